/*
 * test_cluster_consumer_invalid.c: bad Cluster input on the consumer side,
 * refused before anything connects (docs/BAD_INPUT.md):
 *   - outbox-consume --redis with a bad redis-cluster:// URL exits 2 naming
 *     the problem; --sentinel-password with a Cluster URL, and a --tls-*
 *     option with redis-cluster:// (not TLS), exit 2 naming the option;
 *     with rediss-cluster:// the --tls-* option is taken (a missing CA file
 *     is then what it names);
 *   - the C API: outbox_consumer_create and outbox_dedup_create answer
 *     OUTBOX_EURL with the same text for a bad Cluster URL, OUTBOX_EINVAL
 *     for sentinel credentials or TLS settings that do not fit, and accept
 *     a good Cluster URL without connecting (nobody listens on it);
 *   - a plain redis:// URL naming a cluster node that does not own the
 *     stream's slot (a real cluster of 3 masters, cluster_env.h): the
 *     consumer says once, as an error, that the URL names a Redis Cluster
 *     node and which redis-cluster:// URL to use.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../consumer/ct.h"
#include "cluster_env.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

typedef struct bad_url {
    const char *url, *message;
} bad_url;

static const bad_url bad[] = {
    {"redis-cluster://", "empty seed node list: expected redis-cluster://host:port[,host:port...]"},
    {"redis-cluster://u:pw@", "empty seed node list"},
    {"rediss-cluster:///0", "empty seed node list: expected rediss-cluster://host:port[,host:port...]"},
    {"redis-cluster://127.0.0.1:7000,,127.0.0.1:7001", "empty host in the seed node list"},
    {"redis-cluster://127.0.0.1:99999", "port 99999 out of range 1..65535"},
    {"redis-cluster://127.0.0.1:x", "port 'x' is not a number"},
    {"redis-cluster://127.0.0.1:7000/1", "database 1 with redis-cluster://: a Redis Cluster has only database 0"},
    {"redis-cluster://127.0.0.1:7000/x", "database 'x' is not a number"},
    {"redis-cluster://127.0.0.1:7000#mymaster", "unexpected '#mymaster' in redis-cluster:// URL"},
    {"redis-cluster://127.0.0.1:7000?db=0", "unexpected '?db=0' in redis-cluster:// URL"},
    {"redis-cluster://[::1:7000", "unterminated '['"},
    {"redis-clusters://127.0.0.1:7000", "bad scheme 'redis-clusters', expected redis://, rediss://, unix://, "
                                        "redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"cluster://127.0.0.1:7000", "bad scheme 'cluster'"},
};

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    (void)data;
    outbox_consumer_done(c, dv, 0);
    return 0;
}

/* outbox-consume with --redis url and the extra arguments (NULL-ended, at
 * most 4); exit status, stderr in *err. */
static int consume(const char *url, char **err, const char *a1, const char *a2)
{
    char *bin = th_bin("tools/consume/outbox-consume");
    char *argv[12] = {bin, "--redis", (char *)url, "--stream", "s", "--group", "g", "--print"};
    int n = 8, rc;
    if (a1)
        argv[n++] = (char *)a1;
    if (a2)
        argv[n++] = (char *)a2;
    argv[n] = NULL;
    rc = th_run(argv, NULL, NULL, err, 20000);
    free(bin);
    return rc;
}

static void test_cli(void)
{
    char *err = NULL;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = consume(bad[i].url, &err, NULL, NULL);
        is_int(rc, 2, "outbox-consume --redis '%s': exit 2", bad[i].url);
        ok(err && strstr(err, bad[i].message), "  names it: %s", bad[i].message);
        if (err && !strstr(err, bad[i].message))
            th_diag_tail("stderr", err, 5);
        free(err);
        err = NULL;
    }
    is_int(consume("redis-cluster://127.0.0.1:7000", &err, "--sentinel-password", "pw"), 2,
           "--sentinel-password with a Cluster URL: exit 2");
    ok(err && strstr(err, "sentinel_password needs a redis-sentinel:// URL"), "  names it");
    free(err);
    err = NULL;
    is_int(consume("redis-cluster://127.0.0.1:7000", &err, "--tls-ca-file", "/nonexistent/ca.pem"), 2,
           "--tls-ca-file with redis-cluster://: exit 2");
    ok(err && strstr(err, "--tls-ca-file: given but the Redis URL is not rediss://, rediss-sentinel:// or "
                          "rediss-cluster://"),
       "  names the option");
    free(err);
    err = NULL;
    is_int(consume("rediss-cluster://127.0.0.1:7000", &err, "--tls-ca-file", "/nonexistent/ca.pem"), 2,
           "--tls-ca-file with rediss-cluster://: taken, and the missing file refused");
    ok(err && strstr(err, "/nonexistent/ca.pem") && !strstr(err, "given but"), "  names the file");
    if (err && !strstr(err, "/nonexistent/ca.pem"))
        th_diag_tail("stderr", err, 5);
    free(err);
}

static void test_api(void)
{
    int refused_fd = -1, refused;
    uv_loop_t loop;
    outbox_consumer_settings cs;
    outbox_dedup_settings ds;
    outbox_consumer *c = NULL;
    outbox_dedup *d = NULL;
    char err[400], want[400], url[64];

    uv_loop_init(&loop);
    outbox_consumer_defaults(&cs);
    cs.stream = "s";
    cs.group = "g";
    cs.handler = handler;
    outbox_dedup_defaults(&ds);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(want, sizeof want, "redis: %s", bad[i].message);
        cs.redis_url = bad[i].url;
        is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), OUTBOX_EURL, "consumer: '%s': OUTBOX_EURL",
               bad[i].url);
        ok(c == NULL && strstr(err, want) == err, "  err: %s", err);
        ds.redis_url = bad[i].url;
        is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EURL, "dedup: '%s': OUTBOX_EURL",
               bad[i].url);
        ok(d == NULL && strstr(err, want) == err, "  err: %s", err);
    }

    cs.redis_url = "redis-cluster://127.0.0.1:7000";
    cs.sentinel_user = "sam";
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), OUTBOX_EINVAL,
           "consumer: sentinel_user with a Cluster URL");
    ok(strstr(err, "sentinel_user needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    cs.sentinel_user = NULL;
    cs.tls.insecure = 1;
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), OUTBOX_EINVAL,
           "consumer: TLS settings with redis-cluster://");
    ok(strstr(err, "TLS settings given but the Redis URL is not rediss://") != NULL, "  err: %s", err);
    cs.redis_url = "rediss-cluster://127.0.0.1:7000";
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), 0, "consumer: TLS settings with rediss-cluster://");
    outbox_consumer_destroy(c);
    c = NULL;
    cs.tls.insecure = 0;
    cs.redis_url = "redis-cluster://127.0.0.1:7000,127.0.0.1:7001";
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), 0, "consumer: a good Cluster URL");
    outbox_consumer_destroy(c);

    ds.redis_url = "redis-cluster://127.0.0.1:7000";
    ds.sentinel_password = "pw";
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EINVAL,
           "dedup: sentinel_password with a Cluster URL");
    ok(strstr(err, "sentinel_password needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    ds.sentinel_password = NULL;
    ds.tls.server_name = "redis.example";
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EINVAL, "dedup: TLS settings with redis-cluster://");
    ok(strstr(err, "TLS settings given but the Redis URL is not rediss://") != NULL, "  err: %s", err);
    ds.tls.server_name = NULL;
    refused = th_refused_port(&refused_fd);
    if (refused < 0)
        bail("cannot bind a loopback port");
    snprintf(url, sizeof url, "redis-cluster://127.0.0.1:%d", refused);
    ds.redis_url = url;
    ds.log_level = OUTBOX_LOG_ERROR; /* the refused connects are no news here */
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), 0, "dedup: a good Cluster URL (connects later)");
    ok(!outbox_dedup_connected(d), "  not connected: nobody listens there");
    outbox_dedup_destroy(d, NULL, NULL);
    close(refused_fd);
    is_int(uv_run(&loop, UV_RUN_DEFAULT), 0, "nothing left on the loop");
    is_int(uv_loop_close(&loop), 0, "the loop closes");
}

static char hint[256];
static int hints;

static void capture(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    if (level == OUTBOX_LOG_ERROR && strstr(msg, hint))
        hints++;
}

static void test_plain_url(void)
{
    ce_env env;
    uv_loop_t loop;
    outbox_consumer_settings cs;
    outbox_consumer *c = NULL;
    int m[CE_MAX_NODES];
    char stream[64], err[300];
    outbox_consumer_stats st;

    if (ce_start(&env, 3, 0, 0, NULL) != 0) {
        ok(0, "a cluster of 3 masters for the plain URL check");
        return;
    }
    ce_master_list(&env, m);
    if (ce_name_in_slot(&env, ce_lowest_slot(&env, m[1]), "outbox:plain-", stream, sizeof stream) != 0)
        bail("no stream name");
    snprintf(hint, sizeof hint, "the Redis URL names a Redis Cluster node: use a cluster URL, redis-cluster://127.0.0.1:%d",
             env.node[m[0]].port);
    uv_loop_init(&loop);
    outbox_consumer_defaults(&cs);
    cs.redis_url = env.node[m[0]].tcp_url;
    cs.stream = stream;
    cs.group = "g";
    cs.handler = handler;
    cs.block_ms = 100;
    cs.claim_interval_ms = 100;
    cs.log = capture;
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), 0, "plain URL %s of a node without the stream",
           cs.redis_url);
    is_int(outbox_consumer_start(c), 0, "  started");
    ct_run_for(&loop, 1500);
    is_int(hints, 1, "  said once that the URL names a cluster node: %s", hint);
    outbox_consumer_stats_get(c, &st);
    is_int(st.delivered, 0, "  nothing delivered");
    outbox_consumer_stop(c, NULL, NULL);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "  the loop closes cleanly");
    ce_stop(&env);
}

int main(void)
{
    test_cli();
    test_api();
    test_plain_url();
    return tap_done();
}
