/*
 * test_invalid.c: rows that the table's constraints allow but the relay
 * cannot publish, written by plain SQL, are dead-lettered at once (state 3
 * on their first claim, no XADD, last_error saying why) while the valid rows
 * around them flow:
 *   - a payload above --max-payload 100 (a payload of exactly 100 is fine);
 *   - headers that are not a msgpack map: an integer, an array, a truncated
 *     map, a map with trailing bytes;
 *   - a key that is not valid UTF-8, a key with a NUL byte.
 * A keyed invalid row does not block the later rows of its key.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N_GOOD 500

typedef struct bad_row {
    const char *id, *sql_values, *reason;
} bad_row;

/* Values for (id, topic, key, payload, headers). */
static const bad_row bad[] = {
    {"big-1", "'big-1', 'inv', NULL, randomblob(101), NULL", "payload is 101 bytes"},
    {"big-2", "'big-2', 'inv', 'k1', zeroblob(5000), NULL", "payload is 5000 bytes"},
    {"hdr-int", "'hdr-int', 'inv', NULL, 'p', X'01'", "not a map"},
    {"hdr-array", "'hdr-array', 'inv', NULL, 'p', X'92a161a162'", "not a map"},
    {"hdr-trunc", "'hdr-trunc', 'inv', 'k2', 'p', X'82a161'", "truncated"},
    {"hdr-trailing", "'hdr-trailing', 'inv', NULL, 'p', X'80c0'", "trailing"},
    {"key-utf8", "'key-utf8', 'inv', CAST(X'61ff62' AS TEXT), 'p', NULL", "UTF-8"},
    {"key-nul", "'key-nul', 'inv', CAST(X'610062' AS TEXT), 'p', NULL", "NUL"},
};
#define N_BAD ((int)(sizeof bad / sizeof bad[0]))

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *err = NULL;
    redisContext *c;
    sqlite3 *db;
    rt_stream s;
    size_t k;
    int i, rc, bad_in_stream = 0;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);

    /* Bad rows interleaved with good ones, keyed and not. */
    rt_insert_rows(db, "g", 0, N_GOOD / 2, "inv", 3);
    for (i = 0; i < N_BAD; i++)
        th_sql_exec(db, "INSERT INTO outbox(id, topic, key, payload, headers) VALUES (%s)", bad[i].sql_values);
    th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('exact-100', 'inv', zeroblob(100))");
    rt_insert_rows(db, "g", N_GOOD / 2, N_GOOD / 2, "inv", 3);

    rc = rt_relay_run(30000 * th_slow(), &err, dbpath, srv.url, "--drain", "--max-payload", "100", NULL);
    is_int(rc, 0, "--drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    is_int(rt_count_substr(err, "msg=\"dead-lettered\""), N_BAD, "each invalid row is logged as dead-lettered");
    ok(strstr(err, "publish failed") == NULL, "no publish was attempted for them");
    free(err);

    for (i = 0; i < N_BAD; i++) {
        sqlite3_stmt *st = NULL;
        if (sqlite3_prepare_v2(db, "SELECT state, attempts, last_error, stream_id FROM outbox_messages WHERE id = ?1", -1, &st,
                               NULL) != SQLITE_OK)
            bail("prepare: %s", sqlite3_errmsg(db));
        sqlite3_bind_text(st, 1, bad[i].id, -1, SQLITE_STATIC);
        if (sqlite3_step(st) == SQLITE_ROW) {
            const char *le = (const char *)sqlite3_column_text(st, 2);
            is_int(sqlite3_column_int(st, 0), 3, "%s: dead (state 3)", bad[i].id);
            is_int(sqlite3_column_int(st, 1), 1, "%s: at the first claim", bad[i].id);
            ok(le && strstr(le, bad[i].reason), "%s: last_error says why: %s", bad[i].id, le ? le : "(null)");
            ok(sqlite3_column_type(st, 3) == SQLITE_NULL, "%s: no stream id", bad[i].id);
        } else {
            ok(0, "%s: row present", bad[i].id);
        }
        sqlite3_finalize(st);
    }
    is_int(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'exact-100'"), 2, "a payload of exactly 100 is published");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id LIKE 'g-%%' AND state = 2"), N_GOOD,
           "all %d valid rows published", N_GOOD);

    s = rt_stream_read(c, "outbox:inv");
    for (k = 0; k < s.n; k++)
        for (i = 0; i < N_BAD; i++)
            bad_in_stream += s.e[k].id && strcmp(s.e[k].id, bad[i].id) == 0;
    is_int(bad_in_stream, 0, "no invalid row reached the stream");
    is_int((long)s.n, N_GOOD + 1, "the stream holds the valid rows only");
    rt_stream_free(&s);

    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
