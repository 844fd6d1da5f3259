/*
 * test_sentinel_down.c: the relay when sentinels are down (sentinel_env.h).
 *   1. The first sentinel of the URL is down: the next one answers;
 *      outbox-relay --drain publishes every row and exits 0.
 *   2. Every sentinel is down at start: nothing is published, the log says
 *      once that no sentinel named the master and what each one did, the
 *      relay keeps retrying; once the sentinels are back it publishes by
 *      itself.
 *   3. Every sentinel goes down while the relay is connected: its
 *      connection to the master is fine, so it keeps publishing; it says
 *      that the sentinels do not answer, and that one does again after
 *      their restart.
 *   4. --wait-replicas checked against the replicas the sentinels know:
 *      WAIT 1 with the one replica drains and warns of nothing; WAIT 2
 *      says at once that it cannot succeed, and marks nothing published.
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

static sqlite3 *db;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

static long long xlen_master(const se_env *e, const char *topic)
{
    redisContext *c = th_redis_client(&e->node[0]);
    char stream[128];
    long long n;
    snprintf(stream, sizeof stream, "outbox:%s", topic);
    n = th_xlen(c, stream);
    redisFree(c);
    return n;
}

static int log_has(const char *path, const char *needle)
{
    char *text = th_slurp(path);
    int n = rt_count_substr(text, needle);
    free(text);
    return n;
}

int main(void)
{
    se_env e;
    char *dir, *dbpath, *log2, *log3, *log4, *err = NULL;
    pid_t pid;
    int i, rc;

    se_world_start(&e, NULL, &dir, &dbpath, &db);
    log2 = th_path(dir, "relay2.log");
    log3 = th_path(dir, "relay3.log");
    log4 = th_path(dir, "relay4.log");

    /* 1 */
    se_sentinel_kill(&e, 0);
    rt_insert_rows(db, "one", 0, 500, "one", 0);
    rc = rt_relay_run(60000 * th_slow(), &err, dbpath, e.url, "--drain", NULL);
    is_int(rc, 0, "first sentinel down: --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    free(err);
    is_int(xlen_master(&e, "one"), 500, "first sentinel down: every row on the master");

    /* 2 */
    se_sentinel_kill(&e, 1);
    se_sentinel_kill(&e, 2);
    rt_insert_rows(db, "two", 0, 300, "two", 0);
    pid = rt_relay_spawn(log2, dbpath, e.url, NULL);
    /* Until it said so (however long the start takes), and 2.5 s at least. */
    {
        int64_t t0 = th_now_ms();
        while (!log_has(log2, "no sentinel named the master") && th_now_ms() - t0 < 20000 * th_slow())
            th_sleep_ms(20);
        if (th_now_ms() - t0 < 2500)
            th_sleep_ms((int)(2500 - (th_now_ms() - t0)));
    }
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'two' AND state = 2"), 0,
           "all sentinels down: nothing published");
    is_int(log_has(log2, "no sentinel named the master"), 1, "all sentinels down: said once");
    ok(log_has(log2, "connection refused") && log_has(log2, "127.0.0.1:"), "  with what each sentinel did");
    for (i = 0; i < SE_SENTINELS; i++)
        ok(se_sentinel_restart(&e, i) == 0, "sentinel %d started again", i);
    ok(th_wait_until(30000 * th_slow(), settled, NULL), "sentinels back: every row published by itself");
    is_int(xlen_master(&e, "two"), 300, "sentinels back: on the master");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "the relay exits 0 on SIGTERM");

    /* 3 */
    pid = rt_relay_spawn(log3, dbpath, e.url, NULL);
    rt_insert_rows(db, "three", 0, 100, "three", 0);
    ok(th_wait_until(20000 * th_slow(), settled, NULL), "connected: rows published");
    for (i = 0; i < SE_SENTINELS; i++)
        se_sentinel_kill(&e, i);
    th_sleep_ms(300);
    rt_insert_rows(db, "three", 100, 100, "three", 0);
    ok(th_wait_until(20000 * th_slow(), settled, NULL), "sentinels down while connected: rows still published");
    is_int(xlen_master(&e, "three"), 200, "  all on the master");
    for (int64_t t0 = th_now_ms(); !log_has(log3, "no sentinel answers") && th_now_ms() - t0 < 10000 * th_slow();)
        th_sleep_ms(20);
    ok(log_has(log3, "no sentinel answers"), "  the relay says the sentinels do not answer");
    for (i = 0; i < SE_SENTINELS; i++)
        ok(se_sentinel_restart(&e, i) == 0, "sentinel %d started again", i);
    for (int64_t t0 = th_now_ms(); !log_has(log3, "a sentinel answers again") && th_now_ms() - t0 < 10000 * th_slow();)
        th_sleep_ms(50);
    ok(log_has(log3, "a sentinel answers again"), "  and that one answers again");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "the relay exits 0 on SIGTERM");

    /* 4 */
    rt_insert_rows(db, "four", 0, 50, "four", 0);
    rc = rt_relay_run(60000 * th_slow(), &err, dbpath, e.url, "--drain", "--wait-replicas", "1", NULL);
    is_int(rc, 0, "--wait-replicas 1, one replica: --drain exits 0");
    ok(err && !strstr(err, "does not cover a failover") && !strstr(err, "WAIT cannot succeed"),
       "  no warning about the replicas");
    if (rc != 0 || !err || strstr(err, "cover") || strstr(err, "cannot succeed"))
        th_diag_tail("relay", err, 20);
    free(err);
    err = NULL;
    rt_insert_rows(db, "four", 50, 20, "four", 0);
    pid = rt_relay_spawn(log4, dbpath, e.url, "--wait-replicas", "2", NULL);
    for (int64_t t0 = th_now_ms(); !log_has(log4, "WAIT cannot succeed") && th_now_ms() - t0 < 20000 * th_slow();)
        th_sleep_ms(20);
    ok(log_has(log4, "WAIT cannot succeed") == 1 && log_has(log4, "replicas=1 wait_replicas=2"),
       "--wait-replicas 2, one replica: said once, with the counts");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'four' AND state = 2"), 50,
           "  the new rows are not marked published");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "the relay exits 0 on SIGTERM");

    free(log2);
    free(log3);
    free(log4);
    se_world_end(&e, dir, dbpath, db);
    return tap_done();
}
