/*
 * reader.c: the stream reader of the latency and sustained scenarios (see
 * bench_reader in bench.h): one thread in XREAD BLOCK over every bench
 * topic, noting when it first saw each measured message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* Notes one stream entry: its id field names the message's seq. */
static void note_entry(bench_reader *x, const redisReply *fields, int64_t entry_ms, int64_t now)
{
    size_t plen = strlen(x->id_prefix);
    for (size_t k = 0; k + 1 < fields->elements; k += 2) {
        const char *id;
        uint64_t seq;
        if (strcmp(fields->element[k]->str, "id") != 0)
            continue;
        id = fields->element[k + 1]->str;
        if (strncmp(id, x->id_prefix, plen) != 0)
            return;
        seq = strtoull(id + plen, NULL, 10);
        if (seq <= x->n && x->seen_us[seq] == 0) {
            x->seen_us[seq] = now;
            if (x->entry_ms)
                x->entry_ms[seq] = entry_ms;
            __atomic_add_fetch(&x->seen, 1, __ATOMIC_RELEASE);
        }
        return;
    }
}

void *bench_reader_main(void *arg)
{
    bench_reader *x = arg;
    redisContext *c = bench_redis_connect(x->b);
    char names[BENCH_TOPICS][32], last[BENCH_TOPICS][48], count[16];
    const char *argv[6 + 2 * BENCH_TOPICS];
    int i;

    if (!c) {
        snprintf(x->err, sizeof x->err, "reader cannot connect to Redis");
        return NULL;
    }
    snprintf(count, sizeof count, "%u", x->count);
    for (i = 0; i < BENCH_TOPICS; i++) {
        snprintf(names[i], sizeof names[i], "outbox:bench.t%d", i);
        snprintf(last[i], sizeof last[i], "0-0");
    }
    while (!__atomic_load_n(&x->stop, __ATOMIC_ACQUIRE)) {
        int a = 0;
        redisReply *r;
        int64_t now;
        argv[a++] = "XREAD";
        argv[a++] = "COUNT";
        argv[a++] = count;
        argv[a++] = "BLOCK";
        argv[a++] = "100";
        argv[a++] = "STREAMS";
        for (i = 0; i < BENCH_TOPICS; i++)
            argv[a++] = names[i];
        for (i = 0; i < BENCH_TOPICS; i++)
            argv[a++] = last[i];
        r = redisCommandArgv(c, a, argv, NULL);
        now = bench_wall_us();
        if (!r) {
            snprintf(x->err, sizeof x->err, "reader: connection lost");
            break;
        }
        for (size_t s = 0; r->type == REDIS_REPLY_ARRAY && s < r->elements; s++) {
            redisReply *sr = r->element[s], *entries;
            int si = -1;
            if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2)
                continue;
            for (i = 0; i < BENCH_TOPICS; i++)
                if (!strcmp(sr->element[0]->str, names[i]))
                    si = i;
            entries = sr->element[1];
            if (si < 0 || entries->type != REDIS_REPLY_ARRAY)
                continue;
            for (size_t e = 0; e < entries->elements; e++) {
                redisReply *en = entries->element[e];
                if (en->type != REDIS_REPLY_ARRAY || en->elements != 2)
                    continue;
                snprintf(last[si], sizeof last[si], "%s", en->element[0]->str);
                note_entry(x, en->element[1], strtoll(en->element[0]->str, NULL, 10), now);
            }
        }
        freeReplyObject(r);
    }
    redisFree(c);
    return NULL;
}
