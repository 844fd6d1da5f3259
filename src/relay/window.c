/*
 * window.c: the in-flight window: the seqs of the messages this relay holds
 * under leases of their own (to tell its own leases from expired ones; a
 * batch lease's messages are not in it), the newest message of each
 * ordering key (for chaining), and the queue of marks waiting for a unit.
 * Loop thread; the unit's worker reads the seq set and the key map while it
 * runs (the loop changes them only when the unit is done).
 */
#include <stdlib.h>
#include <string.h>

#include "relay_int.h"

static size_t seq_hash(int64_t seq, size_t cap)
{
    return (size_t)(((uint64_t)seq * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
}

int outbox__win_seq_reserve(outbox_relay *r, size_t n)
{
    size_t ncap = r->win.seqset_cap ? r->win.seqset_cap : 1024, i, k;
    int64_t *t, *old = r->win.seqset;
    /* Rebuild when live entries and tombstones would fill half the table,
     * not only the live ones: a lookup of an absent seq stops only at an
     * empty slot, and every add may turn one into a tombstone for good. */
    if ((r->win.seqset_len + r->win.seqset_tombs + n) * 2 <= r->win.seqset_cap)
        return 0;
    while ((r->win.seqset_len + n) * 4 > ncap)
        ncap *= 2;
    t = malloc(ncap * sizeof *t);
    if (!t)
        return OUTBOX_ENOMEM;
    for (k = 0; k < ncap; k++)
        t[k] = 0;
    for (k = 0; k < r->win.seqset_cap; k++)
        if (old[k] > 0) {
            i = seq_hash(old[k], ncap);
            while (t[i] != 0)
                i = (i + 1) & (ncap - 1);
            t[i] = old[k];
        }
    free(old);
    r->win.seqset = t;
    r->win.seqset_cap = ncap;
    r->win.seqset_tombs = 0;
    return 0;
}

void outbox__win_seq_add(outbox_relay *r, int64_t seq)
{
    size_t i = seq_hash(seq, r->win.seqset_cap);
    while (r->win.seqset[i] > 0)
        i = (i + 1) & (r->win.seqset_cap - 1);
    if (r->win.seqset[i] < 0)
        r->win.seqset_tombs--;
    r->win.seqset[i] = seq;
    r->win.seqset_len++;
}

int outbox__win_seq_has(const outbox_relay *r, int64_t seq)
{
    size_t i;
    if (!r->win.seqset_cap)
        return 0;
    for (i = seq_hash(seq, r->win.seqset_cap); r->win.seqset[i] != 0; i = (i + 1) & (r->win.seqset_cap - 1))
        if (r->win.seqset[i] == seq)
            return 1;
    return 0;
}

void outbox__win_seq_del(outbox_relay *r, int64_t seq)
{
    size_t i;
    if (!r->win.seqset_cap)
        return;
    for (i = seq_hash(seq, r->win.seqset_cap); r->win.seqset[i] != 0; i = (i + 1) & (r->win.seqset_cap - 1))
        if (r->win.seqset[i] == seq) {
            r->win.seqset[i] = -1;
            r->win.seqset_len--;
            r->win.seqset_tombs++;
            return;
        }
}

relay_batch *outbox__batch_new(int64_t lo, int64_t hi, int64_t token, int64_t attempts)
{
    relay_batch *b = calloc(1, sizeof *b);
    if (b) {
        b->lo = lo;
        b->hi = hi;
        b->token = token;
        b->attempts = attempts;
    }
    return b;
}

void outbox__batch_join(relay_batch *b, msg *m)
{
    m->batch = b;
    b->refs++;
    b->n++;
}

void outbox__batch_live(outbox_relay *r, relay_batch *b)
{
    if (b->live)
        return;
    b->live = 1;
    b->prev_live = NULL;
    b->next_live = r->win.batches;
    if (r->win.batches)
        r->win.batches->prev_live = b;
    r->win.batches = b;
}

int outbox__batch_ours(const outbox_relay *r, int64_t lo, int64_t token)
{
    const relay_batch *b;
    for (b = r->win.batches; b; b = b->next_live)
        if (b->lo == lo)
            return b->token == token;
    return 0;
}

static void batch_unref(outbox_relay *r, relay_batch *b)
{
    if (--b->refs > 0)
        return;
    if (b->live) {
        if (b->prev_live)
            b->prev_live->next_live = b->next_live;
        else
            r->win.batches = b->next_live;
        if (b->next_live)
            b->next_live->prev_live = b->prev_live;
    }
    free(b);
}

void outbox__msg_free(msg *m)
{
    if (!m)
        return;
    if (m->batch)
        batch_unref(m->r, m->batch);
    free(m->env);
    if (m->result != m->entry)
        free(m->result);
    outbox__msg_release(m);
}

static void enqueue(outbox_relay *r, msg *m)
{
    m->next = NULL;
    if (r->win.marks_tail)
        r->win.marks_tail->next = m;
    else
        r->win.marks_head = m;
    r->win.marks_tail = m;
    r->win.marks_len++;
}

/* A clock read costs about as much as the rest of a mark on a virtual
 * machine (50-100 ns through the vDSO's paravirtual clock); a pipeline's
 * replies arrive together, so one read serves a few dozen of them, a few
 * microseconds apart, within the histogram's millisecond buckets. */
#define LATENCY_CLOCK_USES 32

static int64_t latency_clock(outbox_relay *r)
{
    uint64_t turn = uv_now(r->loop);
    if (turn != r->stats.clock_turn || ++r->stats.clock_uses >= LATENCY_CLOCK_USES || !r->stats.clock_ms) {
        r->stats.clock_ms = outbox_now_ms();
        r->stats.clock_turn = turn;
        r->stats.clock_uses = 0;
    }
    return r->stats.clock_ms;
}

void outbox__win_queue_mark(outbox_relay *r, msg *m, enum outcome o, const char *text, size_t len)
{
    /* text may be m->result; an entry id goes in the message itself */
    char *copy = !text ? NULL
                 : o == OUT_PUBLISHED && len < sizeof m->entry ? outbox__safe_text_into(m->entry, text, len)
                                                                : outbox__safe_text(text, len);
    if (o == OUT_PUBLISHED) {
        /* Commit (created_at) to Redis accepting it. */
        int64_t lat = latency_clock(r) - m->created_at;
        outbox__hist_observe(&r->stats.h_latency, lat > 0 ? (double)lat / 1000.0 : 0.0);
    }
    m->outcome = o;
    m->state = MSG_DONE;
    if (o == OUT_RELEASE)
        r->win.releases++;
    if (m->result != m->entry)
        free(m->result);
    m->result = copy;
    if (m->batch) {
        /* Published messages of a batch wait for the rest of it: the batch
         * is marked published once, after the rows that left it. */
        relay_batch *b = m->batch;
        b->ndone++;
        if (o == OUT_PUBLISHED) {
            m->next = NULL;
            if (b->published_tail) {
                b->published_tail->next = m;
            } else {
                b->published = m;
                b->parked_since = uv_now(r->loop);
                if (b->ndone < b->n && r->hooks.parked)
                    r->hooks.parked(r);
            }
            b->published_tail = m;
        } else {
            enqueue(r, m);
        }
        if (b->ndone == b->n) {
            if (b->published) {
                msg *p = b->published, *next;
                b->published = b->published_tail = NULL;
                p->batch_lead = 1;
                for (; p; p = next) {
                    next = p->next;
                    enqueue(r, p);
                }
            } else {
                m->batch_lead = 1;
            }
        } else if (o == OUT_PUBLISHED) {
            /* Parked in its batch: nothing for a unit to write yet, and
             * its room in the window comes back with the batch's mark (a
             * unit per reply claimed nothing, a transaction each; a
             * parked batch left waiting is flushed by the next unit). */
            return;
        }
    } else {
        enqueue(r, m);
    }
    r->hooks.schedule(r);
}

int outbox__win_group_next(const msg *m)
{
    const msg *n = m->next;
    return n && n->batch && n->batch == m->batch && !n->batch_lead && !n->own_published && n->outcome == OUT_PUBLISHED;
}

int outbox__win_flush_parked(outbox_relay *r, uint64_t ms)
{
    relay_batch *b;
    uint64_t now = uv_now(r->loop);
    int left = 0;
    for (b = r->win.batches; b; b = b->next_live) {
        msg *p = b->published, *next;
        if (!p)
            continue;
        if (now - b->parked_since < ms) {
            left = 1;
            continue;
        }
        b->published = b->published_tail = NULL;
        for (; p; p = next) {
            next = p->next;
            p->own_published = 1; /* it leaves the batch */
            b->n--;
            b->ndone--;
            enqueue(r, p);
        }
    }
    return left;
}

void outbox__win_free_parked(outbox_relay *r)
{
    relay_batch *b = r->win.batches;
    while (b) {
        relay_batch *next = b->next_live;
        msg *p = b->published;
        b->published = b->published_tail = NULL;
        while (p) {
            msg *pn = p->next;
            size_t refs = b->refs;
            outbox__win_retire(r, p);
            p = pn;
            if (refs == 1)
                break; /* b went with it */
        }
        b = next;
    }
}

/* Releases m's held-back successors: they were never sent. */
void outbox__win_release_chain(outbox_relay *r, msg *m, const char *why)
{
    msg *n = m->key_next;
    m->key_next = NULL;
    while (n) {
        msg *next = n->key_next;
        n->key_next = NULL;
        outbox__win_queue_mark(r, n, OUT_RELEASE, why, strlen(why));
        n = next;
    }
}

void outbox__win_hand_back(outbox_relay *r, msg *m, const char *why, const char *chain_why)
{
    outbox__win_release_chain(r, m, chain_why);
    outbox__win_queue_mark(r, m, OUT_RELEASE, why, strlen(why));
}

/* Puts a detached list of marks (first to its end) back at the head of the
 * queue, ahead of those queued since. */
void outbox__win_requeue(outbox_relay *r, msg *first)
{
    msg *end = first;
    if (!first)
        return;
    r->win.marks_len++;
    while (end->next) {
        end = end->next;
        r->win.marks_len++;
    }
    end->next = r->win.marks_head;
    if (!r->win.marks_head)
        r->win.marks_tail = end;
    r->win.marks_head = first;
}


/*
 * The newest message this relay holds (claimed, not yet marked) of each
 * ordering key. A row whose key predecessor is that message, still on its
 * way, is claimed and chained behind it (sent when it is accepted) instead
 * of waiting for its mark: otherwise a key with a message in flight would
 * hold its next row back for a whole round trip plus a mark.
 */
uint64_t outbox__key_hash(const char *topic, const char *key, size_t klen)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p;
    for (p = (const unsigned char *)topic; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
    for (size_t i = 0; i < klen; i++)
        h = (h ^ (unsigned char)key[i]) * 1099511628211ull;
    return h;
}

int outbox__same_key(const char *t1, const char *k1, size_t l1, const char *t2, const char *k2, size_t l2)
{
    return l1 == l2 && memcmp(k1, k2, l1) == 0 && strcmp(t1, t2) == 0;
}

/* The link that points at the key's entry, or at the NULL ending its bucket.
 * h is the key's outbox__key_hash; an entry's own (km_hash) is compared
 * first, so that the strings of the other entries of a bucket, in memory
 * last written by the claim's thread, are not read. */
static msg **keymap_link(outbox_relay *r, uint64_t h, const char *topic, const char *key, size_t klen)
{
    msg **l = &r->win.keymap[h & (r->win.keymap_cap - 1)];
    while (*l && ((*l)->km_hash != h || !outbox__same_key((*l)->topic, (*l)->key, (*l)->klen, topic, key, klen)))
        l = &(*l)->km_next;
    return l;
}

msg *outbox__win_key_get(outbox_relay *r, uint64_t h, const char *topic, const char *key, size_t klen)
{
    return r->win.keymap_cap ? *keymap_link(r, h, topic, key, klen) : NULL;
}

/* Makes m its key's newest message. Without memory for the table it is left
 * out: its successors then wait for its mark, which is slower, not wrong. */
void outbox__win_key_put(outbox_relay *r, msg *m)
{
    msg **l;
    if (r->win.keymap_len * 2 >= r->win.keymap_cap) {
        size_t ncap = r->win.keymap_cap ? r->win.keymap_cap * 2 : 1024, i;
        msg **n = calloc(ncap, sizeof *n);
        if (n) {
            for (i = 0; i < r->win.keymap_cap; i++) {
                msg *e = r->win.keymap[i];
                while (e) {
                    msg *next = e->km_next;
                    msg **b = &n[e->km_hash & (ncap - 1)];
                    e->km_next = *b;
                    *b = e;
                    e = next;
                }
            }
            free(r->win.keymap);
            r->win.keymap = n;
            r->win.keymap_cap = ncap;
        } else if (!r->win.keymap_cap) {
            return;
        }
    }
    /* The claim hashed it (0: not yet; a hash of 0 is computed again, the
     * same). */
    if (!m->km_hash)
        m->km_hash = outbox__key_hash(m->topic, m->key, m->klen);
    l = keymap_link(r, m->km_hash, m->topic, m->key, m->klen);
    if (*l) {
        msg *old = *l;
        m->km_next = old->km_next;
        old->km_next = NULL;
        old->in_keymap = 0;
    } else {
        m->km_next = NULL;
        r->win.keymap_len++;
    }
    *l = m;
    m->in_keymap = 1;
}

static void keymap_drop(outbox_relay *r, msg *m)
{
    msg **l;
    if (!m->in_keymap)
        return;
    /* m is its key's entry or a newer message of its key is: m itself is
     * found without comparing any strings. */
    for (l = &r->win.keymap[m->km_hash & (r->win.keymap_cap - 1)]; *l && *l != m; l = &(*l)->km_next)
        if ((*l)->km_hash == m->km_hash &&
            outbox__same_key((*l)->topic, (*l)->key, (*l)->klen, m->topic, m->key, m->klen))
            break;
    if (*l == m) {
        *l = m->km_next;
        r->win.keymap_len--;
    }
    m->in_keymap = 0;
    m->km_next = NULL;
}

/* Frees a message that leaves the window. */
void outbox__win_retire(outbox_relay *r, msg *m)
{
    keymap_drop(r, m);
    if (!m->batch)
        outbox__win_seq_del(r, m->seq);
    outbox__msg_free(m);
}
