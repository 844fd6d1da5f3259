/*
 * sqlite_util.h: small SQLite helpers shared by the library's modules.
 */
#ifndef OUTBOX_SRC_SQLITE_UTIL_H
#define OUTBOX_SRC_SQLITE_UTIL_H

#include <sqlite3.h>
#include <stdint.h>

/* Maps a SQLite result code to an OUTBOX_E* code (0 for OK/ROW/DONE). */
int outbox__sqlite_code(int rc);
/* Runs a one-row, one-column query; 0 or an OUTBOX_E* code. No row: 0. */
int outbox__sqlite_int(sqlite3 *db, const char *sql, int64_t *value);

#endif
