/*
 * drain_tls: the drain's backlog drained by the relay daemon over plaintext
 * TCP and over TLS (rediss://, verified against the server's certificate),
 * to the same redis-server on 127.0.0.1, in the same run, alternating.
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"

/* Runs per transport (--quick: QUICK_ROUNDS): the best of them counts
 * (noise only adds time; the first drain after the backlog was built also
 * pays for reading it). */
#define ROUNDS 3
#define QUICK_ROUNDS 2
#define TARGET 0.7

int sc_drain_tls(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    bench_tls_server t;
    /* The same server over both transports (its URLs are filled in when
     * it starts); the TLS side verifies its certificate. */
    const char *const tcp_extra[] = {"--redis", t.tcp_url, NULL};
    const char *const tls_extra[] = {"--redis", t.tls_url, "--tls-ca-file", t.cert, NULL};
    bench_drain_side tr[2] = {{"tcp", "over tcp", tcp_extra, NULL, NULL, 0, 0},
                              {"tls", "over tls", tls_extra, NULL, NULL, 0, 0}};
    char src[PATH_MAX + 32], db[PATH_MAX + 32], err[512], n1[32], n2[32];
    long n = b->messages;
    int rounds = b->quick ? QUICK_ROUNDS : ROUNDS, rc = 0;
    double ratio;

    snprintf(r->title, sizeof r->title,
             "%ld messages (the drain's shape), relay daemon with default options over plaintext TCP and over "
             "TLS to one redis-server on 127.0.0.1",
             n);
    if (bench_tls_server_start(b, &t, err, sizeof err) != 0) {
        bench_tls_server_stop(&t);
        bench_fail(r, "%s", err);
        return -1;
    }
    tr[0].rc = tr[1].rc = t.rc;
    bench_path(b, src, sizeof src, "drain-tls-src.db");
    bench_path(b, db, sizeof db, "drain-tls.db");
    bench_progress(b, "building a %ld-message backlog", n);
    rc = bench_dataset_build(src, (uint64_t)n, &sh, 1000, err, sizeof err);
    if (rc == 0)
        rc = bench_drain_pair(b, src, db, n, rounds, tr, err, sizeof err);
    bench_unlink_db(src);
    bench_tls_server_stop(&t);
    if (rc != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    ratio = tr[1].best_rate / tr[0].best_rate;
    bench_row_add(r, "drain over plaintext TCP", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg",
                  bench_thousands(n1, sizeof n1, tr[0].best_rate), tr[0].cpu_us);
    bench_row_add(r, "drain over TLS", NULL, V_NONE, "%s msg/s, %.1f us CPU/msg",
                  bench_thousands(n2, sizeof n2, tr[1].best_rate), tr[1].cpu_us);
    bench_row_add(r, "TLS / plaintext", ">= 0.70", ratio >= TARGET ? V_PASS : V_FAIL, "%.2f", ratio);
    bench_note(r, "Best of %d run%s each, alternating; every run drains a copy of one backlog and checks that "
                  "the streams hold all %ld messages.",
               rounds, rounds > 1 ? "s" : "", n);
    bench_note(r, "TLS: rediss://127.0.0.1 with --tls-ca-file (a self-signed P-256 certificate made with the "
                  "openssl command for this run), so the chain and the IP address are verified as in production.");
    bench_json_int(r, "messages", n);
    bench_json_num(r, "msgs_per_s", tr[1].best_rate, 0);
    bench_json_num(r, "plain_msgs_per_s", tr[0].best_rate, 0);
    bench_json_num(r, "ratio", ratio, 3);
    bench_json_num(r, "target", TARGET, 1);
    bench_json_num(r, "relay_cpu_us_per_msg", tr[1].cpu_us, 2);
    bench_json_num(r, "plain_relay_cpu_us_per_msg", tr[0].cpu_us, 2);
    bench_json_int(r, "rounds", rounds);
    return 0;
}
