/*
 * test_consume_cli.c: the outbox-consume command line. --help and
 * --version; every usage error exits 2 naming the problem; --print writes
 * JSON lines that parse (text payloads as UTF-8, binary ones as base64 with
 * payload_encoding "base64", headers as an object); --exec runs the command
 * with the payload on stdin and the envelope in OUTBOX_* variables (stale
 * OUTBOX_* variables of the caller are not passed on); messages that name
 * their database hand it on (the JSON line's db, OUTBOX_DB) and the same id
 * from two databases is two messages; SIGTERM stops it cleanly.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

static th_redis srv;
static redisContext *rc;
static char *dir;

typedef struct res {
    int code;
    char *out, *err;
} res;

static res run_args(const char *const *args, char *const *env)
{
    res r;
    r.code = ct_consume_run(args, env, &r.out, &r.err, 20000 * th_slow());
    return r;
}

#define RUN(...)                                                                                   \
    ({                                                                                             \
        const char *args_[] = {__VA_ARGS__, NULL};                                                 \
        run_args(args_, NULL);                                                                     \
    })

static void res_free(res *r)
{
    free(r->out);
    free(r->err);
}

static void expect_usage(res r, const char *needle, const char *what)
{
    is_int(r.code, 2, "%s: exit 2", what);
    ok(r.err && strstr(r.err, needle) != NULL, "%s: stderr names it (%.*s)", what,
       r.err ? (int)strcspn(r.err, "\n") : 0, r.err ? r.err : "");
    res_free(&r);
}

static void test_help(void)
{
    res r = RUN("--help");
    const char *must[] = {"--redis",          "--stream",        "--group",         "--consumer",
                          "--print",          "--exec",          "--exec-timeout-ms", "--dedup",
                          "--namespace",      "--dedup-lease-ms", "--dedup-retention-ms", "--batch",
                          "--max-inflight",   "--block-ms",      "--min-idle-ms",   "--claim-interval-ms",
                          "--max-deliveries", "--retry-ms",      "--drain",         "--log-level",
                          "OUTBOX_ID",        "OUTBOX_TOPIC",    "OUTBOX_DELIVERIES", "payload_encoding",
                          ":dead",            "OUTBOX_DB"};
    int all = 1;
    is_int(r.code, 0, "--help exits 0");
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (!strstr(r.out, must[i])) {
            diag("--help lacks %s", must[i]);
            all = 0;
        }
    ok(all, "--help documents every option, the variables and the JSON encoding");
    ok(strstr(r.out, "default") != NULL, "--help states defaults");
    res_free(&r);
    r = RUN("-h");
    is_int(r.code, 0, "-h exits 0");
    res_free(&r);
    r = RUN("--version");
    is_int(r.code, 0, "--version exits 0");
    ok(strstr(r.out, OUTBOX_VERSION_STRING) != NULL, "--version prints %s", OUTBOX_VERSION_STRING);
    res_free(&r);
}

static void test_usage_errors(void)
{
    const char *u = srv.url;
    {
        const char *none[] = {NULL};
        res r = run_args(none, NULL);
        expect_usage(r, "required", "no arguments");
    }
    expect_usage(RUN("--stream", "s", "--group", "g", "--print"), "--redis", "missing --redis");
    expect_usage(RUN("--redis", u, "--group", "g", "--print"), "--stream", "missing --stream");
    expect_usage(RUN("--redis", u, "--stream", "s", "--print"), "--group", "missing --group");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g"), "exactly one of --print and --exec",
                 "neither --print nor --exec");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--exec", "true"),
                 "exactly one of --print and --exec", "both --print and --exec");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--frobnicate"),
                 "unknown option '--frobnicate'", "unknown option");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--batch", "ten"),
                 "--batch: 'ten' is not a non-negative whole number", "bad number");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--batch", "0"),
                 "--batch: 0 is out of range", "number out of range");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--min-idle-ms", "-5"),
                 "--min-idle-ms", "negative number");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--retry-ms", "12abc"),
                 "--retry-ms: '12abc'", "number with trailing garbage");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--max-deliveries",
                     "99999999999999999999999"),
                 "--max-deliveries", "number too large");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--block-ms"), "--block-ms needs a value",
                 "option without its value");
    expect_usage(RUN("--redis", "http://localhost", "--stream", "s", "--group", "g", "--print"), "scheme",
                 "bad URL scheme");
    expect_usage(RUN("--redis", "redis://localhost:99999", "--stream", "s", "--group", "g", "--print"), "port",
                 "bad URL port");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--dedup", "sql"),
                 "--dedup: unknown mode 'sql'", "unknown dedup mode");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--log-level", "loud"),
                 "--log-level", "unknown log level");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "g", "--print", "--namespace", "a{b}"),
                 "namespace", "namespace with braces");
    expect_usage(RUN("--redis", u, "--stream", "s", "--group", "my group", "--print"), "namespace",
                 "a group that makes an invalid default namespace");
    is_int(th_xlen(rc, "s"), 0, "usage errors touched nothing in Redis");
    {
        /* The longest group allowed works with its default namespace. */
        char group[201];
        memset(group, 'g', 200);
        group[200] = '\0';
        res r = RUN("--redis", u, "--stream", "outbox:long", "--group", group, "--print", "--drain");
        is_int(r.code, 0, "a 200-byte group name with the default namespace works");
        if (r.code != 0)
            th_diag_tail("consume", r.err, INT_MAX);
        res_free(&r);
    }
}

/* A headers map {"trace": "abc"} in msgpack. */
static const unsigned char headers_mp[] = {0x81, 0xa5, 't', 'r', 'a', 'c', 'e', 0xa3, 'a', 'b', 'c'};
static const unsigned char binary[] = {0xff, 0x00, 0x80, 'b', 'i', 'n', 0x00, 0xc3};
static const char text[] = "{\"q\":\"a \\\"quoted\\\" line\\nnext\",\"u\":\"\xc3\xa9t\xc3\xa9 \xe2\x82\xac\"}\t\x01";

static void add_with_headers(const char *stream, char *eid)
{
    outbox_envelope e;
    char buf[512];
    size_t len;
    redisReply *r;
    memset(&e, 0, sizeof e);
    e.version = OUTBOX_ENVELOPE_VERSION;
    e.id = "m-hdr";
    e.topic = "cli";
    e.key = "customer-7";
    e.payload = "h";
    e.payload_len = 1;
    e.headers = headers_mp;
    e.headers_len = sizeof headers_mp;
    e.created_at = 1700000000123;
    if (outbox_envelope_encode(&e, buf, sizeof buf, &len) != 0)
        bail("encode");
    r = th_cmd(rc, "XADD %s * id m-hdr envelope %b", stream, buf, len);
    if (r->type != REDIS_REPLY_STRING)
        bail("XADD");
    snprintf(eid, 48, "%s", r->str);
    freeReplyObject(r);
}

/* Writes out to path and runs the Python script on it (argv[1]); returns
 * its exit status, its stdout and stderr in *pyout and *pyerr. */
static int python_over(const char *out, const char *path, const char *script, char **pyout, char **pyerr)
{
    FILE *f = fopen(path, "w");
    char *py[] = {"python3", "-c", (char *)script, (char *)path, NULL};
    if (!f)
        bail("write %s", path);
    fputs(out, f);
    fclose(f);
    return th_run(py, NULL, pyout, pyerr, 20000);
}

static void test_print(void)
{
    const char *stream = "outbox:cli";
    char eid_bin[48], eid_hdr[48], *jsonf = th_path(dir, "out.jsonl"), *pyout = NULL, *pyerr = NULL;
    res r;
    int st;

    ct_xadd_msg(rc, stream, "m-text", "cli", text, strlen(text), NULL);
    ct_xadd_msg(rc, stream, "m-bin", "cli", binary, sizeof binary, eid_bin);
    add_with_headers(stream, eid_hdr);
    ct_xadd_msg(rc, stream, "m-b1", "cli", "\xfe", 1, NULL);
    ct_xadd_msg(rc, stream, "m-b3", "cli", "\xff\xfe\xfd", 3, NULL);
    ct_xadd_msg(rc, stream, "m-empty", "cli", "", 0, NULL);
    r = RUN("--redis", srv.url, "--stream", stream, "--group", "p", "--print", "--drain");
    is_int(r.code, 0, "--print --drain exits 0");
    is_int(th_count_lines(r.out), 6, "six JSON lines");
    /* One line of facts per message, decoded by python's json module. */
    st = python_over(r.out, jsonf,
                     "import json,sys,base64\n"
                     "for l in open(sys.argv[1]):\n"
                     "    d=json.loads(l)\n"
                     "    p=d['payload']\n"
                     "    b=base64.b64decode(p) if d['payload_encoding']=='base64' else p.encode('utf-8')\n"
                     "    print(d['id'],d['topic'],d['key'],d['payload_encoding'],b.hex(),json.dumps(d['headers']),"
                     "d['created_at'],d['stream'],d['entry_id'],d['deliveries'])\n",
                     &pyout, &pyerr);
    is_int(st, 0, "every line parses as JSON (python3 json.loads)");
    if (st != 0)
        th_diag_tail("python", pyerr, INT_MAX);
    {
        char want[1024], hex[512] = "";
        for (size_t i = 0; i < strlen(text); i++)
            snprintf(hex + 2 * i, 3, "%02x", (unsigned char)text[i]);
        snprintf(want, sizeof want, "m-text cli None utf-8 %s null ", hex);
        ok(strstr(pyout, want) != NULL, "text payload: UTF-8 string, exact bytes, key null, headers null");
        snprintf(want, sizeof want, "m-bin cli None base64 ff008062696e00c3 null ");
        ok(strstr(pyout, want) != NULL, "binary payload: base64 with payload_encoding \"base64\", exact bytes");
        snprintf(want, sizeof want, "outbox:cli %s 1\n", eid_bin);
        ok(strstr(pyout, want) != NULL, "stream, entry_id and deliveries given");
        snprintf(want, sizeof want, "m-hdr cli customer-7 utf-8 68 {\"trace\": \"abc\"} 1700000000123 outbox:cli %s 1",
                 eid_hdr);
        ok(strstr(pyout, want) != NULL, "key, headers as an object, created_at");
        if (!strstr(pyout, want))
            th_diag_tail("python", pyout, INT_MAX);
        ok(strstr(pyout, "m-b1 cli None base64 fe null") && strstr(pyout, "m-b3 cli None base64 fffefd null"),
           "base64 padding right for 1 and 3 bytes");
        ok(strstr(pyout, "m-empty cli None utf-8  null") != NULL, "an empty payload is an empty string");
    }
    is_int(ct_pending(rc, stream, "p"), 0, "all acknowledged");
    res_free(&r);
    free(pyout);
    free(pyerr);
    free(jsonf);
}

static void test_exec(void)
{
    const char *stream = "outbox:cliexec";
    char eid_hdr[48], envdir[600], stale[] = "OUTBOX_KEY=stale", *t, *p;
    char *env[] = {envdir, stale, NULL};
    const char *args[] = {"--redis", srv.url, "--stream", stream, "--group", "x", "--exec",
                          "cat > \"$CT_DIR/$OUTBOX_ID.payload\" && env | grep '^OUTBOX_' | sort > \"$CT_DIR/$OUTBOX_ID.env\"",
                          "--drain", NULL};
    res r;
    size_t want_len;

    snprintf(envdir, sizeof envdir, "CT_DIR=%s", dir);
    ct_xadd_msg(rc, stream, "m-bin", "cliexec", binary, sizeof binary, NULL);
    add_with_headers(stream, eid_hdr);
    ct_xadd_msg(rc, stream, "m-empty", "cliexec", "", 0, NULL);
    r = run_args(args, env);
    is_int(r.code, 0, "--exec --drain exits 0");
    p = th_path(dir, "m-bin.payload");
    t = th_slurp(p);
    want_len = sizeof binary;
    {
        FILE *f = fopen(p, "rb");
        char buf[64];
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f)
            fclose(f);
        ok(n == want_len && memcmp(buf, binary, n) == 0, "the command got the binary payload on stdin (%zu bytes)",
           n);
    }
    free(t);
    free(p);
    p = th_path(dir, "m-hdr.env");
    t = th_slurp(p);
    {
        char want[200];
        const char *lines[] = {"OUTBOX_ID=m-hdr", "OUTBOX_TOPIC=cli", "OUTBOX_KEY=customer-7",
                               "OUTBOX_STREAM=outbox:cliexec", "OUTBOX_CREATED_AT=1700000000123",
                               "OUTBOX_DELIVERIES=1", "OUTBOX_HEADERS={\"trace\":\"abc\"}"};
        for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
            is_int(ct_line_count(t, lines[i]), 1, "the command's environment has %s", lines[i]);
        snprintf(want, sizeof want, "OUTBOX_ENTRY_ID=%s", eid_hdr);
        is_int(ct_line_count(t, want), 1, "the command's environment has %s", want);
        ok(!strstr(t, "stale") && !strstr(t, "OUTBOX_BUILD_DIR"), "the caller's own OUTBOX_* variables are not passed on");
    }
    free(t);
    free(p);
    p = th_path(dir, "m-bin.env");
    t = th_slurp(p);
    is_int(ct_line_count(t, "OUTBOX_KEY="), 1, "a message without key: OUTBOX_KEY empty");
    is_int(ct_line_count(t, "OUTBOX_HEADERS=null"), 1, "a message without headers: OUTBOX_HEADERS=null");
    free(t);
    free(p);
    p = th_path(dir, "m-empty.payload");
    t = th_slurp(p);
    ok(access(p, F_OK) == 0 && t[0] == '\0', "an empty payload: the command ran with empty stdin");
    free(t);
    free(p);
    is_int(ct_pending(rc, stream, "x"), 0, "all three acknowledged");
    res_free(&r);
}

/* The same id m-1 from two databases and from a relay that names none,
 * tenant-a's appended twice. */
static void add_db_entries(const char *stream)
{
    ct_xadd_db_msg(rc, stream, "tenant-a", "tenant-a", "m-1", "clidb", "a", 1, NULL);
    ct_xadd_db_msg(rc, stream, "tenant-b", "tenant-b", "m-1", "clidb", "b", 1, NULL);
    ct_xadd_msg(rc, stream, "m-1", "clidb", "-", 1, NULL);
    ct_xadd_db_msg(rc, stream, "tenant-a", "tenant-a", "m-1", "clidb", "a", 1, NULL);
}

static void test_db(void)
{
    const char *stream = "outbox:clidb", *xstream = "outbox:clidbexec";
    char *jsonf = th_path(dir, "db.jsonl"), *pyout = NULL, *pyerr = NULL, envdir[600], *t, *p;
    char *env[] = {envdir, NULL};
    const char *args[] = {"--redis", srv.url, "--stream", xstream, "--group", "x", "--exec",
                          "env | grep '^OUTBOX_' | sort > \"$CT_DIR/db-${OUTBOX_DB:-none}-$OUTBOX_ID.env\"",
                          "--drain", NULL};
    res r;
    int st;

    add_db_entries(stream);
    r = RUN("--redis", srv.url, "--stream", stream, "--group", "p", "--print", "--drain");
    is_int(r.code, 0, "db: --print --drain exits 0");
    is_int(th_count_lines(r.out), 3, "db: three JSON lines for four entries: m-1 of each database once");
    st = python_over(r.out, jsonf,
                     "import json,sys\n"
                     "for l in sorted(open(sys.argv[1]), key=lambda l: str(json.loads(l)['db'])):\n"
                     "    d=json.loads(l)\n"
                     "    print(d['db'],d['id'],d['payload'],list(d)[:3])\n",
                     &pyout, &pyerr);
    is_int(st, 0, "db: every line parses as JSON");
    if (st != 0)
        th_diag_tail("python", pyerr, INT_MAX);
    is_str(pyout,
           "None m-1 - ['id', 'db', 'topic']\n"
           "tenant-a m-1 a ['id', 'db', 'topic']\n"
           "tenant-b m-1 b ['id', 'db', 'topic']\n",
           "db: the JSON line's db is the message's database, null for none, after id");
    is_int(ct_pending(rc, stream, "p"), 0, "db: all four acknowledged");
    res_free(&r);

    add_db_entries(xstream);
    snprintf(envdir, sizeof envdir, "CT_DIR=%s", dir);
    r = run_args(args, env);
    is_int(r.code, 0, "db: --exec --drain exits 0");
    res_free(&r);
    for (int i = 0; i < 3; i++) {
        static const char *const files[] = {"db-tenant-a-m-1.env", "db-tenant-b-m-1.env", "db-none-m-1.env"};
        static const char *const lines[] = {"OUTBOX_DB=tenant-a", "OUTBOX_DB=tenant-b", "OUTBOX_DB="};
        p = th_path(dir, files[i]);
        t = th_slurp(p);
        is_int(ct_line_count(t, lines[i]), 1, "db: the command of %s had %s", files[i], lines[i]);
        is_int(ct_line_count(t, "OUTBOX_ID=m-1"), 1, "db: and OUTBOX_ID=m-1");
        free(t);
        free(p);
    }
    is_int(ct_pending(rc, xstream, "x"), 0, "db: --exec acknowledged all four");
    free(pyout);
    free(pyerr);
    free(jsonf);
}

static int stream_exists(void *arg)
{
    return ct_int(rc, "EXISTS %s", (const char *)arg) == 1;
}

static void test_sigterm(void)
{
    const char *args[] = {"--redis", srv.url, "--stream", "outbox:idle", "--group", "i", "--print", NULL};
    char *log = th_path(dir, "idle.log"), *t;
    pid_t pid = ct_consume_spawn(args, NULL, NULL, log);
    int st;
    if (pid < 0)
        bail("spawn");
    ok(th_wait_until(10000 * th_slow(), stream_exists, "outbox:idle"), "the group is created with MKSTREAM");
    th_sleep_ms(100);
    st = th_stop(pid, SIGTERM, 10000);
    is_int(st, 0, "SIGTERM on an idle consumer: exit 0");
    t = th_slurp(log);
    ok(strstr(t, "consumer stopped") != NULL, "it logs its stop");
    free(t);
    free(log);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();

    test_help();
    test_usage_errors();
    test_print();
    test_exec();
    test_db();
    test_sigterm();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
