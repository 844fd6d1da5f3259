/*
 * test_sentinel_consumer.c: the consumer side on a redis-sentinel:// URL
 * (sentinel_env.h) follows a failover by itself.
 *   1. The consumer-group helper (library, Redis dedup): entries written
 *      before a SENTINEL FAILOVER are applied; entries written to the new
 *      master afterwards are applied too, each exactly once; every one is
 *      acknowledged and its dedup marker is "D" on the new master (the
 *      dedup scripts were not on the promoted replica: NOSCRIPT handled).
 *   2. outbox-consume --print follows the failover back: every entry
 *      written before and after it is printed.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../consumer/ct.h"
#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "sentinel_env.h"
#include "tap.h"

#define N 150
#define STREAM "outbox:orders"

static int applied[2 * N];
static int applied_total;

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    int i = -1;
    (void)data;
    if (sscanf(dv->msg->id, "m-%d", &i) == 1 && i >= 0 && i < 2 * N) {
        applied[i]++;
        applied_total++;
    }
    outbox_consumer_done(c, dv, 0);
    return 0;
}

static void write_entries(const th_redis *node, int first, int n)
{
    redisContext *c = th_redis_client(node);
    char id[32];
    for (int i = first; i < first + n; i++) {
        snprintf(id, sizeof id, "m-%d", i);
        ct_xadd_msg(c, STREAM, id, "orders", "x", 1, NULL);
    }
    redisFree(c);
}

static int all_applied(void *arg)
{
    int want = *(int *)arg;
    for (int i = 0; i < want; i++)
        if (!applied[i])
            return 0;
    return 1;
}

typedef struct named {
    const se_env *e;
    int node;
    int asked; /* the sentinel asked for the failover to node */
} named;

/* Node n->node is the master; a failover that sentinel n->asked aborted
 * (its promotion not seen within failover-timeout) is asked for again. */
static int master_is(void *arg)
{
    const named *n = arg;
    if (se_wait_master(n->e, n->node, 0))
        return 1;
    if (se_failover_aborted(n->e, n->asked, 1 - n->node)) {
        diag("the failover to node %d ended without a switch: asking again", n->node);
        se_failover_to(n->e, n->asked, n->node, 10000 * th_slow());
    }
    return 0;
}

static int dedup_done(const th_redis *node, const char *group, int n)
{
    redisContext *c = th_redis_client(node);
    int done = 0;
    char key[128];
    for (int i = 0; i < n; i++) {
        char *v;
        snprintf(key, sizeof key, "dedup:%s:{" STREAM "}:m-%d", group, i);
        v = ct_get(c, key);
        done += v && strcmp(v, "D") == 0;
        free(v);
    }
    redisFree(c);
    return done;
}

static void test_helper(se_env *e)
{
    uv_loop_t loop;
    outbox_consumer_settings s;
    outbox_consumer *c;
    char err[256];
    int want = N, dups = 0;
    named nm = {e, 1, 0};
    int64_t t0;
    redisContext *rc;

    uv_loop_init(&loop);
    outbox_consumer_defaults(&s);
    s.redis_url = e->url;
    s.stream = STREAM;
    s.group = "g1";
    s.handler = handler;
    s.block_ms = 200;
    s.log_level = OUTBOX_LOG_WARN;
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "helper: created on %s", e->url);
    is_int(outbox_consumer_start(c), 0, "helper: started");
    write_entries(&e->node[0], 0, N);
    ok(ct_run_until_cond(&loop, all_applied, &want, 20000 * th_slow()), "helper: %d entries applied from node 0", N);
    /* The failover once the replica has the entries and their done
     * markers (replication lags on a loaded machine; what the master had
     * not sent to the replica would be lost with the switch). */
    for (t0 = th_now_ms(); dedup_done(&e->node[0], "g1", N) < N && th_now_ms() - t0 < 10000 * th_slow();)
        ct_run_for(&loop, 20);
    se_wait_replica(e, 1, 30000 * th_slow());

    ok(se_failover_to(e, 0, 1, 30000 * th_slow()) == 0, "helper: SENTINEL FAILOVER accepted");
    t0 = th_now_ms();
    ok(ct_run_until_cond(&loop, master_is, &nm, 30000 * th_slow()), "helper: node 1 is the master");
    diag("helper: SENTINEL FAILOVER took %lld ms", (long long)(th_now_ms() - t0));
    write_entries(&e->node[1], N, N);
    want = 2 * N;
    ok(ct_run_until_cond(&loop, all_applied, &want, 30000 * th_slow()), "helper: %d more entries applied from node 1",
       N);
    diag("helper: all applied %lld ms after the failover began", (long long)(th_now_ms() - t0));
    ct_run_for(&loop, 300);
    for (int i = 0; i < 2 * N; i++)
        dups += applied[i] > 1;
    is_int(dups, 0, "helper: each applied once");
    rc = th_redis_client(&e->node[1]);
    is_int(ct_pending(rc, STREAM, "g1"), 0, "helper: all acknowledged on the new master");
    redisFree(rc);
    is_int(dedup_done(&e->node[1], "g1", 2 * N), 2 * N, "helper: every dedup marker is done on the new master");
    outbox_consumer_stop(c, NULL, NULL);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "helper: the loop closes cleanly");
}

static void test_cli(se_env *e, const char *dir)
{
    char *out = th_path(dir, "consume.out"), *errp = th_path(dir, "consume.err"), *text, line[64];
    const char *args[] = {"--redis", e->url, "--stream", STREAM, "--group", "g2", "--print", "--block-ms", "200",
                          NULL};
    pid_t pid = ct_consume_spawn(args, NULL, out, errp);
    int64_t deadline;
    int missing = 0;
    named nm = {e, 0, 1};

    ok(pid > 0, "cli: outbox-consume started");
    /* It reads the whole stream (2N entries) from the master, node 1; once
     * its dedup markers are on the replica too (a marker written to the old
     * master while the replica is being promoted is lost, and its message
     * applied again: the same window as the relay's), the failover back. */
    deadline = th_now_ms() + 30000 * th_slow();
    do {
        text = th_slurp(out);
        missing = 2 * N - rt_count_substr(text, "\"id\":\"m-");
        free(text);
        if (missing > 0)
            th_sleep_ms(50);
    } while (missing > 0 && th_now_ms() < deadline);
    is_int(missing, 0, "cli: the %d entries printed", 2 * N);
    for (deadline = th_now_ms() + 10000 * th_slow();
         dedup_done(&e->node[1], "g2", 2 * N) < 2 * N && th_now_ms() < deadline;)
        th_sleep_ms(20);
    ok(se_wait_replica(e, 0, 30000 * th_slow()),
       "cli: the old master is a replica now and has everything the master has");
    /* The sentinel asked must see it so too (it learns that from an INFO
     * every 10 s); -INPROG or -NOGOODSLAVE are asked again. */
    ok(se_failover_to(e, 1, 0, 30000 * th_slow()) == 0, "cli: SENTINEL FAILOVER back accepted");
    ok(th_wait_until(30000 * th_slow(), master_is, &nm), "cli: node 0 is the master again");
    write_entries(&e->node[0], 0, 1); /* m-0 once more: a duplicate, skipped */
    {
        redisContext *c = th_redis_client(&e->node[0]);
        char id[32];
        for (int i = 0; i < 20; i++) {
            snprintf(id, sizeof id, "late-%d", i);
            ct_xadd_msg(c, STREAM, id, "orders", "y", 1, NULL);
        }
        redisFree(c);
    }
    deadline = th_now_ms() + 30000 * th_slow();
    do {
        text = th_slurp(out);
        missing = 0;
        for (int i = 0; i < 20; i++) {
            snprintf(line, sizeof line, "\"id\":\"late-%d\"", i);
            missing += !strstr(text, line);
        }
        for (int i = 0; i < 2 * N; i++) {
            snprintf(line, sizeof line, "\"id\":\"m-%d\"", i);
            missing += !strstr(text, line);
        }
        if (missing)
            free(text);
        else
            break;
        th_sleep_ms(100);
    } while (th_now_ms() < deadline);
    is_int(missing, 0, "cli: every entry printed, before and after the failover");
    if (!missing) {
        is_int(rt_count_substr(text, "\"id\":\"m-0\""), 1, "cli: the duplicate of m-0 printed once");
        free(text);
    }
    is_int(th_stop(pid, SIGTERM, 10000), 0, "cli: exits 0 on SIGTERM");
    if (missing) {
        text = th_slurp(errp);
        th_diag_tail("outbox-consume", text, 30);
        free(text);
    }
    free(out);
    free(errp);
}

int main(void)
{
    se_env e;
    char *dir;
    if (se_start(&e) != 0)
        skip_all("cannot start a master, a replica and three sentinels");
    dir = th_tmpdir();
    test_helper(&e);
    test_cli(&e, dir);
    se_stop(&e);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
