/*
 * redis.c: one Redis connection driven by libuv (see redis.h for the
 * contract).
 *
 * Structure. Every entry from libuv (resolver, connect, read, write, timer,
 * idle and close callbacks) runs between enter() and leave(). While that
 * depth is non-zero, outbox__redis_close() only records the request; leave()
 * then tears the connection down once the outermost entry unwinds. This is
 * hiredis' IN_CALLBACK/FREEING scheme: a callback may close the object that
 * is calling it without the caller's stack touching freed memory.
 *
 * The memory goes only when every libuv handle has delivered its close
 * callback and no getaddrinfo request is outstanding (`refs` counts them),
 * so libuv never calls back into freed memory.
 *
 * Pending commands live in a ring buffer in the order they were written;
 * Redis answers in the same order, so each reply pops the head. The
 * handshake (AUTH, SELECT, CLIENT SETNAME) goes through the same queue with
 * internal entries.
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
 * On output, flush() encrypts at most TLS_CHUNK bytes of obuf (`osent`
 * marks how far) and writes the records from wbuf, so a large burst never
 * sits in memory twice in full; the write's completion encrypts the next
 * chunk.
 *
 * Deadlines: a single timer. Before the connection is up it is the connect
 * timeout. Afterwards it is armed for the earliest deadline among pending
 * commands. Because replies arrive in order, one expired command means the
 * connection is stuck, so the whole connection fails with ETIMEDOUT. The
 * timer is re-armed lazily: only when it fires is the queue scanned for the
 * next deadline, so a reply costs O(1).
 */
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "redis.h"

#define READ_BUF_SIZE (64 * 1024)
/* Replies handed to callbacks per loop turn: a long pipeline of replies
 * would otherwise hold the loop for tens of milliseconds. The rest stays
 * parsed-later in the reader and goes out at the next turn (idle handle). */
#define REPLIES_PER_TURN 1024
#define RING_MIN 64
#define OBUF_MIN 4096
/* A write buffer larger than this is released after use instead of being
 * kept for the next write, so one burst does not pin memory forever. */
#define OBUF_KEEP_MAX (4 * 1024 * 1024)
/* Plaintext encrypted per write on a TLS connection. */
#define TLS_CHUNK (128 * 1024)

enum state {
    ST_NEW,        /* created, connect() not called */
    ST_RESOLVING,  /* uv_getaddrinfo in flight */
    ST_CONNECTING, /* uv_tcp_connect / uv_pipe_connect in flight */
    ST_TLS,        /* connected, TLS handshake in progress (rediss://) */
    ST_HANDSHAKE,  /* connected, waiting for AUTH/SELECT/SETNAME replies */
    ST_CONNECTED,  /* usable */
    ST_FAILED,     /* connect or connection failed; waiting for close() */
    ST_CLOSING     /* close() done its part; waiting for handles to close */
};

enum kind { K_USER = 0, K_AUTH, K_SELECT, K_SETNAME, K_PING };

typedef struct pending {
    outbox__redis_reply_cb cb;
    void *data;
    uint64_t deadline;   /* loop time in ms; 0 = none */
    uint64_t timeout_ms; /* for the error message */
    int kind;
} pending;

struct outbox__redis {
    uv_loop_t *loop;
    outbox__redis_url url;
    uint64_t connect_timeout_ms;
    uint64_t reply_timeout_ms;
    char *client_name;
    outbox__tls_config *tls_cfg; /* a reference; NULL without TLS */
    void *data;

    outbox__redis_connect_cb connect_cb;
    outbox__redis_disconnect_cb disconnect_cb;
    outbox__redis_close_cb close_cb;
    void *close_data;

    enum state state;
    int connect_cb_called;
    int close_requested;
    int in_callback; /* depth of entries from libuv */
    int refs;        /* handles not yet closed + outstanding getaddrinfo */

    uv_timer_t timer;
    int timer_armed; /* reply deadline timer armed (connected state) */
    uint64_t timer_due;
    int deferred_status; /* a failure to report from the timer, see fail_soon() */

    uv_idle_t idle; /* flushes output once per loop turn; resumes paused reads */
    uv_check_t check; /* flushes what I/O callbacks queued, in the same turn */
    unsigned turn_budget; /* replies still to hand out in this loop turn */
    int more_replies;     /* parsed input waits for the next turn */

    uv_getaddrinfo_t gai;
    int gai_active;
    struct addrinfo *ai_head, *ai_next;

    uv_stream_t *stream; /* malloc'd uv_tcp_t or uv_pipe_t; NULL when none */
    uv_connect_t creq;

    uv_write_t wreq;
    int write_active;
    char *obuf; /* queued output */
    size_t olen, ocap;
    size_t osent; /* TLS: bytes of obuf already encrypted */
    char *wbuf; /* the write in flight */
    size_t wlen, wcap;

    char *rbuf; /* READ_BUF_SIZE, reused by every read */
    redisReader *reader;
    int got_input; /* plaintext: a byte arrived (else a reset hints at a TLS port) */
    outbox__tls *tls; /* the TLS session while connected */

    pending *ring;
    size_t ring_cap; /* a power of two */
    size_t ring_head;
    size_t ring_count;
    int hs_remaining;

    char errstr[256];

    outbox__redis_push_cb push_cb; /* pub/sub messages, see is_push() */
    void *push_data;
};

static void on_timer(uv_timer_t *t);
static void on_idle(uv_idle_t *h);
static void on_check(uv_check_t *h);
static void on_write(uv_write_t *req, int status);
static void on_connect(uv_connect_t *req, int status);
static int try_next_address(outbox__redis *r);

static void set_err(outbox__redis *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(outbox__redis *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->errstr, sizeof r->errstr, fmt, ap);
    va_end(ap);
}

/* ---- lifetime ------------------------------------------------------------ */

static void destroy(outbox__redis *r)
{
    if (r->ai_head)
        uv_freeaddrinfo(r->ai_head);
    if (r->reader)
        redisReaderFree(r->reader);
    free(r->ring);
    free(r->obuf);
    free(r->wbuf);
    free(r->rbuf);
    free(r->client_name);
    outbox__tls_destroy(r->tls);
    outbox__tls_config_unref(r->tls_cfg);
    outbox__redis_url_free(&r->url);
    free(r);
}

/* Frees the object once close() was called, all handles are closed and no
 * entry is on the stack. Returns 1 if it did (r is gone). */
static int maybe_free(outbox__redis *r)
{
    outbox__redis_close_cb cb;
    void *data;
    if (r->state != ST_CLOSING || r->refs > 0 || r->in_callback > 0)
        return 0;
    cb = r->close_cb;
    data = r->close_data;
    destroy(r);
    if (cb)
        cb(data);
    return 1;
}

static void on_handle_closed(uv_handle_t *h)
{
    outbox__redis *r = h->data;
    r->refs--;
    maybe_free(r);
}

static void on_stream_closed(uv_handle_t *h)
{
    outbox__redis *r = h->data;
    free(h);
    r->refs--;
    maybe_free(r);
}

static void close_stream(outbox__redis *r)
{
    if (r->stream) {
        uv_close((uv_handle_t *)r->stream, on_stream_closed);
        r->stream = NULL;
    }
}

static void teardown(outbox__redis *r);

static void enter(outbox__redis *r)
{
    r->in_callback++;
}

/* Returns 1 if the object was freed. */
static int leave(outbox__redis *r)
{
    if (--r->in_callback > 0)
        return 0;
    if (r->close_requested && r->state != ST_CLOSING)
        teardown(r);
    return maybe_free(r);
}

/* ---- the pending queue --------------------------------------------------- */

static int ring_reserve(outbox__redis *r, size_t extra)
{
    pending *n;
    size_t cap, i;
    if (r->ring_count + extra <= r->ring_cap)
        return 0;
    cap = r->ring_cap ? r->ring_cap : RING_MIN;
    while (cap < r->ring_count + extra)
        cap *= 2;
    n = malloc(cap * sizeof *n);
    if (!n)
        return OUTBOX_ENOMEM;
    for (i = 0; i < r->ring_count; i++)
        n[i] = r->ring[(r->ring_head + i) & (r->ring_cap - 1)];
    free(r->ring);
    r->ring = n;
    r->ring_cap = cap;
    r->ring_head = 0;
    return 0;
}

/* Needs a prior ring_reserve(). */
static void ring_push(outbox__redis *r, const pending *p)
{
    r->ring[(r->ring_head + r->ring_count) & (r->ring_cap - 1)] = *p;
    r->ring_count++;
}

static pending ring_pop(outbox__redis *r)
{
    pending p = r->ring[r->ring_head];
    r->ring_head = (r->ring_head + 1) & (r->ring_cap - 1);
    r->ring_count--;
    return p;
}

/* ---- output -------------------------------------------------------------- */

static int obuf_reserve(outbox__redis *r, size_t extra)
{
    size_t cap;
    char *n;
    if (r->ocap - r->olen >= extra)
        return 0;
    if (r->osent > 0) {
        memmove(r->obuf, r->obuf + r->osent, r->olen - r->osent);
        r->olen -= r->osent;
        r->osent = 0;
        if (r->ocap - r->olen >= extra)
            return 0;
    }
    cap = r->ocap ? r->ocap : OBUF_MIN;
    while (cap - r->olen < extra) {
        if (cap > SIZE_MAX / 2)
            return OUTBOX_ENOMEM;
        cap *= 2;
    }
    n = realloc(r->obuf, cap);
    if (!n)
        return OUTBOX_ENOMEM;
    r->obuf = n;
    r->ocap = cap;
    return 0;
}

static void schedule_flush(outbox__redis *r)
{
    if (r->write_active)
        return;
    if (!uv_is_active((uv_handle_t *)&r->idle))
        uv_idle_start(&r->idle, on_idle);
    if (!uv_is_active((uv_handle_t *)&r->check))
        uv_check_start(&r->check, on_check);
}

static void fail_conn(outbox__redis *r, int status);

/* The TLS session failed; its error text says why. */
static void fail_tls(outbox__redis *r)
{
    set_err(r, "%s", outbox__tls_errstr(r->tls));
    fail_conn(r, OUTBOX_ETLS);
}

static void start_write(outbox__redis *r)
{
    uv_buf_t b = uv_buf_init(r->wbuf, (unsigned int)r->wlen);
    int rc = uv_write(&r->wreq, r->stream, &b, 1, on_write);
    if (rc < 0) {
        set_err(r, "write: %s", uv_strerror(rc));
        fail_conn(r, r->state == ST_CONNECTED ? OUTBOX_ECLOSED : OUTBOX_ECONNECT);
        return;
    }
    r->write_active = 1;
}

/* flush() on a TLS connection: encrypts the next chunk of obuf (once the
 * TLS handshake is done) and writes whatever records the session holds,
 * its own handshake messages included. */
static void flush_tls(outbox__redis *r)
{
    size_t used = 0, n = r->olen - r->osent;
    if (r->state != ST_TLS && n > 0) {
        if (outbox__tls_encrypt(r->tls, r->obuf + r->osent, n < TLS_CHUNK ? n : TLS_CHUNK, &used) < 0) {
            fail_tls(r);
            return;
        }
        r->osent += used;
        if (r->osent == r->olen)
            r->osent = r->olen = 0;
    }
    r->wlen = 0;
    if (outbox__tls_take(r->tls, &r->wbuf, &r->wlen, &r->wcap) < 0) {
        set_err(r, "TLS: out of memory");
        fail_conn(r, OUTBOX_ENOMEM);
        return;
    }
    if (r->wlen > 0)
        start_write(r);
}

/* Starts writing obuf if nothing is in flight. Only called from an entry. */
static void flush(outbox__redis *r)
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

static void process_replies(outbox__redis *r);

static void on_check(uv_check_t *h)
{
    outbox__redis *r = h->data;
    enter(r);
    uv_check_stop(&r->check);
    flush(r);
    leave(r);
}

static void on_idle(uv_idle_t *h)
{
    outbox__redis *r = h->data;
    enter(r);
    uv_idle_stop(&r->idle);
    flush(r);
    r->turn_budget = REPLIES_PER_TURN;
    if (r->more_replies) {
        r->more_replies = 0;
        process_replies(r);
    }
    leave(r);
}

static void on_write(uv_write_t *req, int status)
{
    outbox__redis *r = req->data;
    enter(r);
    r->write_active = 0;
    if (status < 0) {
        /* UV_ECANCELED: the stream was closed on purpose; already handled. */
        if (status != UV_ECANCELED && (r->state == ST_TLS || r->state == ST_HANDSHAKE || r->state == ST_CONNECTED)) {
            set_err(r, "write: %s", uv_strerror(status));
            fail_conn(r, r->state == ST_CONNECTED ? OUTBOX_ECLOSED : OUTBOX_ECONNECT);
        }
    } else {
        r->wlen = 0;
        if (r->wcap > OBUF_KEEP_MAX) {
            free(r->wbuf);
            r->wbuf = NULL;
            r->wcap = 0;
        }
        flush(r);
    }
    leave(r);
}

/* ---- failure ------------------------------------------------------------- */

static void arm_timer(outbox__redis *r, uint64_t deadline)
{
    uint64_t now = uv_now(r->loop);
    if (r->timer_armed && r->timer_due <= deadline)
        return;
    uv_timer_start(&r->timer, on_timer, deadline > now ? deadline - now : 0, 0);
    r->timer_armed = 1;
    r->timer_due = deadline;
}

static void stop_timer(outbox__redis *r)
{
    uv_timer_stop(&r->timer);
    r->timer_armed = 0;
}

static void call_reply(outbox__redis *r, const pending *p, int status, redisReply *reply)
{
    if (p->kind == K_USER && p->cb)
        p->cb(r, status, reply, p->data);
}

static void fail_pending(outbox__redis *r, int status)
{
    /* Pop before each call so that a callback sees an exact pending count and
     * a nested failure cannot call the same entry twice. */
    while (r->ring_count > 0) {
        pending p = ring_pop(r);
        call_reply(r, &p, status, NULL);
    }
}

/* Drops the transport; the object stays until close(). */
static void drop_transport(outbox__redis *r)
{
    stop_timer(r);
    uv_idle_stop(&r->idle);
    uv_check_stop(&r->check);
    close_stream(r);
    if (r->gai_active)
        uv_cancel((uv_req_t *)&r->gai);
    r->olen = 0;
    r->osent = 0;
    r->wlen = 0;
    outbox__tls_destroy(r->tls);
    r->tls = NULL;
}

/*
 * The connection attempt or connection failed with status (errstr already
 * set). Must run inside an entry (enter/leave), since it calls user
 * callbacks.
 */
static void fail_conn(outbox__redis *r, int status)
{
    enum state prev = r->state;
    if (prev == ST_FAILED || prev == ST_CLOSING || prev == ST_NEW)
        return;
    r->state = ST_FAILED;
    drop_transport(r);
    fail_pending(r, status);
    if (prev == ST_CONNECTED) {
        if (r->disconnect_cb && !r->close_requested)
            r->disconnect_cb(r, status, r->data);
    } else if (!r->connect_cb_called) {
        r->connect_cb_called = 1;
        if (r->connect_cb)
            r->connect_cb(r, status, r->data);
    }
}

/* Reports a failure found synchronously inside connect() from the next loop
 * turn, so connect() itself never calls connect_cb. */
static void fail_soon(outbox__redis *r, int status)
{
    r->deferred_status = status;
    stop_timer(r);
    uv_timer_start(&r->timer, on_timer, 0, 0);
}

/* close() part one: fail everything and close the handles. Runs with no
 * entry on the stack (from close() itself or from leave()). */
static void teardown(outbox__redis *r)
{
    enum state prev = r->state;
    r->state = ST_CLOSING;
    set_err(r, "closed");
    drop_transport(r);
    r->in_callback++;
    fail_pending(r, OUTBOX_ECLOSED);
    if (prev != ST_NEW && !r->connect_cb_called) {
        r->connect_cb_called = 1;
        if (r->connect_cb)
            r->connect_cb(r, OUTBOX_ECLOSED, r->data);
    }
    r->in_callback--;
    uv_close((uv_handle_t *)&r->timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->idle, on_handle_closed);
    uv_close((uv_handle_t *)&r->check, on_handle_closed);
}

/* ---- commands ------------------------------------------------------------ */

static int queue_command(outbox__redis *r, const char *cmd, size_t len, uint64_t timeout_ms,
                         outbox__redis_reply_cb cb, void *data, int kind)
{
    pending p;
    int rc;
    /* Reserve everything first: an error must leave no trace. */
    if ((rc = ring_reserve(r, 1)) || (rc = obuf_reserve(r, len)))
        return rc;
    memcpy(r->obuf + r->olen, cmd, len);
    r->olen += len;

    memset(&p, 0, sizeof p);
    p.cb = cb;
    p.data = data;
    p.kind = kind;
    if (kind == K_USER) {
        p.timeout_ms = timeout_ms ? timeout_ms : r->reply_timeout_ms;
        if (p.timeout_ms) {
            p.deadline = uv_now(r->loop) + p.timeout_ms;
            arm_timer(r, p.deadline);
        }
    }
    ring_push(r, &p);
    schedule_flush(r);
    return 0;
}

static int check_usable(const outbox__redis *r)
{
    switch (r->state) {
    case ST_CONNECTED:
        return r->close_requested ? OUTBOX_ECLOSED : 0;
    case ST_FAILED:
    case ST_CLOSING:
        return OUTBOX_ECLOSED;
    default:
        return r->close_requested ? OUTBOX_ECLOSED : OUTBOX_ESTATE;
    }
}

static int queue_argv(outbox__redis *r, int argc, const char **argv, const size_t *argvlen,
                      uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, int kind)
{
    char *cmd = NULL;
    int len, rc;
    len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);
    if (len < 0)
        return OUTBOX_ENOMEM;
    rc = queue_command(r, cmd, (size_t)len, timeout_ms, cb, data, kind);
    redisFreeCommand(cmd);
    return rc;
}

int outbox__redis_command_argv(outbox__redis *r, int argc, const char **argv, const size_t *argvlen,
                               uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    int rc, i;
    if (!r || argc < 1 || !argv)
        return OUTBOX_EINVAL;
    for (i = 0; i < argc; i++)
        if (!argv[i])
            return OUTBOX_EINVAL;
    if ((rc = check_usable(r)))
        return rc;
    return queue_argv(r, argc, argv, argvlen, timeout_ms, cb, data, K_USER);
}

int outbox__redis_command_raw(outbox__redis *r, const char *cmd, size_t len, uint64_t timeout_ms,
                              outbox__redis_reply_cb cb, void *data)
{
    int rc;
    if (!r || !cmd || len == 0)
        return OUTBOX_EINVAL;
    if ((rc = check_usable(r)))
        return rc;
    return queue_command(r, cmd, len, timeout_ms, cb, data, K_USER);
}

/* ---- replies ------------------------------------------------------------- */

static void connected(outbox__redis *r)
{
    r->state = ST_CONNECTED;
    stop_timer(r); /* the connect timeout */
    r->errstr[0] = '\0';
    if (r->ai_head) {
        uv_freeaddrinfo(r->ai_head);
        r->ai_head = r->ai_next = NULL;
    }
    r->connect_cb_called = 1;
    if (r->connect_cb)
        r->connect_cb(r, 0, r->data);
}

static void handshake_reply(outbox__redis *r, const pending *p, redisReply *reply)
{
    static const char *const names[] = {"", "AUTH", "SELECT", "CLIENT SETNAME", "PING"};
    if (reply->type == REDIS_REPLY_ERROR) {
        const char *msg = reply->str ? reply->str : "";
        int auth = p->kind == K_AUTH || strncmp(msg, "NOAUTH", 6) == 0 || strncmp(msg, "WRONGPASS", 9) == 0;
        set_err(r, "%s: %s", names[p->kind], msg);
        fail_conn(r, auth ? OUTBOX_EAUTH : OUTBOX_EREDIS);
        return;
    }
    if (--r->hs_remaining == 0)
        connected(r);
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
            set_err(r, "%s: %s", r->state == ST_HANDSHAKE ? "handshake: protocol error" : "protocol error",
                    r->reader->errstr);
            fail_conn(r, oom ? OUTBOX_ENOMEM : r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_EPROTO);
            return;
        }
        if (!obj)
            return;
        reply = obj;
        if (r->push_cb && r->state == ST_CONNECTED && is_push(reply)) {
            r->push_cb(r, reply, r->push_data);
            freeReplyObject(reply);
            continue;
        }
        if (r->ring_count == 0) {
            freeReplyObject(reply);
            set_err(r, "protocol error: reply without a pending command");
            fail_conn(r, r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_EPROTO);
            return;
        }
        p = ring_pop(r);
        if (r->ring_count == 0 && r->state == ST_CONNECTED)
            stop_timer(r);
        if (p.kind == K_USER)
            call_reply(r, &p, 0, reply);
        else
            handshake_reply(r, &p, reply);
        freeReplyObject(reply);
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
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
        set_err(r, "TLS: the server asked for a client certificate and none is configured (set a certificate "
                   "and key file); then it closed the connection");
        fail_conn(r, OUTBOX_ETLS);
        return;
    }
    if (r->tls && outbox__tls_buffered(r->tls) > 0)
        hint = " in the middle of a TLS record";
    else if (!r->tls && r->url.host && !r->got_input && (nread == UV_ECONNRESET || nread == UV_EOF))
        hint = " before any reply (a TLS port? use rediss://)"; /* a TLS server drops what is not TLS */
    if (nread == UV_EOF)
        set_err(r, "%sconnection closed by the server%s", where, hint);
    else
        set_err(r, "%sread: %s%s", where, uv_strerror((int)nread), hint);
    fail_conn(r, hs ? OUTBOX_ECONNECT : OUTBOX_ECLOSED);
}

static void start_handshake(outbox__redis *r);

/* Advances the TLS handshake; once it is done, the Redis handshake starts
 * over TLS. */
static void tls_step(outbox__redis *r)
{
    int rc = outbox__tls_handshake(r->tls);
    if (rc < 0) {
        fail_tls(r);
        return;
    }
    if (rc == 0)
        start_handshake(r);
    flush(r);
}

/* Ciphertext arrived (TLS connections). */
static void tls_input(outbox__redis *r, const char *data, size_t len)
{
    size_t n;
    int rc;
    if (outbox__tls_feed(r->tls, data, len) < 0) {
        set_err(r, "TLS: out of memory");
        fail_conn(r, OUTBOX_ENOMEM);
        return;
    }
    if (r->state == ST_TLS) {
        tls_step(r);
        if (r->state == ST_TLS || !r->tls)
            return;
    }
    /* The session copied the ciphertext: rbuf is free for the plaintext. */
    while ((rc = outbox__tls_read(r->tls, r->rbuf, READ_BUF_SIZE, &n)) == 0) {
        if (redisReaderFeed(r->reader, r->rbuf, n) != REDIS_OK) {
            set_err(r, "out of memory buffering a reply");
            fail_conn(r, OUTBOX_ENOMEM);
            return;
        }
    }
    if (rc == OUTBOX__TLS_EOF) {
        set_err(r, "%sconnection closed by the server (TLS close_notify)",
                r->state == ST_HANDSHAKE ? "handshake: " : "");
        fail_conn(r, r->state == ST_HANDSHAKE ? OUTBOX_ECONNECT : OUTBOX_ECLOSED);
        return;
    }
    if (rc < 0) {
        fail_tls(r);
        return;
    }
    process_replies(r);
    /* Reading may have produced records to send (a key update), or let a
     * write that waited for input go on. */
    if (r->tls && (outbox__tls_pending(r->tls) > 0 || r->olen > r->osent))
        flush(r);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    outbox__redis *r = s->data;
    if (nread == 0)
        return;
    enter(r);
    if (s != r->stream || (r->state != ST_TLS && r->state != ST_HANDSHAKE && r->state != ST_CONNECTED)) {
        /* late data for a connection already given up */
    } else if (nread < 0) {
        read_failed(r, nread);
    } else if (r->tls) {
        tls_input(r, buf->base, (size_t)nread);
    } else if (redisReaderFeed(r->reader, buf->base, (size_t)nread) != REDIS_OK) {
        set_err(r, "out of memory buffering a reply");
        fail_conn(r, OUTBOX_ENOMEM);
    } else {
        r->got_input = 1;
        process_replies(r);
    }
    leave(r);
}

/* ---- connecting ---------------------------------------------------------- */

static void start_handshake(outbox__redis *r)
{
    const char *argv[3];
    char db[16];
    int rc = 0;

    r->state = ST_HANDSHAKE;
    r->hs_remaining = 0;
    if (r->url.password) {
        int n = 0;
        argv[n++] = "AUTH";
        if (r->url.user)
            argv[n++] = r->url.user;
        argv[n++] = r->url.password;
        rc = queue_argv(r, n, argv, NULL, 0, NULL, NULL, K_AUTH);
        r->hs_remaining += !rc;
    }
    if (!rc && r->url.db != 0) {
        snprintf(db, sizeof db, "%d", r->url.db);
        argv[0] = "SELECT";
        argv[1] = db;
        rc = queue_argv(r, 2, argv, NULL, 0, NULL, NULL, K_SELECT);
        r->hs_remaining += !rc;
    }
    if (!rc && r->client_name) {
        argv[0] = "CLIENT";
        argv[1] = "SETNAME";
        argv[2] = r->client_name;
        rc = queue_argv(r, 3, argv, NULL, 0, NULL, NULL, K_SETNAME);
        r->hs_remaining += !rc;
    }
    if (!rc && r->tls && r->hs_remaining == 0) {
        argv[0] = "PING";
        rc = queue_argv(r, 1, argv, NULL, 0, NULL, NULL, K_PING);
        r->hs_remaining += !rc;
    }
    if (rc) {
        set_err(r, "handshake: out of memory");
        fail_conn(r, OUTBOX_ENOMEM);
    } else if (r->hs_remaining == 0) {
        connected(r);
    }
}

static void start_tls(outbox__redis *r)
{
    int rc = outbox__tls_create(&r->tls, r->tls_cfg, r->url.host);
    if (rc < 0) {
        set_err(r, rc == OUTBOX_ENOMEM ? "TLS: out of memory" : "TLS: cannot use '%s' as the server name",
                r->url.host);
        fail_conn(r, rc == OUTBOX_ENOMEM ? OUTBOX_ENOMEM : OUTBOX_ETLS);
        return;
    }
    r->state = ST_TLS;
    tls_step(r);
}

static void on_connect(uv_connect_t *req, int status)
{
    uv_stream_t *s = req->handle;
    outbox__redis *r = s->data;
    int rc;
    enter(r);
    if (s != r->stream || r->state != ST_CONNECTING) {
        /* an attempt abandoned by a timeout or close(): UV_ECANCELED */
    } else if (status < 0) {
        if (r->url.path)
            set_err(r, "connect %s: %s", r->url.path, uv_strerror(status));
        else
            set_err(r, "connect %s:%d: %s", r->url.host, r->url.port, uv_strerror(status));
        close_stream(r);
        if (!r->ai_next || try_next_address(r) < 0)
            fail_conn(r, OUTBOX_ECONNECT);
    } else if ((rc = uv_read_start(s, on_alloc, on_read)) < 0) {
        set_err(r, "read: %s", uv_strerror(rc));
        fail_conn(r, OUTBOX_ECONNECT);
    } else if (r->tls_cfg) {
        start_tls(r);
    } else {
        start_handshake(r);
    }
    leave(r);
}

/* Connects a new TCP handle to addr. Returns 0 or a libuv error (errstr
 * set). */
static int start_tcp(outbox__redis *r, const struct sockaddr *addr)
{
    uv_tcp_t *t = malloc(sizeof *t);
    int rc;
    if (!t) {
        set_err(r, "connect: out of memory");
        return UV_ENOMEM;
    }
    uv_tcp_init(r->loop, t);
    t->data = r;
    r->refs++;
    r->stream = (uv_stream_t *)t;
    uv_tcp_nodelay(t, 1);
    uv_tcp_keepalive(t, 1, 60);
    r->state = ST_CONNECTING;
    rc = uv_tcp_connect(&r->creq, t, addr, on_connect);
    if (rc < 0) {
        set_err(r, "connect %s:%d: %s", r->url.host, r->url.port, uv_strerror(rc));
        close_stream(r);
    }
    return rc;
}

/* Tries the remaining resolved addresses in order until one connect starts.
 * Returns 0, or <0 when none is left (errstr holds the last error). */
static int try_next_address(outbox__redis *r)
{
    while (r->ai_next) {
        struct addrinfo *ai = r->ai_next;
        r->ai_next = ai->ai_next;
        if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
            continue;
        if (start_tcp(r, ai->ai_addr) == 0)
            return 0;
    }
    return -1;
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    outbox__redis *r = req->data;
    r->gai_active = 0;
    r->refs--;
    enter(r);
    if (r->state != ST_RESOLVING) {
        if (res)
            uv_freeaddrinfo(res);
    } else if (status < 0) {
        set_err(r, "resolve %s: %s", r->url.host, uv_strerror(status));
        fail_conn(r, OUTBOX_ECONNECT);
    } else {
        r->ai_head = r->ai_next = res;
        set_err(r, "resolve %s: no IPv4 or IPv6 address", r->url.host);
        if (try_next_address(r) < 0)
            fail_conn(r, OUTBOX_ECONNECT);
    }
    leave(r);
}

int outbox__redis_connect(outbox__redis *r, outbox__redis_connect_cb connect_cb,
                          outbox__redis_disconnect_cb disconnect_cb)
{
    int rc;
    if (!r)
        return OUTBOX_EINVAL;
    if (r->state != ST_NEW || r->close_requested)
        return OUTBOX_ESTATE;
    r->connect_cb = connect_cb;
    r->disconnect_cb = disconnect_cb;
    r->errstr[0] = '\0';
    if (r->connect_timeout_ms)
        uv_timer_start(&r->timer, on_timer, r->connect_timeout_ms, 0);

    if (r->url.path) {
        uv_pipe_t *pp = malloc(sizeof *pp);
        if (!pp) {
            r->state = ST_CONNECTING;
            set_err(r, "connect: out of memory");
            fail_soon(r, OUTBOX_ENOMEM);
            return 0;
        }
        uv_pipe_init(r->loop, pp, 0);
        pp->data = r;
        r->refs++;
        r->stream = (uv_stream_t *)pp;
        r->state = ST_CONNECTING;
        uv_pipe_connect(&r->creq, pp, r->url.path, on_connect);
        return 0;
    }

    {
        /* A literal address needs no resolver (and no thread pool). */
        struct sockaddr_storage ss;
        char port[8];
        struct addrinfo hints;
        memset(&ss, 0, sizeof ss);
        if (uv_ip4_addr(r->url.host, r->url.port, (struct sockaddr_in *)&ss) == 0 ||
            (strchr(r->url.host, ':') &&
             uv_ip6_addr(r->url.host, r->url.port, (struct sockaddr_in6 *)&ss) == 0)) {
            if (start_tcp(r, (struct sockaddr *)&ss) < 0) {
                r->state = ST_CONNECTING;
                fail_soon(r, OUTBOX_ECONNECT);
            }
            return 0;
        }
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        snprintf(port, sizeof port, "%d", r->url.port);
        r->state = ST_RESOLVING;
        r->gai.data = r;
        rc = uv_getaddrinfo(r->loop, &r->gai, on_resolved, r->url.host, port, &hints);
        if (rc < 0) {
            set_err(r, "resolve %s: %s", r->url.host, uv_strerror(rc));
            fail_soon(r, OUTBOX_ECONNECT);
            return 0;
        }
        r->gai_active = 1;
        r->refs++;
    }
    return 0;
}

static void on_timer(uv_timer_t *t)
{
    outbox__redis *r = t->data;
    enter(r);
    r->timer_armed = 0;
    if (r->deferred_status) {
        int st = r->deferred_status;
        r->deferred_status = 0;
        fail_conn(r, st);
    } else if (r->state == ST_TLS) {
        if (outbox__tls_received(r->tls) == 0)
            set_err(r, "connect timeout after %llu ms: no answer to the TLS handshake (a port without TLS? use "
                       "redis://)",
                    (unsigned long long)r->connect_timeout_ms);
        else
            set_err(r, "connect timeout after %llu ms in the TLS handshake (the server stopped answering)",
                    (unsigned long long)r->connect_timeout_ms);
        fail_conn(r, OUTBOX_ETIMEDOUT);
    } else if (r->state == ST_RESOLVING || r->state == ST_CONNECTING || r->state == ST_HANDSHAKE) {
        set_err(r, "connect timeout after %llu ms", (unsigned long long)r->connect_timeout_ms);
        fail_conn(r, OUTBOX_ETIMEDOUT);
    } else if (r->state == ST_CONNECTED && r->ring_count > 0) {
        uint64_t now = uv_now(r->loop), next = 0;
        size_t i;
        const pending *expired = NULL;
        for (i = 0; i < r->ring_count; i++) {
            const pending *p = &r->ring[(r->ring_head + i) & (r->ring_cap - 1)];
            if (!p->deadline)
                continue;
            if (p->deadline <= now) {
                expired = p;
                break;
            }
            if (!next || p->deadline < next)
                next = p->deadline;
        }
        if (expired) {
            set_err(r, "reply timeout after %llu ms", (unsigned long long)expired->timeout_ms);
            fail_conn(r, OUTBOX_ETIMEDOUT);
        } else if (next) {
            arm_timer(r, next);
        }
    }
    leave(r);
}

/* ---- public -------------------------------------------------------------- */

void outbox__redis_options_defaults(outbox__redis_options *o)
{
    if (!o)
        return;
    memset(o, 0, sizeof *o);
    o->connect_timeout_ms = 5000;
    o->reply_timeout_ms = 10000;
    o->client_name = NULL;
    o->tls = NULL;
}

int outbox__redis_create(outbox__redis **out, uv_loop_t *loop, const outbox__redis_url *url,
                         const outbox__redis_options *opt, void *data)
{
    outbox__redis_options defaults;
    outbox__redis *r;
    struct sockaddr_un sa;

    if (out)
        *out = NULL;
    if (!out || !loop || !url)
        return OUTBOX_EINVAL;
    if (!url->host == !url->path || url->db < 0)
        return OUTBOX_EINVAL;
    if (url->path && strlen(url->path) >= sizeof sa.sun_path)
        return OUTBOX_EINVAL;
    if (url->host && (url->port < 1 || url->port > 65535 || !*url->host))
        return OUTBOX_EINVAL;
    if (!opt) {
        outbox__redis_options_defaults(&defaults);
        opt = &defaults;
    }
    if ((url->tls && !url->host) || (!url->tls && opt->tls))
        return OUTBOX_EINVAL;

    r = calloc(1, sizeof *r);
    if (!r)
        return OUTBOX_ENOMEM;
    r->loop = loop;
    r->data = data;
    r->connect_timeout_ms = opt->connect_timeout_ms;
    r->reply_timeout_ms = opt->reply_timeout_ms;
    if (url->tls) {
        int rc = opt->tls ? 0 : outbox__tls_config_create(&r->tls_cfg, NULL, NULL, 0);
        if (rc) {
            free(r);
            return rc;
        }
        if (opt->tls)
            r->tls_cfg = outbox__tls_config_ref(opt->tls);
    }
    if (outbox__redis_url_copy(&r->url, url) ||
        (opt->client_name && !(r->client_name = strdup(opt->client_name))) ||
        !(r->rbuf = malloc(READ_BUF_SIZE)) || !(r->reader = redisReaderCreate())) {
        destroy(r);
        return OUTBOX_ENOMEM;
    }
    /* Handles last: from here on the memory may only go via their close
     * callbacks. */
    uv_timer_init(loop, &r->timer);
    r->timer.data = r;
    uv_idle_init(loop, &r->idle);
    uv_check_init(loop, &r->check);
    r->turn_budget = REPLIES_PER_TURN;
    r->idle.data = r;
    r->check.data = r;
    r->wreq.data = r;
    r->refs = 3;
    r->state = ST_NEW;
    *out = r;
    return 0;
}

void outbox__redis_set_push_cb(outbox__redis *r, outbox__redis_push_cb cb, void *data)
{
    if (!r)
        return;
    r->push_cb = cb;
    r->push_data = data;
}

size_t outbox__redis_pending(const outbox__redis *r)
{
    return r ? r->ring_count : 0;
}

size_t outbox__redis_queued_bytes(const outbox__redis *r)
{
    return r ? r->olen - r->osent + r->wlen : 0;
}

int outbox__redis_is_connected(const outbox__redis *r)
{
    return r && r->state == ST_CONNECTED && !r->close_requested;
}

const char *outbox__redis_errstr(const outbox__redis *r)
{
    return r ? r->errstr : "";
}

const char *outbox__redis_failure_text(int status)
{
    if (status == OUTBOX_EAUTH)
        return "redis refused the credentials (check the URL's user and password)";
    if (status == OUTBOX_EREDIS)
        return "redis refused the connection set-up";
    if (status == OUTBOX_ETLS)
        return "TLS with redis failed";
    return "redis unreachable";
}

void outbox__redis_close(outbox__redis *r, outbox__redis_close_cb close_cb, void *data)
{
    if (!r || r->close_requested)
        return;
    r->close_requested = 1;
    r->close_cb = close_cb;
    r->close_data = data;
    if (r->in_callback > 0)
        return; /* leave() finishes this when the callback returns */
    teardown(r);
    maybe_free(r);
}
