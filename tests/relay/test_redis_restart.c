/*
 * test_redis_restart.c: Redis crashes (SIGKILL) in the middle of a drain and
 * comes back. With appendonly yes and appendfsync always, Redis keeps every
 * entry it acknowledged, so afterwards every committed id must be in the
 * stream at least once: the relay hands the messages whose replies were lost
 * back for retry, reconnects and finishes the drain.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 20000
#define KILL_AT 3000

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    pid_t pid;
    rt_audit a;
    long long xlen = 0;
    int64_t deadline;
    int rc;

    if (th_redis_start(&srv, 0, "appendonly yes\nappendfsync always\n") != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    log = th_path(dir, "relay.log");
    {
        sqlite3 *db = rt_open(dbpath);
        rt_insert_rows(db, "r", 0, N / 2, "restart", 0);
        rt_insert_rows(db, "rk", 0, N / 2, "restart", 20);
        sqlite3_close_v2(db);
    }

    c = th_redis_client(&srv);
    pid = rt_relay_spawn(log, dbpath, srv.url, "--drain", NULL);
    deadline = th_now_ms() + 20000 * th_slow();
    while ((xlen = th_xlen(c, "outbox:restart")) < KILL_AT && th_now_ms() < deadline)
        th_sleep_ms(1);
    redisFree(c);
    th_redis_kill(&srv);
    diag("redis-server killed with %lld entries in the stream", xlen);
    ok(xlen >= KILL_AT && xlen < N, "killed mid-stream");
    th_sleep_ms(300);
    is_int(th_wait(pid, 0), -2, "the relay keeps running without Redis");
    is_int(th_redis_restart(&srv), 0, "redis-server restarted (from its AOF)");

    rc = th_wait(pid, 60000 * th_slow());
    is_int(rc, 0, "the drain finishes with exit 0");
    if (rc == -2) {
        kill(pid, SIGKILL);
        th_wait(pid, -1);
    }
    text = th_slurp(log);
    ok(strstr(text, "redis connection lost") != NULL, "the relay noticed the lost connection");
    if (rc != 0)
        th_diag_tail("relay", text, 20);
    free(text);

    c = th_redis_client(&srv);
    {
        sqlite3 *db = rt_open(dbpath);
        a = rt_audit_topic(db, c, "outbox:", "restart");
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state IN (0, 1)"), 0, "no row left pending or sending");
        sqlite3_close_v2(db);
    }
    is_int(a.rows, N, "%d rows", N);
    is_int(a.missing, 0, "every committed id is in the stream at least once");
    is_int(a.unpublished, 0, "every row is published");
    is_int(a.foreign, 0, "no entry without a row");
    is_int(a.order_violations, 0, "per key, first appearances follow commit order");
    diag("%ld duplicate entries (replies lost with the crash)", a.dups);

    redisFree(c);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(log);
    free(dbpath);
    free(dir);
    return tap_done();
}
