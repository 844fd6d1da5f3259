/*
 * encode.c: what the relay does with one claimed row before sending it:
 * the message built from the row, the checks that dead-letter a row written
 * past the schema's checks, and the XADD command with its envelope. Pure
 * functions of the row and the settings; run on the unit's worker thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "outbox/envelope.h"
#include "outbox/writer.h"
#include "relay_int.h"


/* Copies an error for last_error: short, printable, one line. */
char *outbox__safe_text(const char *s, size_t len)
{
    size_t n = len > 200 ? 200 : len, i;
    char *out = malloc(n + 1);
    if (!out)
        return NULL;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        out[i] = (c < ' ' || c == 0x7f) ? ' ' : (char)c;
    }
    out[n] = '\0';
    return out;
}

/* ------------------------------------------------------------------ */
/* claim */

/* The fields of a row that the envelope and the checks need. */
typedef struct rowview {
    const char *id, *topic, *key;
    const void *payload, *headers;
    size_t klen, plen, hlen;
    int64_t created_at;
} rowview;


static int build_command(outbox_relay *r, msg *m, const rowview *c)
{
    outbox_envelope e;
    size_t need, envlen = 0;
    char stream[400], maxlen[24];
    const char *argv[10];
    size_t lens[10];
    int argc = 0, len;

    memset(&e, 0, sizeof e);
    e.version = OUTBOX_ENVELOPE_VERSION;
    e.id = c->id;
    e.topic = c->topic;
    e.key = c->key;
    e.key_len = c->klen;
    e.payload = c->payload;
    e.payload_len = c->plen;
    e.headers = c->headers;
    e.headers_len = c->hlen;
    e.created_at = c->created_at;
    need = outbox_envelope_max_size(&e);
    if (need > r->cw.envcap) {
        char *nb = realloc(r->cw.envbuf, need);
        if (!nb)
            return OUTBOX_ENOMEM;
        r->cw.envbuf = nb;
        r->cw.envcap = need;
    }
    if (outbox_envelope_encode(&e, r->cw.envbuf, r->cw.envcap, &envlen) != 0)
        return OUTBOX_EINVAL;
    if (r->cfg.s.idempotent) {
        /* Sent later with the rest of its stream's batch in one script call. */
        m->env = malloc(envlen ? envlen : 1);
        if (!m->env)
            return OUTBOX_ENOMEM;
        memcpy(m->env, r->cw.envbuf, envlen);
        m->envlen = envlen;
        return 0;
    }
    snprintf(stream, sizeof stream, "%s%s", r->cfg.stream_prefix, c->topic);
    argv[argc] = "XADD";
    lens[argc++] = 4;
    argv[argc] = stream;
    lens[argc++] = strlen(stream);
    if (r->cfg.s.maxlen) {
        snprintf(maxlen, sizeof maxlen, "%llu", (unsigned long long)r->cfg.s.maxlen);
        argv[argc] = "MAXLEN";
        lens[argc++] = 6;
        argv[argc] = "~";
        lens[argc++] = 1;
        argv[argc] = maxlen;
        lens[argc++] = strlen(maxlen);
    }
    argv[argc] = "*";
    lens[argc++] = 1;
    argv[argc] = "id";
    lens[argc++] = 2;
    argv[argc] = c->id;
    lens[argc++] = strlen(c->id);
    argv[argc] = "envelope";
    lens[argc++] = 8;
    argv[argc] = r->cw.envbuf;
    lens[argc++] = envlen;
    len = redisFormatCommandArgv(&m->cmd, argc, argv, lens);
    if (len < 0)
        return OUTBOX_ENOMEM;
    m->cmdlen = (size_t)len;
    return 0;
}

/* Checks a row written by plain SQL against what the relay can publish;
 * returns NULL or a reason to dead-letter it. */
static const char *row_problem(const outbox_relay *r, const rowview *v, char *buf, size_t len)
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

int outbox__encode_row(outbox_relay *r, sqlite3_stmt *st, msg **out)
{
    rowview v;
    size_t idl, tl;
    msg *m;
    char why[256];
    const char *problem;
    int e;

    *out = NULL;
    memset(&v, 0, sizeof v);
    v.id = (const char *)sqlite3_column_text(st, 1);
    idl = (size_t)sqlite3_column_bytes(st, 1);
    v.topic = (const char *)sqlite3_column_text(st, 2);
    tl = (size_t)sqlite3_column_bytes(st, 2);
    if (sqlite3_column_type(st, 3) != SQLITE_NULL) {
        v.key = (const char *)sqlite3_column_text(st, 3);
        v.klen = (size_t)sqlite3_column_bytes(st, 3);
    }
    v.payload = sqlite3_column_blob(st, 4);
    v.plen = (size_t)sqlite3_column_bytes(st, 4);
    if (sqlite3_column_type(st, 5) != SQLITE_NULL) {
        v.headers = sqlite3_column_blob(st, 5);
        v.hlen = (size_t)sqlite3_column_bytes(st, 5);
    }
    v.created_at = sqlite3_column_int64(st, 6);
    if (!v.id || !v.topic)
        return OUTBOX_ENOMEM; /* NOT NULL columns: only a failed text conversion is NULL */
    m = calloc(1, sizeof *m + idl + 1 + tl + 1 + v.klen + 1);
    if (!m)
        return OUTBOX_ENOMEM;
    m->r = r;
    m->seq = sqlite3_column_int64(st, 0);
    m->token = sqlite3_column_int64(st, 7);
    m->attempts = sqlite3_column_int64(st, 8);
    m->replay_count = sqlite3_column_int64(st, 9);
    m->created_at = v.created_at;
    m->id = (char *)(m + 1);
    memcpy(m->id, v.id, idl + 1);
    m->topic = m->id + idl + 1;
    memcpy(m->topic, v.topic, tl + 1);
    m->key = m->topic + tl + 1;
    if (v.klen)
        memcpy(m->key, v.key, v.klen);
    m->key[v.klen] = '\0';
    m->klen = v.klen;
    m->state = MSG_HELD;
    *out = m;
    problem = row_problem(r, &v, why, sizeof why);
    if (!problem) {
        e = build_command(r, m, &v);
        if (e == OUTBOX_ENOMEM)
            return e;
        if (e != 0) {
            /* The row passed every check, so this is the relay's own fault:
             * visible and replayable as a dead row, never a claim that fails
             * for good. */
            snprintf(why, sizeof why, "cannot encode the envelope: %s", outbox_strerror(e));
            problem = why;
        }
    }
    if (problem) {
        /* Never publishable: dead in this same transaction. */
        m->outcome = OUT_DEAD;
        m->result = outbox__safe_text(problem, strlen(problem));
    }
    return 0;
}
