/* The outbox-relay command line: --help, --version, init, and every usage
 * error of run (exit 2 with the offending option named). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

static char *relay, *dir;

typedef struct res {
    int code;
    char *out, *err;
} res;

static res run(char *const *argv, char *const *env)
{
    res r;
    r.code = th_run(argv, env, &r.out, &r.err, 20000);
    return r;
}

static void res_free(res *r)
{
    free(r->out);
    free(r->err);
}

#define RUN(...)                                                                                   \
    ({                                                                                             \
        char *argv_[] = {relay, __VA_ARGS__, NULL};                                                \
        run(argv_, NULL);                                                                          \
    })

static void expect_usage(res r, const char *needle, const char *what)
{
    is_int(r.code, 2, "%s: exit 2", what);
    ok(r.err && strstr(r.err, needle) != NULL, "%s: stderr names it (%s)", what, r.err ? r.err : "");
}

static void test_help_version(void)
{
    res r = RUN("--help");
    const char *must[] = {"--db", "--redis", "--batch", "--inflight", "--lease-ms", "--scan-interval-ms",
                          "--max-attempts", "--backoff-min-ms", "--backoff-max-ms", "--stream-prefix", "--maxlen",
                          "--worker-id", "--shutdown-timeout-ms", "--wait-replicas", "--wait-timeout-ms",
                          "--log-level", "--drain", "--config", "OUTBOX_"};
    int all = 1;
    is_int(r.code, 0, "--help exits 0");
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (!strstr(r.out, must[i])) {
            diag("--help lacks %s", must[i]);
            all = 0;
        }
    ok(all, "--help documents every option");
    ok(strstr(r.out, "default") != NULL, "--help states defaults");
    res_free(&r);
    r = RUN("--version");
    is_int(r.code, 0, "--version exits 0");
    ok(strstr(r.out, OUTBOX_VERSION_STRING) != NULL, "--version prints %s", OUTBOX_VERSION_STRING);
    res_free(&r);
    r = RUN("frobnicate");
    expect_usage(r, "unknown command 'frobnicate'", "unknown command");
    res_free(&r);
    {
        char *argv[] = {relay, NULL};
        r = run(argv, NULL);
        is_int(r.code, 2, "no arguments: exit 2 with usage");
        res_free(&r);
    }
}

static void test_init(void)
{
    char *db = th_path(dir, "init.db"), *txt = th_path(dir, "text.db"), *foreign = th_path(dir, "foreign.db"),
         *newer = th_path(dir, "newer.db"), *missing_dir = th_path(dir, "no/such/dir/x.db");
    res r;
    sqlite3 *h;
    FILE *f;

    r = RUN("init", "--db", db);
    is_int(r.code, 0, "init creates a database");
    {
        char want[40];
        snprintf(want, sizeof want, "version %d", OUTBOX_SCHEMA_VERSION);
        ok(strstr(r.out, want) != NULL, "and says so: %s", r.out);
    }
    res_free(&r);
    r = RUN("init", "--db", db);
    is_int(r.code, 0, "init again: idempotent");
    res_free(&r);

    /* The sqlite3 command-line client can write messages into it. */
    if (access("/usr/bin/sqlite3", X_OK) == 0) {
        char *argv[] = {"/usr/bin/sqlite3", db,
                        "INSERT INTO outbox(id, topic, payload) VALUES ('cli-1', 'orders', 'hello');", NULL};
        r = run(argv, NULL);
        is_int(r.code, 0, "sqlite3 CLI: plain INSERT accepted (%s)", r.err);
        res_free(&r);
    } else {
        skip("no sqlite3 command-line client");
    }
    sqlite3_open(db, &h);
    {
        sqlite3_stmt *st;
        sqlite3_prepare_v2(h, "SELECT count(*) FROM outbox_messages WHERE state = 0", -1, &st, NULL);
        sqlite3_step(st);
        ok(sqlite3_column_int(st, 0) >= 0, "outbox table readable");
        sqlite3_finalize(st);
    }
    sqlite3_close(h);

    r = RUN("init", "--db", missing_dir);
    expect_usage(r, "No such file", "init in a missing directory");
    res_free(&r);
    r = RUN("init", "--db", dir);
    expect_usage(r, "directory", "init on a directory");
    res_free(&r);
    f = fopen(txt, "w");
    fputs("this is a text file, not a database; it is long enough to have a header\n", f);
    fclose(f);
    r = RUN("init", "--db", txt);
    expect_usage(r, "not a usable SQLite database", "init on a text file");
    res_free(&r);
    sqlite3_open(foreign, &h);
    sqlite3_exec(h, "CREATE TABLE outbox(id INTEGER PRIMARY KEY, body TEXT)", NULL, NULL, NULL);
    sqlite3_close(h);
    r = RUN("init", "--db", foreign);
    expect_usage(r, "not an outbox table", "init on a foreign outbox table");
    ok(strstr(r.err, "EFOREIGN") != NULL, "error code named");
    res_free(&r);
    sqlite3_open(newer, &h);
    {
        char sql[64];
        snprintf(sql, sizeof sql, "PRAGMA user_version=%d", OUTBOX_SCHEMA_VERSION + 1);
        sqlite3_exec(h, sql, NULL, NULL, NULL);
    }
    sqlite3_close(h);
    r = RUN("init", "--db", newer);
    expect_usage(r, "newer", "init on a newer schema");
    res_free(&r);
    r = RUN("init");
    expect_usage(r, "--db PATH is required", "init without --db");
    res_free(&r);
    r = RUN("init", "--db");
    expect_usage(r, "--db needs a value", "init --db without a value");
    res_free(&r);
    r = RUN("init", "--db", db, "--bogus");
    expect_usage(r, "unexpected argument '--bogus'", "init with an unknown option");
    res_free(&r);
    free(db);
    free(txt);
    free(foreign);
    free(newer);
    free(missing_dir);
}

static void test_run_usage(void)
{
    char *db = th_path(dir, "run.db"), *empty = th_path(dir, "empty.db"), *cfg = th_path(dir, "relay.ini");
    char *url = "unix:///nonexistent/redis.sock";
    res r;
    FILE *f;

    r = RUN("init", "--db", db);
    res_free(&r);
    r = RUN("--db", db);
    expect_usage(r, "--redis URL is required", "missing --redis");
    res_free(&r);
    r = RUN("--redis", url);
    expect_usage(r, "--db PATH is required", "missing --db");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--bogus", "1");
    expect_usage(r, "unknown option '--bogus'", "unknown option");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--batch");
    expect_usage(r, "--batch needs a value", "missing value");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--batch", "abc");
    expect_usage(r, "--batch: 'abc' is not a non-negative whole number", "non-numeric value");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--batch", "-5");
    expect_usage(r, "--batch", "negative value");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--batch", "0");
    expect_usage(r, "--batch: 0 is out of range 1..100000", "out of range");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--lease-ms", "99999999999999999999999");
    expect_usage(r, "--lease-ms", "overflowing number");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--log-level", "loud");
    expect_usage(r, "unknown log level 'loud'", "bad log level");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--backoff-min-ms", "5000", "--backoff-max-ms", "100");
    expect_usage(r, "backoff-min-ms", "min above max");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--lease-ms", "2000", "--reply-timeout-ms", "5000");
    expect_usage(r, "lease-ms", "reply timeout not below the lease");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--stream-prefix", "a{b}");
    expect_usage(r, "stream-prefix", "prefix with braces");
    res_free(&r);
    r = RUN("--db", db, "--redis", "http://localhost:6379");
    expect_usage(r, "http", "bad URL scheme");
    res_free(&r);
    r = RUN("--db", db, "--redis", "redis://localhost:99999");
    expect_usage(r, "99999", "bad port");
    res_free(&r);
    r = RUN("--db", db, "--redis", "redis://localhost:6379/x");
    expect_usage(r, "redis:", "bad database number");
    res_free(&r);
    r = RUN("--db", empty, "--redis", url);
    expect_usage(r, "No such file", "missing database file");
    ok(access(empty, F_OK) != 0, "run never creates a database");
    res_free(&r);
    {
        sqlite3 *h;
        sqlite3_open(empty, &h);
        sqlite3_exec(h, "CREATE TABLE t(x)", NULL, NULL, NULL);
        sqlite3_close(h);
    }
    r = RUN("--db", empty, "--redis", url);
    expect_usage(r, "outbox-relay init", "database without the schema");
    res_free(&r);

    /* Environment and config file. */
    {
        char *argv[] = {relay, "--db", db, "--redis", url, NULL};
        char *env[] = {"OUTBOX_BATCH=zero", NULL};
        r = run(argv, env);
        expect_usage(r, "environment variable OUTBOX_BATCH", "bad environment value");
        res_free(&r);
    }
    f = fopen(cfg, "w");
    fputs("[relay]\nbatch = 64\nbach = 3\n", f);
    fclose(f);
    r = RUN("--db", db, "--redis", url, "--config", cfg);
    expect_usage(r, "unknown key 'bach'", "unknown config key");
    res_free(&r);
    f = fopen(cfg, "w");
    fputs("[relay]\nlease-ms = soon\n", f);
    fclose(f);
    r = RUN("--db", db, "--redis", url, "--config", cfg);
    expect_usage(r, "lease-ms: 'soon'", "bad config value");
    res_free(&r);
    f = fopen(cfg, "w");
    fputs("[other]\nbatch = 5\n", f);
    fclose(f);
    r = RUN("--db", db, "--redis", url, "--config", cfg);
    expect_usage(r, "unknown section [other]", "unknown config section");
    res_free(&r);
    f = fopen(cfg, "w");
    fputs("this line is not ini\n", f);
    fclose(f);
    r = RUN("--db", db, "--redis", url, "--config", cfg);
    expect_usage(r, "line 1", "malformed config line");
    res_free(&r);
    r = RUN("--db", db, "--redis", url, "--config", "/nonexistent/relay.ini");
    expect_usage(r, "cannot open '/nonexistent/relay.ini'", "missing config file");
    res_free(&r);
    free(db);
    free(empty);
    free(cfg);
}

/* Starts the daemon with a Redis nobody listens on: it must get as far as
 * "started" (it then keeps reconnecting) and stop on SIGTERM with exit 0. */
static void expect_starts(const char *db, const char *what, char *extra[])
{
    char *log = th_path(dir, "starts.log"), *argv[16], *text = NULL;
    int n = 0, st, started = 0;
    int64_t deadline;
    pid_t pid;
    argv[n++] = relay;
    argv[n++] = "--db";
    argv[n++] = (char *)db;
    argv[n++] = "--redis";
    argv[n++] = "unix:///nonexistent/redis.sock";
    for (int i = 0; extra[i] && n < 15; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    unlink(log);
    pid = th_spawn(argv, NULL, NULL, log);
    if (pid < 0)
        bail("cannot start %s", relay);
    deadline = th_now_ms() + 10000 * th_slow();
    while (!started && th_now_ms() < deadline) {
        th_sleep_ms(20);
        free(text);
        text = th_slurp(log);
        started = text && strstr(text, "msg=started") != NULL;
        if (!started && th_wait(pid, 0) != -2) {
            pid = -1; /* it exited */
            break;
        }
    }
    ok(started, "%s: the relay starts", what);
    if (!started)
        th_diag_tail(what, text ? text : "", 5);
    if (pid > 0) {
        kill(pid, SIGTERM);
        st = th_wait(pid, 10000 * th_slow());
        if (st == -2) {
            kill(pid, SIGKILL);
            th_wait(pid, -1);
        }
        is_int(st, 0, "%s: and stops on SIGTERM with exit 0", what);
    }
    free(text);
    free(log);
}

/* Defaults that follow --lease-ms: the reply timeout (lease-ms/3, at most
 * 10000) and the WAIT timeout (lease-ms/4, at most 1000). A short lease
 * alone is accepted; only timeouts given explicitly that contradict the
 * lease are refused, naming both options. */
static void test_derived_timeouts(void)
{
    char *db = th_path(dir, "derived.db");
    res r;

    r = RUN("init", "--db", db);
    res_free(&r);
    expect_starts(db, "--lease-ms 3000 alone", (char *[]){"--lease-ms", "3000", NULL});
    expect_starts(db, "--lease-ms 1000 alone", (char *[]){"--lease-ms", "1000", NULL});
    expect_starts(db, "--lease-ms 1500 --wait-replicas 1",
                  (char *[]){"--lease-ms", "1500", "--wait-replicas", "1", NULL});
    expect_starts(db, "--lease-ms 3000 --reply-timeout-ms 2000",
                  (char *[]){"--lease-ms", "3000", "--reply-timeout-ms", "2000", NULL});

    r = RUN("--db", db, "--redis", "unix:///nonexistent/redis.sock", "--lease-ms", "3000", "--reply-timeout-ms",
            "5000");
    expect_usage(r, "reply-timeout-ms 5000", "--lease-ms 3000 --reply-timeout-ms 5000");
    ok(r.err && strstr(r.err, "lease-ms 3000"), "and the message names --lease-ms too");
    res_free(&r);
    r = RUN("--db", db, "--redis", "unix:///nonexistent/redis.sock", "--reply-timeout-ms", "40000");
    expect_usage(r, "reply-timeout-ms 40000", "--reply-timeout-ms 40000 with the default lease");
    ok(r.err && strstr(r.err, "lease-ms 30000"), "and the message names lease-ms");
    res_free(&r);
    r = RUN("--db", db, "--redis", "unix:///nonexistent/redis.sock", "--lease-ms", "3000", "--wait-replicas", "1",
            "--reply-timeout-ms", "2000", "--wait-timeout-ms", "1000");
    expect_usage(r, "reply-timeout-ms 2000 plus wait-timeout-ms 1000", "reply plus WAIT timeout not below the lease");
    ok(r.err && strstr(r.err, "lease-ms 3000"), "and the message names lease-ms");
    res_free(&r);
    r = RUN("--db", db, "--redis", "unix:///nonexistent/redis.sock", "--lease-ms", "1500", "--wait-replicas", "1",
            "--wait-timeout-ms", "1000");
    expect_usage(r, "wait-timeout-ms 1000", "--lease-ms 1500 --wait-timeout-ms 1000");
    ok(r.err && strstr(r.err, "lease-ms 1500"), "and the message names lease-ms");
    res_free(&r);
    free(db);
}

/* --sentinel-user / --sentinel-password: options like every other (flag,
 * environment, config key), refused with a URL that is not a Sentinel one. */
static void test_sentinel_options(void)
{
    char *db = th_path(dir, "sentinel.db"), *cfg = th_path(dir, "sentinel.ini");
    char *env[] = {"OUTBOX_SENTINEL_PASSWORD=secret", NULL};
    char *argv_env[] = {relay, "--db", db, "--redis", "redis://127.0.0.1:1", NULL};
    res r;
    FILE *f;

    r = RUN("init", "--db", db);
    res_free(&r);
    r = RUN("--db", db, "--redis", "redis://127.0.0.1:1", "--sentinel-password", "secret");
    expect_usage(r, "sentinel_password needs a redis-sentinel:// URL", "--sentinel-password with redis://");
    res_free(&r);
    r = run(argv_env, env);
    expect_usage(r, "sentinel_password needs a redis-sentinel:// URL", "OUTBOX_SENTINEL_PASSWORD with redis://");
    res_free(&r);
    f = fopen(cfg, "w");
    if (!f)
        bail("cannot write %s", cfg);
    fprintf(f, "db = %s\nredis = unix:///nonexistent.sock\nsentinel-user = watcher\n", db);
    fclose(f);
    r = RUN("--config", cfg);
    expect_usage(r, "sentinel_user needs a redis-sentinel:// URL", "sentinel-user key with unix://");
    res_free(&r);
    r = RUN("--db", db, "--redis", "redis://127.0.0.1:1", "--sentinel-user", "");
    expect_usage(r, "sentinel-user", "empty --sentinel-user");
    res_free(&r);
    /* With a Sentinel URL they are taken: no sentinel answers, the drain
     * gives up after its timeout (exit 1), not a usage error. */
    r = RUN("--db", db, "--redis", "redis-sentinel://127.0.0.1:1#mymaster", "--sentinel-user", "watcher",
            "--sentinel-password", "secret", "--drain", "--drain-timeout-ms", "300");
    is_int(r.code, 1, "a Sentinel URL with --sentinel-user and --sentinel-password: accepted (drain times out: %s)",
           r.err ? r.err : "");
    res_free(&r);
    free(db);
    free(cfg);
}

int main(void)
{
    relay = th_bin("tools/relay/outbox-relay");
    dir = th_tmpdir();
    test_help_version();
    test_init();
    test_run_usage();
    test_derived_timeouts();
    test_sentinel_options();
    th_rmtree(dir);
    free(dir);
    free(relay);
    return tap_done();
}
