/*
 * test_attach.c: what outbox_relay_attach does to the application's
 * connection besides the wake-up hook: its busy wait (outbox_db_open's
 * outbox_db_busy_wait of 5000 ms, or a busy timeout) becomes a busy handler
 * with the same total wait (one that wakes as soon as the relay's own
 * transaction ends), and outbox_relay_detach restores the wait it had.
 *   - outbox_db_open's wait: replaced at attach, back after detach (a lock
 *     held 150 ms is waited out again);
 *   - busy_timeout 300: replaced at attach, 300 again after detach;
 *   - outbox_db_busy_wait(db, 0): left alone (the connection keeps not
 *     waiting);
 *   - a lock held by another connection for 150 ms: the attached writer
 *     waits and commits right after it is released (well before the next
 *     default sleep step would end);
 *   - a lock held for longer than the timeout (300 ms): SQLITE_BUSY after
 *     about 300 ms, not at once and not later.
 * Each attached connection has a record of its own:
 *   - two at once, A waiting 5000 ms and B not at all: A still waits out a
 *     lock, B still fails at once; detach gives A its 5000 back and leaves
 *     B not waiting; a commit on either wakes a running relay;
 *   - SQLite's auto-checkpoint (PRAGMA wal_autocheckpoint) is off while
 *     attached and back after detach; PRAGMA wal_autocheckpoint=N on an
 *     attached connection replaces the relay's WAL hook, and detach then
 *     leaves N in place (and does not crash) and restores the busy timeout;
 *   - a WAL hook the application set after attach goes with detach; a busy
 *     timeout it set after attach stays;
 *   - detach of a connection never attached (or NULL) changes nothing;
 *     attaching twice to the same relay is 0 and changes nothing, to
 *     another relay OUTBOX_ESTATE; NULL arguments OUTBOX_EINVAL.
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

/* How long db waits for a lock: its busy timeout, or outbox_db_busy_wait's
 * wait (PRAGMA busy_timeout reads 0 for any busy handler); 0 for none. */
static int64_t wait_ms(sqlite3 *db)
{
    sqlite3_stmt *st = NULL;
    int64_t ms = th_sql_int(db, "PRAGMA busy_timeout");
    if (ms > 0)
        return ms;
    if (sqlite3_prepare_v2(db, "SELECT outbox_busy_wait_ms()", -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW)
        ms = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st); /* no such function: it does not wait */
    return ms;
}

/* Inserts one row through db while another connection holds the write lock
 * for hold_ms (th_sql_while_locked); returns its result code and the
 * insert's time in *took. */
static int insert_while_locked(sqlite3 *db, const char *id, int hold_ms, int64_t *took)
{
    char sql[200];
    double took_ms, late_ms;
    int rc;
    snprintf(sql, sizeof sql, "INSERT INTO outbox(id, topic, payload) VALUES ('%s', 'a', x'00')", id);
    rc = th_sql_while_locked(db, dbpath, hold_ms, sql, &took_ms, &late_ms);
    *took = (int64_t)took_ms;
    return rc;
}

/* Two connections attached at once: each keeps its own busy timeout. */
static void two_connections(outbox_relay *r)
{
    sqlite3 *a = rt_open(dbpath), *b = rt_open(dbpath);
    int64_t took;
    int rc;

    outbox_db_busy_wait(b, 0);
    is_int(outbox_relay_attach(r, a), 0, "two: attach A (waits 5000 ms)");
    is_int(outbox_relay_attach(r, b), 0, "two: attach B (does not wait)");
    rc = insert_while_locked(a, "two-a", 150, &took);
    is_int(rc, SQLITE_OK, "two: A still waits out a lock held 150 ms");
    ok(took >= 100 && took < 400, "two: A took about the rest of the hold (%lld ms)", (long long)took);
    rc = insert_while_locked(b, "two-b", 300, &took);
    is_int(rc & 0xff, SQLITE_BUSY, "two: B still does not wait: SQLITE_BUSY");
    ok(took < 100, "two: B fails at once (%lld ms)", (long long)took);
    outbox_relay_detach(a);
    is_int(wait_ms(a), 5000, "two: detach A restores its 5000");
    outbox_relay_detach(b);
    is_int(wait_ms(b), 0, "two: detach B leaves it not waiting");
    sqlite3_close_v2(a);
    sqlite3_close_v2(b);
}

static int app_hook_calls;

static int app_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    (void)arg;
    (void)db;
    (void)name;
    (void)pages;
    app_hook_calls++;
    return SQLITE_OK;
}

/* The frames in db's WAL (PRAGMA wal_checkpoint's second column), or -1. */
static int wal_frames(sqlite3 *db)
{
    sqlite3_stmt *st = NULL;
    int n = -1;
    if (sqlite3_prepare_v2(db, "PRAGMA wal_checkpoint(PASSIVE)", -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW)
        n = sqlite3_column_int(st, 1);
    sqlite3_finalize(st);
    return n;
}

/* The WAL hook and SQLite's auto-checkpoint around attach and detach. */
static void wal_hooks(outbox_relay *r)
{
    sqlite3 *a = rt_open(dbpath);
    int i, frames;

    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 1000, "autockpt: SQLite's default of 1000 pages");
    outbox_relay_attach(r, a);
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 0, "autockpt: off while attached (the relay's WAL hook)");
    outbox_relay_detach(a);
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 1000, "autockpt: 1000 again after detach");

    /* The application turns auto-checkpoint on again while attached: its
     * hook replaces the relay's, and detach must neither trust the hook's
     * argument (the page count) nor remove SQLite's hook. */
    outbox_relay_attach(r, a);
    th_sql_exec(a, "PRAGMA wal_autocheckpoint=10");
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 10, "autockpt=10 while attached: SQLite's hook is back");
    outbox_relay_detach(a);
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 10, "autockpt=10: still 10 after detach");
    is_int(wait_ms(a), 5000, "autockpt=10: the wait of 5000 ms again");
    /* Each commit adds at least two frames; checkpoints every 10 keep
     * the WAL rewinding to its start. */
    for (i = 0; i < 40; i++)
        th_sql_exec(a, "INSERT INTO outbox(id, topic, payload) VALUES ('ckpt-%d', 'a', x'00')", i);
    frames = wal_frames(a);
    ok(frames >= 0 && frames < 40, "autockpt=10: SQLite checkpoints: %d frames in the WAL after 40 commits", frames);
    /* That detach found a's record without the hook's argument (SQLite's
     * own now) and dropped it: attaching again is a new attachment, which
     * puts the relay's hook in (an attachment still on record would be
     * left as it is). */
    outbox_relay_attach(r, a);
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 0,
           "autockpt=10: detach let go of the connection: attaching it again puts the relay's hook in");
    outbox_relay_detach(a);

    /* A hook of the application's own, set while attached, goes with
     * detach (SQLite cannot tell whose hook is installed). */
    sqlite3_wal_autocheckpoint(a, 1000);
    outbox_relay_attach(r, a);
    sqlite3_wal_hook(a, app_wal_hook, NULL);
    th_sql_exec(a, "INSERT INTO outbox(id, topic, payload) VALUES ('hook-1', 'a', x'00')");
    is_int(app_hook_calls, 1, "own hook: the application's hook runs while attached");
    outbox_relay_detach(a);
    th_sql_exec(a, "INSERT INTO outbox(id, topic, payload) VALUES ('hook-2', 'a', x'00')");
    is_int(app_hook_calls, 1, "own hook: removed by detach");
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 1000, "own hook: auto-checkpoint back after detach");

    /* A busy timeout the application set while attached stays. */
    outbox_relay_attach(r, a);
    sqlite3_busy_timeout(a, 700);
    outbox_relay_detach(a);
    is_int(th_sql_int(a, "PRAGMA busy_timeout"), 700, "busy_timeout set while attached: it stays after detach");
    sqlite3_close_v2(a);
}

/* Attach and detach misused. */
static void misuse(outbox_relay *r, outbox_relay *r2)
{
    sqlite3 *a = rt_open(dbpath);
    int64_t took;

    outbox_relay_detach(NULL);
    outbox_relay_detach(a);
    is_int(wait_ms(a), 5000, "never attached: detach leaves the busy wait");
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 1000, "never attached: detach leaves auto-checkpoint");
    is_int(outbox_relay_attach(NULL, a), OUTBOX_EINVAL, "attach without a relay: OUTBOX_EINVAL");
    is_int(outbox_relay_attach(r, NULL), OUTBOX_EINVAL, "attach without a connection: OUTBOX_EINVAL");

    is_int(outbox_relay_attach(r, a), 0, "twice: the first attach");
    is_int(outbox_relay_attach(r, a), 0, "twice: the second to the same relay is 0");
    is_int(outbox_relay_attach(r2, a), OUTBOX_ESTATE, "twice: to another relay OUTBOX_ESTATE");
    is_int(insert_while_locked(a, "twice-1", 150, &took), SQLITE_OK,
           "twice: the connection still waits out a lock held 150 ms (%lld ms)", (long long)took);
    outbox_relay_detach(a);
    is_int(wait_ms(a), 5000, "twice: one detach restores the wait of 5000 ms");
    is_int(th_sql_int(a, "PRAGMA wal_autocheckpoint"), 1000, "twice: and auto-checkpoint");
    outbox_relay_detach(a);
    is_int(wait_ms(a), 5000, "twice: a second detach changes nothing");
    is_int(outbox_relay_attach(r2, a), 0, "detached: it may be attached to another relay");
    outbox_relay_detach(a);
    sqlite3_close_v2(a);
}

/* What the wake-up case's loop does, one step per timer tick. */
typedef struct waker {
    outbox_relay *r;
    redisContext *c;
    sqlite3 *db[2];
    uv_timer_t timer;
    int step;      /* 0 connecting, 1 settling, 2 and 3 a commit through db[step - 2], 4 stop, 5 stopping */
    int connected; /* the relay reached Redis */
    int written;   /* the current step's row is committed */
    int64_t t0, took[2];
} waker;

static void on_stopped(outbox_relay *r, void *data)
{
    waker *k = data;
    (void)r;
    uv_close((uv_handle_t *)&k->timer, NULL);
}

static void waker_tick(uv_timer_t *t)
{
    waker *k = t->data;
    int64_t now = th_now_ms();
    outbox_relay_stats st;
    if (k->step == 0) {
        outbox_relay_stats_get(k->r, &st); /* the connection state is current even before a refresh */
        if (st.redis_connected) {
            k->connected = 1;
            k->step = 1;
            k->t0 = now;
        } else if (now - k->t0 > 5000 * th_slow()) {
            k->step = 4;
        }
    } else if (k->step == 1) {
        if (now - k->t0 >= 200) /* the first scan after the connect is over */
            k->step = 2;
    } else if (k->step <= 3) {
        int i = k->step - 2;
        if (!k->written) {
            /* B does not wait for locks: a unit of the relay's may hold the
             * lock at this moment; try again on the next tick. */
            char sql[128];
            snprintf(sql, sizeof sql, "INSERT INTO outbox(id, topic, payload) VALUES ('wake-%d', 'wake', 'x')", i);
            if (sqlite3_exec(k->db[i], sql, NULL, NULL, NULL) == SQLITE_OK) {
                k->written = 1;
                k->t0 = now;
            }
        } else if (th_xlen(k->c, "outbox:wake") >= i + 1 || now - k->t0 > 3000 * th_slow()) {
            k->took[i] = now - k->t0;
            k->written = 0;
            k->step++;
        }
    }
    if (k->step == 4) {
        k->step = 5;
        outbox_relay_stop(k->r, on_stopped, k);
    }
}

/* A commit on each of two attached connections wakes a running relay whose
 * scan timer would not run for a minute. */
static void wake_ups(const char *dir)
{
    th_redis srv;
    uv_loop_t loop;
    outbox_relay_settings s;
    char *path, err[256];
    waker k;
    int i;

    if (th_redis_start(&srv, 0, NULL) != 0) {
        skip("wake-ups: redis-server not available");
        return;
    }
    memset(&k, 0, sizeof k);
    k.took[0] = k.took[1] = -1;
    path = rt_make_db(dir, "wake.db");
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = path;
    s.redis_url = srv.url;
    s.scan_interval_ms = 60000;
    s.log_level = OUTBOX_LOG_WARN;
    is_int(outbox_relay_create(&k.r, &loop, &s, err, sizeof err), 0, "wake: relay created (%s)", err);
    k.c = th_redis_client(&srv);
    k.db[0] = rt_open(path);
    k.db[1] = rt_open(path);
    outbox_db_busy_wait(k.db[1], 0);
    is_int(outbox_relay_attach(k.r, k.db[0]), 0, "wake: attach A (waits 5000 ms)");
    is_int(outbox_relay_attach(k.r, k.db[1]), 0, "wake: attach B (does not wait)");
    is_int(outbox_relay_start(k.r), 0, "wake: relay started");
    uv_timer_init(&loop, &k.timer);
    k.timer.data = &k;
    k.t0 = th_now_ms();
    uv_timer_start(&k.timer, waker_tick, 2, 2);
    uv_run(&loop, UV_RUN_DEFAULT);
    ok(k.connected, "wake: the relay connected to Redis");
    for (i = 0; i < 2; i++)
        ok(k.took[i] >= 0 && k.took[i] < 500 * th_slow(), "wake: a commit on %s is published promptly (%lld ms)",
           i ? "B" : "A", (long long)k.took[i]);
    is_int(th_xlen(k.c, "outbox:wake"), 2, "wake: both messages in the stream");
    for (i = 0; i < 2; i++) {
        outbox_relay_detach(k.db[i]);
        sqlite3_close_v2(k.db[i]);
    }
    outbox_relay_destroy(k.r);
    is_int(uv_loop_close(&loop), 0, "wake: the loop closes: no handle left behind");
    redisFree(k.c);
    th_redis_destroy(&srv);
    free(path);
}

int main(void)
{
    char *dir, err[256];
    uv_loop_t loop;
    outbox_relay_settings s;
    outbox_relay *r, *r2;
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

    db = rt_open(dbpath); /* outbox_db_open: outbox_db_busy_wait(db, 5000) */
    is_int(wait_ms(db), 5000, "writer: outbox_db_open's busy wait of 5000 ms");
    is_int(outbox_relay_attach(r, db), 0, "attach");

    /* A lock held 150 ms by another connection: the writer waits it out. */
    rc = insert_while_locked(db, "m1", 150, &took);
    is_int(rc, SQLITE_OK, "lock held 150 ms: the insert waits and succeeds");
    ok(took >= 100 && took < 400, "and it took about the rest of the hold (%lld ms)", (long long)took);

    /* Detached: outbox_db_open's wait is back, and waits the lock out. */
    outbox_relay_detach(db);
    is_int(wait_ms(db), 5000, "detached: the busy wait of 5000 ms again");
    rc = insert_while_locked(db, "m1b", 150, &took);
    is_int(rc, SQLITE_OK, "detached: a lock held 150 ms is waited out (%lld ms)", (long long)took);

    /* Held longer than a short timeout: BUSY after about that timeout. */
    sqlite3_busy_timeout(db, 300);
    outbox_relay_attach(r, db);
    rc = insert_while_locked(db, "m2", 1500, &took);
    is_int(rc & 0xff, SQLITE_BUSY, "lock held past a 300 ms timeout: SQLITE_BUSY");
    ok(took >= 280 && took < 1000, "after about 300 ms (%lld ms)", (long long)took);
    outbox_relay_detach(db);
    is_int(th_sql_int(db, "PRAGMA busy_timeout"), 300, "detached: busy_timeout 300 again");

    /* A connection that does not wait keeps not waiting. */
    is_int(outbox_db_busy_wait(db, 0), 0, "no wait: outbox_db_busy_wait(db, 0)");
    outbox_relay_attach(r, db);
    is_int(wait_ms(db), 0, "no wait: still none after attach");
    rc = insert_while_locked(db, "m3", 300, &took);
    is_int(rc & 0xff, SQLITE_BUSY, "no wait: SQLITE_BUSY");
    ok(took < 100, "at once (%lld ms)", (long long)took);
    outbox_relay_detach(db);
    is_int(wait_ms(db), 0, "no wait: none after detach");

    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages"), 2, "two rows written (m1, m1b)");
    sqlite3_close_v2(db);

    is_int(outbox_relay_create(&r2, &loop, &s, err, sizeof err), 0, "another relay created (%s)", err);
    two_connections(r);
    wal_hooks(r);
    misuse(r, r2);
    outbox_relay_destroy(r2);
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "loop closes: no handle left behind");
    wake_ups(dir);
    th_rmtree(dir);
    free((char *)dbpath);
    free(dir);
    return tap_done();
}
