/*
 * claim_write.c: claiming the rows a claim chose (claim.c), inside the
 * unit's transaction (the unit's worker thread): the new rows under one
 * batch lease record, a taken-over batch by rewriting its record, the other
 * rows each under a lease of its own; their messages, settled in the order
 * chosen (a dead row holds nothing back, a row behind one not claimed goes
 * back to its row).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "claim.h"

static int cmp_seq_idx(const void *a, const void *b)
{
    const int64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Turns the current row of a claim's statement (columns as
 * OUTBOX__SQL_CLAIM returns them) into a message for its candidate; b: the
 * batch lease it was claimed in, or NULL. */
static int take_row(claim_ctx *x, sqlite3_stmt *st, const int64_t *index, relay_batch *b)
{
    int64_t key[2], *hit;
    cand *c;
    msg *m;
    int e;

    key[0] = sqlite3_column_int64(st, 0);
    hit = bsearch(key, index, x->nchosen, 2 * sizeof(int64_t), cmp_seq_idx);
    if (!hit)
        return OUTBOX_ESQLITE; /* a row not chosen: impossible under the write lock */
    c = &x->cs[hit[1]];
    e = outbox__encode_row(x->r, st, &outbox__claim_cols, &m);
    if (m) {
        m->km_hash = c->khash;
        m->took_over = c->source == S_EXPIRED || c->source == S_TAKEN;
        c->m = m;
        if (b)
            outbox__batch_join(b, m);
    }
    return e;
}

/* Reads the rows of batch b (OUTBOX__SQL_BATCH_ROWS) into messages. */
static int batch_rows(claim_ctx *x, relay_batch *b, const int64_t *index)
{
    sqlite3_stmt *st = Q(x->r, q_batch_rows);
    int step, e = 0;
    sqlite3_bind_int64(st, 1, b->lo);
    sqlite3_bind_int64(st, 2, b->hi);
    sqlite3_bind_int64(st, 3, b->token);
    sqlite3_bind_int64(st, 4, b->attempts);
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        e = take_row(x, st, index, b);
        if (e != 0)
            break;
    }
    if (e == 0 && step != SQLITE_DONE)
        e = outbox__relay_sqlerr(x->r, step);
    sqlite3_reset(st);
    return e;
}

/* The expired batch lease the claim took (x->taken) kept none of its rows:
 * each has a state of its own (made to wait by this claim, or settled one
 * by one before). Its record goes: left leased, it would count as leased
 * work for ever, and a drain would never end. */
static int drop_taken(claim_ctx *x)
{
    outbox_relay *r = x->r;
    sqlite3_bind_int64(Q(r, q_batch_drop), 1, x->t_lo);
    return outbox__relay_step_done(r, Q(r, q_batch_drop));
}

/*
 * Claims the chosen rows: the new rows in one batch lease (one record for
 * the range from the first to the last of them: every other row of that
 * range was made to wait or is not new), the rows of a taken-over batch by
 * taking its record over (token + 1), and the other rows each under a lease
 * of its own with one UPDATE ... RETURNING. *nb gets the batches (up to 2).
 */
static int claim_chosen(claim_ctx *x, relay_batch **bs, size_t *nb)
{
    outbox_relay *r = x->r;
    int64_t *index, lo = INT64_MAX, hi = 0, until = x->now + (int64_t)r->cfg.s.lease_ms;
    char *list, *p;
    size_t i, nrow = 0, ntaken = 0;
    int step, e = 0, sorted = 1;

    *nb = 0;
    index = malloc(x->nchosen * 2 * sizeof *index);
    list = malloc(x->nchosen * 21 + 2);
    if (!index || !list) {
        free(index);
        free(list);
        return OUTBOX_ENOMEM;
    }
    /* The seqs of rows under leases of their own as a JSON array, for
     * json_each() in the statement. */
    p = list;
    *p++ = '[';
    for (i = 0; i < x->nchosen; i++) {
        const cand *c = &x->cs[x->chosen[i]];
        index[2 * i] = c->seq;
        index[2 * i + 1] = x->chosen[i];
        if (i && c->seq < index[2 * i - 2])
            sorted = 0;
        if (c->source == S_NEW) {
            lo = c->seq < lo ? c->seq : lo;
            hi = c->seq > hi ? c->seq : hi;
        } else if (c->source == S_TAKEN) {
            ntaken++;
        } else {
            p += sprintf(p, "%s%lld", nrow ? "," : "", (long long)c->seq);
            nrow++;
        }
    }
    *p++ = ']';
    if (!sorted) /* chosen in seq order unless waiting or expired rows were */
        qsort(index, x->nchosen, 2 * sizeof *index, cmp_seq_idx);
    if (x->taken && ntaken) {
        sqlite3_stmt *t = Q(r, q_batch_take);
        relay_batch *b = outbox__batch_new(x->t_lo, x->t_hi, x->t_token + 1, x->t_attempts + 1);
        if (!b) {
            e = OUTBOX_ENOMEM;
            goto done;
        }
        bs[(*nb)++] = b;
        sqlite3_bind_int64(t, 1, x->t_lo);
        sqlite3_bind_text(t, 2, r->cfg.worker_id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(t, 3, until);
        sqlite3_bind_int64(t, 4, x->now);
        sqlite3_bind_int64(t, 5, x->t_token);
        e = outbox__relay_step_done(r, t);
        if (e == 0 && sqlite3_changes(r->db.conn) != 1)
            e = OUTBOX_ESQLITE; /* changed under the write lock: impossible */
        if (e == 0)
            e = batch_rows(x, b, index);
    } else if (x->taken) {
        e = drop_taken(x);
    }
    if (e == 0 && hi > 0) {
        sqlite3_stmt *n = Q(r, q_batch_new);
        relay_batch *b = outbox__batch_new(lo, hi, 1, 1);
        if (!b) {
            e = OUTBOX_ENOMEM;
            goto done;
        }
        bs[(*nb)++] = b;
        sqlite3_bind_int64(n, 1, lo);
        sqlite3_bind_int64(n, 2, hi);
        sqlite3_bind_text(n, 3, r->cfg.worker_id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(n, 4, until);
        e = outbox__relay_step_done(r, n);
        /* Its rows are the new rows chosen (every other row of the range
         * was made to wait), encoded by the walk: in seq order. */
        for (i = 0; e == 0 && i < x->nchosen; i++) {
            cand *c = &x->cs[index[2 * i + 1]];
            if (c->source != S_NEW)
                continue;
            if (!c->m)
                e = OUTBOX_ESQLITE; /* not encoded: cannot happen (outbox__claim sets encode) */
            else
                outbox__batch_join(b, c->m);
        }
    }
    if (e == 0 && nrow) {
        sqlite3_bind_text(Q(r, q_claim), 1, r->cfg.worker_id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(Q(r, q_claim), 2, until);
        sqlite3_bind_text(Q(r, q_claim), 3, list, (int)(p - list), SQLITE_STATIC);
        sqlite3_bind_int64(Q(r, q_claim), 4, x->now);
        while ((step = sqlite3_step(Q(r, q_claim))) == SQLITE_ROW) {
            e = take_row(x, Q(r, q_claim), index, NULL);
            if (e != 0)
                break;
        }
        if (e == 0 && step != SQLITE_DONE)
            e = outbox__relay_sqlerr(r, step);
        sqlite3_reset(Q(r, q_claim));
        sqlite3_clear_bindings(Q(r, q_claim));
    }
done:
    free(list);
    free(index);
    return e;
}

int outbox__claim(outbox_relay *r, unsigned want, int64_t now, msg ***out, size_t *nout, size_t *ndead,
                  msg **settled, size_t *ndeferred)
{
    claim_ctx x;
    msg **ms = NULL;
    relay_batch *bs[2];
    size_t nm = 0, i, nb = 0;
    int rc;

    *out = NULL;
    *nout = 0;
    *ndead = 0;
    *ndeferred = 0;
    rc = outbox__claim_choose(&x, r, want, now, 1);
    if (rc == 0)
        *ndeferred = x.ndefer;
    if (rc == 0 && x.nchosen == 0 && x.taken)
        rc = drop_taken(&x); /* and nothing else was chosen: claim_chosen does not run */
    if (rc != 0 || x.nchosen == 0)
        goto done;
    rc = claim_chosen(&x, bs, &nb);
    if (rc != 0)
        goto done;

    ms = malloc(x.nchosen * sizeof *ms);
    if (!ms) {
        rc = OUTBOX_ENOMEM;
        goto done;
    }
    /* In the order chosen, so a predecessor is settled before its successor. */
    for (i = 0; i < x.nchosen; i++) {
        cand *c = &x.cs[x.chosen[i]];
        msg *after = c->after;
        int release = 0, in_batch = 0;
        if (!c->m) {
            c->fate = C_RELEASED; /* changed under us: impossible under the write lock */
            continue;
        }
        if (c->prev >= 0) {
            cand *p = &x.cs[c->prev];
            if (p->fate == C_CHOSEN) {
                after = p->m;
                in_batch = 1;
            } else if (p->fate == C_DEAD) {
                after = p->eff_after; /* a dead row holds nothing back */
                in_batch = p->eff_in_batch;
            } else {
                release = 1;
            }
        }
        c->eff_after = after;
        c->eff_in_batch = in_batch;
        if (c->m->outcome == OUT_DEAD || release) {
            if (release) {
                c->m->outcome = OUT_RELEASE;
                free(c->m->result);
                c->m->result = outbox__safe_text("held back: its predecessor was not claimed", 42);
            }
            rc = outbox__mark_write(r, c->m, now);
            if (c->m->batch)
                c->m->batch->n--; /* it left its batch at once */
            if (c->m->outcome == OUT_DEAD)
                (*ndead)++;
            c->fate = release ? C_RELEASED : C_DEAD;
            /* Counted and freed when the unit is done. */
            c->m->next = *settled;
            *settled = c->m;
            c->m = NULL;
            if (rc != 0)
                goto done;
            continue;
        }
        /* Idempotent mode sends a stream's messages of one claim in one
         * script call, in seq order, which stops at the first failure: a
         * row behind one of the same claim goes in the same call, unless
         * that one is held itself. A later call could not know that an
         * earlier one failed: a row behind a message of an earlier claim is
         * chained, and sent once that one is appended (on_idem_reply). */
        if (after && (!r->cfg.s.idempotent || !in_batch || after->behind)) {
            c->m->behind = 1;
            if (in_batch)
                after->key_next = c->m;
            else
                c->m->chain_after = after; /* linked after the commit */
        }
        ms[nm++] = c->m;
    }
    /* A batch all of whose rows left it at once names no row: its record
     * goes. */
    for (i = 0; i < nb; i++)
        if (bs[i]->n == 0) {
            relay_batch *b = bs[i];
            sqlite3_bind_int64(Q(r, q_batch_drop), 1, b->lo);
            if (b->refs == 0) {
                bs[i] = bs[--nb]; /* no message took it */
                i--;
                free(b);
            }
            rc = outbox__relay_step_done(r, Q(r, q_batch_drop));
            if (rc != 0)
                goto done;
        }
    rc = 0;
done:
    if (rc != 0) {
        for (i = 0; i < nb; i++)
            if (bs[i]->refs == 0)
                free(bs[i]); /* no message took it */
        for (i = 0; i < x.nchosen && x.cs; i++)
            outbox__msg_free(x.cs[x.chosen[i]].m);
        free(ms);
        ms = NULL;
        nm = 0;
    }
    *out = ms;
    *nout = nm;
    return rc;
}
