/* The writer API inside the application's own transactions. */
#include <msgpack.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

static char *dir;
static int warnings;

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

static void count_log(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    if (level == OUTBOX_LOG_WARN && strstr(msg, "not durable"))
        warnings++;
}

static sqlite3 *open_db(const char *name)
{
    char *p = th_path(dir, name), err[256];
    sqlite3 *db;
    if (outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err))
        bail("open %s: %s", p, err);
    sqlite3_exec(db, "CREATE TABLE orders(id INTEGER PRIMARY KEY, what TEXT)", NULL, NULL, NULL);
    free(p);
    return db;
}

static outbox_message msg(const char *id, const char *topic, const char *payload)
{
    outbox_message m;
    memset(&m, 0, sizeof m);
    m.id = id;
    m.topic = topic;
    m.payload = payload;
    m.payload_len = payload ? strlen(payload) : 0;
    return m;
}

static void test_transactions(void)
{
    sqlite3 *db = open_db("tx.db"), *other;
    outbox_writer *w;
    outbox_writer_settings s;
    outbox_message m;
    char id[OUTBOX_ID_MAX + 1], *path = th_path(dir, "tx.db");

    outbox_writer_defaults(&s);
    s.log = count_log;
    is_int(outbox_writer_create(&w, db, &s), 0, "writer created");
    is_int(warnings, 0, "no durability warning on a FULL connection");
    sqlite3_open(path, &other);

    /* Commit: business row and message appear together. */
    sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    sqlite3_exec(db, "INSERT INTO orders(what) VALUES ('book')", NULL, NULL, NULL);
    m = msg(NULL, "orders", "{\"order\":1}");
    m.key = "customer-1";
    is_int(outbox_enqueue(w, &m, id), 0, "enqueue inside the transaction");
    is_int(strlen(id), 36, "a generated UUID is handed back: %s", id);
    is_int(one_int(other, "SELECT count(*) FROM outbox_messages"), 0, "another connection sees no message before COMMIT");
    is_int(one_int(other, "SELECT count(*) FROM orders"), 0, "nor the order");
    ok(!sqlite3_get_autocommit(db), "the writer did not end the caller's transaction");
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    is_int(one_int(other, "SELECT count(*) FROM outbox_messages"), 1, "after COMMIT the message is visible");
    is_int(one_int(other, "SELECT count(*) FROM orders"), 1, "together with the order");

    /* An error between the two inserts, then ROLLBACK: neither stays. */
    sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    sqlite3_exec(db, "INSERT INTO orders(what) VALUES ('lamp')", NULL, NULL, NULL);
    m = msg("order-2", "orders", "{\"order\":2}");
    is_int(outbox_enqueue(w, &m, NULL), 0, "second message enqueued");
    ok(sqlite3_exec(db, "INSERT INTO no_such_table VALUES (1)", NULL, NULL, NULL) != SQLITE_OK,
       "a business error after the enqueue");
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    is_int(one_int(other, "SELECT count(*) FROM outbox_messages WHERE id='order-2'"), 0, "rolled back: no message");
    is_int(one_int(other, "SELECT count(*) FROM orders"), 1, "rolled back: no order");

    /* A duplicate id fails only its own statement. */
    sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    m = msg("dup-1", "orders", "a");
    is_int(outbox_enqueue(w, &m, NULL), 0, "dup-1 first time");
    is_int(outbox_enqueue(w, &m, NULL), OUTBOX_EDUPLICATE, "dup-1 again: EDUPLICATE");
    ok(strstr(outbox_writer_errmsg(w), "dup-1") != NULL, "errmsg names the id: %s", outbox_writer_errmsg(w));
    ok(!sqlite3_get_autocommit(db), "the transaction is still open");
    m = msg("dup-2", "orders", "b");
    is_int(outbox_enqueue(w, &m, NULL), 0, "the transaction goes on: dup-2");
    sqlite3_exec(db, "INSERT INTO orders(what) VALUES ('pen')", NULL, NULL, NULL);
    is_int(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK, "and commits");
    is_int(one_int(other, "SELECT count(*) FROM outbox_messages WHERE id IN ('dup-1','dup-2')"), 2, "both unique rows kept");
    is_int(one_int(other, "SELECT count(*) FROM orders"), 2, "and the business row");

    /* Outside a transaction: an autocommit insert. */
    m = msg("auto-1", "orders", "c");
    m.available_at = outbox_now_ms() + 60000;
    is_int(outbox_enqueue(w, &m, id), 0, "autocommit enqueue");
    is_str(id, "auto-1", "the given id is handed back");
    is_int(one_int(other, "SELECT count(*) FROM outbox_messages WHERE id='auto-1'"), 1, "visible at once");
    ok(one_int(other, "SELECT available_at - created_at FROM outbox_messages WHERE id='auto-1'") >= 59000,
       "available_at is stored");

    /* Stored columns. */
    {
        sqlite3_stmt *st;
        sqlite3_prepare_v2(other, "SELECT topic, key, payload, headers, state FROM outbox_messages WHERE seq=1", -1, &st, NULL);
        ok(sqlite3_step(st) == SQLITE_ROW, "first row read back");
        is_str((const char *)sqlite3_column_text(st, 0), "orders", "topic");
        is_str((const char *)sqlite3_column_text(st, 1), "customer-1", "key");
        is_int(sqlite3_column_type(st, 2), SQLITE_BLOB, "payload is a blob");
        is_int(sqlite3_column_type(st, 3), SQLITE_NULL, "no headers: NULL");
        is_int(sqlite3_column_int(st, 4), 0, "pending");
        sqlite3_finalize(st);
    }

    /* Empty payload and empty key. */
    m = msg("empty-1", "orders", NULL);
    m.key = "";
    is_int(outbox_enqueue(w, &m, NULL), 0, "empty payload and empty key are accepted");
    is_int(one_int(other, "SELECT length(payload) FROM outbox_messages WHERE id='empty-1'"), 0, "zero-length payload");
    is_int(one_int(other, "SELECT key IS NULL FROM outbox_messages WHERE id='empty-1'"), 1, "empty key stored as NULL");

    sqlite3_close(other);
    outbox_writer_destroy(w);
    outbox_writer_destroy(NULL);
    sqlite3_close_v2(db);
    free(path);
}

static void test_validation(void)
{
    sqlite3 *db = open_db("val.db");
    outbox_writer *w;
    outbox_writer_settings s;
    outbox_message m;
    char big_id[200], big_topic[200], big_key[600];
    unsigned char hdr[64];
    static char payload[2048];

    outbox_writer_defaults(&s);
    s.max_payload = 1024;
    s.log = NULL;
    is_int(outbox_writer_create(&w, db, &s), 0, "writer with a 1 KiB limit");

#define EXPECT(code, what)                                                                         \
    do {                                                                                           \
        int e_ = outbox_enqueue(w, &m, NULL);                                                      \
        is_int(e_, code, "%s: %s (%s)", what, outbox_err_name(e_), outbox_writer_errmsg(w));       \
    } while (0)

    m = msg("", "orders", "x");
    EXPECT(OUTBOX_EID, "empty id");
    memset(big_id, 'a', 129);
    big_id[129] = 0;
    m = msg(big_id, "orders", "x");
    EXPECT(OUTBOX_EID, "129-byte id");
    big_id[128] = 0;
    m = msg(big_id, "orders", "x");
    EXPECT(0, "128-byte id");
    m = msg("has space", "orders", "x");
    EXPECT(OUTBOX_EID, "id with a space");
    ok(strstr(outbox_writer_errmsg(w), "byte 3") != NULL, "names the position: %s", outbox_writer_errmsg(w));
    m = msg("tab\tid", "orders", "x");
    EXPECT(OUTBOX_EID, "id with a control byte");
    m = msg("caf\xc3\xa9", "orders", "x");
    EXPECT(OUTBOX_EID, "id with non-ASCII");

    m = msg("t1", NULL, "x");
    EXPECT(OUTBOX_ETOPIC, "NULL topic");
    m = msg("t1", "", "x");
    EXPECT(OUTBOX_ETOPIC, "empty topic");
    memset(big_topic, 'b', 129);
    big_topic[129] = 0;
    m = msg("t1", big_topic, "x");
    EXPECT(OUTBOX_ETOPIC, "129-byte topic");
    m = msg("t1", "or{ders}", "x");
    EXPECT(OUTBOX_ETOPIC, "topic with braces (hash tags)");
    m = msg("t1", "a b", "x");
    EXPECT(OUTBOX_ETOPIC, "topic with a space");
    m = msg("t1", "orders.eu-1:v2/x_y", "x");
    EXPECT(0, "topic with every allowed punctuation");

    m = msg("k1", "orders", "x");
    memset(big_key, 'k', 513);
    big_key[513] = 0;
    m.key = big_key;
    EXPECT(OUTBOX_EKEY, "513-byte key");
    m.key = "\xff\xfe";
    EXPECT(OUTBOX_EKEY, "key not UTF-8");
    m.key = "\xc0\xaf";
    EXPECT(OUTBOX_EKEY, "overlong UTF-8 key");
    m.key = "\xe2\x82";
    EXPECT(OUTBOX_EKEY, "truncated UTF-8 key");
    m.key = "kunde-\xc3\xa9\xe2\x82\xac";
    EXPECT(0, "UTF-8 key");

    m = msg("p1", "orders", NULL);
    m.payload = payload;
    m.payload_len = 1025;
    EXPECT(OUTBOX_ETOOBIG, "payload above the limit");
    ok(strstr(outbox_writer_errmsg(w), "1025") != NULL, "says the size: %s", outbox_writer_errmsg(w));
    m.payload_len = 1024;
    EXPECT(0, "payload at the limit");
    m = msg("p2", "orders", NULL);
    m.payload_len = 5;
    EXPECT(OUTBOX_EINVAL, "NULL payload with a length");

    /* Headers. */
    m = msg("h1", "orders", "x");
    hdr[0] = 0x81; /* {"a": 1} */
    hdr[1] = 0xa1;
    hdr[2] = 'a';
    hdr[3] = 0x01;
    m.headers = hdr;
    m.headers_len = 4;
    EXPECT(0, "a map header");
    m.id = "h2";
    m.headers_len = 3;
    EXPECT(OUTBOX_EHEADERS, "truncated headers");
    m.headers_len = 5;
    hdr[4] = 0xc0;
    EXPECT(OUTBOX_EHEADERS, "headers with trailing bytes");
    hdr[0] = 0x91; /* [ "a" ]: an array */
    m.headers_len = 3;
    EXPECT(OUTBOX_EHEADERS, "headers that are an array");
    hdr[0] = 0x81; /* {1: 1} */
    hdr[1] = 0x01;
    hdr[2] = 0x01;
    EXPECT(OUTBOX_EHEADERS, "headers with a non-string key");
    hdr[0] = 0xdf; /* map32 claiming 4 billion entries in 5 bytes */
    hdr[1] = hdr[2] = hdr[3] = hdr[4] = 0xff;
    m.headers_len = 5;
    EXPECT(OUTBOX_EHEADERS, "headers declaring a huge map");
    hdr[0] = 0xc1;
    m.headers_len = 1;
    EXPECT(OUTBOX_EHEADERS, "reserved msgpack byte");
    m.headers = NULL;
    m.headers_len = 3;
    EXPECT(OUTBOX_EINVAL, "NULL headers with a length");
    m.headers = hdr;
    m.headers_len = 0;
    EXPECT(OUTBOX_EHEADERS, "empty headers");

    is_int(one_int(db, "SELECT count(*) FROM outbox_messages"), 5, "only the 5 valid messages were written");
    is_int(outbox_enqueue(NULL, &m, NULL), OUTBOX_EINVAL, "NULL writer");
    is_int(outbox_enqueue(w, NULL, NULL), OUTBOX_EINVAL, "NULL message");

    /* Settings. */
    {
        outbox_writer *w2 = NULL;
        s.max_payload = 0;
        is_int(outbox_writer_create(&w2, db, &s), OUTBOX_EINVAL, "max_payload 0 refused");
        s.max_payload = (size_t)OUTBOX_PAYLOAD_HARD_MAX + 1;
        is_int(outbox_writer_create(&w2, db, &s), OUTBOX_EINVAL, "max_payload above the hard limit refused");
        is_int(outbox_writer_create(&w2, NULL, NULL), OUTBOX_EINVAL, "NULL db refused");
    }
    outbox_writer_destroy(w);

    /* The table vanishes. */
    sqlite3_exec(db, "DROP TABLE outbox", NULL, NULL, NULL);
    is_int(outbox_writer_create(&w, db, NULL), OUTBOX_ENOSCHEMA, "no outbox table: ENOSCHEMA");
    sqlite3_close_v2(db);
}

static void test_not_durable_warning(void)
{
    char *p = th_path(dir, "weak.db");
    sqlite3 *db;
    outbox_writer *w;
    outbox_writer_settings s;
    sqlite3_open(p, &db);
    outbox_schema_apply(db, NULL, 0);
    sqlite3_exec(db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    outbox_writer_defaults(&s);
    s.log = count_log;
    warnings = 0;
    is_int(outbox_writer_create(&w, db, &s), 0, "writer on a NORMAL connection");
    is_int(warnings, 1, "warns that commits are not durable");
    outbox_writer_destroy(w);
    sqlite3_close(db);
    free(p);
}

static void test_uuid(void)
{
    char a[37], b[37];
    int sorted = 1, shaped = 1;
    outbox_uuid7(a);
    for (int i = 0; i < 100000; i++) {
        outbox_uuid7(b);
        if (strcmp(a, b) >= 0)
            sorted = 0;
        if (strlen(b) != 36 || b[14] != '7' || b[8] != '-' || b[13] != '-' || b[18] != '-' || b[23] != '-' ||
            !strchr("89ab", b[19]))
            shaped = 0;
        memcpy(a, b, 37);
    }
    ok(sorted, "100,000 UUIDv7s strictly increase");
    ok(shaped, "each has the version 7 and variant bits in place");
    is_int(outbox_validate_id(a, NULL, 0), 0, "a UUID is a valid id");
}

int main(void)
{
    dir = th_tmpdir();
    test_transactions();
    test_validation();
    test_not_durable_warning();
    test_uuid();
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
