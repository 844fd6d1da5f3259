/*
 * test_cluster_consumer_tls.c: the consumer side on a rediss-cluster://
 * URL: a cluster of 3 masters with a replica each whose nodes, bus and
 * replication speak TLS (cluster_env.h's ce_start_tls, certificates of
 * tls_certs.h), the consumer trusting the test CA.
 *   1. The consumer-group helper with the Redis dedup module applies every
 *      message once, before and after its stream's slot is moved to
 *      another master (the slot map over TLS names the TLS ports); nothing
 *      is left pending on the new owner and every marker is "D" there.
 *   2. outbox-consume --tls-ca-file --print --drain prints each message
 *      once and exits 0.
 *   3. Without the CA (the system's trust store) no node's certificate
 *      verifies: nothing is delivered, and the failure is logged as TLS.
 * And the env's redis-cli reshard over TLS.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../consumer/ct.h"
#include "cluster_env.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"
#include "tls_certs.h"

#define N 200

static ce_env env;
static tls_certs *certs;
static char stream[64];
static int applied[2 * N];
static char tls_line[512];

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    int i = -1;
    (void)data;
    if (sscanf(dv->msg->id, "t-%d", &i) == 1 && i >= 0 && i < 2 * N)
        applied[i]++;
    outbox_consumer_done(c, dv, 0);
    return 0;
}

static void capture(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    if (level >= OUTBOX_LOG_WARN && !tls_line[0] && strstr(msg, "TLS"))
        snprintf(tls_line, sizeof tls_line, "%s", msg);
}

static void write_range(int first, int n)
{
    for (int i = first; i < first + n; i++) {
        char id[32];
        size_t len;
        char *envl;
        const char *argv[7];
        size_t lens[7];
        redisReply *r;
        snprintf(id, sizeof id, "t-%d", i);
        envl = ct_envelope(id, "orders", "x", 1, &len);
        argv[0] = "XADD", lens[0] = 4;
        argv[1] = stream, lens[1] = strlen(stream);
        argv[2] = "*", lens[2] = 1;
        argv[3] = "id", lens[3] = 2;
        argv[4] = id, lens[4] = strlen(id);
        argv[5] = "envelope", lens[5] = 8;
        argv[6] = envl, lens[6] = len;
        r = ce_cmd_argv(&env, stream, 7, argv, lens, 10000);
        if (!r || r->type != REDIS_REPLY_STRING)
            bail("XADD %s: %s", id, r && r->type == REDIS_REPLY_ERROR ? r->str : "no answer");
        freeReplyObject(r);
        free(envl);
    }
}

static int applied_upto(void *arg)
{
    int n = *(int *)arg;
    for (int i = 0; i < n; i++)
        if (!applied[i])
            return 0;
    return 1;
}

static void test_helper(int to)
{
    uv_loop_t loop;
    outbox_consumer_settings s;
    outbox_consumer *c = NULL;
    char err[512];
    int n = N, twice = 0, done = 0, slot = ce_slot_of(&env, stream);
    redisContext *rc;

    uv_loop_init(&loop);
    outbox_consumer_defaults(&s);
    s.redis_url = env.url;
    s.stream = stream;
    s.group = "g";
    s.handler = handler;
    s.block_ms = 200;
    s.min_idle_ms = 1000;
    s.claim_interval_ms = 300;
    s.tls.ca_file = tls_cert(certs, "ca.crt");
    s.log_level = OUTBOX_LOG_WARN;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "helper: created on %s%s%s", env.url,
           err[0] ? ": " : "", err);
    if (!c)
        bail("cannot go on without the consumer");
    is_int(outbox_consumer_start(c), 0, "helper: started");
    write_range(0, N);
    ok(ct_run_until_cond(&loop, applied_upto, &n, 20000 * th_slow()), "helper: %d messages applied over TLS", N);
    is_int(ce_move_slot(&env, slot, to), 0, "helper: the stream's slot %d moved to node %d", slot, to);
    write_range(N, N);
    n = 2 * N;
    ok(ct_run_until_cond(&loop, applied_upto, &n, 20000 * th_slow()), "helper: %d more applied from the new owner", N);
    ct_run_for(&loop, 300);
    for (int i = 0; i < 2 * N; i++)
        twice += applied[i] > 1;
    is_int(twice, 0, "helper: each applied once");
    rc = ce_client(&env, to);
    ok(rc != NULL, "helper: the new owner answers");
    if (rc) {
        is_int(ct_pending(rc, stream, "g"), 0, "helper: nothing pending on the new owner");
        for (int i = 0; i < 2 * N; i++) {
            char key[160], *v;
            snprintf(key, sizeof key, "dedup:g:{%s}:t-%d", stream, i);
            v = ct_get(rc, key);
            done += v && strcmp(v, "D") == 0;
            free(v);
        }
        is_int(done, 2 * N, "helper: every marker D on the new owner");
        redisFree(rc);
    }
    outbox_consumer_stop(c, NULL, NULL);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "helper: the loop closes cleanly");
}

static void test_cli(void)
{
    const char *args[] = {"--redis", env.url, "--stream", stream, "--group", "g2", "--print", "--drain",
                          "--tls-ca-file", tls_cert(certs, "ca.crt"), "--block-ms", "200", NULL};
    char *out = NULL, *err = NULL;
    int rc = ct_consume_run(args, NULL, &out, &err, 60000 * th_slow()), missing = 0, twice = 0;
    is_int(rc, 0, "cli: outbox-consume --drain over rediss-cluster:// exits 0");
    for (int i = 0; i < 2 * N; i++) {
        char needle[48];
        const char *p = out ? out : "";
        int k = 0;
        snprintf(needle, sizeof needle, "\"id\":\"t-%d\"", i);
        while ((p = strstr(p, needle)) != NULL) {
            k++;
            p += strlen(needle);
        }
        missing += k == 0;
        twice += k > 1;
    }
    is_int(missing, 0, "cli: every message printed");
    is_int(twice, 0, "cli: none twice");
    if (rc != 0 || missing)
        th_diag_tail("outbox-consume", err, 20);
    free(out);
    free(err);
}

static void test_untrusted(void)
{
    uv_loop_t loop;
    outbox_consumer_settings s;
    outbox_consumer *c = NULL;
    outbox_consumer_stats st;
    char err[512];

    uv_loop_init(&loop);
    outbox_consumer_defaults(&s);
    s.redis_url = env.url;
    s.stream = stream;
    s.group = "g3";
    s.handler = handler;
    s.log = capture;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "untrusted: created without the test CA");
    is_int(outbox_consumer_start(c), 0, "untrusted: started");
    ct_run_for(&loop, 1500);
    outbox_consumer_stats_get(c, &st);
    is_int(st.delivered, 0, "untrusted: nothing delivered");
    ok(strstr(tls_line, "certificate verification failed") != NULL, "untrusted: logged as TLS: %s", tls_line);
    outbox_consumer_stop(c, NULL, NULL);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "untrusted: the loop closes cleanly");
}

int main(void)
{
    int m[CE_MAX_NODES];
    ce_tls t;
    certs = tls_certs_make();
    t.ca_file = tls_cert(certs, "ca.crt");
    t.cert_file = tls_cert(certs, "server.crt");
    t.key_file = tls_cert(certs, "server.key");
    if (ce_start_tls(&env, 3, 1, 0, NULL, &t) != 0)
        skip_all("cannot start a TLS cluster of 3 masters with a replica each");
    ok(strncmp(env.url, "rediss-cluster://127.0.0.1:", 27) == 0 && env.tls_port[0] > 0, "the URL names the TLS ports: %s",
       env.url);
    ce_master_list(&env, m);
    if (ce_name_in_slot(&env, ce_lowest_slot(&env, m[0]), "outbox:tls-", stream, sizeof stream) != 0)
        bail("no stream name");
    test_helper(m[1]);
    test_cli();
    test_untrusted();
    {
        /* The env's own reshard on a TLS cluster (redis-cli --tls). */
        int slot = ce_lowest_slot(&env, m[2]);
        is_int(ce_reshard(&env, m[2], m[0], 1), 0, "redis-cli --cluster reshard --tls of slot %d", slot);
        is_int(ce_owner_of_slot(&env, slot), m[0], "  it is node %d's now", m[0]);
    }
    ce_stop(&env);
    tls_certs_free(certs);
    return tap_done();
}
