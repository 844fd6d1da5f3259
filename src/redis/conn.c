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
#include <netinet/in.h>
#include <netinet/tcp.h>
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

/*
 * A peer that went silent (a black hole: no RST, no FIN) is noticed on an
 * idle connection by keepalive probes (after OUTBOX__REDIS_KEEPALIVE_IDLE_S
 * of silence, one a second, OUTBOX__REDIS_KEEPALIVE_PROBES of them), and on
 * one with bytes unacknowledged by TCP_USER_TIMEOUT, set to the same bound,
 * which also ends a connect whose SYNs go unanswered. Both are set on every
 * new socket: libuv's uv_tcp_keepalive() before the socket exists applies
 * a fixed 60 s idle time and the kernel's default 9 probes 75 s apart,
 * which let a silent peer go unnoticed for 11 minutes. A failure to set
 * them leaves the kernel's defaults: the reply timeout still bounds a
 * connection with commands outstanding.
 */
static void set_dead_peer_bounds(uv_tcp_t *t)
{
    uv_os_fd_t fd;
    int idle = OUTBOX__REDIS_KEEPALIVE_IDLE_S, intvl = 1, cnt = OUTBOX__REDIS_KEEPALIVE_PROBES, on = 1;
    unsigned user_ms = (unsigned)OUTBOX__REDIS_DEAD_PEER_MS;
    if (uv_fileno((uv_handle_t *)t, &fd) != 0)
        return;
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof user_ms);
}

/* ---- the stall watch ------------------------------------------------------ */

/*
 * A connection into a black hole (a dropped route, a firewall change, a
 * partition) gets no reply, and TCP retransmits with a backoff that doubles
 * from 200 ms, on each side: after 8 s of silence the next try came some
 * 2-5 s after the network was back, and the reply timeout (10 s by
 * default) was what ended the wait. So while commands wait for replies the
 * connection is looked at every STALL_TICK_MS, and once nothing has arrived
 * on it for STALL_MS a probe starts: a new connection to the same address
 * that sends a PING. Any answer from the server's process to it (a reply,
 * an error such as NOAUTH, or a close: a TLS port closes on plaintext), or
 * a refused connect, shows the server reachable again; if this connection
 * has still received nothing one look later, it fails (OUTBOX_ETIMEDOUT),
 * its commands fail with it and the owner reconnects at once: a healed
 * network costs about two looks and a reconnect. A probe whose connect is
 * not answered by the next look is dropped for a new one (a fresh SYN,
 * not the kernel's retries 1, 2, 4 s apart). A server that is busy (a long
 * command, DEBUG SLEEP) answers neither connection, and the replies that
 * come first on this one end the probe.
 */
#define STALL_TICK_MS 200
#define STALL_MS 1000

struct stall_probe {
    uv_tcp_t tcp;
    uv_connect_t req;
    uv_write_t wreq;
    outbox__redis *r;
    uint64_t started;
    int connected, answered, abandoned;
    char buf[64];
};

static void on_probe_closed(uv_handle_t *h)
{
    struct stall_probe *p = h->data;
    outbox__redis *r = p->r;
    free(p);
    r->refs--;
    outbox__redis_enter(r);
    outbox__redis_leave(r); /* frees r if it was the last handle of a close */
}

static void probe_close(outbox__redis *r)
{
    struct stall_probe *p = r->probe;
    if (!p)
        return;
    r->probe = NULL;
    p->abandoned = 1;
    uv_close((uv_handle_t *)&p->tcp, on_probe_closed);
}

static void on_probe_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct stall_probe *p = h->data;
    (void)suggested;
    *buf = uv_buf_init(p->buf, sizeof p->buf);
}

static void on_probe_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct stall_probe *p = s->data;
    (void)buf;
    if (nread != 0 && !p->abandoned) {
        p->answered = 1; /* bytes, EOF or a reset: the server's process answered */
        uv_read_stop(s);
    }
}

static void on_probe_written(uv_write_t *req, int status)
{
    (void)req;
    (void)status; /* a failed write shows in the read */
}

static void on_probe_connect(uv_connect_t *req, int status)
{
    static char ping[] = "PING\r\n";
    struct stall_probe *p = req->data;
    uv_buf_t b = uv_buf_init(ping, sizeof ping - 1);
    if (p->abandoned || status == UV_ECANCELED)
        return;
    if (status == UV_ECONNREFUSED) {
        p->answered = 1; /* the host answers; nothing listens there any more */
    } else if (status == 0) {
        /* Not connected for the next look if the PING cannot go: a new probe. */
        p->connected = uv_read_start((uv_stream_t *)&p->tcp, on_probe_alloc, on_probe_read) == 0 &&
                       uv_write(&p->wreq, (uv_stream_t *)&p->tcp, &b, 1, on_probe_written) == 0;
    }
}

static void probe_start(outbox__redis *r, uv_os_fd_t fd)
{
    struct sockaddr_storage peer;
    socklen_t plen = sizeof peer;
    struct stall_probe *p;
    if (getpeername(fd, (struct sockaddr *)&peer, &plen) != 0)
        return;
    if (!(p = calloc(1, sizeof *p)))
        return;
    p->r = r;
    p->started = uv_now(r->loop);
    uv_tcp_init(r->loop, &p->tcp);
    p->tcp.data = p;
    p->req.data = p;
    r->refs++;
    r->probe = p;
    if (uv_tcp_connect(&p->req, &p->tcp, (const struct sockaddr *)&peer, on_probe_connect) != 0)
        probe_close(r);
}

static void on_stall_tick(uv_timer_t *t)
{
    outbox__redis *r = t->data;
    uint64_t now = uv_now(r->loop), quiet = r->last_rx > r->wait_since ? r->last_rx : r->wait_since;
    struct stall_probe *p = r->probe;
    uv_os_fd_t fd;
    if (r->state != ST_CONNECTED || r->ring_count == 0 || !r->stream) {
        outbox__redis_conn_stall_stop(r);
        return;
    }
    if (now - quiet < STALL_MS) {
        probe_close(r); /* replies came lately: not stalled */
        return;
    }
    if (p && p->answered && r->last_rx < p->started) {
        outbox__redis_enter(r);
        probe_close(r);
        outbox__redis_set_err(r,
                              "no reply for %llu ms while a new connection to %s:%d was answered: the connection "
                              "is lost",
                              (unsigned long long)(now - quiet), r->url.host, r->url.port);
        outbox__redis_fail_conn(r, OUTBOX_ETIMEDOUT);
        outbox__redis_leave(r);
        return;
    }
    if (p && p->connected)
        return; /* its PING waits for a busy server: so do the replies here */
    probe_close(r); /* one not answered yet: a fresh SYN instead of the kernel's retries */
    if (uv_fileno((uv_handle_t *)r->stream, &fd) == 0)
        probe_start(r, fd);
}

void outbox__redis_conn_stall_watch(outbox__redis *r)
{
    if (r->state == ST_CONNECTED && !r->url.path && r->stream && !uv_is_active((uv_handle_t *)&r->stall_timer))
        uv_timer_start(&r->stall_timer, on_stall_tick, STALL_TICK_MS, STALL_TICK_MS);
}

void outbox__redis_conn_stall_stop(outbox__redis *r)
{
    uv_timer_stop(&r->stall_timer);
    probe_close(r);
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
    r->state = ST_CONNECTING;
    rc = uv_tcp_connect(&r->creq, t, addr, on_connect);
    if (rc < 0) {
        outbox__redis_set_err(r, "connect %s:%d: %s", r->url.host, r->url.port, uv_strerror(rc));
        outbox__redis_close_stream(r);
    } else {
        set_dead_peer_bounds(t);
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
