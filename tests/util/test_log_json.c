/*
 * test_log_json.c: --log-format json. The formatter (outbox__log_json_format)
 * turns logfmt fragments into JSON objects with the same fields, decoding
 * logfmt's quoting (quotes, backslashes, newlines, \xNN) and keeping raw
 * quotes, bytes that are not UTF-8 and lines too long for the buffer valid
 * JSON. Then the three tools run with --log-format json through paths that
 * log: the relay starting, failing to connect, failing to publish (a Redis
 * error with quotes, a message id with a quote and a backslash) and
 * stopping; outbox-consume connecting, failing to connect, a failing
 * command and stopping; outbox-replay's errors and warnings. Every line of
 * their stderr is parsed as JSON (tests/util/check_json_lines.py) and the lines
 * that must be there are looked for by their fields. An unknown format is
 * refused by each tool.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "util/util.h"
#include "outbox.h"
#include "tap.h"

static char *dir, *checker;

/* Runs the checker on file with the patterns (NULL-terminated). */
static void check_lines(const char *file, const char *what, ...)
{
    char *argv[32] = {"python3", checker, (char *)file};
    char *out = NULL, *err = NULL;
    int n = 3, code;
    va_list ap;
    va_start(ap, what);
    while (n < 31 && (argv[n] = va_arg(ap, char *)) != NULL)
        n++;
    va_end(ap);
    argv[n] = NULL;
    code = th_run(argv, NULL, &out, &err, 30000);
    ok(code == 0, "%s: every line is JSON with ts, level and msg, and the expected lines are there", what);
    if (code != 0) {
        th_diag_tail("checker", out, 40);
        th_diag_tail("checker", err, 10);
        th_diag_tail("log", th_slurp(file), 40);
    }
    free(out);
    free(err);
}

static void append(FILE *f, const char *fragment, size_t cap)
{
    char line[8192];
    size_t n = outbox__log_json_format(line, cap, "2026-12-01T10:00:00.123Z", OUTBOX_LOG_WARN, fragment);
    ok(n > 0 && n < cap && line[n - 1] == '\n' && strlen(line) == n, "a line of %zu bytes for a %zu-byte buffer", n,
       cap);
    fwrite(line, 1, n, f);
}

static void check_formatter(void)
{
    char *file = th_path(dir, "unit.log"), q[512], frag[1024], big[1024];
    FILE *f = fopen(file, "w");
    if (!f)
        bail("cannot write %s", file);
    /* What the relay logs for a publish failure (src/relay/marks.c). */
    outbox__logfmt_quote(q, sizeof q, "ERR bad \"value\"\nsecond line\\ \x01 end");
    snprintf(frag, sizeof frag, "msg=\"publish failed, will retry\" id=a-1 seq=3 attempts=2 error=%s", q);
    append(f, frag, 8192);
    /* Raw text between quotes, as a few messages write SQLite's errors. */
    append(f, "msg=\"database error, retrying\" during=claim error=\"near \"x\": syntax error\" retry_ms=100", 8192);
    /* Bare values with quotes, a flag, bytes that are not UTF-8. */
    append(f, "msg=started redis=unix:///tmp/a\"b.sock drained id=\xff\xfe ok=\xc3\xa9", 8192);
    /* A value cut by outbox__log's line limit: no closing quote. */
    append(f, "msg=\"cut in the mid", 8192);
    /* Too long for the buffer: cut, still one object. */
    memset(big, '"', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    memcpy(big, "msg=\"", 5);
    append(f, big, 200);
    append(f, "msg=x k1=v1 k2=v2 k3=v3 k4=v4 k5=v5 k6=v6 k7=v7 k8=v8", 128);
    fclose(f);
    check_lines(file, "the formatter",
                "{\"level\":\"warn\",\"msg\":\"publish failed, will retry\",\"id\":\"a-1\",\"seq\":\"3\","
                "\"attempts\":\"2\",\"error\":\"ERR bad \\\"value\\\"\\nsecond line\\\\ \\u0001 end\"}",
                "{\"msg\":\"database error, retrying\",\"during\":\"claim\",\"error\":\"near \\\"x\\\": syntax error\","
                "\"retry_ms\":\"100\"}",
                "{\"msg\":\"started\",\"redis\":\"unix:///tmp/a\\\"b.sock\",\"drained\":\"true\","
                "\"id\":\"\\ufffd\\ufffd\",\"ok\":\"\\u00e9\"}",
                "{\"msg\":\"cut in the mid\"}", "{\"msg\":\"~\\\"\\\"\\\"\"}", "{\"msg\":\"x\",\"k1\":\"v1\"}", NULL);
    free(file);
}

static int has(void *arg)
{
    const char **a = arg;
    char *text = th_slurp(a[0]);
    int found = strstr(text, a[1]) != NULL;
    free(text);
    return found;
}

/* Starts argv with stderr into errfile, waits until it holds needle, then
 * stops it with SIGTERM; returns the exit status. */
static int run_until(char *const argv[], const char *errfile, const char *needle, const char *what)
{
    const char *arg[] = {errfile, needle};
    pid_t pid = th_spawn(argv, NULL, "/dev/null", errfile);
    int seen, code;
    if (pid < 0)
        bail("cannot start %s", argv[0]);
    seen = th_wait_until(15000 * th_slow(), has, arg);
    ok(seen, "%s: logged %s", what, needle);
    code = th_stop(pid, SIGTERM, 15000 * th_slow());
    is_int(code, 0, "%s: stopped by SIGTERM, exit 0", what);
    return code;
}

static void check_relay(const th_redis *srv)
{
    char *relay = th_bin("tools/relay/outbox-relay"), *db = th_path(dir, "relay.db"),
         *log = th_path(dir, "relay.log"), *nosock, url[400], err[256];
    sqlite3 *h;
    outbox_writer *w;
    outbox_message m = {.id = "q\"uo\\te", .topic = "orders", .payload = "{}", .payload_len = 2};

    if (outbox_db_open(db, OUTBOX_OPEN_CREATE, &h, err, sizeof err) != 0 || outbox_schema_apply(h, err, sizeof err) ||
        outbox_writer_create(&w, h, NULL) != 0 || outbox_enqueue(w, &m, NULL) != 0)
        bail("database: %s", err);
    outbox_writer_destroy(w);
    sqlite3_close_v2(h);

    /* A user whose keys leave the topic's stream out: every publish fails
     * with Redis's error, message by message (an ACL refusing XADD itself
     * would hold publishing instead: README, "Running the daemon"). */
    snprintf(url, sizeof url, "redis://relay:pw@127.0.0.1:%d", srv->port);
    {
        char *argv[] = {relay, "--db", db, "--redis", url, "--log-format", "json", "--backoff-min-ms", "50",
                        "--backoff-max-ms", "100", NULL};
        run_until(argv, log, "publish failed", "relay, publish failing");
    }
    check_lines(log, "relay, publish failing", "{\"level\":\"info\",\"msg\":\"started\"}",
                "{\"msg\":\"connected to redis\",\"conn\":\"relay\"}",
                "{\"level\":\"warn\",\"msg\":\"publish failed, will retry\",\"id\":\"q\\\"uo\\\\te\","
                "\"error\":\"~NOPERM this user has no permissions to access one of the keys\"}",
                "{\"msg\":\"stopped\",\"published\":\"0\"}", NULL);

    nosock = th_path(dir, "no\"such.sock");
    snprintf(url, sizeof url, "unix://%s", nosock);
    remove(log);
    {
        char *argv[] = {relay, "--db", db, "--redis", url, "--log-format", "json", NULL};
        run_until(argv, log, "retrying", "relay, Redis unreachable");
    }
    check_lines(log, "relay, Redis unreachable",
                "{\"level\":\"warn\",\"msg\":\"redis unreachable, retrying with backoff\",\"err\":\"ECONNECT\"}",
                "{\"msg\":\"stopped\"}", NULL);

    /* The same through the environment and the INI file (one row of the
     * table gives all three). */
    remove(log);
    {
        char *missing = th_path(dir, "none/x.db");
        char *argv[] = {relay, "--db", missing, "--redis", url, NULL};
        char *env[] = {"OUTBOX_LOG_FORMAT=json", NULL};
        char *out = NULL, *errtext = NULL;
        int code = th_run(argv, env, &out, &errtext, 15000);
        FILE *f = fopen(log, "w");
        is_int(code, 2, "relay, OUTBOX_LOG_FORMAT=json and a database that cannot be opened: exit 2");
        if (f) {
            fputs(errtext, f);
            fclose(f);
        }
        check_lines(log, "relay, OUTBOX_LOG_FORMAT=json",
                    "{\"level\":\"error\",\"msg\":\"cannot create the relay\",\"error\":\"~x.db\"}", NULL);
        free(out);
        free(errtext);
        free(missing);
    }
    {
        char *ini = th_path(dir, "relay.ini"), *out = NULL, *errtext = NULL;
        char *argv[] = {relay, "--config", ini, NULL};
        FILE *f = fopen(ini, "w");
        int code;
        if (!f)
            bail("cannot write %s", ini);
        fprintf(f, "[relay]\nlog-format = json\ndb = %s/none/x.db\nredis = %s\n", dir, url);
        fclose(f);
        code = th_run(argv, NULL, &out, &errtext, 15000);
        is_int(code, 2, "relay, log-format = json in the INI file: exit 2");
        f = fopen(log, "w");
        if (f) {
            fputs(errtext, f);
            fclose(f);
        }
        check_lines(log, "relay, log-format = json in the INI file",
                    "{\"level\":\"error\",\"msg\":\"cannot create the relay\",\"err\":\"EIO\"}", NULL);
        free(out);
        free(errtext);
        free(ini);
    }
    free(nosock);
    free(log);
    free(db);
    free(relay);
}

static void check_consume(const th_redis *srv)
{
    char *consume = th_bin("tools/consume/outbox-consume"), *log = th_path(dir, "consume.log"), url[400];
    redisContext *c = th_redis_client(srv);
    outbox_envelope e = {OUTBOX_ENVELOPE_VERSION, "m\"1", "orders", NULL, 0, "{}", 2, NULL, 0, 1, NULL};
    char env[256];
    size_t len;
    if (outbox_envelope_encode(&e, env, sizeof env, &len) != 0)
        bail("encode");
    freeReplyObject(th_cmd(c, "XADD plain * id %s envelope %b", e.id, env, len));
    freeReplyObject(th_cmd(c, "XADD plain * id m2 envelope junk"));
    redisFree(c);
    {
        char *argv[] = {consume, "--redis", (char *)srv->url, "--stream", "plain", "--group", "g", "--exec",
                        "exit 3", "--log-format", "json", NULL};
        run_until(argv, log, "command failed", "outbox-consume, a failing command");
    }
    check_lines(log, "outbox-consume", "{\"level\":\"info\",\"msg\":\"consumer started\",\"stream\":\"plain\"}",
                "{\"level\":\"warn\",\"msg\":\"command failed; message left pending for retry\",\"id\":\"m\\\"1\","
                "\"exit\":\"3\"}",
                "{\"level\":\"warn\",\"msg\":\"undecodable envelope\"}", "{\"msg\":\"consumer stopped\"}", NULL);
    snprintf(url, sizeof url, "unix://%s/none.sock", dir);
    remove(log);
    {
        char *argv[] = {consume, "--redis", url, "--stream", "plain", "--group", "g", "--print", "--log-format",
                        "json", NULL};
        run_until(argv, log, "retrying", "outbox-consume, Redis unreachable");
    }
    check_lines(log, "outbox-consume, Redis unreachable", "{\"level\":\"warn\",\"err\":\"ECONNECT\"}", NULL);
    free(log);
    free(consume);
}

static void check_replay(void)
{
    char *replay = th_bin("tools/replay/outbox-replay"), *db = th_path(dir, "relay.db"),
         *log = th_path(dir, "replay.log"), *out = NULL, *err = NULL;
    FILE *f = fopen(log, "w");
    int code;
    if (!f)
        bail("cannot write %s", log);
    {
        char *argv[] = {replay, "requeue", "--db", db, "--id", "nosuch", "--reason", "test", "--log-format", "json",
                        NULL};
        code = th_run(argv, NULL, &out, &err, 15000);
        is_int(code, 1, "outbox-replay requeue of an unknown id: exit 1");
        fputs(err, f);
        free(out);
        free(err);
    }
    {
        char *argv[] = {replay, "stats", "--log-format", "json", "--db", "/nonexistent/x.db", NULL};
        code = th_run(argv, NULL, &out, &err, 15000);
        is_int(code, 2, "outbox-replay stats on a missing database: exit 2");
        fputs(err, f);
        free(out);
        free(err);
    }
    fclose(f);
    check_lines(log, "outbox-replay", "{\"level\":\"warn\",\"msg\":\"no message with id nosuch\"}",
                "{\"level\":\"error\",\"msg\":\"~nothing matches\"}",
                "{\"level\":\"error\",\"msg\":\"~/nonexistent/x.db\"}", NULL);
    free(log);
    free(db);
    free(replay);
}

/* An unknown format is a usage error in each tool, naming its source. */
static void check_refused(void)
{
    char *relay = th_bin("tools/relay/outbox-relay"), *consume = th_bin("tools/consume/outbox-consume"),
         *replay = th_bin("tools/replay/outbox-replay");
    char *relay_argv[] = {relay, "--db", "x.db", "--redis", "unix:///x.sock", NULL};
    char *consume_argv[] = {consume, "--log-format", "xml", "--redis", "unix:///x.sock", "--stream", "s", "--group",
                            "g", "--print", NULL};
    char *replay_argv[] = {replay, "stats", "--db", "x.db", "--log-format", "xml", NULL};
    char *env[] = {"OUTBOX_LOG_FORMAT=xml", NULL};
    struct {
        char **argv, **env;
        const char *want;
    } cases[] = {
        {relay_argv, env, "outbox-relay: environment variable OUTBOX_LOG_FORMAT: unknown log format 'xml' (logfmt, "
                          "json)"},
        {consume_argv, NULL, "outbox-consume: --log-format: unknown log format 'xml' (logfmt, json)"},
        {replay_argv, NULL, "outbox-replay: --log-format: unknown log format 'xml' (logfmt, json)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL, *err = NULL;
        int code = th_run(cases[i].argv, cases[i].env, &out, &err, 15000);
        ok(code == 2 && strstr(err, cases[i].want), "%s: exit 2 and '%s' (exit %d: %s)", cases[i].argv[0],
           cases[i].want, code, err);
        free(out);
        free(err);
    }
    free(relay);
    free(consume);
    free(replay);
}

int main(void)
{
    th_redis srv;
    char *src = getenv("OUTBOX_SOURCE_DIR");
    if (!src)
        bail("OUTBOX_SOURCE_DIR is not set");
    dir = th_tmpdir();
    checker = th_path(src, "tests/util/check_json_lines.py");
    check_formatter();
    if (th_redis_start(&srv, 1, "user default on nopass ~* &* +@all\nuser relay on >pw ~elsewhere:* &* +@all\n") != 0)
        skip_all("redis-server not available");
    check_relay(&srv);
    check_consume(&srv);
    check_replay();
    check_refused();
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    free(checker);
    return tap_done();
}
