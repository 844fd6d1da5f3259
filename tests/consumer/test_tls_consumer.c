/*
 * test_tls_consumer.c: the consumer-group helper and the dedup module over
 * mutual TLS (a redis-server with tls-auth-clients yes), with certificates
 * made by the `openssl` command at test time: every message delivered with
 * its exact payload, deduplicated and acknowledged over TLS; and the TLS
 * settings that create refuses, each with its message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"
#include "tls.h"
#include "tls_certs.h"

#define STREAM "outbox:orders"
#define GROUP "billing"
#define MSGS 50

static tls_certs *certs;

typedef struct got {
    int n, drained, stopped;
    char *payload[MSGS];
    size_t len[MSGS];
} got;

static void payload_of(int i, char *buf, size_t cap, size_t *len)
{
    /* binary, with NUL bytes and CRLF, different for each message */
    int n = snprintf(buf, cap, "order %d\r\n", i);
    buf[n++] = '\0';
    buf[n++] = (char)(0x80 + i);
    n += snprintf(buf + n, cap - (size_t)n, "end");
    *len = (size_t)n;
}

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    got *g = data;
    if (g->n < MSGS) {
        g->payload[g->n] = malloc(dv->msg->payload_len + 1);
        if (!g->payload[g->n])
            bail("out of memory");
        memcpy(g->payload[g->n], dv->msg->payload, dv->msg->payload_len);
        g->len[g->n] = dv->msg->payload_len;
    }
    g->n++;
    outbox_consumer_done(c, dv, 0);
    return 0;
}

static void on_drained(outbox_consumer *c, void *data)
{
    (void)c;
    ((got *)data)->drained = 1;
}

static void on_stopped(outbox_consumer *c, void *data)
{
    (void)c;
    ((got *)data)->stopped = 1;
}

static void mtls(outbox_tls_settings *t)
{
    outbox_tls_defaults(t);
    t->ca_file = tls_cert(certs, "ca.crt");
    t->cert_file = tls_cert(certs, "client.crt");
    t->key_file = tls_cert(certs, "client.key");
}

static void settings(outbox_consumer_settings *s, const char *url, got *g)
{
    outbox_consumer_defaults(s);
    s->redis_url = url;
    s->stream = STREAM;
    s->group = GROUP;
    s->consumer = "tls-1";
    s->drain = 1;
    s->on_drained = on_drained;
    s->handler = handler;
    s->data = g;
    s->log_level = OUTBOX_LOG_WARN;
    mtls(&s->tls);
}

static void test_refused(const char *tls_url)
{
    outbox_consumer_settings s;
    outbox_dedup_settings ds;
    outbox_consumer *c = NULL;
    outbox_dedup *d = NULL;
    uv_loop_t loop;
    char err[600];
    got g;

    memset(&g, 0, sizeof g);
    uv_loop_init(&loop);
    outbox_consumer_defaults(&s);
    ok(!outbox__tls_settings_given(&s.tls), "consumer defaults: no TLS settings");
    settings(&s, "redis://127.0.0.1:6379", &g);
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), OUTBOX_EINVAL,
           "consumer: TLS settings with a redis:// URL refused");
    ok(c == NULL && strstr(err, "tls: TLS settings given but the Redis URL is not rediss://"), "  message: %s", err);
    settings(&s, "unix:///tmp/x.sock", &g);
    s.tls.ca_file = NULL;
    s.tls.cert_file = s.tls.key_file = NULL;
    s.tls.insecure = 1;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), OUTBOX_EINVAL,
           "consumer: insecure with a unix:// URL refused");
    settings(&s, tls_url, &g);
    s.tls.ca_file = "/nonexistent/ca.pem";
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "consumer: missing CA file");
    ok(strstr(err, "CA file '/nonexistent/ca.pem': No such file or directory") != NULL, "  message: %s", err);
    settings(&s, tls_url, &g);
    s.tls.key_file = tls_cert(certs, "server.key");
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "consumer: key of another certificate");
    ok(strstr(err, "does not match certificate file") != NULL, "  message: %s", err);
    settings(&s, tls_url, &g);
    s.tls.key_file = NULL;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "consumer: certificate without key");
    ok(strstr(err, "without a key file") != NULL, "  message: %s", err);

    outbox_dedup_defaults(&ds);
    ok(!outbox__tls_settings_given(&ds.tls), "dedup defaults: no TLS settings");
    ds.redis_url = "redis://127.0.0.1:6379";
    ds.tls.server_name = "redis.example";
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EINVAL,
           "dedup: TLS settings with a redis:// URL refused");
    ok(d == NULL && strstr(err, "not rediss://") != NULL, "  message: %s", err);
    ds.redis_url = tls_url;
    ds.tls.server_name = NULL;
    ds.tls.ca_file = tls_cert(certs, "garbage.pem");
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EINVAL, "dedup: CA file that is not PEM");
    ok(strstr(err, tls_cert(certs, "garbage.pem")) != NULL, "  message names the file: %s", err);
    is_int(uv_loop_close(&loop), 0, "refused creates leave the loop empty");
}

int main(void)
{
    th_redis srv;
    redisContext *rc;
    outbox_consumer_settings s;
    outbox_consumer *c;
    outbox_consumer_stats st;
    uv_loop_t loop;
    char url[128], err[600], buf[64];
    int port, i, exact = 1;
    size_t len;
    got g;

    certs = tls_certs_make();
    port = tls_redis_start(&srv, certs, "server.crt", "server.key", 1, 0, NULL);
    if (port < 0)
        skip_all("redis-server with TLS not available");
    snprintf(url, sizeof url, "rediss://localhost:%d", port);
    test_refused(url);

    rc = th_redis_client(&srv);
    for (i = 0; i < MSGS; i++) {
        char id[32];
        snprintf(id, sizeof id, "msg-%03d", i);
        payload_of(i, buf, sizeof buf, &len);
        ct_xadd_msg(rc, STREAM, id, "orders", buf, len, NULL);
    }

    memset(&g, 0, sizeof g);
    uv_loop_init(&loop);
    settings(&s, url, &g);
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "consumer over mutual TLS created %s", err);
    is_int(outbox_consumer_start(c), 0, "started (two connections and the dedup module, all TLS)");
    ok(ct_run_until(&loop, &g.drained, 30000 * th_slow()), "drained");
    is_int(g.n, MSGS, "%d messages delivered", MSGS);
    for (i = 0; i < MSGS && i < g.n; i++) {
        payload_of(i, buf, sizeof buf, &len);
        if (g.len[i] != len || memcmp(g.payload[i], buf, len) != 0)
            exact = 0;
    }
    ok(exact, "each payload exact (binary, in order)");
    outbox_consumer_stats_get(c, &st);
    is_int(st.applied, MSGS, "applied %d", MSGS);
    is_int(st.acked, MSGS, "acknowledged over TLS");
    is_int(ct_pending(rc, STREAM, GROUP), 0, "nothing pending in the group");
    {
        char *v = ct_get(rc, "dedup:" GROUP ":{" STREAM "}:msg-007");
        is_str(v, "D", "the dedup module marked messages done over TLS");
        free(v);
    }
    is_int(outbox_consumer_stop(c, on_stopped, &g), 0, "stop");
    ok(ct_run_until(&loop, &g.stopped, 10000 * th_slow()), "stop callback ran");
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "uv_loop_close() == 0");

    for (i = 0; i < MSGS && i < g.n; i++)
        free(g.payload[i]);
    redisFree(rc);
    th_redis_destroy(&srv);
    tls_certs_free(certs);
    return tap_done();
}
