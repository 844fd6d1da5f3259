/*
 * test_vfs_faults.c: the relay on a database whose I/O fails.
 *
 * A shim VFS, registered as the default before the relay opens its
 * connections, delegates every call to the real default VFS and, while a
 * global switch is on, makes xWrite fail (SQLITE_IOERR_WRITE or SQLITE_FULL)
 * and xSync fail (SQLITE_IOERR_FSYNC), in short windows or for the next K
 * calls. The relay runs embedded on this test's loop and drains a backlog
 * while the windows come and go. Afterwards (faults off): no row is marked
 * published without its entry in the stream, the relay logged the errors and
 * its loop kept turning, and a final clean drain publishes everything.
 *
 * Part 2: a second connection holds BEGIN IMMEDIATE for 2 s while the relay
 * drains; a 10 ms timer on the same loop must keep firing all along.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "shim_vfs.h"
#include "tap.h"

static atomic_int log_db_errors, log_mark_errors, log_errors, log_lines;

static void count_log(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    atomic_fetch_add(&log_lines, 1);
    if (strstr(msg, "database error"))
        atomic_fetch_add(&log_db_errors, 1);
    if (strstr(msg, "database error") && strstr(msg, "during=mark"))
        atomic_fetch_add(&log_mark_errors, 1);
    if (level == OUTBOX_LOG_ERROR && atomic_fetch_add(&log_errors, 1) < 3)
        diag("relay log: %s", msg);
}

static void relay_settings(outbox_relay_settings *s, const char *db, const char *url)
{
    outbox_relay_defaults(s);
    s->db_path = db;
    s->redis_url = url;
    s->worker_id = "faults";
    s->batch = 20;
    s->inflight = 40;
    s->scan_interval_ms = 20;
    s->lease_ms = 3000;
    s->reply_timeout_ms = 2000;
    s->connect_timeout_ms = 2000;
    s->backoff_min_ms = 20;
    s->backoff_max_ms = 200;
    s->retention_ms = 0;
    s->log = count_log;
    s->log_level = OUTBOX_LOG_INFO;
}

/* Runs a fresh relay in drain mode on its own loop until it stops itself. */
static int final_drain(const char *db, const char *url)
{
    uv_loop_t loop;
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    char err[512];
    int64_t t0 = th_now_ms();
    uv_loop_init(&loop);
    relay_settings(&s, db, url);
    s.batch = 512;
    s.inflight = 8192;
    s.drain = 1;
    if (outbox_relay_create(&r, &loop, &s, err, sizeof err) != 0)
        bail("final drain relay: %s", err);
    outbox_relay_start(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    diag("final drain: %lld ms", (long long)(th_now_ms() - t0));
    return uv_loop_close(&loop);
}

/* Rows in state 2 whose id has no entry in the stream. */
static long published_not_in_stream(sqlite3 *db, redisContext *c, const char *stream)
{
    rt_stream st = rt_stream_read(c, stream);
    rt_map *m = rt_map_new();
    sqlite3_stmt *q = NULL;
    long bad = 0;
    size_t i;
    for (i = 0; i < st.n; i++)
        if (st.e[i].id)
            rt_map_add(m, st.e[i].id, 0);
    if (sqlite3_prepare_v2(db, "SELECT id FROM outbox_messages WHERE state = 2", -1, &q, NULL) != SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    while (sqlite3_step(q) == SQLITE_ROW) {
        const char *id = (const char *)sqlite3_column_text(q, 0);
        if (!rt_map_get(m, id, NULL) && bad++ < 3)
            diag("published row %s has no stream entry", id);
    }
    sqlite3_finalize(q);
    rt_map_free(m);
    rt_stream_free(&st);
    return bad;
}

/* ---- part 1: fault windows during a drain ------------------------------ */

/* n rows with 3 KB payloads, so that the WAL grows and the relay's
 * checkpoints (which sync) run during the test. */
static void insert_big(sqlite3 *db, const char *prefix, int first, int n, const char *topic, int nkeys)
{
    sqlite3_stmt *st = NULL;
    static char payload[3000];
    int i;
    memset(payload, 'p', sizeof payload);
    th_sql_exec(db, "BEGIN IMMEDIATE");
    if (sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)", -1, &st,
                           NULL) != SQLITE_OK)
        bail("prepare insert: %s", sqlite3_errmsg(db));
    for (i = first; i < first + n; i++) {
        char id[64], key[32];
        snprintf(id, sizeof id, "%s-%06d", prefix, i);
        snprintf(key, sizeof key, "k%d", i % nkeys);
        sqlite3_bind_text(st, 1, id, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, topic, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 3, key, -1, SQLITE_TRANSIENT);
        sqlite3_bind_blob(st, 4, payload, (int)sizeof payload, SQLITE_STATIC);
        if (sqlite3_step(st) != SQLITE_DONE)
            bail("insert: %s", sqlite3_errmsg(db));
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    th_sql_exec(db, "COMMIT");
}

#define INITIAL_ROWS 2000
#define SCHEDULE_MS 1600
#define CYCLE_MS 80

typedef struct p1 {
    uv_loop_t *loop;
    outbox_relay *r;
    sqlite3 *app; /* the test's own connection, used only with faults off */
    uv_timer_t tick, beat;
    int64_t t0;
    int faulting, next_row, windows, stopping, stopped;
    long beats, beats_in_fault;
    int64_t fault_ms_total, fault_since;
} p1;

static void p1_beat(uv_timer_t *t)
{
    p1 *p = t->data;
    p->beats++;
    if (p->faulting)
        p->beats_in_fault++;
}

static void p1_on_stopped(outbox_relay *r, void *data)
{
    p1 *p = data;
    (void)r;
    p->stopped = 1;
    uv_close((uv_handle_t *)&p->tick, NULL);
    uv_close((uv_handle_t *)&p->beat, NULL);
}

static void p1_tick(uv_timer_t *t)
{
    p1 *p = t->data;
    int64_t el = th_now_ms() - p->t0;
    if (p->stopping)
        return;
    if (el < SCHEDULE_MS) {
        int cycle = (int)(el / CYCLE_MS), on = (el % CYCLE_MS) < CYCLE_MS / 2;
        if (on && !p->faulting) {
            p->faulting = 1;
            p->windows++;
            p->fault_since = th_now_ms();
            switch (cycle % 5) {
            case 0: /* every write fails for the window */
                atomic_store(&write_fail_code, SQLITE_IOERR_WRITE);
                atomic_store(&write_fail_left, 1000000);
                break;
            case 1: /* disk full */
                atomic_store(&write_fail_code, SQLITE_FULL);
                atomic_store(&write_fail_left, 1000000);
                break;
            case 2: /* every sync fails */
                atomic_store(&sync_fail_left, 1000000);
                break;
            case 3: /* both */
                atomic_store(&write_fail_code, SQLITE_IOERR_WRITE);
                atomic_store(&write_fail_left, 1000000);
                atomic_store(&sync_fail_left, 1000000);
                break;
            default: /* just the next few calls */
                atomic_store(&write_fail_code, SQLITE_IOERR_WRITE);
                atomic_store(&write_fail_left, 3);
                atomic_store(&sync_fail_left, 2);
                break;
            }
        } else if (!on && p->faulting) {
            faults_off();
            p->faulting = 0;
            p->fault_ms_total += th_now_ms() - p->fault_since;
            /* More work arrives between the windows. */
            insert_big(p->app, "late", p->next_row, 80, "faults", 7);
            p->next_row += 80;
            outbox_relay_wake(p->r);
        }
        return;
    }
    if (p->faulting) {
        faults_off();
        p->faulting = 0;
        p->fault_ms_total += th_now_ms() - p->fault_since;
    }
    {
        outbox_relay_stats st;
        int done = outbox_relay_stats_get(p->r, &st) == 0 && st.pending == 0 && st.sending == 0 &&
                   st.inflight == 0;
        if (done) {
            int nlog = -1, nckpt = -1;
            int crc = sqlite3_wal_checkpoint_v2(p->app, NULL, SQLITE_CHECKPOINT_PASSIVE, &nlog, &nckpt);
            diag("drained; a PASSIVE checkpoint from the test: rc %d, WAL %d frames, %d checkpointed, %ld syncs so far",
                 crc, nlog, nckpt, (long)syncs_total);
        }
        if (done || el > 25000) {
            if (!done)
                diag("relay did not finish: pending %lld sending %lld inflight %llu", (long long)st.pending,
                     (long long)st.sending, (unsigned long long)st.inflight);
            p->stopping = 1;
            outbox_relay_stop(p->r, p1_on_stopped, p);
        }
    }
}

static void part1(th_redis *srv, redisContext *c, const char *dir)
{
    uv_loop_t loop;
    outbox_relay_settings s;
    char err[512], *db;
    p1 p;
    sqlite3 *chk;
    rt_audit a;
    int64_t t0 = th_now_ms();
    int rc;

    memset(&p, 0, sizeof p);
    db = rt_make_db(dir, "faults.db");
    p.app = rt_open(db);
    rt_insert_rows(p.app, "early", 0, INITIAL_ROWS, "faults", 7);

    uv_loop_init(&loop);
    p.loop = &loop;
    relay_settings(&s, db, srv->url);
    rc = outbox_relay_create(&p.r, &loop, &s, err, sizeof err);
    if (rc != 0)
        bail("relay create: %s", err);
    is_int(outbox_relay_start(p.r), 0, "relay starts");
    uv_timer_init(&loop, &p.tick);
    uv_timer_init(&loop, &p.beat);
    p.tick.data = p.beat.data = &p;
    p.t0 = th_now_ms();
    uv_timer_start(&p.tick, p1_tick, 1, 2);
    uv_timer_start(&p.beat, p1_beat, 5, 5);
    uv_run(&loop, UV_RUN_DEFAULT);
    faults_off();
    ok(p.stopped, "the relay stopped gracefully after the fault windows");
    outbox_relay_destroy(p.r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "loop closes: no handle left behind");
    diag("part 1: %d windows, %lld ms faulting, %ld writes + %ld syncs failed of %ld + %ld, %lld ms", p.windows,
         (long long)p.fault_ms_total, (long)writes_failed, (long)syncs_failed, (long)writes_total,
         (long)syncs_total, (long long)(th_now_ms() - t0));
    ok(writes_failed > 0, "faults were injected (writes %ld, syncs %ld)", (long)writes_failed,
       (long)syncs_failed);
    ok(log_db_errors > 0, "the relay logged database errors (%d, %d of them during marks)", (int)log_db_errors,
       (int)log_mark_errors);
    ok(p.beats_in_fault >= p.fault_ms_total / 5 / 4 / th_slow(),
       "a 5 ms timer kept firing during the faults (%ld firings in %lld ms)", p.beats_in_fault,
       (long long)p.fault_ms_total);

    {
        char *wal = sqlite3_mprintf("%s-wal", db);
        FILE *f = fopen(wal, "rb");
        long sz = -1;
        if (f && fseek(f, 0, SEEK_END) == 0)
            sz = ftell(f);
        if (f)
            fclose(f);
        diag("WAL size after the faulty run: %ld bytes", sz);
        sqlite3_free(wal);
    }
    chk = rt_open(db);
    is_int(published_not_in_stream(chk, c, "outbox:faults"), 0,
           "no row is marked published whose id is not in the stream");
    diag("after the faulty run: %lld pending, %lld sending, %lld published, %lld dead",
         (long long)th_sql_int(chk, "SELECT count(*) FROM outbox_messages WHERE state = 0"),
         (long long)th_sql_int(chk, "SELECT count(*) FROM outbox_messages WHERE state = 1"),
         (long long)th_sql_int(chk, "SELECT count(*) FROM outbox_messages WHERE state = 2"),
         (long long)th_sql_int(chk, "SELECT count(*) FROM outbox_messages WHERE state = 3"));
    {
        sqlite3_stmt *q = NULL;
        const char *res = "";
        if (sqlite3_prepare_v2(chk, "PRAGMA quick_check", -1, &q, NULL) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW)
            res = (const char *)sqlite3_column_text(q, 0);
        is_str(res, "ok", "the database passes quick_check after the faults");
        sqlite3_finalize(q);
    }

    is_int(final_drain(db, srv->url), 0, "final clean drain; its loop closes");
    a = rt_audit_topic(chk, c, "outbox:", "faults");
    is_int(a.rows, INITIAL_ROWS + p.next_row, "every committed row is in the database (%ld)", a.rows);
    is_int(a.missing, 0, "every row has an entry in its stream");
    is_int(a.foreign, 0, "no entry without a row");
    is_int(a.unpublished, 0, "every row is marked published");
    is_int(th_sql_int(chk, "SELECT count(*) FROM outbox_messages WHERE state = 1"), 0, "no row stuck in state 1");
    is_int(a.dead, 0, "no row dead-lettered by database faults");
    is_int(a.order_violations, 0, "per key in commit order");
    diag("entries %ld, duplicates %ld", a.entries, a.dups);
    sqlite3_close_v2(chk);
    sqlite3_close_v2(p.app);
    free(db);
}

/* ---- part 2: a writer holds the write lock for 2 s --------------------- */

#define HOLD_MS 2000

typedef struct p2 {
    outbox_relay *r;
    sqlite3 *holder;
    uv_timer_t beat, release, check;
    int holding, stopping, stopped;
    long beats_held;
    int64_t hold_t0, hold_ms, max_gap, last_beat, t0;
} p2;

static void p2_beat(uv_timer_t *t)
{
    p2 *p = t->data;
    int64_t now = th_now_ms();
    if (p->holding) {
        p->beats_held++;
        if (p->last_beat && now - p->last_beat > p->max_gap)
            p->max_gap = now - p->last_beat;
    }
    p->last_beat = now;
}

static void p2_on_stopped(outbox_relay *r, void *data)
{
    p2 *p = data;
    (void)r;
    p->stopped = 1;
    uv_close((uv_handle_t *)&p->beat, NULL);
    uv_close((uv_handle_t *)&p->release, NULL);
    uv_close((uv_handle_t *)&p->check, NULL);
}

static void p2_release(uv_timer_t *t)
{
    p2 *p = t->data;
    if (sqlite3_exec(p->holder, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
        bail("holder COMMIT: %s", sqlite3_errmsg(p->holder));
    p->holding = 0;
    p->hold_ms = th_now_ms() - p->hold_t0;
    outbox_relay_wake(p->r);
}

static void p2_check(uv_timer_t *t)
{
    p2 *p = t->data;
    outbox_relay_stats st;
    if (p->holding || p->stopping)
        return;
    if ((outbox_relay_stats_get(p->r, &st) == 0 && st.pending == 0 && st.sending == 0 && st.inflight == 0) ||
        th_now_ms() - p->t0 > 25000) {
        p->stopping = 1;
        outbox_relay_stop(p->r, p2_on_stopped, p);
    }
}

static void part2(th_redis *srv, redisContext *c, const char *dir)
{
    uv_loop_t loop;
    outbox_relay_settings s;
    char err[512], *db;
    p2 p;
    sqlite3 *app, *chk;
    rt_audit a;
    int64_t t0 = th_now_ms();

    memset(&p, 0, sizeof p);
    db = rt_make_db(dir, "busy.db");
    app = rt_open(db);
    rt_insert_rows(app, "before", 0, INITIAL_ROWS, "busy", 5);
    if (sqlite3_open_v2(db, &p.holder, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK)
        bail("holder open: %s", sqlite3_errmsg(p.holder));
    sqlite3_busy_timeout(p.holder, 60000);

    uv_loop_init(&loop);
    relay_settings(&s, db, srv->url);
    s.batch = 50;
    if (outbox_relay_create(&p.r, &loop, &s, err, sizeof err) != 0)
        bail("relay create: %s", err);
    outbox_relay_start(p.r);
    uv_timer_init(&loop, &p.beat);
    uv_timer_init(&loop, &p.release);
    uv_timer_init(&loop, &p.check);
    p.beat.data = p.release.data = p.check.data = &p;
    p.t0 = th_now_ms();

    /* Let the relay get going (connect, first claims), then take the lock
     * with rows of our own inside the held transaction. */
    uv_run(&loop, UV_RUN_NOWAIT);
    while (th_now_ms() - p.t0 < 30)
        uv_run(&loop, UV_RUN_ONCE);
    if (sqlite3_exec(p.holder, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        bail("holder BEGIN IMMEDIATE: %s", sqlite3_errmsg(p.holder));
    {
        int i;
        for (i = 0; i < 100; i++) {
            char *sql = sqlite3_mprintf("INSERT INTO outbox(id, topic, payload) VALUES ('held-%06d', 'busy', 'x')", i);
            if (sqlite3_exec(p.holder, sql, NULL, NULL, NULL) != SQLITE_OK)
                bail("holder insert: %s", sqlite3_errmsg(p.holder));
            sqlite3_free(sql);
        }
    }
    p.holding = 1;
    p.hold_t0 = th_now_ms();
    uv_timer_start(&p.beat, p2_beat, 10, 10);
    uv_timer_start(&p.release, p2_release, HOLD_MS, 0);
    uv_timer_start(&p.check, p2_check, 20, 20);
    {
        sqlite3 *peek = rt_open(db);
        diag("when the lock was taken: %lld of %d published",
             (long long)th_sql_int(peek, "SELECT count(*) FROM outbox_messages WHERE state = 2"), INITIAL_ROWS);
        sqlite3_close_v2(peek);
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    ok(p.stopped, "relay stopped after the drain");
    outbox_relay_destroy(p.r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "loop closes");
    /* Under valgrind (th_slow() > 1) everything is ~10x slower: only the
     * loop turning at all is required there. */
    ok(p.beats_held >= (th_slow() > 1 ? 10 : 100), "a 10 ms timer fired %ld times while the lock was held %lld ms (>= 100)",
       p.beats_held, (long long)p.hold_ms);
    ok(p.max_gap < 200 * th_slow(), "longest gap between firings while held: %lld ms (< 200)", (long long)p.max_gap);

    chk = rt_open(db);
    a = rt_audit_topic(chk, c, "outbox:", "busy");
    is_int(a.rows, INITIAL_ROWS + 100, "all rows, the held transaction's too");
    is_int(a.missing, 0, "every row is in its stream");
    is_int(a.unpublished, 0, "every row is marked published");
    is_int(a.foreign, 0, "no foreign entries");
    is_int(a.order_violations, 0, "per key in commit order");
    diag("part 2: %lld ms, %ld entries, %ld dups", (long long)(th_now_ms() - t0), a.entries, a.dups);
    sqlite3_close_v2(chk);
    sqlite3_close_v2(p.holder);
    sqlite3_close_v2(app);
    free(db);
}

int main(void)
{
    th_redis srv;
    redisContext *c;
    char *dir;

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    shim_register("faultshim", 1);
    dir = th_tmpdir();
    c = th_redis_client(&srv);
    part1(&srv, c, dir);
    part2(&srv, c, dir);
    redisFree(c);
    th_redis_destroy(&srv);
    free(dir);
    return tap_done();
}
