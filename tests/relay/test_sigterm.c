/*
 * test_sigterm.c: SIGTERM in the middle of a drain, then a second run.
 *
 * Each run starts with Redis's writes paused (CLIENT PAUSE ... WRITE), so
 * that SIGTERM, sent once the relay's XADDs wait in Redis, finds it
 * mid-drain however fast it is.
 * 1. Replies held for 700 ms after SIGTERM (shorter than the shutdown
 *    timeout): the relay waits for the in-flight replies, marks them, hands
 *    every other claimed row back, and exits 0 within the shutdown timeout
 *    with no row left in state 1; each row it marked published is in the
 *    stream exactly once, nothing else is.
 * 2. Replies held until it exited (longer than --shutdown-timeout-ms): it
 *    gives up waiting at the timeout, hands those rows back too, and exits
 *    0 soon after.
 * 3. A second run with --drain publishes the rest: every id in the stream
 *    at least once.
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

/* Starts a relay against Redis with its writes paused (CLIENT PAUSE ...
 * WRITE, longer than any wait here), so that it is mid-drain whatever its
 * speed: once its XADDs wait in Redis (a blocked client), SIGTERM. The
 * replies stay held for hold_ms after SIGTERM (then CLIENT UNPAUSE), or
 * until the relay exited when hold_ms is 0. Returns the exit status, the
 * time from the moment its XADDs were seen held to the exit in
 * *since_pause and from SIGTERM to the exit in *since_term. */
static int run_and_term(const char *log, const char *dbpath, const char *url, redisContext *c, int hold_ms,
                        const char *shutdown_ms, int wait_ms, int64_t *since_pause, int64_t *since_term)
{
    pid_t pid;
    int64_t paused, termed;
    int rc;
    freeReplyObject(th_cmd(c, "CLIENT PAUSE %d WRITE", 60000 * th_slow()));
    pid = rt_relay_spawn(log, dbpath, url, "--shutdown-timeout-ms", shutdown_ms, NULL);
    if (!rt_wait_blocked(c, 20000 * th_slow()))
        diag("the relay did not start publishing");
    paused = th_now_ms();
    /* Let XADDs pile up behind the pause (a daemon under valgrind takes
     * longer to send its next ones). */
    th_sleep_ms(50 * th_slow());
    termed = th_now_ms();
    kill(pid, SIGTERM);
    if (hold_ms) {
        rc = th_wait(pid, hold_ms);
        freeReplyObject(th_cmd(c, "CLIENT UNPAUSE"));
        if (rc == -2)
            rc = th_wait(pid, wait_ms);
    } else {
        rc = th_wait(pid, wait_ms);
    }
    *since_pause = th_now_ms() - paused;
    *since_term = th_now_ms() - termed;
    if (rc == -2) {
        kill(pid, SIGKILL);
        th_wait(pid, -1);
    }
    freeReplyObject(th_cmd(c, "CLIENT UNPAUSE"));
    return rc;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log1, *log2, *text, *err = NULL;
    redisContext *c;
    sqlite3 *db;
    int64_t since_pause, ms;
    int rc;
    long published, entries;
    rt_audit a;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log1 = th_path(dir, "relay1.log");
    log2 = th_path(dir, "relay2.log");
    rt_insert_rows(db, "t", 0, N / 2, "term", 0);
    rt_insert_rows(db, "tk", 0, N / 2, "term", 8);

    /* 1: replies come back within the shutdown timeout. */
    rc = run_and_term(log1, dbpath, srv.url, c, 700, "5000", 6000 * th_slow(), &since_pause, &ms);
    is_int(rc, 0, "held replies: exit 0 after SIGTERM");
    diag("held replies: exited %lld ms after SIGTERM", (long long)ms);
    ok(since_pause >= 650 && ms < 5000, "it waited for the held replies, within the shutdown timeout (%lld ms)",
       (long long)ms);
    text = th_slurp(log1);
    if (rc != 0 || getenv("SIGTERM_DEBUG"))
        th_diag_tail("relay", text, 40);
    ok(strstr(text, "msg=stopping") != NULL && strstr(text, "msg=stopped") != NULL, "held replies: a graceful stop");
    ok(strstr(text, "shutdown timeout") == NULL, "held replies: no shutdown timeout");
    free(text);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1"), 0, "held replies: no row left in state 1");
    published = (long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
    entries = (long)th_xlen(c, "outbox:term");
    diag("held replies: %ld published, %ld pending", published, N - published);
    ok(published > 0 && published < N, "stopped mid-drain");
    is_int(entries, published, "held replies: the stream holds exactly the rows marked published");

    /* 2: replies held past the shutdown timeout. */
    rc = run_and_term(log2, dbpath, srv.url, c, 0, "500", 6000 * th_slow(), &since_pause, &ms);
    is_int(rc, 0, "shutdown timeout: exit 0 after SIGTERM");
    diag("shutdown timeout: exited %lld ms after SIGTERM", (long long)ms);
    ok(ms >= 450 && since_pause < 2500, "it gave up waiting at the 500 ms timeout (%lld ms)", (long long)ms);
    text = th_slurp(log2);
    if (rc != 0 || getenv("SIGTERM_DEBUG"))
        th_diag_tail("relay", text, 40);
    ok(strstr(text, "shutdown timeout") != NULL, "shutdown timeout: logged");
    free(text);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1"), 0, "shutdown timeout: no row left in state 1");

    /* 3: a second run drains the rest. */
    rc = rt_relay_run(60000 * th_slow(), &err, dbpath, srv.url, "--drain", NULL);
    is_int(rc, 0, "second run: --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    free(err);
    a = rt_audit_topic(db, c, "outbox:", "term");
    is_int(a.rows, N, "%d rows", N);
    is_int(a.missing, 0, "every id is in the stream at least once");
    is_int(a.unpublished, 0, "every row is published");
    is_int(a.foreign, 0, "no entry without a row");
    is_int(a.order_violations, 0, "per key, first appearances follow commit order");
    diag("%ld duplicate entries (from the abandoned replies)", a.dups);

    free(log1);
    free(log2);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
