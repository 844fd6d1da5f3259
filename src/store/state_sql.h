/*
 * state_sql.h: the SQL fragments that say where a row's state comes from
 * (internal), for every reader that derives it from the schema itself
 * rather than through the outbox_messages view: the relay's claims and
 * marks (relay/sql.h) and the figures (figures.c). They follow
 * proto/schema.sql's rules, and live here, beside the schema, so that the
 * store never reads the relay's SQL. States are literals: partial indexes
 * need them spelled.
 */
#ifndef OUTBOX_SRC_STORE_STATE_SQL_H
#define OUTBOX_SRC_STORE_STATE_SQL_H

/* Where the walk starts: the cursor, and never before the end of the last
 * batch's range (whose rows as written are not new). The cursor's row, NULL
 * when it was deleted by hand, is written again by the claim. */
#define OUTBOX__SQL_LAST_HI "(SELECT hi + 1 FROM outbox_batch WHERE lo = (SELECT max(lo) FROM outbox_batch))"
#define OUTBOX__SQL_NEW_FROM                                                                                          \
    "max(coalesce((SELECT new_from FROM outbox_cursor), 0), coalesce(" OUTBOX__SQL_LAST_HI ", 0))"

/*
 * Batch leases (outbox_batch). A row "as written" (state 0, available_at not
 * after created_at, lease_token 0) inside a batch's range has its batch's
 * state; every other row has its own (proto/schema.md, "Batch leases").
 */
#define OUTBOX__SQL_BARE "state = 0 AND available_at <= created_at AND lease_token = 0"

/* The available_at of the oldest due pending row by ?1 (the older of the
 * first new row and the first due waiting row: both found through indexes,
 * never a scan of all pending rows), one of the database figures of
 * /metrics (src/store/figures.c has the others). */
#define OUTBOX__SQL_OLDEST_DUE                                                                                        \
    "WITH h(a, b) AS (SELECT (SELECT available_at FROM outbox WHERE seq >= " OUTBOX__SQL_NEW_FROM " AND state = 0 " \
    "AND available_at <= created_at ORDER BY seq LIMIT 1), (SELECT min(available_at) "                               \
    "FROM outbox WHERE state = 0 AND available_at > created_at AND available_at <= ?1)) "                            \
    "SELECT min(coalesce(a, b), coalesce(b, a)) FROM h"

#endif
