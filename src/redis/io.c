/*
 * redis_io.c: the bytes of a Redis connection (redis.h; redis_int.h): the
 * output buffer and its writes, reads, reply parsing and hand-out, and the
 * data of a TLS session. Loop thread.
 *
 * Output: commands are appended to `obuf` and go out in one uv_write per
 * loop turn. A check handle writes what the turn's I/O callbacks queued
 * (replies, a unit of work that ended) right after them, in the same turn;
 * an idle handle writes what timer callbacks queued, and keeps poll from
 * blocking until it has. With the idle handle alone, commands queued by
 * I/O callbacks waited for the next turn's timers to run first, and an
 * application's timer may commit with an fsync on the loop (0.5 ms and
 * more here).
 * At most one write is in flight; while it is, new commands accumulate in
 * `obuf` and are written as soon as the write completes.
 *
 * TLS (rediss://): after the TCP connect the state is ST_TLS until the
 * TLS handshake (tls.c) completes. Ciphertext from the socket is fed to the
 * session and the plaintext that comes out goes to the redisReader through
 * rbuf, which is free again once the session has copied the ciphertext.
 * On output, outbox__redis_io_flush() encrypts at most TLS_CHUNK bytes of
 * obuf (`osent` marks how far) and writes the records from wbuf, so a large
 * burst never sits in memory twice in full; the write's completion encrypts
 * the next chunk.
 */
#include <stdlib.h>
#include <string.h>

#include "redis/redis_int.h"
#include "util/array.h"

#define OBUF_MIN 4096
/* A write buffer larger than this is released after use instead of being
 * kept for the next write, so one burst does not pin memory forever. */
#define OBUF_KEEP_MAX (4 * 1024 * 1024)
/* Plaintext encrypted per write on a TLS connection. */
#define TLS_CHUNK (128 * 1024)

static void on_idle(uv_idle_t *h);
static void on_check(uv_check_t *h);
static void on_write(uv_write_t *req, int status);

/* ---- output -------------------------------------------------------------- */

int outbox__redis_io_obuf_reserve(outbox__redis *r, size_t extra)
{
    if (r->ocap - r->olen >= extra)
        return 0;
    if (r->osent > 0) {
        memmove(r->obuf, r->obuf + r->osent, r->olen - r->osent);
        r->olen -= r->osent;
        r->osent = 0;
        if (r->ocap - r->olen >= extra)
            return 0;
    }
    return OUTBOX__GROW(r->obuf, &r->ocap, r->olen, extra, OBUF_MIN);
}

void outbox__redis_io_schedule_flush(outbox__redis *r)
{
    if (r->write_active)
        return;
    if (!uv_is_active((uv_handle_t *)&r->idle))
        uv_idle_start(&r->idle, on_idle);
    if (!uv_is_active((uv_handle_t *)&r->check))
        uv_check_start(&r->check, on_check);
}

/* The TLS session failed; its error text says why. */
void outbox__redis_io_fail_tls(outbox__redis *r)
{
    outbox__redis_set_err(r, "%s", outbox__tls_errstr(r->tls));
    outbox__redis_fail_conn(r, OUTBOX_ETLS);
}

static void start_write(outbox__redis *r)
{
    uv_buf_t b = uv_buf_init(r->wbuf, (unsigned int)r->wlen);
    int rc = uv_write(&r->wreq, r->stream, &b, 1, on_write);
    if (rc < 0) {
        outbox__redis_set_err(r, "write: %s", uv_strerror(rc));
        outbox__redis_fail_conn(r, r->state == ST_CONNECTED ? OUTBOX_ECLOSED : OUTBOX_ECONNECT);
        return;
    }
    r->write_active = 1;
}

/* outbox__redis_io_flush() on a TLS connection: encrypts the next chunk of
 * obuf (once the TLS handshake is done) and writes whatever records the
 * session holds, its own handshake messages included. */
static void flush_tls(outbox__redis *r)
{
    size_t used = 0, n = r->olen - r->osent;
    if (r->state != ST_TLS && n > 0) {
        if (outbox__tls_encrypt(r->tls, r->obuf + r->osent, n < TLS_CHUNK ? n : TLS_CHUNK, &used) < 0) {
            outbox__redis_io_fail_tls(r);
            return;
        }
        r->osent += used;
        if (r->osent == r->olen)
            r->osent = r->olen = 0;
    }
    r->wlen = 0;
    if (outbox__tls_take(r->tls, &r->wbuf, &r->wlen, &r->wcap) < 0) {
        outbox__redis_set_err(r, "TLS: out of memory");
        outbox__redis_fail_conn(r, OUTBOX_ENOMEM);
        return;
    }
    if (r->wlen > 0)
        start_write(r);
}

/* Starts writing obuf if nothing is in flight. Only called from an entry. */
void outbox__redis_io_flush(outbox__redis *r)
{
    char *tmp;
    size_t tcap;
    if (r->write_active || !r->stream)
        return;
    if (r->state != ST_TLS && r->state != ST_HANDSHAKE && r->state != ST_CONNECTED)
        return;
    if (r->tls) {
        flush_tls(r);
        return;
    }
    if (r->olen == 0)
        return;
    /* Swap the buffers: the queued bytes become the write in flight and the
     * old write buffer collects what is queued meanwhile. */
    tmp = r->wbuf;
    tcap = r->wcap;
    r->wbuf = r->obuf;
    r->wcap = r->ocap;
    r->wlen = r->olen;
    r->obuf = tmp;
    r->ocap = tcap;
    r->olen = 0;
    start_write(r);
}

/* ---- reply objects -------------------------------------------------------- */

/*
 * The reader's object functions: hiredis' own, except that a top-level
 * reply that is a short string, status, error, integer or nil goes into the
 * connection's flat reply when it is free. Every reply is freed right after
 * its callback (process_replies), so one flat reply is enough; a reply
 * parsed while it is in use (a callback that makes the connection read
 * again) is allocated as before. hiredis allocated the reply and its string
 * separately: two mallocs and two frees for every XADD reply, about 700
 * instructions of the relay's work per message (docs/BENCHMARKS.md).
 * Elements of arrays are always allocated, so freeReplyObject frees an
 * array whole. A flat reply never reaches the reader's freeObject: the
 * reader holds a top-level reply only until the redisReaderGetReply that
 * completes it returns it, and a scalar is complete when it is created.
 */
static redisReply *flat_take(const redisReadTask *task, int type)
{
    outbox__redis *r = task->privdata;
    if (task->parent || !r || r->flat_busy)
        return NULL;
    memset(&r->flat, 0, sizeof r->flat);
    r->flat.type = type;
    r->flat_busy = 1;
    return &r->flat;
}

/* A new reply of hiredis' own, linked into its parent array. */
static redisReply *reply_new(const redisReadTask *task, int type)
{
    redisReply *o = calloc(1, sizeof *o);
    if (o && task->parent) {
        redisReply *parent = task->parent->obj;
        parent->element[task->idx] = o;
    }
    if (o)
        o->type = type;
    return o;
}

static void *create_string(const redisReadTask *task, char *str, size_t len)
{
    redisReply *o = len <= FLAT_STR_MAX ? flat_take(task, task->type) : NULL;
    char *buf;
    if (o) {
        buf = ((outbox__redis *)task->privdata)->flat_str;
    } else {
        if (!(buf = malloc(len + 1)))
            return NULL;
        if (!(o = reply_new(task, task->type))) {
            free(buf);
            return NULL;
        }
    }
    memcpy(buf, str, len);
    buf[len] = '\0';
    o->str = buf;
    o->len = len;
    return o;
}

static void *create_array(const redisReadTask *task, int elements)
{
    redisReply *o = calloc(1, sizeof *o);
    if (!o)
        return NULL;
    o->type = REDIS_REPLY_ARRAY;
    if (elements > 0 && !(o->element = calloc((size_t)elements, sizeof *o->element))) {
        free(o);
        return NULL;
    }
    o->elements = elements > 0 ? (size_t)elements : 0;
    if (task->parent) {
        redisReply *parent = task->parent->obj;
        parent->element[task->idx] = o;
    }
    return o;
}

static void *create_integer(const redisReadTask *task, long long value)
{
    redisReply *o = flat_take(task, REDIS_REPLY_INTEGER);
    if (!o && !(o = reply_new(task, REDIS_REPLY_INTEGER)))
        return NULL;
    o->integer = value;
    return o;
}

static void *create_nil(const redisReadTask *task)
{
    redisReply *o = flat_take(task, REDIS_REPLY_NIL);
    return o ? o : reply_new(task, REDIS_REPLY_NIL);
}

static void free_object(void *o)
{
    freeReplyObject(o);
}

redisReplyObjectFunctions outbox__redis_io_reader_fns = {create_string, create_array, create_integer, create_nil,
                                                         free_object};

static void reply_free(outbox__redis *r, redisReply *reply)
{
    if (reply == &r->flat)
        r->flat_busy = 0;
    else
        freeReplyObject(reply);
}

static void process_replies(outbox__redis *r);

static void on_check(uv_check_t *h)
{
    outbox__redis *r = h->data;
    outbox__redis_enter(r);
    uv_check_stop(&r->check);
    outbox__redis_io_flush(r);
    outbox__redis_leave(r);
}

static void on_idle(uv_idle_t *h)
{
    outbox__redis *r = h->data;
    outbox__redis_enter(r);
    uv_idle_stop(&r->idle);
    outbox__redis_io_flush(r);
    r->turn_budget = REPLIES_PER_TURN;
    if (r->more_replies) {
        r->more_replies = 0;
        process_replies(r);
    }
    outbox__redis_leave(r);
}

static void on_write(uv_write_t *req, int status)
{
    outbox__redis *r = req->data;
    outbox__redis_enter(r);
    r->write_active = 0;
    if (status < 0) {
        /* UV_ECANCELED: the stream was closed on purpose; already handled. */
        if (status != UV_ECANCELED && (r->state == ST_TLS || r->state == ST_HANDSHAKE || r->state == ST_CONNECTED)) {
            outbox__redis_set_err(r, "write: %s", uv_strerror(status));
            outbox__redis_fail_conn(r, r->state == ST_CONNECTED ? OUTBOX_ECLOSED : OUTBOX_ECONNECT);
        }
    } else {
        r->wlen = 0;
        if (r->wcap > OBUF_KEEP_MAX) {
            free(r->wbuf);
            r->wbuf = NULL;
            r->wcap = 0;
        }
        outbox__redis_io_flush(r);
    }
    outbox__redis_leave(r);
}


/* A pub/sub message: it answers no command. */
static int is_push(const redisReply *reply)
{
    const redisReply *k;
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 3)
        return 0;
    k = reply->element[0];
    return k->type == REDIS_REPLY_STRING &&
           ((k->len == 7 && memcmp(k->str, "message", 7) == 0) || (k->len == 8 && memcmp(k->str, "pmessage", 8) == 0));
}

static void process_replies(outbox__redis *r)
{
    while ((r->state == ST_HANDSHAKE || r->state == ST_CONNECTED) && !r->close_requested) {
        void *obj = NULL;
        redisReply *reply;
        pending p;
        if (r->turn_budget == 0) {
            r->more_replies = 1;
            uv_idle_start(&r->idle, on_idle);
            return;
        }
        r->turn_budget--;
        if (redisReaderGetReply(r->reader, &obj) != REDIS_OK) {
            int oom = r->reader->err == REDIS_ERR_OOM;
            outbox__redis_set_err(r, "%s: %s",
                                  r->state == ST_HANDSHAKE ? "handshake: protocol error" : "protocol error",
                                  r->reader->errstr);
            outbox__redis_fail_conn(r, oom ? OUTBOX_ENOMEM
                                       : r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_EPROTO);
            return;
        }
        if (!obj)
            return;
        reply = obj;
        if (r->push_cb && r->state == ST_CONNECTED && is_push(reply)) {
            r->push_cb(r, reply, r->push_data);
            reply_free(r, reply);
            continue;
        }
        if (r->ring_count == 0) {
            reply_free(r, reply);
            outbox__redis_set_err(r, "protocol error: reply without a pending command");
            outbox__redis_fail_conn(r, r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_EPROTO);
            return;
        }
        p = outbox__redis_ring_pop(r);
        if (r->ring_count == 0 && r->state == ST_CONNECTED)
            outbox__redis_stop_timer(r);
        if (p.kind == K_USER)
            outbox__redis_call_reply(r, &p, 0, reply);
        else if (p.kind != K_NUDGE)
            outbox__redis_conn_handshake_reply(r, &p, reply);
        reply_free(r, reply);
    }
}

void outbox__redis_io_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    outbox__redis *r = h->data;
    (void)suggested;
    *buf = uv_buf_init(r->rbuf, READ_BUF_SIZE);
}

/* The connection ended with a read error or EOF (nread < 0). */
static void read_failed(outbox__redis *r, ssize_t nread)
{
    int hs = r->state != ST_CONNECTED;
    const char *where = r->state == ST_TLS ? "TLS handshake: " : hs ? "handshake: " : "";
    const char *hint = "";
    if (r->tls && hs && outbox__tls_cert_requested(r->tls)) {
        /* A TLS 1.2 server may close without saying why. */
        outbox__redis_set_err(r, "TLS: the server asked for a client certificate and none is configured (set a "
                                 "certificate and key file); then it closed the connection");
        outbox__redis_fail_conn(r, OUTBOX_ETLS);
        return;
    }
    if (r->tls && outbox__tls_buffered(r->tls) > 0)
        hint = " in the middle of a TLS record";
    else if (!r->tls && r->url.host && !r->got_input && (nread == UV_ECONNRESET || nread == UV_EOF))
        hint = " before any reply (a TLS port? use rediss://)"; /* a TLS server drops what is not TLS */
    if (nread == UV_EOF)
        outbox__redis_set_err(r, "%sconnection closed by the server%s", where, hint);
    else
        outbox__redis_set_err(r, "%sread: %s%s", where, uv_strerror((int)nread), hint);
    outbox__redis_fail_conn(r, hs ? OUTBOX_ECONNECT : OUTBOX_ECLOSED);
}


/* Ciphertext arrived (TLS connections). */
static void tls_input(outbox__redis *r, const char *data, size_t len)
{
    size_t n;
    int rc;
    if (outbox__tls_feed(r->tls, data, len) < 0) {
        outbox__redis_set_err(r, "TLS: out of memory");
        outbox__redis_fail_conn(r, OUTBOX_ENOMEM);
        return;
    }
    if (r->state == ST_TLS) {
        outbox__redis_conn_tls_step(r);
        if (r->state == ST_TLS || !r->tls)
            return;
    }
    /* The session copied the ciphertext: rbuf is free for the plaintext. */
    while ((rc = outbox__tls_read(r->tls, r->rbuf, READ_BUF_SIZE, &n)) == 0) {
        if (redisReaderFeed(r->reader, r->rbuf, n) != REDIS_OK) {
            outbox__redis_set_err(r, "out of memory buffering a reply");
            outbox__redis_fail_conn(r, OUTBOX_ENOMEM);
            return;
        }
    }
    if (rc == OUTBOX__TLS_EOF) {
        outbox__redis_set_err(r, "%sconnection closed by the server (TLS close_notify)",
                              r->state == ST_HANDSHAKE ? "handshake: " : "");
        outbox__redis_fail_conn(r, r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_ECLOSED);
        return;
    }
    if (rc < 0) {
        outbox__redis_io_fail_tls(r);
        return;
    }
    process_replies(r);
    /* Reading may have produced records to send (a key update), or let a
     * write that waited for input go on. */
    if (r->tls && (outbox__tls_pending(r->tls) > 0 || r->olen > r->osent))
        outbox__redis_io_flush(r);
}

void outbox__redis_io_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    outbox__redis *r = s->data;
    if (nread == 0)
        return;
    outbox__redis_enter(r);
    if (s != r->stream || (r->state != ST_TLS && r->state != ST_HANDSHAKE && r->state != ST_CONNECTED)) {
        /* late data for a connection already given up */
    } else if (nread < 0) {
        read_failed(r, nread);
    } else {
        r->last_rx = uv_now(r->loop); /* for the stall watch (conn.c) */
        if (r->tls) {
            tls_input(r, buf->base, (size_t)nread);
        } else if (redisReaderFeed(r->reader, buf->base, (size_t)nread) != REDIS_OK) {
            outbox__redis_set_err(r, "out of memory buffering a reply");
            outbox__redis_fail_conn(r, OUTBOX_ENOMEM);
        } else {
            r->got_input = 1;
            process_replies(r);
        }
    }
    outbox__redis_leave(r);
}
