/*
 * test_recovery.c: consumers that die. Each scenario leaves a stream entry
 * pending for a consumer that is gone, and checks what a live
 * `outbox-consume` does with it:
 *  - killed after begin, before complete (SIGKILL while its --exec command
 *    runs): the processing key expires after the lease, another consumer
 *    takes the entry over with XAUTOCLAIM and applies it, once;
 *  - killed after complete, before XACK (the key set to D by hand): the
 *    redelivery is recognised as done and acknowledged, not applied;
 *  - a dead consumer's read-but-unacknowledged entries: recovered with
 *    XAUTOCLAIM, each applied once, with the group's delivery count.
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

typedef struct lines_arg {
    const char *path;
    int want;
} lines_arg;

static int has_lines(void *arg)
{
    lines_arg *a = arg;
    char *t = th_slurp(a->path);
    int n = th_count_lines(t);
    free(t);
    return n >= a->want;
}

typedef struct pend_arg {
    const char *stream, *group;
} pend_arg;

static int nothing_pending(void *arg)
{
    pend_arg *a = arg;
    return ct_pending(rc, a->stream, a->group) == 0;
}

static void test_killed_mid_effect(void)
{
    const char *stream = "outbox:crash";
    const char *key = "dedup:g:{outbox:crash}:m-crash";
    char *pidfile = th_path(dir, "sleep.pid"), *effects = th_path(dir, "effects3"), *loga = th_path(dir, "a.log"),
         *logb = th_path(dir, "b.log");
    char env1[600], env2[600];
    char *enva[] = {env1, NULL}, *envb[] = {env2, NULL};
    /* The shell writes its pid and becomes `sleep`: the pid is the
     * command's, so it can be stopped by pid after its parent is killed. */
    const char *aa[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "A", "--exec",
                        "echo $$ > \"$CT_PIDFILE.tmp\" && mv \"$CT_PIDFILE.tmp\" \"$CT_PIDFILE\" && exec sleep 30",
                        "--dedup-lease-ms", "2000", NULL};
    const char *ab[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "B", "--exec",
                        "echo \"$OUTBOX_ID $OUTBOX_DELIVERIES\" >> \"$CT_EFFECTS\"", "--dedup-lease-ms", "2000",
                        "--min-idle-ms", "100", "--claim-interval-ms", "100", "--retry-ms", "100", NULL};
    pid_t a, b;
    long long pttl;
    int64_t expires_at, applied_at;
    char *v, *t, *log;
    lines_arg la = {pidfile, 1}, le = {effects, 1};
    pend_arg pa = {stream, "g"};
    long sleep_pid = 0;

    snprintf(env1, sizeof env1, "CT_PIDFILE=%s", pidfile);
    snprintf(env2, sizeof env2, "CT_EFFECTS=%s", effects);
    ct_xadd_msg(rc, stream, "m-crash", "crash", "pay", 3, NULL);
    a = ct_consume_spawn(aa, enva, NULL, loga);
    if (a < 0)
        bail("cannot start consumer A");
    ok(th_wait_until(10000 * th_slow(), has_lines, &la), "consumer A started the command");
    t = th_slurp(pidfile);
    sleep_pid = atol(t);
    free(t);
    kill(a, SIGKILL);
    is_int(th_wait(a, 5000), 128 + SIGKILL, "consumer A killed with SIGKILL mid-effect");
    if (sleep_pid > 1)
        kill((pid_t)sleep_pid, SIGKILL);
    pttl = ct_int(rc, "PTTL %s", key);
    expires_at = th_now_ms() + pttl;
    v = ct_get(rc, key);
    ok(v && strncmp(v, "P:", 2) == 0, "A left its processing key behind (%s)", v ? v : "nil");
    free(v);
    ok(pttl > 0 && pttl <= 2000, "the processing key expires with A's lease (PTTL %lld)", pttl);
    is_int(ct_pending_for(rc, stream, "g", "A"), 1, "the entry is pending for the dead consumer A");

    b = ct_consume_spawn(ab, envb, NULL, logb);
    if (b < 0)
        bail("cannot start consumer B");
    ok(th_wait_until(15000 * th_slow(), has_lines, &le), "consumer B applied the message");
    applied_at = th_now_ms();
    ok(applied_at >= expires_at - 50, "not before A's lease ended (%lld ms after its end)",
       (long long)(applied_at - expires_at));
    ok(th_wait_until(5000 * th_slow(), nothing_pending, &pa), "the entry is acknowledged");
    th_sleep_ms(300); /* time for a wrong second application */
    is_int(th_stop(b, SIGTERM, 10000), 0, "consumer B stops on SIGTERM with status 0");
    t = th_slurp(effects);
    is_int(th_count_lines(t), 1, "applied exactly once");
    ok(strncmp(t, "m-crash ", 8) == 0, "the effect is m-crash's (%.*s)", (int)strcspn(t, "\n"), t);
    free(t);
    v = ct_get(rc, key);
    is_str(v, "D", "the key is D now");
    free(v);
    is_int(th_xlen(rc, "outbox:crash:dead"), 0, "not dead-lettered while A's lease ran out");
    log = th_slurp(logb);
    ok(strstr(log, "recovered an idle pending entry") != NULL, "B says it recovered an idle entry");
    if (th_xlen(rc, "outbox:crash:dead") != 0)
        th_diag_tail("B", log, INT_MAX);
    free(log);
    free(pidfile);
    free(effects);
    free(loga);
    free(logb);
}

static void test_killed_before_ack(void)
{
    const char *stream = "outbox:acked";
    char *effects = th_path(dir, "effects4"), *logc = th_path(dir, "c4.log");
    char env1[600];
    char *env[] = {env1, NULL};
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "C", "--exec",
                          "echo \"$OUTBOX_ID\" >> \"$CT_EFFECTS\"", "--min-idle-ms", "100", "--claim-interval-ms",
                          "100", "--log-level", "debug", NULL};
    pend_arg pa = {stream, "g"};
    pid_t c;
    char *t;

    snprintf(env1, sizeof env1, "CT_EFFECTS=%s", effects);
    ct_xadd_msg(rc, stream, "m-done", "acked", "x", 1, NULL);
    ct_xadd_msg(rc, stream, "m-new", "acked", "y", 1, NULL);
    ct_group_create(rc, stream, "g");
    is_int(ct_read_as(rc, stream, "g", "ghost", 1), 1, "ghost read m-done and died before XACK");
    /* What complete leaves behind. */
    freeReplyObject(th_cmd(rc, "SET dedup:g:{outbox:acked}:m-done D PX 600000"));
    th_sleep_ms(150);
    c = ct_consume_spawn(args, env, NULL, logc);
    if (c < 0)
        bail("cannot start consumer C");
    ok(th_wait_until(10000 * th_slow(), nothing_pending, &pa), "both entries acknowledged");
    th_sleep_ms(200);
    is_int(th_stop(c, SIGTERM, 10000), 0, "consumer C stops with status 0");
    t = th_slurp(effects);
    is_int(ct_line_count(t, "m-done"), 0, "m-done (already done) not applied again");
    is_int(ct_line_count(t, "m-new"), 1, "m-new applied once");
    free(t);
    is_int(ct_pending_for(rc, stream, "g", "ghost"), 0, "nothing left pending for ghost");
    is_int(th_xlen(rc, "outbox:acked:dead"), 0, "nothing dead-lettered");
    t = th_slurp(logc);
    ok(strstr(t, "duplicate skipped") && strstr(t, "id=m-done"), "C logs the duplicate as skipped");
    free(t);
    free(effects);
    free(logc);
}

#define NREC 20

static void test_autoclaim(void)
{
    const char *stream = "outbox:ghost";
    char *effects = th_path(dir, "effects6"), *logd = th_path(dir, "d6.log");
    char env1[600], idle[16];
    char *env[] = {env1, NULL};
    /* Longer than D's own handling of an entry takes, under valgrind too:
     * an entry D holds that goes idle for longer is claimed again, by D
     * itself, and its delivery count grows. */
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--consumer", "D", "--exec",
                          "echo \"$OUTBOX_ID $OUTBOX_DELIVERIES\" >> \"$CT_EFFECTS\"", "--min-idle-ms", idle,
                          "--claim-interval-ms", "100", NULL};
    pend_arg pa = {stream, "g"};
    lines_arg le = {effects, NREC};
    pid_t d;
    char *t;
    int bad = 0, recovered = 0;

    snprintf(env1, sizeof env1, "CT_EFFECTS=%s", effects);
    snprintf(idle, sizeof idle, "%d", 100 * th_slow());
    for (int i = 0; i < NREC; i++) {
        char id[16];
        snprintf(id, sizeof id, "g-%02d", i);
        ct_xadd_msg(rc, stream, id, "ghost", id, strlen(id), NULL);
    }
    ct_group_create(rc, stream, "g");
    is_int(ct_read_as(rc, stream, "g", "ghost", NREC / 2), NREC / 2, "ghost read %d entries and died", NREC / 2);
    d = ct_consume_spawn(args, env, NULL, logd);
    if (d < 0)
        bail("cannot start consumer D");
    ok(th_wait_until(15000 * th_slow(), has_lines, &le), "all %d messages applied", NREC);
    ok(th_wait_until(5000 * th_slow(), nothing_pending, &pa), "nothing pending in the group");
    th_sleep_ms(300);
    is_int(th_stop(d, SIGTERM, 10000), 0, "consumer D stops with status 0");
    t = th_slurp(effects);
    is_int(th_count_lines(t), NREC, "exactly %d effects", NREC);
    for (int i = 0; i < NREC; i++) {
        char line[32];
        /* The ghost's entries come back as second deliveries. */
        snprintf(line, sizeof line, "g-%02d %d", i, i < NREC / 2 ? 2 : 1);
        if (ct_line_count(t, line) != 1 && bad++ < 5)
            diag("no single '%s' in the effects", line);
    }
    is_int(bad, 0, "each applied once, the recovered ones with OUTBOX_DELIVERIES=2");
    free(t);
    is_int(ct_pending_for(rc, stream, "g", "ghost"), 0, "nothing left pending for ghost");
    t = th_slurp(logd);
    for (const char *p = t; (p = strstr(p, "recovered an idle pending entry")); p++)
        recovered++;
    is_int(recovered, NREC / 2, "D recovered the ghost's %d entries", NREC / 2);
    free(t);
    free(effects);
    free(logd);
}

static int log_has(void *arg)
{
    const char **a = arg;
    char *t = th_slurp(a[0]);
    int yes = strstr(t, a[1]) != NULL;
    free(t);
    return yes;
}

static void acl(const char *rule)
{
    redisReply *r = th_cmd(rc, "ACL SETUSER default %s", rule);
    if (r->type == REDIS_REPLY_ERROR)
        bail("ACL SETUSER default %s: %s", rule, r->str);
    freeReplyObject(r);
}

/* A Redis error answering the group creation or a read (here NOPERM while
 * an ACL rule forbids the command; LOADING or MISCONF in real life) is
 * retried; it does not end the consumer's reading for good. */
static void test_read_errors(void)
{
    const char *stream = "outbox:acl";
    char *out = th_path(dir, "acl.out"), *log = th_path(dir, "acl.log");
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "g", "--print", "--block-ms", "100",
                          "--claim-interval-ms", "100", NULL};
    const char *no_group[] = {log, "cannot create the consumer group"}, *no_read[] = {log, "XREADGROUP failed"};
    lines_arg one = {out, 1}, two = {out, 2};
    pid_t p;

    acl("-xgroup");
    p = ct_consume_spawn(args, NULL, out, log);
    if (p < 0)
        bail("cannot start outbox-consume");
    ok(th_wait_until(5000 * th_slow(), log_has, no_group), "XGROUP CREATE refused (NOPERM) and logged");
    acl("+xgroup");
    ct_xadd_msg(rc, stream, "m-acl-1", "acl", "1", 1, NULL);
    ok(th_wait_until(5000 * th_slow(), has_lines, &one), "once allowed, the group is created and the message printed");
    acl("-xreadgroup");
    ok(th_wait_until(5000 * th_slow(), log_has, no_read), "XREADGROUP refused (NOPERM) and logged");
    acl("+xreadgroup");
    ct_xadd_msg(rc, stream, "m-acl-2", "acl", "2", 1, NULL);
    ok(th_wait_until(5000 * th_slow(), has_lines, &two), "once allowed again, reading resumes");
    is_int(th_stop(p, SIGTERM, 10000), 0, "stops with status 0");
    free(out);
    free(log);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();

    test_killed_mid_effect();
    test_killed_before_ack();
    test_autoclaim();
    test_read_errors();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
