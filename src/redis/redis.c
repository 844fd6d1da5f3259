/*
 * redis.c: one Redis connection driven by libuv (see redis.h for the
 * contract): the object itself. Create, close and freeing, the re-entrancy
 * guard, failure, the queue of pending commands and the deadline timer.
 * Connecting is in redis_conn.c, the bytes in and out in redis_io.c.
 * Loop thread.
 *
 * Structure. Every entry from libuv (resolver, connect, read, write, timer,
 * idle and close callbacks) runs between outbox__redis_enter() and
 * outbox__redis_leave(). While that depth is non-zero, outbox__redis_close()
 * only records the request; outbox__redis_leave() then tears the connection
 * down once the outermost entry unwinds. This is hiredis' IN_CALLBACK/FREEING
 * scheme: a callback may close the object that is calling it without the
 * caller's stack touching freed memory.
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
 * Deadlines: a single timer. Before the connection is up it is the connect
 * timeout. Afterwards a command's reply timeout counts from when it became
 * the oldest one waiting (queued on an empty queue, or the reply before it
 * came): replies arrive in order, so that is when the server owes it, and a
 * command queued behind a WAIT or behind a 1 MiB value on a slow link is
 * not given up while the ones before it are still being answered. (Counted
 * from when it was queued, eight 1 MiB XADDs on a 1 Mbit/s link expired
 * behind one another, and XADDs behind WAITs for unreachable replicas
 * expired every second.) One overdue reply means the connection is stuck,
 * so the whole connection fails with ETIMEDOUT. The timer is re-armed
 * lazily: when it fires it looks at the oldest command only, and a reply
 * costs O(1).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "redis/redis_int.h"

#define RING_MIN 64

void outbox__redis_set_err(outbox__redis *r, const char *fmt, ...)
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

void outbox__redis_close_stream(outbox__redis *r)
{
    if (r->stream) {
        uv_close((uv_handle_t *)r->stream, on_stream_closed);
        r->stream = NULL;
    }
}

static void teardown(outbox__redis *r);

void outbox__redis_enter(outbox__redis *r)
{
    r->in_callback++;
}

/* Returns 1 if the object was freed. */
int outbox__redis_leave(outbox__redis *r)
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

pending outbox__redis_ring_pop(outbox__redis *r)
{
    pending p = r->ring[r->ring_head];
    r->ring_head = (r->ring_head + 1) & (r->ring_cap - 1);
    r->ring_count--;
    r->nblocking -= p.blocking;
    if (r->ring_count > 0) {
        /* The next one is owed from now; the timer (if any) fires early and
         * looks again. */
        const pending *h = &r->ring[r->ring_head];
        r->head_since = uv_now(r->loop);
        if (h->deadline && !r->timer_armed && r->state == ST_CONNECTED)
            outbox__redis_arm_timer(r, r->head_since + h->timeout_ms);
    }
    return p;
}

/* ---- failure ------------------------------------------------------------- */

void outbox__redis_arm_timer(outbox__redis *r, uint64_t deadline)
{
    uint64_t now = uv_now(r->loop);
    if (r->timer_armed && r->timer_due <= deadline)
        return;
    uv_timer_start(&r->timer, outbox__redis_on_timer, deadline > now ? deadline - now : 0, 0);
    r->timer_armed = 1;
    r->timer_due = deadline;
}

void outbox__redis_stop_timer(outbox__redis *r)
{
    uv_timer_stop(&r->timer);
    r->timer_armed = 0;
}

void outbox__redis_call_reply(outbox__redis *r, const pending *p, int status, redisReply *reply)
{
    if (p->kind == K_USER && p->cb)
        p->cb(r, status, reply, p->data);
}

static void fail_pending(outbox__redis *r, int status)
{
    /* Pop before each call so that a callback sees an exact pending count and
     * a nested failure cannot call the same entry twice. */
    while (r->ring_count > 0) {
        pending p = outbox__redis_ring_pop(r);
        outbox__redis_call_reply(r, &p, status, NULL);
    }
}

/* Drops the transport; the object stays until close(). */
static void drop_transport(outbox__redis *r)
{
    outbox__redis_stop_timer(r);
    uv_idle_stop(&r->idle);
    uv_check_stop(&r->check);
    outbox__redis_conn_stall_stop(r);
    outbox__redis_close_stream(r);
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
 * set). Must run inside an entry (outbox__redis_enter/outbox__redis_leave), since it calls user
 * callbacks.
 */
void outbox__redis_fail_conn(outbox__redis *r, int status)
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
void outbox__redis_fail_soon(outbox__redis *r, int status)
{
    r->deferred_status = status;
    outbox__redis_stop_timer(r);
    uv_timer_start(&r->timer, outbox__redis_on_timer, 0, 0);
}

/* close() part one: fail everything and close the handles. Runs with no
 * entry on the stack (from close() itself or from outbox__redis_leave()). */
static void teardown(outbox__redis *r)
{
    enum state prev = r->state;
    r->state = ST_CLOSING;
    outbox__redis_set_err(r, "closed");
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
    uv_close((uv_handle_t *)&r->stall_timer, on_handle_closed);
}

/* ---- commands ------------------------------------------------------------ */

static int queue_command(outbox__redis *r, const char *cmd, size_t len, uint64_t timeout_ms,
                         outbox__redis_reply_cb cb, void *data, int kind)
{
    pending p;
    int rc;
    /* Reserve everything first: an error must outbox__redis_leave no trace. */
    if ((rc = ring_reserve(r, 1)) || (rc = outbox__redis_io_obuf_reserve(r, len)))
        return rc;
    memcpy(r->obuf + r->olen, cmd, len);
    r->olen += len;

    memset(&p, 0, sizeof p);
    p.cb = cb;
    p.data = data;
    p.kind = kind;
    if (kind == K_USER) {
        p.timeout_ms = timeout_ms ? timeout_ms : r->reply_timeout_ms;
        p.blocking = timeout_ms && timeout_ms > r->reply_timeout_ms;
        r->nblocking += p.blocking;
        if (p.timeout_ms) {
            p.deadline = uv_now(r->loop) + p.timeout_ms;
            outbox__redis_arm_timer(r, p.deadline);
        }
    }
    if (r->ring_count == 0)
        r->head_since = uv_now(r->loop);
    ring_push(r, &p);
    outbox__redis_io_schedule_flush(r);
    outbox__redis_conn_stall_watch(r);
    return 0;
}

int outbox__redis_queue_raw(outbox__redis *r, const char *cmd, size_t len, int kind)
{
    return queue_command(r, cmd, len, 0, NULL, NULL, kind);
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

int outbox__redis_queue_argv(outbox__redis *r, int argc, const char **argv, const size_t *argvlen,
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
    return outbox__redis_queue_argv(r, argc, argv, argvlen, timeout_ms, cb, data, K_USER);
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

void outbox__redis_on_timer(uv_timer_t *t)
{
    outbox__redis *r = t->data;
    outbox__redis_enter(r);
    r->timer_armed = 0;
    if (r->deferred_status) {
        int st = r->deferred_status;
        r->deferred_status = 0;
        outbox__redis_fail_conn(r, st);
    } else if (r->state == ST_TLS) {
        if (outbox__tls_received(r->tls) == 0)
            outbox__redis_set_err(r,
                                  "connect timeout after %llu ms: no answer to the TLS handshake (a port without "
                                  "TLS? use redis://)",
                                  (unsigned long long)r->connect_timeout_ms);
        else
            outbox__redis_set_err(r,
                                  "connect timeout after %llu ms in the TLS handshake (the server stopped answering)",
                                  (unsigned long long)r->connect_timeout_ms);
        outbox__redis_fail_conn(r, OUTBOX_ETIMEDOUT);
    } else if (r->state == ST_RESOLVING || r->state == ST_CONNECTING || r->state == ST_HANDSHAKE) {
        outbox__redis_set_err(r, "connect timeout after %llu ms", (unsigned long long)r->connect_timeout_ms);
        outbox__redis_fail_conn(r, OUTBOX_ETIMEDOUT);
    } else if (r->state == ST_CONNECTED && r->ring_count > 0) {
        /* Only the oldest command is owed a reply now (see the top). */
        const pending *h = &r->ring[r->ring_head];
        uint64_t now = uv_now(r->loop), due = r->head_since + h->timeout_ms;
        if (!h->deadline) {
            /* No deadline: the next one's is armed when it becomes the oldest. */
        } else if (due <= now) {
            outbox__redis_set_err(r, "reply timeout after %llu ms", (unsigned long long)h->timeout_ms);
            outbox__redis_fail_conn(r, OUTBOX_ETIMEDOUT);
        } else {
            outbox__redis_arm_timer(r, due);
        }
    }
    outbox__redis_leave(r);
}

/* ---- public -------------------------------------------------------------- */

const redisReply *outbox__reply_map_get(const redisReply *m, const char *key)
{
    size_t klen = strlen(key);
    if (!m || m->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i + 1 < m->elements; i += 2) {
        const redisReply *k = m->element[i];
        if ((k->type == REDIS_REPLY_STRING || k->type == REDIS_REPLY_STATUS) && k->len == klen &&
            memcmp(k->str, key, klen) == 0)
            return m->element[i + 1];
    }
    return NULL;
}

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
        !(r->rbuf = malloc(READ_BUF_SIZE)) ||
        !(r->reader = redisReaderCreateWithFunctions(&outbox__redis_io_reader_fns))) {
        destroy(r);
        return OUTBOX_ENOMEM;
    }
    r->reader->privdata = r;
    /* Handles last: from here on the memory may only go via their close
     * callbacks. */
    uv_timer_init(loop, &r->timer);
    r->timer.data = r;
    uv_timer_init(loop, &r->stall_timer);
    r->stall_timer.data = r;
    uv_idle_init(loop, &r->idle);
    uv_check_init(loop, &r->check);
    r->turn_budget = REPLIES_PER_TURN;
    r->idle.data = r;
    r->check.data = r;
    r->wreq.data = r;
    r->refs = 4;
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
        return; /* outbox__redis_leave() finishes this when the callback returns */
    teardown(r);
    maybe_free(r);
}
