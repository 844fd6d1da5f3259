/*
 * writer: what outbox_enqueue costs compared with a plain SQLite INSERT of
 * the same shape (a table with the writer-facing columns, no constraints and
 * no extra indexes, the id generated the same way).
 *
 * 1. Batched: N rows, 1000 per transaction. Also the plain INSERT's
 *    statement into the outbox table itself: what the table's constraints
 *    leave to any writer, the writer API's overhead apart.
 * 2. Single-row business transactions: BEGIN; INSERT an order; [the outbox
 *    row | a plain row]; COMMIT, each its own transaction.
 * Both with synchronous=NORMAL, so that the CPU cost is measured, not the
 * disk's fsync; a short synchronous=FULL run shows what a durable commit
 * adds. Each variant runs twice, alternating, on fresh files; the better
 * run counts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* K_TABLE: the same prepared INSERT as K_PLAIN, into the outbox table
 * itself (its CHECKs, UNIQUE(id), triggers and indexes): the least any
 * writer of the contract can pay. */
enum kind { K_NONE, K_OUTBOX, K_PLAIN, K_TABLE };

static const char plain_ddl[] =
    "CREATE TABLE plain(seq INTEGER PRIMARY KEY, id TEXT NOT NULL, topic TEXT NOT NULL, key TEXT, "
    "payload BLOB NOT NULL, headers BLOB, created_at INTEGER NOT NULL, available_at INTEGER NOT NULL)";
static const char plain_insert[] = "INSERT INTO plain(id, topic, key, payload, headers, created_at, available_at) "
                                   "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
static const char table_insert[] = "INSERT INTO outbox(id, topic, key, payload, headers, created_at, available_at) "
                                   "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
static const char orders_ddl[] = "CREATE TABLE orders(id INTEGER PRIMARY KEY, customer TEXT NOT NULL, "
                                 "amount_cents INTEGER NOT NULL, created_at INTEGER NOT NULL)";
static const char orders_insert[] = "INSERT INTO orders(customer, amount_cents, created_at) VALUES (?1, ?2, ?3)";

/* Writes `rows` messages of `kind` (and, with business, one order per
 * transaction) in transactions of rows_per_txn; returns the seconds taken. */
static int run_variant(bench *b, const char *path, enum kind kind, int business, uint64_t rows,
                       uint64_t rows_per_txn, const char *sync, double *secs, char *err, size_t errlen)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    sqlite3 *db = NULL;
    sqlite3_stmt *pl = NULL, *ord = NULL;
    outbox_writer *w = NULL;
    outbox_writer_settings ws;
    bench_msgbuf mb;
    char pragma[64], id[37], customer[32];
    uint64_t i, t0;
    int rc = -1, e;

    if (bench_db_fresh(path, 0, &db, err, errlen) != 0)
        return -1;
    snprintf(pragma, sizeof pragma, "PRAGMA synchronous=%s", sync);
    if (bench_exec(db, pragma, err, errlen) != 0 || bench_exec(db, plain_ddl, err, errlen) != 0 ||
        bench_exec(db, orders_ddl, err, errlen) != 0)
        goto out;
    if (sqlite3_prepare_v2(db, kind == K_TABLE ? table_insert : plain_insert, -1, &pl, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(db, orders_insert, -1, &ord, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "prepare: %s", sqlite3_errmsg(db));
        goto out;
    }
    outbox_writer_defaults(&ws);
    ws.warn_not_durable = 0;
    ws.log = NULL;
    if ((e = outbox_writer_create(&w, db, &ws)) != 0) {
        snprintf(err, errlen, "writer: %s", outbox_strerror(e));
        goto out;
    }
    t0 = bench_mono_us();
    for (i = 0; i < rows; i++) {
        if (i % rows_per_txn == 0 && bench_exec(db, "BEGIN IMMEDIATE", err, errlen) != 0)
            goto out;
        if (business) {
            snprintf(customer, sizeof customer, "customer-%llu", (unsigned long long)(i % 1000));
            sqlite3_bind_text(ord, 1, customer, -1, SQLITE_STATIC);
            sqlite3_bind_int64(ord, 2, (int64_t)(1000 + i));
            sqlite3_bind_int64(ord, 3, outbox_now_ms());
            if (sqlite3_step(ord) != SQLITE_DONE) {
                snprintf(err, errlen, "order insert: %s", sqlite3_errmsg(db));
                goto out;
            }
            sqlite3_reset(ord);
        }
        if (kind != K_NONE)
            bench_shape_message(&sh, i, &mb);
        if (kind == K_OUTBOX) {
            if ((e = outbox_enqueue(w, &mb.m, NULL)) != 0) {
                snprintf(err, errlen, "enqueue: %s", outbox_writer_errmsg(w));
                goto out;
            }
        } else if (kind == K_PLAIN || kind == K_TABLE) {
            int64_t now = outbox_now_ms();
            outbox_uuid7(id);
            sqlite3_bind_text(pl, 1, id, -1, SQLITE_STATIC);
            sqlite3_bind_text(pl, 2, mb.m.topic, -1, SQLITE_STATIC);
            if (mb.m.key)
                sqlite3_bind_text(pl, 3, mb.m.key, -1, SQLITE_STATIC);
            else
                sqlite3_bind_null(pl, 3);
            sqlite3_bind_blob(pl, 4, mb.m.payload, (int)mb.m.payload_len, SQLITE_STATIC);
            sqlite3_bind_null(pl, 5);
            sqlite3_bind_int64(pl, 6, now);
            sqlite3_bind_int64(pl, 7, now);
            if (sqlite3_step(pl) != SQLITE_DONE) {
                snprintf(err, errlen, "plain insert: %s", sqlite3_errmsg(db));
                goto out;
            }
            sqlite3_reset(pl);
        }
        if ((i + 1) % rows_per_txn == 0 || i + 1 == rows)
            if (bench_exec(db, "COMMIT", err, errlen) != 0)
                goto out;
    }
    *secs = (double)(bench_mono_us() - t0) / 1e6;
    rc = 0;
out:
    if (rc != 0)
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_finalize(pl);
    sqlite3_finalize(ord);
    outbox_writer_destroy(w);
    sqlite3_close_v2(db);
    bench_unlink_db(path);
    return rc;
}

/* Best of `rounds` runs of each variant, alternating between them. */
static int best_of(bench *b, const char *path, int nv, const enum kind *kinds, int business, uint64_t rows,
                   uint64_t per_txn, const char *sync, int rounds, double *best, char *err, size_t errlen)
{
    for (int v = 0; v < nv; v++)
        best[v] = 1e300;
    for (int round = 0; round < rounds; round++)
        for (int v = 0; v < nv; v++) {
            double s;
            if (run_variant(b, path, kinds[v], business, rows, per_txn, sync, &s, err, errlen) != 0)
                return -1;
            if (s < best[v])
                best[v] = s;
        }
    return 0;
}

int sc_writer(bench *b, bench_report *r)
{
    char path[PATH_MAX + 32], err[512], n1[32], n2[32];
    uint64_t rows = (uint64_t)b->messages;
    uint64_t txns = b->quick ? 5000 : 20000;
    uint64_t full_txns = b->quick ? 300 : 1000;
    enum kind batch_kinds[3] = {K_PLAIN, K_OUTBOX, K_TABLE};
    enum kind single_kinds[3] = {K_NONE, K_PLAIN, K_OUTBOX};
    enum kind full_kinds[2] = {K_NONE, K_OUTBOX};
    double bt[3], st[3], ft[2];
    double ratio_batch, ratio_single, us_none, us_plain, us_outbox, fus_none, fus_outbox;

    snprintf(r->title, sizeof r->title,
             "outbox_enqueue vs plain INSERT of the same shape (writer-facing columns, no constraints or extra "
             "indexes), synchronous=NORMAL, best of 2");
    bench_path(b, path, sizeof path, "writer.db");
    bench_progress(b, "batched inserts, %llu rows", (unsigned long long)rows);
    if (best_of(b, path, 3, batch_kinds, 0, rows, 1000, "NORMAL", 2, bt, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "single-row business transactions, %llu each", (unsigned long long)txns);
    if (best_of(b, path, 3, single_kinds, 1, txns, 1, "NORMAL", 2, st, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "single-row business transactions with synchronous=FULL, %llu each",
                   (unsigned long long)full_txns);
    if (best_of(b, path, 2, full_kinds, 1, full_txns, 1, "FULL", 2, ft, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    ratio_batch = bt[0] / bt[1];
    ratio_single = st[1] / st[2];
    us_none = st[0] * 1e6 / (double)txns;
    us_plain = st[1] * 1e6 / (double)txns;
    us_outbox = st[2] * 1e6 / (double)txns;
    fus_none = ft[0] * 1e6 / (double)full_txns;
    fus_outbox = ft[1] * 1e6 / (double)full_txns;

    bench_row_add(r, "batched: plain INSERT", NULL, V_NONE, "%s rows/s",
                  bench_thousands(n1, sizeof n1, (double)rows / bt[0]));
    bench_row_add(r, "batched: outbox_enqueue", NULL, V_NONE, "%s rows/s (%.2f us/row)",
                  bench_thousands(n2, sizeof n2, (double)rows / bt[1]), bt[1] * 1e6 / (double)rows);
    bench_row_add(r, "batched: enqueue / plain", ">= 0.60", ratio_batch >= 0.6 ? V_PASS : V_FAIL, "%.2f",
                  ratio_batch);
    bench_row_add(r, "batched: INSERT into outbox", NULL, V_NONE, "%s rows/s (%.2f us/row): %.2f x plain",
                  bench_thousands(n1, sizeof n1, (double)rows / bt[2]), bt[2] * 1e6 / (double)rows, bt[0] / bt[2]);
    bench_row_add(r, "1-row txn: business only", NULL, V_NONE, "%.1f us/txn", us_none);
    bench_row_add(r, "1-row txn: + plain row", NULL, V_NONE, "%.1f us/txn (+%.1f us)", us_plain, us_plain - us_none);
    bench_row_add(r, "1-row txn: + outbox_enqueue", NULL, V_NONE, "%.1f us/txn (+%.1f us, +%.0f%%)", us_outbox,
                  us_outbox - us_none, 100.0 * (us_outbox - us_none) / us_none);
    bench_row_add(r, "1-row txn: outbox / plain", ">= 0.60", ratio_single >= 0.6 ? V_PASS : V_FAIL, "%.2f",
                  ratio_single);
    bench_row_add(r, "FULL: business only", NULL, V_NONE, "%.1f us/txn", fus_none);
    bench_row_add(r, "FULL: + outbox_enqueue", NULL, V_NONE, "%.1f us/txn (%+.1f us)", fus_outbox,
                  fus_outbox - fus_none);
    bench_note(r, "INSERT into outbox: the plain INSERT's statement and values into the outbox table itself (its "
                  "CHECK constraints, UNIQUE(id) and indexes), no writer API: the most any writer of the table "
                  "can reach.");
    bench_note(r, "Ratios are throughput ratios (outbox rows/s over plain rows/s). 1-row: %llu transactions per "
                  "variant; FULL: %llu, best of 2 (fsync-bound, informational).",
               (unsigned long long)txns, (unsigned long long)full_txns);

    bench_json_int(r, "rows", (long long)rows);
    bench_json_num(r, "enqueue_rows_per_s", (double)rows / bt[1], 0);
    bench_json_num(r, "plain_rows_per_s", (double)rows / bt[0], 0);
    bench_json_num(r, "ratio", ratio_batch, 3);
    bench_json_num(r, "table_rows_per_s", (double)rows / bt[2], 0);
    bench_json_num(r, "table_ratio", bt[0] / bt[2], 3);
    bench_json_int(r, "txns", (long long)txns);
    bench_json_num(r, "txn_business_us", us_none, 2);
    bench_json_num(r, "txn_plain_us", us_plain, 2);
    bench_json_num(r, "txn_outbox_us", us_outbox, 2);
    bench_json_num(r, "txn_ratio", ratio_single, 3);
    bench_json_num(r, "full_txn_business_us", fus_none, 1);
    bench_json_num(r, "full_txn_outbox_us", fus_outbox, 1);
    bench_json_str(r, "synchronous", "NORMAL");
    bench_json_num(r, "target", 0.6, 1);
    return 0;
}
