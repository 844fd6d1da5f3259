/*
 * test_create_wait.c: when outbox_relay_create waits on its caller's
 * thread. It reads the schema through a connection of its own and, while
 * that meets a lock, tries again every 10 ms for about 2 s:
 *   - a writer holding BEGIN IMMEDIATE with an uncommitted insert does not
 *     make it wait (in WAL mode a reader never waits for a writer);
 *   - an older schema must be migrated, which takes the write lock: a
 *     writer holding it for 300 ms makes create wait that long, and create
 *     then migrates and succeeds;
 *   - a connection in locking_mode=EXCLUSIVE keeps every other connection
 *     from reading: create gives up after about 2 s with OUTBOX_EBUSY;
 *   - with wait_for_db it succeeds instead, and the relay waits for the
 *     lock: outbox_relay_db_waiting says why, a stop during the wait closes
 *     every handle, and once the lock is gone the relay opens its database.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

/* A connection that holds a lock from a thread of its own: it takes the
 * lock (sql), posts `taken`, holds it for hold_ms and lets go (COMMIT). */
typedef struct locker {
    const char *path, *sql;
    int hold_ms;
    uv_sem_t taken;
    uv_thread_t thread;
} locker;

static void lock_run(void *arg)
{
    locker *l = arg;
    sqlite3 *db = rt_open(l->path);
    th_sql_exec(db, "%s", l->sql);
    uv_sem_post(&l->taken);
    uv_sleep((unsigned)l->hold_ms);
    th_sql_exec(db, "COMMIT");
    sqlite3_close_v2(db);
}

static void lock_start(locker *l, const char *path, const char *sql, int hold_ms)
{
    l->path = path;
    l->sql = sql;
    l->hold_ms = hold_ms;
    if (uv_sem_init(&l->taken, 0) != 0 || uv_thread_create(&l->thread, lock_run, l) != 0)
        bail("cannot start the lock holder");
    uv_sem_wait(&l->taken);
}

static void lock_end(locker *l)
{
    uv_thread_join(&l->thread);
    uv_sem_destroy(&l->taken);
}

/* Creates a relay on path (never started) and destroys it; returns create's
 * result and its time in *took. */
static int create_timed(uv_loop_t *loop, const char *path, int64_t *took)
{
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    char err[256];
    int64_t t0;
    int rc;
    outbox_relay_defaults(&s);
    s.db_path = path;
    s.redis_url = "redis://127.0.0.1:1"; /* never started: no connection needed */
    s.log_level = OUTBOX_LOG_ERROR;
    t0 = th_now_ms();
    rc = outbox_relay_create(&r, loop, &s, err, sizeof err);
    *took = th_now_ms() - t0;
    if (rc != 0)
        diag("create: %s (%s)", outbox_err_name(rc), err);
    outbox_relay_destroy(r);
    uv_run(loop, UV_RUN_DEFAULT);
    return rc;
}

/* Turns a current database back into schema 4 (no holes or tally, no batch
 * records, no cursor, an index of new rows): create has to migrate it. */
static void make_schema_4(const char *path)
{
    sqlite3 *db = rt_open(path);
    th_sql_exec(db, "DROP TRIGGER outbox_gone_after_delete; DROP TABLE outbox_gone; DROP TABLE outbox_tally; "
                    "DROP VIEW outbox_messages; DROP TABLE outbox_batch; "
                    "DROP TRIGGER outbox_cursor_after_delete; DROP TRIGGER outbox_cursor_after_update; "
                    "DROP TABLE outbox_cursor; DROP INDEX outbox_stray; "
                    "CREATE INDEX outbox_new ON outbox(seq) WHERE state = 0 AND available_at <= created_at; "
                    "PRAGMA user_version = 4");
    sqlite3_close_v2(db);
}

/* A relay created with wait_for_db, started on the loop: polled until its
 * database opened (or the deadline), then stopped. */
typedef struct waiter {
    outbox_relay *r;
    uv_timer_t timer;
    int64_t deadline;
    int opened, stopped;
} waiter;

static void on_waiter_stopped(outbox_relay *r, void *data)
{
    waiter *w = data;
    (void)r;
    w->stopped = 1;
}

static void poll_open(uv_timer_t *t)
{
    waiter *w = t->data;
    w->opened = outbox_relay_db_waiting(w->r, NULL, 0) == 0;
    if (!w->opened && th_now_ms() < w->deadline)
        return;
    uv_close((uv_handle_t *)t, NULL);
    outbox_relay_stop(w->r, on_waiter_stopped, w);
}

/* Creates a waiting relay on path while it is locked, starts it and either
 * stops it at once or waits up to wait_ms for its database; the checks. */
static void waiting_relay(uv_loop_t *loop, const char *path, int wait_ms)
{
    outbox_relay_settings s;
    waiter w = {0};
    char err[256] = "", why[512] = "";
    int rc;
    outbox_relay_defaults(&s);
    s.db_path = path;
    s.redis_url = "redis://127.0.0.1:1"; /* nothing listens: reconnects until the stop */
    s.log_level = OUTBOX_LOG_ERROR;
    s.wait_for_db = 1;
    rc = outbox_relay_create(&w.r, loop, &s, err, sizeof err);
    is_int(rc, 0, "wait_for_db: create succeeds while the lock is held (%s)", err);
    if (rc != 0)
        return;
    is_int(outbox_relay_db_waiting(w.r, why, sizeof why), 1, "the relay waits for its database: %s", why);
    ok(strstr(why, "locked") != NULL, "... because it is locked");
    is_int(outbox_relay_start(w.r), 0, "start succeeds while waiting");
    if (wait_ms == 0) {
        is_int(outbox_relay_stop(w.r, on_waiter_stopped, &w), 0, "stop while waiting");
    } else {
        w.deadline = th_now_ms() + wait_ms;
        uv_timer_init(loop, &w.timer);
        w.timer.data = &w;
        uv_timer_start(&w.timer, poll_open, 10, 10);
    }
    uv_run(loop, UV_RUN_DEFAULT);
    ok(w.stopped, "the relay stopped, every handle closed");
    if (wait_ms)
        ok(w.opened, "once the lock was released the relay opened its database");
    outbox_relay_destroy(w.r);
}

int main(void)
{
    char *dir, *path, *old;
    uv_loop_t loop;
    locker l;
    int64_t took;
    int rc;

    dir = th_tmpdir();
    path = rt_make_db(dir, "app.db");
    old = rt_make_db(dir, "old.db");
    make_schema_4(old);
    uv_loop_init(&loop);

    /* A writer in the middle of its transaction: create only reads. */
    lock_start(&l, path, "BEGIN IMMEDIATE; INSERT INTO outbox(id, topic, payload) VALUES ('w1', 't', x'00')", 300);
    rc = create_timed(&loop, path, &took);
    is_int(rc, 0, "a writer holds the write lock: create succeeds");
    ok(took < 100 * th_slow(), "at once, without waiting for the writer (%lld ms)", (long long)took);
    lock_end(&l);

    /* The same writer on a database whose schema must be migrated. */
    lock_start(&l, old, "BEGIN IMMEDIATE; INSERT INTO outbox(id, topic, payload) VALUES ('w1', 't', x'00')", 300);
    rc = create_timed(&loop, old, &took);
    is_int(rc, 0, "schema 4 and a writer: create migrates and succeeds");
    ok(took >= 200 && took < 2000 * th_slow(), "after waiting for the writer's commit (%lld ms)", (long long)took);
    lock_end(&l);
    {
        sqlite3 *db = rt_open(old);
        is_int(th_sql_int(db, "PRAGMA user_version"), OUTBOX_SCHEMA_VERSION, "the schema is current now");
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 'w1'"), 1, "and the writer's row is there");
        sqlite3_close_v2(db);
    }

    /* A connection that keeps the database to itself: create gives up. */
    lock_start(&l, path, "PRAGMA locking_mode = EXCLUSIVE; BEGIN IMMEDIATE; "
                         "INSERT INTO outbox(id, topic, payload) VALUES ('x1', 't', x'00')", 4000);
    rc = create_timed(&loop, path, &took);
    is_int(rc, OUTBOX_EBUSY, "locking_mode=EXCLUSIVE held: create fails with OUTBOX_EBUSY");
    ok(took >= 1800 && took < 4000 * th_slow(), "after about 2 s (%lld ms)", (long long)took);
    lock_end(&l);
    is_int(create_timed(&loop, path, &took), 0, "once it closed: create succeeds");

    /* The same lock with wait_for_db: the relay waits. Held beyond create's
     * own 2 s of tries, so that create ends with the lock still held. */
    lock_start(&l, path, "PRAGMA locking_mode = EXCLUSIVE; BEGIN IMMEDIATE; "
                         "INSERT INTO outbox(id, topic, payload) VALUES ('x2', 't', x'00')", 4000 * th_slow());
    waiting_relay(&loop, path, 0);
    lock_end(&l);
    lock_start(&l, path, "PRAGMA locking_mode = EXCLUSIVE; BEGIN IMMEDIATE; "
                         "INSERT INTO outbox(id, topic, payload) VALUES ('x3', 't', x'00')", 4000 * th_slow());
    waiting_relay(&loop, path, 20000 * th_slow());
    lock_end(&l);

    is_int(uv_loop_close(&loop), 0, "loop closes: no handle left behind");
    free(path);
    free(old);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
