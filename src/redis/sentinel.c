/*
 * sentinel.c: asking Redis Sentinel where the master is (see sentinel.h).
 *
 * A round asks the sentinels one after another, starting with the one that
 * answered last (redis-py and go-redis do the same: a sentinel that
 * answers is asked first next time). Each question is one connection:
 * `SENTINEL get-master-addr-by-name <master>` and, pipelined behind it,
 * `SUBSCRIBE +switch-master`. The first answer ends the round and the
 * connection stays, subscribed; a ping every few seconds proves it alive.
 *
 * An owner that waits for replicas (opt.wait_replicas) also asks, between
 * the two, `SENTINEL REPLICAS <master>`, and is warned when its WAITs do not
 * cover a failover (outbox__sentinel_wait_needed()).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis/sentinel.h"

#define PING_MS 3000
#define REPLY_TIMEOUT_MS 3000

enum sstate {
    S_IDLE,      /* no connection; maybe a retry timer */
    S_ASKING,    /* a round is under way: conn asks sentinel `cur` */
    S_SUBSCRIBED /* conn answered and watches +switch-master */
};

struct outbox__sentinel {
    uv_loop_t *loop;
    outbox__redis_url url; /* the Sentinel URL (copy) */
    outbox__redis_options opt;
    const outbox__logger *log;
    char what[32];
    outbox__sentinel_cb cb;
    void *data;

    enum sstate state;
    outbox__redis *conn;
    size_t cur;           /* the sentinel asked, or subscribed to */
    size_t tried;         /* sentinels asked in this round */
    int locating;         /* the owner waits for this round's outcome */
    int round_status;     /* the most telling failure of this round */
    size_t refused;       /* sentinels of this round that answered with a refusal */
    unsigned rounds_failed;
    uv_timer_t timer;     /* pings while subscribed; the retry of a background round */
    uint64_t warned;      /* what the last replicas warning said (replicas, best, need), 0: none */

    int closing, handles;
    void (*close_cb)(void *data);
    void *close_data;
    char errstr[512];
};

static void start_round(outbox__sentinel *s);
static void ask(outbox__sentinel *s);

static void handle_gone(outbox__sentinel *s)
{
    void (*cb)(void *);
    void *data;
    if (--s->handles > 0 || !s->closing)
        return;
    cb = s->close_cb;
    data = s->close_data;
    outbox__redis_url_free(&s->url);
    outbox__tls_config_unref(s->opt.tls);
    free(s);
    if (cb)
        cb(data);
}

static void conn_closed(void *data)
{
    handle_gone(data);
}

static void timer_closed(uv_handle_t *h)
{
    handle_gone(h->data);
}

static void drop(outbox__sentinel *s)
{
    outbox__redis *c = s->conn;
    s->conn = NULL;
    uv_timer_stop(&s->timer);
    if (c) {
        s->handles++;
        outbox__redis_close(c, conn_closed, s);
    }
}

static void note(outbox__sentinel *s, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void note(outbox__sentinel *s, int status, const char *fmt, ...)
{
    size_t used = strlen(s->errstr);
    va_list ap;
    if (used && used + 2 < sizeof s->errstr) {
        memcpy(s->errstr + used, "; ", 3);
        used += 2;
    }
    va_start(ap, fmt);
    vsnprintf(s->errstr + used, sizeof s->errstr - used, fmt, ap);
    va_end(ap);
    /* It goes into log lines between double quotes. */
    for (char *p = s->errstr + used; *p; p++)
        if (*p == '"' || *p == '\n')
            *p = '\'';
    /* Refused credentials say the most, then "does not know the master",
     * then an unreachable sentinel. */
    if (status == OUTBOX_EAUTH || (status == OUTBOX_EREDIS && s->round_status != OUTBOX_EAUTH))
        s->round_status = status;
    if (status == OUTBOX_EAUTH || status == OUTBOX_EREDIS)
        s->refused++;
}

static void on_timer(uv_timer_t *t);

/* The sentinel asked did not answer: ask the next, or end the round. */
static void next(outbox__sentinel *s)
{
    int status;
    drop(s);
    s->cur = (s->cur + 1) % s->url.sentinel->n;
    if (++s->tried < s->url.sentinel->n) {
        ask(s);
        return;
    }
    s->state = S_IDLE;
    s->rounds_failed++;
    status = s->round_status;
    if (s->locating) {
        s->locating = 0;
        s->cb(s, status, NULL, 0, 0, s->data);
        return;
    }
    /* Asked in the background (the subscription was lost): the owner's
     * connection may be fine, so keep trying to watch for switches. */
    if (s->rounds_failed == 1)
        outbox__log(s->log, OUTBOX_LOG_WARN, "msg=\"no sentinel answers, retrying with backoff\" conn=%s detail=\"%s\"",
                    s->what, s->errstr);
    uv_timer_start(&s->timer, on_timer,
                   outbox__backoff_ms(OUTBOX__RECONNECT_MIN_MS, OUTBOX__RECONNECT_MAX_MS, s->rounds_failed), 0);
}

static int reply_str(const redisReply *r, char *buf, size_t len)
{
    if (!r || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS) || r->len >= len)
        return -1;
    memcpy(buf, r->str, r->len);
    buf[r->len] = '\0';
    return 0;
}

static int parse_port(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    return *s && !*end && v > 0 && v <= 65535 ? (int)v : -1;
}

static const char *cur_host(const outbox__sentinel *s)
{
    return s->url.sentinel->hosts[s->cur];
}

static int cur_port(const outbox__sentinel *s)
{
    return s->url.sentinel->ports[s->cur];
}

static void on_addr(outbox__redis *c, int status, redisReply *reply, void *data)
{
    outbox__sentinel *s = data;
    char host[256], port[16];
    int p;
    if (c != s->conn)
        return;
    if (status != 0) {
        note(s, OUTBOX_ECONNECT, "%s:%d: %s", cur_host(s), cur_port(s), outbox__redis_errstr(c));
        next(s);
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        int auth = strncmp(reply->str, "NOAUTH", 6) == 0 || strncmp(reply->str, "WRONGPASS", 9) == 0 ||
                   strncmp(reply->str, "NOPERM", 6) == 0;
        note(s, auth ? OUTBOX_EAUTH : OUTBOX_EREDIS, "%s:%d: %.200s", cur_host(s), cur_port(s), reply->str);
        next(s);
        return;
    }
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 || reply_str(reply->element[0], host, sizeof host) ||
        reply_str(reply->element[1], port, sizeof port) || (p = parse_port(port)) < 0) {
        note(s, OUTBOX_EREDIS, "%s:%d does not know master '%s'", cur_host(s), cur_port(s), s->url.sentinel->master);
        next(s);
        return;
    }
    if (s->rounds_failed && !s->locating)
        outbox__log(s->log, OUTBOX_LOG_INFO, "msg=\"a sentinel answers again\" conn=%s sentinel=%s:%d", s->what,
                    cur_host(s), cur_port(s));
    s->state = S_SUBSCRIBED;
    s->rounds_failed = 0;
    s->locating = 0;
    uv_timer_start(&s->timer, on_timer, PING_MS, PING_MS);
    s->cb(s, 0, host, p, 0, s->data);
}

unsigned outbox__sentinel_wait_needed(const int *priority, size_t n, size_t *best_out)
{
    int best = 0;
    size_t nbest = 0;
    for (size_t i = 0; i < n; i++) {
        if (priority[i] <= 0)
            continue;
        if (!best || priority[i] < best) {
            best = priority[i];
            nbest = 0;
        }
        if (priority[i] == best)
            nbest++;
    }
    if (best_out)
        *best_out = nbest;
    return nbest ? (unsigned)(n - nbest + 1) : 0;
}

/* SENTINEL REPLICAS: a list of replicas, each a flat list of names and
 * values ("ip", "port", "flags", "slave-priority", ...). */
static void on_replicas(outbox__redis *c, int status, redisReply *reply, void *data)
{
    outbox__sentinel *s = data;
    int prio[64];
    size_t n = 0, best = 0;
    unsigned need, want = s->opt.wait_replicas;
    uint64_t key;
    if (c != s->conn || status != 0 || reply->type != REDIS_REPLY_ARRAY)
        return;
    for (size_t i = 0; i < reply->elements && n < sizeof prio / sizeof prio[0]; i++) {
        const redisReply *p = outbox__reply_map_get(reply->element[i], "slave-priority");
        prio[n++] = p && p->type == REDIS_REPLY_STRING ? atoi(p->str) : 100;
    }
    need = outbox__sentinel_wait_needed(prio, n, &best);
    if (want <= n && (need == 0 || want >= need)) {
        s->warned = 0;
        return;
    }
    key = (uint64_t)n << 40 | (uint64_t)best << 20 | need;
    key |= (uint64_t)1 << 63;
    if (key == s->warned)
        return;
    s->warned = key;
    if (want > n)
        outbox__log(s->log, OUTBOX_LOG_WARN,
                    "msg=\"WAIT cannot succeed: the sentinels know fewer replicas than --wait-replicas asks for; "
                    "nothing is marked published until enough of them acknowledge\" conn=%s master=%s replicas=%zu "
                    "wait_replicas=%u",
                    s->what, s->url.sentinel->master, n, want);
    else
        outbox__log(s->log, OUTBOX_LOG_WARN,
                    "msg=\"--wait-replicas does not cover a failover: Sentinel promotes the replicas of the lowest "
                    "replica-priority first, and the others can acknowledge an entry they lack; --wait-replicas %u, "
                    "or the same replica-priority on every replica, covers it\" conn=%s master=%s replicas=%zu "
                    "first_in_line=%zu wait_replicas=%u",
                    need, s->what, s->url.sentinel->master, n, best, want);
}

static void on_subscribed(outbox__redis *c, int status, redisReply *reply, void *data)
{
    outbox__sentinel *s = data;
    if (c != s->conn || status != 0 || reply->type != REDIS_REPLY_ERROR)
        return;
    /* Without the subscription a switch would go unseen until a reply says
     * READONLY: ask another sentinel. */
    outbox__log(s->log, OUTBOX_LOG_WARN, "msg=\"cannot subscribe to +switch-master\" conn=%s sentinel=%s:%d error=\"%.200s\"",
                s->what, cur_host(s), cur_port(s), reply->str);
    if (s->state == S_SUBSCRIBED) {
        drop(s);
        s->state = S_IDLE;
        s->cur = (s->cur + 1) % s->url.sentinel->n;
        uv_timer_start(&s->timer, on_timer, 1000, 0);
    }
}

/* ["message", "+switch-master", "<name> <old ip> <old port> <new ip> <new port>"] */
static void on_push(outbox__redis *c, redisReply *reply, void *data)
{
    outbox__sentinel *s = data;
    char text[600], name[256], oldip[256], newip[256];
    int oldport, newport;
    if (c != s->conn || s->state != S_SUBSCRIBED || reply->elements != 3 ||
        reply_str(reply->element[2], text, sizeof text))
        return;
    if (sscanf(text, "%255s %255s %d %255s %d", name, oldip, &oldport, newip, &newport) != 5 ||
        strcmp(name, s->url.sentinel->master) != 0 || newport < 1 || newport > 65535)
        return;
    outbox__log(s->log, OUTBOX_LOG_INFO, "msg=\"sentinel announced a new master\" conn=%s master=%s from=%s:%d to=%s:%d",
                s->what, name, oldip, oldport, newip, newport);
    s->cb(s, 0, newip, newport, 1, s->data);
}

static void on_lost(outbox__redis *c, int status, void *data)
{
    outbox__sentinel *s = data;
    if (c != s->conn)
        return;
    outbox__log(s->log, OUTBOX_LOG_WARN, "msg=\"sentinel connection lost, asking the sentinels again\" conn=%s "
                "sentinel=%s:%d err=%s detail=\"%s\"",
                s->what, cur_host(s), cur_port(s), outbox_err_name(status), outbox__redis_errstr(c));
    drop(s);
    s->state = S_IDLE;
    s->cur = (s->cur + 1) % s->url.sentinel->n;
    start_round(s);
}

static void on_connected(outbox__redis *c, int status, void *data)
{
    outbox__sentinel *s = data;
    const char *q[3] = {"SENTINEL", "get-master-addr-by-name", s->url.sentinel->master};
    const char *sub[2] = {"SUBSCRIBE", "+switch-master"};
    const char *rq[3] = {"SENTINEL", "REPLICAS", s->url.sentinel->master};
    int e;
    if (c != s->conn)
        return;
    if (status != 0) {
        note(s, status == OUTBOX_EAUTH ? OUTBOX_EAUTH : OUTBOX_ECONNECT, "%s:%d: %s", cur_host(s), cur_port(s),
             outbox__redis_errstr(c));
        next(s);
        return;
    }
    outbox__redis_set_push_cb(c, on_push, s);
    e = outbox__redis_command_argv(c, 3, q, NULL, 0, on_addr, s);
    if (e == 0 && s->opt.wait_replicas)
        e = outbox__redis_command_argv(c, 3, rq, NULL, 0, on_replicas, s);
    if (e == 0)
        e = outbox__redis_command_argv(c, 2, sub, NULL, 0, on_subscribed, s);
    if (e != 0) {
        note(s, e, "%s:%d: %s", cur_host(s), cur_port(s), outbox_strerror(e));
        next(s);
    }
}

/* Asks sentinel `cur`. */
static void ask(outbox__sentinel *s)
{
    outbox__redis_url u;
    outbox__redis_options o = s->opt;
    int e;
    memset(&u, 0, sizeof u);
    u.host = (char *)cur_host(s);
    u.port = cur_port(s);
    u.user = s->url.sentinel->user;
    u.password = s->url.sentinel->password;
    u.tls = s->url.tls; /* rediss-sentinel://: the sentinels too, with the data nodes' settings */
    o.client_name = NULL;
    if (!o.reply_timeout_ms || o.reply_timeout_ms > REPLY_TIMEOUT_MS)
        o.reply_timeout_ms = REPLY_TIMEOUT_MS;
    s->state = S_ASKING;
    e = outbox__redis_create(&s->conn, s->loop, &u, &o, s);
    if (e == 0)
        e = outbox__redis_connect(s->conn, on_connected, on_lost);
    if (e != 0) {
        note(s, OUTBOX_ECONNECT, "%s:%d: %s", cur_host(s), cur_port(s), outbox_strerror(e));
        next(s);
    }
}

static void start_round(outbox__sentinel *s)
{
    s->tried = 0;
    s->refused = 0;
    s->round_status = OUTBOX_ECONNECT;
    s->errstr[0] = '\0';
    ask(s);
}

static void on_ping(outbox__redis *c, int status, redisReply *reply, void *data)
{
    /* A ping not answered in time fails the connection (on_lost). */
    (void)c;
    (void)status;
    (void)reply;
    (void)data;
}

static void on_timer(uv_timer_t *t)
{
    outbox__sentinel *s = t->data;
    if (s->closing)
        return;
    if (s->state == S_SUBSCRIBED) {
        const char *argv[1] = {"PING"};
        if (outbox__redis_command_argv(s->conn, 1, argv, NULL, 0, on_ping, s) != 0)
            on_lost(s->conn, OUTBOX_ECLOSED, s);
    } else if (s->state == S_IDLE) {
        start_round(s);
    }
}

int outbox__sentinel_create(outbox__sentinel **out, uv_loop_t *loop, const outbox__redis_url *url,
                            const outbox__redis_options *opt, const outbox__logger *log, const char *what,
                            outbox__sentinel_cb cb, void *data)
{
    outbox__sentinel *s;
    *out = NULL;
    if (!url || !url->sentinel || !url->sentinel->n || !cb)
        return OUTBOX_EINVAL;
    s = calloc(1, sizeof *s);
    if (!s)
        return OUTBOX_ENOMEM;
    if (outbox__redis_url_copy(&s->url, url) != 0) {
        free(s);
        return OUTBOX_ENOMEM;
    }
    s->loop = loop;
    s->opt = *opt;
    s->opt.tls = outbox__tls_config_ref(opt->tls);
    s->log = log;
    s->cb = cb;
    s->data = data;
    outbox__strlcpy(s->what, what, sizeof s->what);
    uv_timer_init(loop, &s->timer);
    s->timer.data = s;
    s->handles = 1;
    *out = s;
    return 0;
}

void outbox__sentinel_locate(outbox__sentinel *s)
{
    if (!s || s->closing)
        return;
    s->locating = 1;
    if (s->state == S_ASKING)
        return;
    drop(s);
    start_round(s);
}

const char *outbox__sentinel_errstr(const outbox__sentinel *s)
{
    return s ? s->errstr : "";
}

int outbox__sentinel_refused(const outbox__sentinel *s)
{
    return s && s->state == S_IDLE && s->tried == s->url.sentinel->n && s->refused == s->url.sentinel->n;
}

void outbox__sentinel_close(outbox__sentinel *s, void (*cb)(void *data), void *data)
{
    if (!s || s->closing)
        return;
    s->closing = 1;
    s->close_cb = cb;
    s->close_data = data;
    drop(s);
    uv_close((uv_handle_t *)&s->timer, timer_closed);
}

int outbox__sentinel_node_url(outbox__redis_url *out, const outbox__redis_url *url, const char *host, int port)
{
    outbox__redis_url u = *url;
    u.sentinel = NULL;
    u.path = NULL;
    u.host = (char *)host;
    u.port = port;
    return outbox__redis_url_copy(out, &u);
}

int outbox__sentinel_url_parse(const char *url, const char *sentinel_user, const char *sentinel_password,
                               outbox__redis_url *out, char *err, size_t errlen)
{
    int e = outbox__redis_url_parse(url, out, err, errlen);
    if (e != 0 || (!sentinel_user && !sentinel_password))
        return e;
    if (!out->sentinel) {
        outbox__redis_url_free(out);
        if (err && errlen)
            snprintf(err, errlen, "%s needs a redis-sentinel:// URL",
                     sentinel_password ? "sentinel_password" : "sentinel_user");
        return OUTBOX_EINVAL;
    }
    if ((sentinel_user && !(out->sentinel->user = strdup(sentinel_user))) ||
        (sentinel_password && !(out->sentinel->password = strdup(sentinel_password)))) {
        outbox__redis_url_free(out);
        return OUTBOX_ENOMEM;
    }
    return 0;
}
