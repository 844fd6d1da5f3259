/*
 * sql.h: the SQL the relay runs, in one place (db.c prepares it). outbox-bench's
 * SQL floor (tools/bench/sqlpath.c) runs the claim's and the published mark's
 * text too, so that the floor always measures what the relay executes.
 * Column lists are what the relay's readers expect (add_cand in claim.c,
 * outbox__encode_row in encode.c). States are literals (see
 * OUTBOX_STATE_* in outbox/schema.h): partial indexes need them spelled.
 */
#ifndef OUTBOX_RELAY_SQL_H
#define OUTBOX_RELAY_SQL_H

#include "store/state_sql.h"

/* The walk of new rows from the cursor: ?1 limit, ?2 new_from. The first
 * six columns as add_cand reads them, then what a row to send has besides
 * (the claim encodes a chosen new row from the walk, see walk_cols in
 * claim.c: a new batch's rows are not read again). */
#define OUTBOX__SQL_NEW                                                                                               \
    "SELECT seq, topic, key, lease_token, available_at, created_at, id, payload, headers, attempts, replay_count "    \
    "FROM outbox "                                                                                                    \
    "WHERE seq >= ?2 AND state = 0 AND available_at <= created_at ORDER BY seq LIMIT ?1"
#define OUTBOX__SQL_CURSOR "SELECT (SELECT new_from FROM outbox_cursor), " OUTBOX__SQL_LAST_HI
/* An upsert: a cursor row deleted by hand comes back (the walk that follows
 * its loss starts at the first row). */
#define OUTBOX__SQL_CURSOR_SET                                                                                        \
    "INSERT INTO outbox_cursor(one, new_from) VALUES (1, ?1) "                                                       \
    "ON CONFLICT(one) DO UPDATE SET new_from = excluded.new_from"
/* Rows made pending again by hand (outbox_stray) become waiting rows. */
#define OUTBOX__SQL_STRAY                                                                                             \
    "UPDATE outbox SET available_at = created_at + 1 "                                                               \
    "WHERE state = 0 AND available_at <= created_at AND lease_token > 0"
/* Waiting rows due by ?1, ?2 at most. */
#define OUTBOX__SQL_DUE                                                                                               \
    "SELECT seq, topic, key, lease_token, available_at, created_at FROM outbox "                                     \
    "WHERE state = 0 AND available_at > created_at AND available_at <= ?1 "                                          \
    "ORDER BY available_at, seq LIMIT ?2"
/* The rows of the partial index outbox_key (leased or waiting keyed rows),
 * its WHERE as proto/schema.sql has it: SQLite uses a partial index only for
 * a query that repeats its condition. */
#define OUTBOX__SQL_IN_KEY_INDEX "key IS NOT NULL AND (state = 1 OR (state = 0 AND available_at > created_at))"
/* The newest leased or waiting row of a key (?1 topic, ?2 key) before ?3
 * (outbox_key). */
#define OUTBOX__SQL_KEY_PREV                                                                                          \
    "SELECT seq, state, lease_owner, lease_token, available_at FROM outbox "                                         \
    "WHERE topic = ?1 AND key = ?2 AND " OUTBOX__SQL_IN_KEY_INDEX " AND seq < ?3 ORDER BY seq DESC LIMIT 1"
/* Whether outbox_key holds any row: while it holds none,
 * OUTBOX__SQL_KEY_PREV finds nothing for any key, and a claim runs this once
 * instead of that once per keyed row. */
#define OUTBOX__SQL_KEY_ANY "SELECT 1 FROM outbox WHERE " OUTBOX__SQL_IN_KEY_INDEX " LIMIT 1"
/* The claim of the chosen rows: ?1 owner, ?2 lease expiry, ?3 their seqs
 * as a JSON array, ?4 now (an expired lease may be taken over). */
#define OUTBOX__SQL_CLAIM                                                                                             \
    "UPDATE outbox SET state = 1, lease_owner = ?1, lease_token = lease_token + 1, "                                 \
    "lease_until = ?2, attempts = attempts + 1 "                                                                     \
    "WHERE seq IN (SELECT value FROM json_each(?3)) AND (state = 0 OR (state = 1 AND lease_until <= ?4)) "           \
    "RETURNING seq, id, topic, key, payload, headers, created_at, lease_token, attempts, replay_count"
/* The fenced published mark: ?1 seq, ?2 owner, ?3 token, ?4 now, ?5 the
 * stream entry id. */
#define OUTBOX__SQL_PUBLISHED                                                                                         \
    "UPDATE outbox SET state = 2, published_at = ?4, stream_id = ?5, lease_owner = NULL, "                           \
    "lease_until = NULL, last_error = NULL "                                                                         \
    "WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"

/* A new batch: ?1 lo, ?2 hi, ?3 owner, ?4 lease expiry. */
#define OUTBOX__SQL_BATCH_NEW                                                                                         \
    "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, attempts) VALUES (?1, ?2, 1, ?3, 1, ?4, 1)"
/* A batch's rows, as OUTBOX__SQL_CLAIM returns them: ?1 lo, ?2 hi, ?3 its
 * token, ?4 its attempts (a taken-over batch's; a new one's rows come from
 * the walk). */
#define OUTBOX__SQL_BATCH_ROWS                                                                                        \
    "SELECT seq, id, topic, key, payload, headers, created_at, ?3, attempts + ?4, replay_count FROM outbox "        \
    "WHERE seq BETWEEN ?1 AND ?2 AND " OUTBOX__SQL_BARE " ORDER BY seq"
/* A batch's rows as candidates (add_cand): ?1 lo, ?2 hi. */
#define OUTBOX__SQL_BATCH_CANDS                                                                                       \
    "SELECT seq, topic, key, lease_token, available_at, created_at FROM outbox "                                     \
    "WHERE seq BETWEEN ?1 AND ?2 AND " OUTBOX__SQL_BARE " ORDER BY seq"
/* Expired batch leases by ?1 (outbox_batch_leased), in no order: the claim
 * takes the one with the lowest range itself. With ORDER BY lo, SQLite
 * built a temporary B-tree at every claim to sort what are nearly always
 * no rows at all: about 27,000 instructions a claim (docs/BENCHMARKS.md). */
#define OUTBOX__SQL_BATCH_EXPIRED                                                                                     \
    "SELECT lo, hi, owner, token, attempts FROM outbox_batch WHERE state = 1 AND lease_until <= ?1"
/* Takeover of an expired batch lease: ?1 lo, ?2 owner, ?3 expiry, ?4 now,
 * ?5 the token it was seen with. */
#define OUTBOX__SQL_BATCH_TAKE                                                                                        \
    "UPDATE outbox_batch SET owner = ?2, token = token + 1, lease_until = ?3, attempts = attempts + 1 "              \
    "WHERE lo = ?1 AND state = 1 AND lease_until <= ?4 AND token = ?5"
/* A taken-over batch none of whose rows stayed in it. */
#define OUTBOX__SQL_BATCH_DROP "DELETE FROM outbox_batch WHERE lo = ?1 AND state = 1"
/* Leased batches (another relay's keys, see claim.c), and their keyed rows. */
#define OUTBOX__SQL_BATCH_LEASED "SELECT lo, hi, owner, token FROM outbox_batch WHERE state = 1"
#define OUTBOX__SQL_BATCH_KEYS                                                                                        \
    "SELECT seq, topic, key FROM outbox WHERE seq BETWEEN ?1 AND ?2 AND key IS NOT NULL AND " OUTBOX__SQL_BARE
/* A row leaves a taken-over batch, made to wait until ?2: ?1 seq, ?3 the
 * batch's old token, ?4 its attempts (the row's attempts so far). */
#define OUTBOX__SQL_BATCH_LEAVE                                                                                       \
    "UPDATE outbox SET available_at = max(?2, created_at + 1), lease_token = ?3, attempts = attempts + ?4 "          \
    "WHERE seq = ?1 AND " OUTBOX__SQL_BARE
/* The fenced published mark of a batch: ?1 lo, ?2 owner, ?3 token, ?4 now.
 * Its rows without a state of their own are published. */
#define OUTBOX__SQL_BATCH_PUBLISHED                                                                                   \
    "UPDATE outbox_batch SET state = 2, published_at = ?4, lease_until = NULL "                                     \
    "WHERE lo = ?1 AND state = 1 AND owner = ?2 AND token = ?3"
/* The fence of a row's mark inside a batch: the row has no state of its own
 * and its batch (?8 lo) is leased to ?2 under ?3. */
#define OUTBOX__SQL_BATCH_FENCE                                                                                       \
    "seq = ?1 AND " OUTBOX__SQL_BARE " AND EXISTS (SELECT 1 FROM outbox_batch WHERE lo = ?8 AND state = 1 "           \
    "AND owner = ?2 AND token = ?3)"
/* A row's failure inside a batch (?1 seq, ?2 owner, ?3 token, ?8 lo): ?4
 * state (pending or dead), due at ?5, ?6 last_error, ?7 attempts. It leaves
 * the batch: a state of its own, lease_token the batch's. */
#define OUTBOX__SQL_BATCH_FAILED                                                                                      \
    "UPDATE outbox SET state = ?4, available_at = max(?5, created_at + 1), last_error = ?6, attempts = ?7, "         \
    "lease_token = ?3 WHERE " OUTBOX__SQL_BATCH_FENCE
/* A row published while its batch waits for others (?1 seq, ?2 owner, ?3
 * token, ?8 lo): ?4 now, ?5 the stream entry id. It leaves the batch. */
#define OUTBOX__SQL_BATCH_ROW_PUBLISHED                                                                               \
    "UPDATE outbox SET state = 2, published_at = ?4, stream_id = ?5, attempts = ?7, lease_token = ?3 "               \
    "WHERE " OUTBOX__SQL_BATCH_FENCE
/* A row handed back from a batch (not counted: ?7 the attempts before this
 * claim), due at ?5 (?4 and ?6 are not used). */
#define OUTBOX__SQL_BATCH_RELEASE                                                                                     \
    "UPDATE outbox SET available_at = max(?5, created_at + 1), attempts = ?7, lease_token = ?3 "                     \
    "WHERE " OUTBOX__SQL_BATCH_FENCE

/* Expired leases by ?1, ?2 at most (outbox_leased). */
#define OUTBOX__SQL_EXPIRED                                                                                           \
    "SELECT seq, topic, key, lease_token, available_at, created_at FROM outbox "                                     \
    "WHERE state = 1 AND lease_until <= ?1 ORDER BY lease_until LIMIT ?2"
/* A row held back behind a row made to wait: ?1 seq due no earlier than ?2. */
#define OUTBOX__SQL_DEFER "UPDATE outbox SET available_at = ?2 WHERE seq = ?1 AND state = 0 AND available_at < ?2"
/* The fenced failure mark (?1 seq, ?2 owner, ?3 token): ?4 state (pending or
 * dead), due at ?5, ?6 last_error. A row that goes back to pending is a
 * waiting row: available_at after created_at. */
#define OUTBOX__SQL_FAILED                                                                                            \
    "UPDATE outbox SET state = ?4, available_at = max(?5, created_at + 1), last_error = ?6, lease_owner = NULL, "    \
    "lease_until = NULL WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"
/* The fenced hand-back (not the message's fault: the attempt is not
 * counted), due at ?4. */
#define OUTBOX__SQL_RELEASE                                                                                           \
    "UPDATE outbox SET state = 0, available_at = max(?4, created_at + 1), attempts = max(attempts - 1, 0), "         \
    "lease_owner = NULL, lease_until = NULL "                                                                        \
    "WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"
/* Retention: rows published on their own older than ?1, ?2 at most, oldest
 * first; batches published before ?1 (?2 at most, oldest first), each
 * deleted with its rows that have no state of their own (?1 lo, ?2 hi): the
 * record first, so that its rows lie in no batch's range when they go and
 * their seqs are no holes to keep (outbox_gone_after_delete). */
#define OUTBOX__SQL_RETENTION                                                                                         \
    "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE state = 2 "                                       \
    "AND published_at < ?1 ORDER BY published_at LIMIT ?2)"
#define OUTBOX__SQL_RETENTION_BATCHES                                                                                 \
    "SELECT lo, hi FROM outbox_batch WHERE state = 2 AND published_at < ?1 ORDER BY published_at LIMIT ?2"
#define OUTBOX__SQL_RETENTION_BATCH_ROWS "DELETE FROM outbox WHERE seq BETWEEN ?1 AND ?2 AND " OUTBOX__SQL_BARE
#define OUTBOX__SQL_RETENTION_BATCH "DELETE FROM outbox_batch WHERE lo = ?1 AND state = 2"
/* The holes (outbox_gone) below every range that can hold one: below the
 * first batch and the cursor. Those of a batch's range go with its record
 * (a trigger); these are left by rows deleted where no batch came to hold
 * their seqs. */
#define OUTBOX__SQL_RETENTION_HOLES                                                                                   \
    "DELETE FROM outbox_gone WHERE seq < coalesce((SELECT min(lo) FROM outbox_batch), 9223372036854775807) "         \
    "AND seq < coalesce((SELECT new_from FROM outbox_cursor), 0)"
/* The oldest published_at of a row published on its own or of a published
 * batch (NULL: none), from outbox_published and outbox_batch_published. */
#define OUTBOX__SQL_RETENTION_OLDEST                                                                                  \
    "SELECT min(m) FROM (SELECT min(published_at) AS m FROM outbox WHERE state = 2 "                                  \
    "UNION ALL SELECT min(published_at) FROM outbox_batch WHERE state = 2)"
/* When the next waiting row becomes due after ?1, and the next foreign lease
 * expires. */
#define OUTBOX__SQL_NEXT_DUE                                                                                          \
    "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at > created_at AND available_at > ?1"
#define OUTBOX__SQL_NEXT_LEASE                                                                                        \
    "SELECT min(coalesce((SELECT min(lease_until) FROM outbox WHERE state = 1 AND lease_until > ?1), "               \
    "9223372036854775807), coalesce((SELECT min(lease_until) FROM outbox_batch WHERE state = 1 "                    \
    "AND lease_until > ?1), 9223372036854775807))"
/* Whether a lease expired by ?1 (its holder died or stalled): work for any
 * relay, through outbox_leased and outbox_batch_leased. */
#define OUTBOX__SQL_EXPIRED_LEASE                                                                                     \
    "SELECT EXISTS (SELECT 1 FROM outbox WHERE state = 1 AND lease_until <= ?1) "                                    \
    "OR EXISTS (SELECT 1 FROM outbox_batch WHERE state = 1 AND lease_until <= ?1)"
/* What the database holds besides new rows, read before a claim while this
 * relay holds nothing, and after a unit that found no more rows: the cursor
 * (NULL if its row is gone), the row after the last batch (NULL if none),
 * whether any row is leased, waiting (due or not) or stray, whether any
 * batch is leased (each through its partial index: outbox_leased,
 * outbox_due, outbox_stray, outbox_batch_leased), the last seq, and the
 * first expiry of a batch lease after ?1 (NULL if none). When nothing but
 * new rows is there, a claim needs only the walk of new rows (claim.c,
 * simple) and a drain is over once the cursor is past the last seq; with no
 * row leased or waiting, the next thing due is a batch lease's expiry. */
#define OUTBOX__SQL_PLAN                                                                                              \
    "SELECT (SELECT new_from FROM outbox_cursor), " OUTBOX__SQL_LAST_HI ", "                                         \
    "EXISTS(SELECT 1 FROM outbox WHERE state = 1) "                                                                  \
    "OR EXISTS(SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at) "                                 \
    "OR EXISTS(SELECT 1 FROM outbox WHERE state = 0 AND available_at <= created_at AND lease_token > 0), "           \
    "EXISTS(SELECT 1 FROM outbox_batch WHERE state = 1), "                                                           \
    "(SELECT max(seq) FROM outbox), "                                                                                 \
    "(SELECT min(lease_until) FROM outbox_batch WHERE state = 1 AND lease_until > ?1)"
/* Drain mode: what is left to do by ?1, each count stopping at ?2 rows (-1:
 * no limit): rows due (new rows, stray rows, due waiting rows), rows waiting
 * for a retry (claimed before: lease_token > 0, pending, not due yet), and
 * leased rows and batches. A waiting row never claimed (lease_token 0) was written with
 * a later available_at, or was held back behind an earlier row of its key
 * (then due no later than that row's retry, which is counted): delayed
 * messages do not hold a drain. Each part repeats the WHERE of its partial
 * index (outbox_stray, outbox_due, outbox_leased). */
#define OUTBOX__SQL_DRAIN                                                                                             \
    "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE seq >= " OUTBOX__SQL_NEW_FROM                         \
    " AND state = 0 AND available_at <= created_at "                                                                 \
    "AND lease_token = 0 LIMIT ?2)) "                                                                                \
    "+ (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at <= created_at "                  \
    "AND lease_token > 0 LIMIT ?2)) "                                                                                \
    "+ (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at "                   \
    "AND available_at <= ?1 LIMIT ?2)), "                                                                            \
    "(SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at "                     \
    "AND available_at > ?1 AND lease_token > 0 LIMIT ?2)), "                                                         \
    "(SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 1 LIMIT ?2)) "                                       \
    "+ (SELECT count(*) FROM (SELECT 1 FROM outbox_batch WHERE state = 1 LIMIT ?2))"

#endif
