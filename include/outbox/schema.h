/*
 * schema.h: opening the application's database and creating or migrating
 * the outbox schema (proto/schema.sql, proto/schema.md).
 *
 * The outbox lives in the application's own SQLite database, so that a
 * business change and its message commit in one transaction. The schema
 * version is kept in PRAGMA user_version: a database holding an outbox must
 * not use user_version for anything else.
 */
#ifndef OUTBOX_SCHEMA_H
#define OUTBOX_SCHEMA_H

#include <sqlite3.h>

#include "outbox/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The states of an outbox row (column `state`, proto/schema.md). SQL text
 * spells them as literals (a partial index is used only by a query that
 * repeats its WHERE term literally); test_schema checks these against
 * proto/schema.sql.
 */
#define OUTBOX_STATE_PENDING 0   /* waiting to be claimed (due at available_at) */
#define OUTBOX_STATE_SENDING 1   /* claimed under a lease, being published */
#define OUTBOX_STATE_PUBLISHED 2 /* Redis accepted it */
#define OUTBOX_STATE_DEAD 3      /* gave up after max attempts, or unpublishable: replayable */
#define OUTBOX_STATE_COUNT 4

/* Flags for outbox_db_open(). */
enum {
    /* Create the file if it does not exist (otherwise OUTBOX_ENOTDB names the
     * missing file). */
    OUTBOX_OPEN_CREATE = 1 << 0,
    /* Open read-only (inspection tools). */
    OUTBOX_OPEN_READONLY = 1 << 1,
    /* A connection for the relay: busy_timeout 0 (the relay adds a busy
     * handler that waits only on its worker thread) and synchronous=NORMAL (a relay commit
     * lost in a power cut only causes a duplicate publish, never a loss).
     * Without this flag: a busy wait of 5000 ms (outbox_db_busy_wait) and
     * synchronous=FULL, the settings a writer needs. */
    OUTBOX_OPEN_RELAY = 1 << 2,
};

/*
 * Opens (or with OUTBOX_OPEN_CREATE creates) a database and sets the pragmas
 * every outbox connection wants:
 *   journal_mode=WAL   readers (the relay, tools) never block the writer, and
 *                      the writer never blocks them;
 *   synchronous=FULL   every commit is fsynced before COMMIT returns, so a
 *                      power cut cannot undo a commit whose message the relay
 *                      already published (guarantee 2). With NORMAL, WAL mode
 *                      survives application crashes but not power loss.
 *                      (OUTBOX_OPEN_RELAY: NORMAL, see above.)
 *   busy wait          5000 ms in short naps (outbox_db_busy_wait) for
 *                      writers and tools; none for the relay (busy_timeout 0).
 *   cache_size         8 MiB (SQLite's default is 2 MiB): the working pages
 *                      of the outbox table and its indexes outgrow 2 MiB.
 * It checks that the file is a SQLite database (OUTBOX_ENOTDB otherwise) but
 * does not look at the schema: see outbox_schema_apply() / _check().
 *
 * path: a file name (copied). *out receives the connection (close it with
 * sqlite3_close_v2) and is set to NULL on error. err (may be NULL) receives a
 * specific message, e.g. "cannot open '/x/y.db': unable to open database file".
 * Returns 0, OUTBOX_ENOTDB, OUTBOX_EBUSY, OUTBOX_ESQLITE, OUTBOX_EINVAL.
 */
OUTBOX_API int outbox_db_open(const char *path, int flags, sqlite3 **out, char *err, size_t errlen);

/*
 * Creates the outbox schema in db, or migrates an older version to
 * OUTBOX_SCHEMA_VERSION, in one BEGIN IMMEDIATE transaction. Idempotent and
 * safe against a concurrent apply. Sets journal_mode=WAL. Refuses, changing
 * nothing:
 *   OUTBOX_ESCHEMANEWER  user_version is newer than this library knows;
 *   OUTBOX_EFOREIGN      a table named outbox exists that this library did not
 *                        create (user_version 0) or that lacks a column, or
 *                        the version is set but table outbox or
 *                        outbox_cursor is missing (dropped by hand);
 *   OUTBOX_ENOTDB        the file is not a database (or is corrupt).
 * Also OUTBOX_EBUSY, OUTBOX_ESQLITE. err (may be NULL) gets the details.
 * db stays owned by the caller and must not be inside a transaction. A
 * migration from a version before 4 edits the table's stored definition:
 * it turns SQLITE_DBCONFIG_DEFENSIVE off on db for that step (and back on
 * if it was on), and makes db reload its schema after the commit.
 */
OUTBOX_API int outbox_schema_apply(sqlite3 *db, char *err, size_t errlen);

/*
 * Checks, changing nothing, that db holds an outbox schema this library can
 * use at exactly OUTBOX_SCHEMA_VERSION. Returns 0, OUTBOX_ENOSCHEMA (no
 * outbox table and user_version 0, or an older version that needs
 * outbox_schema_apply()), OUTBOX_ESCHEMANEWER, OUTBOX_EFOREIGN,
 * OUTBOX_ENOTDB, OUTBOX_ESQLITE.
 */
OUTBOX_API int outbox_schema_check(sqlite3 *db, char *err, size_t errlen);

/*
 * Makes db wait up to ms for a lock held by another connection, trying again
 * in short naps: 50 us for the first 2 ms of a wait, 200 us up to 20 ms, then
 * 1 ms. outbox_db_open sets 5000 ms on every connection but the relay's.
 * SQLite's busy timeout (sqlite3_busy_timeout) waits as long, but sleeps 1, 2,
 * 5, 10, 15, 20, 25 ms ... between tries: a writer that met a relay
 * transaction of 4 ms got the lock 8 ms after it asked, fell behind, then
 * committed back to back and kept the relay from the lock while it caught
 * up. Locks are not queued, so trying often is the only way to get one soon
 * after its release; the growing naps keep a long wait cheap.
 *
 * It is a busy handler, so PRAGMA busy_timeout reads 0 while it is set;
 * sqlite3_busy_timeout() or sqlite3_busy_handler() replaces it. ms 0 removes
 * it (db then fails at once with SQLITE_BUSY). outbox_relay_attach counts db
 * as waiting ms while it is set: to make a connection from outbox_db_open
 * fail at once, use outbox_db_busy_wait(db, 0), not sqlite3_busy_timeout(db,
 * 0), which the library cannot tell from this handler.
 *
 * Call it from the thread that owns db, with no statement of db running.
 * Returns 0, OUTBOX_EINVAL (db NULL, ms < 0), OUTBOX_EBUSY (a statement of db
 * is running: nothing changed), OUTBOX_ENOMEM, OUTBOX_ESQLITE.
 */
OUTBOX_API int outbox_db_busy_wait(sqlite3 *db, int ms);

/*
 * 1 if commits on db are durable across power loss (PRAGMA synchronous is
 * FULL or EXTRA), 0 if not, a negative code if the pragma cannot be read.
 */
OUTBOX_API int outbox_db_is_durable(sqlite3 *db);

#ifdef __cplusplus
}
#endif

#endif
