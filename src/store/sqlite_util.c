/*
 * sqlite_util.c: the small SQLite helpers of sqlite_util.h that the store
 * and the relay share: result codes mapped to the library's, and one-value
 * queries.
 */
#include "outbox/common.h"
#include "store/sqlite_util.h"

int outbox__sqlite_code(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_OK:
    case SQLITE_ROW:
    case SQLITE_DONE:
        return 0;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        return OUTBOX_EBUSY;
    case SQLITE_NOMEM:
        return OUTBOX_ENOMEM;
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
        return OUTBOX_ENOTDB;
    case SQLITE_IOERR:
    case SQLITE_FULL:
    case SQLITE_CANTOPEN:
    case SQLITE_READONLY:
    case SQLITE_PERM:
        return OUTBOX_EIO;
    default:
        return OUTBOX_ESQLITE;
    }
}

int outbox__sqlite_int(sqlite3 *db, const char *sql, int64_t *value)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    if (rc == SQLITE_OK) {
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            *value = sqlite3_column_int64(st, 0);
            rc = SQLITE_OK;
        } else if (rc == SQLITE_DONE) {
            *value = 0;
            rc = SQLITE_OK;
        }
    }
    sqlite3_finalize(st);
    return outbox__sqlite_code(rc);
}
