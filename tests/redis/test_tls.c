/*
 * test_tls.c: TLS on the project's Redis connection (src/redis/tls.c, redis.c with
 * rediss:// URLs) against real redis-servers with TLS ports, certificates
 * made by the `openssl` command at test time (tls_certs.c), and against a
 * misbehaving TLS peer.
 *
 * Every test runs on its own loop, closes what it opened and checks that
 * uv_loop_close() succeeds.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/ssl.h>

#include "consumer/ct.h"
#include "redis/rconn.h"
#include "redis/redis.h"
#include "tap.h"
#include "tls/tls.h"
#include "tls_certs.h"

static int slow = 1;
static tls_certs *certs;

/* ---- OpenSSL's allocations, counted (installed before OpenSSL starts) ---- */

static atomic_long ossl_allocs;

static void *count_malloc(size_t n, const char *file, int line)
{
    (void)file;
    (void)line;
    atomic_fetch_add(&ossl_allocs, 1);
    return malloc(n);
}

static void *count_realloc(void *p, size_t n, const char *file, int line)
{
    (void)file;
    (void)line;
    atomic_fetch_add(&ossl_allocs, 1);
    return realloc(p, n);
}

static void count_free(void *p, const char *file, int line)
{
    (void)file;
    (void)line;
    free(p);
}

/* SSL_CTX_free calls every registered ex_data free function, whether the
 * index holds data or not: registered with SSL_CTX_get_ex_new_index, this
 * one counts the SSL_CTXs freed, so a test sees when a configuration's
 * context goes. */
static atomic_int ctx_frees;

static void count_ctx_free(void *parent, void *ptr, CRYPTO_EX_DATA *ad, int idx, long argl, void *argp)
{
    (void)parent;
    (void)ptr;
    (void)ad;
    (void)idx;
    (void)argl;
    (void)argp;
    atomic_fetch_add(&ctx_frees, 1);
}

/* ---- a connection on its own loop ----------------------------------------- */

typedef struct T {
    uv_loop_t loop;
    outbox__redis *r;
    outbox__tls_config *cfg;
    int connects, connect_status;
    int64_t t0, connect_ms;
    char connect_err[512];
    int disconnects, disconnect_status;
    char disconnect_err[512];
    int closed;
    /* replies */
    int replies, wrong, last_status;
    char *last; /* the last reply's string (malloc'd), length last_len */
    size_t last_len;
} T;

static void t_loop_init(T *t)
{
    memset(t, 0, sizeof *t);
    if (uv_loop_init(&t->loop) != 0)
        bail("uv_loop_init");
}

/* Runs the loop empty and checks that it closes cleanly (the owner closed
 * its objects first). */
static void t_loop_finish(T *t, const char *name)
{
    int e = ct_loop_finish(&t->loop, 5000 * slow);
    is_int(t->closed, 1, "%s: close callback once", name);
    is_int(e, 0, "%s: loop closed cleanly", name);
    free(t->last);
    t->last = NULL;
}

typedef struct at_least {
    const int *count;
    int want;
} at_least;

static int reached(void *arg)
{
    const at_least *a = arg;
    return *a->count >= a->want;
}

/* Runs the loop until *count reaches want or ms pass (times the valgrind
 * factor); returns whether it did. */
static int run_until(T *t, const int *count, int want, int ms)
{
    at_least a = {count, want};
    return ct_run_until_cond(&t->loop, reached, &a, ms * slow);
}

static void on_connect(outbox__redis *r, int status, void *data)
{
    T *t = data;
    t->connects++;
    t->connect_status = status;
    t->connect_ms = th_now_ms() - t->t0;
    snprintf(t->connect_err, sizeof t->connect_err, "%s", outbox__redis_errstr(r));
}

static void on_disconnect(outbox__redis *r, int status, void *data)
{
    T *t = data;
    t->disconnects++;
    t->disconnect_status = status;
    snprintf(t->disconnect_err, sizeof t->disconnect_err, "%s", outbox__redis_errstr(r));
}

static void on_closed(void *data)
{
    ((T *)data)->closed++;
}

/* Builds the TLS configuration from ts (NULL: none given, so a rediss:// URL
 * gets the defaults inside create), creates and connects; runs until the
 * connect callback. Returns its status. */
static int t_open(T *t, const char *url_text, const outbox_tls_settings *ts, const char *client_name,
                  uint64_t connect_timeout_ms)
{
    outbox__redis_url url;
    outbox__redis_options o;
    char err[512];
    t_loop_init(t);
    if (outbox__redis_url_parse(url_text, &url, err, sizeof err) != 0)
        bail("url %s: %s", url_text, err);
    if (ts && outbox__tls_config_create(&t->cfg, ts, err, sizeof err) != 0)
        bail("tls config: %s", err);
    outbox__redis_options_defaults(&o);
    o.tls = t->cfg;
    o.client_name = client_name;
    o.connect_timeout_ms = connect_timeout_ms;
    if (outbox__redis_create(&t->r, &t->loop, &url, &o, t) != 0)
        bail("outbox__redis_create");
    outbox__redis_url_free(&url);
    t->t0 = th_now_ms();
    if (outbox__redis_connect(t->r, on_connect, on_disconnect) != 0)
        bail("outbox__redis_connect");
    if (!run_until(t, &t->connects, 1, 20000))
        diag("no connect callback within 20 s");
    return t->connect_status;
}

/* Closes everything and checks that the loop closes cleanly. */
static void t_close(T *t, const char *name)
{
    outbox__redis_close(t->r, on_closed, t);
    outbox__tls_config_unref(t->cfg);
    t_loop_finish(t, name);
}

static void on_reply(outbox__redis *r, int status, redisReply *reply, void *data)
{
    T *t = data;
    (void)r;
    t->replies++;
    t->last_status = status;
    free(t->last);
    t->last = NULL;
    t->last_len = 0;
    if (status == 0 && reply && (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS ||
                                 reply->type == REDIS_REPLY_ERROR)) {
        t->last = malloc(reply->len + 1);
        if (!t->last)
            bail("out of memory");
        memcpy(t->last, reply->str, reply->len);
        t->last[reply->len] = '\0';
        t->last_len = reply->len;
    }
}

/* Runs one command to its reply; returns the status. */
static int t_cmd(T *t, int argc, const char **argv, const size_t *lens)
{
    int want = t->replies + 1;
    if (outbox__redis_command_argv(t->r, argc, argv, lens, 0, on_reply, t) != 0)
        return -1000;
    if (!run_until(t, &t->replies, want, 20000))
        return -1001;
    return t->last_status;
}

static int has(const char *s, const char *part)
{
    int found = s && strstr(s, part) != NULL;
    if (!found)
        diag("'%s' does not contain '%s'", s ? s : "(null)", part);
    return found;
}

static void ca_only(outbox_tls_settings *s)
{
    outbox_tls_defaults(s);
    s->ca_file = tls_cert(certs, "ca.crt");
}

/* ---- settings -------------------------------------------------------------- */

static void expect_config_error(const outbox_tls_settings *s, const char *what, const char *part1,
                                const char *part2)
{
    outbox__tls_config *c = NULL;
    char err[600];
    is_int(outbox__tls_config_create(&c, s, err, sizeof err), OUTBOX_EINVAL, "config: %s refused", what);
    ok(c == NULL, "  nothing created");
    ok(has(err, part1) && (!part2 || has(err, part2)), "  message names it: %s", err);
}

static void test_settings(void)
{
    outbox_tls_settings s;
    outbox__tls_config *c = NULL;
    char err[600];
    int counted = SSL_CTX_get_ex_new_index(0, NULL, NULL, NULL, count_ctx_free) >= 0, frees, alive;

    outbox_tls_defaults(&s);
    ok(!s.ca_file && !s.ca_dir && !s.cert_file && !s.key_file && !s.server_name && !s.insecure,
       "defaults: nothing set, verification on");
    ok(!outbox__tls_settings_given(&s), "  and nothing counts as given");
    is_int(outbox__tls_config_create(&c, &s, err, sizeof err), 0, "default configuration (system trust store)");
    ok(!outbox__tls_config_insecure(c), "  verifies");
    outbox__tls_config_unref(c);
    is_int(outbox__tls_config_create(&c, NULL, err, sizeof err), 0, "NULL settings are the defaults");
    frees = atomic_load(&ctx_frees);
    outbox__tls_config_unref(outbox__tls_config_ref(c));
    alive = atomic_load(&ctx_frees) == frees;
    outbox__tls_config_unref(c);
    outbox__tls_config_unref(NULL);
    ok(counted && alive && atomic_load(&ctx_frees) == frees + 1,
       "ref/unref balance: the context outlives ref+unref and goes with the last unref; unref(NULL) frees nothing");

    ca_only(&s);
    s.ca_file = "/nonexistent/ca.pem";
    expect_config_error(&s, "missing CA file", "CA file '/nonexistent/ca.pem'", "No such file or directory");
    s.ca_file = tls_cert(certs, "garbage.pem");
    expect_config_error(&s, "CA file that is not PEM", tls_cert(certs, "garbage.pem"), "no usable PEM certificate");
    s.ca_file = "/tmp";
    expect_config_error(&s, "CA file that is a directory", "CA file '/tmp'", "is a directory");
    s.ca_file = "";
    expect_config_error(&s, "empty CA file path", "CA file", "empty path");
    outbox_tls_defaults(&s);
    s.ca_dir = tls_cert(certs, "ca.crt");
    expect_config_error(&s, "CA directory that is a file", "CA directory", "not a directory");
    s.ca_dir = "/nonexistent-dir";
    expect_config_error(&s, "missing CA directory", "CA directory '/nonexistent-dir'", "No such file");

    ca_only(&s);
    s.cert_file = tls_cert(certs, "client.crt");
    expect_config_error(&s, "certificate without key", "certificate file given without a key file", NULL);
    s.cert_file = NULL;
    s.key_file = tls_cert(certs, "client.key");
    expect_config_error(&s, "key without certificate", "key file given without a certificate file", NULL);
    s.cert_file = "/nonexistent/client.crt";
    expect_config_error(&s, "missing certificate file", "certificate file '/nonexistent/client.crt'", "No such file");
    s.cert_file = tls_cert(certs, "garbage.pem");
    expect_config_error(&s, "certificate file that is not PEM", tls_cert(certs, "garbage.pem"),
                        "no usable PEM certificate");
    s.cert_file = tls_cert(certs, "client.crt");
    s.key_file = tls_cert(certs, "garbage.pem");
    expect_config_error(&s, "key file that is not PEM", tls_cert(certs, "garbage.pem"), "no usable PEM private key");
    s.key_file = tls_cert(certs, "enc.key");
    expect_config_error(&s, "encrypted key", tls_cert(certs, "enc.key"), "is encrypted: a passphrase cannot be entered");
    s.key_file = tls_cert(certs, "server.key");
    expect_config_error(&s, "key of another certificate", "does not match certificate file", tls_cert(certs, "client.crt"));
    s.key_file = tls_cert(certs, "client.key");
    is_int(outbox__tls_config_create(&c, &s, err, sizeof err), 0, "client certificate with its key: %s", err);
    outbox__tls_config_unref(c);

    ca_only(&s);
    s.server_name = "";
    expect_config_error(&s, "empty server name", "server name", NULL);

    /* TLS settings that would not apply */
    ca_only(&s);
    is_int(outbox__tls_config_for_url(0, &s, &c, err, sizeof err), OUTBOX_EINVAL, "TLS settings with redis:// refused");
    ok(c == NULL && has(err, "not rediss://"), "  message: %s", err);
    outbox_tls_defaults(&s);
    s.insecure = 1;
    is_int(outbox__tls_config_for_url(0, &s, &c, err, sizeof err), OUTBOX_EINVAL, "insecure with redis:// refused");
    outbox_tls_defaults(&s);
    is_int(outbox__tls_config_for_url(0, &s, &c, err, sizeof err), 0, "no TLS settings with redis://: fine");
    ok(c == NULL, "  and no configuration");
    is_int(outbox__tls_config_for_url(1, &s, &c, err, sizeof err), 0, "rediss:// without settings: the defaults");
    ok(c != NULL, "  a configuration");
    outbox__tls_config_unref(c);

    {
        /* The connection refuses a TLS configuration on a plaintext URL. */
        outbox__redis_url url;
        outbox__redis_options o;
        outbox__redis *r = NULL;
        uv_loop_t loop;
        uv_loop_init(&loop);
        outbox__tls_config_create(&c, NULL, err, sizeof err);
        outbox__redis_url_parse("redis://127.0.0.1:1", &url, err, sizeof err);
        outbox__redis_options_defaults(&o);
        o.tls = c;
        is_int(outbox__redis_create(&r, &loop, &url, &o, NULL), OUTBOX_EINVAL, "create: TLS config with redis:// refused");
        outbox__redis_url_free(&url);
        outbox__tls_config_unref(c);
        is_int(uv_loop_close(&loop), 0, "  loop untouched");
    }
}

/* ---- a real server ----------------------------------------------------------- */

static void test_roundtrip(th_redis *srv, int port)
{
    static const char value[] = "bin\0ary\r\nvalue \xff\x01 with CRLF\r\n";
    const char *hosts[] = {"localhost", "127.0.0.1"};
    outbox_tls_settings s;
    size_t i;
    ca_only(&s);
    for (i = 0; i < 2; i++) {
        char url[128], key[32];
        const char *set[] = {"SET", key, value}, *get[] = {"GET", key};
        size_t setlen[] = {3, 0, sizeof value - 1}, getlen[] = {3, 0};
        redisContext *plain;
        redisReply *rep;
        T t;
        snprintf(url, sizeof url, "rediss://%s:%d/3", hosts[i], port);
        snprintf(key, sizeof key, "k-%s", hosts[i]);
        setlen[1] = getlen[1] = strlen(key);
        is_int(t_open(&t, url, &s, "outbox-tls-test", 5000), 0, "%s: TLS connect (db 3, client name) %s", url,
               t.connect_err);
        is_int(t_cmd(&t, 3, set, setlen), 0, "  SET over TLS");
        is_int(t_cmd(&t, 2, get, getlen), 0, "  GET over TLS");
        ok(t.last_len == sizeof value - 1 && memcmp(t.last, value, sizeof value - 1) == 0,
           "  exact binary content back (%zu bytes)", t.last_len);
        plain = th_redis_client(srv);
        freeReplyObject(th_cmd(plain, "SELECT 3"));
        rep = th_cmd(plain, "GET %s", key);
        ok(rep->type == REDIS_REPLY_STRING && rep->len == sizeof value - 1 &&
               memcmp(rep->str, value, sizeof value - 1) == 0,
           "  the server holds exactly that (read over its Unix socket)");
        freeReplyObject(rep);
        rep = th_cmd(plain, "CLIENT LIST");
        ok(rep->type == REDIS_REPLY_STRING && strstr(rep->str, "name=outbox-tls-test"), "  CLIENT SETNAME went over TLS");
        freeReplyObject(rep);
        redisFree(plain);
        t_close(&t, url);
    }
}

/* Pipeline: `count` ECHOs queued at once, each checked in order. */
typedef struct echo_check {
    T *t;
    int next;
} echo_check;

static void echo_text(int i, char *buf, size_t len)
{
    snprintf(buf, len, "message %06d: the quick brown fox jumps over the lazy dog %d", i, i * 7919);
}

static void on_echo(outbox__redis *r, int status, redisReply *reply, void *data)
{
    echo_check *ec = data;
    char want[128];
    (void)r;
    echo_text(ec->next++, want, sizeof want);
    if (status != 0 || !reply || reply->type != REDIS_REPLY_STRING || strcmp(reply->str, want) != 0)
        ec->t->wrong++;
    ec->t->replies++;
}

static void test_big(int port)
{
    enum { COUNT = 20000, BIG = 1 << 20 };
    outbox_tls_settings s;
    echo_check ec;
    char url[128], text[128];
    char *big = malloc(BIG);
    const char *set[] = {"SET", "big", big}, *get[] = {"GET", "big"};
    size_t setlen[] = {3, 3, BIG}, getlen[] = {3, 3};
    int i, rc = 0;
    T t;
    if (!big)
        bail("out of memory");
    for (i = 0; i < BIG; i++)
        big[i] = (char)(i * 131 + (i >> 9));
    ca_only(&s);
    snprintf(url, sizeof url, "rediss://localhost:%d", port);
    is_int(t_open(&t, url, &s, NULL, 5000), 0, "big: TLS connect without handshake commands (PING) %s", t.connect_err);

    ec.t = &t;
    ec.next = 0;
    for (i = 0; i < COUNT && rc == 0; i++) {
        const char *argv[2] = {"ECHO", text};
        echo_text(i, text, sizeof text);
        rc = outbox__redis_command_argv(t.r, 2, argv, NULL, 0, on_echo, &ec);
    }
    is_int(rc, 0, "big: %d commands queued in one turn", COUNT);
    ok(outbox__redis_queued_bytes(t.r) > 1000000, "  more than a megabyte of plaintext waiting (%zu bytes)",
       outbox__redis_queued_bytes(t.r));
    ok(run_until(&t, &t.replies, COUNT, 60000), "  every reply arrived (%d)", t.replies);
    is_int(t.wrong, 0, "  each one exact and in order");

    t.replies = 0;
    is_int(t_cmd(&t, 3, set, setlen), 0, "big: SET of 1 MiB (64 records and more per write)");
    ok(t.last && strcmp(t.last, "OK") == 0, "  OK");
    is_int(t_cmd(&t, 2, get, getlen), 0, "big: GET of 1 MiB (replies split across reads)");
    ok(t.last_len == BIG && memcmp(t.last, big, BIG) == 0, "  the exact megabyte back (%zu bytes)", t.last_len);
    is_int(t.disconnects, 0, "  no disconnect");
    t_close(&t, "big");
    free(big);
}

static void on_any(outbox__redis *r, int status, redisReply *reply, void *data)
{
    T *t = data;
    (void)r;
    (void)reply;
    if (status != 0)
        t->wrong++;
    t->replies++;
}

/* 50 round trips of `per` SETs each; OpenSSL's allocations meanwhile. */
static long allocs_for(T *t, int per)
{
    long before = atomic_load(&ossl_allocs);
    int round, i;
    for (round = 0; round < 50; round++) {
        int want = t->replies + per;
        for (i = 0; i < per; i++) {
            const char *argv[] = {"SET", "counted", "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"};
            outbox__redis_command_argv(t->r, 3, argv, NULL, 0, on_any, t);
        }
        run_until(t, &t->replies, want, 10000);
    }
    return atomic_load(&ossl_allocs) - before;
}

/* The TLS connection costs no allocation per message. Our side reuses its
 * buffers; OpenSSL 3.0 allocates a few small blocks per record it writes
 * (its WPACKET), so the count follows the writes, never the messages. */
static void test_no_alloc_per_message(int port)
{
    outbox_tls_settings s;
    char url[128];
    long few, many;
    T t;
    ca_only(&s);
    snprintf(url, sizeof url, "rediss://127.0.0.1:%d", port);
    is_int(t_open(&t, url, &s, NULL, 5000), 0, "alloc: connect");
    allocs_for(&t, 100); /* warm up: session tickets, buffers at their size */
    few = allocs_for(&t, 10);
    many = allocs_for(&t, 100);
    is_int(t.replies, 50 * 210, "alloc: every command answered");
    is_int(t.wrong, 0, "  all fine");
    ok(many <= few + 5, "  OpenSSL: %ld allocations for 500 messages, %ld for 5000 (in 50 writes each)", few, many);
    ok(many <= 50 * 5, "  at most a few per write, none per message");
    t_close(&t, "alloc");
}

/* ---- failures ------------------------------------------------------------------ */

static void expect_failure(const char *name, const char *url, const outbox_tls_settings *s, const char *client_name,
                           uint64_t timeout_ms, int status, const char *part)
{
    T t;
    t_open(&t, url, s, client_name, timeout_ms);
    is_int(t.connect_status, status, "%s: connect fails with %s", name, outbox_err_name(status));
    ok(has(t.connect_err, part), "  message: %s", t.connect_err);
    is_int(t.connects, 1, "  connect callback once");
    t_close(&t, name);
}

static void expect_success(const char *name, const char *url, const outbox_tls_settings *s)
{
    const char *ping[] = {"PING"};
    T t;
    is_int(t_open(&t, url, s, NULL, 5000), 0, "%s: connects %s", name, t.connect_err);
    is_int(t_cmd(&t, 1, ping, NULL), 0, "  PING over TLS");
    ok(t.last && strcmp(t.last, "PONG") == 0, "  PONG");
    t_close(&t, name);
}

static void test_verification(int good, int expired, int other)
{
    outbox_tls_settings s;
    char url[128];

    outbox_tls_defaults(&s);
    s.ca_file = tls_cert(certs, "rogue-ca.crt");
    snprintf(url, sizeof url, "rediss://localhost:%d", good);
    expect_failure("wrong CA", url, &s, NULL, 5000, OUTBOX_ETLS, "unknown CA");
    snprintf(url, sizeof url, "rediss://127.0.0.1:%d", good);
    outbox_tls_defaults(&s);
    expect_failure("system trust store (test CA not in it)", url, &s, NULL, 5000, OUTBOX_ETLS,
                   "certificate verification failed");
    expect_failure("no settings at all: system trust store", url, NULL, NULL, 5000, OUTBOX_ETLS,
                   "certificate verification failed");

    ca_only(&s);
    snprintf(url, sizeof url, "rediss://localhost:%d", expired);
    expect_failure("expired certificate", url, &s, NULL, 5000, OUTBOX_ETLS, "certificate has expired");

    snprintf(url, sizeof url, "rediss://localhost:%d", other);
    expect_failure("name mismatch", url, &s, NULL, 5000, OUTBOX_ETLS, "hostname mismatch");
    snprintf(url, sizeof url, "rediss://127.0.0.1:%d", other);
    expect_failure("IP address mismatch", url, &s, NULL, 5000, OUTBOX_ETLS, "IP address mismatch");
    s.server_name = "other.example";
    expect_success("server name given (other.example)", url, &s);
    snprintf(url, sizeof url, "rediss://localhost:%d", good);
    s.server_name = "wrong.example";
    expect_failure("server name that the certificate lacks", url, &s, NULL, 5000, OUTBOX_ETLS,
                   "'wrong.example': hostname mismatch");
    s.server_name = "10.9.9.9";
    expect_failure("server name that is an IP the certificate lacks", url, &s, NULL, 5000, OUTBOX_ETLS,
                   "IP address mismatch");

    outbox_tls_defaults(&s);
    s.insecure = 1;
    snprintf(url, sizeof url, "rediss://localhost:%d", other);
    expect_success("insecure: wrong name accepted", url, &s);
    snprintf(url, sizeof url, "rediss://localhost:%d", expired);
    expect_success("insecure: expired accepted", url, &s);
}

/* The server requires a client certificate and a password. */
static void test_client_certs(int mtls)
{
    outbox_tls_settings s;
    char url[128];
    ca_only(&s);
    snprintf(url, sizeof url, "rediss://:s3cret@localhost:%d", mtls);
    expect_failure("missing client certificate", url, &s, NULL, 5000, OUTBOX_ETLS,
                   "the server asked for a client certificate and none is configured");
    expect_failure("missing client certificate, with a client name", url, &s, "named", 5000, OUTBOX_ETLS,
                   "asked for a client certificate");
    s.cert_file = tls_cert(certs, "client.crt");
    s.key_file = tls_cert(certs, "client.key");
    expect_success("mutual TLS with AUTH", url, &s);
    snprintf(url, sizeof url, "rediss://:wrong@localhost:%d", mtls);
    expect_failure("mutual TLS, wrong password", url, &s, NULL, 5000, OUTBOX_EAUTH, "AUTH: WRONGPASS");
    snprintf(url, sizeof url, "rediss://localhost:%d", mtls);
    expect_failure("mutual TLS, no password", url, &s, NULL, 5000, OUTBOX_EAUTH, "PING: NOAUTH");
}

static void test_wrong_port(th_redis *srv, int tls_port)
{
    outbox_tls_settings s;
    char url[128];
    int64_t t0;
    T t;
    ca_only(&s);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", tls_port);
    expect_failure("plaintext to the TLS port", url, NULL, "plain", 5000, OUTBOX_ECONNECT,
                   "a TLS port? use rediss://");

    /* Redis reads a ClientHello as an inline command: it waits for a
     * newline (then the connect times out) or answers an error in
     * plaintext if the random bytes held one. Both say so. */
    snprintf(url, sizeof url, "rediss://127.0.0.1:%d", srv->port);
    t0 = th_now_ms();
    t_open(&t, url, &s, NULL, 1000);
    ok(t.connect_status == OUTBOX_ETIMEDOUT || t.connect_status == OUTBOX_ETLS, "TLS to a plaintext port fails (%s)",
       outbox_err_name(t.connect_status));
    ok(has(t.connect_err, "use redis://"), "  message: %s", t.connect_err);
    ok(th_now_ms() - t0 < 4000 * slow, "  within the connect timeout");
    t_close(&t, "TLS to a plaintext port");
}

static void test_fake_peers(void)
{
    outbox_tls_settings s;
    char url[128];
    const char *set[] = {"SET", "k", "v"};
    tls_fake *f;
    T t;
    ca_only(&s);

    f = tls_fake_start(certs, TLS_FAKE_SILENT, 0);
    snprintf(url, sizeof url, "rediss://localhost:%d", tls_fake_port(f));
    t_open(&t, url, &s, NULL, 800);
    is_int(t.connect_status, OUTBOX_ETIMEDOUT, "silent peer: the handshake times out");
    ok(has(t.connect_err, "no answer to the TLS handshake"), "  message: %s", t.connect_err);
    ok(t.connect_ms >= 750 && t.connect_ms < 3000 * slow, "  the handshake counts against the connect timeout (%lld ms)",
       (long long)t.connect_ms);
    t_close(&t, "silent peer");
    tls_fake_stop(f);

    f = tls_fake_start(certs, TLS_FAKE_STALL, 0);
    snprintf(url, sizeof url, "rediss://localhost:%d", tls_fake_port(f));
    t_open(&t, url, &s, NULL, 800);
    is_int(t.connect_status, OUTBOX_ETIMEDOUT, "peer that stops mid-handshake: times out");
    ok(has(t.connect_err, "in the TLS handshake (the server stopped answering)"), "  message: %s", t.connect_err);
    t_close(&t, "stalled peer");
    tls_fake_stop(f);

    f = tls_fake_start(certs, TLS_FAKE_RESET_RECORD, 1);
    snprintf(url, sizeof url, "rediss://localhost:%d", tls_fake_port(f));
    is_int(t_open(&t, url, &s, NULL, 5000), 0, "resetting peer: the handshake (PING) succeeds %s", t.connect_err);
    if (t.connect_status == 0) {
        int rc = t_cmd(&t, 3, set, NULL);
        ok(rc == OUTBOX_ECLOSED || rc == OUTBOX_ETLS, "  the command fails with the connection (%s)",
           outbox_err_name(rc));
        is_int(t.disconnects, 1, "  disconnect callback once");
        ok(has(t.disconnect_err, "in the middle of a TLS record"), "  message: %s", t.disconnect_err);
    }
    t_close(&t, "resetting peer");
    tls_fake_stop(f);
}

/* ---- reconnecting ---------------------------------------------------------------- */

typedef struct R {
    int ups, downs, warnings;
    T *t;
} R;

static void capture_log(void *data, outbox_log_level level, const char *msg)
{
    R *rr = data;
    if (level == OUTBOX_LOG_WARN && strstr(msg, "TLS without verification"))
        rr->warnings++;
}

static void rc_up(outbox__rconn *rc, void *data)
{
    (void)rc;
    ((R *)data)->ups++;
}

static void rc_down(outbox__rconn *rc, int status, void *data)
{
    (void)rc;
    (void)status;
    ((R *)data)->downs++;
}

static void test_reconnect(th_redis *srv, int port, int insecure)
{
    outbox_tls_settings s;
    outbox__redis_url url;
    outbox__redis_options o;
    outbox__logger lg;
    outbox__rconn rc;
    char text[128], err[256];
    const char *name = insecure ? "reconnect (insecure)" : "reconnect";
    R rr;
    T t;
    int i;

    t_loop_init(&t);
    memset(&rr, 0, sizeof rr);
    ca_only(&s);
    s.insecure = insecure;
    if (outbox__tls_config_create(&t.cfg, &s, err, sizeof err) != 0)
        bail("tls config: %s", err);
    snprintf(text, sizeof text, "rediss://localhost:%d", port);
    outbox__redis_url_parse(text, &url, err, sizeof err);
    outbox__redis_options_defaults(&o);
    o.tls = t.cfg;
    lg.fn = capture_log;
    lg.data = &rr;
    lg.min_level = OUTBOX_LOG_DEBUG;
    is_int(outbox__rconn_init(&rc, &t.loop, &url, &o, &lg, "tls"), 0, "%s: rconn with TLS", name);
    outbox__redis_url_free(&url);
    outbox__tls_config_unref(t.cfg); /* the rconn holds its own reference */
    t.cfg = NULL;
    rc.on_up = rc_up;
    rc.on_down = rc_down;
    rc.data = &rr;
    outbox__rconn_start(&rc);
    ok(run_until(&t, &rr.ups, 1, 10000), "  up");
    for (i = 0; i < 2; i++) {
        outbox__redis *c;
        if (i == 1) {
            if (th_redis_restart(srv) != 0)
                bail("cannot restart redis-server");
            ok(run_until(&t, &rr.ups, 2, 15000), "  up again after the server restarted");
            is_int(rr.downs, 1, "  the loss was reported once");
        }
        c = outbox__rconn_get(&rc);
        if (c) {
            const char *ping[] = {"PING"};
            int want = t.replies + 1;
            outbox__redis_command_argv(c, 1, ping, NULL, 0, on_reply, &t);
            run_until(&t, &t.replies, want, 10000);
            ok(t.last_status == 0 && t.last && strcmp(t.last, "PONG") == 0, "  PING over the %s connection",
               i ? "new" : "first");
        } else {
            ok(0, "  connected");
        }
    }
    is_int(rr.warnings, insecure ? 2 : 0, "  %s", insecure ? "a warning at each connect" : "no insecure warning");
    outbox__rconn_close(&rc, on_closed, &t);
    t_loop_finish(&t, name);
}

int main(void)
{
    th_redis good, mtls, expired, other;
    int good_port, mtls_port, expired_port, other_port;

    if (!CRYPTO_set_mem_functions(count_malloc, count_realloc, count_free))
        diag("cannot count OpenSSL's allocations (OpenSSL already allocated)");
    slow = th_slow();
    certs = tls_certs_make();
    test_settings();

    good_port = tls_redis_start(&good, certs, "server.crt", "server.key", 0, 1, NULL);
    mtls_port = tls_redis_start(&mtls, certs, "server.crt", "server.key", 1, 0, "requirepass s3cret\n");
    expired_port = tls_redis_start(&expired, certs, "expired.crt", "expired.key", 0, 0, NULL);
    other_port = tls_redis_start(&other, certs, "other.crt", "other.key", 0, 0, NULL);
    if (good_port < 0 || mtls_port < 0 || expired_port < 0 || other_port < 0)
        bail("cannot start redis-server with TLS");

    test_roundtrip(&good, good_port);
    test_big(good_port);
    test_no_alloc_per_message(good_port);
    test_verification(good_port, expired_port, other_port);
    test_client_certs(mtls_port);
    test_wrong_port(&good, good_port);
    test_fake_peers();
    test_reconnect(&good, good_port, 0);
    test_reconnect(&good, good_port, 1);

    th_redis_destroy(&good);
    th_redis_destroy(&mtls);
    th_redis_destroy(&expired);
    th_redis_destroy(&other);
    tls_certs_free(certs);
    return tap_done();
}
