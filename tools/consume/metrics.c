/*
 * metrics.c: outbox-consume's /metrics and /healthz (see metrics.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/http.h"
#include "ops/metrics.h"
#include "metrics.h"
#include "util/sbuf.h"
#include "ops/web_config.h"

/* The group's figures are asked for this often. */
#define REFRESH_MS 1000

struct consume_metrics {
    uv_loop_t *loop;
    const outbox__logger *log;
    char *listen, *stream, *group;
    outbox__web_config *web;
    outbox__http *http;
    outbox_consumer *c;
    uv_timer_t refresh;
    int refresh_started, asking, handles, closing;
    uint64_t down_ms, started_at, answered_at; /* loop time */
    outbox_consumer_group_info gi;
    int gi_ok; /* the last answer's figures */
    char why[200]; /* the last failure, for /healthz */
    void (*close_cb)(void *);
    void *close_data;
};

static void family(outbox__sbuf *b, const consume_metrics *m, const char *name, const char *type, const char *help,
                   long long v)
{
    outbox__sbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s{stream=\"", name, help, name, type, name);
    outbox__prom_label_value(b, m->stream);
    outbox__sbuf_puts(b, "\",group=\"");
    outbox__prom_label_value(b, m->group);
    outbox__sbuf_printf(b, "\"} %lld\n", v);
}

static void write_metrics(const consume_metrics *m, outbox__sbuf *b)
{
    outbox_consumer_stats st;
    outbox_consumer_stats_get(m->c, &st);
    family(b, m, "outbox_consumer_delivered_total", "counter", "Entries the group delivered to this consumer.",
           (long long)st.delivered);
    family(b, m, "outbox_consumer_applied_total", "counter", "Messages whose effect this consumer applied.",
           (long long)st.applied);
    family(b, m, "outbox_consumer_duplicates_total", "counter",
           "Messages skipped as already applied (the dedup marker or the inbox row said so).",
           (long long)st.duplicates);
    family(b, m, "outbox_consumer_failures_total", "counter",
           "Handler failures (the message left pending for a retry).", (long long)st.failed);
    family(b, m, "outbox_consumer_dead_lettered_total", "counter",
           "Entries moved to the dead stream (malformed, or delivered too often).", (long long)st.dead_lettered);
    family(b, m, "outbox_consumer_inflight", "gauge", "Messages this consumer is processing now.",
           (long long)st.inflight);
    family(b, m, "outbox_consumer_redis_up", "gauge", "1 while Redis answered the last question for the group's "
           "figures.", m->gi_ok);
    /* Not shown while unknown: a 0 would read as "all caught up". */
    if (m->gi_ok)
        family(b, m, "outbox_consumer_pending", "gauge",
               "Entries delivered to the group and not acknowledged (XINFO GROUPS).", (long long)m->gi.pending);
    if (m->gi_ok && m->gi.lag >= 0)
        family(b, m, "outbox_consumer_lag", "gauge",
               "Entries of the stream not yet delivered to the group (XINFO GROUPS; Redis 7.0 or later).",
               (long long)m->gi.lag);
}

static void on_http(void *data, outbox__http_req *req, const char *path)
{
    consume_metrics *m = data;
    uint64_t now = uv_now(m->loop), since = m->answered_at ? m->answered_at : m->started_at;
    char body[320];
    int n;
    if (!strcmp(path, "/metrics")) {
        outbox__sbuf b = {0};
        write_metrics(m, &b);
        if (b.oom)
            outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
        else
            outbox__http_respond(req, 200, "text/plain; version=0.0.4; charset=utf-8", b.p, b.len);
        outbox__sbuf_free(&b);
        return;
    }
    if (strcmp(path, "/healthz") != 0) {
        static const char nf[] = "not found: try /metrics or /healthz\n";
        outbox__http_respond(req, 404, "text/plain; charset=utf-8", nf, sizeof nf - 1);
        return;
    }
    if (now - since >= m->down_ms)
        n = snprintf(body, sizeof body, "unhealthy: redis has not answered for %llu ms (%s)\n",
                     (unsigned long long)(now - since), m->why[0] ? m->why : "no answer yet");
    else
        n = snprintf(body, sizeof body, "ok\n");
    if (n < 0)
        n = 0;
    else if ((size_t)n >= sizeof body)
        n = (int)sizeof body - 1;
    outbox__http_respond(req, body[0] == 'o' ? 200 : 503, "text/plain; charset=utf-8", body, (size_t)n);
}

static void on_info(outbox_consumer *c, int status, const outbox_consumer_group_info *gi, void *data)
{
    consume_metrics *m = data;
    (void)c;
    m->asking = 0;
    if (status == 0) {
        m->gi = *gi;
        m->gi_ok = 1;
        m->answered_at = uv_now(m->loop);
        m->why[0] = '\0';
        return;
    }
    m->gi_ok = 0;
    snprintf(m->why, sizeof m->why, "XINFO GROUPS: %s", outbox_strerror(status));
    /* Redis answered, only not with the group (not created yet). */
    if (status == OUTBOX_EREDIS)
        m->answered_at = uv_now(m->loop);
}

static void on_refresh(uv_timer_t *t)
{
    consume_metrics *m = t->data;
    int e;
    if (m->asking || m->closing)
        return;
    e = outbox_consumer_group_info_get(m->c, on_info, m);
    if (e == 0) {
        m->asking = 1;
        return;
    }
    m->gi_ok = 0;
    snprintf(m->why, sizeof m->why, "%s", outbox_strerror(e));
}

int consume_metrics_create(consume_metrics **out, uv_loop_t *loop, const char *listen, const char *web_path,
                           const char *stream, const char *group, uint64_t down_ms, const outbox__logger *log,
                           char *err, size_t errlen)
{
    struct sockaddr_storage ss;
    consume_metrics *m;
    char why[512];
    int e;
    *out = NULL;
    if (web_path && !listen)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "--metrics-web-config: given without --metrics-listen (it configures that endpoint)");
    if (outbox__http_parse_listen(listen, &ss, why, sizeof why) != 0)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "--metrics-listen: %s", why);
    if (!(m = calloc(1, sizeof *m)) || !(m->listen = strdup(listen)) || !(m->stream = strdup(stream)) ||
        !(m->group = strdup(group))) {
        consume_metrics_close(m, NULL, NULL);
        return OUTBOX_ENOMEM;
    }
    m->loop = loop;
    m->log = log;
    m->down_ms = down_ms;
    if (web_path && (e = outbox__web_config_load(&m->web, web_path, why, sizeof why)) != 0) {
        consume_metrics_close(m, NULL, NULL);
        return outbox__errf(err, errlen, e, "--metrics-web-config: %s", why[0] ? why : outbox_strerror(e));
    }
    *out = m;
    return 0;
}

int consume_metrics_start(consume_metrics *m, outbox_consumer *c, char *err, size_t errlen)
{
    int e;
    m->c = c;
    if ((e = outbox__http_start(&m->http, m->loop, m->listen, m->web, NULL, on_http, m, m->log, err, errlen)) != 0)
        return e;
    m->handles++;
    uv_timer_init(m->loop, &m->refresh);
    m->refresh.data = m;
    m->refresh_started = 1;
    m->handles++;
    m->started_at = uv_now(m->loop);
    uv_timer_start(&m->refresh, on_refresh, 0, REFRESH_MS);
    outbox__log(m->log, OUTBOX_LOG_INFO, "msg=\"serving /metrics and /healthz\" listen=%s tls=%s basic_auth_users=%zu",
                m->listen, m->web && m->web->tls ? "on" : "off", m->web ? m->web->nusers : (size_t)0);
    return 0;
}

static void metrics_free(consume_metrics *m)
{
    void (*cb)(void *) = m->close_cb;
    void *d = m->close_data;
    outbox__web_config_free(m->web);
    free(m->listen);
    free(m->stream);
    free(m->group);
    free(m);
    if (cb)
        cb(d);
}

static void one_closed(consume_metrics *m)
{
    if (--m->handles == 0)
        metrics_free(m);
}

static void http_closed(void *data)
{
    one_closed(data);
}

static void timer_closed(uv_handle_t *h)
{
    one_closed(h->data);
}

void consume_metrics_close(consume_metrics *m, void (*cb)(void *data), void *data)
{
    if (!m) {
        if (cb)
            cb(data);
        return;
    }
    if (m->closing)
        return;
    m->closing = 1;
    m->close_cb = cb;
    m->close_data = data;
    if (!m->handles) {
        metrics_free(m);
        return;
    }
    if (m->http)
        outbox__http_close(m->http, http_closed, m);
    if (m->refresh_started)
        uv_close((uv_handle_t *)&m->refresh, timer_closed);
}
