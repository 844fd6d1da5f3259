/*
 * test_late_commit.c: another connection's commit that becomes visible only
 * after the relay has looked is still published at once, not at the next
 * fallback scan.
 *
 * The relay notices other connections' commits through a watch on the WAL
 * file and PRAGMA data_version. The watch is off while one of its own units
 * of work runs (its own WAL writes would wake it for nothing), and back on
 * when the loop handles the unit's end. A writer waiting for the lock gets
 * it the moment the unit commits, so it can write its frames before the
 * watch is back (no event), and with a slow fsync its commit becomes visible
 * in the wal-index (data_version) only after the relay's first look. Such a
 * commit once waited for the scan timer.
 *
 * Made to happen here: the relay runs embedded on this test's
 * loop, which spends 20 ms in each iteration while a round runs (an
 * application busy on its loop), so a unit's end is handled well after its
 * COMMIT. Each round commits a trigger row from another connection and
 * waits for its stream entry; then a writer thread waits until it sees the
 * unit that marks that row published hold the write lock (the relay's last
 * unit of the round), and commits one row through a VFS whose fsync takes
 * 150 ms. The scan interval is 60 s: the row must still be in its stream
 * within 2 s. ("Made to happen": in about half the rounds the writer sees
 * that unit's lock; before the relay looked again after its units, 1 to 4
 * of 15 rounds were late in every run.) Under valgrind the timing is not
 * judged (see main).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "shim_vfs.h"
#include "tap.h"

#define ROUNDS 15
#define LATE_LIMIT_MS 2000

typedef struct round_ctx {
    const char *dbpath;
    atomic_int go;       /* the main thread starts a round */
    atomic_int polling;  /* the writer watches the lock */
    atomic_int done;     /* the writer committed (or failed) */
    atomic_int saw_lock; /* the writer saw a unit hold the write lock first */
    atomic_int failed;
    int round;
    int64_t commit_ms; /* when the writer's COMMIT returned */
} round_ctx;

static atomic_int slow_loop;

/* An application busy on the relay's loop: 20 ms per iteration. */
static void on_prepare(uv_prepare_t *h)
{
    int64_t until;
    (void)h;
    if (!atomic_load(&slow_loop))
        return;
    until = th_now_ms() + 20;
    while (th_now_ms() < until)
        ;
}

static int relay_stopped;

static void on_stopped(outbox_relay *r, void *data)
{
    (void)r;
    (void)data;
    relay_stopped = 1;
}

/* Polls the write lock with BEGIN IMMEDIATE (no busy timeout) until it is
 * held by another connection (held = 1: BUSY) or free (held = 0), or
 * give_up passes. Returns whether it saw that. */
static int lock_seen(sqlite3 *w, int held, int64_t give_up)
{
    struct timespec nap = {0, 100000};
    while (th_now_ms() < give_up) {
        int rc = sqlite3_exec(w, "BEGIN IMMEDIATE", NULL, NULL, NULL);
        if (rc == SQLITE_OK)
            sqlite3_exec(w, "ROLLBACK", NULL, NULL, NULL);
        if ((rc == SQLITE_BUSY) == held)
            return 1;
        nanosleep(&nap, NULL);
    }
    return 0;
}

/* The writer thread: one row per round, through the slow-fsync VFS, right
 * after a unit of the relay released the write lock. */
static void *writer_main(void *arg)
{
    round_ctx *x = arg;
    sqlite3 *w = NULL;
    char sql[160];

    if (sqlite3_open_v2(x->dbpath, &w, SQLITE_OPEN_READWRITE, "slowsync") != SQLITE_OK) {
        atomic_store(&x->failed, 1);
        atomic_store(&x->done, 1);
        return NULL;
    }
    sqlite3_exec(w, "PRAGMA synchronous=FULL", NULL, NULL, NULL);
    for (;;) {
        int64_t give_up;
        int rc = SQLITE_OK;
        while (!atomic_load(&x->go))
            sched_yield();
        if (atomic_load(&x->go) < 0)
            break;
        atomic_store(&x->go, 0);
        /* Wait for the unit that marks the trigger row to hold the lock. */
        sqlite3_busy_timeout(w, 0);
        give_up = th_now_ms() + 1000 * th_slow(); /* missed it: commit anyway, a round without the race */
        atomic_store(&x->polling, 1);
        rc = lock_seen(w, 1, give_up) ? SQLITE_BUSY : SQLITE_OK;
        atomic_store(&x->saw_lock, rc == SQLITE_BUSY);
        /* Now wait for it (SQLite's busy handler: first retry after 1 ms;
         * under valgrind the relay's unit runs slowly beside the busy loop). */
        sqlite3_busy_timeout(w, 5000 * th_slow());
        snprintf(sql, sizeof sql,
                 "BEGIN IMMEDIATE; INSERT INTO outbox(id, topic, payload) VALUES ('late-%d', 'late', x'01'); COMMIT",
                 x->round);
        atomic_store(&sync_delay_us, 150000);
        if (sqlite3_exec(w, sql, NULL, NULL, NULL) != SQLITE_OK) {
            diag("writer: %s", sqlite3_errmsg(w));
            sqlite3_exec(w, "ROLLBACK", NULL, NULL, NULL);
            atomic_store(&x->failed, 1);
        }
        atomic_store(&sync_delay_us, 0);
        x->commit_ms = th_now_ms();
        atomic_store(&x->done, 1);
    }
    sqlite3_close_v2(w);
    return NULL;
}

/* Whether the stream holds id (XRANGE over the small test stream). */
static int stream_has(redisContext *c, const char *stream, const char *id)
{
    rt_stream s = rt_stream_read(c, stream);
    int found = 0;
    for (size_t i = 0; i < s.n; i++)
        if (s.e[i].id && strcmp(s.e[i].id, id) == 0)
            found = 1;
    rt_stream_free(&s);
    return found;
}

int main(void)
{
    th_redis srv;
    redisContext *c;
    sqlite3 *db;
    char *dir, *dbpath, err[512], id[32];
    uv_loop_t loop;
    uv_prepare_t prep;
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    round_ctx x;
    pthread_t th;
    int late = 0, locked = 0, rounds, done_rounds = 0, i;
    int64_t worst = 0;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    shim_register("slowsync", 0);
    uv_loop_init(&loop);
    uv_prepare_init(&loop, &prep);
    uv_prepare_start(&prep, on_prepare);
    outbox_relay_defaults(&s);
    s.db_path = dbpath;
    s.redis_url = srv.url;
    /* The fallback must not be what finds the row. Under valgrind, which
     * runs one thread at a time, the busy loop starves the writer and its
     * commit can take longer than the relay's looks after a unit: there the
     * run only checks memory, and the scan finds such rows. */
    s.scan_interval_ms = th_slow() > 1 ? 2000 : 60000;
    s.log_level = OUTBOX_LOG_WARN;
    if (outbox_relay_create(&r, &loop, &s, err, sizeof err) != 0)
        bail("relay: %s", err);
    is_int(outbox_relay_start(r), 0, "relay started");

    memset(&x, 0, sizeof x);
    x.dbpath = dbpath;
    if (pthread_create(&th, NULL, writer_main, &x) != 0)
        bail("pthread_create");

    /* Warm-up: connected, and the stream exists. */
    rt_insert_rows(db, "warm", 0, 1, "late", 0);
    for (i = 0; i < 500 * th_slow() && !stream_has(c, "outbox:late", "warm-000000"); i++)
        uv_run(&loop, UV_RUN_NOWAIT), th_sleep_ms(10);
    ok(stream_has(c, "outbox:late", "warm-000000"), "warm-up row published");

    rounds = th_slow() > 1 ? 4 : ROUNDS; /* under valgrind each round takes seconds */
    /* Whether the writer meets the unit's lock is chance (about half the
     * rounds on a quiet machine, fewer on a loaded one): rounds go on, up to
     * three times as many, until it did at least once. */
    for (int round = 0; round < rounds || (locked == 0 && round < 3 * rounds); round++) {
        int64_t seen_ms = 0, start;
        /* A row by another connection makes the relay run a unit; the
         * writer commits right after it. */
        char trig[32];
        x.round = round;
        atomic_store(&x.done, 0);
        atomic_store(&x.polling, 0);
        rt_insert_rows(db, "trigger", round, 1, "late", 0);
        snprintf(trig, sizeof trig, "trigger-%06d", round);
        start = th_now_ms();
        while (!stream_has(c, "outbox:late", trig) && th_now_ms() - start < 5000 * th_slow())
            uv_run(&loop, UV_RUN_NOWAIT);
        /* Its XADD is done: the unit that marks it is the next (and last).
         * The loop does not turn until the writer watches the lock. */
        atomic_store(&x.go, 1);
        while (!atomic_load(&x.polling))
            sched_yield();
        atomic_store(&slow_loop, 1);
        start = th_now_ms();
        while (!atomic_load(&x.done) && th_now_ms() - start < 10000 * th_slow())
            uv_run(&loop, UV_RUN_NOWAIT);
        atomic_store(&slow_loop, 0);
        if (!atomic_load(&x.done) || atomic_load(&x.failed)) {
            ok(0, "round %d: the writer committed", round);
            break;
        }
        locked += atomic_load(&x.saw_lock);
        done_rounds++;
        snprintf(id, sizeof id, "late-%d", round);
        while (th_now_ms() - x.commit_ms < LATE_LIMIT_MS * th_slow()) {
            uv_run(&loop, UV_RUN_NOWAIT);
            if (stream_has(c, "outbox:late", id)) {
                seen_ms = th_now_ms();
                break;
            }
            th_sleep_ms(2);
        }
        if (!seen_ms) {
            late++;
            diag("round %d: %s not in its stream %d ms after its commit", round, id, LATE_LIMIT_MS * th_slow());
        } else if (seen_ms - x.commit_ms > worst) {
            worst = seen_ms - x.commit_ms;
        }
    }
    /* How often the race was made to happen: reported, not judged (it is
     * chance, and some machines never show it); the judgement is below. */
    diag("the writer met the marking unit's lock in %d of %d rounds", locked, done_rounds);
    is_int(late, 0, "every late-visible commit published without the fallback scan (worst %lld ms)",
           (long long)worst);

    atomic_store(&x.go, -1);
    pthread_join(th, NULL);
    outbox_relay_stop(r, on_stopped, NULL);
    while (!relay_stopped)
        uv_run(&loop, UV_RUN_ONCE);
    outbox_relay_destroy(r);
    uv_close((uv_handle_t *)&prep, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "loop closed cleanly");
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
