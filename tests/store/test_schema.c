/* Opening databases and the schema contract: creation, idempotence,
 * refusal of foreign and newer schemas, plain-SQL inserts, durability. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/figures.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

static char *dir;

static int64_t one_int(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st;
    int64_t v = -1;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        return -2;
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return v;
}

/* The first column of the first row as text (malloc'd), or NULL. */
static char *one_text(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st;
    char *v = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        return NULL;
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
        v = strdup((const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    return v;
}

/* Everything of the schema but the outbox table (its indexes, the cursor
 * table and its triggers), name and SQL, in name order, without white space: the
 * SQL a migration writes is laid out differently from proto/schema.sql's. */
static const char index_sql[] =
    "SELECT group_concat(name || ': ' || replace(replace(replace(sql, ' ', ''), char(10), ''), char(9), ''), "
    "char(10)) FROM (SELECT name, sql FROM sqlite_master WHERE name <> 'outbox' AND sql IS NOT NULL ORDER BY name)";

/* The outbox table's SQL. */
static const char table_sql[] = "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'outbox'";

/* Turns a current database back into schema 3 (its state CHECK, an IN list),
 * the way an older library wrote it. */
static const char v3_table[] =
    "PRAGMA writable_schema=ON;"
    "UPDATE sqlite_master SET sql = replace(sql, 'CHECK (state = 0 OR state = 1 OR state = 2 OR state = 3)', "
    "'CHECK (state IN (0, 1, 2, 3))') WHERE type = 'table' AND name = 'outbox';"
    "PRAGMA writable_schema=OFF;";

/* Whether a statement that writes the state column builds an ephemeral
 * table on every run (the cost schema 4 removed): 1, 0, or -1 on error. */
static int state_write_builds_table(sqlite3 *db)
{
    sqlite3_stmt *st;
    int found = 0;
    if (sqlite3_prepare_v2(db, "EXPLAIN UPDATE outbox SET state = 2 WHERE seq = 1", -1, &st, NULL) != SQLITE_OK)
        return -1;
    while (sqlite3_step(st) == SQLITE_ROW)
        if (strcmp((const char *)sqlite3_column_text(st, 1), "OpenEphemeral") == 0)
            found = 1;
    sqlite3_finalize(st);
    return found;
}

/* Turns a current database back into schema 6: no holes, no tally of the
 * published ranges, none of their triggers. */
static const char to_v6[] =
    "DROP TRIGGER outbox_gone_after_delete; DROP TRIGGER outbox_batch_after_insert;"
    "DROP TRIGGER outbox_batch_after_update; DROP TRIGGER outbox_batch_after_delete;"
    "DROP TABLE outbox_gone; DROP TABLE outbox_tally;";

/* Turns a schema 6 database back into schema 5: no batch records, no view,
 * schema 5's triggers. */
static const char to_v5[] =
    "DROP VIEW outbox_messages; DROP TABLE outbox_batch;"
    "DROP TRIGGER outbox_cursor_after_delete; DROP TRIGGER outbox_cursor_after_update;"
    "CREATE TRIGGER outbox_cursor_after_delete AFTER DELETE ON outbox "
    "WHEN old.seq >= (SELECT new_from FROM outbox_cursor) - 1 "
    "BEGIN UPDATE outbox_cursor SET new_from = (SELECT coalesce(max(seq), 0) + 1 FROM outbox) "
    "WHERE new_from > (SELECT coalesce(max(seq), 0) + 1 FROM outbox); END;"
    "CREATE TRIGGER outbox_cursor_after_update AFTER UPDATE OF available_at, created_at ON outbox "
    "WHEN new.state = 0 AND new.available_at <= new.created_at AND new.seq < (SELECT new_from FROM outbox_cursor) "
    "BEGIN UPDATE outbox_cursor SET new_from = new.seq WHERE new_from > new.seq; END;";

/* Drops the cursor and its triggers (schema 5). */
static const char drop_cursor[] = "DROP TRIGGER outbox_cursor_after_delete; DROP TRIGGER outbox_cursor_after_update;"
                                  "DROP TABLE outbox_cursor;";

/* Turns a current database without the cursor back into schema 4 (an index
 * of new rows). */
static const char v4_indexes[] = "DROP INDEX outbox_stray;"
                                 "CREATE INDEX outbox_new ON outbox(seq) WHERE state = 0 AND available_at <= created_at;";

/* Turns a current database back into schema 1 or 2 (their indexes). */
static const char v2_indexes[] = "DROP INDEX outbox_new; DROP INDEX outbox_due; DROP INDEX outbox_key;"
                                 "CREATE INDEX outbox_due ON outbox(available_at) WHERE state = 0;"
                                 "CREATE INDEX outbox_key ON outbox(topic, key, seq) WHERE key IS NOT NULL;";
static const char v1_indexes[] = "DROP INDEX outbox_key;"
                                 "CREATE INDEX outbox_key_open ON outbox(topic, key, seq) "
                                 "WHERE key IS NOT NULL AND state < 2;";

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len)
        bail("cannot write %s", path);
    fclose(f);
}

static sqlite3 *raw_open(const char *path)
{
    sqlite3 *db;
    if (sqlite3_open(path, &db) != SQLITE_OK)
        bail("sqlite3_open %s", path);
    return db;
}

static void test_create_and_idempotent(void)
{
    char *path = th_path(dir, "fresh.db"), err[512] = "";
    sqlite3 *db = NULL;
    int e;

    e = outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    is_int(e, 0, "open with CREATE makes a new database (%s)", err);
    is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_ENOSCHEMA, "check on an empty database: ENOSCHEMA");
    ok(strstr(err, "outbox-relay init") != NULL, "the message says what to do: %s", err);
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply creates the schema");
    is_int(one_int(db, "PRAGMA user_version"), OUTBOX_SCHEMA_VERSION, "user_version records the version");
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply again is a no-op");
    is_int(outbox_schema_check(db, err, sizeof err), 0, "check passes");
    ok(sqlite3_exec(db, "SELECT 1", NULL, NULL, NULL) == SQLITE_OK, "connection usable");
    {
        sqlite3_stmt *st;
        sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL);
        sqlite3_step(st);
        is_str((const char *)sqlite3_column_text(st, 0), "wal", "journal_mode is WAL");
        sqlite3_finalize(st);
    }
    is_int(one_int(db, "PRAGMA synchronous"), 2, "writer connection: synchronous=FULL");
    is_int(outbox_db_is_durable(db), 1, "durable");
    is_int(one_int(db, "SELECT outbox_busy_wait_ms()"), 5000, "writer connection: a busy wait of 5000 ms");
    is_int(one_int(db, "PRAGMA busy_timeout"), 0, "writer connection: no busy timeout (a busy handler instead)");

    /* A plain INSERT from any client is a complete message. */
    ok(sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('m1', 'orders', x'0102')", NULL, NULL,
                    NULL) == SQLITE_OK,
       "plain INSERT of id, topic, payload works");
    is_int(one_int(db, "SELECT state FROM outbox_messages WHERE id='m1'"), 0, "it is pending");
    ok(one_int(db, "SELECT created_at FROM outbox_messages WHERE id='m1'") > 1600000000000LL, "created_at defaults to unix ms");
    ok(llabs((long long)(one_int(db, "SELECT available_at FROM outbox_messages WHERE id='m1'") - outbox_now_ms())) < 60000,
       "available_at defaults to now");
    ok(sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('bad id', 'orders', x'00')", NULL, NULL,
                    NULL) != SQLITE_OK,
       "the schema refuses an id with a space");
    ok(strstr(sqlite3_errmsg(db), "id_is_1_to_128_printable_ascii") != NULL, "named constraint: %s",
       sqlite3_errmsg(db));
    ok(sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('m2', 'or{ders}', x'00')", NULL, NULL,
                    NULL) != SQLITE_OK,
       "the schema refuses a topic with braces");
    ok(sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('m1', 'orders', x'00')", NULL, NULL,
                    NULL) != SQLITE_OK,
       "the schema refuses a duplicate id");
    ok(sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload, headers) VALUES ('m3', 'orders', x'00', 'text')",
                    NULL, NULL, NULL) != SQLITE_OK,
       "the schema refuses text headers");
    sqlite3_close_v2(db);

    /* Apply through a second connection while the first holds the file. */
    {
        sqlite3 *a = NULL, *b = NULL;
        is_int(outbox_db_open(path, 0, &a, err, sizeof err), 0, "reopen without CREATE");
        is_int(outbox_db_open(path, OUTBOX_OPEN_RELAY, &b, err, sizeof err), 0, "relay connection");
        is_int(one_int(b, "PRAGMA busy_timeout"), 0, "relay connection: busy_timeout 0");
        is_int(one_int(b, "SELECT outbox_busy_wait_ms()"), -2, "relay connection: no busy wait");
        is_int(one_int(b, "PRAGMA synchronous"), 1, "relay connection: synchronous=NORMAL");
        is_int(outbox_db_is_durable(b), 0, "relay connection is not durable (by design)");
        is_int(outbox_schema_apply(a, err, sizeof err), 0, "apply on a current schema from conn a");
        is_int(outbox_schema_apply(b, err, sizeof err), 0, "and from conn b");
        sqlite3_close_v2(a);
        sqlite3_close_v2(b);
    }
    free(path);
}

static void test_refusals(void)
{
    char err[512] = "";
    sqlite3 *db = NULL;
    char *p;
    int e;

    /* Missing file without CREATE. */
    p = th_path(dir, "missing.db");
    e = outbox_db_open(p, 0, &db, err, sizeof err);
    is_int(e, OUTBOX_EIO, "missing file without CREATE: EIO");
    ok(db == NULL && strstr(err, "No such file") != NULL, "message: %s", err);
    ok(access(p, F_OK) != 0, "no file was created");
    free(p);

    /* A directory. */
    e = outbox_db_open(dir, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    is_int(e, OUTBOX_EIO, "a directory: EIO");
    ok(strstr(err, "directory") != NULL, "message: %s", err);

    /* Not a database. */
    p = th_path(dir, "text.db");
    write_file(p, "hello, this is not a database at all, just some text that is long enough\n", 74);
    e = outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    is_int(e, OUTBOX_ENOTDB, "a text file: ENOTDB");
    ok(strstr(err, "not a usable SQLite database") != NULL, "message: %s", err);
    free(p);

    /* A corrupt database: a valid header, garbage pages. */
    {
        char *good = th_path(dir, "corrupt.db");
        sqlite3 *raw = raw_open(good);
        unsigned char junk[4096];
        int fd;
        sqlite3_exec(raw, "PRAGMA journal_mode=DELETE; CREATE TABLE t(x); INSERT INTO t VALUES (1);", NULL, NULL,
                     NULL);
        sqlite3_close(raw);
        memset(junk, 0xA5, sizeof junk);
        fd = open(good, O_WRONLY);
        if (fd < 0 || pwrite(fd, junk, 200, 100) != 200)
            bail("corrupting");
        close(fd);
        e = outbox_db_open(good, 0, &db, err, sizeof err);
        if (e == 0) {
            e = outbox_schema_apply(db, err, sizeof err);
            sqlite3_close_v2(db);
            db = NULL;
        }
        is_int(e, OUTBOX_ENOTDB, "a corrupt database: ENOTDB (%s)", err);
        free(good);
    }

    /* A foreign outbox table (user_version 0). */
    p = th_path(dir, "foreign.db");
    db = raw_open(p);
    sqlite3_exec(db, "CREATE TABLE outbox(id INTEGER PRIMARY KEY, body TEXT)", NULL, NULL, NULL);
    e = outbox_schema_apply(db, err, sizeof err);
    is_int(e, OUTBOX_EFOREIGN, "foreign outbox table: EFOREIGN");
    ok(strstr(err, "not an outbox table") != NULL || strstr(err, "not created by outbox") != NULL, "message: %s",
       err);
    is_int(one_int(db, "PRAGMA user_version"), 0, "user_version untouched");
    is_int(one_int(db, "SELECT count(*) FROM pragma_table_info('outbox')"), 2, "foreign table untouched");
    is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_EFOREIGN, "check says EFOREIGN too");
    /* A foreign table with a version set but missing columns. */
    sqlite3_exec(db, "PRAGMA user_version=1", NULL, NULL, NULL);
    e = outbox_schema_check(db, err, sizeof err);
    is_int(e, OUTBOX_EFOREIGN, "version 1 but wrong columns: EFOREIGN");
    ok(strstr(err, "no column 'seq'") != NULL, "names the missing column: %s", err);
    sqlite3_close(db);
    free(p);

    /* Schemas 1 to 5 are migrated to the current one in place: the same
     * table, indexes, cursor, batch records, view and triggers as a new
     * database, rows kept (schema 5's leased and published rows keep their
     * own state), a
     * row claimed before that went back to pending in the millisecond of its
     * creation moves to the waiting rows, and the cursor starts at the first
     * new row. The migrating connection uses the new state CHECK at once,
     * another connection too. */
    {
        char *want, *got, *want_table, *got_table;
        p = th_path(dir, "current.db");
        db = raw_open(p);
        is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
        want = one_text(db, index_sql);
        ok(want && !strstr(want, "outbox_new") && strstr(want, "outbox_key") && strstr(want, "outbox_cursor:") &&
               strstr(want, "outbox_cursor_after_delete:") && strstr(want, "outbox_cursor_after_update:") &&
               strstr(want, "outbox_batch:") && strstr(want, "outbox_batch_leased:") &&
               strstr(want, "outbox_batch_published:") && strstr(want, "outbox_messages:") &&
               strstr(want, "outbox_gone:") && strstr(want, "outbox_tally:") &&
               strstr(want, "outbox_gone_after_delete:") && strstr(want, "outbox_batch_after_insert:") &&
               strstr(want, "outbox_batch_after_update:") && strstr(want, "outbox_batch_after_delete:"),
           "a new database: indexes, cursor, batch records, holes, tally, view and triggers");
        want_table = one_text(db, table_sql);
        is_int(state_write_builds_table(db), 0, "a new database: writing state builds no ephemeral table");
        sqlite3_close(db);
        free(p);
        for (int from = 1; from <= 6; from++) {
            char name[32];
            sqlite3 *other;
            snprintf(name, sizeof name, "v%d.db", from);
            p = th_path(dir, name);
            db = raw_open(p);
            is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
            is_int(sqlite3_exec(db, to_v6, NULL, NULL, NULL), SQLITE_OK, "back to schema 6");
            if (from <= 5)
                is_int(sqlite3_exec(db, to_v5, NULL, NULL, NULL), SQLITE_OK, "back to schema 5");
            if (from <= 4) {
                is_int(sqlite3_exec(db, drop_cursor, NULL, NULL, NULL), SQLITE_OK, "without the cursor");
                is_int(sqlite3_exec(db, v4_indexes, NULL, NULL, NULL), SQLITE_OK, "back to schema 4's indexes");
            }
            if (from <= 3) {
                is_int(sqlite3_exec(db, v3_table, NULL, NULL, NULL), SQLITE_OK, "back to schema 3's table");
                sqlite3_close(db);
                db = raw_open(p);
                is_int(state_write_builds_table(db), 1, "schema 3's state CHECK builds an ephemeral table");
            }
            if (from <= 2)
                is_int(sqlite3_exec(db, v2_indexes, NULL, NULL, NULL), SQLITE_OK, "back to schema 2's indexes");
            if (from == 1)
                is_int(sqlite3_exec(db, v1_indexes, NULL, NULL, NULL), SQLITE_OK, "back to schema 1's indexes");
            sqlite3_exec(db,
                         "INSERT INTO outbox(id, topic, key, payload) VALUES ('m1', 't', 'k', x'01'), "
                         "('m2', 't', NULL, x'02');"
                         "INSERT INTO outbox(id, topic, key, payload, created_at, available_at, lease_token) "
                         "VALUES ('m3', 't', 'k', x'03', 1000, 1000, 2);",
                         NULL, NULL, NULL);
            if (from == 5) /* a cursor past the rows of schema 5's relay: one leased, one published */
                sqlite3_exec(db,
                             "INSERT INTO outbox(id, topic, payload, state, lease_owner, lease_token, lease_until, "
                             "attempts, created_at, available_at) VALUES ('m4', 't', x'04', 1, 'old', 1, 5000, 1, "
                             "1000, 1001);"
                             "INSERT INTO outbox(id, topic, payload, state, lease_token, attempts, published_at, "
                             "stream_id) VALUES ('m5', 't', x'05', 2, 1, 1, 7000, '7-0');",
                             NULL, NULL, NULL);
            if (from == 6) /* schema 6's batches, with holes the migration must find */
                sqlite3_exec(db,
                             "INSERT INTO outbox(id, topic, payload) VALUES ('m4', 't', x'04'), ('m5', 't', x'05'), "
                             "('m6', 't', x'06'), ('m7', 't', x'07'), ('m8', 't', x'08'), ('m9', 't', x'09'), "
                             "('m10', 't', x'0a');"
                             "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, published_at) VALUES "
                             "(1, 6, 2, NULL, 1, NULL, 7000), (7, 8, 1, 'r', 1, 9000000000000, NULL);"
                             "UPDATE outbox_cursor SET new_from = 9;"
                             "DELETE FROM outbox WHERE id IN ('m4', 'm7', 'm9');",
                             NULL, NULL, NULL);
            snprintf(name, sizeof name, "PRAGMA user_version=%d", from);
            sqlite3_exec(db, name, NULL, NULL, NULL);
            is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_ENOSCHEMA,
                   "version %d: check asks for a migration", from);
            ok(strstr(err, "older") != NULL, "message: %s", err);
            if (from == 3 || from == 4) /* an application's connection in defensive mode */
                sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL);
            is_int(outbox_schema_apply(db, err, sizeof err), 0, "version %d -> %d applied (%s)", from,
                   OUTBOX_SCHEMA_VERSION, err);
            if (from == 3 || from == 4) {
                int on = 0;
                sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, -1, &on);
                is_int(on, 1, "defensive mode is on again after the migration");
            }
            is_int(one_int(db, "PRAGMA user_version"), OUTBOX_SCHEMA_VERSION, "user_version is now current");
            got = one_text(db, index_sql);
            ok(want && got && strcmp(want, got) == 0, "from %d: the indexes, cursor and triggers of a new database:\n%s",
               from, got ? got : "(none)");
            if (from < 6)
                is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 1,
                       "from %d: the cursor is at the first new row", from);
            free(got);
            got_table = one_text(db, table_sql);
            ok(want_table && got_table && strcmp(want_table, got_table) == 0, "from %d: the table of a new database",
               from);
            free(got_table);
            is_int(state_write_builds_table(db), 0, "from %d: the migrating connection uses the new CHECK", from);
            other = raw_open(p);
            is_int(state_write_builds_table(other), 0, "from %d: so does another connection", from);
            is_int(sqlite3_exec(other, "UPDATE outbox SET state = 4 WHERE id = 'm1'", NULL, NULL, NULL),
                   SQLITE_CONSTRAINT, "from %d: state 4 is still refused", from);
            is_int(sqlite3_exec(other, "UPDATE outbox SET state = 1.5 WHERE id = 'm1'", NULL, NULL, NULL),
                   SQLITE_CONSTRAINT, "from %d: state 1.5 is still refused", from);
            is_int(one_int(other, "SELECT count(*) FROM pragma_integrity_check WHERE integrity_check <> 'ok'"), 0,
                   "from %d: integrity_check ok", from);
            sqlite3_close(other);
            is_int(one_int(db, "SELECT count(*) FROM outbox_messages"), from == 5 ? 5 : from == 6 ? 7 : 3, "rows kept");
            if (from == 6) {
                outbox__figures f;
                char *holes = one_text(db, "SELECT group_concat(seq) FROM (SELECT seq FROM outbox_gone ORDER BY seq)");
                is_str(holes, "4,7,9", "from 6: the holes of the batch ranges and after the cursor are found");
                free(holes);
                is_int(one_int(db, "SELECT published FROM outbox_tally"), 6, "from 6: the published ranges' length");
                is_int(outbox__figures_read(db, outbox_now_ms(), &f), 0, "from 6: the figures");
                for (int st = 0; st < OUTBOX_STATE_COUNT; st++) {
                    char q[96];
                    snprintf(q, sizeof q, "SELECT count(*) FROM outbox_messages WHERE state = %d", st);
                    is_int(f.by_state[st], one_int(db, q), "from 6: state %d as the view counts it", st);
                }
            }
            if (from == 5) {
                is_int(one_int(db, "SELECT state FROM outbox_messages WHERE id = 'm4' AND lease_owner = 'old' "
                                   "AND lease_token = 1 AND batch IS NULL"),
                       1, "from 5: a leased row stays leased on its own");
                is_int(one_int(db, "SELECT state FROM outbox_messages WHERE id = 'm5' AND published_at = 7000 "
                                   "AND stream_id = '7-0'"),
                       2, "from 5: a published row keeps its state, time and entry id");
                is_int(one_int(db, "SELECT count(*) FROM outbox_batch"), 0, "from 5: no batch record");
            }
            if (from <= 2) { /* schema 3 had these rows right already */
                is_int(one_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0 AND available_at <= created_at"), 2,
                       "new rows stay new");
                is_int(one_int(db, "SELECT available_at - created_at FROM outbox_messages WHERE id = 'm3'"), 1,
                       "a row claimed before is a waiting row");
            }
            is_int(outbox_schema_check(db, err, sizeof err), 0, "check passes");
            sqlite3_close(db);
            free(p);
        }
        free(want);
        free(want_table);
    }

    /* A newer schema. */
    p = th_path(dir, "newer.db");
    db = raw_open(p);
    sqlite3_exec(db, "PRAGMA user_version=99", NULL, NULL, NULL);
    e = outbox_schema_apply(db, err, sizeof err);
    is_int(e, OUTBOX_ESCHEMANEWER, "newer schema: ESCHEMANEWER");
    ok(strstr(err, "99") != NULL && strstr(err, "newer") != NULL, "message: %s", err);
    is_int(one_int(db, "SELECT count(*) FROM sqlite_master"), 0, "nothing created");
    sqlite3_close(db);
    free(p);

    /* Version set but the table was dropped. */
    p = th_path(dir, "dropped.db");
    db = raw_open(p);
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
    sqlite3_exec(db, "DROP TABLE outbox", NULL, NULL, NULL);
    is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_EFOREIGN, "dropped table is reported");
    ok(strstr(err, "missing") != NULL, "message: %s", err);
    sqlite3_close(db);
    free(p);

    /* Version set but the cursor table was dropped. */
    p = th_path(dir, "nocursor.db");
    db = raw_open(p);
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
    sqlite3_exec(db, drop_cursor, NULL, NULL, NULL);
    is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_EFOREIGN, "dropped cursor table is reported");
    ok(strstr(err, "outbox_cursor") != NULL && strstr(err, "missing") != NULL, "message: %s", err);
    sqlite3_close(db);
    free(p);

    /* Version set but the batch records' table was dropped. */
    p = th_path(dir, "nobatch.db");
    db = raw_open(p);
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
    sqlite3_exec(db, "DROP VIEW outbox_messages; DROP TABLE outbox_batch", NULL, NULL, NULL);
    is_int(outbox_schema_check(db, err, sizeof err), OUTBOX_EFOREIGN, "dropped batch table is reported");
    ok(strstr(err, "outbox_batch") != NULL && strstr(err, "missing") != NULL, "message: %s", err);
    sqlite3_close(db);
    free(p);

    /* Apply inside a transaction is refused. */
    p = th_path(dir, "intx.db");
    db = raw_open(p);
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    is_int(outbox_schema_apply(db, err, sizeof err), OUTBOX_ESTATE, "apply inside a transaction: ESTATE");
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close(db);
    free(p);

    /* Bad arguments. */
    is_int(outbox_db_open(NULL, 0, &db, err, sizeof err), OUTBOX_EINVAL, "NULL path: EINVAL");
    is_int(outbox_schema_apply(NULL, NULL, 0), OUTBOX_EINVAL, "NULL db: EINVAL");
}

/* A new row's seq is one more than the largest in the table, so the cursor
 * (no new row before it) must never be past that: a delete of the rows at
 * the end, by retention or by hand, moves it back. And a delayed row made
 * new again by an UPDATE of available_at moves it back to that row. */
static void test_cursor_trigger(void)
{
    char *p = th_path(dir, "cursor.db"), err[512] = "";
    sqlite3 *db = raw_open(p);
    is_int(outbox_schema_apply(db, err, sizeof err), 0, "apply");
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 1, "a new database: the cursor at 1");
    sqlite3_exec(db,
                 "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10) "
                 "INSERT INTO outbox(id, topic, payload) SELECT 'm' || i, 't', x'00' FROM n;"
                 "UPDATE outbox SET state = 2; UPDATE outbox_cursor SET new_from = 11;",
                 NULL, NULL, NULL);
    is_int(sqlite3_exec(db, "DELETE FROM outbox WHERE seq <= 5", NULL, NULL, NULL), SQLITE_OK, "delete old rows");
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 11, "deleting old rows leaves the cursor");
    is_int(sqlite3_exec(db, "DELETE FROM outbox WHERE seq = 10", NULL, NULL, NULL), SQLITE_OK, "delete the last row");
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 10, "the cursor follows the end of the table back");
    sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('n1', 't', x'00')", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT seq FROM outbox_messages WHERE id = 'n1'"), 10, "a new row takes the freed seq");
    is_int(sqlite3_exec(db, "DELETE FROM outbox WHERE state = 2", NULL, NULL, NULL), SQLITE_OK,
           "delete every published row");
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 10, "the new row keeps the cursor where it is");
    is_int(sqlite3_exec(db, "DELETE FROM outbox", NULL, NULL, NULL), SQLITE_OK, "delete every row");
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 1, "an empty table: the cursor back at 1");
    /* A delayed row sent at once by an UPDATE is a new row again. */
    sqlite3_exec(db,
                 "INSERT INTO outbox(id, topic, payload, created_at, available_at) VALUES "
                 "('d1', 't', x'00', 1000, 99999999999999), ('d2', 't', x'00', 1000, 99999999999999), "
                 "('d3', 't', x'00', 1000, 99999999999999);"
                 "UPDATE outbox_cursor SET new_from = 4;",
                 NULL, NULL, NULL);
    sqlite3_exec(db, "UPDATE outbox SET available_at = 5000 WHERE id = 'd2'", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 4, "a later available_at leaves the cursor");
    sqlite3_exec(db, "UPDATE outbox SET available_at = 1000 WHERE id = 'd2'", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT new_from FROM outbox_cursor"), 4, "available_at back to created_at: the cursor stays");
    is_int(one_int(db, "SELECT available_at FROM outbox WHERE id = 'd2'"), 1001,
           "the row below the cursor is a waiting row due at once");
    sqlite3_exec(db, "UPDATE outbox SET available_at = 0 WHERE id = 'd3'", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT available_at FROM outbox WHERE id = 'd3'"), 1001, "so is a later one");
    /* Batch records past the end of the table go with it (their seqs come
     * back for new rows); a range reaching past it ends there. */
    sqlite3_exec(db,
                 "DELETE FROM outbox; INSERT INTO outbox(id, topic, payload) VALUES ('b1', 't', x'00'), "
                 "('b2', 't', x'00'), ('b3', 't', x'00'), ('b4', 't', x'00');"
                 "UPDATE outbox_cursor SET new_from = 5;"
                 "INSERT INTO outbox_batch(lo, hi, state, owner, token, published_at) VALUES (1, 2, 2, 'r', 1, 1), "
                 "(3, 4, 2, 'r', 1, 1);",
                 NULL, NULL, NULL);
    is_int(one_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2 AND batch IS NOT NULL"), 4,
           "four rows published in two batches");
    sqlite3_exec(db, "DELETE FROM outbox WHERE seq = 4", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT hi FROM outbox_batch WHERE lo = 3"), 3, "deleting the last row ends its range before it");
    sqlite3_exec(db, "DELETE FROM outbox WHERE seq = 3", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT count(*) FROM outbox_batch"), 1, "a range past the end goes");
    sqlite3_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('b5', 't', x'00')", NULL, NULL, NULL);
    is_int(one_int(db, "SELECT state FROM outbox_messages WHERE id = 'b5'"), 0, "a new row on a freed seq is pending");
    sqlite3_close(db);
    free(p);
}

static void test_durability(void)
{
    char *p = th_path(dir, "weak.db");
    sqlite3 *db = raw_open(p);
    sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    is_int(outbox_db_is_durable(db), 0, "synchronous=NORMAL is not durable");
    sqlite3_exec(db, "PRAGMA synchronous=FULL", NULL, NULL, NULL);
    is_int(outbox_db_is_durable(db), 1, "synchronous=FULL is durable");
    sqlite3_exec(db, "PRAGMA synchronous=EXTRA", NULL, NULL, NULL);
    is_int(outbox_db_is_durable(db), 1, "synchronous=EXTRA is durable");
    sqlite3_close(db);
    free(p);
}

/* BEGIN IMMEDIATE on db while another connection holds the lock for hold_ms
 * (th_sql_while_locked), rolled back if it succeeds. */
static int begin_while_locked(sqlite3 *db, const char *path, int hold_ms, double *took_ms, double *late_ms)
{
    int rc = th_sql_while_locked(db, path, hold_ms, "BEGIN IMMEDIATE", took_ms, late_ms);
    if (rc == SQLITE_OK)
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

/* outbox_db_busy_wait: the wait outbox_db_open gives writers tries again in
 * short naps, so the lock is taken soon after its release (SQLite's busy
 * timeout, whose sleeps grow to 25 ms, would take a lock released 80 ms into
 * the wait 23 ms late); a shorter total gives up after it; 0 does not wait. */
static void test_busy_wait(void)
{
    char *p = th_path(dir, "busy.db"), err[256];
    sqlite3 *db = NULL;
    double took, late;
    int rc;
    if (outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err) != 0)
        bail("schema: %s", err);
    rc = begin_while_locked(db, p, 100, &took, &late);
    is_int(rc, SQLITE_OK, "busy wait: a lock held 100 ms is waited out");
    ok(late >= 0 && late < 10 * th_slow(), "busy wait: taken %.2f ms after its release", late);

    is_int(outbox_db_busy_wait(db, 100), 0, "busy wait of 100 ms");
    is_int(one_int(db, "SELECT outbox_busy_wait_ms()"), 100, "busy wait: outbox_busy_wait_ms() says 100");
    rc = begin_while_locked(db, p, 400, &took, &late);
    is_int(rc & 0xff, SQLITE_BUSY, "busy wait of 100 ms, lock held 400 ms: SQLITE_BUSY");
    ok(took >= 95 && took < 300 * th_slow(), "after about 100 ms (%.1f ms)", took);

    is_int(outbox_db_busy_wait(db, 0), 0, "no busy wait");
    is_int(one_int(db, "SELECT outbox_busy_wait_ms()"), -2, "no busy wait: the function is gone");
    rc = begin_while_locked(db, p, 200, &took, &late);
    is_int(rc & 0xff, SQLITE_BUSY, "no busy wait: SQLITE_BUSY");
    ok(took < 50, "no busy wait: at once (%.1f ms)", took);

    {
        /* A statement running: the wait cannot change (SQLite will not
         * change a function then), and stays as it was. */
        sqlite3_stmt *st = NULL;
        is_int(outbox_db_busy_wait(db, 200), 0, "busy wait of 200 ms");
        sqlite3_prepare_v2(db, "SELECT 1 UNION ALL SELECT 2", -1, &st, NULL);
        is_int(sqlite3_step(st), SQLITE_ROW, "a statement running");
        is_int(outbox_db_busy_wait(db, 300), OUTBOX_EBUSY, "busy wait changed meanwhile: OUTBOX_EBUSY");
        sqlite3_finalize(st);
        is_int(one_int(db, "SELECT outbox_busy_wait_ms()"), 200, "and the wait is still 200 ms");
    }
    is_int(outbox_db_busy_wait(NULL, 10), OUTBOX_EINVAL, "busy wait without a connection: OUTBOX_EINVAL");
    is_int(outbox_db_busy_wait(db, -1), OUTBOX_EINVAL, "negative busy wait: OUTBOX_EINVAL");
    sqlite3_close_v2(db);
    free(p);
}

/* The public state constants are the values the table's CHECK admits, and
 * the indexes name: SQL spells them as literals (partial indexes need it). */
static void test_state_constants(void)
{
    char *p = th_path(dir, "states.db"), err[256], check[200];
    sqlite3 *db = NULL;
    char *table;
    if (outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err) != 0)
        bail("schema: %s", err);
    snprintf(check, sizeof check, "CHECK (state = %d OR state = %d OR state = %d OR state = %d)", OUTBOX_STATE_PENDING,
             OUTBOX_STATE_SENDING, OUTBOX_STATE_PUBLISHED, OUTBOX_STATE_DEAD);
    table = one_text(db, "SELECT sql FROM sqlite_master WHERE name = 'outbox'");
    ok(table && strstr(table, check) != NULL, "the table's CHECK admits exactly the OUTBOX_STATE_* values");
    is_int(OUTBOX_STATE_COUNT, 4, "four states");
    is_int(th_sql_int(db, "SELECT count(*) FROM sqlite_master WHERE name = 'outbox_published' AND sql LIKE '%%state = %d'",
                      OUTBOX_STATE_PUBLISHED),
           1, "outbox_published indexes OUTBOX_STATE_PUBLISHED");
    is_int(th_sql_int(db, "SELECT count(*) FROM sqlite_master WHERE name = 'outbox_dead' AND sql LIKE '%%state = %d'",
                      OUTBOX_STATE_DEAD),
           1, "outbox_dead indexes OUTBOX_STATE_DEAD");
    is_int(th_sql_int(db, "SELECT count(*) FROM sqlite_master WHERE name = 'outbox_leased' AND sql LIKE '%%state = %d'",
                      OUTBOX_STATE_SENDING),
           1, "outbox_leased indexes OUTBOX_STATE_SENDING");
    free(table);
    sqlite3_close(db);
    free(p);
}

int main(void)
{
    dir = th_tmpdir();
    test_state_constants();
    test_create_and_idempotent();
    test_refusals();
    test_cursor_trigger();
    test_durability();
    test_busy_wait();
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
