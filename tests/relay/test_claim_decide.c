/*
 * test_claim_decide.c: the claim's decisions (src/relay/claim.c), without
 * Redis or a running relay. Each case builds a relay by hand on a fresh
 * database file (the schema applied, statements prepared), writes rows with
 * plain SQL, runs outbox__claim_select inside BEGIN IMMEDIATE and checks
 * what became of each candidate (fate, prev, after, deferred), the order
 * chosen, and what the claim wrote (available_at of the rows it made wait,
 * outbox_cursor). The cases:
 *   - unkeyed rows: all chosen in seq order; a smaller batch moves the
 *     cursor only past the rows it saw;
 *   - a keyed head failing (pending, attempts > 0, backoff in the future):
 *     its key's later rows held and made due no earlier than it, an
 *     unkeyed row chosen;
 *   - two rows of one key in one batch: the second behind the first (prev);
 *   - chained behind this relay's own message in flight (after = it), in
 *     idempotent mode too (the message is sent once that one is appended);
 *     held when the window's message of the key is not the lease's;
 *   - a row requeued by outbox-replay goes before its key's pending rows;
 *   - an expired lease of another owner taken over (S_EXPIRED); this
 *     relay's own expired lease, still in its seq set, skipped;
 *   - delayed rows (available_at in the future) not chosen, not blocking
 *     unkeyed rows; a keyed row not due holds its key, also a new row
 *     created in the future, which no index shows to its key's later rows;
 *   - rows held behind another relay's live lease: made waiting rows due at
 *     once;
 * and the whole outbox__claim: claimed rows in state 1 under this relay's
 * lease, a takeover's new token, a key's second message linked behind the
 * first, and rows with an invalid topic or payload dead-lettered in the same
 * transaction without holding back their key.
 *
 * Every case runs twice: as a relay holding messages, and as one holding
 * nothing (r->cw.holds_nothing), which asks the plan first and, when the
 * database has nothing but new rows, takes the simple way (the walk of new
 * rows alone). The decisions must be the same either way: where a case has
 * leased, waiting or stray rows, or another relay's batch, the plan sends
 * the claim the full way; the simple cases (unkeyed rows, a key twice in a
 * batch, rows created in the future, invalid rows) take the simple way,
 * which the second run checks it did.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "relay/claim.h"
#include "rt.h"
#include "tap.h"

#define ME "relay-me"
#define OTHER "relay-other"

/* The second run: the relay says it holds nothing (see the top). */
static int holds_nothing;

/* A case's world: a database file in a temp dir and a relay made by hand
 * on it (only what the claim reads: settings, worker id, statements, the
 * window's seq set and key map). */
typedef struct world {
    char *dir, *path;
    outbox_relay *r;
    sqlite3 *db; /* the relay's connection; rows are written through it too */
    int64_t now;
    msg *inflight[4]; /* this relay's messages in flight (freed at the end) */
    int ninflight;
} world;

static void world_start(world *w, int idempotent)
{
    char err[256];
    outbox_relay *r = calloc(1, sizeof *r);
    memset(w, 0, sizeof *w);
    if (!r)
        bail("out of memory");
    w->dir = th_tmpdir();
    w->path = rt_make_db(w->dir, "claim.db");
    outbox_relay_defaults(&r->cfg.s);
    r->cfg.worker_id = strdup(ME);
    r->cfg.stream_prefix = strdup("outbox:");
    if (!r->cfg.worker_id || !r->cfg.stream_prefix)
        bail("out of memory");
    r->cfg.s.worker_id = r->cfg.worker_id;
    r->cfg.s.stream_prefix = r->cfg.stream_prefix;
    r->cfg.s.idempotent = idempotent;
    r->cfg.s.max_payload = 100;
    r->cw.holds_nothing = holds_nothing;
    r->db.conn = rt_open(w->path);
    if (outbox__relay_db_prepare(r, err, sizeof err) != 0)
        bail("prepare: %s", err);
    w->r = r;
    w->db = r->db.conn;
    w->now = rt_unix_ms();
}

static void world_end(world *w)
{
    int i;
    for (i = 0; i < w->ninflight; i++)
        outbox__msg_free(w->inflight[i]);
    outbox__claim_free(w->r);
    outbox__relay_db_close(w->r);
    free(w->r->win.seqset);
    free(w->r->win.keymap);
    free(w->r->cfg.worker_id);
    free(w->r->cfg.stream_prefix);
    free(w->r);
    free(w->path);
    th_rmtree(w->dir);
    free(w->dir);
}

/* Inserts a row by plain SQL: key NULL for none, created_at and available_at
 * relative to w->now. Returns its seq. */
static int64_t put_row(world *w, const char *id, const char *key, int64_t created, int64_t avail)
{
    th_sql_exec(w->db,
                "INSERT INTO outbox(id, topic, key, payload, created_at, available_at) "
                "VALUES ('%s', 't', %s%s%s, x'00', %lld, %lld)",
                id, key ? "'" : "", key ? key : "NULL", key ? "'" : "", (long long)(w->now + created),
                (long long)(w->now + avail));
    return (int64_t)sqlite3_last_insert_rowid(w->db);
}

/* Makes a row leased: owner, token, lease_until relative to w->now. */
static void lease_row(world *w, int64_t seq, const char *owner, int64_t token, int64_t until)
{
    th_sql_exec(w->db,
                "UPDATE outbox SET state = 1, lease_owner = '%s', lease_token = %lld, lease_until = %lld, "
                "attempts = attempts + 1 WHERE seq = %lld",
                owner, (long long)token, (long long)(w->now + until), (long long)seq);
}

/* A batch lease of another relay over seqs lo..hi (token, expiry until ms
 * from now, attempts), and the cursor past it, as that relay's claim left
 * them. */
static void other_batch(world *w, int64_t lo, int64_t hi, int64_t token, int64_t until, int64_t attempts)
{
    th_sql_exec(w->db,
                "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, attempts) VALUES (%lld, %lld, 1, "
                "'%s', %lld, %lld, %lld); UPDATE outbox_cursor SET new_from = %lld",
                (long long)lo, (long long)hi, OTHER, (long long)token, (long long)(w->now + until),
                (long long)attempts, (long long)hi + 1);
}

/* A message of this relay in flight (claimed with token, not yet marked):
 * in the seq set, and its key's newest message in the key map if keyed. */
static msg *own_inflight(world *w, int64_t seq, int64_t token, const char *key)
{
    size_t kl = key ? strlen(key) : 0;
    msg *m = calloc(1, sizeof *m + 16 + 2 + kl + 1);
    if (!m || w->ninflight == 4)
        bail("out of memory");
    m->r = w->r;
    m->seq = seq;
    m->token = token;
    m->id = (char *)(m + 1);
    snprintf(m->id, 16, "own-%lld", (long long)seq);
    m->topic = m->id + 16;
    strcpy(m->topic, "t");
    m->key = m->topic + 2;
    memcpy(m->key, key ? key : "", kl + 1);
    m->klen = kl;
    m->state = MSG_SENT;
    if (outbox__win_seq_reserve(w->r, 1) != 0)
        bail("out of memory");
    outbox__win_seq_add(w->r, seq);
    if (key)
        outbox__win_key_put(w->r, m);
    w->inflight[w->ninflight++] = m;
    return m;
}

/* Runs the claim's choice in its own transaction, committed so that what
 * it wrote can be read back. */
static int select_rows(world *w, claim_ctx *x, unsigned want)
{
    int rc;
    th_sql_exec(w->db, "BEGIN IMMEDIATE");
    rc = outbox__claim_select(x, w->r, want, w->now);
    th_sql_exec(w->db, rc == 0 ? "COMMIT" : "ROLLBACK");
    return rc;
}

/* The candidate of a seq, NULL if the claim did not look at it. */
static const cand *cand_of(const claim_ctx *x, int64_t seq)
{
    size_t i;
    for (i = 0; i < x->n; i++)
        if (x->cs[i].seq == seq)
            return &x->cs[i];
    return NULL;
}

/* The index in x->cs of a seq's candidate, or -2 (never a valid prev). */
static int cand_index(const claim_ctx *x, int64_t seq)
{
    const cand *c = cand_of(x, seq);
    return c ? (int)(c - x->cs) : -2;
}

/* The chosen seqs in the order chosen, "1,2,3" ("" if none). */
static const char *chosen_seqs(const claim_ctx *x)
{
    static char buf[512];
    size_t i, len = 0;
    buf[0] = '\0';
    for (i = 0; i < x->nchosen && len < sizeof buf - 24; i++)
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%lld", i ? "," : "",
                                (long long)x->cs[x->chosen[i]].seq);
    return buf;
}

static int fate_of(const claim_ctx *x, int64_t seq)
{
    const cand *c = cand_of(x, seq);
    return c ? (int)c->fate : -1;
}

static int deferred_of(const claim_ctx *x, int64_t seq)
{
    const cand *c = cand_of(x, seq);
    return c ? c->deferred : -1;
}

/* A row's available_at relative to w->now. */
static int64_t avail_of(world *w, int64_t seq)
{
    return th_sql_int(w->db, "SELECT available_at FROM outbox_messages WHERE seq = %lld", (long long)seq) - w->now;
}

static int64_t cursor_of(world *w)
{
    return th_sql_int(w->db, "SELECT new_from FROM outbox_cursor");
}

static void test_unkeyed(void)
{
    world w;
    claim_ctx x;
    int i, all = 1;

    world_start(&w, 0);
    for (i = 0; i < 5; i++) {
        char id[16];
        snprintf(id, sizeof id, "u%d", i);
        put_row(&w, id, NULL, -1000 + i, -1000 + i);
    }
    is_int(select_rows(&w, &x, 3), 0, "unkeyed, want 3: the choice succeeds");
    is_str(chosen_seqs(&x), "1,2,3", "unkeyed, want 3: the first three, in seq order");
    is_int(cursor_of(&w), 4, "unkeyed, want 3: the cursor moves past the rows seen, to 4");
    is_int(avail_of(&w, 4), -997, "unkeyed, want 3: an unseen row is left as it is");

    is_int(select_rows(&w, &x, 10), 0, "unkeyed, want 10: the choice succeeds");
    is_str(chosen_seqs(&x), "4,5", "unkeyed, want 10: the rest from the cursor, in seq order");
    for (i = 0; i < (int)x.n; i++)
        all &= x.cs[i].fate == C_CHOSEN && x.cs[i].prev == -1 && !x.cs[i].after && !x.cs[i].deferred &&
               x.cs[i].source == S_NEW;
    ok(all && x.n == 2, "unkeyed: each one new, chosen, behind nothing, not deferred");
    is_int(cursor_of(&w), 6, "unkeyed: every row seen: the cursor after the last row");
    is_int(x.simple, holds_nothing, "unkeyed: the simple way iff the relay holds nothing");
    is_int(x.ndefer, 0, "unkeyed: nothing made to wait");
    world_end(&w);
}

static void test_failing_head(void)
{
    world w;
    claim_ctx x;
    int64_t head, k2, k3, u;

    world_start(&w, 0);
    /* The key's head failed twice and retries in 5 s (as the retry mark
     * leaves it: pending, attempts 2, token 2, available_at + backoff). */
    head = put_row(&w, "k-head", "k", -1000, -1000);
    th_sql_exec(w.db,
                "UPDATE outbox SET attempts = 2, lease_token = 2, last_error = 'boom', available_at = %lld "
                "WHERE seq = %lld",
                (long long)(w.now + 5000), (long long)head);
    k2 = put_row(&w, "k-2", "k", -900, -900);
    k3 = put_row(&w, "k-3", "k", -800, -800);
    u = put_row(&w, "u", NULL, -700, -700);

    is_int(select_rows(&w, &x, 10), 0, "failing head: the choice succeeds");
    is_str(chosen_seqs(&x), "4", "failing head: only the unkeyed row is chosen");
    ok(cand_of(&x, head) == NULL, "failing head: the head itself is not due: not a candidate");
    is_int(fate_of(&x, k2), C_SEEN, "failing head: the key's next row is held");
    is_int(fate_of(&x, k3), C_SEEN, "failing head: and the one after it");
    is_int(deferred_of(&x, k2), 1, "failing head: the next row is made to wait");
    is_int(deferred_of(&x, k3), 1, "failing head: and the one after it");
    is_int(avail_of(&w, k2), 5000, "failing head: the next row due no earlier than the head's retry");
    is_int(avail_of(&w, k3), 5000, "failing head: the one after it too");
    is_int(fate_of(&x, u), C_CHOSEN, "failing head: the unkeyed row goes");
    is_int(avail_of(&w, head), 5000, "failing head: the head's own retry time is untouched");
    is_int(cursor_of(&w), 5, "failing head: the cursor moves past every row seen");
    is_int(x.simple, 0, "failing head: a waiting row: the full way");
    world_end(&w);
}

static void test_same_key_in_batch(void)
{
    world w;
    claim_ctx x;
    int64_t a, b, c;
    const cand *cb, *cc;

    world_start(&w, 0);
    a = put_row(&w, "a", "k", -1000, -1000);
    b = put_row(&w, "b", "k", -900, -900);
    c = put_row(&w, "c", "other", -800, -800);
    is_int(select_rows(&w, &x, 10), 0, "one key twice: the choice succeeds");
    is_str(chosen_seqs(&x), "1,2,3", "one key twice: all chosen, in seq order");
    cb = cand_of(&x, b);
    cc = cand_of(&x, c);
    is_int(cand_of(&x, a)->prev, -1, "one key twice: the first is behind nothing");
    ok(cb && cb->prev == cand_index(&x, a) && !cb->after, "one key twice: the second is behind the first (prev)");
    ok(cc && cc->prev == -1 && !cc->after, "one key twice: another key's row is behind nothing");
    is_int(x.ndefer, 0, "one key twice: nothing made to wait");
    is_int(x.simple, holds_nothing, "one key twice: the simple way iff the relay holds nothing");
    world_end(&w);
}

static void test_chained(int idempotent)
{
    const char *mode = idempotent ? "idempotent" : "chained";
    world w;
    claim_ctx x;
    int64_t own, next, u;
    const cand *c;
    msg *m;

    world_start(&w, idempotent);
    /* This relay's message of key k is on its way (leased, in the window). */
    own = put_row(&w, "own", "k", -1000, -1000);
    lease_row(&w, own, ME, 1, 30000);
    m = own_inflight(&w, own, 1, "k");
    next = put_row(&w, "next", "k", -900, -900);
    u = put_row(&w, "u", NULL, -800, -800);

    is_int(select_rows(&w, &x, 10), 0, "%s: the choice succeeds", mode);
    c = cand_of(&x, next);
    ok(cand_of(&x, own) == NULL, "%s: the message in flight is not a candidate (its lease is live)", mode);
    /* Idempotent mode chains too: the row is sent once the message in
     * flight is appended (idem_publish.c), not held back as a waiting row
     * to be claimed again on its own. */
    is_str(chosen_seqs(&x), "2,3", "%s: the key's next row is chosen, with the unkeyed one", mode);
    ok(c && c->after == m && c->prev == -1, "%s: it goes after this relay's message in flight", mode);
    is_int(deferred_of(&x, next), 0, "%s: not deferred", mode);
    is_int(fate_of(&x, u), C_CHOSEN, "%s: the unkeyed row goes", mode);
    world_end(&w);
}

/* The window's newest message of the key is not the one that holds the
 * lease (another token): the row cannot chain to it and waits. */
static void test_chain_stale(void)
{
    world w;
    claim_ctx x;
    int64_t own, next;

    world_start(&w, 0);
    own = put_row(&w, "own", "k", -1000, -1000);
    lease_row(&w, own, ME, 2, 30000);
    own_inflight(&w, own, 1, "k");
    next = put_row(&w, "next", "k", -900, -900);
    is_int(select_rows(&w, &x, 10), 0, "stale chain: the choice succeeds");
    is_str(chosen_seqs(&x), "", "stale chain: nothing chosen");
    ok(cand_of(&x, next) && !cand_of(&x, next)->after, "stale chain: the row is held, chained to nothing");
    is_int(avail_of(&w, next), -899, "stale chain: made a waiting row due at once");
    world_end(&w);
}

static void test_requeued(void)
{
    world w;
    claim_ctx x;
    int64_t first, second, third;

    world_start(&w, 0);
    first = put_row(&w, "first", "k", -1000, -1000);
    th_sql_exec(w.db,
                "UPDATE outbox SET state = 2, lease_token = 1, attempts = 1, published_at = %lld, "
                "stream_id = '1-0' WHERE seq = %lld",
                (long long)(w.now - 500), (long long)first);
    second = put_row(&w, "second", "k", -900, -900);
    third = put_row(&w, "third", "k", -800, -800);
    /* What outbox-replay requeue writes (tools/replay/main.c). */
    th_sql_exec(w.db,
                "UPDATE outbox SET state = 0, available_at = max(%lld, created_at + 1), attempts = 0, "
                "last_error = NULL, lease_owner = NULL, lease_until = NULL, "
                "lease_token = lease_token + (state = 1), replay_count = replay_count + 1, "
                "replayed_at = %lld, replay_reason = 'test' WHERE seq = %lld AND state = 2",
                (long long)w.now, (long long)w.now, (long long)first);

    is_int(select_rows(&w, &x, 10), 0, "requeued: the choice succeeds");
    is_str(chosen_seqs(&x), "1", "requeued: the requeued row is chosen");
    is_int(cand_of(&x, first) ? (int)cand_of(&x, first)->source : -1, S_WAITING,
           "requeued: found as a waiting row");
    is_int(fate_of(&x, second), C_SEEN, "requeued: the key's pending rows wait for it");
    is_int(fate_of(&x, third), C_SEEN, "requeued: all of them");
    ok(avail_of(&w, second) >= avail_of(&w, first) && avail_of(&w, third) >= avail_of(&w, first),
       "requeued: they are due no earlier than the requeued row (%lld, %lld ms, it %lld ms)",
       (long long)avail_of(&w, second), (long long)avail_of(&w, third), (long long)avail_of(&w, first));
    world_end(&w);
}

static void test_expired(void)
{
    world w;
    claim_ctx x;
    int64_t theirs, mine, u;
    const cand *c;

    world_start(&w, 0);
    theirs = put_row(&w, "theirs", NULL, -60000, -60000);
    lease_row(&w, theirs, OTHER, 3, -1);
    mine = put_row(&w, "mine", NULL, -60000, -60000);
    lease_row(&w, mine, ME, 1, -1);
    own_inflight(&w, mine, 1, NULL);
    u = put_row(&w, "u", NULL, -1000, -1000);

    is_int(select_rows(&w, &x, 10), 0, "expired: the choice succeeds");
    is_str(chosen_seqs(&x), "1,3", "expired: another owner's expired lease first, then the new row");
    c = cand_of(&x, theirs);
    ok(c && c->source == S_EXPIRED && c->fate == C_CHOSEN, "expired: the other owner's row is taken over");
    ok(cand_of(&x, mine) == NULL, "expired: this relay's own expired lease, still in flight, is skipped");
    is_int(fate_of(&x, u), C_CHOSEN, "expired: the new row goes too");
    world_end(&w);
}

static void test_delayed(void)
{
    world w;
    claim_ctx x;
    int64_t later, future, lk, lk2, u1, u2;

    world_start(&w, 0);
    later = put_row(&w, "later", NULL, -1000, 60000);    /* written with a later available_at */
    future = put_row(&w, "future", NULL, 5000, 5000);    /* created_at in the future: a new row not due */
    lk = put_row(&w, "later-k", "k", -1000, 60000);      /* a delayed keyed row ... */
    lk2 = put_row(&w, "after-later-k", "k", -900, -900); /* ... and its key's next row */
    u1 = put_row(&w, "u1", NULL, -800, -800);
    u2 = put_row(&w, "u2", NULL, -700, -700);

    is_int(select_rows(&w, &x, 10), 0, "delayed: the choice succeeds");
    is_str(chosen_seqs(&x), "5,6", "delayed: the unkeyed rows after them are chosen");
    ok(cand_of(&x, later) == NULL && cand_of(&x, lk) == NULL, "delayed: the waiting rows are not due: not seen");
    is_int(avail_of(&w, later), 60000, "delayed: its available_at untouched");
    is_int(fate_of(&x, future), C_SEEN, "delayed: a new row created in the future is not chosen");
    is_int(avail_of(&w, future), 5001, "delayed: it is made a waiting row due when it was created");
    is_int(fate_of(&x, lk2), C_SEEN, "delayed: a delayed keyed row holds its key's next row");
    is_int(avail_of(&w, lk2), 60000, "delayed: which becomes due no earlier than it");
    is_int(fate_of(&x, u1) == C_CHOSEN && fate_of(&x, u2) == C_CHOSEN, 1, "delayed: unkeyed rows are not blocked");
    world_end(&w);
}

/* A new row not due yet (created_at in the future, another writer's clock)
 * is in no index that a later row of its key looks up: the claim itself
 * remembers that it held the key back. */
static void test_future_head(void)
{
    world w;
    claim_ctx x;
    int64_t head, next, u;

    world_start(&w, 0);
    head = put_row(&w, "ahead", "k", 5000, 5000);
    next = put_row(&w, "behind", "k", -1000, -1000);
    u = put_row(&w, "u", NULL, -900, -900);
    is_int(select_rows(&w, &x, 10), 0, "future head: the choice succeeds");
    is_str(chosen_seqs(&x), "3", "future head: only the unkeyed row is chosen");
    is_int(fate_of(&x, head), C_SEEN, "future head: the key's first row is not due");
    is_int(fate_of(&x, next), C_SEEN, "future head: its next row, older by its clock, waits for it");
    is_int(avail_of(&w, head), 5001, "future head: the first row made a waiting row due when it was created");
    is_int(avail_of(&w, next), 5001, "future head: the next row due no earlier");
    is_int(fate_of(&x, u), C_CHOSEN, "future head: the unkeyed row goes");
    is_int(x.simple, holds_nothing, "future head: only new rows: the simple way iff the relay holds nothing");
    world_end(&w);
}

static void test_foreign_lease(void)
{
    world w;
    claim_ctx x;
    int64_t theirs, k2, k3, u;
    const cand *c2, *c3;

    world_start(&w, 0);
    theirs = put_row(&w, "theirs", "k", -1000, -1000);
    lease_row(&w, theirs, OTHER, 1, 30000);
    k2 = put_row(&w, "k-2", "k", -900, -900);
    k3 = put_row(&w, "k-3", "k", -800, -800);
    u = put_row(&w, "u", NULL, -700, -700);

    is_int(select_rows(&w, &x, 10), 0, "foreign lease: the choice succeeds");
    is_str(chosen_seqs(&x), "4", "foreign lease: only the unkeyed row is chosen");
    c2 = cand_of(&x, k2);
    c3 = cand_of(&x, k3);
    ok(c2 && c2->fate == C_SEEN && !c2->after && c2->prev == -1, "foreign lease: the key's next row is held");
    ok(c3 && c3->fate == C_SEEN && !c3->after && c3->prev == -1, "foreign lease: and the one after it");
    is_int(avail_of(&w, k2), -899, "foreign lease: made a waiting row, due at once");
    is_int(avail_of(&w, k3), -799, "foreign lease: the one after it too");
    is_int(fate_of(&x, u), C_CHOSEN, "foreign lease: the unkeyed row goes");
    is_int(cursor_of(&w), 5, "foreign lease: the cursor moves past every row seen");
    world_end(&w);
}

/* The whole claim: one UPDATE ... RETURNING, messages in the order chosen,
 * invalid rows dead-lettered in the same transaction. */
static void test_claim_full(void)
{
    world w;
    msg **out = NULL, *settled = NULL, *m;
    size_t nout = 0, ndead = 0, ndeferred = 0, i, nsettled = 0;
    int64_t theirs, a, bad_topic, big, b, k2;
    int rc;

    world_start(&w, 0);
    theirs = put_row(&w, "theirs", NULL, -60000, -60000);
    lease_row(&w, theirs, OTHER, 3, -1);
    a = put_row(&w, "a", "k", -1000, -1000);
    th_sql_exec(w.db, "PRAGMA ignore_check_constraints = ON"); /* written past the table's checks */
    th_sql_exec(w.db,
                "INSERT INTO outbox(id, topic, payload, created_at, available_at) VALUES ('bad-topic', 'no "
                "spaces{}', x'00', %lld, %lld)",
                (long long)(w.now - 950), (long long)(w.now - 950));
    bad_topic = (int64_t)sqlite3_last_insert_rowid(w.db);
    th_sql_exec(w.db, "PRAGMA ignore_check_constraints = OFF");
    b = put_row(&w, "b", "k", -900, -900);
    big = put_row(&w, "big", "j", -850, -850);
    th_sql_exec(w.db, "UPDATE outbox SET payload = zeroblob(101) WHERE seq = %lld", (long long)big);
    k2 = put_row(&w, "after-big", "j", -800, -800);

    th_sql_exec(w.db, "BEGIN IMMEDIATE");
    rc = outbox__claim(w.r, 10, w.now, &out, &nout, &ndead, &settled, &ndeferred);
    th_sql_exec(w.db, rc == 0 ? "COMMIT" : "ROLLBACK");
    is_int(rc, 0, "claim: succeeds");
    is_int(nout, 4, "claim: four messages to send");
    is_int(ndead, 2, "claim: two dead-lettered");
    is_int(ndeferred, 0, "claim: nothing made to wait");
    if (nout == 4) {
        is_int(out[0]->seq, theirs, "claim: the takeover first");
        ok(out[0]->took_over && out[0]->token == 4, "claim: taken over with the next token (%lld)",
           (long long)out[0]->token);
        ok(out[1]->seq == a && out[2]->seq == b && out[3]->seq == k2, "claim: then the rows in seq order");
        ok(out[1]->key_next == out[2] && out[2]->behind && !out[1]->behind,
           "claim: the key's second message is linked behind the first");
        ok(!out[3]->behind && !out[3]->chain_after, "claim: a dead row holds nothing back");
    }
    for (m = settled; m; m = m->next) {
        nsettled++;
        ok(m->outcome == OUT_DEAD && (m->seq == bad_topic || m->seq == big), "claim: settled %lld is dead",
           (long long)m->seq);
    }
    is_int(nsettled, 2, "claim: both dead rows settled");
    is_int(th_sql_int(w.db,
                      "SELECT count(*) FROM outbox_messages WHERE state = 1 AND lease_owner = '%s' AND lease_until = %lld "
                      "AND seq IN (%lld, %lld, %lld, %lld)",
                      ME, (long long)(w.now + 30000), (long long)theirs, (long long)a, (long long)b,
                      (long long)k2),
           4, "claim: the claimed rows are sending, under this relay's lease");
    is_int(th_sql_int(w.db, "SELECT lease_token FROM outbox_messages WHERE seq = %lld", (long long)a), 1,
           "claim: a new row's first token is 1");
    is_int(th_sql_int(w.db,
                      "SELECT count(*) FROM outbox_messages WHERE state = 3 AND lease_owner IS NULL AND seq IN (%lld, %lld)",
                      (long long)bad_topic, (long long)big),
           2, "claim: the invalid rows are dead in the same transaction");
    is_int(th_sql_int(w.db, "SELECT instr(last_error, 'topic') > 0 FROM outbox_messages WHERE seq = %lld",
                      (long long)bad_topic),
           1, "claim: the bad topic's last_error names the topic");
    is_int(th_sql_int(w.db, "SELECT instr(last_error, 'payload') > 0 FROM outbox_messages WHERE seq = %lld",
                      (long long)big),
           1, "claim: the big payload's last_error names the payload");
    for (i = 0; i < nout; i++)
        outbox__msg_free(out[i]);
    free(out);
    while (settled) {
        m = settled->next;
        outbox__msg_free(settled);
        settled = m;
    }
    world_end(&w);
}

/* A batch lease of another relay: its rows as written are in no index; a
 * new row of one of its keys waits, a row of another key goes. */
static void test_foreign_batch(void)
{
    world w;
    claim_ctx x;
    int64_t b1, b2, k2, j, u;
    const cand *c;

    world_start(&w, 0);
    b1 = put_row(&w, "b-1", "k", -1000, -1000);
    b2 = put_row(&w, "b-2", NULL, -990, -990);
    other_batch(&w, b1, b2, 1, 30000, 1);
    k2 = put_row(&w, "k-2", "k", -900, -900);
    j = put_row(&w, "j", "j", -800, -800);
    u = put_row(&w, "u", NULL, -700, -700);

    is_int(select_rows(&w, &x, 10), 0, "foreign batch: the choice succeeds");
    ok(cand_of(&x, b1) == NULL && cand_of(&x, b2) == NULL, "foreign batch: its rows are not walked again");
    c = cand_of(&x, k2);
    ok(c && c->fate == C_SEEN, "foreign batch: a new row of one of its keys is held");
    is_int(avail_of(&w, k2), -899, "foreign batch: made a waiting row, due at once");
    is_int(fate_of(&x, j), C_CHOSEN, "foreign batch: a row of another key goes");
    is_int(fate_of(&x, u), C_CHOSEN, "foreign batch: the unkeyed row goes");
    world_end(&w);
}

/* An expired batch lease of another relay is taken over: its rows as
 * written are candidates (S_TAKEN) before anything else; a row of it beyond
 * what the claim wants leaves it as a waiting row with the batch's token. */
static void test_taken_batch(void)
{
    world w;
    claim_ctx x;
    int64_t t1, t2, t3, n;
    const cand *c;

    world_start(&w, 0);
    t1 = put_row(&w, "t-1", "k", -1000, -1000);
    t2 = put_row(&w, "t-2", "k", -990, -990);
    t3 = put_row(&w, "t-3", NULL, -980, -980);
    other_batch(&w, t1, t3, 5, -1, 2);
    n = put_row(&w, "n", "k", -900, -900);

    is_int(select_rows(&w, &x, 2), 0, "taken batch: the choice succeeds");
    is_str(chosen_seqs(&x), "1,2", "taken batch: its rows first, in order, as many as wanted");
    c = cand_of(&x, t1);
    ok(c && c->source == S_TAKEN && x.taken && x.t_lo == t1 && x.t_token == 5, "taken batch: the batch is the one taken");
    c = cand_of(&x, t2);
    ok(c && c->fate == C_CHOSEN && c->prev == cand_index(&x, t1), "taken batch: its key's second row goes after the first");
    c = cand_of(&x, t3);
    ok(c && c->fate == C_SEEN && c->deferred, "taken batch: the row past the claim's size leaves the batch");
    is_int(th_sql_int(w.db, "SELECT lease_token * 10 + attempts FROM outbox WHERE seq = %lld", (long long)t3), 52,
           "taken batch: with the batch's token and attempts");
    ok(cand_of(&x, n) == NULL, "taken batch: the claim is full before the new rows");
    world_end(&w);
}

/* A keyed row decided before outbox_stray runs (a taken-over batch's), while
 * outbox_key holds no row, then a row made pending again by hand that the
 * stray update makes a waiting row of another key: a later row of that key
 * must still find it (the claim looks at outbox_key again after the update,
 * OUTBOX__SQL_KEY_ANY). */
static void test_stray_key(void)
{
    world w;
    claim_ctx x;
    int64_t t1, s, n;
    const cand *c;

    world_start(&w, 0);
    t1 = put_row(&w, "t-1", "a", -1000, -1000);
    other_batch(&w, t1, t1, 5, -1, 1);
    s = put_row(&w, "s", "k", -500, -500);
    th_sql_exec(w.db, "UPDATE outbox SET lease_token = 1, attempts = 1 WHERE seq = %lld", (long long)s);
    /* Written after it with an earlier created_at: walked before it. */
    n = put_row(&w, "n", "k", -800, -800);

    is_int(select_rows(&w, &x, 10), 0, "stray key: the choice succeeds");
    c = cand_of(&x, t1);
    ok(c && c->source == S_TAKEN && c->fate == C_CHOSEN, "stray key: the taken batch's keyed row goes");
    c = cand_of(&x, s);
    ok(c && c->source == S_WAITING && c->fate == C_CHOSEN, "stray key: the stray row is a waiting row and goes");
    c = cand_of(&x, n);
    ok(c && c->source == S_NEW && c->fate == C_SEEN && c->deferred,
       "stray key: the later row of its key is held and made to wait");
    ok(avail_of(&w, n) >= avail_of(&w, s), "stray key: due no earlier than the stray row (%lld, it %lld ms)",
       (long long)avail_of(&w, n), (long long)avail_of(&w, s));
    world_end(&w);
}

static void cases(void)
{
    test_unkeyed();
    test_failing_head();
    test_same_key_in_batch();
    test_chained(0);
    test_chained(1);
    test_chain_stale();
    test_requeued();
    test_expired();
    test_delayed();
    test_future_head();
    test_foreign_lease();
    test_foreign_batch();
    test_taken_batch();
    test_stray_key();
    test_claim_full();
}

int main(void)
{
    for (holds_nothing = 0; holds_nothing < 2; holds_nothing++) {
        diag("%s", holds_nothing ? "holding nothing: the plan first" : "holding messages: the full claim");
        cases();
    }
    return tap_done();
}
