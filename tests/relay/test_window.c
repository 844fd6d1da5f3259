/*
 * test_window.c: the in-flight window bounds what the relay holds. With
 * --inflight 100 and Redis holding every write (CLIENT PAUSE ... WRITE), the
 * relay claims exactly up to the window and no further: at no moment, while
 * paused or afterwards, are more than 100 rows in state 1 (sending). Once
 * Redis answers again everything is published.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 3000
#define WINDOW 100

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    sqlite3 *db;
    redisContext *c;
    redisReply *rep;
    pid_t pid;
    int64_t pause_end, deadline;
    long max_sending = 0, max_sending_paused = 0, samples = 0, published = 0, published_paused = -1;
    int rc, pause_ms;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log = th_path(dir, "relay.log");
    rt_insert_rows(db, "w", 0, N, "window", 0);

    /* Held by the test until the relay's XADDs waited in Redis for a while
     * (below the relay's 10 s reply timeout, also under valgrind); the
     * pause's own end is only a bound, however long the relay takes to
     * start. */
    pause_ms = 60000 * th_slow();
    rep = th_cmd(c, "CLIENT PAUSE %d WRITE", pause_ms);
    ok(rep->type == REDIS_REPLY_STATUS, "CLIENT PAUSE WRITE accepted");
    freeReplyObject(rep);
    pid = rt_relay_spawn(log, dbpath, srv.url, "--inflight", "100", NULL);
    if (!rt_wait_blocked(c, 20000 * th_slow()))
        diag("no XADD of the relay waits in Redis");
    pause_end = th_now_ms() + (th_slow() > 1 ? 4000 : 1500);

    /* While paused: sample the table as fast as we can. */
    while (th_now_ms() < pause_end) {
        long sending = (long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1");
        if (sending > max_sending_paused)
            max_sending_paused = sending;
        samples++;
        th_sleep_ms(2);
    }
    published_paused = (long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
    diag("%ld samples while paused, at most %ld rows sending", samples, max_sending_paused);
    is_int(max_sending_paused, WINDOW, "while Redis holds the writes, the relay fills the window of %d and no more",
           WINDOW);
    is_int(published_paused, 0, "nothing is marked published while Redis holds the writes");
    freeReplyObject(th_cmd(c, "CLIENT UNPAUSE"));

    /* After the pause: it drains, never above the window. */
    max_sending = max_sending_paused;
    deadline = th_now_ms() + 30000 * th_slow();
    while (th_now_ms() < deadline) {
        long sending = (long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1");
        if (sending > max_sending)
            max_sending = sending;
        published = (long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
        if (published == N)
            break;
        th_sleep_ms(1);
    }
    ok(max_sending <= WINDOW, "at most %d rows in state 1 at any sample (saw %ld)", WINDOW, max_sending);
    is_int(published, N, "all %d rows published after the pause", N);
    is_int(th_xlen(c, "outbox:window"), N, "the stream has %d entries", N);

    rc = th_stop(pid, SIGTERM, 15000);
    is_int(rc, 0, "SIGTERM: the relay exits 0");
    text = th_slurp(log);
    if (rc != 0 || published != N)
        th_diag_tail("relay", text, 20);
    free(text);

    free(log);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
