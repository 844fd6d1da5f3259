/*
 * harness_sql.c: see harness.h. SQL run on a test's own connection.
 */
#include "harness.h"

#include <stdarg.h>
#include <stdint.h>

#include "tap.h"

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

