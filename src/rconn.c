#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rconn.h"

static void rc_connect(outbox__rconn *rc);

static void rc_handle_gone(outbox__rconn *rc)
{
    if (--rc->handles == 0 && rc->closing) {
        outbox__redis_url_free(&rc->url);
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
    rc_connect(t->data);
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
                    outbox__redis_failure_text(status), rc->what, rc->desc, outbox_err_name(status), detail);
    } else if (now - rc->last_log >= 30000) {
        rc->last_log = now;
        outbox__log(rc->log, OUTBOX_LOG_WARN,
                    "msg=\"%s, still retrying\" conn=%s redis=%s for_ms=%llu attempts=%u err=%s detail=\"%s\"",
                    outbox__redis_failure_text(status), rc->what, rc->desc,
                    (unsigned long long)(now - rc->down_since), rc->failures, outbox_err_name(status), detail);
    }
    /* 100 ms doubling to 5 s; failures counts this one already. */
    d = outbox__backoff_ms(100, 5000, rc->failures);
    uv_timer_start(&rc->timer, rc_on_timer, d, 0);
}

static void quote_free(char *buf, size_t len, const char *s)
{
    outbox__strlcpy(buf, s, len);
    for (char *p = buf; *p; p++)
        if (*p == '"' || *p == '\n')
            *p = '\'';
}

static void rc_connected(outbox__redis *c, int status, void *data)
{
    outbox__rconn *rc = data;
    char detail[256];
    if (c != rc->conn)
        return;
    if (status != 0) {
        quote_free(detail, sizeof detail, outbox__redis_errstr(c));
        rc_retry(rc, status, detail);
        return;
    }
    rc->up = 1;
    if (outbox__tls_config_insecure(rc->opt.tls))
        outbox__log(rc->log, OUTBOX_LOG_WARN,
                    "msg=\"TLS without verification: the server's certificate and name are not checked\" conn=%s "
                    "redis=%s",
                    rc->what, rc->desc);
    if (rc->failures)
        outbox__log(rc->log, OUTBOX_LOG_INFO, "msg=\"redis reachable again\" conn=%s redis=%s attempts=%u",
                    rc->what, rc->desc, rc->failures);
    else
        outbox__log(rc->log, OUTBOX_LOG_INFO, "msg=\"connected to redis\" conn=%s redis=%s", rc->what, rc->desc);
    rc->failures = 0;
    if (rc->on_up)
        rc->on_up(rc, rc->data);
}

static void rc_disconnected(outbox__redis *c, int status, void *data)
{
    outbox__rconn *rc = data;
    char detail[256];
    if (c != rc->conn)
        return;
    quote_free(detail, sizeof detail, outbox__redis_errstr(c));
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

static void rc_connect(outbox__rconn *rc)
{
    int e;
    if (!rc->running || rc->closing || rc->conn)
        return;
    e = outbox__redis_create(&rc->conn, rc->loop, &rc->url, &rc->opt, rc);
    if (e == 0)
        e = outbox__redis_connect(rc->conn, rc_connected, rc_disconnected);
    if (e != 0)
        rc_retry(rc, e, outbox_strerror(e));
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
    uv_close((uv_handle_t *)&rc->timer, rc_timer_closed);
}
