/*
 * test_dead.c: poison entries end up in <stream>:dead, so that one cannot
 * block a group. A message whose command always fails is retried
 * max_deliveries times, then copied to the dead stream with the fields of
 * proto/dedup.md and acknowledged; a malformed entry (no envelope, a
 * truncated one, no id, an id that disagrees with its envelope, not msgpack
 * at all) goes there at once, without running the command. Good messages
 * around them are applied.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

static th_redis srv;
static redisContext *rc;
static char *dir;

/* The dead stream's entries as field -> value lookups. */
typedef struct dead {
    redisReply *r;
} dead;

static dead dead_read(const char *stream)
{
    dead d;
    d.r = th_cmd(rc, "XRANGE %s - +", stream);
    if (d.r->type != REDIS_REPLY_ARRAY)
        bail("XRANGE %s", stream);
    return d;
}

static size_t dead_n(const dead *d)
{
    return d->r->elements;
}

/* The value of field in entry i, NULL if absent; *len gets its length. */
static const char *dead_field(const dead *d, size_t i, const char *field, size_t *len)
{
    const redisReply *f = d->r->element[i]->element[1];
    for (size_t k = 0; k + 1 < f->elements; k += 2)
        if (strcmp(f->element[k]->str, field) == 0) {
            if (len)
                *len = f->element[k + 1]->len;
            return f->element[k + 1]->str;
        }
    return NULL;
}

/* The dead entry whose source_entry is eid, or -1. */
static long dead_find(const dead *d, const char *eid)
{
    for (size_t i = 0; i < dead_n(d); i++) {
        const char *s = dead_field(d, i, "source_entry", NULL);
        if (s && strcmp(s, eid) == 0)
            return (long)i;
    }
    return -1;
}

static void test_poison(void)
{
    const char *stream = "outbox:poison";
    char *attempts = th_path(dir, "attempts"), *out, *err, *t, eid[48], good[48];
    char env1[600];
    char *env[] = {env1, NULL};
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--exec",
                          "echo \"$OUTBOX_ID $OUTBOX_DELIVERIES\" >> \"$CT_ATTEMPTS\"; "
                          "test \"$OUTBOX_ID\" = m-good",
                          "--max-deliveries", "2", "--retry-ms", "50", "--drain", NULL};
    size_t envlen, len;
    char *envelope = ct_envelope("m-poison", "poison", "boom", 4, &envlen);
    const char *v;
    dead d;
    long i;
    int st;

    snprintf(env1, sizeof env1, "CT_ATTEMPTS=%s", attempts);
    ct_xadd_fields(rc, stream, eid, 2, "id", "m-poison", (size_t)8, "envelope", envelope, envlen);
    ct_xadd_msg(rc, stream, "m-good", "poison", "fine", 4, good);
    st = ct_consume_run(args, env, &out, &err, 30000 * th_slow());
    is_int(st, 0, "--drain exits 0 once the poison message is dead-lettered");
    t = th_slurp(attempts);
    is_int(ct_line_count(t, "m-poison 1") + ct_line_count(t, "m-poison 2"), 2,
           "the failing command ran max_deliveries (2) times, deliveries 1 and 2");
    is_int(th_count_lines(t), 3, "and no more: 2 failures + 1 good message");
    is_int(ct_line_count(t, "m-good 1"), 1, "the good message was applied once");
    free(t);
    is_int(ct_pending(rc, stream, "g"), 0, "the poison entry is acknowledged in the group");
    d = dead_read("outbox:poison:dead");
    is_int(dead_n(&d), 1, "one entry in outbox:poison:dead");
    i = dead_find(&d, eid);
    ok(i >= 0, "it names the source entry %s", eid);
    if (i >= 0) {
        is_str(dead_field(&d, (size_t)i, "id", NULL), "m-poison", "field id");
        v = dead_field(&d, (size_t)i, "envelope", &len);
        ok(v && len == envlen && memcmp(v, envelope, len) == 0, "field envelope: the original bytes");
        is_str(dead_field(&d, (size_t)i, "group", NULL), "g", "field group");
        is_str(dead_field(&d, (size_t)i, "deliveries", NULL), "3", "field deliveries: 3 (more than 2)");
        v = dead_field(&d, (size_t)i, "reason", NULL);
        ok(v && strstr(v, "max_deliveries"), "field reason says why (%s)", v ? v : "(none)");
    }
    ok(dead_find(&d, good) < 0, "the good message is not there");
    freeReplyObject(d.r);
    {
        char *v2 = ct_get(rc, "dedup:g:{outbox:poison}:m-poison");
        ok(v2 == NULL, "the failed message's dedup key was abandoned (no key left)");
        free(v2);
    }
    if (st != 0)
        th_diag_tail("consume", err, INT_MAX);
    free(out);
    free(err);
    free(attempts);
    free(envelope);
}

static void test_malformed(void)
{
    const char *stream = "outbox:bad";
    char *effects = th_path(dir, "effects-bad"), *out, *err, *t;
    char env1[600];
    char *env[] = {env1, NULL};
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--exec",
                          "echo \"$OUTBOX_ID\" >> \"$CT_EFFECTS\"", "--max-deliveries", "5", "--drain", NULL};
    size_t envlen, otherlen;
    char *envelope = ct_envelope("m-bad", "bad", "payload", 7, &envlen);
    char *other = ct_envelope("m-else", "bad", "payload", 7, &otherlen);
    char e_noenv[48], e_trunc[48], e_noid[48], e_mismatch[48], e_junk[48], e_good1[48], e_good2[48];
    struct {
        const char *what;
        char *eid;
        const char *id;
    } bad[] = {{"no envelope field", e_noenv, "m-noenv"},
               {"truncated msgpack", e_trunc, "m-bad"},
               {"no id field", e_noid, ""},
               {"id field differs from the envelope's", e_mismatch, "m-mismatch"},
               {"not msgpack at all", e_junk, "m-junk"}};
    dead d;
    int st;

    snprintf(env1, sizeof env1, "CT_EFFECTS=%s", effects);
    ct_xadd_msg(rc, stream, "m-good1", "bad", "ok", 2, e_good1);
    ct_xadd_fields(rc, stream, e_noenv, 1, "id", "m-noenv", (size_t)7);
    ct_xadd_fields(rc, stream, e_trunc, 2, "id", "m-bad", (size_t)5, "envelope", envelope, envlen / 2);
    ct_xadd_fields(rc, stream, e_noid, 1, "envelope", envelope, envlen);
    ct_xadd_fields(rc, stream, e_mismatch, 2, "id", "m-mismatch", (size_t)10, "envelope", other, otherlen);
    ct_xadd_fields(rc, stream, e_junk, 2, "id", "m-junk", (size_t)6, "envelope", "{\"json\":1}", (size_t)10);
    ct_xadd_msg(rc, stream, "m-good2", "bad", "ok", 2, e_good2);

    st = ct_consume_run(args, env, &out, &err, 30000 * th_slow());
    is_int(st, 0, "--drain exits 0");
    t = th_slurp(effects);
    is_int(th_count_lines(t), 2, "only the two good messages ran the command");
    ok(ct_line_count(t, "m-good1") == 1 && ct_line_count(t, "m-good2") == 1, "each once");
    free(t);
    is_int(ct_pending(rc, stream, "g"), 0, "every entry acknowledged");
    d = dead_read("outbox:bad:dead");
    is_int(dead_n(&d), 5, "five entries in outbox:bad:dead");
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        long i = dead_find(&d, bad[k].eid);
        const char *dv, *reason, *id, *g;
        ok(i >= 0, "%s: dead-lettered", bad[k].what);
        if (i < 0)
            continue;
        dv = dead_field(&d, (size_t)i, "deliveries", NULL);
        reason = dead_field(&d, (size_t)i, "reason", NULL);
        id = dead_field(&d, (size_t)i, "id", NULL);
        g = dead_field(&d, (size_t)i, "group", NULL);
        ok(dv && strcmp(dv, "1") == 0, "%s: at once (deliveries %s)", bad[k].what, dv ? dv : "(none)");
        ok(reason && strstr(reason, "malformed"), "%s: reason '%s'", bad[k].what, reason ? reason : "(none)");
        ok(id && strcmp(id, bad[k].id) == 0 && g && strcmp(g, "g") == 0 &&
               dead_field(&d, (size_t)i, "envelope", NULL) != NULL,
           "%s: fields id, envelope, group present", bad[k].what);
    }
    freeReplyObject(d.r);
    if (st != 0)
        th_diag_tail("consume", err, INT_MAX);
    free(out);
    free(err);
    free(effects);
    free(envelope);
    free(other);
}

/* A dedup key of the wrong type makes every begin fail with WRONGTYPE:
 * that message is retried and dead-lettered like a failing one, the others
 * go on. */
static void test_wrongtype_key(void)
{
    const char *stream = "outbox:wt";
    char *out, *err, eid[48];
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--print", "--max-deliveries", "2",
                          "--retry-ms", "50", "--drain", NULL};
    dead d;
    long i;
    int st;

    ct_xadd_msg(rc, stream, "m-wt", "wt", "x", 1, eid);
    ct_xadd_msg(rc, stream, "m-fine", "wt", "y", 1, NULL);
    freeReplyObject(th_cmd(rc, "HSET dedup:g:{outbox:wt}:m-wt f v"));
    st = ct_consume_run(args, NULL, &out, &err, 30000 * th_slow());
    is_int(st, 0, "wrong-type dedup key: --drain exits 0");
    ok(!strstr(out, "m-wt") && strstr(out, "m-fine"), "the other message is printed, m-wt is not");
    ok(strstr(err, "WRONGTYPE") != NULL, "the log names WRONGTYPE");
    is_int(ct_pending(rc, stream, "g"), 0, "both acknowledged");
    d = dead_read("outbox:wt:dead");
    i = dead_find(&d, eid);
    ok(dead_n(&d) == 1 && i >= 0, "m-wt dead-lettered after max_deliveries");
    if (i >= 0)
        is_str(dead_field(&d, (size_t)i, "deliveries", NULL), "3", "after 2 deliveries");
    freeReplyObject(d.r);
    free(out);
    free(err);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();

    test_poison();
    test_malformed();
    test_wrongtype_key();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
