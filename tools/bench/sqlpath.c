/*
 * The relay's per-message SQL run directly on one connection, without
 * Redis: what the claim scenario's SQL path times, and the floor under the
 * drain (what the SQL alone allows, since SQLite lets one connection write
 * at a time).
 *
 * Two sets of statements:
 * - the relay's own (src/relay/sql.h, the text the relay runs), in the
 *   order a unit runs them: the walk (which reads what is to be sent of the
 *   rows it chooses), one batch lease record, and one write of the record
 *   when the batch is published;
 * - the least any per-row lifecycle of DESIGN.md writes: one UPDATE ...
 *   RETURNING that leases a range of rows (owner, token, expiry) and reads
 *   what is to be sent, then one UPDATE per row that marks it published
 *   with its stream entry id. No walk, no key lookups, no fencing terms.
 *
 * And the floor of a database of a group: one database opened, walked,
 * leased and marked the least way the relay can, then closed (dbdir).
 */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "relay/sql.h"

struct bench_sql {
    sqlite3 *h;
    sqlite3_stmt *stray, *wait, *cur, *walk, *any, *prev, *claim, *setcur, *mark;
    sqlite3_stmt *bare_claim, *bare_mark;
    char *list; /* the claim's seqs as a JSON array */
    int64_t bare_next;
    int wal_pages; /* the WAL's size after the last commit (wal hook) */
};

/* Checkpoints from this many WAL pages, as the relay does while draining;
 * the floor does not count their time (the relay runs them on another
 * thread), but without them the WAL would grow without end, each commit
 * appending to a longer file than the relay's ever is. */
#define FLOOR_CKPT_PAGES 8000

static int wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    (void)db;
    (void)name;
    ((bench_sql *)arg)->wal_pages = pages;
    return SQLITE_OK;
}

static const char owner[] = "bench-sql";

/* Every statement, by its field. */
static const struct {
    size_t off;
    const char *sql;
} stmts[] = {
#define S(f, q) {offsetof(bench_sql, f), q}
    S(stray, OUTBOX__SQL_STRAY),
    S(wait, OUTBOX__SQL_DUE),
    S(cur, OUTBOX__SQL_CURSOR),
    S(walk, OUTBOX__SQL_NEW),
    S(any, OUTBOX__SQL_KEY_ANY),
    S(prev, OUTBOX__SQL_KEY_PREV),
    S(claim, OUTBOX__SQL_BATCH_NEW),
    S(setcur, OUTBOX__SQL_CURSOR_SET),
    S(mark, OUTBOX__SQL_BATCH_PUBLISHED),
    S(bare_claim, "UPDATE outbox SET state = 1, lease_owner = ?1, lease_token = lease_token + 1, lease_until = ?2 "
                  "WHERE seq BETWEEN ?3 AND ?4 RETURNING seq, id, topic, key, payload, headers, lease_token"),
    S(bare_mark, "UPDATE outbox SET state = 2, published_at = ?2, stream_id = ?3 WHERE seq = ?1"),
#undef S
};

int bench_sql_open(const char *db, bench_sql **out, char *err, size_t errlen)
{
    bench_sql *s = calloc(1, sizeof *s);
    size_t i;
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->bare_next = 1;
    if (outbox_db_open(db, OUTBOX_OPEN_RELAY, &s->h, err, errlen) != 0) {
        free(s);
        return -1;
    }
    /* As the relay: a 16 MiB page cache, no checkpoint inside a commit (a
     * WAL hook replaces the automatic one; bench_sql_drain checkpoints
     * between units and leaves that time out). */
    if (bench_exec(s->h, "PRAGMA cache_size=-16384", err, errlen) != 0)
        goto fail;
    sqlite3_wal_hook(s->h, wal_hook, s);
    for (i = 0; i < sizeof stmts / sizeof stmts[0]; i++) {
        sqlite3_stmt **st = (sqlite3_stmt **)((char *)s + stmts[i].off);
        if (sqlite3_prepare_v3(s->h, stmts[i].sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL) != SQLITE_OK) {
            snprintf(err, errlen, "prepare: %s", sqlite3_errmsg(s->h));
            goto fail;
        }
    }
    *out = s;
    return 0;
fail:
    bench_sql_close(s);
    return -1;
}

void bench_sql_close(bench_sql *s)
{
    size_t i;
    if (!s)
        return;
    for (i = 0; i < sizeof stmts / sizeof stmts[0]; i++)
        sqlite3_finalize(*(sqlite3_stmt **)((char *)s + stmts[i].off));
    sqlite3_close_v2(s->h);
    free(s->list);
    free(s);
}

int bench_sql_exec(bench_sql *s, const char *sql, char *err, size_t errlen)
{
    return bench_exec(s->h, sql, err, errlen);
}

/* Reads the columns of a row to send, at these indexes, as the relay's
 * outbox__encode_row does. */
static void read_row(sqlite3_stmt *st, int id, int topic, int key, int payload, int headers)
{
    (void)sqlite3_column_text(st, id);
    (void)sqlite3_column_bytes(st, id);
    (void)sqlite3_column_text(st, topic);
    (void)sqlite3_column_bytes(st, topic);
    if (sqlite3_column_type(st, key) != SQLITE_NULL)
        (void)sqlite3_column_text(st, key);
    (void)sqlite3_column_blob(st, payload);
    (void)sqlite3_column_bytes(st, payload);
    if (sqlite3_column_type(st, headers) != SQLITE_NULL)
        (void)sqlite3_column_blob(st, headers);
}

/* Reads a claimed row's columns as the relay's take_row does. */
static void read_claimed(sqlite3_stmt *st, int64_t *seq, int64_t *token, int token_col)
{
    *seq = sqlite3_column_int64(st, 0);
    read_row(st, 1, 2, 3, 4, 5);
    *token = sqlite3_column_int64(st, token_col);
}

/* Reads a walked row's columns as the relay's encode_new does (walk_cols
 * in src/relay/claim.c). */
static void read_walked(sqlite3_stmt *st)
{
    read_row(st, 6, 1, 2, 7, 8);
    (void)sqlite3_column_int64(st, 9);
    (void)sqlite3_column_int64(st, 10);
}

int bench_sql_claim(bench_sql *s, int batch, int64_t now, int64_t *seq, int64_t *token, int *n, char *err,
                    size_t errlen)
{
    int64_t from = 0, first = -1, last = -1;
    int chosen = 0, rc, keyed;
    char *p;

    *n = 0;
    if (!s->list && !(s->list = malloc((size_t)batch * 21 + 2))) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (sqlite3_step(s->stray) != SQLITE_DONE)
        goto sqlerr;
    sqlite3_reset(s->stray);
    sqlite3_bind_int64(s->wait, 1, now);
    sqlite3_bind_int64(s->wait, 2, (int64_t)batch * 4);
    while ((rc = sqlite3_step(s->wait)) == SQLITE_ROW)
        ; /* none wait here; the relay walks them first */
    sqlite3_reset(s->wait);
    if (sqlite3_step(s->cur) == SQLITE_ROW) {
        from = sqlite3_column_int64(s->cur, 0);
        if (sqlite3_column_int64(s->cur, 1) > from)
            from = sqlite3_column_int64(s->cur, 1);
    }
    sqlite3_reset(s->cur);
    /* The new rows from the cursor (the relay looks up to 4 x batch ahead),
     * and for each keyed one its key's newest leased or waiting row when
     * any row is leased or waiting. */
    keyed = sqlite3_step(s->any);
    sqlite3_reset(s->any);
    if (keyed != SQLITE_ROW && keyed != SQLITE_DONE)
        goto sqlerr;
    sqlite3_bind_int64(s->walk, 1, (int64_t)batch * 4);
    sqlite3_bind_int64(s->walk, 2, from);
    p = s->list;
    *p++ = '[';
    while (chosen < batch && sqlite3_step(s->walk) == SQLITE_ROW) {
        int64_t q = sqlite3_column_int64(s->walk, 0);
        if (keyed == SQLITE_ROW && sqlite3_column_type(s->walk, 2) != SQLITE_NULL) {
            sqlite3_bind_text(s->prev, 1, (const char *)sqlite3_column_text(s->walk, 1), -1, SQLITE_TRANSIENT);
            sqlite3_bind_text(s->prev, 2, (const char *)sqlite3_column_text(s->walk, 2), -1, SQLITE_TRANSIENT);
            sqlite3_bind_int64(s->prev, 3, q);
            while (sqlite3_step(s->prev) == SQLITE_ROW)
                ;
            sqlite3_reset(s->prev);
        }
        read_walked(s->walk);
        seq[chosen] = q;
        token[chosen] = 1;
        p += sprintf(p, "%s%lld", chosen ? "," : "", (long long)q);
        if (first < 0)
            first = q;
        last = q;
        chosen++;
    }
    *p++ = ']';
    sqlite3_reset(s->walk);
    if (!chosen)
        return 0;
    /* One batch lease record for the range. */
    sqlite3_bind_int64(s->claim, 1, first);
    sqlite3_bind_int64(s->claim, 2, last);
    sqlite3_bind_text(s->claim, 3, owner, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s->claim, 4, now + 30000);
    if (sqlite3_step(s->claim) != SQLITE_DONE) {
        sqlite3_reset(s->claim);
        goto sqlerr;
    }
    sqlite3_reset(s->claim);
    sqlite3_bind_int64(s->setcur, 1, last + 1);
    if (sqlite3_step(s->setcur) != SQLITE_DONE)
        goto sqlerr;
    sqlite3_reset(s->setcur);
    *n = chosen;
    return 0;
sqlerr:
    snprintf(err, errlen, "claim: %s", sqlite3_errmsg(s->h));
    return -1;
}

int bench_sql_unclaim(bench_sql *s, int64_t from, char *err, size_t errlen)
{
    char sql[200];
    snprintf(sql, sizeof sql,
             "BEGIN IMMEDIATE; DELETE FROM outbox_batch WHERE owner = '%s'; UPDATE outbox_cursor SET new_from = %lld; "
             "COMMIT",
             owner, (long long)from);
    return bench_exec(s->h, sql, err, errlen);
}

/* A stream entry id of the shape Redis gives (ms-seq). */
static int entry_id(char *buf, size_t len, int64_t now, int64_t seq)
{
    return snprintf(buf, len, "%lld-%lld", (long long)now, (long long)(seq & 1023));
}

/* Marks n rows published: the relay's fenced mark of their batch (one
 * write), or the bare one per row. */
static int mark_rows(bench_sql *s, int bare, const int64_t *seq, const int64_t *token, int n, int64_t now,
                     char *err, size_t errlen)
{
    sqlite3_stmt *st = bare ? s->bare_mark : s->mark;
    char sid[48];
    int i, l;
    if (!bare && n > 0) {
        sqlite3_bind_int64(st, 1, seq[0]);
        sqlite3_bind_text(st, 2, owner, -1, SQLITE_STATIC);
        sqlite3_bind_int64(st, 3, token[0]);
        sqlite3_bind_int64(st, 4, now);
        if (sqlite3_step(st) != SQLITE_DONE || sqlite3_changes(s->h) != 1) {
            snprintf(err, errlen, "mark of the batch from seq %lld: %s", (long long)seq[0], sqlite3_errmsg(s->h));
            sqlite3_reset(st);
            return -1;
        }
        sqlite3_reset(st);
        return 0;
    }
    for (i = 0; i < n; i++) {
        l = entry_id(sid, sizeof sid, now, seq[i]);
        sqlite3_bind_int64(st, 1, seq[i]);
        if (bare) {
            sqlite3_bind_int64(st, 2, now);
            sqlite3_bind_text(st, 3, sid, l, SQLITE_STATIC);
        } else {
            sqlite3_bind_text(st, 2, owner, -1, SQLITE_STATIC);
            sqlite3_bind_int64(st, 3, token[i]);
            sqlite3_bind_int64(st, 4, now);
            sqlite3_bind_text(st, 5, sid, l, SQLITE_STATIC);
        }
        if (sqlite3_step(st) != SQLITE_DONE || sqlite3_changes(s->h) != 1) {
            snprintf(err, errlen, "%smark of seq %lld: %s", bare ? "bare " : "", (long long)seq[i],
                     sqlite3_errmsg(s->h));
            sqlite3_reset(st);
            return -1;
        }
        sqlite3_reset(st);
    }
    return 0;
}

static int claim_bare(bench_sql *s, int batch, int64_t now, int64_t *seq, int64_t *token, int *n, char *err,
                      size_t errlen)
{
    int got = 0;
    sqlite3_bind_text(s->bare_claim, 1, owner, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s->bare_claim, 2, now + 30000);
    sqlite3_bind_int64(s->bare_claim, 3, s->bare_next);
    sqlite3_bind_int64(s->bare_claim, 4, s->bare_next + batch - 1);
    while (got < batch && sqlite3_step(s->bare_claim) == SQLITE_ROW) {
        read_claimed(s->bare_claim, &seq[got], &token[got], 6);
        got++;
    }
    if (sqlite3_reset(s->bare_claim) != SQLITE_OK) {
        snprintf(err, errlen, "bare claim: %s", sqlite3_errmsg(s->h));
        return -1;
    }
    s->bare_next += batch;
    *n = got;
    return 0;
}

int bench_sql_drain(bench_sql *s, int bare, int batch, long n, double *secs, char *err, size_t errlen)
{
    /* Two batches of seqs and tokens: the one claimed now and the one
     * marked now (claimed by the unit before); they swap each unit. */
    int64_t *buf = malloc(4 * (size_t)batch * sizeof *buf), *seq, *tok, *prev_seq, *prev_tok, *t;
    int got = 0, nprev = 0, rc = -1;
    long done = 0;
    uint64_t t0, ckpt_ns = 0;

    if (!buf) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    seq = buf;
    prev_seq = buf + batch;
    tok = buf + 2 * (size_t)batch;
    prev_tok = buf + 3 * (size_t)batch;
    t0 = bench_mono_ns();
    /* One transaction per unit, as the relay: the marks of the batch
     * before, then the next claim. */
    for (;;) {
        int64_t now = outbox_now_ms();
        if (bench_exec(s->h, "BEGIN IMMEDIATE", err, errlen) != 0)
            goto out;
        if (mark_rows(s, bare, prev_seq, prev_tok, nprev, now, err, errlen) != 0 ||
            (bare ? claim_bare(s, batch, now, seq, tok, &got, err, errlen)
                  : bench_sql_claim(s, batch, now, seq, tok, &got, err, errlen)) != 0) {
            sqlite3_exec(s->h, "ROLLBACK", NULL, NULL, NULL);
            goto out;
        }
        if (bench_exec(s->h, "COMMIT", err, errlen) != 0)
            goto out;
        if (s->wal_pages >= FLOOR_CKPT_PAGES) {
            uint64_t c0 = bench_mono_ns();
            if (sqlite3_wal_checkpoint_v2(s->h, NULL, SQLITE_CHECKPOINT_RESTART, NULL, NULL) != SQLITE_OK) {
                snprintf(err, errlen, "checkpoint: %s", sqlite3_errmsg(s->h));
                goto out;
            }
            s->wal_pages = 0;
            ckpt_ns += bench_mono_ns() - c0;
        }
        done += nprev;
        if (!got && !nprev)
            break;
        t = prev_seq, prev_seq = seq, seq = t;
        t = prev_tok, prev_tok = tok, tok = t;
        nprev = got;
    }
    *secs = (double)(bench_mono_ns() - t0 - ckpt_ns) / 1e9;
    if (done != n) {
        snprintf(err, errlen, "%s SQL drain marked %ld of %ld rows", bare ? "bare" : "relay", done, n);
        goto out;
    }
    rc = 0;
out:
    free(buf);
    return rc;
}

/* ------------------------------------------------------------------ */
/* The floor of a database of a group (outbox-bench dbdir) */

/* Thread CPU seconds (a floor runs on the calling thread). */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One database the least way the relay can: opened as the relay opens it
 * (a group's connection: no checkpoint at close), its schema read, the
 * plan (src/relay/sql.h), the walk of its new rows reading what is sent,
 * one batch lease and the cursor in one transaction, the batch marked
 * published in another, closed. No Redis, no encoding. */
static int floor_walk(const char *path, long *rows, char *err, size_t errlen)
{
    static const char *const sql[] = {OUTBOX__SQL_PLAN, OUTBOX__SQL_NEW, OUTBOX__SQL_BATCH_NEW,
                                      OUTBOX__SQL_CURSOR_SET, OUTBOX__SQL_BATCH_PUBLISHED};
    sqlite3 *h = NULL;
    sqlite3_stmt *st[5] = {NULL};
    int64_t lo = -1, hi = -1, from;
    int rc = SQLITE_OK, i, ok = 0;

    if (sqlite3_open_v2(path, &h, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK)
        goto fail;
    sqlite3_db_config(h, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, (int *)NULL);
    if (sqlite3_exec(h, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL) != SQLITE_OK ||
        sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        goto fail;
    for (i = 0; i < 4; i++)
        if (sqlite3_prepare_v3(h, sql[i], -1, SQLITE_PREPARE_PERSISTENT, &st[i], NULL) != SQLITE_OK)
            goto fail;
    sqlite3_bind_int64(st[0], 1, 0);
    if (sqlite3_step(st[0]) != SQLITE_ROW || sqlite3_column_int(st[0], 2) || sqlite3_column_int(st[0], 3))
        goto fail; /* not a database of new rows only: not what the scenario built */
    from = sqlite3_column_int64(st[0], 0) > sqlite3_column_int64(st[0], 1) ? sqlite3_column_int64(st[0], 0)
                                                                           : sqlite3_column_int64(st[0], 1);
    sqlite3_bind_int64(st[1], 1, 1000000);
    sqlite3_bind_int64(st[1], 2, from);
    while ((rc = sqlite3_step(st[1])) == SQLITE_ROW) {
        /* What a message is made of (outbox__row_read reads these). */
        for (i = 0; i < 11; i++)
            (void)sqlite3_column_bytes(st[1], i);
        hi = sqlite3_column_int64(st[1], 0);
        if (lo < 0)
            lo = hi;
        (*rows)++;
    }
    if (rc != SQLITE_DONE || lo < 0)
        goto fail;
    sqlite3_bind_int64(st[2], 1, lo);
    sqlite3_bind_int64(st[2], 2, hi);
    sqlite3_bind_text(st[2], 3, "bench-floor", -1, SQLITE_STATIC);
    sqlite3_bind_int64(st[2], 4, INT64_MAX / 2);
    sqlite3_bind_int64(st[3], 1, hi + 1);
    if (sqlite3_step(st[2]) != SQLITE_DONE || sqlite3_step(st[3]) != SQLITE_DONE ||
        sqlite3_exec(h, "COMMIT", NULL, NULL, NULL) != SQLITE_OK ||
        sqlite3_prepare_v3(h, sql[4], -1, SQLITE_PREPARE_PERSISTENT, &st[4], NULL) != SQLITE_OK ||
        sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        goto fail;
    sqlite3_bind_int64(st[4], 1, lo);
    sqlite3_bind_text(st[4], 2, "bench-floor", -1, SQLITE_STATIC);
    sqlite3_bind_int64(st[4], 3, 1);
    sqlite3_bind_int64(st[4], 4, 1);
    if (sqlite3_step(st[4]) != SQLITE_DONE || sqlite3_changes(h) != 1 ||
        sqlite3_exec(h, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
        goto fail;
    ok = 1;
fail:
    if (!ok)
        snprintf(err, errlen, "SQL floor: %.300s: %.180s", path, h ? sqlite3_errmsg(h) : "cannot open");
    for (i = 0; i < 5; i++)
        sqlite3_finalize(st[i]);
    sqlite3_close_v2(h);
    return ok ? 0 : -1;
}

/* A share of the floor: the databases first, first + step, ... of dir. */
typedef struct floor_job {
    const char *dir;
    long ndb, first, step;
    double cpu_s; /* its thread's CPU */
    long rows;
    int rc;
    char err[512];
} floor_job;

static void *floor_share(void *arg)
{
    floor_job *j = arg;
    char p[PATH_MAX + 64];
    double c0 = thread_cpu_s();
    for (long i = j->first; i < j->ndb && j->rc == 0; i += j->step) {
        snprintf(p, sizeof p, "%.4000s/t%05ld.db", j->dir, i);
        j->rc = floor_walk(p, &j->rows, j->err, sizeof j->err);
    }
    j->cpu_s = thread_cpu_s() - c0;
    return NULL;
}

int bench_sql_floor_db(const char *path, double *cpu_s, long *rows, char *err, size_t errlen)
{
    double c0 = thread_cpu_s();
    int rc;
    *rows = 0;
    rc = floor_walk(path, rows, err, errlen);
    *cpu_s = thread_cpu_s() - c0;
    return rc;
}

int bench_sql_floor_dir(const char *dir, long ndb, int nthreads, double *cpu_s, double *wall_s, long *rows,
                        char *err, size_t errlen)
{
    floor_job jobs[8];
    pthread_t th[8];
    int started = 0, rc = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > 8)
        nthreads = 8;
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < nthreads; i++) {
        jobs[i].dir = dir;
        jobs[i].ndb = ndb;
        jobs[i].first = i;
        jobs[i].step = nthreads;
    }
    if (nthreads == 1) {
        floor_share(&jobs[0]);
        started = 1;
    } else {
        for (; started < nthreads; started++)
            if (pthread_create(&th[started], NULL, floor_share, &jobs[started]) != 0)
                break;
        for (int i = 0; i < started; i++)
            pthread_join(th[i], NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (wall_s)
        *wall_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    *cpu_s = 0;
    *rows = 0;
    for (int i = 0; i < started; i++) {
        *cpu_s += jobs[i].cpu_s;
        *rows += jobs[i].rows;
        if (jobs[i].rc != 0 && rc == 0) {
            snprintf(err, errlen, "%s", jobs[i].err);
            rc = -1;
        }
    }
    if (started < nthreads && rc == 0) {
        snprintf(err, errlen, "SQL floor: cannot start a thread");
        rc = -1;
    }
    return rc;
}
