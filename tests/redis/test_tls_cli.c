/*
 * test_tls_cli.c: the --tls-* options of outbox-relay and outbox-consume
 * against redis-servers with TLS ports and certificates made at test time
 * (tls_certs.c): publishing and consuming through --tls-ca-file (the exact
 * messages arrive), mutual TLS with --tls-cert-file/--tls-key-file,
 * --tls-server-name for a certificate of another name, --tls-insecure and its
 * warning at every connect, the same options from OUTBOX_TLS_* variables and
 * config keys, every bad input (exit 2, the file or option named), and the
 * same through the C API (outbox_relay_settings.tls).
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"
#include "tls_certs.h"

static tls_certs *certs;
static th_redis *main_srv; /* the server of test_publish_consume and test_bad_input */
static char *dir, *consume_bin;
static int slow = 1;
/* --drain-timeout-ms of the drains that cannot connect: long enough for the
 * first attempt's failure to be logged, under valgrind too. */
static char drain_timeout[16];

typedef struct res {
    int code;
    char *out, *err;
} res;

static void res_free(res *r)
{
    free(r->out);
    free(r->err);
}

/* outbox-relay --db db --redis url, then the NULL-terminated arguments. */
static char **relay_argv(const char *db, const char *url, ...)
{
    va_list ap;
    char **argv;
    va_start(ap, url);
    argv = th_relay_argv(db, url, ap);
    va_end(ap);
    return argv;
}

/* relay_argv run to its end; env may be NULL. */
static res relay_run(char *const *env, const char *db, const char *url, ...)
{
    va_list ap;
    char **argv;
    res r;
    va_start(ap, url);
    argv = th_relay_argv(db, url, ap);
    va_end(ap);
    r.code = th_run(argv, env, &r.out, &r.err, 30000 * slow);
    th_argv_free(argv);
    return r;
}

/* outbox-consume with the NULL-terminated arguments. */
static res consume_run(const char *first, ...)
{
    const char *argv[40];
    va_list ap;
    int n = 0;
    res r;
    argv[n++] = consume_bin;
    argv[n++] = first;
    va_start(ap, first);
    while (n < 39 && (argv[n] = va_arg(ap, const char *)) != NULL)
        n++;
    va_end(ap);
    argv[n] = NULL;
    r.code = th_run((char *const *)argv, NULL, &r.out, &r.err, 30000 * slow);
    return r;
}

static void expect_usage(res r, const char *needle, const char *what)
{
    is_int(r.code, 2, "%s: exit 2", what);
    ok(r.err && strstr(r.err, needle) != NULL, "%s: stderr names it (%.*s)", what,
       r.err ? (int)strcspn(r.err, "\n") : 0, r.err ? r.err : "");
    res_free(&r);
}

/* A fresh database with the schema and the messages "<tag>-1".."<tag>-n" of
 * topic orders, payloads "payload <tag> <i>". */
static char *make_db(const char *tag, int n)
{
    char name[64], err[256];
    char *path;
    sqlite3 *db;
    snprintf(name, sizeof name, "%s.db", tag);
    path = th_path(dir, name);
    if (outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 ||
        outbox_schema_apply(db, err, sizeof err) != 0)
        bail("cannot create %s: %s", path, err);
    for (int i = 1; i <= n; i++)
        th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('%q-%d', 'orders', 'payload %q %d')", tag, i,
                    tag, i);
    sqlite3_close_v2(db);
    return path;
}

/* The stream outbox:orders holds exactly the messages of make_db(tag, n), in
 * order: ids and payloads. */
static void expect_stream(th_redis *srv, const char *tag, int n, const char *what)
{
    redisContext *c = th_redis_client(srv);
    redisReply *r = th_cmd(c, "XRANGE outbox:orders - +");
    int good = r->type == REDIS_REPLY_ARRAY && (int)r->elements == n;
    for (size_t i = 0; good && i < r->elements; i++) {
        redisReply *e = r->element[i], *f = e->element[1];
        outbox_envelope *env = NULL;
        char id[64], payload[96];
        snprintf(id, sizeof id, "%s-%zu", tag, i + 1);
        snprintf(payload, sizeof payload, "payload %s %zu", tag, i + 1);
        good = f->elements == 4 && !strcmp(f->element[0]->str, "id") && !strcmp(f->element[1]->str, id) &&
               outbox_envelope_decode(f->element[3]->str, f->element[3]->len, &env, NULL, 0) == 0 &&
               !strcmp(env->id, id) && env->payload_len == strlen(payload) &&
               !memcmp(env->payload, payload, env->payload_len);
        if (!good)
            diag("entry %zu is not %s / '%s'", i, id, payload);
        outbox_envelope_free(env);
    }
    ok(good, "%s: the stream holds exactly the %d messages, in order (%zu entries)", what, n,
       r->type == REDIS_REPLY_ARRAY ? r->elements : 0);
    freeReplyObject(r);
    freeReplyObject(th_cmd(c, "DEL outbox:orders"));
    redisFree(c);
}

static char *tls_url(const char *host, int port)
{
    char buf[128];
    snprintf(buf, sizeof buf, "rediss://%s:%d", host, port);
    return strdup(buf);
}

/* Publish with --tls-ca-file, then consume the same stream through TLS:
 * exact content both ways. Also the options from the environment and the
 * config file. */
static void test_publish_consume(int port)
{
    char *url = tls_url("localhost", port), *db = make_db("plain", 5), *ini = th_path(dir, "relay.ini");
    const char *ca = tls_cert(certs, "ca.crt");
    res r;
    FILE *f;

    r = relay_run(NULL, db, url, "--tls-ca-file", ca, "--drain", NULL);
    is_int(r.code, 0, "relay --tls-ca-file: drained over TLS (exit 0)");
    if (r.code != 0)
        th_diag_tail("relay", r.err, 10);
    res_free(&r);
    free(db);

    r = consume_run("--redis", url, "--tls-ca-file", ca, "--stream", "outbox:orders", "--group", "g1", "--print",
                    "--drain", NULL);
    is_int(r.code, 0, "consume --tls-ca-file: drained over TLS (exit 0)");
    ok(r.out && th_count_lines(r.out) == 5 && strstr(r.out, "\"id\":\"plain-1\"") &&
           strstr(r.out, "\"payload\":\"payload plain 5\""),
       "consume: the 5 messages as JSON lines (%d lines)", r.out ? th_count_lines(r.out) : 0);
    res_free(&r);
    expect_stream(main_srv, "plain", 5, "--tls-ca-file");

    /* OUTBOX_TLS_CA_FILE and the config key tls-ca-file work like the flag. */
    {
        char var[600];
        char *env[] = {var, NULL};
        snprintf(var, sizeof var, "OUTBOX_TLS_CA_FILE=%s", ca);
        db = make_db("env", 3);
        r = relay_run(env, db, url, "--drain", NULL);
        is_int(r.code, 0, "relay with OUTBOX_TLS_CA_FILE: drained (exit 0)");
        res_free(&r);
        expect_stream(main_srv, "env", 3, "OUTBOX_TLS_CA_FILE");
        free(db);
    }
    f = fopen(ini, "w");
    fprintf(f, "[relay]\ntls-ca-file = %s\ntls-server-name = localhost\n", ca);
    fclose(f);
    {
        char *ip = tls_url("127.0.0.1", port);
        db = make_db("ini", 3);
        r = relay_run(NULL, db, ip, "--config", ini, "--drain", NULL);
        is_int(r.code, 0, "relay with tls-ca-file and tls-server-name in the config file: drained (exit 0)");
        res_free(&r);
        expect_stream(main_srv, "ini", 3, "config keys");
        free(db);
        free(ip);
    }
    free(ini);
    free(url);
}

static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

/* A TLS redis-server serving cert/key (tls-auth-clients yes with auth);
 * returns its rediss://localhost URL, or NULL (a failed test). */
static char *start_server(th_redis *srv, const char *cert, const char *key, int auth, const char *what)
{
    int port = tls_redis_start(srv, certs, cert, key, auth, 0, NULL);
    if (port < 0) {
        ok(0, "%s: redis-server started", what);
        return NULL;
    }
    return tls_url("localhost", port);
}

/* A drain that cannot connect: --drain-timeout-ms ends it with exit 1, and
 * the log says why. */
static void expect_no_connect(res r, const char *needle, const char *what)
{
    is_int(r.code, 1, "%s: the drain times out (exit 1)", what);
    ok(r.err && strstr(r.err, needle), "  and the log says why (%s)", needle);
    res_free(&r);
}

/* A server that requires a client certificate: the relay and the consumer
 * with --tls-cert-file/--tls-key-file get through; without them the relay
 * says why and its drain times out. */
static void test_mutual(void)
{
    th_redis srv = {0};
    const char *ca = tls_cert(certs, "ca.crt"), *crt = tls_cert(certs, "client.crt"), *key = tls_cert(certs, "client.key");
    char *url = start_server(&srv, "server.crt", "server.key", 1, "mutual TLS"), *db;
    res r;
    if (!url)
        return;
    db = make_db("mtls", 4);
    r = relay_run(NULL, db, url, "--tls-ca-file", ca, "--tls-cert-file", crt, "--tls-key-file", key, "--drain", NULL);
    is_int(r.code, 0, "mutual TLS: the relay with a client certificate drained (exit 0)");
    res_free(&r);
    r = consume_run("--redis", url, "--tls-ca-file", ca, "--tls-cert-file", crt, "--tls-key-file", key, "--stream",
                    "outbox:orders", "--group", "g1", "--print", "--drain", NULL);
    is_int(r.code, 0, "mutual TLS: the consumer with a client certificate drained (exit 0)");
    ok(r.out && th_count_lines(r.out) == 4 && strstr(r.out, "\"payload\":\"payload mtls 4\""),
       "mutual TLS: the consumer printed the 4 messages");
    res_free(&r);
    expect_stream(&srv, "mtls", 4, "mutual TLS");
    free(db);

    db = make_db("nocert", 1);
    expect_no_connect(relay_run(NULL, db, url, "--tls-ca-file", ca, "--drain", "--drain-timeout-ms", drain_timeout, NULL),
                      "asked for a client certificate", "mutual TLS without a client certificate");
    free(db);
    free(url);
    th_redis_destroy(&srv);
}

/* A certificate only for other.example: connecting to localhost fails the
 * name check, --tls-server-name other.example gets through. */
static void test_server_name(void)
{
    th_redis srv = {0};
    const char *ca = tls_cert(certs, "ca.crt");
    char *url = start_server(&srv, "other.crt", "other.key", 0, "server name"), *db;
    res r;
    if (!url)
        return;
    db = make_db("name", 2);
    expect_no_connect(relay_run(NULL, db, url, "--tls-ca-file", ca, "--drain", "--drain-timeout-ms", drain_timeout, NULL),
                      "hostname mismatch", "certificate for another name");
    r = relay_run(NULL, db, url, "--tls-ca-file", ca, "--tls-server-name", "other.example", "--drain", NULL);
    is_int(r.code, 0, "--tls-server-name other.example: drained (exit 0)");
    res_free(&r);
    expect_stream(&srv, "name", 2, "--tls-server-name");
    r = consume_run("--redis", url, "--tls-ca-file", ca, "--tls-server-name", "other.example", "--stream",
                    "outbox:orders", "--group", "g1", "--print", "--drain", NULL);
    is_int(r.code, 0, "consume --tls-server-name other.example: exit 0");
    res_free(&r);
    free(db);
    free(url);
    th_redis_destroy(&srv);
}

typedef struct log_wait {
    const char *path;
    const char *needle;
    int want;
} log_wait;

static int log_has(void *arg)
{
    const log_wait *w = arg;
    char *text = th_slurp(w->path);
    int n = count(text, w->needle);
    free(text);
    return n >= w->want;
}

/* --tls-insecure: no CA given (the system's store does not know the test
 * CA), yet the relay connects, with a warning at the first connect and again
 * after a reconnect. */
static void test_insecure(void)
{
    th_redis srv = {0};
    const char *warning = "TLS without verification";
    char *url = start_server(&srv, "server.crt", "server.key", 0, "insecure"), *db, *logpath, *text;
    char **argv;
    log_wait w;
    pid_t pid;
    if (!url)
        return;
    logpath = th_path(dir, "insecure.log");
    db = make_db("insecure", 3);
    /* The system's trust store does not know the test CA. */
    expect_no_connect(relay_run(NULL, db, url, "--drain", "--drain-timeout-ms", drain_timeout, NULL), "err=ETLS",
                      "no CA given");
    argv = relay_argv(db, url, "--tls-insecure", "--scan-interval-ms", "50", NULL);
    pid = th_spawn(argv, NULL, NULL, logpath);
    ok(pid > 0, "insecure: relay started");
    w.path = logpath;
    w.needle = warning;
    w.want = 1;
    ok(th_wait_until(10000 * slow, log_has, &w), "--tls-insecure: a warning at the first connect");
    {
        redisContext *c = th_redis_client(&srv);
        int n = 0;
        for (int i = 0; i < 400 && n < 3; i++) {
            n = (int)th_xlen(c, "outbox:orders");
            th_sleep_ms(10);
        }
        is_int(n, 3, "--tls-insecure: the messages were published over TLS");
        redisFree(c);
    }
    th_redis_kill(&srv);
    if (th_redis_restart(&srv) != 0)
        bail("cannot restart redis-server");
    w.want = 2;
    ok(th_wait_until(15000 * slow, log_has, &w), "--tls-insecure: the warning again at the reconnect");
    is_int(th_stop(pid, SIGTERM, 20000 * slow), 0, "insecure: relay stops cleanly");
    text = th_slurp(logpath);
    ok(strstr(text, "level=warn") && count(text, warning) >= 2, "  the warnings are level=warn lines (%d)",
       count(text, warning));
    free(text);
    th_argv_free(argv);
    free(logpath);
    free(db);
    free(url);
    th_redis_destroy(&srv);
}

/* The C API: outbox_relay_create refuses what the daemon refuses, with the
 * same message, and a relay with outbox_relay_settings.tls publishes. */
static void test_c_api(int port)
{
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    uv_loop_t loop;
    char err[512], *db = make_db("capi", 2), *url = tls_url("localhost", port), *missing = th_path(dir, "none.pem");
    int e;

    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    ok(!s.tls.ca_file && !s.tls.ca_dir && !s.tls.cert_file && !s.tls.key_file && !s.tls.server_name &&
           !s.tls.insecure,
       "C API: outbox_relay_defaults leaves every TLS setting off");
    s.db_path = db;
    s.redis_url = url;
    s.tls.ca_file = missing;
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    is_int(e, OUTBOX_EINVAL, "C API: a missing CA file fails create with OUTBOX_EINVAL");
    ok(strstr(err, missing) != NULL, "  naming the file (%s)", err);
    s.redis_url = "redis://127.0.0.1:6379";
    s.tls.ca_file = tls_cert(certs, "ca.crt");
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    is_int(e, OUTBOX_EINVAL, "C API: tls.ca_file with redis:// fails create with OUTBOX_EINVAL");
    ok(strstr(err, "tls-ca-file") != NULL, "  naming the option (%s)", err);
    s.redis_url = url;
    s.drain = 1;
    s.log_level = OUTBOX_LOG_WARN;
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    is_int(e, 0, "C API: create with tls.ca_file and a rediss:// URL (%s)", err);
    if (e == 0) {
        /* The settings' strings are not needed after create. */
        s.tls.ca_file = NULL;
        is_int(outbox_relay_start(r), 0, "C API: start");
        uv_run(&loop, UV_RUN_DEFAULT);
        is_int(outbox_relay_drain_result(r), 0, "C API: drained over TLS");
        outbox_relay_destroy(r);
        uv_run(&loop, UV_RUN_DEFAULT);
        expect_stream(main_srv, "capi", 2, "C API");
    }
    is_int(uv_loop_close(&loop), 0, "C API: loop closed cleanly");
    free(missing);
    free(url);
    free(db);
}

/* Every bad input exits 2 before connecting, naming the file or option. */
static void test_bad_input(int port)
{
    char *url = tls_url("localhost", port), *db = make_db("bad", 1), *missing = th_path(dir, "no-such-ca.pem");
    const char *crt = tls_cert(certs, "client.crt"), *key = tls_cert(certs, "client.key"),
               *garbage = tls_cert(certs, "garbage.pem"), *enc = tls_cert(certs, "enc.key"),
               *other_key = tls_cert(certs, "other.key");
    char want[600];

    snprintf(want, sizeof want, "CA file '%s': No such file or directory", missing);
    expect_usage(relay_run(NULL, db, url, "--tls-ca-file", missing, NULL), want, "relay: missing CA file");
    expect_usage(consume_run("--redis", url, "--tls-ca-file", missing, "--stream", "s", "--group", "g", "--print",
                             NULL),
                 want, "consume: missing CA file");
    {
        char var[600];
        char *env[] = {var, NULL};
        snprintf(var, sizeof var, "OUTBOX_TLS_CA_FILE=%s", missing);
        expect_usage(relay_run(env, db, url, NULL), want, "relay: missing CA file in OUTBOX_TLS_CA_FILE");
    }
    snprintf(want, sizeof want, "CA file '%s' holds no usable PEM certificate", garbage);
    expect_usage(relay_run(NULL, db, url, "--tls-ca-file", garbage, NULL), want, "relay: malformed CA file");
    expect_usage(consume_run("--redis", url, "--tls-ca-file", garbage, "--stream", "s", "--group", "g", "--print",
                             NULL),
                 want, "consume: malformed CA file");
    snprintf(want, sizeof want, "certificate file '%s' holds no usable PEM certificate", garbage);
    expect_usage(relay_run(NULL, db, url, "--tls-cert-file", garbage, "--tls-key-file", key, NULL), want,
                 "relay: malformed certificate file");
    snprintf(want, sizeof want, "key file '%s' holds no usable PEM private key", garbage);
    expect_usage(relay_run(NULL, db, url, "--tls-cert-file", crt, "--tls-key-file", garbage, NULL), want,
                 "relay: malformed key file");
    snprintf(want, sizeof want, "key file '%s' is encrypted", enc);
    expect_usage(relay_run(NULL, db, url, "--tls-cert-file", crt, "--tls-key-file", enc, NULL), want,
                 "relay: encrypted key file");
    snprintf(want, sizeof want, "key file '%s' does not match certificate file '%s'", other_key, crt);
    expect_usage(relay_run(NULL, db, url, "--tls-cert-file", crt, "--tls-key-file", other_key, NULL), want,
                 "relay: key of another certificate");
    expect_usage(consume_run("--redis", url, "--tls-cert-file", crt, "--tls-key-file", other_key, "--stream", "s",
                             "--group", "g", "--print", NULL),
                 want, "consume: key of another certificate");
    snprintf(want, sizeof want, "CA directory '%s': not a directory", crt);
    expect_usage(relay_run(NULL, db, url, "--tls-ca-dir", crt, NULL), want, "relay: CA directory that is a file");

    expect_usage(relay_run(NULL, db, url, "--tls-cert-file", crt, NULL),
                 "certificate file given without a key file: a client certificate needs both",
                 "relay: certificate without key");
    expect_usage(relay_run(NULL, db, url, "--tls-key-file", key, NULL),
                 "key file given without a certificate file: a client certificate needs both",
                 "relay: key without certificate");
    expect_usage(consume_run("--redis", url, "--tls-cert-file", crt, "--stream", "s", "--group", "g", "--print",
                             NULL),
                 "certificate file given without a key file", "consume: certificate without key");
    expect_usage(consume_run("--redis", url, "--tls-key-file", key, "--stream", "s", "--group", "g", "--print",
                             NULL),
                 "key file given without a certificate file", "consume: key without certificate");

    expect_usage(relay_run(NULL, db, "redis://127.0.0.1:6379", "--tls-ca-file", tls_cert(certs, "ca.crt"), NULL),
                 "tls-ca-file: given but the Redis URL is not rediss://", "relay: --tls-ca-file with redis://");
    expect_usage(relay_run(NULL, db, "unix:///tmp/x.sock", "--tls-insecure", NULL),
                 "tls-insecure: given but the Redis URL is not rediss://", "relay: --tls-insecure with unix://");
    expect_usage(consume_run("--redis", "redis://127.0.0.1:6379", "--tls-server-name", "x", "--stream", "s",
                             "--group", "g", "--print", NULL),
                 "--tls-server-name: given but the Redis URL is not rediss://",
                 "consume: --tls-server-name with redis://");
    expect_usage(relay_run(NULL, db, url, "--tls-ca-file", "", NULL), "--tls-ca-file: empty value",
                 "relay: empty --tls-ca-file");
    expect_usage(consume_run("--redis", url, "--tls-ca-file", "", "--stream", "s", "--group", "g", "--print", NULL),
                 "--tls-ca-file: empty value", "consume: empty --tls-ca-file");
    expect_usage(relay_run(NULL, db, url, "--tls-insecure=maybe", NULL), "--tls-insecure: 'maybe' is not a boolean",
                 "relay: --tls-insecure=maybe");
    expect_usage(consume_run("--redis", url, "--tls-ca-file", NULL), "--tls-ca-file needs a value",
                 "consume: --tls-ca-file without a value");
    free(missing);
    free(db);
    free(url);
}

int main(void)
{
    th_redis srv = {0};
    int port;
    slow = th_slow();
    snprintf(drain_timeout, sizeof drain_timeout, "%d", 1500 * slow);
    dir = th_tmpdir();
    consume_bin = th_bin("tools/consume/outbox-consume");
    certs = tls_certs_make();
    port = tls_redis_start(&srv, certs, "server.crt", "server.key", 0, 0, NULL);
    if (port < 0)
        bail("cannot start redis-server with a TLS port");
    main_srv = &srv;
    test_publish_consume(port);
    test_bad_input(port);
    test_c_api(port);
    th_redis_destroy(&srv);
    test_mutual();
    test_server_name();
    test_insecure();
    tls_certs_free(certs);
    th_rmtree(dir);
    free(dir);
    free(consume_bin);
    return tap_done();
}
