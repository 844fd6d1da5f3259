/*
 * The relay daemon's drains that the scenarios share: one run of
 * outbox-relay --drain over a database (bench_relay_drain), and the
 * best-of-rounds comparison of two places to drain into that drain_tls and
 * drain_cluster make (bench_drain_pair).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "bench.h"

int bench_relay_run(bench *b, const char *const *args, const char *tag, double *secs, struct rusage *ru,
                    bench_rss *peak, char *err, size_t errlen)
{
    char wrapbuf[1024];
    const char *argv[48];
    char logpath[PATH_MAX + 64], name[128], st[32], tail[400];
    int a = 0, status = 0;
    pid_t pid;
    uint64_t t0;

    snprintf(name, sizeof name, "relay-%s.log", tag);
    bench_path(b, logpath, sizeof logpath, name);
    a = bench_wrap_argv(argv, wrapbuf, sizeof wrapbuf);
    argv[a++] = b->relay_bin;
    for (; args && *args && a < 46; args++)
        argv[a++] = *args;
    argv[a] = NULL;
    t0 = bench_mono_us();
    if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
        snprintf(err, errlen, "cannot start outbox-relay: %s", strerror(errno));
        return -1;
    }
    if (bench_wait_sampled(pid, &status, ru, 3600000, peak) != 0) {
        snprintf(err, errlen, "relay did not finish within an hour");
        return -1;
    }
    *secs = (double)(bench_mono_us() - t0) / 1e6;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        snprintf(err, errlen, "relay %s: %s", bench_status_text(status, st, sizeof st), tail);
        return -1;
    }
    return 0;
}

int bench_relay_drain(bench *b, const char *db, const char *tag, const char *const *extra, double *secs,
                      struct rusage *ru, bench_rss *peak, char *err, size_t errlen)
{
    const char *args[40] = {"--db", db, "--redis", b->redis_url, "--drain", "--log-level", "warn"};
    int a = 7;
    long long left;
    for (; extra && *extra && a < 39; extra++)
        args[a++] = *extra;
    args[a] = NULL;
    if (bench_relay_run(b, args, tag, secs, ru, peak, err, errlen) != 0)
        return -1;
    left = bench_count_state(db, 0) + bench_count_state(db, 1);
    if (left != 0) {
        snprintf(err, errlen, "relay drained but %lld rows are still pending or sending", left);
        return -1;
    }
    return 0;
}

/* Empties the Redis the side drains into. */
static void side_flush(const bench_drain_side *sd)
{
    if (sd->cluster)
        bench_cluster_flush(sd->cluster);
    else
        freeReplyObject(redisCommand(sd->rc, "FLUSHALL SYNC"));
}

/* One drain of a copy of src (n messages) into sd, run `round` (0-based):
 * the copy drained, removed, and the streams counted; sd keeps the best
 * rate and its CPU per message. */
static int drain_once(bench *b, bench_drain_side *sd, const char *src, const char *db, long n, int round,
                      char *err, size_t errlen)
{
    char tag[64];
    struct rusage ru;
    double secs, rate;
    long long seen;

    snprintf(tag, sizeof tag, "%s-%d", sd->name, round + 1);
    if (bench_copy_db(src, db, err, errlen) != 0)
        return -1;
    side_flush(sd);
    bench_progress(b, "relay draining %s, run %d", sd->where, round + 1);
    if (bench_relay_drain(b, db, tag, sd->extra, &secs, &ru, NULL, err, errlen) != 0)
        return -1;
    bench_unlink_db(db);
    seen = sd->cluster ? bench_cluster_streams_len(sd->cluster) : bench_streams_len(sd->rc);
    if (seen != n) {
        snprintf(err, errlen, "%s drain: %lld stream entries, want %ld", sd->name, seen, n);
        return -1;
    }
    rate = (double)n / secs;
    if (rate > sd->best_rate) {
        sd->best_rate = rate;
        sd->cpu_us = bench_ru_cpu_s(&ru) * 1e6 / (double)n;
    }
    return 0;
}

int bench_drain_pair(bench *b, const char *src, const char *db, long n, int rounds, bench_drain_side side[2],
                     char *err, size_t errlen)
{
    int round, k, rc = 0;
    /* Alternating, each round starting with the other side, so that a drift
     * of the machine's load falls on both. */
    for (round = 0; round < rounds && rc == 0; round++)
        for (k = 0; k < 2 && rc == 0; k++)
            rc = drain_once(b, &side[(round + k) % 2], src, db, n, round, err, errlen);
    return rc;
}
