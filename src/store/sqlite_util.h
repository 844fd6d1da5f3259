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
