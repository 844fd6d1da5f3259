/*
 * idem.c: the pieces of idempotent publishing that do not touch a
 * connection (see idem.h): the script Redis runs, the marker key of a
 * message (always in its stream's Cluster slot), the EVALSHA (or EVAL)
 * call for a batch of one stream, and the reading of the script's reply.
 * The relay's side, which sends these calls and settles the messages, is
 * idem_publish.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay/idem.h"
#include "redis/cluster/slot.h"

/* KEYS[1] the stream, KEYS[2..] the markers; ARGV[1] marker retention in
 * ms, ARGV[2] MAXLEN (0: none), ARGV[3] the database's name ("": none, no
 * db field), then id and envelope per message. A duplicate answers
 * "=<original entry id>". */
const char outbox__idem_lua[] =
    "local out = {}\n"
    "local failed = nil\n"
    "for i = 2, #KEYS do\n"
    "  if failed then\n"
    "    out[#out + 1] = {err = 'HELDBACK an earlier message of this batch failed: ' .. failed}\n"
    "  else\n"
    "    local prev = redis.call('GET', KEYS[i])\n"
    "    if prev then\n"
    "      out[#out + 1] = '=' .. prev\n"
    "    else\n"
    "      local r\n"
    "      local a = {KEYS[1]}\n"
    "      if ARGV[2] ~= '0' then\n"
    "        a[#a + 1] = 'MAXLEN'; a[#a + 1] = '~'; a[#a + 1] = ARGV[2]\n"
    "      end\n"
    "      a[#a + 1] = '*'; a[#a + 1] = 'id'; a[#a + 1] = ARGV[2 * i]\n"
    "      if ARGV[3] ~= '' then\n"
    "        a[#a + 1] = 'db'; a[#a + 1] = ARGV[3]\n"
    "      end\n"
    "      a[#a + 1] = 'envelope'; a[#a + 1] = ARGV[2 * i + 1]\n"
    "      r = redis.pcall('XADD', unpack(a))\n"
    "      if type(r) == 'table' and r.err then\n"
    "        failed = r.err\n"
    "        out[#out + 1] = r\n"
    "      else\n"
    "        redis.call('SET', KEYS[i], r, 'PX', ARGV[1])\n"
    "        out[#out + 1] = r\n"
    "      end\n"
    "    end\n"
    "  end\n"
    "end\n"
    "return out\n";

/* A hash tag (lowercase letters and digits) whose slot is slot: the first
 * in a fixed order, so every relay finds the same. */
static void slot_tag(unsigned slot, char out[8])
{
    static const char alphabet[] = "0123456789abcdefghijklmnopqrstuvwxyz";
    for (size_t len = 1; len <= 5; len++) {
        size_t idx[5] = {0};
        for (;;) {
            size_t i;
            for (i = 0; i < len; i++)
                out[i] = alphabet[idx[i]];
            out[len] = '\0';
            if ((outbox__crc16(out, len) & (OUTBOX__SLOTS - 1)) == slot)
                return;
            for (i = 0; i < len && ++idx[i] == sizeof alphabet - 1; i++)
                idx[i] = 0;
            if (i == len)
                break;
        }
    }
    out[0] = '\0'; /* not reached: 36^4 strings cover every slot */
}

char *outbox__idem_marker(const char *prefix, const char *stream, const char *id, int64_t replay_count)
{
    size_t need = strlen(prefix) + strlen(stream) + strlen(id) + 64, off, n;
    unsigned slot = outbox__key_slot(stream, strlen(stream));
    char *m = malloc(need), tag[8];
    const char *t;
    int len;
    if (!m)
        return NULL;
    len = replay_count > 0 ? snprintf(m, need, "%sidem:{%s}:%s:r%lld", prefix, stream, id, (long long)replay_count)
                           : snprintf(m, need, "%sidem:{%s}:%s", prefix, stream, id);
    if (outbox__key_slot(m, (size_t)len) == slot)
        return m; /* the usual case: no braces in the prefix or the topic */
    /* Braces in the prefix or the topic: the stream's own hashed part as
     * the tag, first in the key, or a tag found for its slot when that part
     * holds a '}'. */
    outbox__key_hashed_part(stream, strlen(stream), &off, &n);
    t = stream + off;
    if (n == 0 || memchr(t, '}', n)) {
        slot_tag(slot, tag);
        t = tag;
        n = strlen(tag);
    }
    if (replay_count > 0)
        snprintf(m, need, "{%.*s}%sidem:%s:%s:r%lld", (int)n, t, prefix, stream, id, (long long)replay_count);
    else
        snprintf(m, need, "{%.*s}%sidem:%s:%s", (int)n, t, prefix, stream, id);
    return m;
}

long outbox__idem_format(char **cmd, const char *sha, const char *prefix, const char *stream, const char *db,
                         uint64_t retention_ms, uint64_t maxlen, const outbox__idem_msg *msgs, size_t n)
{
    size_t argc = 3 + 1 + n + 3 + 2 * n, k = 0, i;
    const char **argv = malloc(argc * sizeof *argv);
    size_t *lens = malloc(argc * sizeof *lens);
    char **owned = calloc(n, sizeof *owned);
    char nkeys[24], ret[24], ml[24];
    long len = -1;

    if (!argv || !lens || !owned)
        goto done;
    snprintf(nkeys, sizeof nkeys, "%zu", n + 1);
    snprintf(ret, sizeof ret, "%llu", (unsigned long long)retention_ms);
    snprintf(ml, sizeof ml, "%llu", (unsigned long long)maxlen);
#define ARG(s, l) (argv[k] = (s), lens[k++] = (l))
    if (sha) {
        ARG("EVALSHA", 7);
        ARG(sha, strlen(sha));
    } else {
        ARG("EVAL", 4);
        ARG(outbox__idem_lua, strlen(outbox__idem_lua));
    }
    ARG(nkeys, strlen(nkeys));
    ARG(stream, strlen(stream));
    for (i = 0; i < n; i++) {
        /* Message ids are unique per database: a group's markers name it. */
        char dbid[600];
        const char *mid = msgs[i].id;
        if (db && *db) {
            snprintf(dbid, sizeof dbid, "%s:%s", db, msgs[i].id);
            mid = dbid;
        }
        if (!(owned[i] = outbox__idem_marker(prefix, stream, mid, msgs[i].replay_count)))
            goto done;
        ARG(owned[i], strlen(owned[i]));
    }
    ARG(ret, strlen(ret));
    ARG(ml, strlen(ml));
    ARG(db ? db : "", db ? strlen(db) : 0);
    for (i = 0; i < n; i++) {
        ARG(msgs[i].id, strlen(msgs[i].id));
        ARG(msgs[i].env, msgs[i].envlen);
    }
#undef ARG
    len = redisFormatCommandArgv(cmd, (int)k, argv, lens);
done:
    if (owned)
        for (i = 0; i < n; i++)
            free(owned[i]);
    free(owned);
    free(argv);
    free(lens);
    return len;
}

outbox__idem_result outbox__idem_element(const redisReply *el, const char **entry, size_t *len)
{
    if (el->type == REDIS_REPLY_STRING || el->type == REDIS_REPLY_STATUS) {
        if (el->len > 0 && el->str[0] == '=') {
            *entry = el->str + 1;
            *len = el->len - 1;
            return OUTBOX_IDEM_DUPLICATE;
        }
        *entry = el->str;
        *len = el->len;
        return OUTBOX_IDEM_APPENDED;
    }
    if (el->type == REDIS_REPLY_ERROR) {
        *entry = el->str;
        *len = el->len;
    } else {
        *entry = "unexpected reply from the publish script";
        *len = strlen(*entry);
    }
    return OUTBOX_IDEM_ERROR;
}
