/*
 * test_wait.c: --wait-replicas, with a real replica (redis-server
 * replicaof the primary over loopback TCP).
 *   1. With the replica up, messages are marked published once WAIT
 *      confirmed them, and they are on the replica; messages Redis refuses
 *      (WRONGTYPE) in the same batches are retried and dead-lettered. The
 *      daemon runs under valgrind when it is installed: a refused XADD
 *      leaves its WAIT group before being marked and freed, and the WAIT
 *      reply that comes later must not touch it.
 *   2. With the replica down, XADDs succeed but WAIT reports 0 replicas:
 *      nothing may be marked published. The relay asks WAIT again on the
 *      same connection rather than appending the entries again (each
 *      XADD made once); stopped, it leaves the rows pending with
 *      last_error naming WAIT.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N_GOOD 400
#define N_BAD 200

static sqlite3 *db;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

static int has_valgrind(void)
{
    /* A sanitizer build checks the daemon itself; valgrind cannot run it. */
    if (getenv("ASAN_OPTIONS"))
        return 0;
    char *argv[] = {"valgrind", "--version", NULL};
    return th_run(argv, NULL, NULL, NULL, 10000) == 0;
}

static int replica_linked(redisContext *c)
{
    redisReply *rep = th_cmd(c, "INFO replication");
    int up = rep->type == REDIS_REPLY_STRING && strstr(rep->str, "connected_slaves:1") != NULL;
    freeReplyObject(rep);
    return up;
}

/* How many WAITs the server has run (INFO commandstats). */
static long long wait_calls(redisContext *c)
{
    redisReply *rep = th_cmd(c, "INFO commandstats");
    const char *p = rep->type == REDIS_REPLY_STRING ? strstr(rep->str, "cmdstat_wait:calls=") : NULL;
    long long n = p ? atoll(p + strlen("cmdstat_wait:calls=")) : 0;
    freeReplyObject(rep);
    return n;
}

/* A write acknowledged by the replica: after the initial sync the primary
 * starts streaming only once the replica's first periodic ACK came (about a
 * second), and WAIT cannot succeed before that. */
static int replica_acks(redisContext *c)
{
    redisReply *rep;
    int acked;
    freeReplyObject(th_cmd(c, "SET probe x"));
    rep = th_cmd(c, "WAIT 1 100");
    acked = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
    freeReplyObject(rep);
    return acked;
}

int main(void)
{
    th_redis primary, replica;
    char *dir, *dbpath, *log, *log1, *text, *relay, conf[128];
    redisContext *c, *rc_replica;
    pid_t pid;
    int64_t deadline;
    int i, rc, vg;

    if (th_redis_start(&primary, 1, NULL) != 0)
        skip_all("redis-server not available");
    snprintf(conf, sizeof conf, "replicaof 127.0.0.1 %d\n", primary.port);
    if (th_redis_start(&replica, 0, conf) != 0) {
        th_redis_destroy(&primary);
        skip_all("cannot start a replica");
    }
    c = th_redis_client(&primary);
    deadline = th_now_ms() + 15000;
    while (!replica_acks(c) && th_now_ms() < deadline)
        th_sleep_ms(20);
    ok(replica_acks(c), "the replica is linked and acknowledges writes");

    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    log = th_path(dir, "relay.log");
    log1 = th_path(dir, "relay1.log");
    db = rt_open(dbpath);
    for (i = 0; i < 10; i++) {
        rt_insert_rows(db, "good", i * (N_GOOD / 10), N_GOOD / 10, "good", 0);
        rt_insert_rows(db, "bad", i * (N_BAD / 10), N_BAD / 10, "bad", 0);
    }
    freeReplyObject(th_cmd(c, "SET outbox:bad x"));

    /* 1: the replica acknowledges. */
    vg = has_valgrind();
    relay = th_bin("tools/relay/outbox-relay");
    {
        /* Not --drain: that stops once nothing is due, while refused rows
         * may still wait for their retry. */
        char *argv[] = {"valgrind", "-q", "--error-exitcode=99", relay, "--db", dbpath, "--redis", primary.url,
                        "--wait-replicas", "1", "--max-attempts", "2", "--backoff-min-ms", "20",
                        "--backoff-max-ms", "40", NULL};
        if (!vg)
            diag("valgrind not found: the daemon runs without it");
        pid = th_spawn(vg ? argv : argv + 3, NULL, log1, log1);
        if (pid < 0)
            bail("cannot start %s", vg ? "valgrind" : relay);
        ok(th_wait_until(120000, settled, NULL), "replica up: every row settles");
        rc = th_stop(pid, SIGTERM, 30000);
    }
    is_int(rc, 0, "replica up: SIGTERM exits 0%s", vg ? " (valgrind: no memory errors)" : "");
    text = th_slurp(log1);
    if (rc != 0)
        th_diag_tail("relay", text, 30);
    free(text);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'good' AND state = 2"), N_GOOD,
           "replica up: every good row published");
    is_int(th_xlen(c, "outbox:good"), N_GOOD, "replica up: %d entries on the primary (WAIT never failed)",
           N_GOOD);
    rc_replica = th_redis_client(&replica);
    deadline = th_now_ms() + 5000 * th_slow();
    while (th_xlen(rc_replica, "outbox:good") < N_GOOD && th_now_ms() < deadline)
        th_sleep_ms(10);
    is_int(th_xlen(rc_replica, "outbox:good"), N_GOOD, "replica up: and on the replica");
    redisFree(rc_replica);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND state = 3 AND attempts = 2 AND "
                      "last_error LIKE '%%WRONGTYPE%%'"),
           N_BAD, "replica up: refused rows dead after 2 attempts");

    /* 2: no replica: WAIT says 0, nothing may count as published. */
    th_redis_stop(&replica);
    deadline = th_now_ms() + 10000 * th_slow();
    while (replica_linked(c) && th_now_ms() < deadline)
        th_sleep_ms(20);
    ok(!replica_linked(c), "the replica is gone");
    rt_insert_rows(db, "lonely", 0, 50, "lonely", 0);
    pid = rt_relay_spawn(log, dbpath, primary.url, "--wait-replicas", "1", "--wait-timeout-ms", "100",
                         "--max-attempts", "1000", "--backoff-min-ms", "100", "--backoff-max-ms", "200", NULL);
    /* Until every row was sent and WAIT was asked again a few times. */
    deadline = th_now_ms() + 20000 * th_slow();
    while (th_xlen(c, "outbox:lonely") < 50 && th_now_ms() < deadline)
        th_sleep_ms(20);
    {
        long long w0 = wait_calls(c);
        while (wait_calls(c) < w0 + 4 && th_now_ms() < deadline)
            th_sleep_ms(20);
        ok(wait_calls(c) >= w0 + 4, "replica down: WAIT asked again (%lld times)", wait_calls(c) - w0);
    }
    is_int(th_xlen(c, "outbox:lonely"), 50, "replica down: each XADD made once, not appended again");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "replica down: SIGTERM exits 0");
    ok(th_xlen(c, "outbox:lonely") >= 50, "replica down: the XADDs were made (%lld entries)",
       th_xlen(c, "outbox:lonely"));
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'lonely' AND state = 2"), 0,
           "replica down: no row marked published");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'lonely' AND state = 0 AND "
                      "last_error LIKE 'WAIT:%%'"),
           50, "replica down: rows pending again, last_error names WAIT");
    text = th_slurp(log);
    if (th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'lonely' AND state = 0") != 50)
        th_diag_tail("relay", text, 20);
    free(text);

    redisFree(c);
    sqlite3_close_v2(db);
    th_redis_destroy(&replica);
    th_redis_destroy(&primary);
    th_rmtree(dir);
    free(relay);
    free(log);
    free(log1);
    free(dbpath);
    free(dir);
    return tap_done();
}
