/*
 * claim_batch.c: what the claim (claim.c) needs for batch leases: the keys
 * of the batch leases other relays hold (their rows as written are in no
 * index), finding an expired batch lease to take over, and the arena the
 * claim copies strings into and its arrays. Worker thread, inside the unit's
 * transaction.
 */
#include <stdlib.h>
#include <string.h>

#include "claim.h"

const char *outbox__claim_arena_dup(chunk **a, const char *s, size_t len)
{
    char *p;
    if (!*a || (*a)->cap - (*a)->used < len + 1) {
        size_t cap = len + 1 > 16384 ? len + 1 : 16384;
        chunk *c = malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->next = *a;
        c->used = 0;
        c->cap = cap;
        *a = c;
    }
    p = (*a)->data + (*a)->used;
    memcpy(p, s, len);
    p[len] = '\0';
    (*a)->used += len + 1;
    return p;
}

void outbox__claim_arena_free(chunk *a)
{
    while (a) {
        chunk *n = a->next;
        free(a);
        a = n;
    }
}

/* Empties an arena for the next claim, keeping its first chunk. */
void outbox__claim_arena_reset(chunk **a)
{
    if (*a) {
        outbox__claim_arena_free((*a)->next);
        (*a)->next = NULL;
        (*a)->used = 0;
    }
}


/*
 * The keys of the batch leases this relay does not hold (another relay's,
 * or expired ones not taken over in this claim): their rows as written are
 * not in outbox_key (a claim of a batch writes no row), so the lowest seq
 * of each key there is loaded once per claim, at its first keyed row, from
 * the leased batches' ranges. A claim of one relay alone reads nothing
 * here.
 */
static int fk_put(claim_ctx *x, uint64_t h, const char *topic, const char *key, size_t klen, int64_t seq)
{
    struct fkey *t = x->fk;
    size_t i;
    if ((x->fk_len + 1) * 2 > x->fk_cap) {
        size_t ncap = x->fk_cap ? x->fk_cap * 2 : 256, k;
        struct fkey *n = calloc(ncap, sizeof *n);
        if (!n)
            return OUTBOX_ENOMEM;
        for (k = 0; k < x->fk_cap; k++)
            if (t[k].topic) {
                i = (size_t)t[k].hash & (ncap - 1);
                while (n[i].topic)
                    i = (i + 1) & (ncap - 1);
                n[i] = t[k];
            }
        free(t);
        x->fk = t = n;
        x->fk_cap = ncap;
        x->r->cw.fk = n;
        x->r->cw.fk_cap = ncap;
    }
    for (i = (size_t)h & (x->fk_cap - 1); t[i].topic; i = (i + 1) & (x->fk_cap - 1))
        if (t[i].hash == h && outbox__same_key(t[i].topic, t[i].key, t[i].klen, topic, key, klen)) {
            if (seq < t[i].seq)
                t[i].seq = seq;
            return 0;
        }
    t[i].topic = outbox__claim_arena_dup(&x->r->cw.arena, topic, strlen(topic));
    t[i].key = outbox__claim_arena_dup(&x->r->cw.arena, key, klen);
    if (!t[i].topic || !t[i].key) {
        t[i].topic = NULL;
        return OUTBOX_ENOMEM;
    }
    t[i].hash = h;
    t[i].klen = klen;
    t[i].seq = seq;
    x->fk_len++;
    return 0;
}

static int foreign_load(claim_ctx *x)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *b = Q(r, q_batch_leased), *k = Q(r, q_batch_keys);
    int sb, sk = SQLITE_DONE, rc = 0;
    x->fk_loaded = 1;
    x->fk = r->cw.fk;
    x->fk_cap = r->cw.fk_cap;
    x->fk_len = 0;
    if (x->fk)
        memset(x->fk, 0, x->fk_cap * sizeof *x->fk);
    while (rc == 0 && (sb = sqlite3_step(b)) == SQLITE_ROW) {
        int64_t lo = sqlite3_column_int64(b, 0), hi = sqlite3_column_int64(b, 1);
        if ((x->taken && lo == x->t_lo) || outbox__batch_ours(r, lo, sqlite3_column_int64(b, 3)))
            continue;
        sqlite3_bind_int64(k, 1, lo);
        sqlite3_bind_int64(k, 2, hi);
        while (rc == 0 && (sk = sqlite3_step(k)) == SQLITE_ROW) {
            const char *topic = (const char *)sqlite3_column_text(k, 1);
            const char *key = (const char *)sqlite3_column_text(k, 2);
            size_t klen = (size_t)sqlite3_column_bytes(k, 2);
            if (!topic || !key)
                rc = OUTBOX_ENOMEM;
            else
                rc = fk_put(x, outbox__key_hash(topic, key, klen), topic, key, klen, sqlite3_column_int64(k, 0));
        }
        sqlite3_reset(k);
        if (rc == 0 && sk != SQLITE_DONE)
            rc = outbox__relay_sqlerr(r, sk);
    }
    if (rc == 0 && sb != SQLITE_DONE && sb != SQLITE_ROW)
        rc = outbox__relay_sqlerr(r, sb);
    sqlite3_reset(b);
    return rc;
}

/* The lowest seq of the key's rows in the other batch leases, or INT64_MAX. */
int outbox__claim_foreign_min(claim_ctx *x, const cand *c, int64_t *seq)
{
    uint64_t h;
    size_t i;
    *seq = INT64_MAX;
    if (!x->fk_loaded) {
        int rc = foreign_load(x);
        if (rc != 0)
            return rc;
    }
    if (!x->fk_len)
        return 0;
    h = c->khash;
    for (i = (size_t)h & (x->fk_cap - 1); x->fk[i].topic; i = (i + 1) & (x->fk_cap - 1))
        if (x->fk[i].hash == h && outbox__same_key(x->fk[i].topic, x->fk[i].key, x->fk[i].klen, c->topic, c->key, c->klen)) {
            *seq = x->fk[i].seq;
            break;
        }
    return 0;
}

/*
 * The oldest expired batch lease this relay does not hold, if any: its range,
 * token and attempts go to x (its rows are walked by scan_taken). *nrows
 * gets the number of its rows as written (the candidates it adds).
 */
int outbox__claim_find_taken(claim_ctx *x, int64_t *nrows)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *st = Q(r, q_batch_expired);
    int step, rc = 0;
    *nrows = 0;
    sqlite3_bind_int64(st, 1, x->now);
    /* The oldest range first, as the rows' order is: the lowest lo. */
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        int64_t lo = sqlite3_column_int64(st, 0), token = sqlite3_column_int64(st, 3);
        if (x->taken && lo >= x->t_lo)
            continue;
        if (outbox__batch_ours(r, lo, token))
            continue; /* still on its way here: not taken over by its own holder */
        x->taken = 1;
        x->t_lo = lo;
        x->t_hi = sqlite3_column_int64(st, 1);
        x->t_token = token;
        x->t_attempts = sqlite3_column_int64(st, 4);
    }
    sqlite3_reset(st);
    if (step != SQLITE_DONE) {
        x->taken = 0;
        return outbox__relay_sqlerr(r, step);
    }
    if (!x->taken)
        return 0;
    st = Q(r, q_batch_cands);
    sqlite3_bind_int64(st, 1, x->t_lo);
    sqlite3_bind_int64(st, 2, x->t_hi);
    while ((step = sqlite3_step(st)) == SQLITE_ROW)
        ++*nrows;
    sqlite3_reset(st);
    if (step != SQLITE_DONE)
        rc = outbox__relay_sqlerr(r, step);
    return rc;
}

/*
 * The arrays outlive the claim and key slots are emptied by generation (a
 * slot of an older one reads as empty): allocated and cleared per claim,
 * they made some claims in an application's process take milliseconds
 * (docs/BENCHMARKS.md, item 12).
 */
int outbox__claim_arrays(outbox_relay *r, size_t cap)
{
    size_t scap = 16;
    if (cap > r->cw.cap) {
        cand *cs = realloc(r->cw.cs, cap * sizeof *cs);
        int *chosen;
        int64_t *defer;
        if (!cs)
            return OUTBOX_ENOMEM;
        r->cw.cs = cs;
        chosen = realloc(r->cw.chosen, cap * sizeof *chosen);
        if (!chosen)
            return OUTBOX_ENOMEM;
        r->cw.chosen = chosen;
        defer = realloc(r->cw.defer, cap * 2 * sizeof *defer);
        if (!defer)
            return OUTBOX_ENOMEM;
        r->cw.defer = defer;
        r->cw.cap = cap;
    }
    while (scap < cap * 2)
        scap *= 2;
    if (scap > r->cw.scap) {
        bslot *slots = calloc(scap, sizeof *slots);
        if (!slots)
            return OUTBOX_ENOMEM;
        free(r->cw.slots);
        r->cw.slots = slots;
        r->cw.scap = scap;
        r->cw.gen = 0;
    }
    if (++r->cw.gen == 0) {
        memset(r->cw.slots, 0, r->cw.scap * sizeof *r->cw.slots);
        r->cw.gen = 1;
    }
    return 0;
}

void outbox__claim_free(outbox_relay *r)
{
    free(r->cw.cs);
    free(r->cw.chosen);
    free(r->cw.defer);
    free(r->cw.slots);
    free(r->cw.fk);
    outbox__win_free_parked(r);
    outbox__claim_arena_free(r->cw.arena);
    outbox__encode_free(r);
    memset(&r->cw, 0, sizeof r->cw);
}
