/*
 * The SQL of the relay's claim and of its published mark: src/relay.c runs
 * them, and outbox-bench's SQL floor (tools/bench/sqlpath.c) runs the same
 * text, so that the floor always measures what the relay executes. Column
 * lists are what the relay's readers expect (see add_cand and take_row).
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

#endif
