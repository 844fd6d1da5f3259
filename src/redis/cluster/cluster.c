/*
 * cluster.c: the cluster layer's object, its nodes and their connections,
 * routed commands, redirections and retries (see cluster.h; the slot map is
 * cluster_map.c's).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "redis/cluster/cluster_int.h"
#include "util/array.h"

void outbox__cluster_options_defaults(outbox__cluster_options *o)
{
    memset(o, 0, sizeof *o);
    outbox__redis_options_defaults(&o->redis);
    o->max_redirects = 5;
    o->refresh_min_ms = 1000;
    o->retry_min_ms = 20;
    o->retry_max_ms = 500;
    o->node_retry_min_ms = OUTBOX__RECONNECT_MIN_MS;
    o->node_retry_max_ms = OUTBOX__RECONNECT_MAX_MS;
}

/* ---- lifetime ------------------------------------------------------------ */

static void node_free(outbox__cluster_node *n)
{
    if (!n)
        return;
    free(n->host);
    free(n);
}

static void cluster_free(outbox__cluster *c)
{
    void (*cb)(void *) = c->close_cb;
    void *data = c->close_data;
    for (size_t i = 0; i < c->nnodes; i++)
        node_free(c->nodes[i]);
    free(c->nodes);
    free(c->probe_order);
    outbox__tls_config_unref(c->opt.redis.tls);
    free((char *)c->opt.redis.client_name);
    outbox__redis_url_free(&c->url);
    free(c);
    if (cb)
        cb(data);
}

static void handle_gone(outbox__cluster *c)
{
    if (--c->handles == 0 && c->closing)
        cluster_free(c);
}

static void on_conn_closed(void *data)
{
    handle_gone(data);
}

static void on_timer_closed(uv_handle_t *h)
{
    handle_gone(h->data);
}

int outbox__cluster_create(outbox__cluster **out, uv_loop_t *loop, const outbox__redis_url *url,
                           const outbox__cluster_options *opt, const outbox__logger *log, const char *what,
                           const outbox__cluster_hooks *hooks)
{
    outbox__cluster *c;
    outbox__cluster_options d;
    if (!out || !loop || !url || !url->cluster || url->cluster->n == 0)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!opt) {
        outbox__cluster_options_defaults(&d);
        opt = &d;
    }
    if (opt->redis.tls && !url->tls)
        return OUTBOX_EINVAL;
    if (!(c = calloc(1, sizeof *c)))
        return OUTBOX_ENOMEM;
    c->loop = loop;
    c->opt = *opt;
    c->opt.redis.tls = NULL;
    c->opt.redis.client_name = NULL;
    c->log = log;
    if (hooks)
        c->hooks = *hooks;
    outbox__strlcpy(c->what, what ? what : "cluster", sizeof c->what);
    if (outbox__redis_url_copy(&c->url, url) != 0 ||
        (opt->redis.client_name && !(c->opt.redis.client_name = strdup(opt->redis.client_name))))
        goto nomem;
    if (url->tls) {
        if (opt->redis.tls)
            c->opt.redis.tls = outbox__tls_config_ref(opt->redis.tls);
        else if (outbox__tls_config_create(&c->opt.redis.tls, NULL, NULL, 0) != 0)
            goto nomem;
    }
    outbox__redis_url_describe(url, c->desc, sizeof c->desc);
    for (size_t i = 0; i < url->cluster->n; i++)
        if (!outbox__cluster_node_get(c, url->cluster->hosts[i], strlen(url->cluster->hosts[i]),
                                      url->cluster->ports[i]))
            goto nomem;
    *out = c;
    return 0;
nomem:
    cluster_free(c);
    return OUTBOX_ENOMEM;
}

void outbox__cluster_start(outbox__cluster *c)
{
    if (!c || c->started || c->closing)
        return;
    c->started = 1;
    uv_timer_init(c->loop, &c->retry_timer);
    uv_timer_init(c->loop, &c->refresh_timer);
    c->retry_timer.data = c->refresh_timer.data = c;
    c->handles += 2;
    outbox__cluster_map_refresh_soon(c);
}

int outbox__cluster_ready(const outbox__cluster *c)
{
    return c && c->ready && !c->closing;
}

int outbox__cluster_reachable(const outbox__cluster *c)
{
    return outbox__cluster_ready(c) && !c->down_reported;
}

/* ---- nodes --------------------------------------------------------------- */

outbox__cluster_node *outbox__cluster_node_get(outbox__cluster *c, const char *host, size_t hlen, int port)
{
    outbox__cluster_node *n;
    for (size_t i = 0; i < c->nnodes; i++) {
        n = c->nodes[i];
        if (n->port == port && strlen(n->host) == hlen && strncasecmp(n->host, host, hlen) == 0)
            return n;
    }
    if (c->nnodes == 65535)
        return NULL; /* the slot map holds node indexes in 16 bits */
    if (OUTBOX__GROW(c->nodes, &c->capnodes, c->nnodes, 1, 8) != 0)
        return NULL;
    if (!(n = calloc(1, sizeof *n)) || !(n->host = strndup(host, hlen))) {
        free(n);
        return NULL;
    }
    n->c = c;
    n->port = port;
    n->index = c->nnodes;
    snprintf(n->name, sizeof n->name, "%s%s%s:%d", memchr(host, ':', hlen) ? "[" : "", n->host,
             memchr(host, ':', hlen) ? "]" : "", port);
    c->nodes[c->nnodes++] = n;
    return n;
}

outbox__cluster_node *outbox__cluster_node_of(const outbox__cluster *c, const outbox__redis *conn)
{
    if (!c || !conn)
        return NULL;
    for (size_t i = 0; i < c->nnodes; i++)
        if (c->nodes[i]->conn == conn)
            return c->nodes[i];
    return NULL;
}

int outbox__cluster_node_serves(const outbox__cluster_node *n)
{
    return n && n->master;
}

static outbox__cluster_node *slot_node(const outbox__cluster *c, unsigned slot)
{
    unsigned i = c->slots[slot];
    return i ? c->nodes[i - 1] : NULL;
}

/* The command's callback, once; k is freed first (the callback may close
 * the cluster). */
static void deliver(ccmd *k, outbox__redis *conn, int status, redisReply *reply)
{
    outbox__redis_reply_cb cb = k->cb;
    void *data = k->data;
    free(k);
    cb(conn, status, reply, data);
}

/* Delivers an error reply of this module's: the command was not executed. */
static void deliver_error(ccmd *k, outbox__redis *conn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void deliver_error(ccmd *k, outbox__redis *conn, const char *fmt, ...)
{
    char buf[300];
    redisReply fake;
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memset(&fake, 0, sizeof fake);
    fake.type = REDIS_REPLY_ERROR;
    fake.str = buf;
    fake.len = n < 0 ? 0 : (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
    deliver(k, conn, 0, &fake);
}

static void fail_list(ccmd *k, int status)
{
    while (k) {
        ccmd *next = k->next;
        deliver(k, NULL, status, NULL);
        k = next;
    }
}

/* Drops n's connection (its pending commands get their callbacks from
 * outbox__redis_close); the node connects again on demand. */
static void node_drop_conn(outbox__cluster *c, outbox__cluster_node *n)
{
    outbox__redis *conn = n->conn;
    n->conn = NULL;
    n->state = NS_IDLE;
    c->handles++;
    outbox__redis_close(conn, on_conn_closed, c);
}

static int node_send(outbox__cluster_node *n, ccmd *k);

void outbox__cluster_node_retire(outbox__cluster *c, outbox__cluster_node *n)
{
    if (n->state != NS_UP || c->closing)
        return;
    outbox__log(c->log, OUTBOX_LOG_INFO,
                "msg=\"cluster node no longer serves slots, its connection closed: its commands go to the new "
                "masters\" conn=%s node=%s",
                c->what, n->name);
    node_drop_conn(c, n);
}

static void on_node_disconnect(outbox__redis *r, int status, void *data)
{
    outbox__cluster_node *n = data;
    outbox__cluster *c = n->c;
    (void)status;
    /* Its pending commands have had their callbacks (unknown outcome). */
    node_drop_conn(c, n);
    n->errors++;
    n->down_until = uv_now(c->loop) + c->opt.node_retry_min_ms;
    outbox__log(c->log, OUTBOX_LOG_WARN, "msg=\"cluster node connection lost\" conn=%s node=%s err=%s detail=\"%s\"",
                c->what, n->name, outbox_err_name(status), outbox__redis_errstr(r));
    if (!c->closing)
        outbox__cluster_map_refresh_soon(c);
}

static void on_node_connect(outbox__redis *r, int status, void *data)
{
    outbox__cluster_node *n = data;
    outbox__cluster *c = n->c;
    ccmd *k;
    if (n->conn != r)
        return; /* given up by close: it is closing already */
    if (status == 0 && !c->closing) {
        n->state = NS_UP;
        if (n->failures)
            outbox__log(c->log, OUTBOX_LOG_INFO, "msg=\"cluster node reachable again\" conn=%s node=%s", c->what,
                        n->name);
        n->failures = 0;
        if (c->hooks.on_node_up)
            c->hooks.on_node_up(c, n, r, c->hooks.data);
        k = n->wait_head;
        n->wait_head = n->wait_tail = NULL;
        while (k) {
            ccmd *next = k->next;
            int e;
            k->next = NULL;
            e = n->state == NS_UP ? node_send(n, k) : OUTBOX_ECLOSED;
            if (e != 0)
                deliver(k, NULL, e, NULL);
            k = next;
        }
        outbox__cluster_map_node_event(c, n, 0);
        return;
    }
    /* One warning per outage of the node; the retries after it at debug. */
    outbox__log(c->log, c->closing || n->failures ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_WARN,
                "msg=\"cluster node unreachable, its messages are released until it answers\" conn=%s node=%s "
                "err=%s detail=\"%s\"",
                c->what, n->name, outbox_err_name(status), outbox__redis_errstr(r));
    snprintf(c->errstr, sizeof c->errstr, "%s: %s", n->name, outbox__redis_errstr(r));
    node_drop_conn(c, n);
    n->errors++;
    n->down_until = uv_now(c->loop) +
                    outbox__backoff_ms(c->opt.node_retry_min_ms, c->opt.node_retry_max_ms, ++n->failures);
    k = n->wait_head;
    n->wait_head = n->wait_tail = NULL;
    /* Never sent: not executed. */
    fail_list(k, c->closing ? OUTBOX_ECLOSED : OUTBOX_ECONNECT);
    if (!c->closing) {
        outbox__cluster_map_node_event(c, n, status);
        outbox__cluster_map_refresh_soon(c);
    }
}

int outbox__cluster_node_connect(outbox__cluster_node *n)
{
    outbox__cluster *c = n->c;
    outbox__redis_url u;
    int e;
    memset(&u, 0, sizeof u);
    u.host = n->host;
    u.port = n->port;
    u.user = c->url.user;
    u.password = c->url.password;
    u.tls = c->url.tls;
    e = outbox__redis_create(&n->conn, c->loop, &u, &c->opt.redis, n);
    if (e != 0)
        return e;
    n->state = NS_CONNECTING;
    outbox__redis_connect(n->conn, on_node_connect, on_node_disconnect);
    return 0;
}

/* ---- commands ------------------------------------------------------------ */

static void on_reply(outbox__redis *conn, int status, redisReply *reply, void *data);

static void on_asking_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    /* The command behind it says what came of it. */
    (void)conn, (void)status, (void)reply, (void)data;
}

static int node_send(outbox__cluster_node *n, ccmd *k)
{
    outbox__cluster *c = n->c;
    uint64_t now = uv_now(c->loop), left;
    int e;
    switch (n->state) {
    case NS_UP:
        left = k->deadline > now ? k->deadline - now : 1;
        if (k->asking) {
            static const char asking[] = "*1\r\n$6\r\nASKING\r\n";
            e = outbox__redis_command_raw(n->conn, asking, sizeof asking - 1, left, on_asking_reply, NULL);
            if (e != 0)
                return e;
        }
        return outbox__redis_command_raw(n->conn, k->cmd, k->len, left, on_reply, k);
    case NS_IDLE:
        if (now < n->down_until)
            return OUTBOX_ECONNECT;
        if ((e = outbox__cluster_node_connect(n)) != 0)
            return e;
        /* fall through */
    case NS_CONNECTING:
    default:
        k->next = NULL;
        if (n->wait_tail)
            n->wait_tail->next = k;
        else
            n->wait_head = k;
        n->wait_tail = k;
        return 0;
    }
}

static int dispatch(outbox__cluster *c, ccmd *k, outbox__cluster_node **where)
{
    outbox__cluster_node *n = k->target ? k->target : slot_node(c, k->slot);
    if (!n)
        return OUTBOX_ECONNECT; /* no master serves the slot */
    if (where)
        *where = n;
    return node_send(n, k);
}

static void on_retry_timer(uv_timer_t *t)
{
    outbox__cluster *c = t->data;
    uint64_t now = uv_now(c->loop);
    while (!c->closing && c->retry_head && c->retry_head->due <= now) {
        ccmd *k = c->retry_head;
        int e;
        c->retry_head = k->next;
        k->next = NULL;
        if ((e = dispatch(c, k, NULL)) != 0)
            deliver(k, NULL, e, NULL);
    }
    if (!c->closing && c->retry_head)
        uv_timer_start(&c->retry_timer, on_retry_timer, c->retry_head->due - now, 0);
}

static void retry_later(outbox__cluster *c, ccmd *k, uint64_t delay)
{
    ccmd **p = &c->retry_head;
    k->due = uv_now(c->loop) + delay;
    while (*p && (*p)->due <= k->due)
        p = &(*p)->next;
    k->next = *p;
    *p = k;
    if (c->retry_head == k)
        uv_timer_start(&c->retry_timer, on_retry_timer, delay, 0);
}

static int starts_with(const redisReply *reply, const char *word)
{
    size_t n = strlen(word);
    return reply->len >= n && memcmp(reply->str, word, n) == 0 && (reply->len == n || reply->str[n] == ' ');
}

/* "MOVED 3999 127.0.0.1:6381" (or ASK): the slot and the node; an empty host
 * (Redis' "unknown endpoint") means the node that answered. 0 or -1. */
static int parse_redirect(const redisReply *reply, const outbox__cluster_node *from, unsigned *slot,
                          const char **host, size_t *hlen, int *port)
{
    const char *s = reply->str, *end = reply->str + reply->len, *p, *colon = NULL;
    long v = 0;
    p = memchr(s, ' ', reply->len);
    if (!p)
        return -1;
    s = p + 1;
    if (s >= end || *s < '0' || *s > '9')
        return -1;
    for (; s < end && *s >= '0' && *s <= '9'; s++)
        if ((v = v * 10 + (*s - '0')) >= OUTBOX__SLOTS)
            return -1;
    if (s >= end || *s != ' ')
        return -1;
    *slot = (unsigned)v;
    s++;
    for (p = s; p < end; p++) {
        if (*p == ':')
            colon = p;
        else if ((unsigned char)*p <= ' ')
            return -1;
    }
    if (!colon || colon + 1 >= end)
        return -1;
    v = 0;
    for (p = colon + 1; p < end; p++) {
        if (*p < '0' || *p > '9' || (v = v * 10 + (*p - '0')) > 65535)
            return -1;
    }
    if (v < 1)
        return -1;
    *port = (int)v;
    *host = s;
    *hlen = (size_t)(colon - s);
    if (*hlen == 0 || (*hlen == 1 && s[0] == '?')) {
        if (!from)
            return -1;
        *host = from->host;
        *hlen = strlen(from->host);
    }
    return 0;
}

static void on_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    ccmd *k = data;
    outbox__cluster *c = k->c;
    outbox__cluster_node *from, *to;
    int moved, e;

    if (status != 0 || !reply || reply->type != REDIS_REPLY_ERROR || k->direct || c->closing) {
        deliver(k, conn, status, reply);
        return;
    }
    from = outbox__cluster_node_of(c, conn);
    moved = starts_with(reply, "MOVED");
    if (moved || starts_with(reply, "ASK")) {
        const char *host;
        size_t hlen;
        int port;
        unsigned slot;
        if (parse_redirect(reply, from, &slot, &host, &hlen, &port) != 0) {
            deliver_error(k, conn, "malformed %s reply '%.*s'", moved ? "MOVED" : "ASK",
                          (int)(reply->len < 120 ? reply->len : 120), reply->str);
            return;
        }
        if (from) {
            if (moved)
                from->moved++;
            else
                from->ask++;
        }
        if (++k->redirects > c->opt.max_redirects) {
            deliver_error(k, conn, "redirect loop: %s %u to %.*s:%d after %u redirections", moved ? "MOVED" : "ASK",
                          slot, (int)(hlen < 200 ? hlen : 200), host, port, c->opt.max_redirects);
            return;
        }
        if (!(to = outbox__cluster_node_get(c, host, hlen, port))) {
            deliver(k, conn, OUTBOX_ENOMEM, NULL);
            return;
        }
        if (moved) {
            c->slots[slot] = (uint16_t)(to->index + 1);
            to->master = 1;
            k->target = NULL;
            k->asking = 0;
            k->slot = slot;
            outbox__cluster_map_refresh_soon(c);
        } else {
            k->target = to;
            k->asking = 1;
        }
        if ((e = node_send(to, k)) != 0)
            deliver(k, NULL, e, NULL);
        return;
    }
    if (starts_with(reply, "TRYAGAIN") || starts_with(reply, "CLUSTERDOWN") || starts_with(reply, "LOADING") ||
        starts_with(reply, "READONLY")) {
        uint64_t delay = outbox__backoff_ms(c->opt.retry_min_ms, c->opt.retry_max_ms, ++k->retries);
        if (from)
            from->tryagain++;
        if (from && starts_with(reply, "CLUSTERDOWN"))
            from->said_down = uv_now(c->loop);
        if (!starts_with(reply, "TRYAGAIN"))
            outbox__cluster_map_refresh_soon(c);
        if (uv_now(c->loop) + delay >= k->deadline) {
            deliver(k, conn, 0, reply); /* its last error, at its deadline */
            return;
        }
        k->target = NULL;
        k->asking = 0;
        k->redirects = 0;
        retry_later(c, k, delay);
        return;
    }
    deliver(k, conn, status, reply);
}

static ccmd *ccmd_new(outbox__cluster *c, const char *cmd, size_t len, uint64_t timeout_ms,
                      outbox__redis_reply_cb cb, void *data)
{
    ccmd *k = malloc(sizeof *k + len);
    if (!k)
        return NULL;
    memset(k, 0, sizeof *k);
    k->c = c;
    k->cb = cb;
    k->data = data;
    k->deadline = uv_now(c->loop) + (timeout_ms ? timeout_ms : c->opt.redis.reply_timeout_ms ? c->opt.redis.reply_timeout_ms : 10000);
    k->len = len;
    memcpy(k->cmd, cmd, len);
    return k;
}

int outbox__cluster_command_raw(outbox__cluster *c, const char *key, size_t klen, const char *cmd, size_t len,
                                uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data,
                                outbox__cluster_node **node)
{
    ccmd *k;
    int e;
    if (!c || !cb || !cmd)
        return OUTBOX_EINVAL;
    if (!c->ready || c->closing)
        return OUTBOX_ESTATE;
    if (!(k = ccmd_new(c, cmd, len, timeout_ms, cb, data)))
        return OUTBOX_ENOMEM;
    k->slot = outbox__key_slot(key, klen);
    if ((e = dispatch(c, k, node)) != 0)
        free(k);
    return e;
}

int outbox__cluster_command_argv(outbox__cluster *c, const char *key, size_t klen, int argc, const char **argv,
                                 const size_t *argvlen, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data,
                                 outbox__cluster_node **node)
{
    char *cmd = NULL;
    long long len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);
    int e;
    if (len < 0)
        return OUTBOX_ENOMEM;
    e = outbox__cluster_command_raw(c, key, klen, cmd, (size_t)len, timeout_ms, cb, data, node);
    free(cmd);
    return e;
}

int outbox__cluster_node_command_argv(outbox__cluster *c, outbox__cluster_node *n, int argc, const char **argv,
                                      const size_t *argvlen, uint64_t timeout_ms, outbox__redis_reply_cb cb,
                                      void *data)
{
    char *cmd = NULL;
    long long len;
    ccmd *k;
    int e;
    if (!c || !n || !cb)
        return OUTBOX_EINVAL;
    if (c->closing || !c->started)
        return OUTBOX_ESTATE;
    if ((len = redisFormatCommandArgv(&cmd, argc, argv, argvlen)) < 0)
        return OUTBOX_ENOMEM;
    k = ccmd_new(c, cmd, (size_t)len, timeout_ms, cb, data);
    free(cmd);
    if (!k)
        return OUTBOX_ENOMEM;
    k->direct = 1;
    k->target = n;
    if ((e = node_send(n, k)) != 0)
        free(k);
    return e;
}

/* ---- figures ------------------------------------------------------------- */

size_t outbox__cluster_node_stats_get(const outbox__cluster *c, outbox__cluster_node_stats *st, size_t n)
{
    if (!c)
        return 0;
    for (size_t i = 0; i < c->nnodes && i < n; i++) {
        const outbox__cluster_node *x = c->nodes[i];
        st[i].name = x->name;
        st[i].connected = x->state == NS_UP;
        st[i].master = x->master;
        st[i].moved = x->moved;
        st[i].ask = x->ask;
        st[i].tryagain = x->tryagain;
        st[i].errors = x->errors;
    }
    return c->nnodes;
}

uint64_t outbox__cluster_refreshes(const outbox__cluster *c, uint64_t *failed)
{
    if (failed)
        *failed = c ? c->refresh_failed : 0;
    return c ? c->refreshes : 0;
}

void outbox__cluster_refresh(outbox__cluster *c)
{
    if (c && c->started && !c->closing)
        outbox__cluster_map_refresh_soon(c);
}

const char *outbox__cluster_errstr(const outbox__cluster *c)
{
    return c ? c->errstr : "";
}

void outbox__cluster_reset(outbox__cluster *c, const char *why)
{
    ccmd *k;
    if (!c || c->closing)
        return;
    /* Those waiting for a retry were not executed (their last reply was a
     * TRYAGAIN & co): they fail as closed too. */
    k = c->retry_head;
    c->retry_head = NULL;
    if (c->started)
        uv_timer_stop(&c->retry_timer);
    fail_list(k, OUTBOX_ECLOSED);
    for (size_t i = 0; i < c->nnodes; i++) {
        outbox__cluster_node *n = c->nodes[i];
        outbox__redis *conn = n->conn;
        k = n->wait_head;
        n->wait_head = n->wait_tail = NULL;
        if (conn) {
            outbox__log(c->log, OUTBOX_LOG_INFO, "msg=\"cluster node connection dropped\" conn=%s node=%s why=\"%s\"",
                        c->what, n->name, why ? why : "");
            node_drop_conn(c, n);
        }
        fail_list(k, OUTBOX_ECLOSED);
        outbox__cluster_map_node_event(c, n, OUTBOX_ECLOSED); /* a refresh waiting for its connect */
    }
}

/* ---- close --------------------------------------------------------------- */

void outbox__cluster_close(outbox__cluster *c, void (*cb)(void *data), void *data)
{
    ccmd *k;
    if (!c || c->closing)
        return;
    c->closing = 1;
    c->close_cb = cb;
    c->close_data = data;
    c->handles++; /* held while the callbacks below run */
    k = c->retry_head;
    c->retry_head = NULL;
    fail_list(k, OUTBOX_ECLOSED);
    for (size_t i = 0; i < c->nnodes; i++) {
        outbox__cluster_node *n = c->nodes[i];
        outbox__redis *conn = n->conn;
        k = n->wait_head;
        n->wait_head = n->wait_tail = NULL;
        fail_list(k, OUTBOX_ECLOSED);
        if (conn) {
            node_drop_conn(c, n);
        }
    }
    if (c->started) {
        uv_close((uv_handle_t *)&c->retry_timer, on_timer_closed);
        uv_close((uv_handle_t *)&c->refresh_timer, on_timer_closed);
    }
    handle_gone(c);
}
