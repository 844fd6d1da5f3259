/*
 * wake.c: noticing commits and checkpointing. An attached connection's
 * commit or outbox_relay_wake() wakes the relay through a uv_async; another
 * process's commit is noticed through a watch on the WAL file and PRAGMA
 * data_version; the scan timer (sched.c) is the fallback. The relay's WAL
 * hook turns SQLite's auto-checkpoint off on its connection, so checkpoints
 * run here, on a worker thread with a connection of their own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay_int.h"

static void on_wal_change(uv_fs_event_t *h, const char *filename, int events, int status);

static void ckpt_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    if (!r->ckpt.db) {
        if (sqlite3_open_v2(r->cfg.db_path, &r->ckpt.db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) !=
            SQLITE_OK) {
            sqlite3_close_v2(r->ckpt.db);
            r->ckpt.db = NULL;
            return;
        }
        sqlite3_busy_timeout(r->ckpt.db, 0);
        outbox__relay_db_no_close_ckpt(r, r->ckpt.db);
    }
    /* A connection that has not read anything has not opened the WAL yet,
     * and a checkpoint through it silently does nothing (SQLite 3.40
     * returns SQLITE_OK with a log size of -1): read first. */
    sqlite3_exec(r->ckpt.db, "SELECT count(*) FROM sqlite_master", NULL, NULL, NULL);
    /* PASSIVE never waits for readers or writers, but under a steady stream
     * of commits it never catches up with the end of the WAL either, and the
     * WAL is only rewound once a checkpoint did. So when the WAL has grown
     * large, RESTART: it waits (here, off the loop, at most 200 ms) for a
     * moment without a writer, which the relay leaves between transactions,
     * and lets the next writer start the WAL from its beginning again. */
    if (r->ckpt.restart) {
        sqlite3_busy_timeout(r->ckpt.db, 200);
        if (sqlite3_wal_checkpoint_v2(r->ckpt.db, NULL, SQLITE_CHECKPOINT_RESTART, NULL, NULL) == SQLITE_OK) {
            sqlite3_busy_timeout(r->ckpt.db, 0);
            return;
        }
        sqlite3_busy_timeout(r->ckpt.db, 0);
    }
    sqlite3_wal_checkpoint_v2(r->ckpt.db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
}

static void ckpt_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    (void)status;
    r->ckpt.running = 0;
    if (r->ckpt.db)
        r->stats.checkpoints_total++; /* opened: the checkpoint ran */
    r->hooks.stop_check(r);
}

/* A checkpoint starts from 1000 WAL pages (SQLite's own default), or from
 * 8000 while a backlog drains (its last claim was full), where fewer copies
 * of the same pages pay (docs/ARCHITECTURE.md, "Checkpoints"); and, while
 * the WAL was not started over since the last checkpoint (a writer that
 * never pauses keeps it from that), only once it grew by as much again:
 * every checkpoint ends in an fsync of the database file, and one after
 * every commit slowed the fsyncs of the application's durable commits. */
void outbox__wake_checkpoint(outbox_relay *r, int pages)
{
    int at = r->sched.last_claim_full ? 8000 : 1000;
    if (pages < at || r->ckpt.running || r->state != R_RUNNING)
        return;
    if (pages >= r->ckpt.last_pages && pages - r->ckpt.last_pages < at)
        return;
    r->ckpt.last_pages = pages;
    __atomic_store_n(&r->ckpt.pages, 0, __ATOMIC_RELAXED);
    r->ckpt.restart = pages >= 16000; /* about 64 MiB of WAL with 4 KiB pages */
    r->ckpt.work.data = r;
    if (uv_queue_work(r->loop, &r->ckpt.work, ckpt_run, ckpt_done) == 0)
        r->ckpt.running = 1;
}

/* Runs on the thread that committed (a unit's worker, or the loop for
 * retention): the committer starts the checkpoint afterwards. */
int outbox__wake_own_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    outbox_relay *r = arg;
    (void)db;
    (void)name;
    r->ckpt.own_pages = pages;
    return SQLITE_OK;
}

/* Runs on the application's thread, right after its commit. */
static void on_wake(uv_async_t *a)
{
    outbox_relay *r = a->data;
    int pages = __atomic_load_n(&r->ckpt.pages, __ATOMIC_RELAXED);
    if (pages)
        outbox__wake_checkpoint(r, pages);
    r->hooks.schedule(r);
}

/* Schedules work and returns 1 if another connection committed since the
 * last look. Our own commits do not change data_version. */
int outbox__wake_dv_changed(outbox_relay *r)
{
    int64_t v = 0;
    if (r->sched.running) {
        /* The connection is the unit's: look when it is done (the re-check
         * timer keeps going meanwhile). */
        r->wake.dv_pending = 1;
        return 0;
    }
    outbox__relay_step_int(r, Q(r, q_data_version), 0, &v);
    if (v == r->wake.data_version)
        return 0;
    r->wake.data_version = v;
    r->wake.foreign_commit_ms = uv_now(r->loop);
    r->hooks.schedule(r);
    return 1;
}

/*
 * The relay's own commits write to the WAL too, and each write would wake
 * the loop through the watch (and start the re-checks) for nothing: the
 * watch is off while a unit runs. Commits of others in the meantime are
 * caught by a data_version check when it is back on (wal_watch_resume
 * returns 1), so none is missed.
 */
void outbox__wake_pause(outbox_relay *r)
{
    if (!r->wake.wal_watch_active)
        return;
    uv_fs_event_stop(&r->wake.wal_watch);
    r->wake.wal_watch_active = 0;
}

int outbox__wake_resume(outbox_relay *r)
{
    if (r->wake.wal_watch_active || !r->wake.wal_path || r->state != R_RUNNING)
        return 0;
    if (uv_fs_event_start(&r->wake.wal_watch, on_wal_change, r->wake.wal_path, 0) == 0)
        r->wake.wal_watch_active = 1;
    return 1;
}

static void on_wal_recheck(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    if (r->state != R_RUNNING || outbox__wake_dv_changed(r) || r->wake.wal_rechecks >= 8)
        return;
    r->wake.wal_rechecks++;
    uv_timer_start(&r->wake.wal_timer, on_wal_recheck, 1u << r->wake.wal_rechecks, 0);
}

/*
 * After a change to the WAL file, or after a unit (the watch was off while
 * it ran): has another connection committed? A commit writes its frames to
 * the WAL, syncs them, and only then publishes them in the wal-index, which
 * is what data_version reads: the last event of another connection's commit
 * comes before the commit is visible, and a writer that took the lock right
 * after the unit's COMMIT wrote its frames before the watch was back on (no
 * event at all). Unless data_version moved, look again shortly (1, 2, 4 ...
 * 256 ms); without these looks such a commit waited for the scan timer.
 */
void outbox__wake_look(outbox_relay *r)
{
    if (r->state != R_RUNNING)
        return;
    if (r->redis.shared && uv_is_active((uv_handle_t *)&r->wake.wal_timer) &&
        uv_timer_get_due_in(&r->wake.wal_timer) <= 1) {
        /* A group's relay: a look is due within a millisecond anyway (the
         * group's watch hands on every write, most of them the relay's
         * own): it comes, then the re-checks start over from it. A relay
         * of its own pauses its watch while it writes, and looks at once. */
        r->wake.wal_rechecks = 0;
        return;
    }
    if (outbox__wake_dv_changed(r))
        return;
    r->wake.wal_rechecks = 0;
    uv_timer_start(&r->wake.wal_timer, on_wal_recheck, 1, 0);
}

static void on_wal_change(uv_fs_event_t *h, const char *filename, int events, int status)
{
    (void)filename;
    (void)events;
    if (status == 0)
        outbox__wake_look(h->data);
}

void outbox_relay_wake(outbox_relay *r)
{
    if (r)
        outbox__wake_send(r);
}

int outbox__wake_init(outbox_relay *r)
{
    char walpath[4200];
    uv_timer_init(r->loop, &r->wake.wal_timer);
    uv_async_init(r->loop, &r->wake.async, on_wake);
    r->wake.async.data = r->wake.wal_timer.data = r;
    __atomic_store_n(&r->wake.ready, 1, __ATOMIC_RELEASE);
    uv_fs_event_init(r->loop, &r->wake.wal_watch);
    r->wake.wal_watch.data = r;
    snprintf(walpath, sizeof walpath, "%s-wal", r->cfg.db_path);
    if (r->redis.shared) {
        /* A group's relay: the group's watch on the directory hands the
         * changes on (outbox__wake_look); a watch each would cost an
         * inotify watch per open database, added and removed per unit. */
    } else if (uv_fs_event_start(&r->wake.wal_watch, on_wal_change, walpath, 0) == 0) {
        r->wake.wal_watch_active = 1;
        r->wake.wal_path = strdup(walpath);
    } else {
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"cannot watch the WAL file; timer scans only\" path=%s", walpath);
    }
    outbox__relay_step_int(r, Q(r, q_data_version), 0, &r->wake.data_version);
    return 3;
}

void outbox__wake_stop(outbox_relay *r)
{
    if (r->wake.wal_watch_active)
        uv_fs_event_stop(&r->wake.wal_watch);
    uv_timer_stop(&r->wake.wal_timer);
}

void outbox__wake_close(outbox_relay *r, uv_close_cb cb)
{
    uv_close((uv_handle_t *)&r->wake.wal_timer, cb);
    __atomic_store_n(&r->wake.ready, 0, __ATOMIC_RELEASE);
    uv_close((uv_handle_t *)&r->wake.async, cb);
    uv_close((uv_handle_t *)&r->wake.wal_watch, cb);
}

void outbox__wake_send(outbox_relay *r)
{
    if (__atomic_load_n(&r->wake.ready, __ATOMIC_ACQUIRE)) /* before start: nothing to wake yet */
        uv_async_send(&r->wake.async);
}
