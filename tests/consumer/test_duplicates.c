/*
 * test_duplicates.c: at-least-once delivery made effectively-once. The same
 * message id appearing twice in a stream (what a relay that crashed between
 * XADD and its mark produces) is handled once and both entries are
 * acknowledged: by one `outbox-consume --print --drain`, and by two
 * `outbox-consume --exec` processes of one group racing for the copies.
 */
#include <signal.h>
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

static void test_print_once(void)
{
    const char *stream = "outbox:dup";
    char e1[48], e2[48], e3[48], *out, *err;
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g1", "--print", "--drain",
                          "--retry-ms", "100", NULL};
    int st;
    char *jsonf = th_path(dir, "dup.jsonl"), *pyout = NULL;
    FILE *f;

    ct_xadd_msg(rc, stream, "m-dup", "dup", "{\"n\":1}", 7, e1);
    ct_xadd_msg(rc, stream, "m-other", "dup", "{\"n\":2}", 7, e2);
    /* The second appearance: same id field, same envelope bytes. */
    {
        redisReply *r = th_cmd(rc, "XRANGE %s %s %s", stream, e1, e1);
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 1)
            bail("XRANGE of the first entry");
        {
            const redisReply *fl = r->element[0]->element[1];
            ct_xadd_fields(rc, stream, e3, 2, fl->element[0]->str, fl->element[1]->str, fl->element[1]->len,
                           fl->element[2]->str, fl->element[3]->str, fl->element[3]->len);
        }
        freeReplyObject(r);
    }
    is_int(th_xlen(rc, stream), 3, "stream holds 3 entries, two of them with id m-dup");

    st = ct_consume_run(args, NULL, &out, &err, 20000 * th_slow());
    is_int(st, 0, "--print --drain exits 0");
    is_int(th_count_lines(out), 2, "two JSON lines for three entries (m-dup once)");
    ok(strstr(out, "\"id\":\"m-dup\"") && strstr(out, "\"id\":\"m-other\""), "both ids printed");
    {
        const char *p = strstr(out, "\"id\":\"m-dup\"");
        ok(p && !strstr(p + 1, "\"id\":\"m-dup\""), "m-dup printed exactly once");
    }
    is_int(ct_pending(rc, stream, "g1"), 0, "XPENDING empty: every entry acknowledged, the duplicate too");
    is_int(th_xlen(rc, "outbox:dup:dead"), 0, "nothing dead-lettered");
    {
        char *v = ct_get(rc, "dedup:g1:{outbox:dup}:m-dup");
        is_str(v, "D", "the dedup key of m-dup (namespace dedup:<group>) is D");
        free(v);
    }
    f = fopen(jsonf, "w");
    if (!f)
        bail("cannot write %s", jsonf);
    fputs(out, f);
    fclose(f);
    {
        char *py[] = {"python3", "-c",
                      "import json,sys\n"
                      "ls=[json.loads(l) for l in open(sys.argv[1])]\n"
                      "print(len(ls), len(set(d['id'] for d in ls)))",
                      jsonf, NULL};
        st = th_run(py, NULL, &pyout, NULL, 20000);
        is_int(st, 0, "the output is JSON lines (python3 json.loads)");
        is_str(pyout, "2 2\n", "two objects, two distinct ids");
    }
    if (st != 0)
        diag("stderr: %s", err);
    free(pyout);
    free(out);
    free(err);
    free(jsonf);

    /* Running again on the same group finds nothing; a new group of the
     * same service namespace finds the messages done and prints nothing. */
    {
        const char *again[] = {"--redis", srv.url, "--stream", stream, "--group", "g2", "--namespace",
                               "dedup:g1", "--print", "--drain", NULL};
        st = ct_consume_run(again, NULL, &out, &err, 20000 * th_slow());
        is_int(st, 0, "another group sharing the namespace: exits 0");
        is_int(th_count_lines(out), 0, "another group sharing the namespace: prints nothing (all DONE)");
        is_int(ct_pending(rc, stream, "g2"), 0, "and acknowledges all three entries");
        free(out);
        free(err);
    }
    /* Without dedup every appearance is handled (at-least-once). */
    {
        const char *none[] = {"--redis", srv.url, "--stream", stream, "--group", "g3", "--dedup", "none", "--print",
                              "--drain", NULL};
        st = ct_consume_run(none, NULL, &out, &err, 20000 * th_slow());
        is_int(st, 0, "--dedup none: exits 0");
        is_int(th_count_lines(out), 3, "--dedup none: all three entries printed, m-dup twice");
        is_int(ct_int(rc, "EXISTS dedup:g3:{outbox:dup}:m-dup"), 0, "--dedup none: no dedup key written");
        is_int(ct_pending(rc, stream, "g3"), 0, "--dedup none: all acknowledged");
        free(out);
        free(err);
    }
}

#define NDUP 100

static void test_two_consumers(void)
{
    const char *stream = "outbox:race";
    char *effects = th_path(dir, "effects"), *log1 = th_path(dir, "c1.log"), *log2 = th_path(dir, "c2.log");
    char envadd[600], *text;
    char *env[] = {envadd, NULL};
    const char *cmd = "sleep 0.01; echo \"$OUTBOX_ID\" >> \"$CT_EFFECTS\"";
    const char *a1[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "c1", "--exec", cmd,
                        "--batch", "5", "--max-inflight", "5", "--retry-ms", "50", "--drain", NULL};
    const char *a2[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "c2", "--exec", cmd,
                        "--batch", "5", "--max-inflight", "5", "--retry-ms", "50", "--drain", NULL};
    pid_t p1, p2;
    int s1, s2, bad = 0, lines;
    long long d1, d2;

    snprintf(envadd, sizeof envadd, "CT_EFFECTS=%s", effects);
    ct_group_create(rc, stream, "g");
    /* Each id twice, the copies next to each other, so that the two
     * consumers' batches split most pairs between them. */
    for (int i = 0; i < NDUP; i++) {
        char id[32];
        snprintf(id, sizeof id, "r-%03d", i);
        ct_xadd_msg(rc, stream, id, "race", id, strlen(id), NULL);
        ct_xadd_msg(rc, stream, id, "race", id, strlen(id), NULL);
    }
    p1 = ct_consume_spawn(a1, env, NULL, log1);
    p2 = ct_consume_spawn(a2, env, NULL, log2);
    if (p1 < 0 || p2 < 0)
        bail("cannot start outbox-consume");
    s1 = th_wait(p1, 60000 * th_slow());
    s2 = th_wait(p2, 60000 * th_slow());
    if (s1 == -2)
        s1 = th_stop(p1, SIGTERM, 5000);
    if (s2 == -2)
        s2 = th_stop(p2, SIGTERM, 5000);
    is_int(s1, 0, "consumer 1 drained and exited 0");
    is_int(s2, 0, "consumer 2 drained and exited 0");
    text = th_slurp(effects);
    lines = th_count_lines(text);
    is_int(lines, NDUP, "%d effects for %d ids in %d entries", lines, NDUP, 2 * NDUP);
    for (int i = 0; i < NDUP; i++) {
        char id[32];
        snprintf(id, sizeof id, "r-%03d", i);
        if (ct_line_count(text, id) != 1 && bad++ < 5)
            diag("%s applied %d times", id, ct_line_count(text, id));
    }
    is_int(bad, 0, "every id applied exactly once");
    is_int(ct_pending(rc, stream, "g"), 0, "all %d entries acknowledged", 2 * NDUP);
    is_int(th_xlen(rc, "outbox:race:dead"), 0, "nothing dead-lettered");
    {
        /* Both really took part: each read some entries. */
        redisReply *r = th_cmd(rc, "XINFO CONSUMERS %s g", stream);
        d1 = d2 = 0;
        ok(r->type == REDIS_REPLY_ARRAY && r->elements == 2, "two consumers in the group");
        freeReplyObject(r);
    }
    {
        char *l1 = th_slurp(log1), *l2 = th_slurp(log2);
        const char *p;
        for (p = l1; (p = strstr(p, "applied=")); p++)
            d1 = atoll(p + 8);
        for (p = l2; (p = strstr(p, "applied=")); p++)
            d2 = atoll(p + 8);
        diag("consumer 1 applied %lld, consumer 2 applied %lld", d1, d2);
        is_int(d1 + d2, NDUP, "the two consumers' applied counts add up to %d", NDUP);
        ok(d1 > 0 && d2 > 0, "both consumers applied some");
        free(l1);
        free(l2);
    }
    free(text);
    free(effects);
    free(log1);
    free(log2);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();

    test_print_once();
    test_two_consumers();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
