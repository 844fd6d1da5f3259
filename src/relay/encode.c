/*
 * encode.c: what the relay does with one claimed row before sending it:
 * the message built from the row, the checks that dead-letter a row written
 * past the schema's checks, and the XADD command with its envelope. Pure
 * functions of the row and the settings; run on the unit's worker thread.
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outbox/envelope.h"
#include "outbox/writer.h"
#include "relay_int.h"


/* Copies an error for last_error: short, printable, one line. */
char *outbox__safe_text_into(char *out, const char *s, size_t len)
{
    size_t n = len > 200 ? 200 : len, i;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        out[i] = (c < ' ' || c == 0x7f) ? ' ' : (char)c;
    }
    out[n] = '\0';
    return out;
}

char *outbox__safe_text(const char *s, size_t len)
{
    char *out = malloc((len > 200 ? 200 : len) + 1);
    return out ? outbox__safe_text_into(out, s, len) : NULL;
}

/* ------------------------------------------------------------------ */
/* claim */

/*
 * Messages live in chunks: one malloc for many messages (each with its
 * strings and its XADD command beside it), freed when the last of them is.
 * The claim's worker carves messages out of its open chunk; the loop thread
 * frees them (outbox__msg_release), so the count is atomic. The worker holds
 * one reference to the open chunk itself until it is full. A message bigger
 * than a quarter of a chunk gets a chunk of its own.
 */
#define CHUNK_BYTES (256u * 1024u)

struct msg_chunk {
    atomic_size_t refs;
    size_t used, cap;
    max_align_t data[];
};

static void chunk_unref(struct msg_chunk *c)
{
    if (c && atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1)
        free(c);
}

void outbox__msg_release(msg *m)
{
    if (!m->chunk) {
        free(m); /* allocated on its own (tests) */
        return;
    }
    chunk_unref(m->chunk);
}

void outbox__encode_free(outbox_relay *r)
{
    chunk_unref(r->cw.mchunk);
    r->cw.mchunk = NULL;
}

/* A zeroed message with room for extra bytes after it. */
static msg *msg_alloc(outbox_relay *r, size_t extra)
{
    const size_t align = _Alignof(max_align_t);
    size_t need = (sizeof(msg) + extra + align - 1) & ~(align - 1);
    struct msg_chunk *c = r->cw.mchunk;
    msg *m;
    if (need > CHUNK_BYTES / 4) {
        c = malloc(sizeof *c + need);
        if (!c)
            return NULL;
        atomic_init(&c->refs, 0);
        c->used = c->cap = need;
        m = (msg *)c->data;
    } else {
        if (!c || c->cap - c->used < need) {
            c = malloc(sizeof *c + CHUNK_BYTES);
            if (!c)
                return NULL;
            atomic_init(&c->refs, 1); /* the worker's */
            c->used = 0;
            c->cap = CHUNK_BYTES;
            chunk_unref(r->cw.mchunk);
            r->cw.mchunk = c;
        }
        m = (msg *)((char *)c->data + c->used);
        c->used += need;
    }
    atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    memset(m, 0, sizeof *m);
    m->chunk = c;
    return m;
}

/* ---- RESP, written by hand: "*argc", then "$len" and the bytes of each ---- */

static size_t dec_len(size_t v)
{
    size_t n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

static char *put_dec(char *p, size_t v)
{
    size_t n = dec_len(v), i;
    for (i = n; i > 0; i--) {
        p[i - 1] = (char)('0' + v % 10);
        v /= 10;
    }
    return p + n;
}

/* "$len\r\n" */
static char *put_bulk_header(char *p, size_t len)
{
    *p++ = '$';
    p = put_dec(p, len);
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

static char *put_bulk(char *p, const void *s, size_t len)
{
    p = put_bulk_header(p, len);
    memcpy(p, s, len);
    p += len;
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

static size_t bulk_size(size_t len)
{
    return 1 + dec_len(len) + 2 + len + 2;
}

static void envelope_of(const outbox_relay *r, const outbox__row *c, outbox_envelope *e)
{
    memset(e, 0, sizeof *e);
    e->version = OUTBOX_ENVELOPE_VERSION;
    e->id = c->id;
    e->topic = c->topic;
    e->key = c->key;
    e->key_len = c->klen;
    e->payload = c->payload;
    e->payload_len = c->plen;
    e->headers = c->headers;
    e->headers_len = c->hlen;
    e->created_at = c->created_at;
    e->db = r->cfg.s.db_name;
}

/* The size of the command's RESP bytes:
 * XADD <prefix><topic> [MAXLEN ~ N] * id <id> [db <name>] envelope <envelope>. */
static size_t command_size(const outbox_relay *r, size_t idl, size_t tl, size_t envlen, const char *maxlen,
                           size_t mlen)
{
    const char *db = r->cfg.s.db_name;
    size_t argc = (maxlen ? 10 : 7) + (db ? 2 : 0);
    return 1 + dec_len(argc) + 2 + bulk_size(4) + bulk_size(strlen(r->cfg.stream_prefix) + tl) +
           (maxlen ? bulk_size(6) + bulk_size(1) + bulk_size(mlen) : 0) + bulk_size(1) + bulk_size(2) +
           bulk_size(idl) + (db ? bulk_size(2) + bulk_size(strlen(db)) : 0) + bulk_size(8) + bulk_size(envlen);
}

/* Writes the command at p, the envelope straight into its last argument;
 * returns the end. */
static char *put_command(const outbox_relay *r, const outbox__row *c, const outbox_envelope *e, char *p, size_t idl,
                         size_t tl, size_t envlen, const char *maxlen, size_t mlen)
{
    size_t pl = strlen(r->cfg.stream_prefix);
    const char *db = r->cfg.s.db_name;
    *p++ = '*';
    p = put_dec(p, (maxlen ? 10 : 7) + (db ? 2 : 0));
    *p++ = '\r';
    *p++ = '\n';
    p = put_bulk(p, "XADD", 4);
    p = put_bulk_header(p, pl + tl);
    memcpy(p, r->cfg.stream_prefix, pl);
    memcpy(p + pl, c->topic, tl);
    p += pl + tl;
    *p++ = '\r';
    *p++ = '\n';
    if (maxlen) {
        p = put_bulk(p, "MAXLEN", 6);
        p = put_bulk(p, "~", 1);
        p = put_bulk(p, maxlen, mlen);
    }
    p = put_bulk(p, "*", 1);
    p = put_bulk(p, "id", 2);
    p = put_bulk(p, c->id, idl);
    if (db) {
        p = put_bulk(p, "db", 2);
        p = put_bulk(p, db, strlen(db));
    }
    p = put_bulk(p, "envelope", 8);
    p = put_bulk_header(p, envlen);
    p = outbox__envelope_put(e, p); /* envlen bytes: outbox__envelope_size said so */
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

/* Checks a row written by plain SQL against what the relay can publish;
 * returns NULL or a reason to dead-letter it. */
static const char *row_problem(const outbox_relay *r, const outbox__row *v, char *buf, size_t len)
{
    if (v->plen > r->cfg.s.max_payload) {
        snprintf(buf, len, "payload is %zu bytes, the relay's limit is %zu", v->plen, r->cfg.s.max_payload);
        return buf;
    }
    if (outbox_validate_topic(v->topic, buf, len) != 0)
        return buf;
    if (outbox_validate_id(v->id, buf, len) != 0)
        return buf;
    if (v->klen && outbox_validate_key(v->key, v->klen, buf, len) != 0)
        return buf;
    if (v->hlen && outbox_validate_headers(v->headers, v->hlen, buf, len) != 0)
        return buf;
    return NULL;
}

const outbox__row_cols outbox__claim_cols = {.seq = 0, .id = 1, .topic = 2, .key = 3, .payload = 4, .headers = 5,
                                              .created_at = 6, .token = 7, .attempts = 8, .replay_count = 9,
                                              .available_at = -1};

void outbox__row_read(sqlite3_stmt *st, const outbox__row_cols *cols, outbox__row *v)
{
    /* Each column once: every sqlite3_column_* call costs about as much as
     * a short memcpy, and a row is read for a claim and its encoding. */
    v->id = (const char *)sqlite3_column_text(st, cols->id);
    v->idl = (size_t)sqlite3_column_bytes(st, cols->id);
    v->topic = (const char *)sqlite3_column_text(st, cols->topic);
    v->tl = (size_t)sqlite3_column_bytes(st, cols->topic);
    v->key = NULL;
    v->klen = 0;
    if (sqlite3_column_type(st, cols->key) != SQLITE_NULL) {
        v->key = (const char *)sqlite3_column_text(st, cols->key);
        v->klen = (size_t)sqlite3_column_bytes(st, cols->key);
    }
    v->payload = sqlite3_column_blob(st, cols->payload);
    v->plen = (size_t)sqlite3_column_bytes(st, cols->payload);
    v->headers = NULL;
    v->hlen = 0;
    if (sqlite3_column_type(st, cols->headers) != SQLITE_NULL) {
        v->headers = sqlite3_column_blob(st, cols->headers);
        v->hlen = (size_t)sqlite3_column_bytes(st, cols->headers);
    }
    v->seq = sqlite3_column_int64(st, cols->seq);
    v->created_at = sqlite3_column_int64(st, cols->created_at);
    v->token = sqlite3_column_int64(st, cols->token);
    v->attempts = sqlite3_column_int64(st, cols->attempts);
    v->replay_count = sqlite3_column_int64(st, cols->replay_count);
    v->available_at = cols->available_at >= 0 ? sqlite3_column_int64(st, cols->available_at) : 0;
}

int outbox__encode_row(outbox_relay *r, sqlite3_stmt *st, const outbox__row_cols *cols, msg **out)
{
    outbox__row v;
    outbox__row_read(st, cols, &v);
    return outbox__encode(r, &v, out);
}

int outbox__encode(outbox_relay *r, const outbox__row *v, msg **out)
{
    outbox_envelope e;
    size_t idl = v->idl, tl = v->tl, envlen = 0, cmdlen = 0, mlen = 0;
    msg *m;
    char why[256], maxlen[24], *p;
    const char *problem, *ml = NULL;

    *out = NULL;
    if (!v->id || !v->topic)
        return OUTBOX_ENOMEM; /* NOT NULL columns: only a failed text conversion is NULL */
    /* Never publishable: dead in this same transaction (no command). */
    problem = row_problem(r, v, why, sizeof why);
    if (!problem) {
        envelope_of(r, v, &e);
        envlen = outbox__envelope_size(&e);
        if (r->cfg.s.maxlen) {
            mlen = (size_t)snprintf(maxlen, sizeof maxlen, "%llu", (unsigned long long)r->cfg.s.maxlen);
            ml = maxlen;
        }
        /* Idempotent mode sends the envelope later with the rest of its
         * stream's batch in one script call. */
        if (!r->cfg.s.idempotent)
            cmdlen = command_size(r, idl, tl, envlen, ml, mlen);
    }
    /* The message, its id, topic and key (NUL-terminated), its command. */
    m = msg_alloc(r, idl + 1 + tl + 1 + v->klen + 1 + cmdlen);
    if (!m)
        return OUTBOX_ENOMEM;
    m->r = r;
    m->seq = v->seq;
    m->token = v->token;
    m->attempts = v->attempts;
    m->replay_count = v->replay_count;
    m->created_at = v->created_at;
    m->id = (char *)(m + 1);
    memcpy(m->id, v->id, idl + 1);
    m->topic = m->id + idl + 1;
    memcpy(m->topic, v->topic, tl + 1);
    m->key = m->topic + tl + 1;
    if (v->klen)
        memcpy(m->key, v->key, v->klen);
    m->key[v->klen] = '\0';
    m->klen = v->klen;
    m->state = MSG_HELD;
    *out = m;
    if (problem) {
        m->outcome = OUT_DEAD;
        m->result = outbox__safe_text(problem, strlen(problem));
        return 0;
    }
    if (r->cfg.s.idempotent) {
        m->env = malloc(envlen);
        if (!m->env)
            return OUTBOX_ENOMEM;
        outbox__envelope_put(&e, m->env);
        m->envlen = envlen;
        return 0;
    }
    p = m->key + v->klen + 1;
    m->cmd = p;
    m->cmdlen = (size_t)(put_command(r, v, &e, p, idl, tl, envlen, ml, mlen) - p);
    return 0;
}
