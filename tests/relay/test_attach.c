/*
 * test_attach.c: what outbox_relay_attach does to the application's
 * connection besides the wake-up hook: its busy timeout becomes a busy
 * handler with the same total wait (one that wakes as soon as the relay's
 * own transaction ends), and outbox_relay_detach restores the timeout.
 *   - busy_timeout 5000: replaced at attach (PRAGMA busy_timeout reads 0),
 *     5000 again after detach;
 *   - busy_timeout 0: left alone (the connection keeps not waiting);
 *   - a lock held by another connection for 150 ms: the attached writer
 *     waits and commits right after it is released (well before the next
 *     default sleep step would end);
 *   - a lock held for longer than the timeout (300 ms): SQLITE_BUSY after
 *     about 300 ms, not at once and not later.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

static const char *dbpath;

typedef struct holder {
    int hold_ms;
} holder;

/* Holds the write lock through a connection of its own for hold_ms. */
static void hold_lock(void *arg)
{
    holder *h = arg;
    sqlite3 *db = rt_open(dbpath);
    th_sql_exec(db, "BEGIN IMMEDIATE");
    uv_sleep((unsigned)h->hold_ms);
    th_sql_exec(db, "COMMIT");
    sqlite3_close_v2(db);
}

/* Inserts one row through db while another connection holds the write lock
 * for hold_ms (taken 20 ms before the insert); returns its result code and
 * the insert's time in *took. */
static int insert_while_locked(sqlite3 *db, const char *id, int hold_ms, int64_t *took)
{
    char sql[200];
    uv_thread_t t;
    holder h = {hold_ms};
    int64_t t0;
    int rc;
    uv_thread_create(&t, hold_lock, &h);
    uv_sleep(20);
    snprintf(sql, sizeof sql, "INSERT INTO outbox(id, topic, payload) VALUES ('%s', 'a', x'00')", id);
    t0 = th_now_ms();
    rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
    *took = th_now_ms() - t0;
    uv_thread_join(&t);
    return rc;
}

int main(void)
{
    char *dir, err[256];
    uv_loop_t loop;
    outbox_relay_settings s;
    outbox_relay *r;
    sqlite3 *db;
    int64_t took;
    int rc;

    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = dbpath;
    s.redis_url = "redis://127.0.0.1:1"; /* never started: no connection needed */
    is_int(outbox_relay_create(&r, &loop, &s, err, sizeof err), 0, "relay created (%s)", err);

    db = rt_open(dbpath); /* busy_timeout 5000 */
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 5000, "writer: busy_timeout 5000");
    is_int(outbox_relay_attach(r, db), 0, "attach");
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 0, "attached: the timeout is replaced by a busy handler");

    /* A lock held 150 ms by another connection: the writer waits it out. */
    rc = insert_while_locked(db, "m1", 150, &took);
    is_int(rc, SQLITE_OK, "lock held 150 ms: the insert waits and succeeds");
    ok(took >= 100 && took < 400, "and it took about the rest of the hold (%lld ms)", (long long)took);

    /* Held longer than a short timeout: BUSY after about that timeout. */
    outbox_relay_detach(db);
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 5000, "detached: busy_timeout 5000 again");
    sqlite3_busy_timeout(db, 300);
    outbox_relay_attach(r, db);
    rc = insert_while_locked(db, "m2", 1500, &took);
    is_int(rc & 0xff, SQLITE_BUSY, "lock held past a 300 ms timeout: SQLITE_BUSY");
    ok(took >= 280 && took < 1000, "after about 300 ms (%lld ms)", (long long)took);
    outbox_relay_detach(db);
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 300, "detached: busy_timeout 300 again");

    /* A connection that does not wait keeps not waiting. */
    sqlite3_busy_timeout(db, 0);
    outbox_relay_attach(r, db);
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 0, "busy_timeout 0: still 0 after attach");
    rc = insert_while_locked(db, "m3", 300, &took);
    is_int(rc & 0xff, SQLITE_BUSY, "busy_timeout 0: SQLITE_BUSY");
    ok(took < 100, "at once (%lld ms)", (long long)took);
    outbox_relay_detach(db);
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 0, "busy_timeout 0 after detach");

    is_int(th_sql_int(db, "SELECT count(*) FROM outbox"), 1, "one row written (m1)");
    sqlite3_close_v2(db);
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "loop closes: no handle left behind");
    th_rmtree(dir);
    free((char *)dbpath);
    free(dir);
    return tap_done();
}
