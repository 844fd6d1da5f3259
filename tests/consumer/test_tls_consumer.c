/*
 * test_tls_consumer.c: the consumer-group helper and the dedup module over
 * mutual TLS (a redis-server with tls-auth-clients yes), with certificates
 * made by the `openssl` command at test time: every message delivered with
 * its exact payload, deduplicated and acknowledged over TLS; the whole path
 * over TLS (outbox-relay publishing to a rediss:// URL, trusting the test CA
 * through OpenSSL's SSL_CERT_FILE since its --tls-* options do not exist
 * yet, and the consumer reading); and the TLS settings that create
 * refuses, each with its message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"
#include "tls/tls.h"
#include "tls_certs.h"

#define STREAM "outbox:orders"
#define GROUP "billing"
#define MSGS 50

static tls_certs *certs;

static void payload_of(int i, char *buf, size_t cap, size_t *len);

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

/* Consumes STREAM from url with the given TLS settings until drained;
 * checks every payload; returns how many arrived. */
static int consume_all(const char *url, const outbox_tls_settings *tls, redisContext *rc, const char *name)
{
    outbox_consumer_settings s;
    outbox_consumer *c;
    outbox_consumer_stats st;
    uv_loop_t loop;
    char err[600], buf[64];
    int i, exact = 1;
    size_t len;
    got g;

    memset(&g, 0, sizeof g);
    uv_loop_init(&loop);
    settings(&s, url, &g);
    s.tls = *tls;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "%s: consumer created %s", name, err);
    is_int(outbox_consumer_start(c), 0, "%s: started (two connections and the dedup module, all TLS)", name);
    ok(ct_run_until(&loop, &g.drained, 30000 * th_slow()), "%s: drained", name);
    is_int(g.n, MSGS, "%s: %d messages delivered", name, MSGS);
    for (i = 0; i < MSGS && i < g.n; i++) {
        payload_of(i, buf, sizeof buf, &len);
        if (g.len[i] != len || memcmp(g.payload[i], buf, len) != 0)
            exact = 0;
    }
    ok(exact, "%s: each payload exact (binary, in order)", name);
    outbox_consumer_stats_get(c, &st);
    is_int(st.applied, MSGS, "%s: applied %d", name, MSGS);
    is_int(st.acked, MSGS, "%s: acknowledged over TLS", name);
    is_int(ct_pending(rc, STREAM, GROUP), 0, "%s: nothing pending in the group", name);
    {
        char *v = ct_get(rc, "dedup:" GROUP ":{" STREAM "}:msg-007");
        is_str(v, "D", "%s: the dedup module marked messages done over TLS", name);
        free(v);
    }
    is_int(outbox_consumer_stop(c, on_stopped, &g), 0, "%s: stop", name);
    ok(ct_run_until(&loop, &g.stopped, 10000 * th_slow()), "%s: stop callback ran", name);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "%s: uv_loop_close() == 0", name);
    for (i = 0; i < MSGS && i < g.n; i++)
        free(g.payload[i]);
    return g.n;
}

/* outbox-relay publishes MSGS rows to a TLS port, the consumer reads them. */
static void test_relay_to_consumer(void)
{
    th_redis srv;
    redisContext *rc;
    outbox_tls_settings tls;
    sqlite3 *db;
    sqlite3_stmt *st;
    char *dir = th_tmpdir(), *path = th_path(dir, "app.db"), *relay = th_bin("tools/relay/outbox-relay");
    char url[128], env[600], err[300], buf[64];
    char *errout = NULL;
    int port, i, code;
    size_t len;

    port = tls_redis_start(&srv, certs, "server.crt", "server.key", 0, 0, NULL);
    if (port < 0)
        bail("cannot start redis-server with TLS");
    if (outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err) != 0)
        bail("database: %s", err);
    if (sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, payload) VALUES (?1, 'orders', ?2)", -1, &st, NULL))
        bail("prepare: %s", sqlite3_errmsg(db));
    for (i = 0; i < MSGS; i++) {
        char id[32];
        snprintf(id, sizeof id, "msg-%03d", i);
        payload_of(i, buf, sizeof buf, &len);
        sqlite3_bind_text(st, 1, id, -1, SQLITE_TRANSIENT);
        sqlite3_bind_blob(st, 2, buf, (int)len, SQLITE_TRANSIENT);
        if (sqlite3_step(st) != SQLITE_DONE)
            bail("insert: %s", sqlite3_errmsg(db));
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    sqlite3_close_v2(db);

    snprintf(url, sizeof url, "rediss://localhost:%d", port);
    snprintf(env, sizeof env, "SSL_CERT_FILE=%s", tls_cert(certs, "ca.crt"));
    {
        char *argv[] = {relay, "--db", path, "--redis", url, "--drain", NULL};
        char *env_add[] = {env, NULL};
        code = th_run(argv, env_add, NULL, &errout, 60000 * th_slow());
        is_int(code, 0, "outbox-relay --drain published over TLS (rediss://, the default trust store)");
        if (code != 0)
            th_diag_tail("relay", errout, 40);
        free(errout);
        errout = NULL;
    }
    {
        /* Without the test CA in its trust store the relay cannot verify
         * the server: it says so and keeps retrying (killed here). */
        char *argv[] = {relay, "--db", path, "--redis", url, "--drain", NULL};
        char *env_add[] = {"SSL_CERT_FILE=/nonexistent", NULL};
        th_run(argv, env_add, NULL, &errout, 2000 * th_slow());
        ok(errout && strstr(errout, "TLS with redis failed, retrying with backoff") && strstr(errout, "err=ETLS") &&
               strstr(errout, "certificate verification failed for 'localhost'"),
           "outbox-relay without the CA: 'TLS with redis failed' with the reason, retried");
        if (!errout || !strstr(errout, "err=ETLS"))
            th_diag_tail("relay", errout, 20);
        free(errout);
    }
    rc = th_redis_client(&srv);
    is_int(th_xlen(rc, STREAM), MSGS, "%d entries in %s", MSGS, STREAM);
    outbox_tls_defaults(&tls);
    tls.ca_file = tls_cert(certs, "ca.crt");
    consume_all(url, &tls, rc, "relay to consumer");
    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    free(path);
    free(relay);
}

int main(void)
{
    th_redis srv;
    redisContext *rc;
    outbox_tls_settings tls;
    char url[128], buf[64];
    int port, i;
    size_t len;

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
    mtls(&tls);
    consume_all(url, &tls, rc, "mutual TLS");
    redisFree(rc);
    th_redis_destroy(&srv);
    test_relay_to_consumer();
    tls_certs_free(certs);
    return tap_done();
}
