/*
 * test_publish.c: rows written by plain SQL (the three-column INSERT of the
 * contract) and by the writer API reach their streams outbox:<topic> in
 * commit order, each entry with exactly the fields id and envelope, the
 * envelope carrying the row's topic, key, payload, headers and created_at;
 * every row ends published (state 2) with its stream entry id recorded.
 * Rows written after published rows were deleted by hand from the end of
 * the table (their seqs used again) are published too, and so is a delayed
 * row that an UPDATE of available_at sends at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N_PLAIN 2000
#define N_API 2000

/* A msgpack map {"trace": "t<n>", "n": <n & 0x7f>}. */
static size_t make_headers(unsigned char *buf, int n)
{
    size_t o = 0;
    char t[16];
    int tl = snprintf(t, sizeof t, "t%d", n);
    buf[o++] = 0x82;
    buf[o++] = 0xa5;
    memcpy(buf + o, "trace", 5);
    o += 5;
    buf[o++] = (unsigned char)(0xa0 | tl);
    memcpy(buf + o, t, (size_t)tl);
    o += (size_t)tl;
    buf[o++] = 0xa1;
    buf[o++] = 'n';
    buf[o++] = (unsigned char)(n & 0x7f);
    return o;
}

static void write_plain(sqlite3 *db)
{
    int i;
    th_sql_exec(db, "BEGIN IMMEDIATE");
    for (i = 0; i < N_PLAIN; i++) {
        if (i == 7)
            th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('plain-%06d', 'plain', X'')", i);
        else if (i % 2)
            th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('plain-%06d', 'plain', 'text payload %d')",
                    i, i);
        else
            th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('plain-%06d', 'plain', X'00ff%04x00')", i,
                    i);
    }
    th_sql_exec(db, "COMMIT");
}

static void write_api(sqlite3 *db)
{
    outbox_writer *w = NULL;
    int i, e;
    if ((e = outbox_writer_create(&w, db, NULL)) != 0)
        bail("outbox_writer_create: %s", outbox_strerror(e));
    /* Several transactions, as an application would commit them. */
    for (i = 0; i < N_API; i++) {
        unsigned char headers[64], payload[64];
        char key[16];
        outbox_message m;
        size_t plen = (size_t)snprintf((char *)payload, sizeof payload, "api%c%d", 0, i);
        if (i % 100 == 0)
            th_sql_exec(db, "BEGIN IMMEDIATE");
        memset(&m, 0, sizeof m);
        m.topic = i % 4 == 3 ? "api.other" : "api";
        snprintf(key, sizeof key, "cust-%d", i % 5);
        m.key = i % 2 ? key : NULL;
        m.payload = payload;
        m.payload_len = plen;
        if (i % 3 == 0) {
            m.headers = headers;
            m.headers_len = make_headers(headers, i);
        }
        if ((e = outbox_enqueue(w, &m, NULL)) != 0)
            bail("outbox_enqueue: %s", outbox_writer_errmsg(w));
        if (i % 100 == 99)
            th_sql_exec(db, "COMMIT");
    }
    outbox_writer_destroy(w);
}

typedef struct check {
    long rows, bad_state, bad_stream_id, bad_fields, bad_envelope, out_of_order;
} check;

/* Compares every row of topic with its stream entry. */
static void check_topic(sqlite3 *db, redisContext *c, const char *topic, check *k)
{
    char stream[64];
    rt_stream s;
    rt_map *pos = rt_map_new(), *keypos = rt_map_new();
    sqlite3_stmt *st = NULL;
    int64_t last_pos = -1;
    size_t i;
    int shown = 0;

    snprintf(stream, sizeof stream, "outbox:%s", topic);
    s = rt_stream_read(c, stream);
    for (i = 0; i < s.n; i++)
        if (s.e[i].id)
            rt_map_add(pos, s.e[i].id, (int64_t)i);
    if (sqlite3_prepare_v2(db,
                           "SELECT id, topic, key, payload, headers, created_at, state, stream_id, batch FROM outbox_messages "
                           "WHERE topic = ?1 ORDER BY seq",
                           -1, &st, NULL) != SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    sqlite3_bind_text(st, 1, topic, -1, SQLITE_STATIC);
    while (sqlite3_step(st) == SQLITE_ROW) {
        const char *id = (const char *)sqlite3_column_text(st, 0);
        const char *key = (const char *)sqlite3_column_text(st, 2);
        const void *payload = sqlite3_column_blob(st, 3);
        size_t plen = (size_t)sqlite3_column_bytes(st, 3);
        const void *headers = sqlite3_column_blob(st, 4);
        size_t hlen = (size_t)sqlite3_column_bytes(st, 4);
        int64_t created = sqlite3_column_int64(st, 5), at;
        int state = sqlite3_column_int(st, 6);
        const char *sid = (const char *)sqlite3_column_text(st, 7);
        const rt_entry *e;
        outbox_envelope *env = NULL;
        char err[128];
        int bad = 0;

        k->rows++;
        if (state != 2)
            k->bad_state++;
        if (rt_map_get(pos, id, &at) != 1) {
            if (shown++ < 5)
                diag("%s: %d entries for %s", stream, rt_map_get(pos, id, NULL), id);
            k->bad_fields++;
            continue;
        }
        e = &s.e[at];
        /* Commit order: per key for keyed rows (a key's messages go one
         * after another), overall for the unkeyed ones (pipelined in claim
         * order on one connection, and nothing failed here). */
        if (key) {
            int64_t prev = -1;
            if (rt_map_get(keypos, key, &prev) && at <= prev)
                k->out_of_order++;
            rt_map_add(keypos, key, at);
            rt_map_set(keypos, key, at);
        } else {
            if (at <= last_pos)
                k->out_of_order++;
            last_pos = at;
        }
        /* A row published on its own keeps its entry id; one published in a
         * batch (its state is its batch record's) keeps none. */
        if (sqlite3_column_type(st, 8) == SQLITE_NULL ? !sid || strcmp(sid, e->eid) != 0 : sid != NULL)
            k->bad_stream_id++;
        if (e->nfields != 2 || !e->id_first || !e->env) {
            k->bad_fields++;
            continue;
        }
        if (outbox_envelope_decode(e->env, e->envlen, &env, err, sizeof err) != 0) {
            if (shown++ < 5)
                diag("%s: envelope of %s does not decode: %s", stream, id, err);
            k->bad_envelope++;
            continue;
        }
        bad |= env->version != OUTBOX_ENVELOPE_VERSION;
        bad |= strcmp(env->id, id) != 0;
        bad |= strcmp(env->topic, topic) != 0;
        bad |= (key == NULL) != (env->key == NULL);
        bad |= key && env->key && (env->key_len != strlen(key) || memcmp(env->key, key, env->key_len) != 0);
        bad |= env->payload_len != plen || (plen && memcmp(env->payload, payload, plen) != 0);
        bad |= (headers == NULL) != (env->headers == NULL);
        bad |= headers && env->headers && (env->headers_len != hlen || memcmp(env->headers, headers, hlen) != 0);
        bad |= env->created_at != created;
        if (bad) {
            if (shown++ < 5)
                diag("%s: envelope of %s differs from its row", stream, id);
            k->bad_envelope++;
        }
        outbox_envelope_free(env);
    }
    sqlite3_finalize(st);
    rt_map_free(pos);
    rt_map_free(keypos);
    rt_stream_free(&s);
}

/* One outbox-relay --drain run, checked to exit 0. */
static void drain(const char *dbpath, const char *url)
{
    char *err = NULL;
    int rc = rt_relay_run(60000 * th_slow(), &err, dbpath, url, "--drain", NULL);
    is_int(rc, 0, "outbox-relay --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    free(err);
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *err = NULL;
    sqlite3 *db;
    redisContext *c;
    int rc;
    int64_t t0;
    const char *topics[] = {"plain", "api", "api.other"};
    long want[] = {N_PLAIN, N_API / 4 * 3, N_API / 4};

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    write_plain(db);
    write_api(db);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0"), N_PLAIN + N_API, "%d rows pending",
           N_PLAIN + N_API);

    t0 = th_now_ms();
    rc = rt_relay_run(60000 * th_slow(), &err, dbpath, srv.url, "--drain", NULL);
    is_int(rc, 0, "outbox-relay --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    diag("%d messages published in %lld ms", N_PLAIN + N_API, (long long)(th_now_ms() - t0));
    ok(strstr(err, "msg=drained") != NULL, "the relay reports it drained");
    free(err);

    for (size_t t = 0; t < sizeof topics / sizeof topics[0]; t++) {
        check k;
        char stream[64];
        memset(&k, 0, sizeof k);
        snprintf(stream, sizeof stream, "outbox:%s", topics[t]);
        check_topic(db, c, topics[t], &k);
        is_int(k.rows, want[t], "%s: %ld rows", topics[t], want[t]);
        is_int(th_xlen(c, stream), want[t], "%s: XLEN is %ld (one entry per row)", stream, want[t]);
        is_int(k.bad_state, 0, "%s: every row is published (state 2)", topics[t]);
        is_int(k.bad_fields, 0, "%s: every row has exactly one entry with fields id and envelope, in this order",
               topics[t]);
        is_int(k.bad_stream_id, 0, "%s: each row's stream_id is its entry id, or none in a batch", topics[t]);
        is_int(k.bad_envelope, 0, "%s: each envelope matches its row (topic, key, payload, headers, created_at)",
               topics[t]);
        is_int(k.out_of_order, 0, "%s: entries are in commit order (per key; unkeyed overall)", topics[t]);
    }
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE lease_owner IS NOT NULL OR lease_until IS NOT NULL "
                      "OR last_error IS NOT NULL OR published_at IS NULL"),
           0, "published rows have no lease, no error, and a published_at");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE attempts <> 1"), 0, "each row took one attempt");

    /* Published rows deleted by hand from the end of the table: SQLite gives
     * the next rows the freed seqs, behind where the relay's walk of new
     * rows had got to. They are published all the same. */
    th_sql_exec(db, "DELETE FROM outbox WHERE seq > (SELECT max(seq) - 100 FROM outbox_messages)");
    rt_insert_rows(db, "reused", 0, 100, "reused", 0);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'reused' AND seq <= "
                          "(SELECT max(seq) FROM outbox_messages WHERE topic <> 'reused') + 100"),
           100, "the new rows took the seqs of the deleted ones");
    drain(dbpath, srv.url);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'reused' AND state = 2"), 100,
           "rows written after a delete at the end of the table: all published");
    is_int(th_xlen(c, "outbox:reused"), 100, "outbox:reused has their 100 entries");

    /* A delayed row that an UPDATE sends at once (available_at back to its
     * created_at) after the relay's walk of new rows has passed it. */
    th_sql_exec(db, "INSERT INTO outbox(id, topic, payload, available_at) VALUES ('later', 'later', x'01', %lld)",
                (long long)(rt_unix_ms() + 3600000));
    rt_insert_rows(db, "after-later", 0, 10, "later", 0);
    drain(dbpath, srv.url);
    is_int(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'later'"), 0, "the delayed row waits");
    ok(th_sql_int(db, "SELECT new_from FROM outbox_cursor") > th_sql_int(db, "SELECT seq FROM outbox_messages WHERE id = 'later'"),
       "the walk of new rows has passed it");
    th_sql_exec(db, "UPDATE outbox SET available_at = created_at WHERE id = 'later'");
    drain(dbpath, srv.url);
    is_int(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'later'"), 2,
           "a delayed row made due by an UPDATE of available_at is published");

    /* The cursor's row deleted by hand: the walk starts at the first row and
     * the claim writes the row again. */
    th_sql_exec(db, "DELETE FROM outbox_cursor");
    rt_insert_rows(db, "nocursor", 0, 10, "nocursor", 0);
    drain(dbpath, srv.url);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'nocursor' AND state = 2"), 10,
           "without the cursor's row: every row published");
    is_int(th_sql_int(db, "SELECT new_from FROM outbox_cursor"), th_sql_int(db, "SELECT max(seq) + 1 FROM outbox_messages"),
           "the cursor's row is back, after the last row");

    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
