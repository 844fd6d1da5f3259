/*
 * retention.c: deleting published rows older than --retention-ms, never
 * dead ones. A step is one transaction on a libuv worker thread, with a
 * connection of its own (like checkpoints, wake.c), so that the loop goes on
 * publishing while it runs; it ends after RET_BUDGET_NS with the write lock
 * or --retention-batch rows, whichever comes first, so that an application's
 * writer never waits long for the lock either. The timer that starts steps
 * and the accounting of their results are the loop thread's.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "relay_int.h"
#include "sql.h"

/* A step's transaction holds the write lock this long (ns) at most, apart
 * from the one statement that crosses it (a batch's rows, or RET_CHUNK rows
 * published on their own). 1 ms is the first nap of SQLite's own busy
 * handler: an application writer that meets a step mostly gets the lock at
 * its first retry. */
#define RET_BUDGET_NS 1000000u

/* Rows published on their own are deleted this many per statement, so that
 * the budget is checked often. */
#define RET_CHUNK 128

/* After a full step (more rows due), the next waits a multiple of the time
 * the step held the write lock, and at least a few ms, by how far
 * retention is behind (the oldest published row left against the cutoff):
 * while less than a second, nine times (the lock is retention's a tenth of
 * the time at most, so an application's writer, whose busy handler sleeps
 * for milliseconds between tries, as SQLite's own does, rarely meets a step
 * twice); up to 5 s behind, three times; further behind, as long as the
 * step (half the lock), so that retention catches up with any writer the
 * relay keeps up with. A step deletes some 200-500 rows a millisecond here
 * (its connection's cache is cold after every other connection's commit). */
static const struct {
    int64_t behind_ms; /* this far behind at most */
    unsigned factor, min_ms;
} ret_pace[] = {{1000, 9, 5}, {5000, 3, 2}, {INT64_MAX, 1, 1}};

/* A step that found the write lock taken comes again this much later
 * (ms); it never waits for the lock (the connection's busy timeout is 0):
 * waiting in short naps, it won the lock over an application's writer,
 * whose busy handler sleeps milliseconds between tries, again and again,
 * and the writer fell behind (docs/ARCHITECTURE.md, "retention.c"). */
#define RET_BUSY_RETRY_MS 2

static void on_retention(uv_timer_t *t);

/* Worker thread, after the step's commit: the WAL's size, for the
 * checkpoint the loop starts once the step is done. The hook turns
 * auto-checkpoint off on this connection: a checkpoint inside the commit
 * would only lengthen the step. */
static int ret_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    struct relay_retention *rt = arg;
    (void)db;
    (void)name;
    rt->pages = pages;
    return SQLITE_OK;
}

/* Retention's statements, prepared on its connection (SQL in sql.h). */
static const struct {
    size_t off;
    const char *sql;
} ret_stmts[] = {
#define STMT(field, sql) {offsetof(struct relay_retention, field), sql}
    STMT(q_rows, OUTBOX__SQL_RETENTION),
    STMT(q_batches, OUTBOX__SQL_RETENTION_BATCHES),
    STMT(q_batch_rows, OUTBOX__SQL_RETENTION_BATCH_ROWS),
    STMT(q_batch, OUTBOX__SQL_RETENTION_BATCH),
    STMT(q_oldest, OUTBOX__SQL_RETENTION_OLDEST),
    STMT(q_holes, OUTBOX__SQL_RETENTION_HOLES),
#undef STMT
};

static sqlite3_stmt **ret_stmt_at(struct relay_retention *rt, size_t i)
{
    return (sqlite3_stmt **)(void *)((char *)rt + ret_stmts[i].off);
}

/* Worker thread: the connection and its statements, on the first step. */
static int ret_open(outbox_relay *r, struct relay_retention *rt)
{
    size_t i;
    int e = outbox_db_open(r->cfg.db_path, OUTBOX_OPEN_RELAY, &rt->db, rt->err, sizeof rt->err);
    if (e != 0)
        return e;
    outbox__relay_db_no_close_ckpt(r, rt->db);
    sqlite3_wal_hook(rt->db, ret_wal_hook, rt);
    for (i = 0; i < OUTBOX_ARRAY_LEN(ret_stmts); i++)
        if (sqlite3_prepare_v3(rt->db, ret_stmts[i].sql, -1, SQLITE_PREPARE_PERSISTENT, ret_stmt_at(rt, i), NULL) !=
            SQLITE_OK) {
            snprintf(rt->err, sizeof rt->err, "cannot prepare a retention statement: %s", sqlite3_errmsg(rt->db));
            return OUTBOX_ESQLITE;
        }
    return 0;
}

/* Runs st bound to a and b; SQLITE_DONE, or the failure's code. */
static int ret_exec(sqlite3_stmt *st, int64_t a, int64_t b)
{
    int rc;
    sqlite3_bind_int64(st, 1, a);
    sqlite3_bind_int64(st, 2, b);
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc;
}

/*
 * One step, on a worker thread: rows published on their own, then whole
 * published batches, oldest first, each with its rows that have no state
 * of their own (a dead or waiting row in a batch's range stays), until
 * the budget or rt->limit rows (at least one batch), then the holes left
 * below every range. Sets rt->deleted,
 * rt->full (stopped by the budget or the limit: more may be due) and
 * rt->rc (the SQLite code of a failure, SQLITE_OK if none).
 */
static void ret_step(struct relay_retention *rt)
{
    sqlite3 *db = rt->db;
    int64_t n = 0, lo, hi;
    uint64_t t0;
    int rc, step;

    rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        goto out;
    t0 = uv_hrtime(); /* the budget counts from the lock */
    for (;;) {
        int64_t want = rt->limit - n < RET_CHUNK ? rt->limit - n : RET_CHUNK;
        int changed;
        rc = ret_exec(rt->q_rows, rt->cutoff, want);
        if (rc != SQLITE_DONE)
            goto fail;
        changed = sqlite3_changes(db);
        n += changed;
        if (changed < want)
            break; /* none left */
        if (n >= rt->limit || uv_hrtime() - t0 >= RET_BUDGET_NS) {
            rt->full = 1;
            goto commit;
        }
    }
    while (n < rt->limit) {
        if (n > 0 && uv_hrtime() - t0 >= RET_BUDGET_NS) {
            rt->full = 1;
            break;
        }
        sqlite3_bind_int64(rt->q_batches, 1, rt->cutoff);
        sqlite3_bind_int64(rt->q_batches, 2, 1);
        step = sqlite3_step(rt->q_batches);
        lo = step == SQLITE_ROW ? sqlite3_column_int64(rt->q_batches, 0) : 0;
        hi = step == SQLITE_ROW ? sqlite3_column_int64(rt->q_batches, 1) : 0;
        sqlite3_reset(rt->q_batches);
        if (step == SQLITE_DONE)
            break;
        if (step != SQLITE_ROW) {
            rc = step;
            goto fail;
        }
        /* The record first: its rows then lie in no batch's range, and
         * their deletes write no holes (outbox_gone_after_delete). */
        sqlite3_bind_int64(rt->q_batch, 1, lo);
        rc = sqlite3_step(rt->q_batch);
        sqlite3_reset(rt->q_batch);
        if (rc != SQLITE_DONE)
            goto fail;
        rc = ret_exec(rt->q_batch_rows, lo, hi);
        if (rc != SQLITE_DONE)
            goto fail;
        n += sqlite3_changes(db);
    }
    if (n >= rt->limit)
        rt->full = 1;
commit:
    if (n > 0) {
        rc = sqlite3_step(rt->q_holes);
        sqlite3_reset(rt->q_holes);
        if (rc != SQLITE_DONE)
            goto fail;
    }
    /* The oldest row left: how far behind retention is, or when the next
     * becomes due. */
    step = sqlite3_step(rt->q_oldest);
    if (step == SQLITE_ROW && sqlite3_column_type(rt->q_oldest, 0) != SQLITE_NULL)
        rt->oldest = sqlite3_column_int64(rt->q_oldest, 0);
    sqlite3_reset(rt->q_oldest);
    rc = sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    if (rc == SQLITE_OK) {
        rt->deleted = n;
        rt->held_ns = uv_hrtime() - t0;
        goto out;
    }
fail:
    rt->full = 0;
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
out:
    rt->rc = rc;
}

static void ret_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    struct relay_retention *rt = &r->ret;
    rt->deleted = 0;
    rt->full = 0;
    rt->pages = 0;
    rt->held_ns = 0;
    rt->oldest = -1;
    rt->err[0] = '\0';
    if (!rt->db && ret_open(r, rt) != 0) {
        rt->rc = SQLITE_CANTOPEN;
        outbox__retention_close_db(rt);
        return;
    }
    ret_step(rt);
}

static void ret_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    struct relay_retention *rt = &r->ret;
    uint64_t delay;
    (void)status;
    rt->running = 0;
    if (rt->err[0]) {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"retention cannot open its database connection\" error=\"%s\"", rt->err);
        delay = 10000;
    } else if (rt->rc == SQLITE_OK) {
        r->stats.retention_deleted += (uint64_t)rt->deleted;
        if (rt->deleted)
            LOG(r, OUTBOX_LOG_DEBUG, "msg=\"retention deleted published rows\" count=%lld held_us=%llu",
                (long long)rt->deleted, (unsigned long long)(rt->held_ns / 1000));
        /* A full step means more are due: the next after a pause (see
         * ret_pace). A pass that deleted rows comes again in a
         * quarter of a second: rows are coming in, and small, even passes
         * keep the table at its size. One that found nothing comes two
         * seconds after the oldest published row becomes due (between 1 and
         * 10 s from now), so that the first pass under a steady writer finds
         * the table larger than the later passes, every quarter of a second,
         * leave it, with room for a writer's bursts: the file does not grow
         * after it (with one second, it grew by 4 % in one run of two). */
        if (rt->full) {
            int64_t behind = rt->oldest >= 0 ? rt->cutoff - rt->oldest : 0;
            size_t i = 0;
            while (behind > ret_pace[i].behind_ms)
                i++;
            delay = ret_pace[i].factor * rt->held_ns / 1000000;
            if (delay < ret_pace[i].min_ms)
                delay = ret_pace[i].min_ms;
        } else if (rt->deleted) {
            delay = 250;
        } else if (rt->oldest < 0) {
            delay = 10000;
        } else {
            int64_t due = rt->oldest + (int64_t)r->cfg.s.retention_ms + 2000 - outbox_now_ms();
            delay = due < 1000 ? 1000 : due > 10000 ? 10000 : (uint64_t)due;
        }
    } else if ((rt->rc & 0xff) == SQLITE_BUSY) {
        /* Again soon, or a writer committing all the time would put
         * retention off again and again. */
        delay = RET_BUSY_RETRY_MS;
    } else {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"retention delete failed\" error=\"%s\"", sqlite3_errstr(rt->rc));
        delay = 10000;
    }
    if (rt->pages)
        outbox__wake_checkpoint(r, rt->pages);
    if (r->state == R_RUNNING)
        uv_timer_start(&rt->timer, on_retention, delay, 0);
    r->hooks.stop_check(r);
}

static void on_retention(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    struct relay_retention *rt = &r->ret;
    if (r->state != R_RUNNING || rt->running)
        return;
    rt->cutoff = outbox_now_ms() - (int64_t)r->cfg.s.retention_ms;
    rt->limit = (int64_t)r->cfg.s.retention_batch;
    rt->work.data = r;
    if (uv_queue_work(r->loop, &rt->work, ret_run, ret_done) == 0)
        rt->running = 1;
}

int outbox__retention_start(outbox_relay *r)
{
    uv_timer_init(r->loop, &r->ret.timer);
    r->ret.timer.data = r;
    if (r->cfg.s.retention_ms)
        uv_timer_start(&r->ret.timer, on_retention, 1000, 0);
    return 1;
}

void outbox__retention_stop(outbox_relay *r)
{
    uv_timer_stop(&r->ret.timer);
}

void outbox__retention_close(outbox_relay *r, uv_close_cb cb)
{
    uv_close((uv_handle_t *)&r->ret.timer, cb);
}

void outbox__retention_close_db(struct relay_retention *rt)
{
    size_t i;
    for (i = 0; i < OUTBOX_ARRAY_LEN(ret_stmts); i++) {
        sqlite3_finalize(*ret_stmt_at(rt, i));
        *ret_stmt_at(rt, i) = NULL;
    }
    if (rt->db) {
        sqlite3_wal_hook(rt->db, NULL, NULL);
        sqlite3_close_v2(rt->db);
        rt->db = NULL;
    }
}
