/*
 * test_sentinel_tls.c: rediss-sentinel://: the sentinels and the data
 * nodes over TLS only (their TLS ports; tls-replication yes), the relay
 * trusting the test CA through SSL_CERT_FILE (the daemon has no TLS flags
 * yet). The relay drains over TLS, follows a SENTINEL FAILOVER, and with
 * --wait-replicas 1 every row is on the new master.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "sentinel_env.h"
#include "tap.h"

static sqlite3 *db;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

int main(void)
{
    se_env e;
    tls_certs *certs = tls_certs_make();
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    rt_audit a;
    pid_t pid;

    se_world_start(&e, certs, &dir, &dbpath, &db);
    ok(strncmp(e.url, "rediss-sentinel://", 18) == 0, "TLS deployment up: %s", e.url);
    setenv("SSL_CERT_FILE", tls_cert(certs, "ca.crt"), 1); /* inherited by the relay */
    log = th_path(dir, "relay.log");

    rt_insert_rows(db, "tls", 0, 500, "tls", 8);
    pid = rt_relay_spawn(log, dbpath, e.url, "--wait-replicas", "1", "--max-attempts", "100000", "--backoff-min-ms",
                         "50", "--backoff-max-ms", "300", NULL);
    ok(th_wait_until(30000 * th_slow(), settled, NULL), "over TLS: every row published");
    ok(se_failover(&e, 0) == 0, "SENTINEL FAILOVER accepted");
    ok(se_wait_master(&e, 1, 30000 * th_slow()), "node 1 is the master");
    rt_insert_rows(db, "tls", 500, 500, "tls", 8);
    ok(th_wait_until(60000 * th_slow(), settled, NULL), "after the failover: every row published");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "the relay exits 0 on SIGTERM");
    c = th_redis_client(&e.node[1]);
    a = rt_audit_topic(db, c, "outbox:", "tls");
    redisFree(c);
    is_int(a.missing, 0, "every row on the new master");
    is_int(a.order_violations, 0, "each key in commit order");
    diag("over TLS: %ld entries for %ld rows, %ld duplicates", a.entries, a.rows, a.dups);
    text = th_slurp(log);
    ok(strstr(text, "sentinel announced a new master") != NULL, "the relay followed +switch-master over TLS");
    {
        char node[64];
        snprintf(node, sizeof node, "node=127.0.0.1:%d", e.tport[0]);
        ok(strstr(text, node) != NULL, "it published to node 0's TLS port (%s)", node);
        snprintf(node, sizeof node, "node=127.0.0.1:%d", e.tport[1]);
        ok(strstr(text, node) != NULL, "and then to node 1's (%s)", node);
    }
    if (a.missing || !strstr(text, "sentinel announced a new master"))
        th_diag_tail("relay", text, 30);
    free(text);

    free(log);
    se_world_end(&e, dir, dbpath, db);
    tls_certs_free(certs);
    return tap_done();
}
