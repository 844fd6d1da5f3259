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

typedef struct target {
    const char *name;
    double best_rate, cpu_us; /* msg/s; relay CPU per message in the best run */
    double ceiling;           /* redis-benchmark XADD req/s */
} target;

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

/* One drain of a copy of src into the standalone server (c NULL) or the
 * cluster. */
static int drain_once(bench *b, bench_tcp_server *s, bench_cluster *c, const char *src, long n, target *tg,
                      int round, char *err, size_t errlen)
{
    char db[PATH_MAX + 32], tag[32];
    /* bench_relay_drain gives --redis the main server's URL first; the last
     * --redis given counts. */
    const char *extra[] = {"--redis", c ? c->url : s->url, NULL};
    struct rusage ru;
    double secs, rate;
    long long seen;

    bench_path(b, db, sizeof db, "drain-cluster.db");
    snprintf(tag, sizeof tag, "%s-%d", tg->name, round + 1);
    if (bench_copy_db(src, db, err, errlen) != 0)
        return -1;
    if (c)
        bench_cluster_flush(c);
    else
        freeReplyObject(redisCommand(s->rc, "FLUSHALL SYNC"));
    bench_progress(b, "relay draining into the %s, run %d", tg->name, round + 1);
    if (bench_relay_drain(b, db, tag, extra, &secs, &ru, NULL, err, errlen) != 0)
        return -1;
    bench_unlink_db(db);
    seen = c ? bench_cluster_streams_len(c) : bench_streams_len(s->rc);
    if (seen != n) {
        snprintf(err, errlen, "%s drain: %lld stream entries, want %ld", tg->name, seen, n);
        return -1;
    }
    rate = (double)n / secs;
    if (rate > tg->best_rate) {
        tg->best_rate = rate;
        tg->cpu_us = bench_ru_cpu_s(&ru) * 1e6 / (double)n;
    }
    return 0;
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
static int ceilings(bench *b, bench_tcp_server *s, bench_cluster *c, target *tg, size_t envlen, long n, char *err,
                    size_t errlen)
{
    bench_bm_target single = {NULL, "127.0.0.1", s->port, 0, "outbox:bench:__rand_int__", BENCH_TOPICS};
    /* --cluster puts each client on one master and replaces {tag} with a
     * hash tag of that master's slots. */
    bench_bm_target clus = {NULL, "127.0.0.1", c->port[0], 1, "outbox:bench:{tag}:__rand_int__", BENCH_TOPICS};
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
    tg[0].ceiling = sum[0] / 2;
    tg[1].ceiling = sum[1] / 2;
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
    target tg[2] = {{"single node", 0, 0, 0}, {"cluster", 0, 0, 0}};
    char src[PATH_MAX + 32], err[512], n1[32], n2[32];
    long n = b->messages, rbn = n > 200000 ? n : 200000;
    int rounds = b->quick ? QUICK_ROUNDS : ROUNDS, round, rc = 0, relay_ok;
    double rate_ratio = 0, cpu_ratio = 0;

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
    rc = ceilings(b, &s, &c, tg, envlen, rbn, err, sizeof err);
    if (rc == 0 && relay_ok) {
        bench_path(b, src, sizeof src, "drain-cluster-src.db");
        bench_progress(b, "building a %ld-message backlog", n);
        rc = bench_dataset_build(src, (uint64_t)n, &sh, 1000, err, sizeof err);
        /* Alternating, each round starting with the other target. */
        for (round = 0; round < rounds && rc == 0; round++)
            for (int k = 0; k < 2 && rc == 0; k++) {
                int i = (round + k) % 2;
                rc = drain_once(b, &s, i ? &c : NULL, src, n, &tg[i], round, err, sizeof err);
            }
        bench_unlink_db(src);
    }
    bench_cluster_stop(&c);
    bench_tcp_server_stop(&s);
    if (rc != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_row_add(r, "ceiling: single node", NULL, V_NONE, "%s req/s",
                  bench_thousands(n1, sizeof n1, tg[0].ceiling));
    bench_row_add(r, "ceiling: cluster", NULL, V_NONE, "%s req/s (%.2f x single node)",
                  bench_thousands(n2, sizeof n2, tg[1].ceiling), tg[1].ceiling / tg[0].ceiling);
    if (relay_ok) {
        rate_ratio = tg[1].best_rate / tg[0].best_rate;
        cpu_ratio = tg[1].cpu_us / tg[0].cpu_us;
        bench_row_add(r, "drain into the single node", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg (%.2f x ceiling)",
                      bench_thousands(n1, sizeof n1, tg[0].best_rate), tg[0].cpu_us, tg[0].best_rate / tg[0].ceiling);
        bench_row_add(r, "drain into the cluster", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg (%.2f x ceiling)",
                      bench_thousands(n2, sizeof n2, tg[1].best_rate), tg[1].cpu_us, tg[1].best_rate / tg[1].ceiling);
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
    bench_json_num(r, "ceiling_per_s", tg[1].ceiling, 0);
    bench_json_num(r, "single_ceiling_per_s", tg[0].ceiling, 0);
    bench_json_num(r, "ceiling_ratio", tg[1].ceiling / tg[0].ceiling, 3);
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
