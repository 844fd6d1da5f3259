/*
 * http.c: the HTTP server's listener and its accept policy (see http.h and
 * http_int.h): the connection table, the connection a newcomer closes, the
 * bound per client, accepts per loop turn, the deadlines, closing.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>

#include "ops/http_int.h"

/* Warnings about a flood are said once, then at most this often. */
#define WARN_EVERY_MS 30000
/* The kernel's queue of connections not yet accepted. A full queue drops
 * new SYNs, and a dropped SYN costs the client a retransmission a second
 * later: a probe that times out. Linux caps it at net.core.somaxconn
 * (4096 by default). */
#define LISTEN_BACKLOG 4096

void outbox__http_limits_default(outbox__http_limits *l)
{
    l->max_conns = 256;
    l->per_client = 32;
    l->accepts_per_turn = 64;
    l->idle_ms = 5000;
    l->head_ms = 5000;
    l->answer_ms = 10000;
}

const outbox__http_limits *outbox__http_limits_of(const outbox__http *h)
{
    return &h->lim;
}

int outbox__http_warn_due(outbox__http *h, uint64_t *last)
{
    uint64_t now = uv_now(h->loop);
    if (*last && now - *last < WARN_EVERY_MS)
        return 0;
    *last = now ? now : 1;
    return 1;
}

static void srv_maybe_free(outbox__http *h)
{
    void (*cb)(void *);
    void *d;
    if (!h->closing || h->handles > 0 || outbox__http_auth_busy(h))
        return;
    cb = h->close_cb;
    d = h->close_data;
    free(h);
    if (cb)
        cb(d);
}

void outbox__http_srv_maybe_free(outbox__http *h)
{
    srv_maybe_free(h);
}

void outbox__http_conn_free_if_done(struct outbox__http_req *c)
{
    outbox__http *h = c->srv;
    /* A handler that was given the request still owes its respond. */
    if (c->handles > 0 || c->phase == CONN_HANDLER)
        return;
    if (c->older)
        c->older->newer = c->newer;
    else
        h->oldest = c->newer;
    if (c->newer)
        c->newer->older = c->older;
    else
        h->newest = c->older;
    h->nconns--;
    outbox__tls_destroy(c->tls);
    free(c->hello);
    free(c);
    h->handles--;
    srv_maybe_free(h);
}

static void conn_handle_closed(uv_handle_t *hd)
{
    struct outbox__http_req *c = hd->data;
    c->handles--;
    outbox__http_conn_free_if_done(c);
}

void outbox__http_conn_close(struct outbox__http_req *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    c->srv->nlive--;
    if (c->phase == CONN_AUTH)
        outbox__http_auth_forget(c);
    /* The socket's descriptor is closed here, the memory in the close
     * callbacks. */
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

static void on_deadline(uv_timer_t *t)
{
    struct outbox__http_req *c = t->data;
    switch (c->phase) {
    case CONN_IDLE:
        outbox__http_conn_close(c);
        break;
    case CONN_HEAD:
        /* A 408 needs a channel to say it on: some of the head came (over
         * TLS, after the handshake). */
        if (c->head_len > 0)
            outbox__http_conn_error(c, 408, "request head not complete in time");
        else
            outbox__http_conn_close(c);
        break;
    case CONN_AUTH:
        outbox__http_auth_forget(c);
        outbox__http_conn_error(c, 503, "the password check did not finish in time");
        break;
    case CONN_HANDLER:
        break; /* our own answer is late, not the client */
    case CONN_WRITING:
        outbox__http_conn_close(c); /* a client that does not read its answer */
        break;
    }
}

void outbox__http_conn_phase(struct outbox__http_req *c, enum conn_phase p)
{
    enum conn_phase old = c->phase;
    c->phase = p;
    if (c->closing)
        return;
    /* The head's deadline runs from its first byte and is not moved by the
     * bytes after it; the answer's from the end of the head. */
    if (p == CONN_IDLE)
        uv_timer_start(&c->timer, on_deadline, c->srv->lim.idle_ms, 0);
    else if (p == CONN_HEAD && old == CONN_IDLE)
        uv_timer_start(&c->timer, on_deadline, c->srv->lim.head_ms, 0);
    else if (p > CONN_HEAD && old <= CONN_HEAD)
        uv_timer_start(&c->timer, on_deadline, c->srv->lim.answer_ms, 0);
}

/* ---- the accept policy ---------------------------------------------------- */

static void peer_of(struct outbox__http_req *c)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memset(&c->peer, 0, sizeof c->peer);
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    if (ss.ss_family == AF_INET) {
        c->peer.family = AF_INET;
        memcpy(c->peer.addr, &((struct sockaddr_in *)&ss)->sin_addr, 4);
    } else if (ss.ss_family == AF_INET6) {
        const unsigned char *a = (const unsigned char *)&((struct sockaddr_in6 *)&ss)->sin6_addr;
        /* An IPv4 client of a dual-stack socket is that IPv4 address. */
        if (memcmp(a, mapped, sizeof mapped) == 0) {
            c->peer.family = AF_INET;
            memcpy(c->peer.addr, a + 12, 4);
        } else {
            c->peer.family = AF_INET6;
            memcpy(c->peer.addr, a, 16);
        }
    }
}

static int same_peer(const http_peer *a, const http_peer *b)
{
    return a->family == b->family && memcmp(a->addr, b->addr, sizeof a->addr) == 0;
}

/* A connection that a newcomer may close: still without a complete head,
 * and with nothing waiting unread in its socket. The second part keeps a
 * probe whose request (or TLS handshake message) arrived but was not read
 * yet, in the middle of an accept burst, from being taken for a slow
 * client. */
static int evictable(const struct outbox__http_req *c)
{
    uv_os_fd_t fd;
    int n = 0;
    if (c->closing || c->phase > CONN_HEAD)
        return 0;
    if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) != 0 || ioctl(fd, FIONREAD, &n) != 0)
        return 1;
    return n == 0;
}

/* The oldest evictable connection other than n, of peer only if given.
 * A TLS connection whose hello was answered comes last: it is waiting for
 * the client's next flight, a round trip away, and a probe in the middle of
 * its handshake must not lose to a crowd that never completes a hello. */
static struct outbox__http_req *victim(outbox__http *h, const struct outbox__http_req *n, const http_peer *only)
{
    struct outbox__http_req *c;
    for (int tier = 0; tier < 2; tier++)
        for (c = h->oldest; c; c = c->newer)
            if (c != n && c->tls_answered == tier && (!only || same_peer(&c->peer, only)) && evictable(c))
                return c;
    return NULL;
}

static void warn_evicted(outbox__http *h, const char *why)
{
    h->evicted_since_warn++;
    if (!outbox__http_warn_due(h, &h->last_full_warn_ms))
        return;
    outbox__log(h->log, OUTBOX_LOG_WARN,
                "msg=\"metrics endpoint: %s; closing the oldest connections without a complete request\" "
                "closed=%u max_connections=%u per_client=%u",
                why, h->evicted_since_warn, h->lim.max_conns, h->lim.per_client);
    h->evicted_since_warn = 0;
}

/* Room for the newcomer n: 1 once there is, 0 when n itself was closed
 * (every connection it could replace has a request in progress). */
static int make_room(outbox__http *h, struct outbox__http_req *n)
{
    struct outbox__http_req *c, *v;
    unsigned same = 0;
    const char *why;
    for (c = h->oldest; c; c = c->newer)
        if (c != n && !c->closing && same_peer(&c->peer, &n->peer))
            same++;
    if (same >= h->lim.per_client) {
        v = victim(h, n, &n->peer);
        why = "a client at its bound of connections opened another";
    } else if (h->nlive > h->lim.max_conns) {
        v = victim(h, n, NULL);
        why = "connection table full";
    } else {
        return 1;
    }
    if (!v) {
        outbox__http_conn_close(n);
        warn_evicted(h, "no connection could make room for a new one (each has a request in progress)");
        return 0;
    }
    outbox__http_conn_close(v);
    warn_evicted(h, why);
    return 1;
}

static void on_turn(uv_check_t *t);

static void accept_one(outbox__http *h)
{
    struct outbox__http_req *c = calloc(1, sizeof *c);
    if (!c) {
        /* libuv keeps the connection until it is accepted: again after
         * this turn. */
        h->held = 1;
        uv_check_start(&h->turn, on_turn);
        return;
    }
    c->srv = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->handles = 2;
    h->handles++;
    c->older = h->newest;
    if (h->newest)
        h->newest->newer = c;
    else
        h->oldest = c;
    h->newest = c;
    h->nconns++;
    h->nlive++;
    if (h->accepted_this_turn++ == 0)
        uv_check_start(&h->turn, on_turn);
    if (uv_accept((uv_stream_t *)&h->listener, (uv_stream_t *)&c->tcp) != 0) {
        outbox__http_conn_close(c);
        return;
    }
    peer_of(c);
    if (!make_room(h, c))
        return;
    outbox__http_conn_phase(c, CONN_IDLE);
    outbox__http_conn_start(c);
}

/* After the I/O of a turn that accepted: a new count, and the connection
 * held back by the bound per turn taken now (which watches the listener
 * again). */
static void on_turn(uv_check_t *t)
{
    outbox__http *h = t->data;
    h->accepted_this_turn = 0;
    uv_check_stop(t);
    if (h->held && !h->closing) {
        h->held = 0;
        accept_one(h);
    }
}

static void on_conn(uv_stream_t *l, int status)
{
    outbox__http *h = l->data;
    if (h->closing)
        return;
    if (status == UV_EMFILE || status == UV_ENFILE) {
        /* libuv has closed the waiting connections with its reserve
         * descriptor; one of ours goes too, so that the next accept finds
         * a descriptor. */
        struct outbox__http_req *v = victim(h, NULL, NULL);
        if (v)
            outbox__http_conn_close(v);
        /* Descriptors ran out below the table's bound (libuv says so
         * when its reserve descriptor did not help): the table shrinks to
         * what could be open, so that newcomers replace connections rather
         * than meet EMFILE again. */
        if (h->nlive < h->lim.max_conns)
            h->lim.max_conns = h->nlive > 1 ? h->nlive : 1;
        if (outbox__http_warn_due(h, &h->last_emfile_warn_ms))
            outbox__log(h->log, OUTBOX_LOG_WARN,
                        "msg=\"metrics endpoint: out of file descriptors; waiting connections were closed\" "
                        "error=%s connections=%u max_connections=%u",
                        uv_err_name(status), h->nlive, h->lim.max_conns);
        return;
    }
    if (status != 0)
        return;
    /* Not accepting makes libuv stop watching the listener until this
     * turn's other I/O has run (on_turn). */
    if (h->accepted_this_turn >= h->lim.accepts_per_turn) {
        h->held = 1;
        return;
    }
    accept_one(h);
}

/* ---- listening ------------------------------------------------------------ */

int outbox__http_parse_listen(const char *listen, struct sockaddr_storage *ss, char *err, size_t errlen)
{
    char host[256];
    const char *colon;
    long port;
    size_t hl;

    memset(ss, 0, sizeof *ss);
    if (!listen || !*listen) {
        snprintf(err, errlen, "empty listen address (want HOST:PORT)");
        return OUTBOX_EINVAL;
    }
    colon = strrchr(listen, ':');
    if (!colon) {
        snprintf(err, errlen, "'%s' has no port (want HOST:PORT, e.g. 127.0.0.1:9464)", listen);
        return OUTBOX_EINVAL;
    }
    /* Digits only: strtol alone would take " 80", "+80" or "0x50". */
    port = strspn(colon + 1, "0123456789") == strlen(colon + 1) ? strtol(colon + 1, NULL, 10) : -1;
    if (!colon[1] || port < 1 || port > 65535) {
        snprintf(err, errlen, "'%s': port must be 1..65535", listen);
        return OUTBOX_EINVAL;
    }
    hl = (size_t)(colon - listen);
    if (hl >= sizeof host) {
        snprintf(err, errlen, "host part too long");
        return OUTBOX_EINVAL;
    }
    memcpy(host, listen, hl);
    host[hl] = '\0';
    if (hl == 0)
        strcpy(host, "0.0.0.0");
    if (host[0] == '[') {
        size_t n = strlen(host);
        if (n < 3 || host[n - 1] != ']') {
            snprintf(err, errlen, "'%s': unterminated [IPv6] address", listen);
            return OUTBOX_EINVAL;
        }
        host[n - 1] = '\0';
        if (uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss) != 0) {
            snprintf(err, errlen, "'%s': not an IPv6 address", listen);
            return OUTBOX_EINVAL;
        }
        return 0;
    }
    if (!strcmp(host, "localhost"))
        strcpy(host, "127.0.0.1");
    if (uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss) != 0) {
        snprintf(err, errlen, "'%s': host must be an IP address (or localhost)", listen);
        return OUTBOX_EINVAL;
    }
    return 0;
}

static void srv_handle_closed(uv_handle_t *hd)
{
    outbox__http *h = hd->data;
    h->handles--;
    srv_maybe_free(h);
}

/* Descriptors the process goes on to open after the endpoint starts: the
 * relay's other database connections (three files each), Redis
 * connections, a cluster's nodes. */
#define FD_HEADROOM 32

/* The process' open descriptors now, or 0 when it cannot tell. */
static unsigned open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    unsigned n = 0;
    if (!d)
        return 0;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n > 0 ? n - 1 : 0; /* the directory's own */
}

/* A quarter of the open files limit at most, and FD_HEADROOM less than
 * what the process left free: the rest of the process needs its
 * descriptors, and an accept that meets EMFILE makes libuv close every
 * connection waiting to be accepted, probes too. */
static void fit_fd_limit(outbox__http *h)
{
    struct rlimit rl;
    rlim_t fit, used;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return;
    used = open_fds();
    fit = rl.rlim_cur / 4;
    if (rl.rlim_cur < used + FD_HEADROOM + fit)
        fit = rl.rlim_cur > used + FD_HEADROOM ? rl.rlim_cur - used - FD_HEADROOM : 1;
    if (fit >= h->lim.max_conns)
        return;
    h->lim.max_conns = fit > 1 ? (unsigned)fit : 1;
    outbox__log(h->log, OUTBOX_LOG_INFO,
                "msg=\"metrics endpoint: fewer connections for a low open files limit\" max_connections=%u "
                "nofile=%llu open=%llu",
                h->lim.max_conns, (unsigned long long)rl.rlim_cur, (unsigned long long)used);
}

int outbox__http_start(outbox__http **out, uv_loop_t *loop, const char *listen, const outbox__web_config *web,
                       const outbox__http_limits *lim, outbox__http_handler handler, void *data,
                       const outbox__logger *log, char *err, size_t errlen)
{
    struct sockaddr_storage ss;
    outbox__http *h;
    int e;

    *out = NULL;
    e = outbox__http_parse_listen(listen, &ss, err, errlen);
    if (e != 0)
        return e;
    h = calloc(1, sizeof *h);
    if (!h)
        return OUTBOX_ENOMEM;
    h->loop = loop;
    h->handler = handler;
    h->data = data;
    h->log = log;
    h->web = web;
    if (lim)
        h->lim = *lim;
    else
        outbox__http_limits_default(&h->lim);
    fit_fd_limit(h);
    outbox__http_auth_init(h);
    uv_tcp_init(loop, &h->listener);
    uv_check_init(loop, &h->turn);
    /* The check runs only after turns with accepts; it must not keep the
     * loop alive by itself. */
    uv_unref((uv_handle_t *)&h->turn);
    h->listener.data = h->turn.data = h;
    h->handles = 2;
    e = uv_tcp_bind(&h->listener, (const struct sockaddr *)&ss, 0);
    if (e == 0)
        e = uv_listen((uv_stream_t *)&h->listener, LISTEN_BACKLOG, on_conn);
    if (e != 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", listen, uv_strerror(e));
        /* The handles' memory must outlive their close callbacks, the last
         * of which frees h. */
        h->closing = 1;
        uv_close((uv_handle_t *)&h->listener, srv_handle_closed);
        uv_close((uv_handle_t *)&h->turn, srv_handle_closed);
        return OUTBOX_EIO;
    }
    if (web && web->nusers && !web->tls)
        outbox__log(log, OUTBOX_LOG_WARN,
                    "msg=\"metrics endpoint: basic authentication without TLS: passwords cross the network in "
                    "the clear\" listen=%s",
                    listen);
    *out = h;
    return 0;
}

void outbox__http_close(outbox__http *h, void (*cb)(void *data), void *data)
{
    struct outbox__http_req *c, *next;
    if (!h || h->closing)
        return;
    h->closing = 1;
    h->close_cb = cb;
    h->close_data = data;
    for (c = h->oldest; c; c = next) {
        next = c->newer;
        outbox__http_conn_close(c);
    }
    uv_close((uv_handle_t *)&h->listener, srv_handle_closed);
    uv_close((uv_handle_t *)&h->turn, srv_handle_closed);
}
