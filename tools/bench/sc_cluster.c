/*
 * drain_cluster: the drain's backlog drained by the relay daemon into a
 * private 3-master Redis Cluster (no replicas) and into one standalone
 * redis-server, both over TCP on 127.0.0.1, in the same run, alternating;
 * with redis-benchmark's XADD ceiling of each beside them.
 */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "bench.h"

/* Runs per target (--quick: QUICK_ROUNDS): the best of them counts. */
#define ROUNDS 3
#define QUICK_ROUNDS 1
#define TARGET_RATE 0.8
#define TARGET_CPU 1.2


/* Whether outbox-relay takes redis-cluster:// URLs: one given with a
 * database that cannot exist fails on the database, not on the scheme. */
static int relay_knows_cluster(bench *b)
{
    char out[PATH_MAX + 32], db[PATH_MAX + 32], line[1024];
    const char *argv[] = {b->relay_bin, "--db", db, "--redis", "redis-cluster://127.0.0.1:1", "--drain", NULL};
    int found = 0, status;
    pid_t pid;
    FILE *f;
    bench_path(b, out, sizeof out, "relay-cluster-probe.txt");
    bench_path(b, db, sizeof db, "no-such-directory/relay.db");
    if (bench_spawn(argv, out, out, &pid) != 0 || bench_wait(pid, &status, NULL, 10000) != 0)
        return 0;
    f = fopen(out, "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "cannot open database"))
            found = 1;
        else if (strstr(line, "bad scheme"))
            found = 0;
    fclose(f);
    return found;
}

/* How many masters hold keys. */
static int cluster_spread(bench_cluster *c)
{
    int i, n = 0;
    for (i = 0; i < BENCH_CLUSTER_MASTERS; i++) {
        redisReply *r = redisCommand(c->rc[i], "DBSIZE");
        n += r && r->type == REDIS_REPLY_INTEGER && r->integer > 0;
        freeReplyObject(r);
    }
    return n;
}

/* redis-benchmark XADD of the drain's entry size over 8 streams (as the
 * drain's 8 topics), -c 50 -P 16, into the standalone server or the
 * cluster (--cluster: each command to the master of its key). */
static int ceilings(bench *b, bench_tcp_server *s, bench_cluster *c, const bench_drain_side *tg, double ceiling[2],
                    size_t envlen, long n, char *err, size_t errlen)
{
    bench_bm_target single = {NULL, "127.0.0.1", s->port, 0, "outbox:bench:__rand_int__", BENCH_TOPICS, 0};
    /* --cluster puts each client on one master and replaces {tag} with a
     * hash tag of that master's slots. */
    bench_bm_target clus = {NULL, "127.0.0.1", c->port[0], 1, "outbox:bench:{tag}:__rand_int__", BENCH_TOPICS, 0};
    double rps, p50, sum[2] = {0, 0};
    int k, i;
    /* Before and after the drains would need the drains in between; two
     * runs of each, alternating, instead. */
    for (k = 0; k < 2; k++)
        for (i = 0; i < 2; i++) {
            int which = (k + i) % 2;
            bench_progress(b, "redis-benchmark XADD into the %s", tg[which].name);
            if (bench_redis_benchmark_to(b, which ? &clus : &single, n, 50, 16, envlen, &rps, &p50, err, errlen) !=
                0)
                return -1;
            sum[which] += rps;
            if (which && cluster_spread(c) != BENCH_CLUSTER_MASTERS) {
                snprintf(err, errlen, "redis-benchmark --cluster wrote to %d of the %d masters", cluster_spread(c),
                         BENCH_CLUSTER_MASTERS);
                return -1;
            }
        }
    ceiling[0] = sum[0] / 2;
    ceiling[1] = sum[1] / 2;
    freeReplyObject(redisCommand(s->rc, "FLUSHALL SYNC"));
    bench_cluster_flush(c);
    return 0;
}

int sc_drain_cluster(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    size_t envlen = bench_shape_envelope_len(&sh);
    bench_tcp_server s;
    bench_cluster c;
    /* Each side's URL is filled in when its servers start. */
    const char *const single_extra[] = {"--redis", s.url, NULL};
    const char *const cluster_extra[] = {"--redis", c.url, NULL};
    bench_drain_side tg[2] = {{"single node", "into the single node", single_extra, NULL, NULL, 0, 0},
                              {"cluster", "into the cluster", cluster_extra, NULL, &c, 0, 0}};
    char src[PATH_MAX + 32], db[PATH_MAX + 32], err[512], n1[32], n2[32];
    long n = b->messages, rbn = n > 200000 ? n : 200000;
    int rounds = b->quick ? QUICK_ROUNDS : ROUNDS, rc = 0, relay_ok;
    double ceiling[2] = {0, 0}, rate_ratio = 0, cpu_ratio = 0;

    snprintf(r->title, sizeof r->title,
             "%ld messages (the drain's shape), relay daemon with default options into a %d-master Redis Cluster "
             "(no replicas) vs one redis-server, all on 127.0.0.1 over TCP",
             n, BENCH_CLUSTER_MASTERS);
    relay_ok = relay_knows_cluster(b);
    memset(&s, 0, sizeof s);
    memset(&c, 0, sizeof c);
    if (bench_tcp_server_start(b, &s, err, sizeof err) != 0 || bench_cluster_start(b, &c, err, sizeof err) != 0) {
        bench_cluster_stop(&c);
        bench_tcp_server_stop(&s);
        bench_fail(r, "%s", err);
        return -1;
    }
    tg[0].rc = s.rc;
    rc = ceilings(b, &s, &c, tg, ceiling, envlen, rbn, err, sizeof err);
    if (rc == 0 && relay_ok) {
        bench_path(b, src, sizeof src, "drain-cluster-src.db");
        bench_path(b, db, sizeof db, "drain-cluster.db");
        bench_progress(b, "building a %ld-message backlog", n);
        rc = bench_dataset_build(src, (uint64_t)n, &sh, 1000, err, sizeof err);
        if (rc == 0)
            rc = bench_drain_pair(b, src, db, n, rounds, tg, err, sizeof err);
        bench_unlink_db(src);
    }
    bench_cluster_stop(&c);
    bench_tcp_server_stop(&s);
    if (rc != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_row_add(r, "ceiling: single node", NULL, V_NONE, "%s req/s",
                  bench_thousands(n1, sizeof n1, ceiling[0]));
    bench_row_add(r, "ceiling: cluster", NULL, V_NONE, "%s req/s (%.2f x single node)",
                  bench_thousands(n2, sizeof n2, ceiling[1]), ceiling[1] / ceiling[0]);
    if (relay_ok) {
        rate_ratio = tg[1].best_rate / tg[0].best_rate;
        cpu_ratio = tg[1].cpu_us / tg[0].cpu_us;
        bench_row_add(r, "drain into the single node", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg (%.2f x ceiling)",
                      bench_thousands(n1, sizeof n1, tg[0].best_rate), tg[0].cpu_us, tg[0].best_rate / ceiling[0]);
        bench_row_add(r, "drain into the cluster", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg (%.2f x ceiling)",
                      bench_thousands(n2, sizeof n2, tg[1].best_rate), tg[1].cpu_us, tg[1].best_rate / ceiling[1]);
        bench_row_add(r, "cluster / single node", ">= 0.80", rate_ratio >= TARGET_RATE ? V_PASS : V_FAIL, "%.2f",
                      rate_ratio);
        bench_row_add(r, "relay CPU/msg cluster / single", "<= 1.20", cpu_ratio <= TARGET_CPU ? V_PASS : V_FAIL,
                      "%.2f", cpu_ratio);
        bench_note(r, "Best of %d run%s each, alternating; every run drains a copy of one backlog and checks that "
                      "the streams hold all %ld messages (each stream's XLEN asked of the master holding it).",
                   rounds, rounds > 1 ? "s" : "", n);
    } else {
        bench_note(r, "This outbox-relay does not take redis-cluster:// URLs: the cluster was started and "
                      "benchmarked, the relay runs were not made.");
    }
    bench_note(r, "Cluster: %d redis-server processes with cluster-enabled yes on free loopback ports, joined with "
                  "redis-cli --cluster create --cluster-replicas 0, up once every node says cluster_state:ok; the "
                  "three share the machine's cores with the relay. Ceilings: redis-benchmark XADD -c 50 -P 16 of "
                  "~%zu-byte envelopes over %d streams (-r), --cluster for the cluster, two runs each, alternating.",
               BENCH_CLUSTER_MASTERS, envlen, BENCH_TOPICS);
    bench_json_int(r, "messages", n);
    bench_json_bool(r, "relay_cluster", relay_ok);
    bench_json_num(r, "ceiling_per_s", ceiling[1], 0);
    bench_json_num(r, "single_ceiling_per_s", ceiling[0], 0);
    bench_json_num(r, "ceiling_ratio", ceiling[1] / ceiling[0], 3);
    if (relay_ok) {
        bench_json_num(r, "msgs_per_s", tg[1].best_rate, 0);
        bench_json_num(r, "single_msgs_per_s", tg[0].best_rate, 0);
        bench_json_num(r, "ratio", rate_ratio, 3);
        bench_json_num(r, "target", TARGET_RATE, 1);
        bench_json_num(r, "relay_cpu_us_per_msg", tg[1].cpu_us, 2);
        bench_json_num(r, "single_relay_cpu_us_per_msg", tg[0].cpu_us, 2);
        bench_json_num(r, "cpu_ratio", cpu_ratio, 3);
        bench_json_num(r, "target_cpu_ratio", TARGET_CPU, 1);
    }
    bench_json_int(r, "rounds", rounds);
    return 0;
}
