/*
 * test_resend.c: a connection lost with messages in flight. Their XADDs
 * were never answered, so their outcome is unknown: the relay keeps them
 * (still leased, in their batch) and sends them again, in order, as soon as
 * Redis answers again, instead of handing each row back to be claimed
 * again on its own (which made every later row of their keys wait as a row
 * of its own, and a backlog drain after a reconnect several times slower).
 *
 * 1. Redis's writes are paused (CLIENT PAUSE WRITE) so that the relay's
 *    XADDs wait in Redis unexecuted, then its connection is killed: every
 *    one of those messages must be kept and sent again on the next
 *    connection; none handed back, none duplicated, the drain finishes,
 *    per-key order holds.
 * 2. The same loss with Redis then gone: a SIGTERM hands the kept messages
 *    back to their rows and the relay exits at once; a later drain
 *    publishes every row.
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

/* The count= of the relay's "kept to send again" line, -1 if none. */
static long kept_count(const char *text)
{
    const char *p = strstr(text, "in-flight messages kept to send again\" count=");
    if (!p)
        return -1;
    return strtol(p + strlen("in-flight messages kept to send again\" count="), NULL, 10);
}

static void fill(const char *dbpath, const char *prefix)
{
    sqlite3 *db = rt_open(dbpath);
    rt_insert_rows(db, prefix, 0, N / 2, "resend", 0);
    rt_insert_rows(db, prefix, N / 2, N / 2, "resend", 20);
    sqlite3_close_v2(db);
}

static void audit(th_redis *srv, const char *dbpath, const char *what)
{
    redisContext *c = th_redis_client(srv);
    sqlite3 *db = rt_open(dbpath);
    rt_audit a = rt_audit_topic(db, c, "outbox:", "resend");
    is_int(a.rows, N, "%s: %d rows", what, N);
    is_int(a.missing, 0, "%s: every committed id is in the stream", what);
    is_int(a.unpublished, 0, "%s: every row is published", what);
    is_int(a.foreign, 0, "%s: no entry without a row", what);
    is_int(a.order_violations, 0, "%s: per key, first appearances follow commit order", what);
    /* XADDs executed just before the pause whose replies went with the
     * killed connection are sent again: duplicates, as after any loss. */
    diag("%s: %ld duplicate entries", what, a.dups);
    sqlite3_close_v2(db);
    redisFree(c);
}

/* Pauses Redis's writes, waits until the relay's XADDs wait in it, kills the
 * relay's connection. 1 if all of that happened. */
static int lose_connection_in_flight(redisContext *c)
{
    redisReply *rep;
    int ok = 1;
    int64_t deadline = th_now_ms() + 20000 * th_slow();
    while (th_xlen(c, "outbox:resend") < 1000 && th_now_ms() < deadline)
        th_sleep_ms(1);
    rep = redisCommand(c, "CLIENT PAUSE %d WRITE", 60000);
    ok = ok && rep && rep->type == REDIS_REPLY_STATUS;
    freeReplyObject(rep);
    ok = ok && rt_wait_blocked(c, 10000 * th_slow());
    rep = redisCommand(c, "CLIENT KILL TYPE normal SKIPME yes");
    ok = ok && rep && rep->type == REDIS_REPLY_INTEGER && rep->integer >= 1;
    freeReplyObject(rep);
    return ok;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    redisReply *rep;
    pid_t pid;
    int rc;
    long kept;

    /* Every entry Redis acknowledged survives its SIGKILL in part 2. */
    if (th_redis_start(&srv, 0, "appendonly yes\nappendfsync always\n") != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();

    /* 1. Lost with Redis still there. */
    dbpath = rt_make_db(dir, "app.db");
    log = th_path(dir, "relay.log");
    fill(dbpath, "a");
    c = th_redis_client(&srv);
    pid = rt_relay_spawn(log, dbpath, srv.url, "--drain", "--log-level", "debug", NULL);
    ok(lose_connection_in_flight(c), "the relay's connection killed with its XADDs waiting in a paused Redis");
    rep = redisCommand(c, "CLIENT UNPAUSE");
    freeReplyObject(rep);
    rc = th_wait(pid, 60000 * th_slow());
    is_int(rc, 0, "the drain finishes with exit 0");
    text = th_slurp(log);
    kept = kept_count(text);
    ok(kept > 0, "the messages in flight were kept to send again (%ld)", kept);
    is_int(rt_count_substr(text, "msg=\"handed back\""), 0, "none handed back to its row");
    if (rc != 0 || kept <= 0)
        th_diag_tail("relay", text, 20);
    free(text);
    audit(&srv, dbpath, "lost");
    redisFree(c);
    free(dbpath);
    free(log);

    /* 2. Lost, and Redis gone: the stop hands them back. */
    dbpath = rt_make_db(dir, "stop.db");
    log = th_path(dir, "stop.log");
    fill(dbpath, "b");
    c = th_redis_client(&srv);
    rep = redisCommand(c, "DEL outbox:resend");
    freeReplyObject(rep);
    pid = rt_relay_spawn(log, dbpath, srv.url, "--log-level", "debug", NULL);
    ok(lose_connection_in_flight(c), "stop: the connection killed with XADDs waiting");
    redisFree(c);
    th_redis_kill(&srv);
    {
        int64_t deadline = th_now_ms() + 10000 * th_slow();
        text = NULL;
        while (th_now_ms() < deadline) {
            free(text);
            text = th_slurp(log);
            if (kept_count(text) >= 0)
                break;
            th_sleep_ms(5);
        }
        kept = kept_count(text);
        free(text);
    }
    ok(kept > 0, "stop: the messages in flight were kept (%ld)", kept);
    is_int(th_stop(pid, SIGTERM, 10000 * th_slow()), 0, "stop: SIGTERM with Redis gone exits 0");
    text = th_slurp(log);
    /* Those kept, and any a claim running at the loss brought back after it. */
    ok(rt_count_substr(text, "msg=\"handed back\"") >= kept, "stop: each kept message handed back to its row (%d)",
       rt_count_substr(text, "msg=\"handed back\""));
    free(text);
    {
        sqlite3 *db = rt_open(dbpath);
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1"), 0,
               "stop: no row left leased");
        sqlite3_close_v2(db);
    }
    is_int(th_redis_restart(&srv), 0, "stop: redis-server back");
    rc = rt_relay_run(60000 * th_slow(), NULL, dbpath, srv.url, "--drain", NULL);
    is_int(rc, 0, "stop: a later drain exits 0");
    audit(&srv, dbpath, "stop");

    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(log);
    free(dbpath);
    free(dir);
    return tap_done();
}
