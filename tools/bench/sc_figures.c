/*
 * figures: does reading the database figures cost the same with 10,000 and
 * with 3,000,000 rows (pending, and published), and is a scrape of a
 * 10,000,000-row relay quick? (--quick: 300,000 rows, and no 10,000,000.)
 *
 * Each database is built with raw prepared INSERTs (16-byte payloads, the
 * drain's topics and keys, bench_dataset_build_fast) and given the same few
 * rows with a state of their own whatever its size: 20 dead, 20 waiting for
 * a later available_at, and one batch of 512 leased by another relay; the
 * rest are new rows (the pending variant). The published variant is the same
 * file with the rest in published batches of 512 (their records written by
 * SQL, the cursor after the last row).
 *
 * Scrape and healthz: the outbox-relay daemon on the database with
 * --metrics-listen, Redis at a socket nobody listens on (it claims nothing),
 * retention off. Its figures are refreshed at most once a second, so each
 * request waits until the last refresh is more than a second old: each GET
 * times a refresh (the worker thread's read of the figures) and the HTTP
 * exchange. Best of ROUNDS (noise only adds time), the median shown too;
 * every scrape's outbox_messages{state} are checked against the rows the
 * database was built with. replay stats: `outbox-replay stats --json` as a
 * child process, spawn to exit, best of ROUNDS.
 *
 * Before, in the same run: the refresh counted rows through outbox_messages
 * (`SELECT state, count(*) FROM outbox_messages GROUP BY state`, timed here
 * in-process on a fresh read-only connection, what each refresh ran), and
 * stats read every row (`outbox-replay stats --json --by-topic`, which still
 * does). Once each: they take seconds on the big files.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#define FIG_ROUNDS 5
#define FIG_ROUNDS_QUICK 2
#define FIG_DEAD 20
#define FIG_WAITING 20
#define FIG_LEASED 512
#define FIG_BATCH 512
/* A refresh is at most this old (ms) before a request starts another. */
#define FIG_REFRESH_MS 1000

enum { F_SCRAPE, F_HEALTHZ, F_STATS, F_N };
static const char *const fig_names[F_N] = {"scrape", "healthz", "replay stats"};

/* One database variant's figures (ms). */
typedef struct fig_run {
    long rows;
    int published; /* the variant */
    double best[F_N], median[F_N];
    double before_count, before_stats; /* -1: not measured */
} fig_run;

/* The rows by state the variant was built with. */
static void expected(long n, int published, long long want[4])
{
    long rest = n - FIG_DEAD - FIG_WAITING - FIG_LEASED;
    want[0] = FIG_WAITING + (published ? 0 : rest);
    want[1] = FIG_LEASED;
    want[2] = published ? rest : 0;
    want[3] = FIG_DEAD;
}

/* The rows with a state of their own and the leased batch, at the start of
 * the table, and the cursor past them. */
static int add_exceptions(const char *path, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    char sql[1024];
    int64_t now = outbox_now_ms();
    int rc = -1;
    if (outbox_db_open(path, 0, &db, err, errlen) != 0)
        return -1;
    snprintf(sql, sizeof sql,
             "BEGIN IMMEDIATE;"
             "UPDATE outbox SET state = 3, attempts = 1, lease_token = 1, last_error = 'bench' WHERE seq <= %d;"
             "UPDATE outbox SET available_at = created_at + 3600000 WHERE seq > %d AND seq <= %d;"
             "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, attempts) "
             "VALUES (%d, %d, 1, 'other', 1, %lld, 1);"
             "UPDATE outbox_cursor SET new_from = %d;"
             "COMMIT; PRAGMA wal_checkpoint(TRUNCATE);",
             FIG_DEAD, FIG_DEAD, FIG_DEAD + FIG_WAITING, FIG_DEAD + FIG_WAITING + 1,
             FIG_DEAD + FIG_WAITING + FIG_LEASED, (long long)(now + 86400000), FIG_DEAD + FIG_WAITING + FIG_LEASED + 1);
    rc = bench_exec(db, sql, err, errlen);
    sqlite3_close_v2(db);
    return rc;
}

/* The new rows become published batches of FIG_BATCH. */
static int publish_rest(const char *path, long n, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    char sql[1024];
    int rc;
    if (outbox_db_open(path, 0, &db, err, errlen) != 0)
        return -1;
    snprintf(sql, sizeof sql,
             "BEGIN IMMEDIATE;"
             "WITH RECURSIVE c(lo) AS (SELECT %d UNION ALL SELECT lo + %d FROM c WHERE lo + %d <= %ld) "
             "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, attempts, published_at) "
             "SELECT lo, min(lo + %d, %ld), 2, NULL, 1, NULL, 1, %lld FROM c;"
             "UPDATE outbox_cursor SET new_from = %ld;"
             "COMMIT; PRAGMA wal_checkpoint(TRUNCATE);",
             FIG_DEAD + FIG_WAITING + FIG_LEASED + 1, FIG_BATCH, FIG_BATCH, n, FIG_BATCH - 1, n,
             (long long)outbox_now_ms(), n + 1);
    rc = bench_exec(db, sql, err, errlen);
    sqlite3_close_v2(db);
    return rc;
}

/* GET path from 127.0.0.1:port; the status code (0: no reply), *ms the
 * time from connect to the server's close. body (may be NULL) gets the
 * reply, cut at len - 1 bytes. */
static int http_get(int port, const char *path, double *ms, char *body, size_t len)
{
    struct sockaddr_in a;
    char req[256], buf[65536];
    size_t got = 0;
    uint64_t t0 = bench_mono_ns();
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), code = 0;
    ssize_t n;
    if (fd < 0)
        return -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        char rest[4096];
        if (poll(&p, 1, 120000) <= 0)
            break;
        /* What does not fit is read and dropped: the reply ends at close. */
        n = got < sizeof buf - 1 ? read(fd, buf + got, sizeof buf - 1 - got) : read(fd, rest, sizeof rest);
        if (n <= 0)
            break;
        if (got < sizeof buf - 1)
            got += (size_t)n;
    }
    close(fd);
    *ms = (double)(bench_mono_ns() - t0) / 1e6;
    buf[got] = '\0';
    if (!strncmp(buf, "HTTP/1.1 ", 9))
        code = atoi(buf + 9);
    if (body)
        snprintf(body, len, "%s", buf);
    return code;
}

/* Whether a scrape shows the rows the variant was built with. */
static int metrics_right(const char *text, const long long want[4], char *err, size_t errlen)
{
    static const char *const names[4] = {"pending", "sending", "published", "dead"};
    for (int s = 0; s < 4; s++) {
        char series[64];
        const char *p;
        snprintf(series, sizeof series, "outbox_messages{state=\"%s\"} ", names[s]);
        p = strstr(text, series);
        if (!p || strtoll(p + strlen(series), NULL, 10) != want[s]) {
            snprintf(err, errlen, "%s%s, want %lld", series, p ? "differs" : "missing", want[s]);
            return 0;
        }
    }
    return 1;
}

static void best_median(double *v, int n, double *best, double *median)
{
    *median = bench_median(v, (size_t)n); /* sorts v */
    *best = v[0];
}

/* Scrapes and health checks of the daemon on db: rounds of each. */
static int time_http(bench *b, const char *db, const char *tag, const long long want[4], int rounds, fig_run *fr,
                     char *err, size_t errlen)
{
    char logpath[PATH_MAX + 64], name[128], listen[32], url[PATH_MAX + 32], tail[400];
    static char body[65536];
    double t[F_N][BENCH_MAX_RUNS], ms;
    const char *argv[24];
    int port = bench_free_port(), a = 0, code = -1, ok = 0;
    uint64_t deadline, last;
    pid_t pid;

    snprintf(name, sizeof name, "relay-figures-%s.log", tag);
    bench_path(b, logpath, sizeof logpath, name);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    snprintf(url, sizeof url, "unix://%s/nobody.sock", b->tmpdir);
    argv[a++] = b->relay_bin;
    argv[a++] = "--db";
    argv[a++] = db;
    argv[a++] = "--redis";
    argv[a++] = url;
    argv[a++] = "--metrics-listen";
    argv[a++] = listen;
    argv[a++] = "--retention-ms";
    argv[a++] = "0";
    argv[a++] = "--health-redis-down-ms";
    argv[a++] = "86400000";
    argv[a++] = "--log-level";
    argv[a++] = "error";
    argv[a] = NULL;
    if (port < 0 || bench_spawn(argv, NULL, logpath, &pid) != 0) {
        snprintf(err, errlen, "cannot start the relay: %s", strerror(errno));
        return -1;
    }
    /* Up once it answers; the first refresh opens its connection. */
    deadline = bench_mono_us() + 60000000u;
    while (bench_mono_us() < deadline && (code = http_get(port, "/healthz", &ms, NULL, 0)) <= 0)
        bench_sleep_ms(20);
    last = bench_mono_us();
    if (code <= 0) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        snprintf(err, errlen, "the relay's /healthz did not answer: %s", tail);
        goto out;
    }
    for (int i = 0; i < rounds; i++)
        for (int f = F_SCRAPE; f <= F_HEALTHZ; f++) {
            uint64_t since = bench_mono_us() - last;
            if (since < (FIG_REFRESH_MS + 50) * 1000u)
                bench_sleep_ms((unsigned)((FIG_REFRESH_MS + 50) - since / 1000));
            code = http_get(port, f == F_SCRAPE ? "/metrics" : "/healthz", &t[f][i], body, sizeof body);
            last = bench_mono_us();
            if (code != 200 || (f == F_SCRAPE && !metrics_right(body, want, err, errlen))) {
                if (code != 200)
                    snprintf(err, errlen, "GET %s: status %d", f == F_SCRAPE ? "/metrics" : "/healthz", code);
                goto out;
            }
        }
    for (int f = F_SCRAPE; f <= F_HEALTHZ; f++)
        best_median(t[f], rounds, &fr->best[f], &fr->median[f]);
    ok = 1;
out:
    bench_stop(pid, NULL, NULL, 30000);
    return ok ? 0 : -1;
}

/* outbox-replay stats on db (extra: an option more, or NULL); the time of
 * one run from spawn to exit, checking its exit status. */
static int time_stats(bench *b, const char *db, const char *extra, double *ms, char *err, size_t errlen)
{
    char tool[PATH_MAX + 64], st[32];
    const char *argv[] = {tool, "stats", "--db", db, "--json", extra, NULL};
    uint64_t t0;
    int status = 0;
    pid_t pid;
    snprintf(tool, sizeof tool, "%s/tools/replay/outbox-replay", b->build_dir);
    t0 = bench_mono_ns();
    if (bench_spawn(argv, NULL, NULL, &pid) != 0 || bench_wait(pid, &status, NULL, 600000) != 0) {
        snprintf(err, errlen, "cannot run outbox-replay: %s", strerror(errno));
        return -1;
    }
    *ms = (double)(bench_mono_ns() - t0) / 1e6;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        snprintf(err, errlen, "outbox-replay stats: %s", bench_status_text(status, st, sizeof st));
        return -1;
    }
    return 0;
}

/* What a refresh ran before: a count through outbox_messages, on a fresh
 * read-only connection. */
static int time_view_count(const char *db, double *ms, char *err, size_t errlen)
{
    sqlite3 *c = NULL;
    sqlite3_stmt *st = NULL;
    uint64_t t0;
    int rc;
    if (sqlite3_open_v2(db, &c, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "cannot open the database: %s", c ? sqlite3_errmsg(c) : "no memory");
        sqlite3_close_v2(c);
        return -1;
    }
    t0 = bench_mono_ns();
    rc = sqlite3_prepare_v2(c, "SELECT state, count(*) FROM outbox_messages GROUP BY state", -1, &st, NULL);
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW)
        rc = SQLITE_OK;
    *ms = (double)(bench_mono_ns() - t0) / 1e6;
    if (rc != SQLITE_DONE)
        snprintf(err, errlen, "count: %s", sqlite3_errmsg(c));
    sqlite3_finalize(st);
    sqlite3_close_v2(c);
    return rc == SQLITE_DONE ? 0 : -1;
}

/* Both variants of one size: fr[0] pending, fr[1] published. before: also
 * the old ways, once each. */
static int measure_size(bench *b, bench_report *r, long n, int with_stats, int before, fig_run fr[2])
{
    bench_shape sh = {16, b->keys};
    char db[PATH_MAX + 32], err[512], tag[48], nb[32];
    double t[BENCH_MAX_RUNS];
    int rounds = b->quick ? FIG_ROUNDS_QUICK : FIG_ROUNDS;
    uint64_t t0 = bench_mono_us();

    snprintf(tag, sizeof tag, "figures-%ld.db", n);
    bench_path(b, db, sizeof db, tag);
    bench_progress(b, "building the %s-row database", bench_thousands(nb, sizeof nb, (double)n));
    if (bench_dataset_build_fast(db, (uint64_t)n, &sh, err, sizeof err) != 0 ||
        add_exceptions(db, err, sizeof err) != 0) {
        bench_fail(r, "%ld rows: %s", n, err);
        bench_unlink_db(db);
        return -1;
    }
    bench_progress(b, "built in %.1f s; measuring", (double)(bench_mono_us() - t0) / 1e6);
    for (int v = 0; v < 2; v++) {
        long long want[4];
        fig_run *f = &fr[v];
        memset(f, 0, sizeof *f);
        f->rows = n;
        f->published = v;
        f->before_count = f->before_stats = -1;
        f->best[F_STATS] = f->median[F_STATS] = -1;
        if (v == 1 && publish_rest(db, n, err, sizeof err) != 0)
            goto fail;
        expected(n, v, want);
        snprintf(tag, sizeof tag, "%ld-%s", n, v ? "published" : "pending");
        if (time_http(b, db, tag, want, rounds, f, err, sizeof err) != 0)
            goto fail;
        if (with_stats) {
            for (int i = 0; i < rounds; i++)
                if (time_stats(b, db, NULL, &t[i], err, sizeof err) != 0)
                    goto fail;
            best_median(t, rounds, &f->best[F_STATS], &f->median[F_STATS]);
        }
        if (before) {
            if (time_view_count(db, &f->before_count, err, sizeof err) != 0 ||
                (with_stats && time_stats(b, db, "--by-topic", &f->before_stats, err, sizeof err) != 0))
                goto fail;
        }
    }
    bench_unlink_db(db);
    return 0;
fail:
    bench_fail(r, "%ld rows: %s", n, err);
    bench_unlink_db(db);
    return -1;
}

static void json_run(bench_report *r, const char *key, const fig_run *f)
{
    outbox__sbuf s = {0};
    outbox__sbuf_printf(&s, "{\"rows\":%ld,\"scrape_ms\":", f->rows);
    bench_sbuf_num(&s, f->best[F_SCRAPE], 3);
    outbox__sbuf_printf(&s, ",\"healthz_ms\":");
    bench_sbuf_num(&s, f->best[F_HEALTHZ], 3);
    outbox__sbuf_printf(&s, ",\"stats_ms\":");
    bench_sbuf_num(&s, f->best[F_STATS] >= 0 ? f->best[F_STATS] : NAN, 3);
    outbox__sbuf_printf(&s, ",\"before_count_ms\":");
    bench_sbuf_num(&s, f->before_count >= 0 ? f->before_count : NAN, 1);
    outbox__sbuf_printf(&s, ",\"before_stats_ms\":");
    bench_sbuf_num(&s, f->before_stats >= 0 ? f->before_stats : NAN, 1);
    outbox__sbuf_printf(&s, "}");
    bench_json_raw(r, key, &s);
    outbox__sbuf_free(&s);
}

int sc_figures(bench *b, bench_report *r)
{
    long small = 10000, big = b->quick ? 300000 : 3000000, huge = b->quick ? 0 : 10000000; /* 0: not run */
    fig_run s[2], g[2], h[2];
    char n1[32], n2[32], label[96], target[32];

    snprintf(r->title, sizeof r->title,
             "scrape, healthz and replay stats on %s vs 10,000 rows (pending; published)%s%s; 16-byte payloads",
             bench_thousands(n1, sizeof n1, (double)big), huge ? ", scrape on " : "",
             huge ? bench_thousands(n2, sizeof n2, (double)huge) : "");
    if (measure_size(b, r, small, 1, 1, s) != 0 || measure_size(b, r, big, 1, 1, g) != 0 ||
        (huge && measure_size(b, r, huge, 0, 1, h) != 0))
        return -1;
    for (int v = 0; v < 2; v++) {
        const char *var = v ? "published" : "pending";
        for (int f = 0; f < F_N; f++) {
            snprintf(label, sizeof label, "%s, %s: 10k", fig_names[f], var);
            bench_row_add(r, label, NULL, V_NONE, "%.3f ms (median %.3f)", s[v].best[f], s[v].median[f]);
            snprintf(label, sizeof label, "%s, %s: %s", fig_names[f], var, bench_thousands(n1, sizeof n1, (double)big));
            bench_row_add(r, label, NULL, V_NONE, "%.3f ms (median %.3f)", g[v].best[f], g[v].median[f]);
            snprintf(label, sizeof label, "%s, %s: big / 10k", fig_names[f], var);
            bench_row_add(r, label, "<= 3", g[v].best[f] / s[v].best[f] <= 3 ? V_PASS : V_FAIL, "%.2f",
                          g[v].best[f] / s[v].best[f]);
        }
        if (!huge)
            continue;
        snprintf(label, sizeof label, "scrape, %s: %s", var, bench_thousands(n1, sizeof n1, (double)huge));
        snprintf(target, sizeof target, "< 50 ms");
        bench_row_add(r, label, target, h[v].best[F_SCRAPE] < 50 ? V_PASS : V_FAIL, "%.3f ms (median %.3f)",
                      h[v].best[F_SCRAPE], h[v].median[F_SCRAPE]);
        snprintf(label, sizeof label, "healthz, %s: %s", var, bench_thousands(n1, sizeof n1, (double)huge));
        bench_row_add(r, label, NULL, V_NONE, "%.3f ms (median %.3f)", h[v].best[F_HEALTHZ], h[v].median[F_HEALTHZ]);
    }
    for (int v = 0; v < 2; v++) {
        const char *var = v ? "published" : "pending";
        const fig_run *runs[3] = {&s[v], &g[v], &h[v]};
        for (int i = 0; i < (huge ? 3 : 2); i++) {
            snprintf(label, sizeof label, "before, %s: %s", var, bench_thousands(n1, sizeof n1, (double)runs[i]->rows));
            if (runs[i]->before_stats >= 0)
                bench_row_add(r, label, NULL, V_NONE, "count %.1f ms, stats %.1f ms", runs[i]->before_count,
                              runs[i]->before_stats);
            else
                bench_row_add(r, label, NULL, V_NONE, "count %.1f ms", runs[i]->before_count);
        }
    }
    bench_note(r, "Each database: %d dead rows, %d waiting, one leased batch of %d, the rest new (pending) or in "
                  "published batches of %d. Best of %d requests each (median shown); every request waited until "
                  "the relay's figures were over %d ms old, so each timed a refresh.",
               FIG_DEAD, FIG_WAITING, FIG_LEASED, FIG_BATCH, b->quick ? FIG_ROUNDS_QUICK : FIG_ROUNDS,
               FIG_REFRESH_MS);
    bench_note(r, "Before: 'count' is what every refresh ran (SELECT state, count(*) FROM outbox_messages GROUP BY "
                  "state, in-process), 'stats' is outbox-replay stats --by-topic (every row read, as stats did "
                  "without filters). Once each.");
    json_run(r, "small_pending", &s[0]);
    json_run(r, "small_published", &s[1]);
    json_run(r, "big_pending", &g[0]);
    json_run(r, "big_published", &g[1]);
    if (huge) {
        json_run(r, "huge_pending", &h[0]);
        json_run(r, "huge_published", &h[1]);
    }
    bench_json_num(r, "target_ratio", 3, 0);
    bench_json_num(r, "target_huge_scrape_ms", 50, 0);
    return 0;
}
