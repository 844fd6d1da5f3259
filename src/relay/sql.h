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

/* The walk of new rows from the cursor: ?1 limit, ?2 new_from. */
#define OUTBOX__SQL_NEW                                                                                               \
    "SELECT seq, topic, key, lease_token, available_at, created_at FROM outbox "                                     \
    "WHERE seq >= ?2 AND state = 0 AND available_at <= created_at ORDER BY seq LIMIT ?1"
#define OUTBOX__SQL_CURSOR "SELECT new_from FROM outbox_cursor"
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
/* The newest leased or waiting row of a key (?1 topic, ?2 key) before ?3
 * (outbox_key). */
#define OUTBOX__SQL_KEY_PREV                                                                                          \
    "SELECT seq, state, lease_owner, lease_token, available_at FROM outbox "                                         \
    "WHERE topic = ?1 AND key = ?2 AND key IS NOT NULL "                                                             \
    "AND (state = 1 OR (state = 0 AND available_at > created_at)) AND seq < ?3 "                                     \
    "ORDER BY seq DESC LIMIT 1"
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
/* Retention: published rows older than ?1, ?2 at most, oldest first. */
#define OUTBOX__SQL_RETENTION                                                                                         \
    "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE state = 2 "                                       \
    "AND published_at < ?1 ORDER BY published_at LIMIT ?2)"
/* When the next waiting row becomes due after ?1, and the next foreign lease
 * expires. */
#define OUTBOX__SQL_NEXT_DUE                                                                                          \
    "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at > created_at AND available_at > ?1"
#define OUTBOX__SQL_NEXT_LEASE "SELECT min(lease_until) FROM outbox WHERE state = 1 AND lease_until > ?1"
/* Drain mode: what is left to do by ?1, each count stopping at ?2 rows (-1:
 * no limit): rows due (new rows, stray rows, due waiting rows), rows waiting
 * for a retry (claimed before: lease_token > 0, pending, not due yet), and
 * leased rows. A waiting row never claimed (lease_token 0) was written with
 * a later available_at, or was held back behind an earlier row of its key
 * (then due no later than that row's retry, which is counted): delayed
 * messages do not hold a drain. Each part repeats the WHERE of its partial
 * index (outbox_stray, outbox_due, outbox_leased). */
#define OUTBOX__SQL_DRAIN                                                                                             \
    "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE seq >= "                                               \
    "coalesce((SELECT new_from FROM outbox_cursor), 0) AND state = 0 AND available_at <= created_at "                \
    "AND lease_token = 0 LIMIT ?2)) "                                                                                \
    "+ (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at <= created_at "                  \
    "AND lease_token > 0 LIMIT ?2)) "                                                                                \
    "+ (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at "                   \
    "AND available_at <= ?1 LIMIT ?2)), "                                                                            \
    "(SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at "                     \
    "AND available_at > ?1 AND lease_token > 0 LIMIT ?2)), "                                                         \
    "(SELECT count(*) FROM (SELECT 1 FROM outbox WHERE state = 1 LIMIT ?2))"
/* The database figures of /metrics and outbox_relay_stats_get: rows by
 * state, and the available_at of the oldest due pending row by ?1 (the
 * older of the first new row and the first due waiting row: both found
 * through indexes, never a scan of all pending rows). */
#define OUTBOX__SQL_STATE_COUNTS "SELECT state, count(*) FROM outbox GROUP BY state"
#define OUTBOX__SQL_OLDEST_DUE                                                                                        \
    "WITH h(a, b) AS (SELECT (SELECT available_at FROM outbox WHERE seq >= "                                         \
    "coalesce((SELECT new_from FROM outbox_cursor), 0) AND state = 0 "                                               \
    "AND available_at <= created_at ORDER BY seq LIMIT 1), (SELECT min(available_at) "                               \
    "FROM outbox WHERE state = 0 AND available_at > created_at AND available_at <= ?1)) "                            \
    "SELECT min(coalesce(a, b), coalesce(b, a)) FROM h"

#endif
