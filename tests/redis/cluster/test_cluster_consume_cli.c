/*
 * test_cluster_consume_cli.c: outbox-consume --print on a redis-cluster://
 * URL (cluster_env.h: 3 masters with a replica each) through a reshard of
 * its stream's slot: a writer thread XADDs all along while the slot is
 * moved with `redis-cli --cluster reshard`, and then again by hand with the
 * ASK window held open (the stream MIGRATEd first, its dedup keys after).
 * Every message written is printed exactly once, nothing is left pending on
 * the stream's new owner, and a SIGTERM stops the tool with status 0.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../consumer/ct.h"
#include "cluster_env.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define MAXMSG 20000
#define GROUP "gc"

static ce_env env;
static char stream[64];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int written, writer_failed;
static volatile int stop_writing;

static int write_one(int i)
{
    char id[32];
    size_t len;
    char *envl;
    const char *argv[7];
    size_t lens[7];
    redisReply *r;
    int good;
    snprintf(id, sizeof id, "c-%d", i);
    envl = ct_envelope(id, "orders", "x", 1, &len);
    argv[0] = "XADD", lens[0] = 4;
    argv[1] = stream, lens[1] = strlen(stream);
    argv[2] = "*", lens[2] = 1;
    argv[3] = "id", lens[3] = 2;
    argv[4] = id, lens[4] = strlen(id);
    argv[5] = "envelope", lens[5] = 8;
    argv[6] = envl, lens[6] = len;
    r = ce_cmd_argv(&env, stream, 7, argv, lens, 20000);
    good = r && r->type == REDIS_REPLY_STRING;
    if (!good)
        diag("writer: XADD %s: %s", id, r && r->type == REDIS_REPLY_ERROR ? r->str : "no answer");
    if (r)
        freeReplyObject(r);
    free(envl);
    return good;
}

static void *writer(void *arg)
{
    (void)arg;
    for (int i = 0; i < MAXMSG && !stop_writing; i++) {
        if (!write_one(i)) {
            writer_failed = 1;
            break;
        }
        pthread_mutex_lock(&mu);
        written = i + 1;
        pthread_mutex_unlock(&mu);
        th_sleep_ms(3);
    }
    return NULL;
}

/* How often "id":"c-<i>" is in text. */
static int printed(const char *text, int i)
{
    char needle[48];
    int n = 0;
    snprintf(needle, sizeof needle, "\"id\":\"c-%d\"", i);
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    return n;
}

int main(void)
{
    char *dir, *out, *errp, *text = NULL, blocks[16];
    int m[CE_MAX_NODES], from, slot, missing = -1, twice = 0, n;
    pid_t pid;
    pthread_t wt;
    int64_t deadline;

    if (ce_start(&env, 3, 1, 0, NULL) != 0)
        skip_all("cannot start a cluster of 3 masters with a replica each");
    ce_master_list(&env, m);
    from = m[0];
    slot = ce_lowest_slot(&env, from);
    if (ce_name_in_slot(&env, slot, "outbox:cli-", stream, sizeof stream) != 0)
        bail("no stream name in slot %d", slot);
    dir = th_tmpdir();
    out = th_path(dir, "consume.out");
    errp = th_path(dir, "consume.err");
    snprintf(blocks, sizeof blocks, "%d", 200);
    {
        const char *args[] = {"--redis", env.url, "--stream", stream, "--group", GROUP, "--print",
                              "--block-ms", blocks, "--min-idle-ms", "1000", "--claim-interval-ms", "300",
                              "--retry-ms", "100", "--max-deliveries", "1000", "--log-level", "warn", NULL};
        pid = ct_consume_spawn(args, NULL, out, errp);
    }
    ok(pid > 0, "outbox-consume started on %s", env.url);
    pthread_create(&wt, NULL, writer, NULL);
    th_sleep_ms(800);
    is_int(ce_reshard(&env, from, m[1], 1), 0, "redis-cli --cluster reshard of the stream's slot %d", slot);
    is_int(ce_owner(&env, stream), m[1], "the stream is on node %d now", m[1]);
    th_sleep_ms(800);
    is_int(ce_migrate_begin(&env, slot, m[2], 0), 0, "a manual migration of the slot to node %d begins", m[2]);
    is_int(ce_migrate_named(&env, stream), 1, "the stream MIGRATEd first");
    th_sleep_ms(1500);
    ok(ce_migrate_keys(&env, 20) >= 0, "some of its dedup keys follow");
    th_sleep_ms(500);
    is_int(ce_migrate_finish(&env), 0, "the rest, and SETSLOT NODE on every master");
    is_int(ce_owner(&env, stream), m[2], "the stream is on node %d now", m[2]);
    th_sleep_ms(800);
    stop_writing = 1;
    pthread_join(wt, NULL);
    is_int(writer_failed, 0, "the writer got every XADD accepted (%d messages)", written);

    deadline = th_now_ms() + 30000 * th_slow();
    do {
        free(text);
        text = th_slurp(out);
        missing = 0;
        for (int i = 0; i < written; i++)
            missing += printed(text, i) == 0;
        if (missing)
            th_sleep_ms(100);
    } while (missing && th_now_ms() < deadline);
    is_int(missing, 0, "every one of the %d messages printed", written);
    th_sleep_ms(500);
    free(text);
    text = th_slurp(out);
    for (int i = 0; i < written; i++)
        twice += printed(text, i) > 1;
    is_int(twice, 0, "none printed twice");
    n = th_count_lines(text);
    is_int(n, written, "one line per message");
    {
        redisContext *c = ce_client(&env, ce_owner(&env, stream));
        ok(c != NULL, "the stream's owner answers");
        if (c) {
            is_int(ct_pending(c, stream, GROUP), 0, "nothing pending on it");
            redisFree(c);
        }
    }
    is_int(th_stop(pid, SIGTERM, 10000), 0, "outbox-consume exits 0 on SIGTERM");
    if (missing || twice) {
        char *log = th_slurp(errp);
        th_diag_tail("outbox-consume", log, 40);
        free(log);
    }
    free(text);
    free(out);
    free(errp);
    th_rmtree(dir);
    free(dir);
    ce_stop(&env);
    return tap_done();
}
