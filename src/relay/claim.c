/*
 * claim.c: choosing rows and claiming them under a lease, inside a unit's
 * transaction (the unit's worker thread). Cost depends on the batch, not on
 * the backlog: the walks read indexes in order and stop at a bound. The
 * parts that only batch leases need (another relay's batch keys, finding an
 * expired batch to take over) and the claim's arena are in claim_batch.c;
 * claiming the rows chosen, and their messages, in claim_write.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "claim.h"

static bslot *bslot_find(claim_ctx *x, const cand *c)
{
    size_t i = (size_t)c->khash & (x->scap - 1);
    while (x->slots[i].gen == x->gen) {
        const cand *o = &x->cs[x->slots[i].first];
        if (o->khash == c->khash && outbox__same_key(o->topic, o->key, o->klen, c->topic, c->key, c->klen))
            return &x->slots[i];
        i = (i + 1) & (x->scap - 1);
    }
    return &x->slots[i];
}

/* Adds a row as a candidate (its strings copied into the claim's arena). */
static int add_cand_row(claim_ctx *x, const outbox__row *v, enum cand_source source)
{
    cand *c;
    if (x->n == x->cap || !v->topic)
        return OUTBOX_ENOMEM; /* sized for the most a claim looks at; a NULL topic: a failed conversion */
    c = &x->cs[x->n];
    memset(c, 0, sizeof *c);
    c->seq = v->seq;
    c->topic = outbox__claim_arena_dup(&x->r->cw.arena, v->topic, v->tl);
    c->key = v->key ? outbox__claim_arena_dup(&x->r->cw.arena, v->key, v->klen) : NULL;
    c->klen = v->klen;
    /* Hashed once here: the batch's key slots, the key map (here and on
     * the loop, m->km_hash) and the other relays' keys all use it. */
    if (c->key)
        c->khash = outbox__key_hash(c->topic, c->key, c->klen);
    c->token = v->token;
    c->available_at = v->available_at;
    c->created_at = v->created_at;
    c->source = source;
    c->prev = -1;
    if (!c->topic || (v->key && !c->key))
        return OUTBOX_ENOMEM;
    x->n++;
    return 0;
}

/* Adds the current row of st (seq, topic, key, lease_token, available_at,
 * created_at) as a candidate. */
static int add_cand(claim_ctx *x, sqlite3_stmt *st, enum cand_source source)
{
    outbox__row v;
    v.topic = (const char *)sqlite3_column_text(st, 1);
    v.tl = (size_t)sqlite3_column_bytes(st, 1);
    v.key = sqlite3_column_type(st, 2) == SQLITE_NULL ? NULL : (const char *)sqlite3_column_text(st, 2);
    v.klen = v.key ? (size_t)sqlite3_column_bytes(st, 2) : 0;
    v.seq = sqlite3_column_int64(st, 0);
    v.token = sqlite3_column_int64(st, 3);
    v.available_at = sqlite3_column_int64(st, 4);
    v.created_at = sqlite3_column_int64(st, 5);
    return add_cand_row(x, &v, source);
}

/* bs: the candidate's key slot (NULL for a row without a key). */
static void choose(claim_ctx *x, int idx, int prev, msg *after, bslot *bs)
{
    cand *c = &x->cs[idx];
    c->prev = prev;
    c->after = after;
    c->fate = C_CHOSEN;
    x->chosen[x->nchosen++] = idx;
    if (bs)
        bs->last_chosen = idx;
}

/* A pending row held back by a row made to wait becomes due no earlier than
 * it (`at`): a new row leaves the new rows for the waiting rows (available_at
 * after its created_at), and a waiting row moves behind it in outbox_due.
 * Otherwise the walks would meet such rows again and again, and a long run
 * of them would keep the walk of outbox_due from ever reaching the row they
 * wait for. A new row held back for another reason is made a waiting row
 * due at once (`at` 0): the walk of new rows never comes back to a row it
 * has seen (see scan_pending). Written after the walks (see claim). */
static void defer(claim_ctx *x, cand *c, bslot *bs, int64_t at)
{
    if (c->source == S_EXPIRED)
        return;
    if ((c->source == S_NEW || c->source == S_TAKEN) && at <= c->created_at)
        at = c->created_at + 1;
    if (bs && at > bs->wait_until)
        bs->wait_until = at; /* its later rows wait as long */
    if (at <= c->available_at)
        return;
    c->deferred = 1;
    x->defer[2 * x->ndefer] = c->seq;
    x->defer[2 * x->ndefer + 1] = at;
    x->ndefer++;
}

/* What decide says of a keyed row. */
enum decision {
    D_FREE,      /* no unfinished earlier row of its key: it may go */
    D_IN_BATCH,  /* behind its key's row chosen earlier in this batch: sent after it */
    D_AFTER,     /* behind this relay's own message still on its way: chained to it */
    D_HELD_OURS, /* behind this relay's own message, which it cannot chain to: waits */
    D_HELD,      /* behind another relay's lease, a failing or waiting row: waits */
};

/*
 * Per-key order: a keyed row may go when every earlier row of its key is
 * published or dead, or was chosen earlier in this batch (it is sent after
 * it), or is this relay's own message still on its way (it is chained
 * behind it). Otherwise it waits. The earlier unfinished rows of a key are
 * found in two places:
 * - New rows are walked in seq order, so those before a new
 *   row were seen earlier in this claim (its bslot). A row claimed before
 *   (lease_token > 0) has no new row before it: it was claimed after them,
 *   and every row that goes back to pending becomes a waiting row. A waiting
 *   row never claimed (written with a later available_at, or a new row made
 *   to wait by defer) goes only when the walk of new rows has already seen
 *   every new row older than it, so its bslot knows those of its key.
 * - Leased and waiting rows are in outbox_key; the newest one before the row
 *   is looked up.
 * Unfinished rows of a key always form its tail, because a row is never
 * sent before its predecessor is appended, so the newest unfinished
 * predecessor decides. A row requeued by outbox-replay is the exception: it
 * goes before its key's rows still pending, after those already published.
 */
static enum decision decide(claim_ctx *x, cand *c, bslot *bs, int *prev, msg **after, int *rc)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *st = NULL; /* prepared only when looked up (a group's relay prepares when first used) */
    int64_t pseq, pstate = 0, ptoken = 0, pavail = 0, fseq;
    int mine = 0, lc = bs->last_chosen;
    msg *km;
    enum decision d = D_HELD;
    int step;

    *prev = -1;
    *after = NULL;

    *rc = 0;
    if (bs->held_min < c->seq) {
        if (bs->wait_until)
            defer(x, c, bs, bs->wait_until);
        return D_HELD;
    }
    if (c->source == S_WAITING && c->token == 0 && x->new_pos <= c->seq)
        return D_HELD;
    if (lc >= 0 && x->cs[lc].seq > c->seq)
        return D_HELD; /* cannot happen: a key's rows are chosen in seq order */
    /* An earlier row of its key in a batch lease this relay does not hold. */
    *rc = outbox__claim_foreign_min(x, c, &fseq);
    if (*rc != 0 || fseq < c->seq)
        return D_HELD;
    /* This relay's own newest message of the key (a batch's rows are in no
     * index): a waiting row older than it waits for it to finish. A simple
     * claim knows that every message it still has is finished (its mark is
     * in this transaction). */
    km = x->simple ? NULL : outbox__win_key_get(r, c->khash, c->topic, c->key, c->klen);
    if (km && km->seq > c->seq && c->source != S_NEW && c->source != S_TAKEN)
        return D_HELD_OURS;
    if (km && km->seq >= c->seq)
        km = NULL; /* not before it (the same row's last claim, its mark just written) */
    if (!km && !x->simple && !r->win.keymap_cap && r->win.batches)
        return D_HELD_OURS; /* no key map (out of memory): our batches' keys are unknown */
    if (x->key_rows == KEYS_UNKNOWN) {
        int64_t any;
        *rc = outbox__relay_step_int(r, Q(r, q_key_any), 0, &any);
        if (*rc != 0)
            return D_HELD;
        x->key_rows = any ? KEYS_SOME : KEYS_NONE;
    }
    if (x->key_rows == KEYS_NONE) {
        step = SQLITE_DONE; /* no leased or waiting keyed row at all */
    } else {
        st = Q(r, q_key_prev);
        sqlite3_bind_text(st, 1, c->topic, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 2, c->key, (int)c->klen, SQLITE_STATIC);
        sqlite3_bind_int64(st, 3, c->seq);
        step = sqlite3_step(st);
    }
    if (step != SQLITE_ROW) {
        sqlite3_reset(st);
        if (step != SQLITE_DONE) {
            *rc = outbox__relay_sqlerr(r, step);
            return D_HELD;
        }
        pseq = -1;
    } else {
        pseq = sqlite3_column_int64(st, 0);
        pstate = sqlite3_column_int64(st, 1);
        mine = sqlite3_column_type(st, 2) == SQLITE_TEXT &&
               strcmp((const char *)sqlite3_column_text(st, 2), r->cfg.worker_id) == 0;
        ptoken = sqlite3_column_int64(st, 3);
        pavail = sqlite3_column_int64(st, 4);
        sqlite3_reset(st);
    }
    if (pseq < 0 && !km) {
        *prev = lc;
        return lc >= 0 ? D_IN_BATCH : D_FREE;
    }
    if (lc >= 0 && x->cs[lc].seq >= pseq && (!km || x->cs[lc].seq >= km->seq)) {
        *prev = lc;
        return D_IN_BATCH;
    }
    if (km && km->seq > pseq) {
        /* Behind this relay's own message, of a batch or not: chained to
         * it (settle_chain decides once the claim is back). */
        *after = km;
        return D_AFTER;
    }
    if (pstate == OUTBOX_STATE_SENDING && mine && outbox__win_seq_has(r, pseq)) {
        msg *m = outbox__win_key_get(r, c->khash, c->topic, c->key, c->klen);
        d = D_HELD_OURS;
        /* Its state changes on the loop thread meanwhile: only the chain is
         * decided here, unit_done settles it (settle_chain). */
        if (m && m->seq == pseq && m->token == ptoken) {
            *after = m;
            d = D_AFTER;
        }
    } else if (pstate == OUTBOX_STATE_PENDING) {
        /* Behind a row made to wait: wait as long. */
        defer(x, c, bs, pavail);
    }
    return d;
}

/* Decides one candidate just added and chooses it if it may go. */
static int consider(claim_ctx *x, int idx)
{
    cand *c = &x->cs[idx];
    int prev = -1, rc = 0;
    msg *after = NULL;
    enum decision d = D_FREE;
    bslot *bs = NULL;

    if (c->klen) {
        bs = bslot_find(x, c);
        if (bs->gen != x->gen) {
            bs->gen = x->gen;
            bs->first = idx;
            bs->last_chosen = -1;
            bs->held_min = INT64_MAX;
            bs->wait_until = 0;
        }
    }
    if (c->source == S_NEW && c->available_at > x->now) {
        /* Not due (its created_at is in the future): a waiting row. */
        defer(x, c, bs, c->available_at);
        d = D_HELD;
    } else if (bs) {
        d = decide(x, c, bs, &prev, &after, &rc);
        if (rc != 0)
            return rc;
    }
    if (d == D_HELD_OURS || d == D_HELD) {
        if (bs && c->seq < bs->held_min)
            bs->held_min = c->seq;
        if ((c->source == S_NEW || c->source == S_TAKEN) && !c->deferred)
            defer(x, c, NULL, 0);
        return 0;
    }
    choose(x, idx, prev, after, bs);
    return 0;
}

/* Moves outbox_cursor past the new rows the walk saw (see scan_pending). */
static int move_cursor(claim_ctx *x)
{
    outbox_relay *r = x->r;
    int64_t to = x->new_pos, top;
    int rc;
    if (to == INT64_MAX) {
        /* Every new row seen: the next one comes after the last row. */
        if (x->simple) {
            top = x->top;
        } else {
            rc = outbox__relay_step_int(r, Q(r, q_top), 0, &top);
            if (rc != 0)
                return rc;
        }
        to = top + 1;
    }
    if (to <= x->new_from && !x->cursor_missing)
        return 0;
    if (to < x->new_from)
        to = x->new_from;
    sqlite3_bind_int64(Q(r, q_cursor_set), 1, to);
    return outbox__relay_step_done(r, Q(r, q_cursor_set));
}

/* Steps q_expired and considers each row until the batch is full; our own
 * leases (still in flight) are skipped. */
static int scan_expired(claim_ctx *x)
{
    sqlite3_stmt *st = Q(x->r, q_expired);
    int step = SQLITE_DONE, e = 0;
    sqlite3_bind_int64(st, 1, x->now);
    sqlite3_bind_int64(st, 2, x->want);
    while (x->nchosen < x->want && (step = sqlite3_step(st)) == SQLITE_ROW) {
        if (outbox__win_seq_has(x->r, sqlite3_column_int64(st, 0)))
            continue;
        e = add_cand(x, st, S_EXPIRED);
        if (e == 0)
            e = consider(x, (int)x->n - 1);
        if (e != 0)
            break;
    }
    sqlite3_reset(st);
    if (e == 0 && step != SQLITE_ROW && step != SQLITE_DONE)
        e = outbox__relay_sqlerr(x->r, step);
    return e;
}

/* Walks the rows of the expired batch lease find_taken chose, in seq order:
 * each one is chosen (it stays in the batch, which this claim takes over) or
 * leaves it as a waiting row (defer), even past `want`: no row of a batch
 * this relay holds may be one it does not know of. */
static int scan_taken(claim_ctx *x)
{
    sqlite3_stmt *st = Q(x->r, q_batch_cands);
    int step = SQLITE_DONE, e = 0;
    if (!x->taken)
        return 0;
    sqlite3_bind_int64(st, 1, x->t_lo);
    sqlite3_bind_int64(st, 2, x->t_hi);
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        e = add_cand(x, st, S_TAKEN);
        if (e == 0) {
            if (x->nchosen < x->want)
                e = consider(x, (int)x->n - 1);
            else
                defer(x, &x->cs[x->n - 1], NULL, 0);
        }
        if (e != 0)
            break;
    }
    sqlite3_reset(st);
    if (e == 0 && step != SQLITE_ROW && step != SQLITE_DONE)
        e = outbox__relay_sqlerr(x->r, step);
    return e;
}

/* Where OUTBOX__SQL_NEW has a row's columns (its lease_token and attempts
 * before the claim). */
static const outbox__row_cols walk_cols = {.seq = 0, .id = 6, .topic = 1, .key = 2, .payload = 7, .headers = 8,
                                           .created_at = 5, .token = 3, .attempts = 9, .replay_count = 10,
                                           .available_at = 4};

/* A new row chosen: its message, from the walk's row. It goes in the new
 * batch lease, token 1 and one attempt more (OUTBOX__SQL_BATCH_NEW), which
 * claim_chosen writes once the walks are done; under the write lock the
 * row stays as the walk read it. */
static int encode_new(claim_ctx *x, const outbox__row *v, cand *c)
{
    msg *m;
    int e = outbox__encode(x->r, v, &m);
    if (m) {
        m->km_hash = c->khash;
        m->token = 1;
        m->attempts++;
        c->m = m;
    }
    return e;
}

/* Where the walk of new rows starts, from a row whose first two columns
 * are the cursor (NULL when its row is gone: *missing) and the row after
 * the last batch (NULL when there is none): OUTBOX__SQL_CURSOR,
 * OUTBOX__SQL_PLAN. */
static int64_t new_from_of(sqlite3_stmt *st, int *missing)
{
    int64_t cursor = sqlite3_column_int64(st, 0), after_batches = sqlite3_column_int64(st, 1); /* 0 when NULL */
    *missing = sqlite3_column_type(st, 0) == SQLITE_NULL;
    return after_batches > cursor ? after_batches : cursor;
}

int outbox__claim_plan(outbox_relay *r, int64_t now, claim_plan *p)
{
    sqlite3_stmt *st = Q(r, q_plan);
    int rc;
    sqlite3_bind_int64(st, 1, now);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        p->new_from = new_from_of(st, &p->cursor_null);
        p->rows_busy = sqlite3_column_int(st, 2) != 0;
        p->batches_leased = sqlite3_column_int(st, 3) != 0;
        p->top = sqlite3_column_int64(st, 4);
        p->next_lease = sqlite3_column_type(st, 5) == SQLITE_NULL ? INT64_MAX : sqlite3_column_int64(st, 5);
        p->new_left = p->top >= p->new_from;
    }
    sqlite3_reset(st);
    return rc == SQLITE_ROW ? 0 : outbox__relay_sqlerr(r, rc);
}

/*
 * Walks the waiting rows that are due (outbox_due) and the new rows (the
 * table from outbox_cursor.new_from) together, oldest available_at first,
 * and considers each row until the batch is full. Each walk looks further
 * than `want`, so that rows held back by their key do not starve the rest.
 * Every new row seen is claimed or made to wait (consider, defer), so the
 * cursor moves past all of them: the next walk starts at the first new row
 * not seen, or after the last row when there was none.
 */
static int scan_pending(claim_ctx *x)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *w = x->simple ? NULL : Q(r, q_due), *n = Q(r, q_new);
    int64_t limit = (int64_t)x->want * 4, nread = 0, last = 0;
    int rw, rn, rc;
    outbox__row row;

    if (!x->simple) {
        /* (A simple claim read the cursor with the plan, and no row is
         * stray or waiting.) */
        rc = outbox__relay_step_done(r, Q(r, q_stray));
        if (rc != 0)
            return rc;
        if (sqlite3_changes(r->db.conn) > 0)
            x->key_rows = KEYS_UNKNOWN; /* they are waiting rows now, in outbox_key */
        rc = sqlite3_step(Q(r, q_cursor));
        if (rc == SQLITE_ROW)
            x->new_from = new_from_of(Q(r, q_cursor), &x->cursor_missing);
        sqlite3_reset(Q(r, q_cursor));
        if (rc != SQLITE_ROW)
            return outbox__relay_sqlerr(r, rc);
    }
    rc = 0;
    sqlite3_bind_int64(n, 1, limit);
    sqlite3_bind_int64(n, 2, x->new_from);
    rn = sqlite3_step(n);
    if (x->simple) {
        w = NULL;
        rw = SQLITE_DONE;
    } else {
        sqlite3_bind_int64(w, 1, x->now);
        sqlite3_bind_int64(w, 2, limit);
        rw = sqlite3_step(w);
    }
    x->new_pos = rn == SQLITE_ROW ? sqlite3_column_int64(n, 0) : INT64_MAX;
    while (x->nchosen < x->want && (rw == SQLITE_ROW || rn == SQLITE_ROW)) {
        int take_new = rw != SQLITE_ROW ||
                       (rn == SQLITE_ROW && (sqlite3_column_int64(n, 4) < sqlite3_column_int64(w, 4) ||
                                             (sqlite3_column_int64(n, 4) == sqlite3_column_int64(w, 4) &&
                                              sqlite3_column_int64(n, 0) < sqlite3_column_int64(w, 0))));
        if (take_new) {
            /* The walk's row is read once, for the decision and the message. */
            outbox__row_read(n, &walk_cols, &row);
            rc = add_cand_row(x, &row, S_NEW);
        } else {
            rc = add_cand(x, w, S_WAITING);
        }
        if (rc == 0)
            rc = consider(x, (int)x->n - 1);
        if (rc == 0 && take_new && x->encode && x->cs[x->n - 1].fate == C_CHOSEN)
            rc = encode_new(x, &row, &x->cs[x->n - 1]);
        if (rc != 0)
            break;
        if (take_new) {
            last = x->cs[x->n - 1].seq;
            nread++;
            rn = sqlite3_step(n);
            /* Seen so far: every new row before the next one, or all of
             * them when the walk ended before its limit. */
            x->new_pos = rn == SQLITE_ROW ? sqlite3_column_int64(n, 0) : nread < limit ? INT64_MAX : last + 1;
        } else {
            rw = sqlite3_step(w);
        }
    }
    if (rc == 0 && rw != SQLITE_ROW && rw != SQLITE_DONE)
        rc = outbox__relay_sqlerr(r, rw);
    if (rc == 0 && rn != SQLITE_ROW && rn != SQLITE_DONE)
        rc = outbox__relay_sqlerr(r, rn);
    if (w)
        sqlite3_reset(w);
    sqlite3_reset(n);
    if (rc == 0)
        rc = move_cursor(x);
    return rc;
}

/* Writes the new due times that defer collected. */
static int write_deferred(claim_ctx *x)
{
    sqlite3_stmt *st;
    size_t i;
    int rc;
    for (i = 0; i < x->ndefer; i++) {
        int64_t seq = x->defer[2 * i];
        if (x->taken && seq >= x->t_lo && seq <= x->t_hi) {
            /* A row leaving the taken-over batch keeps what that batch
             * counted: claimed before (its token), and its attempts. */
            sqlite3_stmt *l = Q(x->r, q_batch_leave);
            sqlite3_bind_int64(l, 1, seq);
            sqlite3_bind_int64(l, 2, x->defer[2 * i + 1]);
            sqlite3_bind_int64(l, 3, x->t_token);
            sqlite3_bind_int64(l, 4, x->t_attempts);
            rc = outbox__relay_step_done(x->r, l);
            if (rc != 0)
                return rc;
            if (sqlite3_changes(x->r->db.conn) > 0)
                continue;
        }
        st = Q(x->r, q_defer);
        sqlite3_bind_int64(st, 1, seq);
        sqlite3_bind_int64(st, 2, x->defer[2 * i + 1]);
        rc = outbox__relay_step_done(x->r, st);
        if (rc != 0)
            return rc;
    }
    return 0;
}


/* Arrays for cap candidates (outbox__claim_arrays), lent to x. */
static int use_arrays(claim_ctx *x, size_t cap)
{
    outbox_relay *r = x->r;
    int rc = outbox__claim_arrays(r, cap);
    if (rc != 0)
        return rc;
    x->cap = r->cw.cap;
    x->cs = r->cw.cs;
    x->chosen = r->cw.chosen;
    x->defer = r->cw.defer;
    x->slots = r->cw.slots;
    x->scap = r->cw.scap;
    x->gen = r->cw.gen;
    return 0;
}

int outbox__claim_choose(claim_ctx *x, outbox_relay *r, unsigned want, int64_t now, int encode)
{
    int64_t ntaken;
    int rc;

    memset(x, 0, sizeof *x);
    x->r = r;
    x->encode = encode;
    x->now = now;
    x->want = want;
    /* The strings of the previous claim's candidates go. */
    outbox__claim_arena_reset(&r->cw.arena);
    if (r->cw.holds_nothing) {
        /* Holding nothing, the relay asks whether anything but new rows is
         * there: if not, the walk of new rows is the whole claim, and it
         * prepares and runs a third of the statements (a database of a
         * group opens for a few rows, and preparing them was most of its
         * cost). */
        claim_plan p;
        rc = outbox__claim_plan(r, now, &p);
        if (rc != 0)
            return rc;
        if (!p.rows_busy && !p.batches_leased) {
            x->simple = 1;
            x->top = p.top;
            x->cursor_missing = p.cursor_null;
            x->new_from = p.new_from;
            x->key_rows = KEYS_NONE; /* no leased or waiting row */
            x->fk_loaded = 1;        /* no other batch leased */
            /* The walk sees the rows from the cursor to the last at most:
             * a database of a few rows gets arrays of its size, not the
             * claim's largest (a quarter of a megabyte, zeroed). */
            rc = use_arrays(x, p.top >= x->new_from && (uint64_t)(p.top - x->new_from) < (uint64_t)want * 4
                                   ? (size_t)(p.top - x->new_from) + 2
                                   : (size_t)want * 4 + 1);
            if (rc == 0)
                rc = scan_pending(x);
            if (rc == 0)
                rc = write_deferred(x);
            return rc;
        }
    }
    rc = outbox__claim_find_taken(x, &ntaken);
    if (rc != 0)
        return rc;
    /* expired (want) + a taken-over batch + waiting (4 want) + new (4 want) */
    rc = use_arrays(x, (size_t)want * 9 + 1 + (size_t)ntaken);
    if (rc != 0)
        return rc;
    /* Expired leases first: they are the oldest work (the batch's rows are
     * older than any other claimed row of their keys). */
    rc = scan_taken(x);
    if (rc == 0)
        rc = scan_expired(x);
    if (rc == 0)
        rc = scan_pending(x);
    if (rc == 0)
        rc = write_deferred(x);
    return rc;
}

int outbox__claim_select(claim_ctx *x, outbox_relay *r, unsigned want, int64_t now)
{
    return outbox__claim_choose(x, r, want, now, 0);
}
