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

static void redials_close(outbox__redis *r);

/* r->stream is connected: reads, then the TLS or the Redis handshake. */
static void stream_up(outbox__redis *r)
{
    int rc;
    redials_close(r);
    if ((rc = uv_read_start(r->stream, outbox__redis_io_on_alloc, outbox__redis_io_on_read)) < 0) {
        outbox__redis_set_err(r, "read: %s", uv_strerror(rc));
        outbox__redis_fail_conn(r, OUTBOX_ECONNECT);
    } else if (r->tls_cfg) {
        start_tls(r);
    } else {
        start_handshake(r);
    }
}

static void on_connect(uv_connect_t *req, int status)
{
    uv_stream_t *s = req->handle;
    outbox__redis *r = s->data;
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
    } else {
        stream_up(r);
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
 * connection is looked at every STALL_TICK_MS. Once nothing has arrived for
 * STALL_MS, a PING goes behind the commands (its reply, in order with
 * theirs, is dropped): a server that is only slow, busy or paused (DEBUG
 * SLEEP, CLIENT PAUSE WRITE during a failover; again every STALL_MS while
 * the silence lasts) gets it acknowledged by its
 * kernel at once (or, when the server reads nothing and its window is full,
 * the kernel's window probes are), and the connection is left alone. If
 * STALL_ACK_MS later no acknowledgement came at all (TCP_INFO), the network
 * is dropping the packets: a probe connect to the same address starts, a new one
 * at every look until one is answered (a fresh SYN, not the kernel's
 * retries 1, 2, 4 s apart). A probe that connects, or is refused, shows the
 * path working again while this connection is not: it fails
 * (OUTBOX_ETIMEDOUT), its commands fail with it, and the owner reconnects at
 * once. A command that may wait in the server (XREADGROUP BLOCK, WAIT:
 * queued with a timeout above the reply timeout) leaves the connection
 * silent on purpose: while one is pending there is no watch, and a silent
 * peer is found by keepalive and the command's own timeout instead.
 */
#define STALL_TICK_MS 200
#define STALL_MS 1000
#define STALL_ACK_MS 400
/* The kernel's clock and the loop's cached one differ by a few ms: an
 * acknowledgement this close before the PING counts as one of it. The PING
 * is sent again every STALL_MS, so one taken for the other is looked at
 * again a second later. */
#define STALL_ACK_SLACK_MS 20

struct stall_probe {
    uv_tcp_t tcp;
    uv_connect_t req;
    outbox__redis *r;
    int abandoned;
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

static void on_probe_connect(uv_connect_t *req, int status)
{
    struct stall_probe *p = req->data;
    outbox__redis *r = p->r;
    if (p->abandoned || (status != 0 && status != UV_ECONNREFUSED))
        return; /* unanswered too: the next look tries again */
    outbox__redis_enter(r);
    probe_close(r);
    if (r->state == ST_CONNECTED) {
        outbox__redis_set_err(r,
                              "no reply and nothing acknowledged for %llu ms while a new connection to %s:%d was %s: "
                              "the network dropped this one",
                              (unsigned long long)(uv_now(r->loop) - r->stall_quiet), r->url.host, r->url.port,
                              status == 0 ? "accepted" : "refused");
        outbox__redis_fail_conn(r, OUTBOX_ETIMEDOUT);
    }
    outbox__redis_leave(r);
}

static void probe_start(outbox__redis *r, uv_os_fd_t fd)
{
    struct sockaddr_storage peer;
    socklen_t plen = sizeof peer;
    struct stall_probe *p;
    if (getpeername(fd, (struct sockaddr *)&peer, &plen) != 0 || !(p = calloc(1, sizeof *p)))
        return;
    p->r = r;
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
    static const char ping[] = "*1\r\n$4\r\nPING\r\n";
    outbox__redis *r = t->data;
    uint64_t now = uv_now(r->loop), quiet = r->last_rx > r->head_since ? r->last_rx : r->head_since;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    uv_os_fd_t fd;
    if (r->state != ST_CONNECTED || r->ring_count == 0 || !r->stream) {
        outbox__redis_conn_stall_stop(r);
        return;
    }
    if (now - quiet < STALL_MS || r->nblocking) {
        probe_close(r); /* replies came lately, or one may wait in the server: not stalled */
        r->stall_nudged = 0;
        return;
    }
    if (!r->stall_nudged || r->stall_quiet != quiet || now - r->stall_nudged >= STALL_MS) {
        /* Something for the peer's kernel to acknowledge. */
        r->stall_quiet = quiet;
        r->stall_nudged = now;
        if (outbox__redis_queue_raw(r, ping, sizeof ping - 1, K_NUDGE) != 0)
            r->stall_nudged = 0;
        return;
    }
    memset(&ti, 0, sizeof ti);
    if (now - r->stall_nudged < STALL_ACK_MS || uv_fileno((uv_handle_t *)r->stream, &fd) != 0 ||
        getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return;
    /* An acknowledgement since the PING (of it, or of a window probe when
     * the server reads nothing: its window is full) shows the peer there. */
    if (ti.tcpi_last_ack_recv <= now - r->stall_nudged + STALL_ACK_SLACK_MS) {
        probe_close(r); /* acknowledged: slow, not lost */
        return;
    }
    probe_close(r); /* one not answered yet: a fresh SYN instead of the kernel's retries */
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
    r->stall_nudged = 0;
    probe_close(r);
    redials_close(r);
}

/* ---- dialing again while a connect is unanswered ------------------------ */

/*
 * A SYN lost in a black hole is sent again by the kernel 1, 3 and 7 s
 * later: a connect started during the fault came through up to 2-4 s after
 * the network was back. So while a TCP connect is unanswered, another one
 * to the same address starts every REDIAL_MS (at most MAX_REDIALS at once,
 * the oldest dropped for a new one), and the first to connect is the
 * connection; the others are closed. A far server whose answer takes
 * longer than REDIAL_MS still gets its first SYN answered: nothing is
 * given up before the connect timeout.
 */
#define REDIAL_MS 250
#define MAX_REDIALS 4

struct redial {
    uv_tcp_t tcp; /* first: as r->stream, its memory goes in on_stream_closed */
    uv_connect_t req;
    outbox__redis *r;
    int abandoned;
};

static void on_redial_closed(uv_handle_t *h)
{
    struct redial *d = (struct redial *)h;
    outbox__redis *r = d->r;
    free(d);
    r->refs--;
    outbox__redis_enter(r);
    outbox__redis_leave(r); /* frees r if it was the last handle of a close */
}

static void redial_drop(outbox__redis *r, int i)
{
    struct redial *d = r->redials[i];
    r->redials[i] = r->redials[--r->nredials];
    d->abandoned = 1;
    uv_close((uv_handle_t *)&d->tcp, on_redial_closed);
}

static void redials_close(outbox__redis *r)
{
    while (r->nredials > 0)
        redial_drop(r, r->nredials - 1);
    if (r->state != ST_CONNECTED)
        uv_timer_stop(&r->stall_timer);
}

static void on_redial_connect(uv_connect_t *req, int status)
{
    struct redial *d = req->data;
    outbox__redis *r = d->r;
    int i;
    if (d->abandoned)
        return;
    for (i = 0; i < r->nredials && r->redials[i] != d; i++)
        ;
    if (i == r->nredials)
        return;
    if (status < 0 || r->state != ST_CONNECTING) {
        redial_drop(r, i); /* the first attempt's own failure or timeout decides */
        return;
    }
    outbox__redis_enter(r);
    r->redials[i] = r->redials[--r->nredials];
    outbox__redis_close_stream(r); /* the first attempt: its callback sees UV_ECANCELED */
    r->stream = (uv_stream_t *)&d->tcp;
    set_dead_peer_bounds(&d->tcp);
    stream_up(r);
    outbox__redis_leave(r);
}

static void on_redial_tick(uv_timer_t *t)
{
    outbox__redis *r = t->data;
    struct redial *d;
    if (r->state != ST_CONNECTING) {
        redials_close(r);
        return;
    }
    if (r->nredials == MAX_REDIALS)
        redial_drop(r, 0);
    if (!(d = calloc(1, sizeof *d)))
        return;
    d->r = r;
    uv_tcp_init(r->loop, &d->tcp);
    d->tcp.data = r; /* as r->stream, the reads find r there */
    d->req.data = d;
    uv_tcp_nodelay(&d->tcp, 1);
    r->refs++;
    r->redials[r->nredials++] = d;
    if (uv_tcp_connect(&d->req, &d->tcp, (const struct sockaddr *)&r->dial_addr, on_redial_connect) != 0)
        redial_drop(r, r->nredials - 1);
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
        redials_close(r); /* of an address tried before */
        memcpy(&r->dial_addr, addr, addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                                : sizeof(struct sockaddr_in));
        uv_timer_start(&r->stall_timer, on_redial_tick, REDIAL_MS, REDIAL_MS);
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
