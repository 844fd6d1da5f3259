/*
 * outbox-bench: runs named benchmark scenarios against a private
 * redis-server and fresh databases, each reported against a reference
 * measured in the same run (the machines are shared: absolute figures
 * drift). Prints a table and one "BENCH {json}" line per scenario.
 */
#include <errno.h>
#include <ftw.h>
#include <malloc.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <uv.h>

#include "bench.h"

static const char *prog = "outbox-bench";

typedef struct scenario {
    const char *name;
    const char *alias;
    int (*run)(bench *b, bench_report *r);
    const char *help;
} scenario;

static const scenario scenarios[] = {
    {"drain", NULL, sc_drain, "relay daemon draining a backlog vs redis-benchmark pipelined XADD"},
    {"drain_tls", "tls", sc_drain_tls, "the same drain over TLS vs over plaintext TCP, one redis-server"},
    {"drain_cluster", "cluster", sc_drain_cluster, "the same drain into a 3-master Redis Cluster vs one redis-server"},
    {"idle", NULL, sc_idle, "CPU of a relay daemon with nothing to do, 5 s, vs redis-server's"},
    {"latency", NULL, sc_latency, "commit-to-stream latency at 1k and 10k msg/s, in-process and daemon"},
    {"sustained", NULL, sc_sustained, "20k msg/s FULL writer for 60 s, relay daemon with retention: backlog, latency, file"},
    {"writer", NULL, sc_writer, "outbox_enqueue vs plain SQLite inserts of the same shape"},
    {"loop", "loop-stall", sc_loop, "event-loop iteration times with the relay embedded, draining"},
    {"idempotent", NULL, sc_idempotent, "drain with --idempotent vs plain drain"},
    {"consume", NULL, sc_consume, "outbox-consume --print --drain with Redis dedup vs without"},
    {"memory", NULL, sc_memory, "peak RSS of the relay daemon draining 1,000,000 vs 100,000"},
    {"claim", "claim-cost", sc_claim, "time per claimed batch with 10,000 vs 10,000,000 rows waiting"},
    {"dbdir", NULL, sc_dbdir, "--db-dir drain of 1,000 databases x 100 rows vs one database of 100,000"},
    {"dbdir_idle", NULL, sc_dbdir_idle, "--db-dir over 10,000 idle databases: RSS, descriptors, CPU, commit latency"},
    {"dbdir_fair", NULL, sc_dbdir_fair, "--db-dir: 40 small tenants at 25 rows/s beside a 400k-row backlog"},
    {"figures", NULL, sc_figures, "scrape, healthz and replay stats on 3,000,000 vs 10,000 rows; scrape on 10,000,000"},
};
#define NSCENARIOS (sizeof scenarios / sizeof scenarios[0])

/* ------------------------------------------------------------------ */
/* reports */

void bench_row_add(bench_report *r, const char *metric, const char *target, int verdict, const char *fmt, ...)
{
    va_list ap;
    bench_row *row;
    if (r->nrows == BENCH_MAX_ROWS)
        return;
    row = &r->rows[r->nrows++];
    snprintf(row->metric, sizeof row->metric, "%s", metric);
    snprintf(row->target, sizeof row->target, "%s", target ? target : "");
    va_start(ap, fmt);
    vsnprintf(row->value, sizeof row->value, fmt, ap);
    va_end(ap);
    row->verdict[0] = '\0';
    if (verdict != V_NONE) {
        snprintf(row->verdict, sizeof row->verdict, "%s", verdict == V_PASS ? "pass" : "FAIL");
        if (!r->has_target) {
            r->has_target = 1;
            r->all_pass = 1;
        }
        if (verdict != V_PASS)
            r->all_pass = 0;
    }
}

void bench_note(bench_report *r, const char *fmt, ...)
{
    va_list ap;
    char line[1024];
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    outbox__sbuf_printf(&r->notes, "  %s\n", line);
}

void bench_fail(bench_report *r, const char *fmt, ...)
{
    va_list ap;
    r->failed = 1;
    va_start(ap, fmt);
    vsnprintf(r->error, sizeof r->error, fmt, ap);
    va_end(ap);
}

static void json_escape(outbox__sbuf *s, const char *v)
{
    outbox__sbuf_printf(s, "\"");
    for (; *v; v++) {
        unsigned char c = (unsigned char)*v;
        if (c == '"' || c == '\\')
            outbox__sbuf_printf(s, "\\%c", c);
        else if (c < 0x20)
            outbox__sbuf_printf(s, "\\u%04x", c);
        else
            outbox__sbuf_printf(s, "%c", c);
    }
    outbox__sbuf_printf(s, "\"");
}

void bench_json_int(bench_report *r, const char *key, long long v)
{
    outbox__sbuf_printf(&r->json, ",\"%s\":%lld", key, v);
}

void bench_json_num(bench_report *r, const char *key, double v, int decimals)
{
    outbox__sbuf_printf(&r->json, ",\"%s\":", key);
    bench_sbuf_num(&r->json, v, decimals);
}

void bench_json_str(bench_report *r, const char *key, const char *v)
{
    outbox__sbuf_printf(&r->json, ",\"%s\":", key);
    json_escape(&r->json, v);
}

void bench_json_bool(bench_report *r, const char *key, int v)
{
    outbox__sbuf_printf(&r->json, ",\"%s\":%s", key, v ? "true" : "false");
}

void bench_json_raw(bench_report *r, const char *key, const outbox__sbuf *json)
{
    if (json->oom || !json->p)
        r->json.oom = 1;
    else
        outbox__sbuf_printf(&r->json, ",\"%s\":%s", key, json->p);
}

/* A report whose text is incomplete is not printed: the run ends. */
static void out_of_memory(void)
{
    fprintf(stderr, "%s: out of memory\n", prog);
    exit(1);
}

static void print_report(const bench *b, const bench_report *r)
{
    outbox__sbuf line = {0};
    int i;
    size_t wm = 6, wv = 5, wt = 6;

    if (r->json.oom || r->notes.oom)
        out_of_memory();
    if (!b->json_only) {
        printf("\n== %s: %s ==\n", r->scenario, r->title);
        if (r->failed)
            printf("  FAILED TO RUN: %s\n", r->error);
        else if (r->skipped)
            printf("  skipped: %s\n", r->error);
        if (r->nrows) {
            for (i = 0; i < r->nrows; i++) {
                if (strlen(r->rows[i].metric) > wm)
                    wm = strlen(r->rows[i].metric);
                if (strlen(r->rows[i].value) > wv)
                    wv = strlen(r->rows[i].value);
                if (strlen(r->rows[i].target) > wt)
                    wt = strlen(r->rows[i].target);
            }
            printf("  %-*s  %-*s  %-*s  %s\n", (int)wm, "metric", (int)wv, "value", (int)wt, "target", "verdict");
            for (i = 0; i < r->nrows; i++)
                printf("  %-*s  %-*s  %-*s  %s\n", (int)wm, r->rows[i].metric, (int)wv, r->rows[i].value, (int)wt,
                       r->rows[i].target, r->rows[i].verdict);
        }
        if (r->notes.len)
            fputs(r->notes.p, stdout);
        printf("  (scenario wall time %.1f s; 1-minute load average %.2f before, %.2f after, on %ld CPUs)\n",
               r->seconds, r->load_before, r->load_after, sysconf(_SC_NPROCESSORS_ONLN));
    }
    outbox__sbuf_printf(&line, "BENCH {\"scenario\":\"%s\"", r->scenario);
    if (r->failed) {
        outbox__sbuf_printf(&line, ",\"error\":");
        json_escape(&line, r->error);
    } else if (r->skipped) {
        outbox__sbuf_printf(&line, ",\"skipped\":");
        json_escape(&line, r->error);
    } else {
        if (r->json.len)
            outbox__sbuf_printf(&line, "%s", r->json.p);
        outbox__sbuf_printf(&line, ",\"load1\":[%.2f,%.2f],\"wall_s\":%.1f", r->load_before, r->load_after,
                         r->seconds);
        if (r->has_target)
            outbox__sbuf_printf(&line, ",\"pass\":%s", r->all_pass ? "true" : "false");
    }
    outbox__sbuf_printf(&line, "}");
    if (line.oom)
        out_of_memory();
    printf("%s\n", line.p);
    fflush(stdout);
    outbox__sbuf_free(&line);
}

/* ------------------------------------------------------------------ */
/* the run */

void bench_progress(const bench *b, const char *fmt, ...)
{
    va_list ap;
    if (b->json_only)
        return;
    fprintf(stderr, "  [%s] ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

const char *bench_path(const bench *b, char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", b->tmpdir, name);
    return buf;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static char interrupted_tmpdir[PATH_MAX];

static void on_interrupt(int sig)
{
    static const char msg[] = "\noutbox-bench: interrupted; killed the child processes; files left in ";
    bench_kill_children();
    if (write(2, msg, sizeof msg - 1) < 0 || write(2, interrupted_tmpdir, strlen(interrupted_tmpdir)) < 0 ||
        write(2, "\n", 1) < 0)
        (void)0;
    signal(sig, SIG_DFL);
    raise(sig);
}

static int find_build_dir(bench *b, char *err, size_t errlen)
{
    const char *env = getenv("OUTBOX_BUILD_DIR");
    char exe[PATH_MAX];
    ssize_t n;
    if (env && *env) {
        snprintf(b->build_dir, sizeof b->build_dir, "%s", env);
    } else {
        /* <build>/tools/bench/outbox-bench */
        n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) {
            snprintf(err, errlen, "cannot read /proc/self/exe; set OUTBOX_BUILD_DIR");
            return -1;
        }
        exe[n] = '\0';
        for (int up = 0; up < 3; up++) {
            char *slash = strrchr(exe, '/');
            if (!slash) {
                snprintf(err, errlen, "cannot find the build directory from %s; set OUTBOX_BUILD_DIR", exe);
                return -1;
            }
            *slash = '\0';
        }
        snprintf(b->build_dir, sizeof b->build_dir, "%s", exe[0] ? exe : "/");
    }
    snprintf(b->relay_bin, sizeof b->relay_bin, "%s/tools/relay/outbox-relay", b->build_dir);
    snprintf(b->consume_bin, sizeof b->consume_bin, "%s/tools/consume/outbox-consume", b->build_dir);
    if (!bench_file_exists_x(b->relay_bin)) {
        snprintf(err, errlen, "no executable %s (build first, or set OUTBOX_BUILD_DIR)", b->relay_bin);
        return -1;
    }
    return 0;
}

static void usage(FILE *f)
{
    size_t i;
    fprintf(f,
            "Usage: %s [SCENARIO...] [--messages N] [--claim-rows N] [--keys K] [--writer-sync FULL|NORMAL]\n"
            "       [--runs N] [--quick] [--json-only] [--keep]\n"
            "\n"
            "Starts a private redis-server on a Unix socket in a temporary directory and\n"
            "fresh SQLite databases there, runs the scenarios (default: all, in this order)\n"
            "and prints for each a table and one line 'BENCH {json}'. Every figure is set\n"
            "against a reference measured in the same run; targets are reported, not enforced.\n"
            "\n"
            "Scenarios:\n",
            prog);
    for (i = 0; i < NSCENARIOS; i++)
        fprintf(f, "  %-11s %s\n", scenarios[i].name, scenarios[i].help);
    fprintf(f,
            "\n"
            "Options:\n"
            "  --messages N     backlog of drain, loop, idempotent, consume and writer (default 300000)\n"
            "  --claim-rows N   the big backlog of the claim scenario (default 10000000)\n"
            "  --keys K         distinct ordering keys; every second message is keyed (default 1000; 0: none)\n"
            "  --writer-sync M  PRAGMA synchronous of the latency scenario's writer: FULL (default) or NORMAL\n"
            "  --runs N         latency: run the in-process 10k msg/s case N times (1..20, default 1) and\n"
            "                   count the runs with p99 <= 5 ms (target: 8 of 10)\n"
            "  --quick          every size about 10x smaller (the run takes about a minute: CI smoke)\n"
            "  --json-only      print only the BENCH lines (no tables, no progress)\n"
            "  --keep           keep the temporary directory (databases, logs) and print its path\n"
            "  -h, --help       this help\n"
            "\n"
            "Environment: OUTBOX_BUILD_DIR, the meson build directory with tools/relay/outbox-relay\n"
            "and tools/consume/outbox-consume (default: found from this binary's location);\n"
            "TMPDIR for the temporary directory; OUTBOX_BENCH_WRAP, a command prefix for the relay\n"
            "daemons of drain, memory, idempotent and claim (profiling only: it skews their figures),\n"
            "e.g. \"perf record -g -o /tmp/relay.perf --\". redis-server and redis-benchmark come from PATH.\n"
            "Exit status: 0 every scenario ran (targets met or not), 1 a scenario failed to run,\n"
            "2 usage error.\n");
}

static int parse_count(const char *opt, const char *v, long min, long max, long *out)
{
    char *end;
    long long x;
    if (!v || !*v || *v == '-' || *v == '+') {
        fprintf(stderr, "%s: %s needs a whole number\n", prog, opt);
        return -1;
    }
    errno = 0;
    x = strtoll(v, &end, 10);
    if (*end == 'k' || *end == 'K') {
        x *= 1000;
        end++;
    } else if (*end == 'm' || *end == 'M') {
        x *= 1000000;
        end++;
    }
    if (*end || errno || x < min || x > max) {
        fprintf(stderr, "%s: %s: '%s' is not a whole number in %ld..%ld\n", prog, opt, v, min, max);
        return -1;
    }
    *out = (long)x;
    return 0;
}

static void print_machine(const bench *b)
{
    char line[512], model[256] = "unknown";
    long long mem_kb = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    struct utsname u;
    if (f) {
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                char *p = strchr(line, ':');
                if (p) {
                    snprintf(model, sizeof model, "%s", p + 2);
                    model[strcspn(model, "\n")] = '\0';
                }
                break;
            }
        fclose(f);
    }
    f = fopen("/proc/meminfo", "r");
    if (f) {
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemTotal: %lld kB", &mem_kb) == 1)
                break;
        fclose(f);
    }
    uname(&u);
    printf("# outbox-bench %s: %ld CPUs (%s), %.1f GiB memory, Linux %s\n", outbox_version(),
           sysconf(_SC_NPROCESSORS_ONLN), model, (double)mem_kb / 1048576.0, u.release);
    printf("# SQLite %s, libuv %s, redis-server on %s, relay %s%s\n", sqlite3_libversion(), uv_version_string(),
           b->sock, b->relay_bin, b->quick ? "; --quick sizes" : "");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    bench b;
    int selected[NSCENARIOS];
    int any_selected = 0, failures = 0;
    const char *tmp;
    char err[PATH_MAX + 1024];
    size_t i;
    long v;

    /* SQLite and malloc as outbox-relay sets them (tools/relay/main.c), so
     * that the SQL floors measured in this process run the way the daemon's
     * SQL does: with SQLite's memory statistics on, every allocation takes
     * one global mutex, and threads at once queue on it. */
    sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
    mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024);
    mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
    memset(&b, 0, sizeof b);
    memset(selected, 0, sizeof selected);
    b.messages = 300000;
    b.claim_rows = 10000000;
    b.keys = 1000;
    b.writer_sync = "FULL";
    b.latency_runs = 1;
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a], *val = a + 1 < argc ? argv[a + 1] : NULL;
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(arg, "--quick")) {
            b.quick = 1;
        } else if (!strcmp(arg, "--json-only")) {
            b.json_only = 1;
        } else if (!strcmp(arg, "--keep")) {
            b.keep = 1;
        } else if (!strcmp(arg, "-v") || !strcmp(arg, "--verbose")) {
            b.verbose = 1;
        } else if (!strcmp(arg, "--messages")) {
            if (parse_count(arg, val, 1000, 100000000, &v) != 0)
                return 2;
            b.messages = v;
            b.messages_set = 1;
            a++;
        } else if (!strcmp(arg, "--claim-rows")) {
            if (parse_count(arg, val, 20000, 1000000000, &v) != 0)
                return 2;
            b.claim_rows = v;
            b.claim_rows_set = 1;
            a++;
        } else if (!strcmp(arg, "--writer-sync")) {
            if (!val || (strcmp(val, "FULL") && strcmp(val, "NORMAL"))) {
                fprintf(stderr, "%s: --writer-sync needs FULL or NORMAL\n", prog);
                return 2;
            }
            b.writer_sync = val;
            a++;
        } else if (!strcmp(arg, "--runs")) {
            if (parse_count(arg, val, 1, BENCH_MAX_RUNS, &v) != 0)
                return 2;
            b.latency_runs = (int)v;
            a++;
        } else if (!strcmp(arg, "--keys")) {
            if (parse_count(arg, val, 0, 10000000, &v) != 0)
                return 2;
            b.keys = (unsigned)v;
            a++;
        } else if (arg[0] == '-') {
            fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, arg);
            return 2;
        } else {
            int found = 0;
            for (i = 0; i < NSCENARIOS; i++)
                if (!strcmp(arg, scenarios[i].name) || (scenarios[i].alias && !strcmp(arg, scenarios[i].alias))) {
                    selected[i] = 1;
                    found = 1;
                }
            if (!found) {
                fprintf(stderr, "%s: unknown scenario '%s' (see --help)\n", prog, arg);
                return 2;
            }
            any_selected = 1;
        }
    }
    if (!any_selected)
        for (i = 0; i < NSCENARIOS; i++)
            selected[i] = 1;
    if (b.quick) {
        if (!b.messages_set)
            b.messages = 30000;
        if (!b.claim_rows_set)
            b.claim_rows = 1000000;
    }
    if (find_build_dir(&b, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        return 1;
    }

    tmp = getenv("TMPDIR");
    snprintf(b.tmpdir, sizeof b.tmpdir, "%s/outbox-bench.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(b.tmpdir)) {
        fprintf(stderr, "%s: cannot create a temporary directory: %s\n", prog, strerror(errno));
        return 1;
    }
    snprintf(interrupted_tmpdir, sizeof interrupted_tmpdir, "%s", b.tmpdir);
    signal(SIGINT, on_interrupt);
    signal(SIGTERM, on_interrupt);
    signal(SIGPIPE, SIG_IGN);
    if (bench_env_start(&b, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        bench_env_stop(&b);
        if (!b.keep)
            nftw(b.tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        return 1;
    }
    if (!b.json_only)
        print_machine(&b);

    for (i = 0; i < NSCENARIOS; i++) {
        bench_report r;
        uint64_t t0;
        if (!selected[i])
            continue;
        memset(&r, 0, sizeof r);
        r.scenario = scenarios[i].name;
        snprintf(r.title, sizeof r.title, "%s", scenarios[i].help);
        bench_progress(&b, "scenario %s", r.scenario);
        t0 = bench_mono_us();
        r.load_before = bench_loadavg();
        if (bench_redis_flush(&b) != 0)
            bench_fail(&r, "cannot flush the private Redis");
        else if (scenarios[i].run(&b, &r) != 0 && !r.failed)
            bench_fail(&r, "failed");
        if (r.failed)
            failures++;
        r.seconds = (double)(bench_mono_us() - t0) / 1e6;
        r.load_after = bench_loadavg();
        print_report(&b, &r);
        outbox__sbuf_free(&r.json);
        outbox__sbuf_free(&r.notes);
        bench_redis_flush(&b);
    }

    bench_env_stop(&b);
    if (b.keep) {
        if (!b.json_only)
            printf("# kept %s\n", b.tmpdir);
    } else {
        nftw(b.tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    return failures ? 1 : 0;
}
