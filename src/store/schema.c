/*
 * Opening databases, and creating / migrating / checking the outbox schema.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "util/util.h"
#include "outbox/schema.h"
#include "store/sqlite_util.h"

/* proto/schema.sql, compiled in (see src/meson.build). */
extern const char outbox__schema_sql[];

/* Every column the library relies on, in schema order. */
static const char *const required_columns[] = {
    "seq",         "id",          "topic",        "key",        "payload",      "headers",
    "created_at",  "available_at", "state",       "attempts",   "lease_owner",  "lease_token",
    "lease_until", "last_error",  "published_at", "stream_id",  "replay_count", "replayed_at",
    "replay_reason",
};

/* The message only: callers return their own code. */
#define set_err(err, errlen, ...) ((void)outbox__errf(err, errlen, 0, __VA_ARGS__))

/*
 * outbox_db_busy_wait's handler (why naps: see the header). arg is the total
 * wait in ms. A connection waits on one thread at a time, so the start of
 * the current wait is the thread's.
 */
static int busy_naps(void *arg, int count)
{
    static __thread uint64_t start;
    struct timespec ts, nap = {0, 0};
    uint64_t now, waited, total = (uint64_t)(uintptr_t)arg * 1000000u;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    if (count == 0)
        start = now;
    waited = now - start;
    if (waited >= total)
        return 0;
    nap.tv_nsec = waited < 2000000u ? 50000 : waited < 20000000u ? 200000 : 1000000;
    nanosleep(&nap, NULL);
    return 1;
}

/* SELECT outbox_busy_wait_ms(): the wait outbox_db_busy_wait set on the
 * connection (a busy handler cannot be read back; outbox__busy_ms). */
static void busy_ms_fn(sqlite3_context *ctx, int argc, sqlite3_value **argv)
{
    (void)argc;
    (void)argv;
    sqlite3_result_int(ctx, (int)(uintptr_t)sqlite3_user_data(ctx));
}

int outbox_db_busy_wait(sqlite3 *db, int ms)
{
    int rc;
    if (!db || ms < 0)
        return OUTBOX_EINVAL;
    /* With ms 0 the function goes (a NULL xFunc deletes it). */
    rc = sqlite3_create_function_v2(db, "outbox_busy_wait_ms", 0, SQLITE_UTF8 | SQLITE_DIRECTONLY,
                                    (void *)(uintptr_t)ms, ms ? busy_ms_fn : NULL, NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        return outbox__sqlite_code(rc);
    if (ms == 0)
        return outbox__sqlite_code(sqlite3_busy_timeout(db, 0));
    outbox__busy_naps_set(db, ms);
    return 0;
}

void outbox__busy_naps_set(sqlite3 *db, int ms)
{
    sqlite3_busy_handler(db, busy_naps, (void *)(uintptr_t)ms);
}

int outbox__busy_ms(sqlite3 *db, int *naps)
{
    int64_t ms = 0;
    *naps = 0;
    if (outbox__sqlite_int(db, "PRAGMA busy_timeout", &ms) == 0 && ms > 0)
        return ms > INT32_MAX ? INT32_MAX : (int)ms;
    /* No such function (an error): the connection does not wait. */
    if (outbox__sqlite_int(db, "SELECT outbox_busy_wait_ms()", &ms) == 0 && ms > 0) {
        *naps = 1;
        return (int)ms;
    }
    return 0;
}

/* SQLite's words for db's last failure, with the system's when it gave one
 * ("disk I/O error (No space left on device)"): a full disk and a failing
 * one read the same otherwise. */
static const char *why(sqlite3 *db, char *buf, size_t len)
{
    int sys = sqlite3_system_errno(db), rc = sqlite3_errcode(db) & 0xff;
    /* errno says something only after a failed system call. */
    if (sys == 0 || (rc != SQLITE_IOERR && rc != SQLITE_FULL && rc != SQLITE_CANTOPEN))
        return sqlite3_errmsg(db);
    snprintf(buf, len, "%s (%s)", sqlite3_errmsg(db), strerror(sys));
    return buf;
}

int outbox_db_open(const char *path, int flags, sqlite3 **out, char *err, size_t errlen)
{
    return outbox__db_open_rc(path, flags, out, NULL, err, errlen);
}

void outbox__sqlfail_get(sqlite3 *db, outbox__sqlfail *f)
{
    if (!f)
        return;
    f->rc = db ? sqlite3_extended_errcode(db) : 0;
    f->sys = db ? sqlite3_system_errno(db) : 0;
}

int outbox__db_open_rc(const char *path, int flags, sqlite3 **out, outbox__sqlfail *f, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    struct stat st;
    int oflags, rc, e;
    char wbuf[300];

    if (out)
        *out = NULL;
    outbox__sqlfail_get(NULL, f);
    if (!path || !*path || !out) {
        set_err(err, errlen, "no database path given");
        return OUTBOX_EINVAL;
    }
    if (stat(path, &st) != 0) {
        if (errno != ENOENT || !(flags & OUTBOX_OPEN_CREATE)) {
            set_err(err, errlen, "cannot open database '%s': %s", path, strerror(errno));
            return OUTBOX_EIO;
        }
        /* Creating: say plainly when the directory is what is missing. */
        {
            char parent[4096];
            char *slash;
            outbox__strlcpy(parent, path, sizeof parent);
            slash = strrchr(parent, '/');
            if (slash && slash != parent) {
                *slash = '\0';
                errno = 0;
                if (stat(parent, &st) != 0 || !S_ISDIR(st.st_mode)) {
                    set_err(err, errlen, "cannot create database '%s': directory '%s': %s", path, parent,
                            errno ? strerror(errno) : "not a directory");
                    return OUTBOX_EIO;
                }
            }
        }
    } else if (S_ISDIR(st.st_mode)) {
        set_err(err, errlen, "cannot open database '%s': it is a directory", path);
        return OUTBOX_EIO;
    }

    if (flags & OUTBOX_OPEN_READONLY)
        oflags = SQLITE_OPEN_READONLY;
    else
        oflags = SQLITE_OPEN_READWRITE | ((flags & OUTBOX_OPEN_CREATE) ? SQLITE_OPEN_CREATE : 0);
    rc = sqlite3_open_v2(path, &db, oflags | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, "cannot open database '%s': %s", path, db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
        e = outbox__sqlite_code(rc);
        goto fail;
    }
    sqlite3_extended_result_codes(db, 1);
    if ((e = outbox_db_busy_wait(db, (flags & OUTBOX_OPEN_RELAY) ? 0 : OUTBOX__BUSY_MS)) != 0) {
        set_err(err, errlen, "cannot set the busy wait of '%s': %s", path, sqlite3_errmsg(db));
        goto fail;
    }

    /* Reading the schema is what tells a database from another file. */
    rc = sqlite3_exec(db, "SELECT count(*) FROM sqlite_master", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        e = outbox__sqlite_code(rc);
        if (e == OUTBOX_ENOTDB)
            set_err(err, errlen, "'%s' is not a usable SQLite database: %s", path, sqlite3_errmsg(db));
        else
            set_err(err, errlen, "cannot read database '%s': %s", path, why(db, wbuf, sizeof wbuf));
        goto fail;
    }

    if (!(flags & OUTBOX_OPEN_READONLY)) {
        sqlite3_stmt *st_mode = NULL;
        const unsigned char *mode = NULL;
        rc = sqlite3_prepare_v2(db, "PRAGMA journal_mode=WAL", -1, &st_mode, NULL);
        if (rc == SQLITE_OK && sqlite3_step(st_mode) == SQLITE_ROW)
            mode = sqlite3_column_text(st_mode, 0);
        if (!mode || strcmp((const char *)mode, "wal") != 0) {
            set_err(err, errlen, "cannot switch '%s' to WAL mode: %s", path,
                    mode ? (const char *)mode : why(db, wbuf, sizeof wbuf));
            e = outbox__sqlite_code(rc == SQLITE_OK ? sqlite3_errcode(db) : rc);
            if (e == 0)
                e = OUTBOX_ESQLITE;
            sqlite3_finalize(st_mode);
            goto fail;
        }
        sqlite3_finalize(st_mode);
        /* The outbox table and its indexes share the cache; the default
         * 2 MiB stops holding their working pages at a few hundred thousand
         * rows, and every insert then reads some back. The relay raises its
         * own further. */
        sqlite3_exec(db, "PRAGMA cache_size=-8192", NULL, NULL, NULL);
        rc = sqlite3_exec(db, (flags & OUTBOX_OPEN_RELAY) ? "PRAGMA synchronous=NORMAL" : "PRAGMA synchronous=FULL",
                          NULL, NULL, NULL);
        if (rc != SQLITE_OK) {
            set_err(err, errlen, "cannot set synchronous on '%s': %s", path, sqlite3_errmsg(db));
            e = outbox__sqlite_code(rc);
            goto fail;
        }
    }
    *out = db;
    return 0;
fail:
    outbox__sqlfail_get(db, f);
    if (f && !db)
        f->rc = rc;
    sqlite3_close_v2(db);
    return e ? e : OUTBOX_ESQLITE;
}

int outbox_db_is_durable(sqlite3 *db)
{
    int64_t level = -1;
    int rc = outbox__sqlite_int(db, "PRAGMA synchronous", &level);
    if (rc != 0)
        return rc;
    return level >= 2;
}

/* Schema 1 -> 2: per-key ordering looks at a key's previous row only, through
 * an index that claims and marks do not write to. Its outbox_key (every
 * keyed row) is not built here: the steps up to the current version run in
 * one transaction, and 2 -> 3 replaces it at once, so building it would
 * only cost a pass over every keyed row of an old database. */
static const char migrate_1_to_2[] = "DROP INDEX IF EXISTS outbox_key_open;";

/* Schema 2 -> 3: rows made to wait by due time (outbox_due), and a per-key
 * index of only the rows that can hold back a later row of their key, so
 * that an INSERT writes to neither per-key nor random-order pages. A row
 * claimed before but pending again with available_at not after created_at
 * (a release within the millisecond of its creation) is moved to the
 * waiting rows, where every claimed row belongs. Schema 3's index of new
 * rows (outbox_new) is not built: 4 -> 5 replaces it in the same
 * transaction. */
static const char migrate_2_to_3[] =
    "DROP INDEX IF EXISTS outbox_due;"
    "DROP INDEX IF EXISTS outbox_key;"
    "CREATE INDEX outbox_due ON outbox(available_at) WHERE state = 0 AND available_at > created_at;"
    "UPDATE outbox SET available_at = created_at + 1 "
    "WHERE state = 0 AND available_at <= created_at AND lease_token > 0;"
    "CREATE INDEX outbox_key ON outbox(topic, key, seq) "
    "WHERE key IS NOT NULL AND (state = 1 OR (state = 0 AND available_at > created_at));";

/*
 * Schema 3 -> 4: the state CHECK as a chain of comparisons. SQLite codes
 * `state IN (0, 1, 2, 3)` (a constant list of more than two values) as an
 * ephemeral B-tree built afresh on every run of a statement that writes the
 * column: every INSERT, and every mark the relay writes, paid 1.5-3 us for
 * it. The two expressions accept exactly the same values, so the table's
 * stored SQL is edited in place (SQLite's documented procedure for changing
 * a constraint without rewriting the table: writable_schema, then a new
 * schema_version so that every connection reloads it); no row is touched.
 * A table whose stored text does not have the old CHECK word for word keeps
 * what it has (slower, not wrong).
 */
static const char old_state_check[] = "CHECK (state IN (0, 1, 2, 3))";
static const char new_state_check[] = "CHECK (state = 0 OR state = 1 OR state = 2 OR state = 3)";

static int migrate_3_to_4(sqlite3 *db, char **msg)
{
    int64_t cookie = 0;
    int defensive = 0, rc;
    char sql[512];

    if (outbox__sqlite_int(db, "PRAGMA schema_version", &cookie) != 0)
        return sqlite3_errcode(db) ? sqlite3_errcode(db) : SQLITE_ERROR;
    /* A connection in defensive mode may not write the schema table. */
    sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, -1, &defensive);
    if (defensive)
        sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 0, NULL);
    rc = sqlite3_exec(db, "PRAGMA writable_schema=ON", NULL, NULL, msg);
    if (rc == SQLITE_OK) {
        snprintf(sql, sizeof sql,
                 "UPDATE sqlite_schema SET sql = replace(sql, '%s', '%s') "
                 "WHERE type = 'table' AND name = 'outbox' AND instr(sql, '%s') > 0",
                 old_state_check, new_state_check, old_state_check);
        rc = sqlite3_exec(db, sql, NULL, NULL, msg);
    }
    if (rc == SQLITE_OK && sqlite3_changes(db) > 0) {
        snprintf(sql, sizeof sql, "PRAGMA schema_version=%lld", (long long)cookie + 1);
        rc = sqlite3_exec(db, sql, NULL, NULL, msg);
    }
    sqlite3_exec(db, "PRAGMA writable_schema=OFF", NULL, NULL, NULL);
    if (defensive)
        sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL);
    return rc;
}

/*
 * Schema 4 -> 5: new rows are found by walking the table from a cursor
 * (outbox_cursor) instead of through an index of their own (outbox_new),
 * which cost every INSERT a write to one more B-tree: in a one-row business
 * transaction, one more page to the WAL. The cursor starts at the first new
 * row (found through outbox_new while it exists, by a walk of the table
 * otherwise), or after the last row. Its triggers keep it within reach of
 * new rows when rows are deleted at the end of the table or a waiting row
 * is made new again; outbox_stray finds rows made pending again by hand
 * that the walk has passed.
 */
static const char migrate_4_to_5[] =
    "CREATE TABLE outbox_cursor (one INTEGER PRIMARY KEY CONSTRAINT one_row CHECK (one = 1), "
    "new_from INTEGER NOT NULL);"
    "INSERT INTO outbox_cursor(one, new_from) VALUES (1, coalesce("
    "(SELECT seq FROM outbox WHERE state = 0 AND available_at <= created_at ORDER BY seq LIMIT 1), "
    "(SELECT coalesce(max(seq), 0) + 1 FROM outbox)));"
    "DROP INDEX IF EXISTS outbox_new;"
    "CREATE INDEX outbox_stray ON outbox(seq) WHERE state = 0 AND available_at <= created_at AND lease_token > 0;"
    "CREATE TRIGGER outbox_cursor_after_delete AFTER DELETE ON outbox "
    "WHEN old.seq >= (SELECT new_from FROM outbox_cursor) - 1 "
    "BEGIN "
    "UPDATE outbox_cursor SET new_from = (SELECT coalesce(max(seq), 0) + 1 FROM outbox) "
    "WHERE new_from > (SELECT coalesce(max(seq), 0) + 1 FROM outbox); "
    "END;"
    "CREATE TRIGGER outbox_cursor_after_update AFTER UPDATE OF available_at, created_at ON outbox "
    "WHEN new.state = 0 AND new.available_at <= new.created_at AND new.seq < (SELECT new_from FROM outbox_cursor) "
    "BEGIN "
    "UPDATE outbox_cursor SET new_from = new.seq WHERE new_from > new.seq; "
    "END;";

/*
 * Schema 5 -> 6: batch leases. A claim of new rows writes one record per
 * batch (outbox_batch: a seq range, owner, token, expiry) instead of a lease
 * per row, and a batch published is one write to it; rows are written one by
 * one only for exceptions. Rows of a version 5 database keep their own state
 * (a leased row stays leased on its own, and so on): no row is rewritten.
 * The view outbox_messages derives each row's state. The update trigger no
 * longer moves the cursor back (a row made new again below it becomes a
 * waiting row due at once), and the delete trigger drops batch records past
 * the end of the table.
 */
static const char migrate_5_to_6[] =
    "CREATE TABLE outbox_batch ( "
    "lo           INTEGER PRIMARY KEY, "
    "hi           INTEGER NOT NULL CONSTRAINT batch_range CHECK (hi >= lo), "
    "state        INTEGER NOT NULL CONSTRAINT batch_state_is_1_or_2 CHECK (state = 1 OR state = 2), "
    "owner        TEXT, "
    "token        INTEGER NOT NULL CONSTRAINT batch_token_positive CHECK (token > 0), "
    "lease_until  INTEGER, "
    "attempts     INTEGER NOT NULL DEFAULT 1, "
    "published_at INTEGER "
    "); "
    "CREATE INDEX outbox_batch_leased ON outbox_batch(lease_until) WHERE state = 1; "
    "CREATE INDEX outbox_batch_published ON outbox_batch(published_at) WHERE state = 2; "
    "DROP TRIGGER IF EXISTS outbox_cursor_after_delete;"
    "CREATE TRIGGER outbox_cursor_after_delete AFTER DELETE ON outbox "
    "WHEN old.seq >= (SELECT new_from FROM outbox_cursor) - 1 "
    "BEGIN "
    "UPDATE outbox_cursor SET new_from = (SELECT coalesce(max(seq), 0) + 1 FROM outbox) "
    "WHERE new_from > (SELECT coalesce(max(seq), 0) + 1 FROM outbox); "
    "DELETE FROM outbox_batch WHERE lo > (SELECT coalesce(max(seq), 0) FROM outbox); "
    "UPDATE outbox_batch SET hi = (SELECT coalesce(max(seq), 0) FROM outbox) "
    "WHERE hi > (SELECT coalesce(max(seq), 0) FROM outbox); "
    "END; "
    "DROP TRIGGER IF EXISTS outbox_cursor_after_update;"
    "CREATE TRIGGER outbox_cursor_after_update AFTER UPDATE OF available_at, created_at ON outbox "
    "WHEN new.state = 0 AND new.available_at <= new.created_at AND new.seq < (SELECT new_from FROM outbox_cursor) "
    "BEGIN "
    "UPDATE outbox SET available_at = new.created_at + 1 WHERE seq = new.seq; "
    "END; "
    "DROP VIEW IF EXISTS outbox_messages;"
    "CREATE VIEW outbox_messages AS "
    "SELECT o.seq AS seq, o.id AS id, o.topic AS topic, o.key AS key, o.payload AS payload, o.headers AS headers, "
    "o.created_at AS created_at, o.available_at AS available_at, "
    "CASE WHEN b.lo IS NULL THEN o.state ELSE b.state END AS state, "
    "o.attempts + coalesce(b.attempts, 0) AS attempts, "
    "CASE WHEN b.lo IS NULL THEN o.lease_owner WHEN b.state = 1 THEN b.owner END AS lease_owner, "
    "CASE WHEN b.lo IS NULL THEN o.lease_token ELSE b.token END AS lease_token, "
    "CASE WHEN b.lo IS NULL THEN o.lease_until WHEN b.state = 1 THEN b.lease_until END AS lease_until, "
    "o.last_error AS last_error, "
    "CASE WHEN b.lo IS NULL THEN o.published_at ELSE b.published_at END AS published_at, "
    "o.stream_id AS stream_id, o.replay_count AS replay_count, o.replayed_at AS replayed_at, "
    "o.replay_reason AS replay_reason, b.lo AS batch "
    "FROM outbox o LEFT JOIN outbox_batch b "
    "ON o.state = 0 AND o.available_at <= o.created_at AND o.lease_token = 0 "
    "AND b.lo = (SELECT max(x.lo) FROM outbox_batch x WHERE x.lo <= o.seq) AND b.hi >= o.seq; ";

/*
 * Schema 6 -> 7: what the figures (rows by state) need in order not to walk
 * the rows: the holes of the batch ranges and of the cursor's part of the
 * table (outbox_gone, found here by one walk of the rows of those ranges:
 * each row whose next seq has no row starts a gap, which ends at the next
 * row or at the range's end), and the total length of the published ranges
 * (outbox_tally), with the triggers that keep both from then on.
 */
static const char migrate_6_to_7[] =
    "CREATE TABLE outbox_gone (seq INTEGER PRIMARY KEY);"
    "CREATE TABLE outbox_tally (one INTEGER PRIMARY KEY CONSTRAINT one_row CHECK (one = 1), "
    "published INTEGER NOT NULL);"
    "INSERT INTO outbox_tally(one, published) "
    "VALUES (1, (SELECT coalesce(sum(hi - lo + 1), 0) FROM outbox_batch WHERE state = 2));"
    "WITH RECURSIVE "
    "r(lo, hi) AS (SELECT lo, hi FROM outbox_batch "
    "UNION ALL SELECT new_from, (SELECT max(seq) FROM outbox) FROM outbox_cursor), "
    "starts(hi, a) AS (SELECT hi, lo FROM r WHERE lo <= hi AND NOT EXISTS (SELECT 1 FROM outbox WHERE seq = r.lo) "
    "UNION ALL SELECT r.hi, o.seq + 1 FROM r JOIN outbox o ON o.seq >= r.lo AND o.seq < r.hi "
    "WHERE NOT EXISTS (SELECT 1 FROM outbox x WHERE x.seq = o.seq + 1)), "
    "gaps(a, b) AS (SELECT a, min(hi, coalesce((SELECT min(seq) FROM outbox WHERE seq > starts.a), hi + 1) - 1) "
    "FROM starts), "
    "s(seq, b) AS (SELECT a, b FROM gaps WHERE a <= b UNION ALL SELECT seq + 1, b FROM s WHERE seq < b) "
    "INSERT OR IGNORE INTO outbox_gone(seq) SELECT seq FROM s;"
    "CREATE TRIGGER outbox_gone_after_delete AFTER DELETE ON outbox "
    "WHEN old.seq >= coalesce((SELECT new_from FROM outbox_cursor), 0) "
    "OR old.seq <= (SELECT hi FROM outbox_batch WHERE lo <= old.seq ORDER BY lo DESC LIMIT 1) "
    "BEGIN "
    "INSERT OR IGNORE INTO outbox_gone(seq) VALUES (old.seq); "
    "END;"
    "CREATE TRIGGER outbox_batch_after_insert AFTER INSERT ON outbox_batch "
    "WHEN new.state = 2 "
    "BEGIN "
    "UPDATE outbox_tally SET published = published + new.hi - new.lo + 1; "
    "END;"
    "CREATE TRIGGER outbox_batch_after_update AFTER UPDATE OF lo, hi, state ON outbox_batch "
    "WHEN old.state = 2 OR new.state = 2 "
    "BEGIN "
    "UPDATE outbox_tally SET published = published "
    "- CASE WHEN old.state = 2 THEN old.hi - old.lo + 1 ELSE 0 END "
    "+ CASE WHEN new.state = 2 THEN new.hi - new.lo + 1 ELSE 0 END; "
    "END;"
    "CREATE TRIGGER outbox_batch_after_delete AFTER DELETE ON outbox_batch "
    "BEGIN "
    "UPDATE outbox_tally SET published = published - (old.hi - old.lo + 1) WHERE old.state = 2; "
    "DELETE FROM outbox_gone WHERE seq BETWEEN old.lo AND old.hi; "
    "END;";

/* migrations[v] takes a database from version v to v + 1 (as far as the
 * next steps need: they all run, in one transaction): SQL, or a function
 * for what SQL alone cannot say. */
static const struct {
    const char *sql;
    int (*run)(sqlite3 *db, char **msg);
} migrations[] = {{NULL, NULL},
                  {migrate_1_to_2, NULL},
                  {migrate_2_to_3, NULL},
                  {NULL, migrate_3_to_4},
                  {migrate_4_to_5, NULL},
                  {migrate_5_to_6, NULL},
                  {migrate_6_to_7, NULL}};
_Static_assert(sizeof migrations / sizeof migrations[0] == OUTBOX_SCHEMA_VERSION, "a migration per version");

/* The tables a version has besides outbox (from 5, 6 and 7 on). */
static const char *const side_tables[] = {"outbox_cursor", "outbox_batch", "outbox_gone", "outbox_tally"};

/* Runs sql, reading the names in column col of its rows: bit i of *found
 * for each one equal to names[i]; *nrows (if given) the rows. 0 or
 * OUTBOX_E*. */
static int names_of(sqlite3 *db, const char *sql, int col, const char *const *names, size_t n, uint64_t *found,
                    int64_t *nrows)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    size_t i;
    *found = 0;
    if (nrows)
        *nrows = 0;
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *name = (const char *)sqlite3_column_text(st, col);
        if (nrows)
            (*nrows)++;
        for (i = 0; name && i < n; i++)
            if (strcmp(name, names[i]) == 0)
                *found |= 1ull << i;
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    return rc == SQLITE_DONE || rc == SQLITE_OK ? 0 : outbox__sqlite_code(rc);
}

/* Reads user_version and the table; shared by apply and check. *exists:
 * the outbox table is there (with every required column, else
 * OUTBOX_EFOREIGN naming the first one missing). */
static int examine(sqlite3 *db, int64_t *version, int *exists, char *err, size_t errlen)
{
    uint64_t cols = 0, tables = 0;
    int64_t ncols = 0;
    size_t i;
    int e;

    *exists = 0;
    e = outbox__sqlite_int(db, "PRAGMA user_version", version);
    if (e != 0) {
        set_err(err, errlen, "cannot read the schema version: %s", sqlite3_errmsg(db));
        return e;
    }
    /* The table's columns, and the side tables present in one query (a
     * relay of many databases opens each one: these were seven statements,
     * and through pragma_table_info()'s virtual table). */
    e = names_of(db, "PRAGMA table_info='outbox'", 1, required_columns, OUTBOX_ARRAY_LEN(required_columns), &cols,
                 &ncols);
    if (e == 0)
        e = names_of(db,
                     "SELECT name FROM sqlite_schema WHERE type = 'table' AND name IN "
                     "('outbox_cursor', 'outbox_batch', 'outbox_gone', 'outbox_tally')",
                     0, side_tables, OUTBOX_ARRAY_LEN(side_tables), &tables, NULL);
    if (e != 0) {
        set_err(err, errlen, "cannot inspect table outbox: %s", sqlite3_errmsg(db));
        return e;
    }
    if (*version > OUTBOX_SCHEMA_VERSION) {
        set_err(err, errlen,
                "outbox schema version %lld is newer than this library's %d: upgrade outbox "
                "(or PRAGMA user_version is used by another program)",
                (long long)*version, OUTBOX_SCHEMA_VERSION);
        return OUTBOX_ESCHEMANEWER;
    }
    if (ncols > 0) {
        *exists = 1;
        for (i = 0; i < OUTBOX_ARRAY_LEN(required_columns); i++)
            if (!(cols & (1ull << i))) {
                set_err(err, errlen,
                        "table 'outbox' exists but is not an outbox table: it has no column '%s' "
                        "(another program's table? rename it or use another database)",
                        required_columns[i]);
                return OUTBOX_EFOREIGN;
            }
    }
    if (*version == 0 && *exists) {
        set_err(err, errlen,
                "table 'outbox' exists but was not created by outbox (schema version 0): "
                "another program's table? rename it or use another database");
        return OUTBOX_EFOREIGN;
    }
    if (*version > 0 && !*exists) {
        set_err(err, errlen, "schema version is %lld but table 'outbox' is missing (dropped by hand?)",
                (long long)*version);
        return OUTBOX_EFOREIGN;
    }
    if (*version >= 5) {
        size_t ntables = *version >= 7 ? 4u : *version >= 6 ? 2u : 1u;
        for (i = 0; i < ntables; i++)
            if (!(tables & (1ull << i))) {
                set_err(err, errlen, "schema version is %lld but table '%s' is missing (dropped by hand?)",
                        (long long)*version, side_tables[i]);
                return OUTBOX_EFOREIGN;
            }
    }
    return 0;
}

int outbox_schema_check(sqlite3 *db, char *err, size_t errlen)
{
    int64_t version = 0;
    int exists = 0, e;
    if (!db)
        return OUTBOX_EINVAL;
    e = examine(db, &version, &exists, err, errlen);
    if (e != 0)
        return e;
    if (version < OUTBOX_SCHEMA_VERSION) {
        if (version == 0)
            set_err(err, errlen, "database has no outbox schema: run 'outbox-relay init --db PATH' first");
        else
            set_err(err, errlen, "outbox schema version %lld is older than %d: run 'outbox-relay init --db PATH'",
                    (long long)version, OUTBOX_SCHEMA_VERSION);
        return OUTBOX_ENOSCHEMA;
    }
    return 0;
}

int outbox_schema_apply(sqlite3 *db, char *err, size_t errlen)
{
    return outbox__schema_apply_rc(db, NULL, err, errlen);
}

int outbox__schema_apply_rc(sqlite3 *db, outbox__sqlfail *f, char *err, size_t errlen)
{
    int64_t version = 0;
    int exists = 0, reload = 0, e, rc;
    char *msg = NULL;
    char sql[64];

    outbox__sqlfail_get(NULL, f);
    if (!db)
        return OUTBOX_EINVAL;
    if (!sqlite3_get_autocommit(db)) {
        set_err(err, errlen, "cannot apply the schema inside an open transaction");
        return OUTBOX_ESTATE;
    }
    /* Cheap check first, so that a refused database is never written to. */
    e = examine(db, &version, &exists, err, errlen);
    if (e != 0) {
        outbox__sqlfail_get(db, f);
        return e;
    }
    if (version == OUTBOX_SCHEMA_VERSION)
        return 0;

    rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, "cannot begin the schema transaction: %s", sqlite3_errmsg(db));
        outbox__sqlfail_get(db, f);
        return outbox__sqlite_code(rc);
    }
    /* Again under the write lock: another process may have migrated since. */
    e = examine(db, &version, &exists, err, errlen);
    if (e != 0 || version == OUTBOX_SCHEMA_VERSION)
        goto done;
    /* Version 0: the whole schema. Older versions: their steps, in order. */
    if (version == 0) {
        rc = sqlite3_exec(db, outbox__schema_sql, NULL, NULL, &msg);
    } else {
        /* A migration that edits the stored schema leaves this connection
         * with the old one in memory: reloaded after the commit. */
        reload = version < 4;
        for (rc = SQLITE_OK; rc == SQLITE_OK && version < OUTBOX_SCHEMA_VERSION; version++)
            rc = migrations[version].run ? migrations[version].run(db, &msg)
                                         : sqlite3_exec(db, migrations[version].sql, NULL, NULL, &msg);
    }
    if (rc != SQLITE_OK) {
        set_err(err, errlen, "cannot %s the outbox schema: %s", exists ? "migrate" : "create",
                msg ? msg : sqlite3_errstr(rc));
        e = outbox__sqlite_code(rc);
        goto done;
    }
    snprintf(sql, sizeof sql, "PRAGMA user_version=%d", OUTBOX_SCHEMA_VERSION);
    rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, "cannot record the schema version: %s", msg ? msg : sqlite3_errstr(rc));
        e = outbox__sqlite_code(rc);
    }
done:
    sqlite3_free(msg);
    if (e == 0) {
        rc = sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
        if (rc != SQLITE_OK) {
            set_err(err, errlen, "cannot commit the schema: %s", sqlite3_errmsg(db));
            e = outbox__sqlite_code(rc);
        } else if (reload) {
            sqlite3_exec(db, "PRAGMA writable_schema=RESET", NULL, NULL, NULL);
        }
    }
    /* The failure's code before ROLLBACK replaces it. */
    if (e != 0)
        outbox__sqlfail_get(db, f);
    if (e != 0 && !sqlite3_get_autocommit(db))
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    return e;
}
