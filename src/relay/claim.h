/*
 * claim.h: the claim's candidates and decisions (internal to the relay;
 * claim.c, and the unit tests of its decisions).
 */
#ifndef OUTBOX_SRC_RELAY_CLAIM_H
#define OUTBOX_SRC_RELAY_CLAIM_H

#include "relay_int.h"

/* Where a candidate came from: an expired lease of its own (outbox_leased),
 * a row of an expired batch lease taken over (outbox_batch_leased), a due
 * waiting row (outbox_due) or the walk of new rows from the cursor. Rows of
 * the walk and of a taken-over batch are claimed in a batch lease; the
 * others each under a lease of their own. */
enum cand_source { S_EXPIRED, S_TAKEN, S_WAITING, S_NEW };
/* What the claim did with it: only looked, chose it, dead-lettered it
 * (invalid row), or handed it back (its predecessor was not claimed). */
enum cand_fate { C_SEEN, C_CHOSEN, C_DEAD, C_RELEASED };

/* A row the claim looked at. */
struct cand {
    int64_t seq;
    const char *topic, *key; /* in the claim's arena */
    size_t klen;
    uint64_t khash;     /* outbox__key_hash of topic and key (keyed rows) */
    int64_t token;      /* lease_token: 0 = never claimed */
    int64_t available_at, created_at;
    enum cand_source source;
    int prev;     /* index of its key predecessor chosen in this batch, or -1 */
    msg *after;   /* or the message of an earlier batch it goes after */
    msg *m;       /* the claimed message */
    msg *eff_after; /* what it ended up behind (for a successor of a dead row) */
    int eff_in_batch; /* eff_after was claimed in this batch */
    int deferred;     /* defer gave it a later available_at */
    enum cand_fate fate;
};

/* Strings copied for the length of one claim. */
struct chunk {
    struct chunk *next;
    size_t used, cap;
    char data[];
};

/* A key of another relay's batch lease (or one nobody holds any more): the
 * lowest seq of its rows there (see foreign_keys in claim.c). */
struct fkey {
    uint64_t hash;
    const char *topic, *key; /* in the claim's arena */
    size_t klen;
    int64_t seq;
};

/* Per key, in one claim: its newest row chosen and its held rows. */
struct bslot {
    unsigned gen;     /* the claim that uses it (claim_ctx.gen); any other: an empty slot */
    int first;        /* index of the key's first row seen */
    int last_chosen;  /* index of its newest row chosen, or -1 */
    int64_t held_min; /* the lowest seq of its rows held back, INT64_MAX if none */
    int64_t wait_until; /* its held rows were made due no earlier than this (see defer), or 0 */
};

typedef struct claim_ctx {
    outbox_relay *r;
    int64_t now;
    unsigned want;
    cand *cs;
    size_t n, cap;
    int *chosen;
    size_t nchosen;
    int64_t new_from; /* outbox_cursor: no new row before this seq */
    int cursor_missing; /* its row was deleted (by hand): written again */
    int64_t new_pos;  /* every new row before this seq was seen (INT64_MAX: all of them) */
    int64_t *defer;   /* (seq, available_at) pairs: rows to make due later (see defer) */
    size_t ndefer;
    bslot *slots;
    size_t scap;
    unsigned gen;
    /* The expired batch lease this claim takes over (taken: its rows were
     * walked), its range, the token and attempts it had. */
    int taken;
    int64_t t_lo, t_hi, t_token, t_attempts;
    /* Keys of the other leased batches, loaded at the first keyed row
     * (fk_loaded), in an open-addressing table of fk_cap slots. */
    int fk_loaded;
    struct fkey *fk;
    size_t fk_cap, fk_len;
    /* Whether outbox_key holds a row (OUTBOX__SQL_KEY_ANY), looked up at the
     * first keyed row that needs it: KEYS_UNKNOWN, KEYS_NONE, KEYS_SOME. */
    int key_rows;
    int encode; /* the new rows chosen get their messages (outbox__claim) */
    /* Nothing but new rows in the database and nothing held by this relay
     * (OUTBOX__SQL_PLAN): only the walk of new rows, and a keyed row waits
     * for nothing but the rows of its key before it in this batch. top is
     * the last seq then (0: none). */
    int simple;
    int64_t top;
} claim_ctx;

enum { KEYS_UNKNOWN, KEYS_NONE, KEYS_SOME };

/* OUTBOX__SQL_PLAN's answer. */
typedef struct claim_plan {
    int cursor_null;               /* the cursor's row is gone */
    int64_t new_from;              /* where the walk of new rows starts (the cursor, or after the last batch) */
    int rows_busy;                 /* a row leased, waiting or stray */
    int batches_leased;            /* a batch leased (ours or another relay's) */
    int64_t top;                   /* the last seq, 0 if none */
    int new_left;                  /* a row from the cursor on (new, unless written oddly: see check_drained) */
    int64_t next_lease;            /* the first batch lease to expire after now, INT64_MAX if none */
} claim_plan;
/* Reads the plan on the relay's connection (in a unit's transaction, or on
 * its own) as of now (unix ms). 0 or OUTBOX_E*. */
int outbox__claim_plan(outbox_relay *r, int64_t now, claim_plan *p);

/* ---- claim_batch.c ---- */

/* The claim's arena: strings copied for the length of one claim. */
const char *outbox__claim_arena_dup(chunk **a, const char *s, size_t len);
void outbox__claim_arena_free(chunk *a);
void outbox__claim_arena_reset(chunk **a); /* empties it, keeping its first chunk */
/* The lowest seq of c's key among the rows of the batch leases this relay
 * does not hold (loaded at the first call of a claim), INT64_MAX if none.
 * 0 or OUTBOX_E*. */
int outbox__claim_foreign_min(claim_ctx *x, const cand *c, int64_t *seq);
/* The oldest expired batch lease this relay does not hold, if any, into x
 * (taken, t_lo, t_hi, t_token, t_attempts); *nrows its rows as written.
 * 0 or OUTBOX_E*. */
int outbox__claim_find_taken(claim_ctx *x, int64_t *nrows);

/*
 * Chooses up to `want` rows inside the open transaction, without claiming
 * them: walks expired leases, due waiting rows and new rows (outbox_cursor),
 * decides each one (per-key order, see decide in claim.c), writes the later
 * due times of the rows it made wait and moves the cursor. x->chosen lists
 * the chosen candidates' indexes in x->cs, in the order chosen. x is set up
 * from r->cw (outbox__claim_arrays first); no messages are made (the claim,
 * outbox__claim, makes the new rows' ones during the walk). Worker thread.
 * Returns 0 or an OUTBOX_E* code (the transaction must then be rolled back).
 */
int outbox__claim_select(claim_ctx *x, outbox_relay *r, unsigned want, int64_t now);
/* The same, and with encode the new rows chosen get their messages
 * (c->m), as outbox__claim (claim_write.c) needs them. */
int outbox__claim_choose(claim_ctx *x, outbox_relay *r, unsigned want, int64_t now, int encode);

/* Makes r->cw hold cap candidates and starts a new generation of key slots.
 * 0 or OUTBOX_ENOMEM. */
int outbox__claim_arrays(outbox_relay *r, size_t cap);

/* Frees what r->cw holds (destroy). */
void outbox__claim_free(outbox_relay *r);

#endif
