/*
 * The drain's peer loops: three plain loops that publish the same backlog
 * the relay drains, as references for it (docs/BENCHMARKS.md). Each runs on
 * its own copy of the backlog, on one SQLite connection opened like the
 * relay's, with hiredis' blocking context for Redis (pipelined XADDs of the
 * relay's stream and field shape), batches of PEER_BATCH rows, and never
 * overlaps its SQLite and its Redis work:
 *
 *   naive    UPDATE ... RETURNING leases the batch row by row (state,
 *            owner, token, expiry), the XADDs, then one UPDATE per row
 *            marks it published with its entry id;
 *   ranged   one lease row per batch (owner, token, seq range, expiry) in
 *            a table of the loop's own, the rows read with a plain SELECT,
 *            the XADDs, then one ranged UPDATE marks the batch published
 *            and the lease row goes;
 *   norow    the same lease row, and no per-row write at all on success:
 *            the lease row, stamped published, is the record of the range.
 *
 * One transaction per batch, as the relay's units: the marks of the batch
 * before, then the next lease; then that batch's XADDs and their replies.
 * Every loop checks its own work: each XADD answered with an entry id, each
 * mark changed exactly the rows it meant, every row of the backlog
 * published; the caller checks the streams' lengths.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"

#define PEER_BATCH 512
#define PEER_LEASE_MS 30000

const char *const bench_peer_names[BENCH_PEERS] = {"naive", "ranged", "norow"};

static const char peer_owner[] = "bench-peer";

typedef struct peer {
    int kind;
    sqlite3 *h;
    redisContext *c;
    sqlite3_stmt *lease, *read, *lease_row, *mark, *done;
    int64_t next, last; /* the next seq to lease; the backlog's last */
    int64_t token;
    /* the batch in flight: its rows' seqs and tokens, entry ids (naive) */
    int64_t seq[PEER_BATCH], tok[PEER_BATCH];
    char entry[PEER_BATCH][48];
    int n;
    int64_t lo, hi, lease_token; /* its range and lease row (ranged, norow) */
    long published;
    char envbuf[8192];
    char *err;
    size_t errlen;
} peer;

static int sqlfail(peer *p, const char *what)
{
    snprintf(p->err, p->errlen, "%s peer: %s: %s", bench_peer_names[p->kind], what, sqlite3_errmsg(p->h));
    return -1;
}

static int prepare(peer *p, sqlite3_stmt **st, const char *sql)
{
    if (sqlite3_prepare_v3(p->h, sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL) != SQLITE_OK)
        return sqlfail(p, "prepare");
    return 0;
}

static int peer_open(peer *p, const char *db)
{
    if (outbox_db_open(db, OUTBOX_OPEN_RELAY, &p->h, p->err, p->errlen) != 0)
        return -1;
    /* The relay's page cache; SQLite's own checkpoints (the loop has no
     * other thread to run them on). */
    if (bench_exec(p->h, "PRAGMA cache_size=-16384", p->err, p->errlen) != 0)
        return -1;
    if (bench_exec(p->h,
                   "CREATE TABLE IF NOT EXISTS bench_peer_lease (token INTEGER PRIMARY KEY, owner TEXT NOT NULL, "
                   "seq_lo INTEGER NOT NULL, seq_hi INTEGER NOT NULL, lease_until INTEGER NOT NULL, "
                   "published_at INTEGER)",
                   p->err, p->errlen) != 0)
        return -1;
    if (p->kind == BENCH_PEER_NAIVE) {
        if (prepare(p, &p->lease,
                    "UPDATE outbox SET state = 1, lease_owner = ?1, lease_token = lease_token + 1, lease_until = ?2, "
                    "attempts = attempts + 1 WHERE seq >= ?3 AND seq < ?4 AND state = 0 "
                    "RETURNING seq, id, topic, key, payload, headers, created_at, lease_token") ||
            prepare(p, &p->mark,
                    "UPDATE outbox SET state = 2, published_at = ?2, stream_id = ?3 "
                    "WHERE seq = ?1 AND state = 1 AND lease_owner = ?4 AND lease_token = ?5"))
            return -1;
    } else {
        if (prepare(p, &p->read,
                    "SELECT seq, id, topic, key, payload, headers, created_at FROM outbox "
                    "WHERE seq >= ?1 AND seq < ?2 AND state = 0 ORDER BY seq") ||
            prepare(p, &p->lease_row,
                    "INSERT INTO bench_peer_lease (owner, seq_lo, seq_hi, lease_until) VALUES (?1, ?2, ?3, ?4)"))
            return -1;
        if (p->kind == BENCH_PEER_RANGED) {
            if (prepare(p, &p->mark,
                        "UPDATE outbox SET state = 2, published_at = ?1 WHERE seq BETWEEN ?2 AND ?3 AND state = 0") ||
                prepare(p, &p->done, "DELETE FROM bench_peer_lease WHERE token = ?1 AND owner = ?2"))
                return -1;
        } else if (prepare(p, &p->done,
                           "UPDATE bench_peer_lease SET published_at = ?1 WHERE token = ?2 AND owner = ?3 AND "
                           "published_at IS NULL")) {
            return -1;
        }
    }
    {
        sqlite3_stmt *st;
        if (prepare(p, &st, "SELECT coalesce(min(seq), 1), coalesce(max(seq), 0) FROM outbox WHERE state = 0"))
            return -1;
        if (sqlite3_step(st) != SQLITE_ROW) {
            sqlite3_finalize(st);
            return sqlfail(p, "the backlog's range");
        }
        p->next = sqlite3_column_int64(st, 0);
        p->last = sqlite3_column_int64(st, 1);
        sqlite3_finalize(st);
    }
    return 0;
}

static void peer_close(peer *p)
{
    sqlite3_finalize(p->lease);
    sqlite3_finalize(p->read);
    sqlite3_finalize(p->lease_row);
    sqlite3_finalize(p->mark);
    sqlite3_finalize(p->done);
    sqlite3_close_v2(p->h);
    if (p->c)
        redisFree(p->c);
}

/* Appends the XADD of the statement's current row (columns seq, id, topic,
 * key, payload, headers, created_at) to the pipeline. */
static int append_xadd(peer *p, sqlite3_stmt *st)
{
    outbox_envelope e;
    char stream[96];
    const char *argv[7];
    size_t lens[7], envlen = 0;
    int sl;

    memset(&e, 0, sizeof e);
    e.version = OUTBOX_ENVELOPE_VERSION;
    e.id = (const char *)sqlite3_column_text(st, 1);
    e.topic = (const char *)sqlite3_column_text(st, 2);
    if (sqlite3_column_type(st, 3) != SQLITE_NULL) {
        e.key = (const char *)sqlite3_column_text(st, 3);
        e.key_len = (size_t)sqlite3_column_bytes(st, 3);
    }
    e.payload = sqlite3_column_blob(st, 4);
    e.payload_len = (size_t)sqlite3_column_bytes(st, 4);
    if (sqlite3_column_type(st, 5) != SQLITE_NULL) {
        e.headers = sqlite3_column_blob(st, 5);
        e.headers_len = (size_t)sqlite3_column_bytes(st, 5);
    }
    e.created_at = sqlite3_column_int64(st, 6);
    if (!e.id || !e.topic || outbox_envelope_encode(&e, p->envbuf, sizeof p->envbuf, &envlen) != 0) {
        snprintf(p->err, p->errlen, "%s peer: cannot encode the envelope of seq %lld", bench_peer_names[p->kind],
                 (long long)sqlite3_column_int64(st, 0));
        return -1;
    }
    sl = snprintf(stream, sizeof stream, "outbox:%s", e.topic);
    argv[0] = "XADD", lens[0] = 4;
    argv[1] = stream, lens[1] = (size_t)sl;
    argv[2] = "*", lens[2] = 1;
    argv[3] = "id", lens[3] = 2;
    argv[4] = e.id, lens[4] = (size_t)sqlite3_column_bytes(st, 1);
    argv[5] = "envelope", lens[5] = 8;
    argv[6] = p->envbuf, lens[6] = envlen;
    if (redisAppendCommandArgv(p->c, 7, argv, lens) != REDIS_OK) {
        snprintf(p->err, p->errlen, "%s peer: out of memory", bench_peer_names[p->kind]);
        return -1;
    }
    return 0;
}

/* Leases the next batch and appends its XADDs (inside the transaction;
 * hiredis sends nothing before the replies are read). */
static int lease_batch(peer *p, int64_t now)
{
    sqlite3_stmt *st = p->kind == BENCH_PEER_NAIVE ? p->lease : p->read;
    int rc;
    p->n = 0;
    while (p->n == 0 && p->next <= p->last) {
        int64_t lo = p->next, hi = p->next + PEER_BATCH;
        p->next = hi;
        if (p->kind == BENCH_PEER_NAIVE) {
            sqlite3_bind_text(st, 1, peer_owner, -1, SQLITE_STATIC);
            sqlite3_bind_int64(st, 2, now + PEER_LEASE_MS);
            sqlite3_bind_int64(st, 3, lo);
            sqlite3_bind_int64(st, 4, hi);
        } else {
            sqlite3_bind_int64(st, 1, lo);
            sqlite3_bind_int64(st, 2, hi);
        }
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            int64_t seq = sqlite3_column_int64(st, 0);
            if (p->n == PEER_BATCH || (p->n && seq <= p->seq[p->n - 1])) {
                sqlite3_reset(st);
                snprintf(p->err, p->errlen, "%s peer: rows of a batch out of seq order (seq %lld)",
                         bench_peer_names[p->kind], (long long)seq);
                return -1;
            }
            p->seq[p->n] = seq;
            p->tok[p->n] = p->kind == BENCH_PEER_NAIVE ? sqlite3_column_int64(st, 7) : 0;
            if (append_xadd(p, st) != 0) {
                sqlite3_reset(st);
                return -1;
            }
            p->n++;
        }
        sqlite3_reset(st);
        if (rc != SQLITE_DONE)
            return sqlfail(p, "lease");
        p->lo = lo;
        p->hi = hi - 1;
    }
    if (p->n && p->kind != BENCH_PEER_NAIVE) {
        sqlite3_bind_text(p->lease_row, 1, peer_owner, -1, SQLITE_STATIC);
        sqlite3_bind_int64(p->lease_row, 2, p->lo);
        sqlite3_bind_int64(p->lease_row, 3, p->hi);
        sqlite3_bind_int64(p->lease_row, 4, now + PEER_LEASE_MS);
        rc = sqlite3_step(p->lease_row);
        sqlite3_reset(p->lease_row);
        if (rc != SQLITE_DONE)
            return sqlfail(p, "lease row");
        p->lease_token = sqlite3_last_insert_rowid(p->h);
    }
    return 0;
}

/* Reads the batch's replies: each must be an entry id. */
static int read_replies(peer *p)
{
    int i;
    for (i = 0; i < p->n; i++) {
        void *rp = NULL;
        redisReply *r;
        if (redisGetReply(p->c, &rp) != REDIS_OK) {
            snprintf(p->err, p->errlen, "%s peer: Redis: %s", bench_peer_names[p->kind], p->c->errstr);
            return -1;
        }
        r = rp;
        if (r->type != REDIS_REPLY_STRING || r->len == 0 || r->len >= sizeof p->entry[i]) {
            snprintf(p->err, p->errlen, "%s peer: XADD of seq %lld answered %s", bench_peer_names[p->kind],
                     (long long)p->seq[i], r->type == REDIS_REPLY_ERROR ? r->str : "no entry id");
            freeReplyObject(r);
            return -1;
        }
        memcpy(p->entry[i], r->str, r->len + 1);
        freeReplyObject(r);
    }
    return 0;
}

static int step_changes(peer *p, sqlite3_stmt *st, int want, const char *what)
{
    int rc = sqlite3_step(st), got = sqlite3_changes(p->h);
    sqlite3_reset(st);
    if (rc != SQLITE_DONE)
        return sqlfail(p, what);
    if (got != want) {
        snprintf(p->err, p->errlen, "%s peer: %s changed %d rows, not %d", bench_peer_names[p->kind], what, got,
                 want);
        return -1;
    }
    return 0;
}

/* Marks the batch whose replies were read. */
static int mark_batch(peer *p, int64_t now)
{
    int i;
    if (!p->n)
        return 0;
    if (p->kind == BENCH_PEER_NAIVE) {
        for (i = 0; i < p->n; i++) {
            sqlite3_bind_int64(p->mark, 1, p->seq[i]);
            sqlite3_bind_int64(p->mark, 2, now);
            sqlite3_bind_text(p->mark, 3, p->entry[i], -1, SQLITE_STATIC);
            sqlite3_bind_text(p->mark, 4, peer_owner, -1, SQLITE_STATIC);
            sqlite3_bind_int64(p->mark, 5, p->tok[i]);
            if (step_changes(p, p->mark, 1, "a row's mark") != 0)
                return -1;
        }
    } else if (p->kind == BENCH_PEER_RANGED) {
        sqlite3_bind_int64(p->mark, 1, now);
        sqlite3_bind_int64(p->mark, 2, p->lo);
        sqlite3_bind_int64(p->mark, 3, p->hi);
        if (step_changes(p, p->mark, p->n, "the ranged mark") != 0)
            return -1;
        sqlite3_bind_int64(p->done, 1, p->lease_token);
        sqlite3_bind_text(p->done, 2, peer_owner, -1, SQLITE_STATIC);
        if (step_changes(p, p->done, 1, "the lease row's delete") != 0)
            return -1;
    } else {
        sqlite3_bind_int64(p->done, 1, now);
        sqlite3_bind_int64(p->done, 2, p->lease_token);
        sqlite3_bind_text(p->done, 3, peer_owner, -1, SQLITE_STATIC);
        if (step_changes(p, p->done, 1, "the lease row's stamp") != 0)
            return -1;
    }
    p->published += p->n;
    return 0;
}

/* Counts what the database says was published: rows in state 2, or the
 * rows of the ranges stamped published. */
static long long db_published(peer *p)
{
    const char *sql = p->kind == BENCH_PEER_NOROW
                          ? "SELECT count(*) FROM outbox o JOIN bench_peer_lease l ON o.seq BETWEEN l.seq_lo AND "
                            "l.seq_hi WHERE l.published_at IS NOT NULL AND o.state = 0"
                          : "SELECT count(*) FROM outbox WHERE state = 2";
    sqlite3_stmt *st;
    long long v = -1;
    if (sqlite3_prepare_v2(p->h, sql, -1, &st, NULL) != SQLITE_OK)
        return -1;
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return v;
}

static double self_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return bench_ru_cpu_s(&ru);
}

int bench_peer_drain(bench *b, int kind, const char *db, long n, double *secs, double *cpu_s, char *err,
                     size_t errlen)
{
    peer *p = calloc(1, sizeof *p);
    uint64_t t0;
    double c0;
    long long counted;
    int rc = -1;

    if (!p) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    p->kind = kind;
    p->err = err;
    p->errlen = errlen;
    if (peer_open(p, db) != 0)
        goto out;
    p->c = bench_redis_connect(b);
    if (!p->c) {
        snprintf(err, errlen, "%s peer: cannot connect to Redis", bench_peer_names[kind]);
        goto out;
    }
    t0 = bench_mono_us();
    c0 = self_cpu_s();
    for (;;) {
        int64_t now = outbox_now_ms();
        int had = p->n;
        if (bench_exec(p->h, "BEGIN IMMEDIATE", err, errlen) != 0)
            goto out;
        if (mark_batch(p, now) != 0 || lease_batch(p, now) != 0) {
            sqlite3_exec(p->h, "ROLLBACK", NULL, NULL, NULL);
            goto out;
        }
        if (bench_exec(p->h, "COMMIT", err, errlen) != 0)
            goto out;
        if (!p->n && had == 0)
            break;
        if (!p->n)
            continue; /* the last batch was marked: one more round finds nothing */
        if (read_replies(p) != 0)
            goto out;
    }
    *secs = (double)(bench_mono_us() - t0) / 1e6;
    *cpu_s = self_cpu_s() - c0;
    counted = db_published(p);
    if (p->published != n || counted != n) {
        snprintf(err, errlen, "%s peer: published %ld rows (the database says %lld) of %ld", bench_peer_names[kind],
                 p->published, counted, n);
        goto out;
    }
    rc = 0;
out:
    peer_close(p);
    free(p);
    return rc;
}
