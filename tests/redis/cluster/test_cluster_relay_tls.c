/*
 * test_cluster_relay_tls.c: the outbox-relay daemon on a rediss-cluster://
 * URL (3 masters with a replica each, nodes, bus and replication over TLS:
 * cluster_env.h's ce_start_tls, certificates of tls_certs.h):
 *   1. 6 topics, keyed and unkeyed, drain while a writer commits and one
 *      stream's slot is moved by hand (ASK, then MOVED, over TLS) and 20
 *      slots are resharded: every committed row in its stream, per-key
 *      order, the slot map read with the TLS ports (every master connected
 *      over TLS);
 *   2. without the test CA (the system's trust store) no node is trusted:
 *      --drain ends at its timeout, exit 1, the log says why.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bg_writer.h"
#include "cluster_env.h"
#include "harness.h"
#include "ops.h"
#include "rt.h"
#include "tap.h"
#include "tls_certs.h"

#define TOPICS 6
#define ROWS 400

static ce_env env;
static tls_certs *certs;
static sqlite3 *db;
static char *dir, *dbpath;
static char streams[TOPICS][80];
static const char *topics[TOPICS];
static bg_writer writer;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

static void test_faults(void)
{
    int masters[CE_MAX_NODES], nm = ce_master_list(&env, masters), mport = th_free_port(), from, to, k;
    char log[512], listen[32], *m = NULL;
    pid_t pid;
    long missing = 0, order = 0, dups = 0;

    for (int i = 0; i < TOPICS; i++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "outbox:s%d-", i);
        if (ce_name_in_slot(&env, ce_lowest_slot(&env, masters[i % nm]) + i / nm, prefix, streams[i],
                            sizeof streams[i]) != 0)
            bail("no stream name");
        topics[i] = streams[i] + 7;
        rt_insert_rows(db, topics[i], 0, ROWS, topics[i], i % 2 == 0 ? 5 : 0);
    }
    snprintf(log, sizeof log, "%s/relay.log", dir);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", mport);
    pid = rt_relay_spawn(log, dbpath, env.url, "--tls-ca-file", tls_cert(certs, "ca.crt"), "--max-attempts",
                         "100000", "--backoff-min-ms", "50", "--backoff-max-ms", "300", "--batch", "64",
                         "--metrics-listen", listen, NULL);
    bg_writer_start(&writer, dbpath, topics, TOPICS, 1, "w");
    /* The relay is publishing with the old slot map when the slot moves:
     * some rows published (however long its start takes), then a while. */
    for (int64_t t0 = th_now_ms(); th_now_ms() - t0 < 20000 * th_slow() &&
                                   th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") == 0;)
        th_sleep_ms(10);
    th_sleep_ms(500 * th_slow());

    /* Topic 1's slot moved by hand to the next master. */
    from = ce_owner(&env, streams[1]);
    for (k = 0; k < nm && masters[k] != from; k++)
        ;
    to = masters[(k + 1) % nm];
    is_int(ce_migrate_begin(&env, ce_slot_of(&env, streams[1]), to, 0), 0, "tls: migration begun");
    ok(ce_migrate_named(&env, streams[1]) >= 0, "tls: the stream MIGRATEd first (ASK window open)");
    th_sleep_ms(700 * th_slow());
    is_int(ce_migrate_finish(&env), 0, "tls: migration finished");
    /* 20 slots of topic 0's master resharded. */
    from = ce_owner(&env, streams[0]);
    for (k = 0; k < nm && masters[k] != from; k++)
        ;
    is_int(ce_reshard(&env, from, masters[(k + 1) % nm], 20), 0, "tls: reshard of 20 slots under the relay");
    th_sleep_ms(500);
    diag("tls: the writer committed %d rows meanwhile", bg_writer_stop(&writer));

    ok(th_wait_until(60000 * th_slow(), settled, NULL), "tls: every row settled");
    is_int(ot_http_get(mport, "/metrics", &m), 200, "tls: /metrics answers");
    ok(ot_prom_sum(m, "outbox_redis_node_connected", NULL) >= 3, "tls: connected to every master over TLS (%.0f)",
       ot_prom_sum(m, "outbox_redis_node_connected", NULL));
    ok(ot_prom_sum(m, "outbox_redis_node_moved_total", NULL) > 0, "tls: MOVED followed (%.0f)",
       ot_prom_sum(m, "outbox_redis_node_moved_total", NULL));
    diag("tls: ask %.0f, tryagain & co %.0f", ot_prom_sum(m, "outbox_redis_node_ask_total", NULL),
         ot_prom_sum(m, "outbox_redis_node_tryagain_total", NULL));
    free(m);
    is_int(th_stop(pid, SIGTERM, 20000), 0, "tls: the relay stops cleanly");
    for (int i = 0; i < TOPICS; i++) {
        int o = ce_owner(&env, streams[i]);
        redisContext *c = o >= 0 ? ce_client(&env, o) : NULL;
        rt_audit a;
        if (!c)
            bail("no owner for %s", streams[i]);
        a = rt_audit_topic(db, c, "outbox:", topics[i]);
        missing += a.missing + a.dead;
        order += a.order_violations;
        dups += a.dups;
        redisFree(c);
    }
    is_int(missing, 0, "tls: every committed row is in its stream");
    is_int(order, 0, "tls: per-key order held");
    diag("tls: %ld duplicates", dups);
}

static void test_untrusted(void)
{
    char *err = NULL;
    int rc;
    rt_insert_rows(db, "untrusted", 0, 5, "untrusted", 0);
    rc = rt_relay_run(30000 * th_slow(), &err, dbpath, env.url, "--drain", "--drain-timeout-ms", "2000", NULL);
    is_int(rc, 1, "untrusted: --drain ends at its timeout, exit 1");
    ok(err && strstr(err, "certificate verification failed"), "untrusted: the log says the certificate is not trusted");
    if (rc != 1)
        th_diag_tail("relay", err, 10);
    free(err);
    th_sql_exec(db, "DELETE FROM outbox WHERE topic = 'untrusted'");
}

int main(void)
{
    ce_tls t;
    int64_t t0 = th_now_ms();
    signal(SIGPIPE, SIG_IGN);
    certs = tls_certs_make();
    t.ca_file = tls_cert(certs, "ca.crt");
    t.cert_file = tls_cert(certs, "server.crt");
    t.key_file = tls_cert(certs, "server.key");
    if (ce_start_tls(&env, 3, 1, 0, NULL, &t) != 0)
        skip_all("cannot start a TLS cluster of 3 masters with a replica each");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    db = rt_open(dbpath);
    test_faults();
    test_untrusted();
    sqlite3_close(db);
    ce_stop(&env);
    tls_certs_free(certs);
    th_rmtree(dir);
    free(dir);
    free(dbpath);
    diag("total %lld ms", (long long)(th_now_ms() - t0));
    return tap_done();
}
