/*
 * test_sentinel_switch.c: the outbox-relay daemon on a redis-sentinel://
 * URL while `SENTINEL FAILOVER` switches the master (sentinel_env.h). The
 * old master stays up and keeps accepting writes until the sentinels
 * reconfigure it as a replica (about 10 s later here): the relay must leave
 * it on the +switch-master event, not on an error. The FAILOVER is asked
 * while the test holds the write lock with the second half of the backlog
 * just written (mid-drain however fast the relay), of a sentinel that sees
 * the replica fit for promotion (se_failover_to), and again if that
 * sentinel aborts it.
 *   1. --wait-replicas 1: a backlog drains through the switch; nothing is
 *      lost on the new master; the relay logged the switch.
 *   2. --idempotent, switching back: the publish script is not on the
 *      promoted replica (NOSCRIPT); the relay loads it again and every row
 *      is on the new master. Lost entries and duplicates are reported:
 *      without --wait-replicas, what the relay appended to the old master
 *      between the replica's promotion and the +switch-master event (the
 *      end of the failover, up to a second or so later) is lost.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "sentinel_env.h"
#include "tap.h"

#define BACKLOG 6000

static sqlite3 *db;
static const char *topic;

static int64_t published(void)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2", topic);
}

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state < 2", topic) == 0;
}

static int running_master(const se_env *e, int node)
{
    return se_wait_master(e, node, 0);
}

static void switch_during_drain(se_env *e, const char *dir, const char *dbpath, int from, int idempotent)
{
    char log[512], *text;
    int to = 1 - from, committed = BACKLOG;
    int64_t last_seq;
    int64_t t_switch, t_named = -1, t_resumed = -1, base;
    pid_t pid;
    redisContext *c;
    rt_audit a;

    snprintf(log, sizeof log, "%s/relay-%s.log", dir, topic);
    rt_insert_rows(db, topic, 0, BACKLOG / 2, topic, 16);
    if (idempotent)
        pid = rt_relay_spawn(log, dbpath, e->url, "--idempotent", "--max-attempts", "100000", "--backoff-min-ms",
                             "50", "--backoff-max-ms", "300", NULL);
    else
        pid = rt_relay_spawn(log, dbpath, e->url, "--wait-replicas", "1", "--wait-timeout-ms", "300",
                             "--max-attempts", "100000", "--backoff-min-ms", "50", "--backoff-max-ms", "300", NULL);
    /* Mid-drain at the FAILOVER, however fast the relay: once it published
     * some of the first half of the backlog, the test takes the write lock
     * (the relay can neither mark nor claim), commits the second half in
     * that transaction and asks for the failover before it lets go: at
     * least half the backlog is then provably left. */
    for (t_switch = th_now_ms(); th_now_ms() - t_switch < 20000 * th_slow() && published() < BACKLOG / 10;)
        th_sleep_ms(5);
    /* The sentinel asked must see node `to` as a replica linked to the
     * master first (after the first switch it learns that from an INFO
     * every 10 s). */
    se_failover_ready(e, 0, to, 30000 * th_slow());
    th_sql_exec(db, "BEGIN IMMEDIATE");
    rt_insert_rows_in_txn(db, topic, BACKLOG / 2, BACKLOG - BACKLOG / 2, topic, 16);
    base = published();
    ok(base > 0 && base < BACKLOG, "%s: SENTINEL FAILOVER mid-drain (%lld of %d published)", topic, (long long)base,
       BACKLOG);
    ok(se_failover_to(e, 0, to, 10000 * th_slow()) == 0, "%s: SENTINEL FAILOVER accepted", topic);
    th_sql_exec(db, "COMMIT");
    t_switch = th_now_ms();
    /* Rows keep coming while the master changes. A failover the sentinel
     * aborted (its promotion not seen within failover-timeout) is asked
     * for again. */
    while (th_now_ms() - t_switch < 30000 * th_slow() && !running_master(e, to)) {
        rt_insert_rows(db, topic, committed, 20, topic, 16);
        committed += 20;
        th_sleep_ms(50);
        if (se_failover_aborted(e, 0, from)) {
            diag("%s: the failover ended without a switch: asking again", topic);
            se_failover_to(e, 0, to, 10000 * th_slow());
        }
    }
    if (running_master(e, to))
        t_named = th_now_ms();
    ok(t_named > 0, "%s: the sentinels name node %d", topic, to);
    last_seq = th_sql_int(db, "SELECT max(seq) FROM outbox_messages");
    /* Resumed: rows committed after the switch are published. */
    rt_insert_rows(db, topic, committed, 20, topic, 0);
    committed += 20;
    while (th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2 AND seq > %lld", topic,
                      (long long)last_seq) == 0 &&
           th_now_ms() - t_switch < 40000 * th_slow())
        th_sleep_ms(10);
    if (th_now_ms() - t_switch < 40000 * th_slow())
        t_resumed = th_now_ms();
    ok(t_resumed > 0, "%s: rows committed after the switch are published", topic);
    ok(th_wait_until(60000 * th_slow(), settled, NULL), "%s: every row settles", topic);
    is_int(th_stop(pid, SIGTERM, 15000), 0, "%s: the relay exits 0 on SIGTERM", topic);

    c = th_redis_client(&e->node[to]);
    a = rt_audit_topic(db, c, "outbox:", topic);
    redisFree(c);
    is_int(a.rows, committed, "%s: %d rows committed", topic, committed);
    is_int(a.unpublished, 0, "%s: every row marked published", topic);
    is_int(a.foreign, 0, "%s: no entry without a row", topic);
    is_int(a.order_violations, 0, "%s: each key's messages in commit order", topic);
    diag("%s: SENTINEL FAILOVER: new master named after %lld ms, marks resumed after %lld ms; on the new master: "
         "%ld entries for %ld rows, %ld lost, %ld duplicates",
         topic, (long long)(t_named - t_switch), (long long)(t_resumed - t_switch), a.entries, a.rows, a.missing,
         a.dups);
    if (!idempotent)
        is_int(a.missing, 0, "%s: with --wait-replicas 1 nothing is lost", topic);
    else
        ok(a.missing <= a.rows - a.unpublished, "%s: only rows marked published can be missing (%ld lost)", topic,
           a.missing);
    text = th_slurp(log);
    ok(strstr(text, "sentinel announced a new master") != NULL, "%s: the relay followed +switch-master", topic);
    if (idempotent)
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 3", topic), 0,
               "%s: no row dead (the script is loaded again on the new master)", topic);
    if (a.missing && !idempotent)
        th_diag_tail("relay", text, 40);
    free(text);
    /* The old master becomes a replica of the new one. */
    ok(se_wait_replica(e, from, 40000 * th_slow()), "%s: node %d is a replica again", topic, from);
}

int main(void)
{
    se_env e;
    char *dir, *dbpath;

    se_world_start(&e, NULL, &dir, &dbpath, &db);

    topic = "acked";
    switch_during_drain(&e, dir, dbpath, 0, 0);
    topic = "idem";
    switch_during_drain(&e, dir, dbpath, 1, 1);

    se_world_end(&e, dir, dbpath, db);
    return tap_done();
}
