/*
 * rconn.c: a Redis connection that keeps itself connected (see rconn.h):
 * reconnects with backoff on a uv timer, Sentinel URLs resolved before every
 * attempt (and the named node's ROLE checked), master switches followed,
 * and log lines rate-limited so that a long outage does not flood the log.
 * The consumer's connections and the relay's link to one node or a Sentinel
 * URL are rconns; a Redis Cluster's nodes are the cluster module's own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "redis/rconn.h"

static void rc_connect(outbox__rconn *rc);

static void rc_handle_gone(outbox__rconn *rc)
{
    if (--rc->handles == 0 && rc->closing) {
        outbox__redis_url_free(&rc->url);
        outbox__redis_url_free(&rc->node);
        outbox__tls_config_unref(rc->opt.tls);
        rc->opt.tls = NULL;
        if (rc->close_cb)
            rc->close_cb(rc->close_data);
    }
}

static void rc_conn_closed(void *data)
{
    rc_handle_gone(data);
}

static void rc_timer_closed(uv_handle_t *h)
{
    rc_handle_gone(h->data);
}

static void rc_drop(outbox__rconn *rc)
{
    outbox__redis *c = rc->conn;
    rc->conn = NULL;
    rc->up = 0;
    if (c) {
        rc->handles++;
        outbox__redis_close(c, rc_conn_closed, rc);
    }
}

static void rc_on_timer(uv_timer_t *t)
{
    outbox__rconn *rc = t->data;
    if (rc->down_pending) {
        /* A connection given up in a reply callback (a redirect): its
         * pending commands have failed by now. */
        rc->down_pending = 0;
        if (rc->on_down)
            rc->on_down(rc, OUTBOX_ECLOSED, rc->data);
        if (!rc->running || rc->closing)
            return;
    }
    rc_connect(rc);
}

static const char *rc_failure_text(const outbox__rconn *rc, int status)
{
    return rc->fail_text ? rc->fail_text : outbox__redis_failure_text(status);
}


static void rc_retry(outbox__rconn *rc, int status, const char *detail)
{
    uint64_t now = uv_now(rc->loop), d;
    rc_drop(rc);
    if (!rc->running || rc->closing)
        return;
    if (rc->failures++ == 0) {
        rc->down_since = rc->last_log = now;
        outbox__log(rc->log, OUTBOX_LOG_WARN, "msg=\"%s, retrying with backoff\" conn=%s redis=%s err=%s detail=\"%s\"",
                    rc_failure_text(rc, status), rc->what, rc->desc, outbox_err_name(status), detail);
    } else if (now - rc->last_log >= 30000) {
        rc->last_log = now;
        outbox__log(rc->log, OUTBOX_LOG_WARN,
                    "msg=\"%s, still retrying\" conn=%s redis=%s for_ms=%llu attempts=%u err=%s detail=\"%s\"",
                    rc_failure_text(rc, status), rc->what, rc->desc,
                    (unsigned long long)(now - rc->down_since), rc->failures, outbox_err_name(status), detail);
    }
    /* failures counts this one already. A timeout (of a connect whose SYNs
     * or handshake went unanswered, of a reply) spent its own wait already:
     * the next attempt goes after the shortest step, so that a network
     * healed during the wait is used within one connect's time, not a
     * connect's time plus half a second. */
    d = status == OUTBOX_ETIMEDOUT ? outbox__backoff_ms(OUTBOX__RECONNECT_MIN_MS, OUTBOX__RECONNECT_MIN_MS, 1)
                                   : outbox__backoff_ms(OUTBOX__RECONNECT_MIN_MS, OUTBOX__RECONNECT_MAX_MS, rc->failures);
    uv_timer_start(&rc->timer, rc_on_timer, d, 0);
}

/* rc_retry with the log's words chosen by the caller. */
static void rc_retry_as(outbox__rconn *rc, const char *text, int status, const char *detail)
{
    rc->fail_text = text;
    rc_retry(rc, status, detail);
    rc->fail_text = NULL;
}

static void quote_free(char *buf, size_t len, const char *s)
{
    outbox__strlcpy(buf, s, len);
    for (char *p = buf; *p; p++)
        if (*p == '"' || *p == '\n')
            *p = '\'';
}

static void rc_up(outbox__rconn *rc)
{
    char node[300] = "";
    rc->up = 1;
    if (rc->url.sentinel)
        snprintf(node, sizeof node, " node=%s:%d", rc->node.host, rc->node.port);
    if (outbox__tls_config_insecure(rc->opt.tls))
        outbox__log(rc->log, OUTBOX_LOG_WARN,
                    "msg=\"TLS without verification: the server's certificate and name are not checked\" conn=%s "
                    "redis=%s",
                    rc->what, rc->desc);
    if (rc->failures)
        outbox__log(rc->log, OUTBOX_LOG_INFO, "msg=\"redis reachable again\" conn=%s redis=%s%s attempts=%u",
                    rc->what, rc->desc, node, rc->failures);
    else
        outbox__log(rc->log, OUTBOX_LOG_INFO, "msg=\"connected to redis\" conn=%s redis=%s%s", rc->what, rc->desc,
                    node);
    rc->failures = 0;
    if (rc->on_up)
        rc->on_up(rc, rc->data);
}

/* The owner hears of a failure that retrying does not heal (see on_refused). */
static void rc_refused(outbox__rconn *rc, int status, const char *why)
{
    if (rc->on_refused && rc->running && !rc->closing)
        rc->on_refused(rc, status, why, rc->data);
}

/* A connection attempt failed: the connection's own words for the log. A
 * refused AUTH, or NOAUTH, is the credentials' fault; an ACL that forbids
 * SELECT or CLIENT SETNAME fails every attempt the same way. */
static void rc_attempt_failed(outbox__rconn *rc, const outbox__redis *c, int status)
{
    char detail[256], why[320];
    quote_free(detail, sizeof detail, outbox__redis_errstr(c));
    rc_retry(rc, status, detail);
    if (status == OUTBOX_EAUTH)
        snprintf(why, sizeof why, "redis refused the credentials (%s)", detail);
    else if (status == OUTBOX_EREDIS && strstr(detail, ": NOPERM "))
        snprintf(why, sizeof why, "the ACL forbids a command the connection needs (%s)", detail);
    else
        return;
    rc_refused(rc, status, why);
}

/* Sentinel URLs: the node the sentinels named must say it is the master
 * before anything is sent (it may have been demoted since they answered). */
static void rc_role_reply(outbox__redis *c, int status, redisReply *reply, void *data)
{
    outbox__rconn *rc = data;
    char raw[300], detail[300];
    const redisReply *role;
    if (c != rc->conn)
        return;
    if (status != 0) {
        rc_attempt_failed(rc, c, status);
        return;
    }
    role = reply->type == REDIS_REPLY_ARRAY && reply->elements > 0 ? reply->element[0] : NULL;
    if (role && role->type == REDIS_REPLY_STRING && role->len == 6 && memcmp(role->str, "master", 6) == 0) {
        rc_up(rc);
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR)
        snprintf(raw, sizeof raw, "ROLE at %s:%d: %.200s", rc->node.host, rc->node.port, reply->str);
    else
        snprintf(raw, sizeof raw, "%s:%d is not the master (ROLE says %.*s)", rc->node.host, rc->node.port,
                 role && role->type == REDIS_REPLY_STRING ? (int)role->len : 1,
                 role && role->type == REDIS_REPLY_STRING ? role->str : "?");
    quote_free(detail, sizeof detail, raw);
    rc_retry_as(rc, "the node the sentinels named is not the master", OUTBOX_ECONNECT, detail);
}

static void rc_connected(outbox__redis *c, int status, void *data)
{
    outbox__rconn *rc = data;
    if (c != rc->conn)
        return;
    if (status != 0) {
        rc_attempt_failed(rc, c, status);
        return;
    }
    if (rc->url.sentinel) {
        const char *argv[1] = {"ROLE"};
        int e = outbox__redis_command_argv(c, 1, argv, NULL, 0, rc_role_reply, rc);
        if (e != 0)
            rc_retry(rc, e, outbox_strerror(e));
        return;
    }
    rc_up(rc);
}

static void rc_disconnected(outbox__redis *c, int status, void *data)
{
    outbox__rconn *rc = data;
    char detail[256];
    if (c != rc->conn)
        return;
    quote_free(detail, sizeof detail, outbox__redis_errstr(c));
    if (!rc->up) { /* lost before ROLE answered: an attempt that failed */
        rc_retry(rc, status, detail);
        return;
    }
    outbox__log(rc->log, OUTBOX_LOG_WARN, "msg=\"redis connection lost\" conn=%s err=%s detail=\"%s\"", rc->what,
                outbox_err_name(status), detail);
    rc->up = 0;
    if (rc->on_down)
        rc->on_down(rc, status, rc->data);
    /* A lost connection is retried at once; failures back off from there. */
    rc_drop(rc);
    rc->failures = 1;
    rc->down_since = rc->last_log = uv_now(rc->loop);
    if (rc->running && !rc->closing)
        uv_timer_start(&rc->timer, rc_on_timer, 10, 0);
}

static void rc_connect_to(outbox__rconn *rc, const outbox__redis_url *node)
{
    int e = outbox__redis_create(&rc->conn, rc->loop, node, &rc->opt, rc);
    if (e == 0)
        e = outbox__redis_connect(rc->conn, rc_connected, rc_disconnected);
    if (e != 0)
        rc_retry(rc, e, outbox_strerror(e));
}

static int same_node(const outbox__redis_url *a, const char *host, int port)
{
    return a->host && strcmp(a->host, host) == 0 && a->port == port;
}

/* What the sentinels say: the answer to rc_connect's question, or (not
 * locating) a switch they announced or the answer of a round they began
 * themselves after losing their connection. */
static void rc_on_master(outbox__sentinel *s, int status, const char *host, int port, int switched, void *data)
{
    outbox__rconn *rc = data;
    outbox__redis_url node;
    int asked = rc->locating, e, refused;
    rc->locating = 0;
    if (!rc->running || rc->closing)
        return;
    if (status != 0) {
        char why[640];
        if (!asked)
            return;
        if (status == OUTBOX_EAUTH)
            snprintf(why, sizeof why, "every sentinel refused the credentials (%s)", outbox__sentinel_errstr(s));
        else
            snprintf(why, sizeof why, "no sentinel of the URL names master '%s' (%s)", rc->url.sentinel->master,
                     outbox__sentinel_errstr(s));
        refused = outbox__sentinel_refused(s);
        rc_retry_as(rc,
                    status == OUTBOX_EAUTH
                        ? "a sentinel refused the credentials (check the sentinel user and password)"
                        : "no sentinel named the master",
                    status, outbox__sentinel_errstr(s));
        if (refused)
            rc_refused(rc, status, why);
        return;
    }
    if (!asked) {
        if (same_node(&rc->node, host, port) && (rc->conn || !switched))
            return;
        if (rc->down_pending) { /* a redirect's, due from the timer stopped below */
            rc->down_pending = 0;
            if (rc->on_down)
                rc->on_down(rc, OUTBOX_ECLOSED, rc->data);
            if (!rc->running || rc->closing)
                return;
        }
        if (rc->conn) {
            int was_up = rc->up;
            outbox__log(rc->log, OUTBOX_LOG_WARN,
                        "msg=\"master switched, leaving the old one\" conn=%s old=%s:%d new=%s:%d", rc->what,
                        rc->node.host ? rc->node.host : "-", rc->node.port, host, port);
            rc_drop(rc); /* not in one of its callbacks: its pending commands fail now */
            if (was_up && rc->on_down)
                rc->on_down(rc, OUTBOX_ECLOSED, rc->data);
            if (!rc->running || rc->closing || rc->conn)
                return;
        }
        uv_timer_stop(&rc->timer);
    }
    if ((e = outbox__sentinel_node_url(&node, &rc->url, host, port)) != 0) {
        rc_retry(rc, e, outbox_strerror(e));
        return;
    }
    outbox__redis_url_free(&rc->node);
    rc->node = node;
    rc_connect_to(rc, &rc->node);
}

/* The one place that decides which node the connection goes to: the URL's
 * own, or the master the sentinels name, asked again before every attempt.
 * (Redis Cluster would choose the node of a slot here.) */
static void rc_connect(outbox__rconn *rc)
{
    int e;
    if (!rc->running || rc->closing || rc->conn || rc->locating)
        return;
    if (!rc->url.sentinel) {
        rc_connect_to(rc, &rc->url);
        return;
    }
    if (!rc->sentinel &&
        (e = outbox__sentinel_create(&rc->sentinel, rc->loop, &rc->url, &rc->opt, rc->log, rc->what, rc_on_master,
                                     rc)) != 0) {
        rc_retry(rc, e, outbox_strerror(e));
        return;
    }
    rc->locating = 1;
    outbox__sentinel_locate(rc->sentinel);
}

static int is_redirect(const redisReply *reply)
{
    /* UNBLOCKED: a blocked command (XREADGROUP BLOCK) of a master that
     * was just turned into a replica. */
    static const char *const codes[] = {"READONLY", "MASTERDOWN", "UNBLOCKED"};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        size_t n = strlen(codes[i]);
        if (reply->len >= n && memcmp(reply->str, codes[i], n) == 0 && (reply->len == n || reply->str[n] == ' '))
            return 1;
    }
    return 0;
}

int outbox__rconn_redirect_error(outbox__rconn *rc, const outbox__redis *conn, const redisReply *reply)
{
    char why[128];
    if (!rc->url.sentinel || !reply || reply->type != REDIS_REPLY_ERROR || !reply->str || !is_redirect(reply))
        return 0;
    if (conn != rc->conn || rc->closing)
        return 1;
    quote_free(why, sizeof why, reply->str);
    outbox__log(rc->log, OUTBOX_LOG_WARN,
                "msg=\"the node is not the master any more, asking the sentinels again\" conn=%s node=%s:%d "
                "reply=\"%.100s\"",
                rc->what, rc->node.host ? rc->node.host : "-", rc->node.port, why);
    rc->down_pending = rc->up;
    rc_drop(rc);
    rc->failures = 1;
    rc->down_since = rc->last_log = uv_now(rc->loop);
    if (rc->running)
        uv_timer_start(&rc->timer, rc_on_timer, 0, 0);
    return 1;
}

int outbox__rconn_init(outbox__rconn *rc, uv_loop_t *loop, const outbox__redis_url *url,
                       const outbox__redis_options *opt, const outbox__logger *log, const char *what)
{
    memset(rc, 0, sizeof *rc);
    rc->loop = loop;
    rc->log = log;
    rc->opt = *opt;
    rc->opt.tls = NULL;
    outbox__strlcpy(rc->what, what, sizeof rc->what);
    if (!url->tls && opt->tls)
        return OUTBOX_EINVAL;
    if (url->tls) {
        /* One configuration for every attempt: the trust store is read
         * once, not at each reconnect. */
        int e = opt->tls ? 0 : outbox__tls_config_create(&rc->opt.tls, NULL, NULL, 0);
        if (e != 0)
            return e;
        if (opt->tls)
            rc->opt.tls = outbox__tls_config_ref(opt->tls);
    }
    if (outbox__redis_url_copy(&rc->url, url) != 0) {
        outbox__tls_config_unref(rc->opt.tls);
        rc->opt.tls = NULL;
        return OUTBOX_ENOMEM;
    }
    outbox__redis_url_describe(&rc->url, rc->desc, sizeof rc->desc);
    return 0;
}

void outbox__rconn_start(outbox__rconn *rc)
{
    if (rc->running || rc->closing)
        return;
    /* The timer exists from start on: an rconn that was only initialised
     * owns no handle and is discarded with outbox__rconn_discard(). */
    uv_timer_init(rc->loop, &rc->timer);
    rc->timer.data = rc;
    rc->handles = 1;
    rc->started = 1;
    rc->running = 1;
    rc_connect(rc);
}

void outbox__rconn_discard(outbox__rconn *rc)
{
    outbox__redis_url_free(&rc->url);
    outbox__redis_url_free(&rc->node);
    outbox__tls_config_unref(rc->opt.tls);
    rc->opt.tls = NULL;
}

outbox__redis *outbox__rconn_get(const outbox__rconn *rc)
{
    return rc->up ? rc->conn : NULL;
}

void outbox__rconn_reset(outbox__rconn *rc, const char *why)
{
    if (!rc->conn || rc->closing)
        return;
    outbox__log(rc->log, OUTBOX_LOG_WARN, "msg=\"dropping redis connection\" conn=%s reason=\"%s\"", rc->what, why);
    rc_drop(rc);
    if (rc->running)
        uv_timer_start(&rc->timer, rc_on_timer, 100, 0);
}

void outbox__rconn_hold(outbox__rconn *rc)
{
    if (!rc->running)
        return;
    rc->running = 0;
    uv_timer_stop(&rc->timer);
    if (!rc->up)
        rc_drop(rc);
}

void outbox__rconn_close(outbox__rconn *rc, void (*cb)(void *data), void *data)
{
    if (rc->closing || !rc->started)
        return;
    rc->closing = 1;
    rc->running = 0;
    rc->close_cb = cb;
    rc->close_data = data;
    rc_drop(rc);
    if (rc->sentinel) {
        rc->handles++;
        outbox__sentinel_close(rc->sentinel, rc_conn_closed, rc);
        rc->sentinel = NULL;
    }
    uv_close((uv_handle_t *)&rc->timer, rc_timer_closed);
}
