/*
 * redis_conn.c: connecting a Redis connection (redis.h; redis_int.h):
 * resolving a host name (uv_getaddrinfo) and trying its addresses in turn,
 * the TCP or Unix socket connect, the TLS handshake of a rediss:// URL, and
 * the Redis handshake (AUTH, SELECT, CLIENT SETNAME, and a PING over TLS
 * when there is nothing else to send) until the connection is usable.
 * Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "redis/redis_int.h"

static void on_connect(uv_connect_t *req, int status);
static int try_next_address(outbox__redis *r);

/* ---- replies ------------------------------------------------------------- */

static void connected(outbox__redis *r)
{
    r->state = ST_CONNECTED;
    outbox__redis_stop_timer(r); /* the connect timeout */
    r->errstr[0] = '\0';
    if (r->ai_head) {
        uv_freeaddrinfo(r->ai_head);
        r->ai_head = r->ai_next = NULL;
    }
    r->connect_cb_called = 1;
    if (r->connect_cb)
        r->connect_cb(r, 0, r->data);
}

void outbox__redis_conn_handshake_reply(outbox__redis *r, const pending *p, redisReply *reply)
{
    static const char *const names[] = {"", "AUTH", "SELECT", "CLIENT SETNAME", "PING"};
    if (reply->type == REDIS_REPLY_ERROR) {
        const char *msg = reply->str ? reply->str : "";
        int auth = p->kind == K_AUTH || strncmp(msg, "NOAUTH", 6) == 0 || strncmp(msg, "WRONGPASS", 9) == 0;
        outbox__redis_set_err(r, "%s: %s", names[p->kind], msg);
        outbox__redis_fail_conn(r, auth ? OUTBOX_EAUTH : OUTBOX_EREDIS);
        return;
    }
    if (--r->hs_remaining == 0)
        connected(r);
}

static void start_handshake(outbox__redis *r);

/* Advances the TLS handshake; once it is done, the Redis handshake starts
 * over TLS. */
void outbox__redis_conn_tls_step(outbox__redis *r)
{
    int rc = outbox__tls_handshake(r->tls);
    if (rc < 0) {
        outbox__redis_io_fail_tls(r);
        return;
    }
    if (rc == 0)
        start_handshake(r);
    outbox__redis_io_flush(r);
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
        rc = outbox__redis_queue_argv(r, n, argv, NULL, 0, NULL, NULL, K_AUTH);
        r->hs_remaining += !rc;
    }
    if (!rc && r->url.db != 0) {
        snprintf(db, sizeof db, "%d", r->url.db);
        argv[0] = "SELECT";
        argv[1] = db;
        rc = outbox__redis_queue_argv(r, 2, argv, NULL, 0, NULL, NULL, K_SELECT);
        r->hs_remaining += !rc;
    }
    if (!rc && r->client_name) {
        argv[0] = "CLIENT";
        argv[1] = "SETNAME";
        argv[2] = r->client_name;
        rc = outbox__redis_queue_argv(r, 3, argv, NULL, 0, NULL, NULL, K_SETNAME);
        r->hs_remaining += !rc;
    }
    if (!rc && r->tls && r->hs_remaining == 0) {
        argv[0] = "PING";
        rc = outbox__redis_queue_argv(r, 1, argv, NULL, 0, NULL, NULL, K_PING);
        r->hs_remaining += !rc;
    }
    if (rc) {
        outbox__redis_set_err(r, "handshake: out of memory");
        outbox__redis_fail_conn(r, OUTBOX_ENOMEM);
    } else if (r->hs_remaining == 0) {
        connected(r);
    }
}

static void start_tls(outbox__redis *r)
{
    int rc = outbox__tls_create(&r->tls, r->tls_cfg, r->url.host);
    if (rc < 0) {
        outbox__redis_set_err(r, rc == OUTBOX_ENOMEM ? "TLS: out of memory" : "TLS: cannot use '%s' as the server name",
                              r->url.host);
        outbox__redis_fail_conn(r, rc == OUTBOX_ENOMEM ? OUTBOX_ENOMEM : OUTBOX_ETLS);
        return;
    }
    r->state = ST_TLS;
    outbox__redis_conn_tls_step(r);
}

static void on_connect(uv_connect_t *req, int status)
{
    uv_stream_t *s = req->handle;
    outbox__redis *r = s->data;
    int rc;
    outbox__redis_enter(r);
    if (s != r->stream || r->state != ST_CONNECTING) {
        /* an attempt abandoned by a timeout or close(): UV_ECANCELED */
    } else if (status < 0) {
        if (r->url.path)
            outbox__redis_set_err(r, "connect %s: %s", r->url.path, uv_strerror(status));
        else
            outbox__redis_set_err(r, "connect %s:%d: %s", r->url.host, r->url.port, uv_strerror(status));
        outbox__redis_close_stream(r);
        if (!r->ai_next || try_next_address(r) < 0)
            outbox__redis_fail_conn(r, OUTBOX_ECONNECT);
    } else if ((rc = uv_read_start(s, outbox__redis_io_on_alloc, outbox__redis_io_on_read)) < 0) {
        outbox__redis_set_err(r, "read: %s", uv_strerror(rc));
        outbox__redis_fail_conn(r, OUTBOX_ECONNECT);
    } else if (r->tls_cfg) {
        start_tls(r);
    } else {
        start_handshake(r);
    }
    outbox__redis_leave(r);
}

/* Connects a new TCP handle to addr. Returns 0 or a libuv error (errstr
 * set). */
static int start_tcp(outbox__redis *r, const struct sockaddr *addr)
{
    uv_tcp_t *t = malloc(sizeof *t);
    int rc;
    if (!t) {
        outbox__redis_set_err(r, "connect: out of memory");
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
        outbox__redis_set_err(r, "connect %s:%d: %s", r->url.host, r->url.port, uv_strerror(rc));
        outbox__redis_close_stream(r);
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
    outbox__redis_enter(r);
    if (r->state != ST_RESOLVING) {
        if (res)
            uv_freeaddrinfo(res);
    } else if (status < 0) {
        outbox__redis_set_err(r, "resolve %s: %s", r->url.host, uv_strerror(status));
        outbox__redis_fail_conn(r, OUTBOX_ECONNECT);
    } else {
        r->ai_head = r->ai_next = res;
        outbox__redis_set_err(r, "resolve %s: no IPv4 or IPv6 address", r->url.host);
        if (try_next_address(r) < 0)
            outbox__redis_fail_conn(r, OUTBOX_ECONNECT);
    }
    outbox__redis_leave(r);
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
        uv_timer_start(&r->timer, outbox__redis_on_timer, r->connect_timeout_ms, 0);

    if (r->url.path) {
        uv_pipe_t *pp = malloc(sizeof *pp);
        if (!pp) {
            r->state = ST_CONNECTING;
            outbox__redis_set_err(r, "connect: out of memory");
            outbox__redis_fail_soon(r, OUTBOX_ENOMEM);
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
                outbox__redis_fail_soon(r, OUTBOX_ECONNECT);
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
            outbox__redis_set_err(r, "resolve %s: %s", r->url.host, uv_strerror(rc));
            outbox__redis_fail_soon(r, OUTBOX_ECONNECT);
            return 0;
        }
        r->gai_active = 1;
        r->refs++;
    }
    return 0;
}
