/*
 * figures.h: the outbox table's figures (rows by state, due and waiting
 * rows, live leases, the oldest due pending row) without walking its rows
 * (internal). /metrics, /healthz and outbox_relay_stats_get (src/relay/ops.c),
 * outbox-replay stats and outbox-bench read them here.
 *
 * A count of rows in a seq range walks every row of it, so the figures
 * count no rows: the rows of a batch's range, or of the cursor's part of
 * the table (new_from to the last seq), are its length less its holes
 * (outbox_gone) and less its rows with a state of their own, which are
 * found through their partial indexes (outbox_due, outbox_stray,
 * outbox_leased, outbox_published, outbox_dead); the published ranges'
 * total length is kept in outbox_tally. The cost grows with the leased
 * batches, the rows with a state of their own and the holes, and with the
 * log of the table, never with the rows in batches or the new rows.
 *
 * Exact (equal to what outbox_messages derives) for every state the relay,
 * outbox-replay and deletes make. Not seen: a row that an UPDATE by hand
 * gave a lease_token of 0 or less after it was claimed, outside every
 * batch's range (no index holds it), and the holes below the cursor while
 * outbox_cursor's row is missing (deleted by hand; the relay's next claim
 * writes it again).
 */
#ifndef OUTBOX_SRC_FIGURES_H
#define OUTBOX_SRC_FIGURES_H

#include <stddef.h>
#include <stdint.h>

#include <sqlite3.h>

#include "outbox/schema.h"

typedef struct outbox__figures {
    /* Rows by state, as outbox_messages derives it (OUTBOX_STATE_*). */
    int64_t by_state[OUTBOX_STATE_COUNT];
    /* Pending rows due at `now`: new rows (the relay claims them whatever
     * their available_at), rows made pending again by hand (outbox_stray)
     * and waiting rows whose available_at has come. The rest of the pending
     * rows wait for a later available_at. */
    int64_t due;
    /* Sending rows whose lease (their own or their batch's) ends after
     * `now`; the others' leases have expired. */
    int64_t leases_live;
    /* available_at of the oldest due pending row (the first new row, or
     * the first due waiting row, whichever is older); -1 when none is due. */
    int64_t oldest_due_at;
} outbox__figures;

/* Reads the figures of db's outbox at `now` (unix ms), in one read
 * transaction (its own, unless db is inside one). Returns 0, or an
 * OUTBOX_E* code with the reason in sqlite3_errmsg(db). */
int outbox__figures_read(sqlite3 *db, int64_t now, outbox__figures *f);

/* The oldest due pending row by created_at (outbox-replay stats): among the
 * new rows the first committed (a later commit whose writer read the clock
 * first may have a created_at a few ms earlier), and the earliest created
 * of the due waiting rows and of the rows made pending again by hand.
 * Returns 1 with its id (a copy, NUL-terminated, cut at idlen - 1 bytes)
 * and created_at, 0 when no row is due, or an OUTBOX_E* code. */
int outbox__figures_oldest(sqlite3 *db, int64_t now, char *id, size_t idlen, int64_t *created_at);

/* Every statement the two functions run, for the test that checks that
 * none walks the outbox table or the batch records. */
extern const char *const outbox__figures_sql[];
extern const size_t outbox__figures_nsql;

#endif
