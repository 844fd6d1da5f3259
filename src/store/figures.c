/*
 * figures.c: the outbox table's figures from its ranges, holes and indexes
 * (figures.h says how, and what they cannot see).
 */
#include "store/figures.h"

#include <string.h>

#include "util/util.h"
#include "store/state_sql.h"
#include "store/sqlite_util.h"

/* Where the new rows start (the walk's start, store/state_sql.h), the last seq,
 * and the total length of the published ranges: outbox_tally's, or without
 * its row the sum over the published batches' records. */
#define SQL_HEAD                                                                                                      \
    "SELECT " OUTBOX__SQL_NEW_FROM ", (SELECT coalesce(max(seq), 0) FROM outbox), "                                   \
    "coalesce((SELECT published FROM outbox_tally), "                                                                 \
    "(SELECT coalesce(sum(hi - lo + 1), 0) FROM outbox_batch WHERE state = 2))"

/* The leased batches' range lengths, by whether the lease ends after ?1
 * (outbox_batch_leased: the leased batches are the relays' windows). */
#define SQL_LEASED "SELECT coalesce(lease_until > ?1, 0), sum(hi - lo + 1) FROM outbox_batch WHERE state = 1 GROUP BY 1"

/* Every row with a state of its own, from its partial index (each WHERE as
 * proto/schema.sql has it: SQLite uses a partial index only for a query
 * that repeats its condition), and every hole up to the last seq ?3 (a hole
 * past it, or one whose seq has a row again, is none), counted by kind and
 * by the range that holds it: 1 the new rows' (from ?2 on), 2 a published
 * batch's, 3 or 4 a leased batch's whose lease ends after ?1 or not, 0 none
 * (a batch found through its primary key, the greatest lo not above the
 * seq). Kinds: 0 and 1 waiting rows due by ?1 or later, 2 rows made pending
 * again by hand (outbox_stray), 3 and 4 rows leased on their own whose
 * lease ends after ?1 or not, 5 published on their own, 6 dead, 7 holes. */
enum { K_DUE, K_LATER, K_STRAY, K_LIVE, K_EXPIRED, K_PUBLISHED, K_DEAD, K_HOLE, K_COUNT };
enum { R_NONE, R_NEW, R_PUBLISHED, R_LIVE, R_EXPIRED, R_COUNT };
#define SQL_EXCEPTIONS                                                                                                \
    "WITH x(seq, kind) AS ("                                                                                          \
    "SELECT seq, available_at > ?1 FROM outbox WHERE state = 0 AND available_at > created_at "                        \
    "UNION ALL SELECT seq, 2 FROM outbox WHERE state = 0 AND available_at <= created_at AND lease_token > 0 "         \
    "UNION ALL SELECT seq, 4 - coalesce(lease_until > ?1, 0) FROM outbox WHERE state = 1 "                            \
    "UNION ALL SELECT seq, 5 FROM outbox WHERE state = 2 "                                                            \
    "UNION ALL SELECT seq, 6 FROM outbox WHERE state = 3 "                                                            \
    "UNION ALL SELECT seq, 7 FROM outbox_gone g WHERE seq <= ?3 "                                                     \
    "AND NOT EXISTS (SELECT 1 FROM outbox WHERE outbox.seq = g.seq)) "                                                \
    "SELECT kind, CASE WHEN seq >= ?2 THEN 1 ELSE coalesce((SELECT CASE WHEN hi < x.seq THEN 0 WHEN state = 2 "      \
    "THEN 2 WHEN lease_until > ?1 THEN 3 ELSE 4 END FROM outbox_batch WHERE lo <= x.seq ORDER BY lo DESC LIMIT 1), " \
    "0) END, count(*) FROM x GROUP BY 1, 2"

/* The oldest due pending row by created_at (figures.h): the first new row
 * from the walk's start, the earliest created due waiting row (outbox_due)
 * and row made pending again by hand (outbox_stray). */
#define SQL_OLDEST                                                                                                    \
    "SELECT id, created_at FROM ("                                                                                    \
    "SELECT * FROM (SELECT seq, id, created_at FROM outbox WHERE seq >= " OUTBOX__SQL_NEW_FROM " AND "                \
    OUTBOX__SQL_BARE " ORDER BY seq LIMIT 1) "                                                                        \
    "UNION ALL SELECT * FROM (SELECT seq, id, created_at FROM outbox WHERE state = 0 AND available_at > created_at "   \
    "AND available_at <= ?1 ORDER BY created_at, seq LIMIT 1) "                                                       \
    "UNION ALL SELECT * FROM (SELECT seq, id, created_at FROM outbox WHERE state = 0 AND available_at <= created_at " \
    "AND lease_token > 0 ORDER BY created_at, seq LIMIT 1)) "                                                         \
    "ORDER BY created_at, seq LIMIT 1"

const char *const outbox__figures_sql[] = {SQL_HEAD, SQL_LEASED, SQL_EXCEPTIONS, OUTBOX__SQL_OLDEST_DUE, SQL_OLDEST};
const size_t outbox__figures_nsql = OUTBOX_ARRAY_LEN(outbox__figures_sql);

/* Prepares sql with ?1 = now; SQLITE_OK or the failure's code. */
static int prepare_now(sqlite3 *db, const char *sql, int64_t now, sqlite3_stmt **st)
{
    int rc = sqlite3_prepare_v2(db, sql, -1, st, NULL);
    if (rc == SQLITE_OK && sqlite3_bind_parameter_count(*st) >= 1)
        rc = sqlite3_bind_int64(*st, 1, now);
    return rc;
}

/* The figures inside the caller's read transaction; a SQLite code. */
static int read_in_txn(sqlite3 *db, int64_t now, outbox__figures *f)
{
    sqlite3_stmt *st = NULL;
    int64_t from = 0, last = 0, published_span = 0, leased_span[2] = {0, 0}, n[K_COUNT][R_COUNT], own[K_COUNT],
            in[R_COUNT], new_rows;
    int rc, k, g;

    memset(n, 0, sizeof n);
    rc = sqlite3_prepare_v2(db, SQL_HEAD, -1, &st, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        from = sqlite3_column_int64(st, 0);
        if (from < 1)
            from = 1; /* no cursor row and no batch: the walk starts at the first seq, which is 1 or more */
        last = sqlite3_column_int64(st, 1);
        published_span = sqlite3_column_int64(st, 2);
        rc = SQLITE_DONE;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return rc;

    rc = prepare_now(db, SQL_LEASED, now, &st);
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        leased_span[sqlite3_column_int(st, 0) ? 1 : 0] += sqlite3_column_int64(st, 1);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return rc;

    rc = prepare_now(db, SQL_EXCEPTIONS, now, &st);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int64(st, 2, from);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int64(st, 3, last);
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        k = sqlite3_column_int(st, 0);
        g = sqlite3_column_int(st, 1);
        if (k >= 0 && k < K_COUNT && g >= 0 && g < R_COUNT)
            n[k][g] += sqlite3_column_int64(st, 2);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return rc;

    /* own[k]: the rows of kind k wherever they are; in[g]: what range g
     * holds besides its rows as written. */
    memset(own, 0, sizeof own);
    memset(in, 0, sizeof in);
    for (k = 0; k < K_COUNT; k++)
        for (g = 0; g < R_COUNT; g++) {
            own[k] += n[k][g];
            in[g] += n[k][g];
        }
    new_rows = (last >= from ? last - from + 1 : 0) - in[R_NEW];
    f->by_state[OUTBOX_STATE_PENDING] = own[K_DUE] + own[K_LATER] + own[K_STRAY] + new_rows;
    f->by_state[OUTBOX_STATE_SENDING] =
        own[K_LIVE] + own[K_EXPIRED] + leased_span[1] - in[R_LIVE] + leased_span[0] - in[R_EXPIRED];
    f->by_state[OUTBOX_STATE_PUBLISHED] = own[K_PUBLISHED] + published_span - in[R_PUBLISHED];
    f->by_state[OUTBOX_STATE_DEAD] = own[K_DEAD];
    f->due = new_rows + own[K_STRAY] + own[K_DUE];
    f->leases_live = own[K_LIVE] + leased_span[1] - in[R_LIVE];

    f->oldest_due_at = -1;
    rc = prepare_now(db, OUTBOX__SQL_OLDEST_DUE, now, &st);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (sqlite3_column_type(st, 0) != SQLITE_NULL && sqlite3_column_int64(st, 0) <= now)
            f->oldest_due_at = sqlite3_column_int64(st, 0);
        rc = SQLITE_DONE;
    }
    sqlite3_finalize(st);
    return rc;
}

int outbox__figures_read(sqlite3 *db, int64_t now, outbox__figures *f)
{
    int own_txn = sqlite3_get_autocommit(db), rc;
    memset(f, 0, sizeof *f);
    /* One snapshot for every statement: the parts must add up. */
    if (own_txn && (rc = sqlite3_exec(db, "BEGIN", NULL, NULL, NULL)) != SQLITE_OK)
        return outbox__sqlite_code(rc);
    rc = read_in_txn(db, now, f);
    if (own_txn)
        sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    return rc == SQLITE_DONE ? 0 : outbox__sqlite_code(rc) ? outbox__sqlite_code(rc) : OUTBOX_ESQLITE;
}

int outbox__figures_oldest(sqlite3 *db, int64_t now, char *id, size_t idlen, int64_t *created_at)
{
    sqlite3_stmt *st = NULL;
    int rc = prepare_now(db, SQL_OLDEST, now, &st), found = 0;
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char *s = sqlite3_column_text(st, 0);
        outbox__strlcpy(id, s ? (const char *)s : "", idlen);
        *created_at = sqlite3_column_int64(st, 1);
        found = 1;
        rc = SQLITE_DONE;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return outbox__sqlite_code(rc) ? outbox__sqlite_code(rc) : OUTBOX_ESQLITE;
    return found;
}
