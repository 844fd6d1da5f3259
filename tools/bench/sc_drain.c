/*
 * Scenarios around the relay daemon: drain (vs redis-benchmark, and the
 * SQL floor under it: sqlpath.c), idle CPU, peak memory, idempotent mode,
 * and the consumer tool.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

/* The relay's default --batch: rows per claim. */
#define FLOOR_BATCH 512

/* ------------------------------------------------------------------ */
/* drain */

/* The drain's SQL floor: the same backlog drained by the relay's
 * statements alone on one connection, and by the least a per-row lifecycle
 * writes (bare), no Redis; microseconds per message, the better of two runs
 * of each, alternating (noise only adds time). */
static int sql_floors(bench *b, const char *src, long n, double *relay_us, double *bare_us, char *err,
                      size_t errlen)
{
    char db[PATH_MAX + 32];
    double best[2] = {1e300, 1e300};
    int round, bare, rc = 0;

    bench_path(b, db, sizeof db, "floor.db");
    for (round = 0; round < 2 && rc == 0; round++)
        for (bare = 0; bare < 2 && rc == 0; bare++) {
            bench_sql *s = NULL;
            double secs = 0;
            bench_progress(b, "SQL floor: %s, run %d", bare ? "bare lifecycle" : "relay statements", round + 1);
            rc = bench_copy_db(src, db, err, errlen);
            if (rc == 0)
                rc = bench_sql_open(db, &s, err, errlen);
            if (rc == 0)
                rc = bench_sql_drain(s, bare, FLOOR_BATCH, n, &secs, err, errlen);
            bench_sql_close(s);
            bench_unlink_db(db);
            if (rc == 0 && secs * 1e6 / (double)n < best[bare])
                best[bare] = secs * 1e6 / (double)n;
        }
    *relay_us = best[0];
    *bare_us = best[1];
    return rc;
}

/* The peer loops (peers.c), each on its own copy of the backlog src; their
 * rates and CPU per message. */
static int peer_runs(bench *b, const char *src, long n, double *rate, double *cpu_us, char *err, size_t errlen)
{
    char db[PATH_MAX + 32];
    int k;
    bench_path(b, db, sizeof db, "peer.db");
    for (k = 0; k < BENCH_PEERS; k++) {
        double secs = 0, cpu = 0;
        long long seen;
        bench_progress(b, "peer loop: %s", bench_peer_names[k]);
        if (bench_copy_db(src, db, err, errlen) != 0 ||
            bench_peer_drain(b, k, db, n, &secs, &cpu, err, errlen) != 0) {
            bench_unlink_db(db);
            return -1;
        }
        bench_unlink_db(db);
        seen = bench_streams_len(b->rc);
        bench_redis_flush(b);
        if (seen != n) {
            snprintf(err, errlen, "%s peer: the streams hold %lld entries, not %ld", bench_peer_names[k], seen, n);
            return -1;
        }
        rate[k] = (double)n / secs;
        cpu_us[k] = cpu * 1e6 / (double)n;
    }
    return 0;
}

/* What each peer loop is, for the table. */
static const char *const peer_titles[BENCH_PEERS] = {
    "peer: naive per-row lease+mark",
    "peer: batch lease, ranged mark",
    "peer: batch lease, no per-row write",
};

/* The most two CPUs allow a drain in which Redis spends redis_us and the
 * relay relay_us of CPU per message: Redis is one thread, and the two
 * together cannot use more than both CPUs. */
static double two_cpu_bound(double redis_us, double relay_us)
{
    double one = 1e6 / redis_us, both = 2e6 / (redis_us + relay_us);
    return one < both ? one : both;
}

int sc_drain(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    size_t envlen = bench_shape_envelope_len(&sh);
    char src[PATH_MAX + 32], db[PATH_MAX + 32], wal[PATH_MAX + 40], err[512], n1[32], n2[32], n3[32], n4[32],
        key[64];
    double c50[2], c1[2], cu[2], cs[2], p50, secs, rate, ceil50, ceil1, ceilu, ceils, ratio, cpu, floor_relay, floor_bare,
        budget;
    double peer_rate[BENCH_PEERS], peer_cpu[BENCH_PEERS], cpu_us, worst_peer = 1e300;
    double rus[2] = {-1, -1}, rud = -1, rus_mean, bound, allow;
    int64_t t0;
    int k;
    struct rusage ru;
    bench_rss peak;
    long long seen;
    long n = b->messages;
    /* Long enough for a stable rate even when the backlog is small. */
    long rbn = n > 200000 ? n : 200000;

    snprintf(r->title, sizeof r->title,
             "%ld messages (%d-byte payloads, %d topics, every second one keyed over %u keys), relay daemon "
             "with default options",
             n, BENCH_PAYLOAD, BENCH_TOPICS, b->keys);
    /* One backlog: the relay, the SQL floors and the peer loops each drain
     * a copy of it. */
    bench_path(b, src, sizeof src, "drain-src.db");
    bench_path(b, db, sizeof db, "drain.db");
    bench_progress(b, "building a %ld-message backlog", n);
    if (bench_dataset_build(src, (uint64_t)n, &sh, 1000, err, sizeof err) != 0 ||
        bench_copy_db(src, db, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        bench_unlink_db(src);
        return -1;
    }
    bench_progress(b, "redis-benchmark XADD (before)");
    if (bench_redis_benchmark(b, rbn, 50, 16, envlen, &c50[0], &p50, err, sizeof err) != 0 ||
        bench_redis_benchmark(b, rbn, 1, 16, envlen, &c1[0], &p50, err, sizeof err) != 0 ||
        bench_redis_benchmark_user(b, rbn, &cu[0], err, sizeof err) != 0 ||
        bench_redis_benchmark_user_shape(b, rbn, envlen, &cs[0], &rus[0], err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "relay draining");
    t0 = bench_proc_cpu_ns(b->redis_pid);
    memset(&peak, 0, sizeof peak);
    snprintf(wal, sizeof wal, "%s-wal", db);
    peak.watch_file = wal;
    if (bench_relay_drain(b, db, "drain", NULL, &secs, &ru, &peak, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    rud = bench_redis_us_per(b, t0, n);
    seen = bench_streams_len(b->rc);
    bench_redis_flush(b);
    bench_progress(b, "redis-benchmark XADD (after)");
    if (bench_redis_benchmark(b, rbn, 50, 16, envlen, &c50[1], &p50, err, sizeof err) != 0 ||
        bench_redis_benchmark(b, rbn, 1, 16, envlen, &c1[1], &p50, err, sizeof err) != 0 ||
        bench_redis_benchmark_user(b, rbn, &cu[1], err, sizeof err) != 0 ||
        bench_redis_benchmark_user_shape(b, rbn, envlen, &cs[1], &rus[1], err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    if (peer_runs(b, src, n, peer_rate, peer_cpu, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        bench_unlink_db(src);
        return -1;
    }
    if (sql_floors(b, src, n, &floor_relay, &floor_bare, err, sizeof err) != 0) {
        bench_fail(r, "SQL floor: %s", err);
        bench_unlink_db(src);
        return -1;
    }
    bench_unlink_db(src);
    rate = (double)n / secs;
    ceil50 = (c50[0] + c50[1]) / 2;
    ceil1 = (c1[0] + c1[1]) / 2;
    ceilu = (cu[0] + cu[1]) / 2;
    ceils = (cs[0] + cs[1]) / 2;
    ratio = rate / ceil50;
    cpu = bench_ru_cpu_s(&ru);
    cpu_us = cpu * 1e6 / (double)n;
    rus_mean = rus[0] > 0 && rus[1] > 0 ? (rus[0] + rus[1]) / 2 : -1;
    /* What stands between the drain and the user's ceiling on two CPUs:
     * Redis's CPU for each of the relay's XADDs, and the relay's own. */
    bound = rud > 0 ? two_cpu_bound(rud, cpu_us) : -1;
    allow = rud > 0 ? 2e6 / (0.8 * ceilu) - rud : -1;

    bench_row_add(r, "relay drain", NULL, V_NONE, "%s msg/s (%.2f s)", bench_thousands(n1, sizeof n1, rate), secs);
    bench_row_add(r, "ceiling: redis-benchmark -c 50 -P 16", NULL, V_NONE, "%s req/s (%s before, %s after)",
                  bench_thousands(n2, sizeof n2, ceil50), bench_thousands(n3, sizeof n3, c50[0]),
                  bench_thousands(n4, sizeof n4, c50[1]));
    bench_row_add(r, "drain / ceiling", ">= 0.60", ratio >= 0.6 ? V_PASS : V_FAIL, "%.2f", ratio);
    bench_row_add(r, "one connection: -c 1 -P 16", NULL, V_NONE, "%s req/s (%s before, %s after)",
                  bench_thousands(n2, sizeof n2, ceil1), bench_thousands(n3, sizeof n3, c1[0]),
                  bench_thousands(n4, sizeof n4, c1[1]));
    bench_row_add(r, "drain / one connection", NULL, V_NONE, "%.2f", rate / ceil1);
    bench_row_add(r, "as a user times it: -c 4 -P 64", NULL, V_NONE, "%s req/s (%s before, %s after)",
                  bench_thousands(n2, sizeof n2, ceilu), bench_thousands(n3, sizeof n3, cu[0]),
                  bench_thousands(n4, sizeof n4, cu[1]));
    bench_row_add(r, "drain / user's ceiling", ">= 0.80", rate / ceilu >= 0.8 ? V_PASS : V_FAIL, "%.2f",
                  rate / ceilu);
    bench_row_add(r, "the same with our entry, 8 streams", NULL, V_NONE, "%s req/s (%s before, %s after) = %.2f x user's",
                  bench_thousands(n2, sizeof n2, ceils), bench_thousands(n3, sizeof n3, cs[0]),
                  bench_thousands(n4, sizeof n4, cs[1]), ceils / ceilu);
    bench_row_add(r, "drain / our entry's ceiling", NULL, V_NONE, "%.2f", rate / ceils);
    bench_row_add(r, "relay CPU", "<= 3.0 us/msg", cpu_us <= 3.0 ? V_PASS : V_FAIL,
                  "%.2f s user+sys = %.0f%% of wall, %.2f us/msg", cpu, 100.0 * cpu / secs, cpu_us);
    if (rud > 0 && rus_mean > 0) {
        bench_row_add(r, "Redis CPU per XADD", NULL, V_NONE, "%.2f us in the drain, %.2f us from redis-benchmark "
                      "with our entry", rud, rus_mean);
        bench_row_add(r, "two CPUs' bound", NULL, V_NONE, "%s msg/s = %.2f x user's ceiling (drain at %.0f%% of it)",
                      bench_thousands(n2, sizeof n2, bound), bound / ceilu, 100.0 * rate / bound);
        bench_row_add(r, "relay CPU 0.8 x user's allows", NULL, V_NONE, "%.2f us/msg at most (SQL floor %.2f)",
                      allow, floor_relay);
    }
    for (k = 0; k < BENCH_PEERS; k++) {
        char metric[64];
        bench_row_add(r, peer_titles[k], NULL, V_NONE, "%s msg/s, %.1f us CPU/msg",
                      bench_thousands(n2, sizeof n2, peer_rate[k]), peer_cpu[k]);
        snprintf(metric, sizeof metric, "  drain / %s peer", bench_peer_names[k]);
        bench_row_add(r, metric, ">= 1.00", rate >= peer_rate[k] ? V_PASS : V_FAIL, "%.2f", rate / peer_rate[k]);
        if (rate / peer_rate[k] < worst_peer)
            worst_peer = rate / peer_rate[k];
    }
    bench_row_add(r, "relay peak RSS / WAL file", NULL, V_NONE, "%.1f MiB / %.0f MiB", (double)peak.hwm_kb / 1024.0,
                  (double)peak.file_bytes / 1048576.0);
    bench_row_add(r, "stream entries", NULL, V_NONE, "%lld (%lld duplicates)", seen, seen - n);
    /* SQLite lets one connection write at a time: a drain cannot go faster
     * than its SQL alone, whatever overlaps it. */
    budget = 1e6 / (0.6 * ceil50);
    bench_row_add(r, "SQL budget at 0.60 x ceiling", NULL, V_NONE, "%.2f us/msg", budget);
    bench_row_add(r, "SQL floor: relay's statements", NULL, V_NONE, "%.2f us/msg: at most %s msg/s = %.2f x ceiling",
                  floor_relay, bench_thousands(n2, sizeof n2, 1e6 / floor_relay), 1e6 / floor_relay / ceil50);
    bench_row_add(r, "SQL floor: bare per-row lease+mark", NULL, V_NONE,
                  "%.2f us/msg: at most %s msg/s = %.2f x ceiling", floor_bare,
                  bench_thousands(n3, sizeof n3, 1e6 / floor_bare), 1e6 / floor_bare / ceil50);
    bench_note(r, "XADD entries: id (36 chars) + envelope of ~%zu bytes; redis-benchmark sends %ld XADDs of the "
                  "same sizes to one stream, before and after the drain. As a user times it: `redis-benchmark -n "
                  "%ld -P 64 -c 4 -q XADD bench '*' id m-0000001 payload <%d bytes>` (README, BENCHMARKS.md): "
                  "four deep pipelines and smaller fields, a ceiling above the one of 50 connections. With our "
                  "entry: the same -c 4 -P 64 with an id of 36 characters and an envelope of %zu bytes over %d "
                  "streams (-r %d): the most Redis takes of the relay's entries from any producer.",
               envlen, rbn, rbn, BENCH_USER_PAYLOAD, envlen, BENCH_TOPICS, BENCH_TOPICS);
    bench_note(r, "Peer loops (peers.c): plain loops on their own copy of the backlog, one connection opened like "
                  "the relay's, hiredis' blocking context, %d rows a batch, one transaction per batch (the marks of "
                  "the batch before, then the next lease), then its pipelined XADDs; SQLite and Redis never "
                  "overlap. Naive: UPDATE ... RETURNING leases each row, one UPDATE per row marks it. Ranged: a "
                  "lease row per batch in a table of its own, one ranged UPDATE marks the batch. No per-row write: "
                  "the lease row, stamped published, is the record of the range. Each checks every XADD reply and "
                  "every mark's changes, and the streams' lengths after it.",
               FLOOR_BATCH);
    bench_note(r, "Redis CPU from /proc/PID/schedstat around the drain and around redis-benchmark with our "
                  "entry. Two CPUs' bound: Redis is one thread and Redis and the relay share two CPUs, so the "
                  "drain runs at most min(1 / Redis's CPU per XADD, 2 / (Redis's + the relay's CPU per message)) "
                  "with both kept busy all the time; 0.8 x the user's ceiling needs the relay's CPU per message "
                  "below 2 / (0.8 x ceiling) less Redis's, of which the SQL floor of its statements is a part no "
                  "overlap removes.");
    bench_note(r, "Drain time is from spawning outbox-relay --drain to its exit (includes start-up and the "
                  "final marks).");
    bench_note(r, "SQL floor: the same backlog drained by SQL alone on one connection opened like the relay's, no "
                  "Redis, one transaction per %d rows (the previous batch's marks, then the next "
                  "claim), better of 2 runs each, checkpoints between units from 8000 WAL pages as in the relay but not timed. Relay's statements: the relay's claim (walk, key lookups, UPDATE ... RETURNING, cursor) "
                  "and fenced marks. Bare: the least a per-row lease and mark write (a range UPDATE ... RETURNING "
                  "setting owner, token and expiry; one UPDATE per row setting state, time and entry id). SQLite "
                  "has one writer at a time, so the drain cannot beat either.",
               FLOOR_BATCH);

    bench_json_int(r, "messages", n);
    bench_json_num(r, "msgs_per_s", rate, 0);
    bench_json_num(r, "ceiling_per_s", ceil50, 0);
    bench_json_num(r, "ratio", ratio, 3);
    bench_json_num(r, "target", 0.6, 1);
    bench_json_num(r, "ceiling_1conn_per_s", ceil1, 0);
    bench_json_num(r, "ratio_1conn", rate / ceil1, 3);
    bench_json_num(r, "ceiling_user_per_s", ceilu, 0);
    bench_json_num(r, "ratio_user", rate / ceilu, 3);
    bench_json_num(r, "target_user", 0.8, 1);
    bench_json_num(r, "ceiling_user_entry_per_s", ceils, 0);
    bench_json_num(r, "ratio_user_entry", rate / ceils, 3);
    bench_json_num(r, "user_entry_over_user", ceils / ceilu, 3);
    bench_json_num(r, "seconds", secs, 3);
    bench_json_num(r, "relay_cpu_s", cpu, 3);
    bench_json_num(r, "relay_peak_rss_mib", (double)peak.hwm_kb / 1024.0, 1);
    bench_json_num(r, "wal_peak_mib", (double)peak.file_bytes / 1048576.0, 1);
    bench_json_int(r, "envelope_bytes", (long long)envlen);
    bench_json_int(r, "keys", b->keys);
    bench_json_int(r, "duplicates", seen - n);
    bench_json_num(r, "sql_budget_us_per_msg", budget, 2);
    bench_json_num(r, "sql_floor_us_per_msg", floor_relay, 2);
    bench_json_num(r, "sql_floor_ratio", 1e6 / floor_relay / ceil50, 3);
    bench_json_num(r, "sql_floor_bare_us_per_msg", floor_bare, 2);
    bench_json_num(r, "sql_floor_bare_ratio", 1e6 / floor_bare / ceil50, 3);
    bench_json_num(r, "relay_cpu_us_per_msg", cpu_us, 2);
    bench_json_num(r, "redis_cpu_us_per_xadd", rud, 3);
    bench_json_num(r, "redis_cpu_us_per_user_entry", rus_mean, 3);
    bench_json_num(r, "two_cpu_bound_per_s", bound, 0);
    bench_json_num(r, "two_cpu_bound_ratio_user", rud > 0 ? bound / ceilu : -1, 3);
    bench_json_num(r, "relay_cpu_us_allowed_at_target", allow, 2);
    bench_json_num(r, "target_cpu_us_per_msg", 3.0, 1);
    for (k = 0; k < BENCH_PEERS; k++) {
        snprintf(key, sizeof key, "peer_%s_msgs_per_s", bench_peer_names[k]);
        bench_json_num(r, key, peer_rate[k], 0);
        snprintf(key, sizeof key, "peer_%s_cpu_us_per_msg", bench_peer_names[k]);
        bench_json_num(r, key, peer_cpu[k], 2);
        snprintf(key, sizeof key, "ratio_peer_%s", bench_peer_names[k]);
        bench_json_num(r, key, rate / peer_rate[k], 3);
    }
    bench_json_num(r, "ratio_peers_min", worst_peer, 3);
    bench_json_num(r, "target_peers", 1.0, 1);
    bench_unlink_db(db);
    return 0;
}

/* ------------------------------------------------------------------ */
/* idle */

int sc_idle(bench *b, bench_report *r)
{
    char db[PATH_MAX + 32], logpath[PATH_MAX + 32], err[512], st[32], tail[400];
    const char *argv[16];
    sqlite3 *h = NULL;
    unsigned window_ms = b->quick ? 2000 : 5000;
    int64_t c0, c1, rc0, rc1;
    long long s0, s1;
    double cpu_pct, redis_pct, wake;
    int status = 0, a = 0;
    pid_t pid;

    snprintf(r->title, sizeof r->title,
             "relay daemon, empty outbox, connected, %.0f s window after 1 s of start-up; CPU from "
             "/proc/PID/schedstat",
             window_ms / 1000.0);
    bench_path(b, db, sizeof db, "idle.db");
    bench_path(b, logpath, sizeof logpath, "relay-idle.log");
    if (bench_db_fresh(db, 0, &h, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    sqlite3_close_v2(h);
    argv[a++] = b->relay_bin;
    argv[a++] = "--db";
    argv[a++] = db;
    argv[a++] = "--redis";
    argv[a++] = b->redis_url;
    argv[a++] = "--log-level";
    argv[a++] = "warn";
    argv[a] = NULL;
    if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
        bench_fail(r, "cannot start the relay: %s", strerror(errno));
        return -1;
    }
    bench_sleep_ms(1000);
    c0 = bench_proc_cpu_ns(pid);
    s0 = bench_proc_ctxsw(pid);
    rc0 = bench_proc_cpu_ns(b->redis_pid);
    bench_sleep_ms(window_ms);
    c1 = bench_proc_cpu_ns(pid);
    s1 = bench_proc_ctxsw(pid);
    rc1 = bench_proc_cpu_ns(b->redis_pid);
    if (bench_stop(pid, &status, NULL, 20000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || c0 < 0 ||
        c1 < 0) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        bench_fail(r, "relay %s: %s", bench_status_text(status, st, sizeof st), tail);
        return -1;
    }
    cpu_pct = 100.0 * (double)(c1 - c0) / ((double)window_ms * 1e6);
    redis_pct = rc0 >= 0 && rc1 >= 0 ? 100.0 * (double)(rc1 - rc0) / ((double)window_ms * 1e6) : -1;
    wake = s0 >= 0 && s1 >= 0 ? (double)(s1 - s0) * 1000.0 / window_ms : -1;
    bench_row_add(r, "relay CPU", "<= 1% core", cpu_pct <= 1.0 ? V_PASS : V_FAIL, "%.3f ms in %.0f s = %.3f%%",
                  (double)(c1 - c0) / 1e6, window_ms / 1000.0, cpu_pct);
    bench_row_add(r, "relay wake-ups", NULL, V_NONE, "%.1f /s (context switches)", wake);
    bench_row_add(r, "reference: idle redis-server", NULL, V_NONE, "%.3f%% CPU", redis_pct);
    bench_note(r, "Target 'idle CPU ~ 0' is read as at most 1%% of one core.");
    bench_json_num(r, "seconds", window_ms / 1000.0, 1);
    bench_json_num(r, "cpu_ms", (double)(c1 - c0) / 1e6, 3);
    bench_json_num(r, "cpu_pct", cpu_pct, 4);
    bench_json_num(r, "wakeups_per_s", wake, 1);
    bench_json_num(r, "redis_cpu_pct", redis_pct, 4);
    bench_json_num(r, "target_cpu_pct", 1.0, 1);
    bench_unlink_db(db);
    return 0;
}

/* ------------------------------------------------------------------ */
/* memory */

int sc_memory(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    long sizes[2];
    double rss_mib[2], maxrss_mib[2], secs[2];
    bench_rss peak[2];
    char db[PATH_MAX + 32], wal[PATH_MAX + 40], err[512], n1[32], tag[32];
    struct rusage ru;
    int i;

    sizes[0] = b->quick ? 10000 : 100000;
    sizes[1] = b->quick ? 100000 : 1000000;
    snprintf(r->title, sizeof r->title,
             "peak RSS (VmHWM) of outbox-relay --drain over %ld and %ld messages, default options",
             sizes[0], sizes[1]);
    for (i = 0; i < 2; i++) {
        snprintf(tag, sizeof tag, "memory-%ld", sizes[i]);
        bench_path(b, db, sizeof db, "memory.db");
        bench_progress(b, "building a %ld-message backlog", sizes[i]);
        if (bench_dataset_build(db, (uint64_t)sizes[i], &sh, 1000, err, sizeof err) != 0) {
            bench_fail(r, "%s", err);
            return -1;
        }
        bench_progress(b, "relay draining %ld", sizes[i]);
        memset(&peak[i], 0, sizeof peak[i]);
        snprintf(wal, sizeof wal, "%s-wal", db);
        peak[i].watch_file = wal;
        if (bench_relay_drain(b, db, tag, NULL, &secs[i], &ru, &peak[i], err, sizeof err) != 0) {
            bench_fail(r, "%s", err);
            return -1;
        }
        rss_mib[i] = (double)peak[i].hwm_kb / 1024.0;
        maxrss_mib[i] = (double)ru.ru_maxrss / 1024.0;
        bench_unlink_db(db);
        bench_redis_flush(b);
    }
    bench_row_add(r, "peak RSS, reference run", NULL, V_NONE, "%.1f MiB (%s msgs, %s msg/s)", rss_mib[0],
                  bench_thousands(n1, sizeof n1, (double)sizes[0]), bench_thousands(tag, sizeof tag,
                                                                                    sizes[0] / secs[0]));
    bench_row_add(r, "peak RSS, big run", b->quick ? NULL : "<= 64 MiB",
                  b->quick ? V_NONE : (rss_mib[1] <= 64.0 ? V_PASS : V_FAIL), "%.1f MiB (%s msgs, %s msg/s)",
                  rss_mib[1], bench_thousands(n1, sizeof n1, (double)sizes[1]),
                  bench_thousands(tag, sizeof tag, sizes[1] / secs[1]));
    bench_row_add(r, "growth big / reference", "<= 1.25", rss_mib[1] / rss_mib[0] <= 1.25 ? V_PASS : V_FAIL,
                  "%.2f", rss_mib[1] / rss_mib[0]);
    for (i = 0; i < 2; i++)
        bench_row_add(r, i ? "  big: sampled peaks" : "  reference: sampled peaks", NULL, V_NONE,
                      "anon %.1f, file %.1f, shmem %.1f MiB; WAL file %.0f MiB", (double)peak[i].anon_kb / 1024.0,
                      (double)peak[i].file_kb / 1024.0, (double)peak[i].shmem_kb / 1024.0,
                      (double)peak[i].file_bytes / 1048576.0);
    bench_note(r, "Peak RSS is VmHWM from /proc/PID/status, read every 10 ms until the relay exits (wait4's "
                  "ru_maxrss is %.1f / %.1f MiB here: Linux carries the spawning process's RSS across exec into it).",
               maxrss_mib[0], maxrss_mib[1]);
    bench_note(r, "Sampled peaks from /proc/PID/status every 10 ms (each may peak at a different time): RssAnon "
                  "(heap), RssFile (binary, libraries, SQLite's -shm WAL index), RssShmem.");
    if (b->quick)
        bench_note(r, "--quick: the 64 MiB target is for 1,000,000 messages and is not judged here.");
    bench_json_int(r, "messages", sizes[1]);
    bench_json_num(r, "peak_rss_mib", rss_mib[1], 1);
    bench_json_int(r, "reference_messages", sizes[0]);
    bench_json_num(r, "reference_peak_rss_mib", rss_mib[0], 1);
    bench_json_num(r, "growth", rss_mib[1] / rss_mib[0], 3);
    bench_json_num(r, "anon_peak_mib", (double)peak[1].anon_kb / 1024.0, 1);
    bench_json_num(r, "file_peak_mib", (double)peak[1].file_kb / 1024.0, 1);
    bench_json_num(r, "wal_peak_mib", (double)peak[1].file_bytes / 1048576.0, 1);
    bench_json_num(r, "reference_wal_peak_mib", (double)peak[0].file_bytes / 1048576.0, 1);
    bench_json_num(r, "target_mib", 64, 0);
    return 0;
}

/* ------------------------------------------------------------------ */
/* idempotent */

static int relay_lists_option(bench *b, const char *opt)
{
    const char *argv[] = {b->relay_bin, "--help", NULL};
    char out[PATH_MAX + 32], line[512];
    int found = 0, status;
    pid_t pid;
    FILE *f;
    bench_path(b, out, sizeof out, "relay-help.txt");
    unlink(out);
    if (bench_spawn(argv, out, NULL, &pid) != 0 || bench_wait(pid, &status, NULL, 10000) != 0)
        return -1;
    f = fopen(out, "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, opt);
        if (p && (p[strlen(opt)] == ' ' || p[strlen(opt)] == '\n' || p[strlen(opt)] == '=' ||
                  p[strlen(opt)] == '\t'))
            found = 1;
    }
    fclose(f);
    return found;
}

int sc_idempotent(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    const char *idem[] = {"--idempotent", NULL};
    char db[PATH_MAX + 32], err[512], n1[32];
    double plain_s, idem_s, plain_rate, idem_rate, ratio;
    struct rusage ru;
    long n = b->messages;

    snprintf(r->title, sizeof r->title, "%ld messages: outbox-relay --drain --idempotent vs plain --drain, same shape "
                                        "as drain",
             n);
    if (relay_lists_option(b, "--idempotent") != 1) {
        r->skipped = 1;
        snprintf(r->error, sizeof r->error, "relay has no --idempotent");
        return 0;
    }
    bench_path(b, db, sizeof db, "idempotent.db");
    bench_progress(b, "building a %ld-message backlog (plain)", n);
    if (bench_dataset_build(db, (uint64_t)n, &sh, 1000, err, sizeof err) != 0 ||
        bench_relay_drain(b, db, "plain", NULL, &plain_s, &ru, NULL, err, sizeof err) != 0) {
        bench_fail(r, "plain drain: %s", err);
        return -1;
    }
    bench_redis_flush(b);
    bench_progress(b, "building a %ld-message backlog (idempotent)", n);
    if (bench_dataset_build(db, (uint64_t)n, &sh, 1000, err, sizeof err) != 0 ||
        bench_relay_drain(b, db, "idempotent", idem, &idem_s, &ru, NULL, err, sizeof err) != 0) {
        bench_fail(r, "idempotent drain: %s", err);
        return -1;
    }
    plain_rate = (double)n / plain_s;
    idem_rate = (double)n / idem_s;
    ratio = idem_rate / plain_rate;
    bench_row_add(r, "plain drain (reference)", NULL, V_NONE, "%s msg/s", bench_thousands(n1, sizeof n1, plain_rate));
    bench_row_add(r, "idempotent drain", NULL, V_NONE, "%s msg/s", bench_thousands(n1, sizeof n1, idem_rate));
    bench_row_add(r, "idempotent / plain", ">= 0.50", ratio >= 0.5 ? V_PASS : V_FAIL, "%.2f", ratio);
    bench_json_int(r, "messages", n);
    bench_json_num(r, "msgs_per_s", idem_rate, 0);
    bench_json_num(r, "plain_msgs_per_s", plain_rate, 0);
    bench_json_num(r, "ratio", ratio, 3);
    bench_json_num(r, "target", 0.5, 1);
    bench_unlink_db(db);
    return 0;
}

/* ------------------------------------------------------------------ */
/* consume */

static int fill_stream(bench *b, const char *stream, long n, const bench_shape *sh, char *err, size_t errlen)
{
    redisContext *c = bench_redis_connect(b);
    unsigned char envbuf[8192];
    long i, pending = 0;
    if (!c) {
        snprintf(err, errlen, "cannot connect to Redis");
        return -1;
    }
    for (i = 0; i < n; i++) {
        bench_msgbuf mb;
        outbox_envelope e;
        char id[37];
        size_t len = 0;
        const char *argv[7];
        size_t lens[7];
        bench_shape_message(sh, (uint64_t)i, &mb);
        outbox_uuid7(id);
        memset(&e, 0, sizeof e);
        e.version = OUTBOX_ENVELOPE_VERSION;
        e.id = id;
        e.topic = mb.m.topic;
        e.key = mb.m.key;
        e.payload = mb.m.payload;
        e.payload_len = mb.m.payload_len;
        e.created_at = outbox_now_ms();
        if (outbox_envelope_encode(&e, envbuf, sizeof envbuf, &len) != 0) {
            snprintf(err, errlen, "envelope encoding failed");
            redisFree(c);
            return -1;
        }
        argv[0] = "XADD";
        argv[1] = stream;
        argv[2] = "*";
        argv[3] = "id";
        argv[4] = id;
        argv[5] = "envelope";
        argv[6] = (const char *)envbuf;
        for (int k = 0; k < 6; k++)
            lens[k] = strlen(argv[k]);
        lens[6] = len;
        redisAppendCommandArgv(c, 7, argv, lens);
        pending++;
        if (pending == 1000 || i == n - 1) {
            while (pending) {
                void *rp = NULL;
                if (redisGetReply(c, &rp) != REDIS_OK || ((redisReply *)rp)->type == REDIS_REPLY_ERROR) {
                    snprintf(err, errlen, "XADD failed while filling the stream: %s",
                             rp ? ((redisReply *)rp)->str : c->errstr);
                    freeReplyObject(rp);
                    redisFree(c);
                    return -1;
                }
                freeReplyObject(rp);
                pending--;
            }
        }
    }
    redisFree(c);
    return 0;
}

/* pending and entries-read of a group, from XINFO GROUPS. */
static int group_info(bench *b, const char *stream, const char *group, long long *pending, long long *read)
{
    redisReply *r = bench_redis(b, "XINFO GROUPS %s", stream);
    int found = -1;
    size_t i, k;
    *pending = *read = -1;
    if (!r || r->type != REDIS_REPLY_ARRAY) {
        freeReplyObject(r);
        return -1;
    }
    for (i = 0; i < r->elements; i++) {
        redisReply *g = r->element[i];
        int mine = 0;
        if (g->type != REDIS_REPLY_ARRAY)
            continue;
        for (k = 0; k + 1 < g->elements; k += 2)
            if (g->element[k]->type == REDIS_REPLY_STRING && !strcmp(g->element[k]->str, "name") &&
                g->element[k + 1]->type == REDIS_REPLY_STRING && !strcmp(g->element[k + 1]->str, group))
                mine = 1;
        if (!mine)
            continue;
        found = 0;
        for (k = 0; k + 1 < g->elements; k += 2) {
            if (g->element[k]->type != REDIS_REPLY_STRING || g->element[k + 1]->type != REDIS_REPLY_INTEGER)
                continue;
            if (!strcmp(g->element[k]->str, "pending"))
                *pending = g->element[k + 1]->integer;
            else if (!strcmp(g->element[k]->str, "entries-read"))
                *read = g->element[k + 1]->integer;
        }
    }
    freeReplyObject(r);
    return found;
}

static int run_consume(bench *b, const char *stream, const char *group, const char *dedup, long n, double *secs,
                       char *err, size_t errlen)
{
    char logpath[PATH_MAX + 64], name[96], st[32], tail[400];
    const char *argv[24];
    int a = 0, status = 0;
    long long pending, read;
    pid_t pid;
    uint64_t t0;

    snprintf(name, sizeof name, "consume-%s.log", group);
    bench_path(b, logpath, sizeof logpath, name);
    argv[a++] = b->consume_bin;
    argv[a++] = "--redis";
    argv[a++] = b->redis_url;
    argv[a++] = "--stream";
    argv[a++] = stream;
    argv[a++] = "--group";
    argv[a++] = group;
    argv[a++] = "--print";
    argv[a++] = "--drain";
    argv[a++] = "--dedup";
    argv[a++] = dedup;
    argv[a++] = "--log-level";
    argv[a++] = "warn";
    argv[a] = NULL;
    t0 = bench_mono_us();
    if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
        snprintf(err, errlen, "cannot start outbox-consume: %s", strerror(errno));
        return -1;
    }
    if (bench_wait(pid, &status, NULL, 3600000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        snprintf(err, errlen, "outbox-consume %s: %s", bench_status_text(status, st, sizeof st), tail);
        return -1;
    }
    *secs = (double)(bench_mono_us() - t0) / 1e6;
    if (group_info(b, stream, group, &pending, &read) != 0 || pending != 0) {
        snprintf(err, errlen, "outbox-consume exited but group %s has %lld entries pending", group, pending);
        return -1;
    }
    if (read >= 0 && read != n) {
        snprintf(err, errlen, "outbox-consume exited after reading %lld of %ld entries", read, n);
        return -1;
    }
    return 0;
}

int sc_consume(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    const char *stream = "outbox:bench.consume";
    char err[512], n1[32];
    double dedup_s, none_s, dedup_rate, none_rate;
    long n = b->messages;

    snprintf(r->title, sizeof r->title,
             "outbox-consume --print --drain over a stream of %ld messages (drain shape), stdout to /dev/null", n);
    if (!bench_file_exists_x(b->consume_bin)) {
        bench_fail(r, "no executable %s", b->consume_bin);
        return -1;
    }
    bench_progress(b, "filling %s with %ld entries", stream, n);
    if (fill_stream(b, stream, n, &sh, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "consuming with Redis dedup");
    if (run_consume(b, stream, "bench-dedup", "redis", n, &dedup_s, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "consuming without dedup");
    if (run_consume(b, stream, "bench-none", "none", n, &none_s, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    dedup_rate = (double)n / dedup_s;
    none_rate = (double)n / none_s;
    bench_row_add(r, "consume, Redis dedup", NULL, V_NONE, "%s msg/s (%.2f s)",
                  bench_thousands(n1, sizeof n1, dedup_rate), dedup_s);
    bench_row_add(r, "reference: --dedup none", NULL, V_NONE, "%s msg/s (%.2f s)",
                  bench_thousands(n1, sizeof n1, none_rate), none_s);
    bench_row_add(r, "dedup / none", NULL, V_NONE, "%.2f", dedup_rate / none_rate);
    bench_note(r, "Times are from spawn to exit; --drain waits up to 100 ms for more before exiting.");
    bench_json_int(r, "messages", n);
    bench_json_num(r, "msgs_per_s", dedup_rate, 0);
    bench_json_num(r, "nodedup_msgs_per_s", none_rate, 0);
    bench_json_num(r, "ratio", dedup_rate / none_rate, 3);
    return 0;
}
