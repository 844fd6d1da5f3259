/*
 * test_group_faults.c: one relay for a directory of databases
 * (outbox_relay_group) when some of them cannot be used: each affects only
 * itself, is logged once, named in /healthz and /metrics and by
 * outbox_relay_group_db_state, tried again, and published once it heals.
 *
 * Beside three healthy databases:
 * - "sick": its filesystem is full (writes to its files fail with
 *   SQLITE_FULL): it opens, but its claim's transaction fails, again and
 *   again, until space comes back;
 * - "locked": another connection holds it in locking_mode=EXCLUSIVE (as an
 *   application's migration or a tool can): it cannot even be read;
 * - "rofs": its filesystem is read-only and its -wal does not exist (the
 *   last connection removed it): it cannot be opened.
 * Then a drain beside a database on a full filesystem ends at its timeout
 * naming it with its error; and a database deleted while its messages wait
 * in Redis leaves the group (said once), the other publishes, and a new
 * file of that name is a new database.
 *
 * The faults are a VFS of the test's own over the default one (the shim's
 * forwarding methods, tests/faults/shim_vfs.c), acting on the files whose
 * names hold "sick" or "rofs"; the lock is a real second connection. The
 * group runs on the test's loop; /healthz and /metrics are read by a thread
 * of the test while the loop runs.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ops/ops.h"
#include "outbox.h"
#include "rt.h"
#include "shim_vfs.h"
#include "tap.h"

#define N_ROWS 100

static th_redis srv;
static redisContext *c;
static uv_loop_t loop;
static int port;

/* ---- the faults: a VFS over the default one ------------------------------ */

static atomic_int full_on, rofs_on;
static sqlite3_vfs *real_vfs;
static sqlite3_vfs fault_vfs;
static sqlite3_io_methods fault_io;

typedef struct fault_file {
    shim_file sf;
    int sick; /* a file of "sick": its filesystem is full while full_on */
} fault_file;

static int f_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 off)
{
    fault_file *ff = (fault_file *)f;
    if (ff->sick && atomic_load(&full_on))
        return SQLITE_FULL;
    return ff->sf.real->pMethods->xWrite(ff->sf.real, b, n, off);
}

static int f_truncate(sqlite3_file *f, sqlite3_int64 size)
{
    fault_file *ff = (fault_file *)f;
    if (ff->sick && atomic_load(&full_on))
        return SQLITE_FULL;
    return ff->sf.real->pMethods->xTruncate(ff->sf.real, size);
}

static int f_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f, int flags, int *out_flags)
{
    fault_file *ff = (fault_file *)f;
    int rc;
    (void)vfs;
    ff->sf.real = (sqlite3_file *)(ff + 1);
    ff->sf.base.pMethods = NULL;
    ff->sick = name && strstr(name, "/sick") != NULL;
    if (name && strstr(name, "/rofs") && atomic_load(&rofs_on) && (flags & SQLITE_OPEN_READWRITE)) {
        /* A read-only filesystem: what exists opens for reading only (as
         * the unix VFS does with a file it cannot write), nothing can be
         * created. */
        int ro = (flags & ~(SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE)) | SQLITE_OPEN_READONLY;
        if ((flags & SQLITE_OPEN_CREATE) && access(name, F_OK) != 0)
            return SQLITE_CANTOPEN;
        rc = real_vfs->xOpen(real_vfs, name, ff->sf.real, ro, out_flags);
    } else {
        rc = real_vfs->xOpen(real_vfs, name, ff->sf.real, flags, out_flags);
    }
    if (ff->sf.real->pMethods) {
        fault_io.iVersion = ff->sf.real->pMethods->iVersion < 3 ? ff->sf.real->pMethods->iVersion : 3;
        ff->sf.base.pMethods = &fault_io;
    }
    return rc;
}

static void fault_register(void)
{
    real_vfs = sqlite3_vfs_find(NULL);
    if (!real_vfs)
        bail("no default VFS");
    fault_vfs = *real_vfs;
    fault_vfs.zName = "groupfaults";
    fault_vfs.pNext = NULL;
    fault_vfs.szOsFile = (int)sizeof(fault_file) + real_vfs->szOsFile;
    fault_vfs.xOpen = f_open;
    shim_io_forward(&fault_io);
    fault_io.xWrite = f_write;
    fault_io.xTruncate = f_truncate;
    if (sqlite3_vfs_register(&fault_vfs, 1) != SQLITE_OK)
        bail("sqlite3_vfs_register failed");
}

/* ---- the loop, the log and the endpoint -------------------------------- */

/* The test's loop until fn(arg) holds (rt.h). */
static int run_until(int timeout_ms, int (*fn)(void *), void *arg)
{
    return rt_run_until(&loop, timeout_ms, fn, arg);
}

/* The group's log lines, kept to count them (loop thread). */
static char *lines[4096];
static size_t nlines;

static void keep_log(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    if (level >= OUTBOX_LOG_WARN)
        fprintf(stderr, "# %s\n", msg);
    if (nlines < sizeof lines / sizeof lines[0])
        lines[nlines++] = strdup(msg);
}

/* Log lines holding both a and b. */
static int logged(const char *a, const char *b)
{
    int n = 0;
    for (size_t i = 0; i < nlines; i++)
        n += lines[i] && strstr(lines[i], a) && strstr(lines[i], b);
    return n;
}

/* A GET of the group's endpoint, on a thread while the loop serves it. */
typedef struct get_job {
    const char *path;
    int code;
    char *body;
    atomic_int done;
} get_job;

static void *get_thread(void *arg)
{
    get_job *j = arg;
    j->code = ot_http_get(port, j->path, &j->body);
    atomic_store(&j->done, 1);
    return NULL;
}

static int job_done(void *arg)
{
    return atomic_load(&((get_job *)arg)->done);
}

static int http_get(const char *path, char **body)
{
    get_job j = {path, -1, NULL, 0};
    pthread_t th;
    if (pthread_create(&th, NULL, get_thread, &j) != 0)
        bail("cannot start a thread");
    run_until(20000, job_done, &j);
    pthread_join(th, NULL);
    *body = j.body;
    return j.code;
}

static int never(void *arg)
{
    (void)arg;
    return 0;
}

/* GETs path until check(body) holds or 10 s passed (a failing database is
 * briefly in another state while it is tried again); the last status, its
 * body in *body. */
static int http_until(const char *path, int (*check)(const char *body), char **body)
{
    int code = -1;
    int64_t end = th_now_ms() + 10000 * (int64_t)th_slow();
    *body = NULL;
    for (;;) {
        free(*body);
        code = http_get(path, body);
        if ((code == 200 && *body && check(*body)) || th_now_ms() >= end)
            return code;
        run_until(20, never, NULL);
    }
}

static int healthz_all(const char *b)
{
    return strstr(b, "failing: sick: database errors for ") && strstr(b, "database or disk is full") &&
           strstr(b, "failing: locked: ") && strstr(b, "failing: rofs: ");
}

static int metrics_all(const char *b)
{
    return ot_prom_val(b, "outbox_database_failing{db=\"sick\"}") == 1 &&
           ot_prom_val(b, "outbox_database_failing{db=\"locked\"}") == 1 &&
           ot_prom_val(b, "outbox_database_failing{db=\"rofs\"}") == 1 &&
           ot_prom_val(b, "outbox_databases{state=\"failed\"}") == 2;
}

static int healthz_none(const char *b)
{
    return !strstr(b, "failing:");
}

/* ---- the scenario -------------------------------------------------------- */

static outbox_relay_group *grp;

/* The group's settings over dir: the test's Redis, its log kept. */
static outbox_relay_settings group_settings(const char *dir)
{
    outbox_relay_settings s;
    outbox_relay_defaults(&s);
    s.db_dir = dir;
    s.redis_url = srv.url;
    s.log = keep_log;
    s.retention_ms = 0;
    return s;
}

static int db_state(const char *name, char *why, size_t len)
{
    return outbox_relay_group_db_state(grp, name, why, len);
}

/* Every fault seen and said: the healthy databases published, "sick"
 * failing while open, "locked" said locked (after a second), "rofs" failed. */
static int faults_seen(void *arg)
{
    char why[300];
    (void)arg;
    return th_xlen(c, "outbox:orders") >= 3 * N_ROWS && db_state("sick", why, sizeof why) == OUTBOX_GROUP_DB_OPEN &&
           strstr(why, "full") && logged("database locked", "database=locked") >= 1 &&
           db_state("rofs", NULL, 0) == OUTBOX_GROUP_DB_FAILED && logged("database error", "database=sick") >= 1;
}

static long long want_len;
static int stream_has(void *arg)
{
    (void)arg;
    return th_xlen(c, "outbox:orders") >= want_len;
}

static int none_failing(void *arg)
{
    char why[300];
    (void)arg;
    for (int i = 0; i < 3; i++) {
        const char *n = i == 0 ? "sick" : i == 1 ? "locked" : "rofs";
        int s = db_state(n, why, sizeof why);
        if (s == OUTBOX_GROUP_DB_FAILED || why[0])
            return 0;
    }
    return 1;
}

/* Every row of db marked published. */
static int a_db_marked(void *arg)
{
    return th_sql_int(arg, "SELECT count(*) FROM outbox_messages WHERE state <> 2") == 0;
}

/* Every row of the six databases (paths) marked published. */
static int all_marked(void *arg)
{
    char **paths = arg;
    int left = 0;
    for (int i = 0; i < 6; i++) {
        sqlite3 *db = rt_open(paths[i]);
        left += (int)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 2");
        sqlite3_close_v2(db);
    }
    return left == 0;
}

/* Set by a group's stop (rt_group_flag). */
static int stopped;

static void faults(void)
{
    char *dir = th_tmpdir(), *paths[6], err[512], why[300], listen[64], *body = NULL;
    static const char *const names[6] = {"h0", "h1", "h2", "sick", "locked", "rofs"};
    sqlite3 *locker = NULL;
    outbox_relay_settings s;
    char file[32];
    int held;

    for (int i = 0; i < 6; i++) {
        snprintf(file, sizeof file, "%s.db", names[i]);
        paths[i] = rt_make_db_rows(dir, file, names[i], 0, N_ROWS, "orders", 4);
    }
    /* The lock: held from its first read, so that no other connection can
     * read the database at all while it lasts. */
    if (sqlite3_open(paths[4], &locker) != SQLITE_OK)
        bail("cannot open %s", paths[4]);
    th_sql_exec(locker, "PRAGMA locking_mode=EXCLUSIVE");
    th_sql_exec(locker, "INSERT INTO outbox(id, topic, payload) VALUES ('locked-extra', 'orders', x'00')");
    {
        char wal[4200];
        snprintf(wal, sizeof wal, "%s-wal", paths[5]);
        ok(access(wal, F_OK) != 0, "rofs has no -wal (its filesystem would not let one be made)");
    }
    atomic_store(&full_on, 1);
    atomic_store(&rofs_on, 1);

    s = group_settings(dir);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    s.metrics_listen = listen;
    is_int(outbox_relay_group_create(&grp, &loop, &s, err, sizeof err), 0, "group created: %s", err);
    is_int(outbox_relay_group_start(grp), 0, "started");

    held = run_until(30000, faults_seen, NULL);
    ok(held, "the healthy databases published (%lld entries), each fault seen", th_xlen(c, "outbox:orders"));
    is_int(th_xlen(c, "outbox:orders"), 3 * N_ROWS, "only the healthy databases' rows are in the stream");
    is_int(db_state("sick", why, sizeof why), OUTBOX_GROUP_DB_OPEN, "sick is open, its transactions failing: %s",
           why);
    ok(strstr(why, "database or disk is full") != NULL, "and its reason says the disk is full");
    is_int(db_state("locked", why, sizeof why), OUTBOX_GROUP_DB_FAILED, "locked failed: %s", why);
    ok(strstr(why, "locked") != NULL, "and its reason says locked");
    is_int(db_state("rofs", why, sizeof why), OUTBOX_GROUP_DB_FAILED, "rofs failed: %s", why);
    ok(why[0] != '\0', "with a reason");
    held = db_state("h0", why, sizeof why);
    ok(held == OUTBOX_GROUP_DB_OPEN || held == OUTBOX_GROUP_DB_CLOSED, "h0 is open or closed (drained), got %d",
       held);
    ok(why[0] == '\0', "with no reason");

    is_int(http_until("/healthz", healthz_all, &body), 200, "/healthz: 200, the process is healthy");
    ok(body && healthz_all(body), "/healthz names sick (open, its error), locked and rofs");
    ok(body && !strstr(body, "failing: h"), "and no healthy database");
    if (!body || !healthz_all(body))
        diag("%s", body ? body : "(no body)");
    free(body);
    is_int(http_until("/metrics", metrics_all, &body), 200, "/metrics: 200");
    ok(body && metrics_all(body), "/metrics: outbox_database_failing 1 for sick, locked and rofs; two failed to open");
    ok(ot_prom_val(body, "outbox_database_failing{db=\"h0\"}") < 0, "and no series for a healthy database");
    free(body);

    /* Said once each (the failures go on all the while). */
    is_int(logged("database error, retrying", "database=sick"), 1, "sick's error logged once");
    is_int(logged("database locked", "database=locked"), 1, "locked logged once");
    is_int(logged("cannot open the database", "database=rofs"), 1, "rofs logged once");

    /* Space comes back, the lock goes, the filesystem becomes writable. */
    atomic_store(&full_on, 0);
    atomic_store(&rofs_on, 0);
    sqlite3_close_v2(locker);
    want_len = 6 * N_ROWS + 1;
    held = run_until(90000, stream_has, NULL);
    ok(held, "every row published once each heals (%lld of %lld)", th_xlen(c, "outbox:orders"), want_len);
    ok(run_until(20000, none_failing, NULL), "nothing failing any more");
    is_int(th_xlen(c, "outbox:orders"), 6 * N_ROWS + 1, "each row once");
    ok(logged("database writable again", "database=sick") >= 1, "sick said writable again");
    ok(run_until(20000, all_marked, paths), "every row of every database marked published");
    for (int i = 0; i < 6; i++) {
        sqlite3 *db = rt_open(paths[i]);
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 2"), 0,
               "%s: every row marked published", names[i]);
        sqlite3_close_v2(db);
    }
    is_int(http_until("/healthz", healthz_none, &body), 200, "/healthz: 200");
    ok(body && healthz_none(body), "and names no database");
    free(body);

    stopped = 0;
    is_int(outbox_relay_group_stop(grp, rt_group_flag, &stopped), 0, "stop");
    ok(run_until(20000, rt_flag, &stopped), "stopped");
    outbox_relay_group_destroy(grp);
    uv_run(&loop, UV_RUN_NOWAIT);
    for (int i = 0; i < 6; i++)
        free(paths[i]);
    free(dir);
}

/* A drain beside a database whose transactions fail: every other database
 * drained, the drain ends at drain_timeout_ms naming that one and its
 * error (as a relay's own drain, it waits for a database that may heal). */
static int drained;
static void on_drained(outbox_relay_group *g, void *data)
{
    (void)data;
    drained = 1;
    outbox_relay_group_stop(g, rt_group_flag, &stopped);
}

static void drain_faults(void)
{
    char *dir = th_tmpdir(), *ph, *ps, err[512], failed[1024];
    outbox_relay_settings s;
    sqlite3 *db;
    long long before = th_xlen(c, "outbox:orders");

    ph = rt_make_db_rows(dir, "d0.db", "d0", 0, N_ROWS, "orders", 4);
    ps = rt_make_db_rows(dir, "sick2.db", "sick2", 0, N_ROWS, "orders", 4);
    atomic_store(&full_on, 1);
    s = group_settings(dir);
    s.drain = 1;
    s.drain_timeout_ms = 3000 * (uint64_t)th_slow();
    is_int(outbox_relay_group_create(&grp, &loop, &s, err, sizeof err), 0, "drain group created: %s", err);
    outbox_relay_group_on_drained(grp, on_drained, NULL);
    drained = stopped = 0;
    is_int(outbox_relay_group_start(grp), 0, "drain started");
    ok(run_until(30000, rt_flag, &stopped), "the drain ended and the group stopped");
    ok(drained, "on_drained called");
    is_int(outbox_relay_group_drain_result(grp, failed, sizeof failed), OUTBOX_ETIMEDOUT,
           "drain result ETIMEDOUT: %s", failed);
    ok(strstr(failed, "sick2 (database or disk is full)") != NULL, "the failing database is named with its error");
    ok(strstr(failed, "d0") == NULL, "the healthy one is not");
    is_int(th_xlen(c, "outbox:orders") - before, N_ROWS, "the healthy database drained");
    outbox_relay_group_destroy(grp);
    uv_run(&loop, UV_RUN_NOWAIT);
    atomic_store(&full_on, 0);
    db = rt_open(ps);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0"), N_ROWS,
           "the failing database's rows are all still pending");
    {
        sqlite3_stmt *st = NULL;
        const char *v = NULL;
        if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, NULL) == SQLITE_OK &&
            sqlite3_step(st) == SQLITE_ROW)
            v = (const char *)sqlite3_column_text(st, 0);
        ok(v && !strcmp(v, "ok"), "and it is intact (integrity_check: %s)", v ? v : "(none)");
        sqlite3_finalize(st);
    }
    sqlite3_close_v2(db);
    free(ph);
    free(ps);
    free(dir);
}

/* A database deleted while its messages wait in Redis (an application
 * dropping a tenant): it leaves the group, said once; the rest go on; a
 * new file of that name later is a new database, published. */
static int gone_inflight(void *arg)
{
    outbox_relay_group_stats st;
    (void)arg;
    outbox_relay_group_stats_get(grp, &st);
    return db_state("gone", NULL, 0) == OUTBOX_GROUP_DB_OPEN && st.inflight >= 2 * N_ROWS;
}

static int gone_left(void *arg)
{
    (void)arg;
    return db_state("gone", NULL, 0) == OUTBOX_GROUP_DB_UNKNOWN && th_xlen(c, "outbox:orders") >= want_len;
}

static void deleted_mid_claim(void)
{
    char *dir = th_tmpdir(), *pk, *pg, err[512], side[4200];
    outbox_relay_settings s;
    sqlite3 *db;
    long long before = th_xlen(c, "outbox:orders");
    int held;

    pk = rt_make_db_rows(dir, "kept.db", "kept", 0, N_ROWS, "orders", 4);
    pg = rt_make_db_rows(dir, "gone.db", "gone", 0, N_ROWS, "orders", 4);
    s = group_settings(dir);
    is_int(outbox_relay_group_create(&grp, &loop, &s, err, sizeof err), 0, "group created: %s", err);
    /* Their XADDs wait in Redis while the test deletes one database. */
    ot_redis_pause(c, 5000);
    is_int(outbox_relay_group_start(grp), 0, "started");
    held = run_until(20000, gone_inflight, NULL);
    ok(held, "both databases' messages are in flight");
    unlink(pg);
    snprintf(side, sizeof side, "%s-wal", pg);
    unlink(side);
    snprintf(side, sizeof side, "%s-shm", pg);
    unlink(side);
    ot_redis_pause(c, 0);
    want_len = before + N_ROWS;
    held = run_until(20000, gone_left, NULL);
    ok(held, "the deleted database left the group; the other's rows published (%lld)",
       th_xlen(c, "outbox:orders") - before);
    is_int(logged("database dropped", "database=gone"), 1, "its leaving said once");
    db = rt_open(pk);
    want_len = 0;
    ok(run_until(20000, a_db_marked, db), "the other database's rows all marked published");
    sqlite3_close_v2(db);

    /* The tenant comes back: a new database of the same name. */
    before = th_xlen(c, "outbox:orders");
    free(rt_make_db_rows(dir, "gone.db", "again", 0, 10, "orders", 2));
    want_len = before + 10;
    held = run_until(20000, stream_has, NULL);
    ok(held, "a new file of that name is a new database, published (%lld)", th_xlen(c, "outbox:orders") - before);

    stopped = 0;
    is_int(outbox_relay_group_stop(grp, rt_group_flag, &stopped), 0, "stop");
    ok(run_until(20000, rt_flag, &stopped), "stopped");
    outbox_relay_group_destroy(grp);
    uv_run(&loop, UV_RUN_NOWAIT);
    free(pk);
    free(pg);
    free(dir);
}

int main(void)
{
    fault_register();
    if (th_redis_start(&srv, 0, NULL) != 0) {
        skip("no redis-server");
        return tap_done();
    }
    port = th_free_port();
    if (port < 0)
        bail("no free port");
    c = th_redis_client(&srv);
    uv_loop_init(&loop);
    faults();
    drain_faults();
    deleted_mid_claim();
    is_int(uv_loop_close(&loop), 0, "every handle closed");
    for (size_t i = 0; i < nlines; i++)
        free(lines[i]);
    redisFree(c);
    th_redis_destroy(&srv);
    return tap_done();
}
