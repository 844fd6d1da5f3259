/*
 * harness_sql.c: see harness.h. SQL run on a test's own connection.
 */
#include "harness.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <time.h>

#include "tap.h"

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct lock_holder {
    const char *path;
    int hold_ms;
    uint64_t released_ns; /* right after its COMMIT */
    int locked;           /* set (atomically) once it holds the lock */
} lock_holder;

static void *hold_lock(void *arg)
{
    lock_holder *h = arg;
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(h->path, &db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK ||
        sqlite3_busy_timeout(db, 5000) != SQLITE_OK || sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        bail("cannot take the write lock of %s: %s", h->path, sqlite3_errmsg(db));
    __atomic_store_n(&h->locked, 1, __ATOMIC_RELEASE);
    th_sleep_ms(h->hold_ms);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    h->released_ns = mono_ns();
    sqlite3_close(db);
    return NULL;
}

int th_sql_while_locked(sqlite3 *db, const char *path, int hold_ms, const char *sql, double *took_ms,
                        double *late_ms)
{
    lock_holder h = {path, hold_ms, 0, 0};
    pthread_t t;
    uint64_t t0, t1;
    int64_t deadline = th_now_ms() + 10000 * th_slow();
    int rc;
    if (pthread_create(&t, NULL, hold_lock, &h) != 0)
        bail("cannot start the lock holder");
    /* The lock is taken before sql starts, however late the thread runs. */
    while (!__atomic_load_n(&h.locked, __ATOMIC_ACQUIRE) && th_now_ms() < deadline)
        th_sleep_ms(1);
    if (!__atomic_load_n(&h.locked, __ATOMIC_ACQUIRE))
        bail("the lock holder did not take the write lock of %s in time", path);
    t0 = mono_ns();
    rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
    t1 = mono_ns();
    pthread_join(t, NULL);
    *took_ms = (double)(t1 - t0) / 1e6;
    *late_ms = ((double)t1 - (double)h.released_ns) / 1e6;
    return rc;
}

void th_sql_exec(sqlite3 *db, const char *fmt, ...)
{
    va_list ap;
    char *sql, *msg = NULL;
    va_start(ap, fmt);
    sql = sqlite3_vmprintf(fmt, ap);
    va_end(ap);
    if (!sql)
        bail("out of memory");
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        bail("SQL failed: %s: %s", sql, msg ? msg : "?");
    sqlite3_free(sql);
}

int64_t th_sql_int(sqlite3 *db, const char *fmt, ...)
{
    va_list ap;
    char *sql;
    sqlite3_stmt *st = NULL;
    int64_t v = 0;
    int rc;
    va_start(ap, fmt);
    sql = sqlite3_vmprintf(fmt, ap);
    va_end(ap);
    if (!sql)
        bail("out of memory");
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("SQL failed: %s: %s", sql, sqlite3_errmsg(db));
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    else if (rc != SQLITE_DONE)
        bail("SQL failed: %s: %s", sql, sqlite3_errmsg(db));
    sqlite3_finalize(st);
    sqlite3_free(sql);
    return v;
}

