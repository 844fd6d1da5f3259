/*
 * sqlite_util.h: small SQLite helpers shared by the library's modules. The
 * result codes and one-value queries are sqlite_util.c's; the busy wait's
 * two helpers belong to outbox_db_busy_wait and live beside it, in
 * schema.c.
 */
#ifndef OUTBOX_SRC_SQLITE_UTIL_H
#define OUTBOX_SRC_SQLITE_UTIL_H

#include <sqlite3.h>
#include <stdint.h>

/* Maps a SQLite result code to an OUTBOX_E* code (0 for OK/ROW/DONE). */
int outbox__sqlite_code(int rc);
/* Runs a one-row, one-column query; 0 or an OUTBOX_E* code. No row: 0. */
int outbox__sqlite_int(sqlite3 *db, const char *sql, int64_t *value);

/* The SQLite failure behind an OUTBOX_E* code: the extended result code
 * and the system's errno (sqlite3_system_errno), both 0 when the failure
 * was not SQLite's (a file that stat() refused, a foreign schema). */
typedef struct outbox__sqlfail {
    int rc, sys;
} outbox__sqlfail;
/* Fills f from db's last failure (db may be NULL: f is then zeroed). */
void outbox__sqlfail_get(sqlite3 *db, outbox__sqlfail *f);
/* outbox_db_open and outbox_schema_apply, also filling *f (may be NULL)
 * on failure: the relay tells a full disk or a lock, which heal, from a
 * read-only file or a missing one, which do not. */
int outbox__db_open_rc(const char *path, int flags, sqlite3 **out, outbox__sqlfail *f, char *err, size_t errlen);
int outbox__schema_apply_rc(sqlite3 *db, outbox__sqlfail *f, char *err, size_t errlen);

/* The busy wait outbox_db_open gives every connection but the relay's
 * (outbox_db_busy_wait). */
#define OUTBOX__BUSY_MS 5000
/* How long db waits for a lock, in ms: its busy timeout, or the wait of
 * outbox_db_busy_wait (*naps set); 0 if it does not wait. */
int outbox__busy_ms(sqlite3 *db, int *naps);
/* Sets outbox_db_busy_wait's busy handler (ms > 0) on db again, leaving its
 * function as it is (changing a function expires db's statements). */
void outbox__busy_naps_set(sqlite3 *db, int ms);

#endif
