/*
 * test_cluster_relay.c: the outbox-relay daemon on a redis-cluster:// URL
 * (3 masters with a replica each, cluster_env.h), draining 8 topics, 4 keyed
 * and 4 unkeyed, spread over the masters:
 *   1. --drain end to end: every committed row in its stream (read on the
 *      node that owns it), none of a rolled-back transaction, per-key order;
 *      /metrics-free checks of the stream placement (a topic on each master).
 *   2. The same while the cluster changes under a running relay, in three
 *      runs (plain, --idempotent, --wait-replicas 1), each with fresh
 *      topics: the busy streams' slots are resharded (redis-cli --cluster
 *      reshard), one slot is moved by hand with the ASK window held open
 *      for a second (SETSLOT MIGRATING/IMPORTING, the stream MIGRATEd
 *      first), a replica takes over with CLUSTER FAILOVER, and a master is
 *      SIGKILLed (the CLUSTERDOWN window: with the default
 *      cluster-require-full-coverage yes every node refuses meanwhile).
 *      In the plain and idempotent runs the killed master holds none of
 *      the run's streams: an entry that a dying master acknowledged and had
 *      not replicated is lost, the documented window that --wait-replicas
 *      closes; the --wait-replicas 1 run kills the master of busy streams.
 *      After the final drain: every committed row at least once, per-key
 *      order, duplicates counted and printed (none with --idempotent).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bg_writer.h"
#include "cluster_env.h"
#include "harness.h"
#include "ops.h"
#include "rt.h"
#include "tap.h"

#define TOPICS 8
#define ROWS 600 /* per topic and run */

static ce_env env;
static sqlite3 *db;
static char *dir, *dbpath;

/* Topic names: <run><i> chosen so that the streams spread over the masters:
 * topic i in the lowest slot of master i % 3 (the lowest slots are the ones
 * a reshard moves first), so that every master holds busy streams. */
static char streams[TOPICS][80];
static const char *topics[TOPICS]; /* streams[i] without "outbox:" */

static void pick_topics(const char *run)
{
    int masters[CE_MAX_NODES], nm = ce_master_list(&env, masters);
    for (int i = 0; i < TOPICS; i++) {
        char prefix[32];
        int slot = ce_lowest_slot(&env, masters[i % nm]) + i / nm;
        snprintf(prefix, sizeof prefix, "outbox:%.8s%d-", run, i);
        if (ce_name_in_slot(&env, slot, prefix, streams[i], sizeof streams[i]) != 0)
            bail("no name in slot %d", slot);
        topics[i] = streams[i] + strlen("outbox:");
    }
}

static void insert_all(int first, int n)
{
    for (int i = 0; i < TOPICS; i++)
        rt_insert_rows(db, topics[i], first, n, topics[i], i % 2 == 0 ? 5 : 0);
}

/* A transaction that rolls back: its rows must never reach a stream. */
static void rolled_back(void)
{
    th_sql_exec(db, "BEGIN");
    for (int i = 0; i < TOPICS; i++)
        th_sql_exec(db, "INSERT INTO outbox(id, topic, key, payload) VALUES ('rolledback-%d', %Q, 'k1', x'00')", i,
                    topics[i]);
    th_sql_exec(db, "ROLLBACK");
}

static bg_writer writer;

static int64_t unsettled(void)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2");
}

static int settled(void *arg)
{
    (void)arg;
    return unsettled() == 0;
}

/* Audits each topic on the node that owns its stream now; returns the
 * duplicates. */
static long audit(const char *what, int want_no_dups)
{
    long dups = 0, missing = 0, order = 0, foreign = 0, rolled = 0;
    for (int i = 0; i < TOPICS; i++) {
        const char *stream;
        int owner;
        redisContext *c;
        rt_audit a;
        rt_stream s;
        stream = streams[i];
        owner = ce_owner(&env, stream);
        c = owner >= 0 ? ce_client(&env, owner) : NULL;
        if (!c) {
            ok(0, "%s: the owner of %s answers", what, stream);
            continue;
        }
        a = rt_audit_topic(db, c, "outbox:", topics[i]);
        s = rt_stream_read(c, stream);
        for (size_t j = 0; j < s.n; j++)
            if (s.e[j].id && strncmp(s.e[j].id, "rolledback-", 11) == 0)
                rolled++;
        rt_stream_free(&s);
        dups += a.dups;
        missing += a.missing + a.dead;
        order += a.order_violations;
        foreign += a.foreign;
        if (a.rows == 0)
            ok(0, "%s: %s has rows", what, topics[i]);
        redisFree(c);
    }
    is_int(missing, 0, "%s: every committed row is in its stream (none dead)", what);
    is_int(order, 0, "%s: per-key order held in every keyed stream", what);
    is_int(rolled, 0, "%s: nothing of the rolled-back transaction", what);
    is_int(foreign, 0, "%s: no entry without a row", what);
    diag("%s: %ld duplicates", what, dups);
    if (want_no_dups)
        is_int(dups, 0, "%s: no duplicates", what);
    return dups;
}

static void test_drain(void)
{
    char *err = NULL;
    int rc, masters[CE_MAX_NODES], nm = ce_master_list(&env, masters), on[CE_MAX_NODES] = {0}, spread = 0;
    pick_topics("d");
    insert_all(0, ROWS);
    rolled_back();
    for (int i = 0; i < TOPICS; i++) {
        const char *stream;
        stream = streams[i];
        on[ce_owner(&env, stream)] = 1;
    }
    for (int i = 0; i < nm; i++)
        spread += on[masters[i]];
    is_int(spread, 3, "drain: the 8 streams are on all 3 masters");
    rc = rt_relay_run(60000 * th_slow(), &err, dbpath, env.url, "--drain", NULL);
    is_int(rc, 0, "drain: outbox-relay --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    free(err);
    is_int(unsettled(), 0, "drain: every row settled");
    audit("drain", 0);
}

/* The master to kill: in the plain and idempotent runs one that holds none
 * of the run's streams (there is none with 8 streams on 3 masters after
 * the reshard: then the one holding the fewest), in the --wait-replicas run
 * the one holding the most. */
static int victim(int most)
{
    int masters[CE_MAX_NODES], nm = ce_master_list(&env, masters), best = -1, best_n = 0;
    for (int k = 0; k < nm; k++) {
        int n = 0;
        for (int i = 0; i < TOPICS; i++) {
            const char *stream;
            stream = streams[i];
            n += ce_owner(&env, stream) == masters[k];
        }
        if (best < 0 || (most ? n > best_n : n < best_n)) {
            best = masters[k];
            best_n = n;
        }
    }
    diag("killing master %d (holds %d of the streams)", best, best_n);
    return best;
}

static int64_t published_now(void)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
}

/* Waits until at least n more rows are published (up to 20 s). */
static void wait_progress(int64_t n)
{
    int64_t base = published_now(), end = th_now_ms() + 20000 * th_slow();
    while (published_now() < base + n && th_now_ms() < end)
        th_sleep_ms(20);
}

static void test_faults(const char *run, const char *mode)
{
    char log[512], what[64], listen[32];
    int masters[CE_MAX_NODES], nm, k, r, from, to, slot, mport;
    pid_t pid;
    const char *stream;

    snprintf(what, sizeof what, "%s run", run);
    pick_topics(run);
    insert_all(0, ROWS);
    rolled_back();
    snprintf(log, sizeof log, "%s/relay-%s.log", dir, run);
    mport = th_free_port();
    snprintf(listen, sizeof listen, "127.0.0.1:%d", mport);
    if (strcmp(mode, "idempotent") == 0)
        pid = rt_relay_spawn(log, dbpath, env.url, "--idempotent", "--max-attempts", "100000", "--backoff-min-ms",
                             "50", "--backoff-max-ms", "300", "--batch", "64", "--metrics-listen", listen, NULL);
    else if (strcmp(mode, "wait") == 0)
        pid = rt_relay_spawn(log, dbpath, env.url, "--wait-replicas", "1", "--wait-timeout-ms", "500",
                             "--max-attempts", "100000", "--backoff-min-ms", "50", "--backoff-max-ms", "300",
                             "--batch", "64", "--metrics-listen", listen, NULL);
    else
        pid = rt_relay_spawn(log, dbpath, env.url, "--max-attempts", "100000", "--backoff-min-ms", "50",
                             "--backoff-max-ms", "300", "--batch", "64", "--metrics-listen", listen, NULL);
    wait_progress(200);
    bg_writer_start(&writer, dbpath, topics, TOPICS, 1, "w");

    /* 1. A reshard of the busy streams' slots: the lowest 20 slots of a
     *    master (topic 0's stream among them) go to the next master. */
    nm = ce_master_list(&env, masters);
    stream = streams[0];
    from = ce_owner(&env, stream);
    for (k = 0; k < nm && masters[k] != from; k++)
        ;
    to = masters[(k + 1) % nm];
    insert_all(ROWS, ROWS / 2);
    is_int(ce_reshard(&env, from, to, 20), 0, "%s: reshard of 20 slots under the relay", what);
    is_int(ce_owner(&env, stream), to, "%s: topic 0's stream moved", what);
    wait_progress(200);

    /* 2. The ASK window held open: topic 1's slot migrates, its stream
     *    first, the other keys of the slot (markers) later. */
    stream = streams[1];
    slot = ce_slot_of(&env, stream);
    from = ce_owner(&env, stream);
    nm = ce_master_list(&env, masters);
    for (k = 0; k < nm && masters[k] != from; k++)
        ;
    to = masters[(k + 1) % nm];
    is_int(ce_migrate_begin(&env, slot, to, 0), 0, "%s: migration of slot %d begun", what, slot);
    ok(ce_migrate_named(&env, stream) >= 0, "%s: the stream MIGRATEd first", what);
    insert_all(ROWS + ROWS / 2, ROWS / 4);
    th_sleep_ms(1000);
    is_int(ce_migrate_finish(&env), 0, "%s: migration finished", what);
    wait_progress(100);

    /* 2b. Idempotent run: the script is flushed on every master (NOSCRIPT
     *     from each node: the relay loads it there and resends). */
    if (strcmp(mode, "idempotent") == 0) {
        int flushed = 0;
        nm = ce_master_list(&env, masters);
        for (k = 0; k < nm; k++) {
            redisContext *c = ce_client(&env, masters[k]);
            redisReply *rep = c ? redisCommand(c, "SCRIPT FLUSH") : NULL;
            flushed += rep && rep->type == REDIS_REPLY_STATUS;
            if (rep)
                freeReplyObject(rep);
            if (c)
                redisFree(c);
        }
        is_int(flushed, nm, "%s: SCRIPT FLUSH on every master", what);
        wait_progress(300);
    }

    /* 3. CLUSTER FAILOVER of the master of topic 2's stream. */
    stream = streams[2];
    r = ce_replica_of(&env, ce_owner(&env, stream));
    ok(r >= 0 && ce_failover(&env, r) == 0, "%s: CLUSTER FAILOVER on replica %d", what, r);
    insert_all(ROWS + ROWS / 2 + ROWS / 4, ROWS / 4);
    wait_progress(100);

    /* 4. A master killed: the CLUSTERDOWN window, then its replica. */
    {
        int v = victim(strcmp(mode, "wait") == 0);
        int promoted = ce_kill_master(&env, v);
        ok(promoted >= 0, "%s: master %d killed, replica %d promoted", what, v, promoted);
        insert_all(2 * ROWS, ROWS / 4);
        th_sleep_ms(500);
        diag("%s: the writer committed %d rows while the cluster changed", what, bg_writer_stop(&writer));
        is_int(ce_restart(&env, v), 0, "%s: the killed node is back (as a replica)", what);
    }

    ok(th_wait_until(90000 * th_slow(), settled, NULL), "%s: every row settled after the faults (%lld left)", what,
       (long long)unsettled());
    {
        char *m = NULL;
        int st = ot_http_get(mport, "/metrics", &m);
        is_int(st, 200, "%s: /metrics answers", what);
        ok(ot_prom_sum(m, "outbox_redis_node_moved_total", NULL) > 0, "%s: MOVED redirections counted (%.0f)", what,
           ot_prom_sum(m, "outbox_redis_node_moved_total", NULL));
        ok(ot_prom_sum(m, "outbox_redis_slot_map_refreshes_total", NULL) > 1, "%s: slot map refreshed (%.0f times)", what,
           ot_prom_sum(m, "outbox_redis_slot_map_refreshes_total", NULL));
        ok(ot_prom_sum(m, "outbox_redis_node_connected", NULL) >= 3, "%s: connected to the masters (%.0f nodes)", what,
           ot_prom_sum(m, "outbox_redis_node_connected", NULL));
        diag("%s: ask %.0f, tryagain/clusterdown %.0f, node errors %.0f", what,
             ot_prom_sum(m, "outbox_redis_node_ask_total", NULL), ot_prom_sum(m, "outbox_redis_node_tryagain_total", NULL),
             ot_prom_sum(m, "outbox_redis_node_errors_total", NULL));
        free(m);
    }
    is_int(th_stop(pid, SIGTERM, 20000), 0, "%s: the relay stops cleanly on SIGTERM", what);
    {
        char *text = th_slurp(log);
        if (text) {
            diag("%s: relay log: %d lines, %d about cluster nodes", what, th_count_lines(text),
                 rt_count_substr(text, "cluster"));
            th_diag_tail("relay log", text, 6);
            free(text);
        }
    }
    audit(what, strcmp(mode, "idempotent") == 0);
}

int main(void)
{
    int64_t t0 = th_now_ms();
    signal(SIGPIPE, SIG_IGN);
    if (ce_start(&env, 3, 1, 0, NULL) != 0) {
        ok(0, "cluster starts");
        return tap_done();
    }
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    db = rt_open(dbpath);
    test_drain();
    test_faults("p", "plain");
    test_faults("i", "idempotent");
    test_faults("w", "wait");
    sqlite3_close(db);
    ce_stop(&env);
    th_rmtree(dir);
    free(dir);
    free(dbpath);
    diag("total %lld ms", (long long)(th_now_ms() - t0));
    return tap_done();
}
