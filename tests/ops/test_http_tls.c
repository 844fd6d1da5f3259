/*
 * The metrics endpoint with a web configuration (--metrics-web-config, the
 * format of Prometheus' exporter-toolkit): over TLS with basic
 * authentication, curl scrapes /metrics (and promtool checks the scrape
 * where it is installed), no or wrong credentials get 401 with
 * WWW-Authenticate, plaintext to the TLS port is closed without an answer,
 * a bcrypt check is paid once and then cached; a crowd of wrong passwords
 * waits for one check at a time (503 beyond the queue) while the relay
 * publishes; client certificates with RequireAndVerifyClientCert; and files
 * that cannot be used stop the relay at start (exit 2, naming the problem).
 */
#include <crypt.h>
#include <stdarg.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"
#include "tls_certs.h"

static th_redis redis;
static tls_certs *certs;
static char *dir, *dbpath;
static sqlite3 *db;

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s: %s", path, strerror(errno));
}

/* A bcrypt hash of password at cost. */
static char *bcrypt(const char *password, int cost)
{
    char salt[CRYPT_GENSALT_OUTPUT_SIZE];
    struct crypt_data cd;
    const char *h;
    memset(&cd, 0, sizeof cd);
    if (!crypt_gensalt_rn("$2b$", (unsigned long)cost, NULL, 0, salt, sizeof salt) ||
        !(h = crypt_rn(password, salt, &cd, (int)sizeof cd)) || h[0] == '*')
        bail("libcrypt cannot make a bcrypt hash");
    return strdup(h);
}

/* Starts the relay with web configuration text written to dir/name; waits
 * until its port takes connections. */
static pid_t start(const char *name, const char *text, int *port, char **logpath)
{
    char listen[64], *web = th_path(dir, name);
    pid_t pid;
    int64_t deadline;
    write_text(web, text);
    *port = th_free_port();
    *logpath = th_path(dir, "relay.log");
    snprintf(listen, sizeof listen, "127.0.0.1:%d", *port);
    pid = rt_relay_spawn(*logpath, dbpath, redis.url, "--metrics-listen", listen, "--metrics-web-config", web, NULL);
    deadline = th_now_ms() + 10000 * th_slow();
    while (th_now_ms() < deadline) {
        char *log = th_slurp(*logpath);
        int up = strstr(log, "serving /metrics") != NULL;
        free(log);
        if (up)
            break;
        th_sleep_ms(20);
    }
    free(web);
    return pid;
}

/* curl with args (a NULL-terminated list after the URL); the exit status,
 * its stdout in *out and stderr in *err (may be NULL). */
static int curl(char **out, char **err, const char *url, ...)
{
    char *argv[32];
    int n = 0;
    va_list ap;
    argv[n++] = "curl";
    argv[n++] = "-sS";
    argv[n++] = "--max-time";
    argv[n++] = "10";
    va_start(ap, url);
    while (n < 30 && (argv[n] = va_arg(ap, char *)) != NULL)
        n++;
    va_end(ap);
    argv[n++] = (char *)url;
    argv[n] = NULL;
    return th_run(argv, NULL, out, err, 20000 * th_slow());
}

static int has_promtool(void)
{
    char *argv[] = {"sh", "-c", "command -v promtool", NULL};
    return th_run(argv, NULL, NULL, NULL, 5000) == 0;
}

static void tls_and_auth(void)
{
    char url[128], hurl[128], text[1024], ipurl[128], *out = NULL, *err = NULL, *log, *hash = bcrypt("s3cret", 10);
    char cacert[300], *logpath;
    int port, rc;
    int64_t t0, first_ms, cached_ms;
    pid_t pid;

    snprintf(text, sizeof text,
             "# as for an exporter\ntls_server_config:\n  cert_file: %s\n  key_file: %s\n"
             "basic_auth_users:\n  prometheus: %s\n",
             tls_cert(certs, "server.crt"), tls_cert(certs, "server.key"), hash);
    pid = start("web.yml", text, &port, &logpath);
    snprintf(url, sizeof url, "https://localhost:%d/metrics", port);
    snprintf(hurl, sizeof hurl, "https://localhost:%d/healthz", port);
    snprintf(ipurl, sizeof ipurl, "https://127.0.0.1:%d/healthz", port);
    snprintf(cacert, sizeof cacert, "%s", tls_cert(certs, "ca.crt"));

    t0 = th_now_ms();
    rc = curl(&out, &err, url, "--cacert", cacert, "-u", "prometheus:s3cret", "-w", "\n%{http_code}", NULL);
    first_ms = th_now_ms() - t0;
    ok(rc == 0 && out && strstr(out, "outbox_published_total") && strstr(out, "\n200"),
       "curl scrapes /metrics over TLS with the password (exit %d%s%.200s)", rc, err && *err ? ": " : "",
       err ? err : "");
    free(out);
    free(err);
    out = err = NULL;
    t0 = th_now_ms();
    rc = curl(&out, NULL, hurl, "--cacert", cacert, "-u", "prometheus:s3cret", NULL);
    cached_ms = th_now_ms() - t0;
    ok(rc == 0 && out && !strcmp(out, "ok\n"), "/healthz too, by address as well as by name");
    free(out);
    out = NULL;
    rc = curl(&out, NULL, ipurl, "--cacert", cacert, "-u", "prometheus:s3cret", NULL);
    ok(rc == 0 && out && !strcmp(out, "ok\n"), "(the certificate's IP address entry verified)");
    free(out);
    out = NULL;
    diag("curl over TLS: the first authenticated scrape %lld ms (with its bcrypt check, cost 10), the next %lld ms "
         "(from the cache; curl's own start included)",
         (long long)first_ms, (long long)cached_ms);

    if (has_promtool()) {
        char cmd[600];
        char *argv[] = {"bash", "-o", "pipefail", "-c", cmd, NULL};
        snprintf(cmd, sizeof cmd,
                 "curl -sS --max-time 10 --cacert '%s' -u prometheus:s3cret %s | promtool check metrics", cacert, url);
        rc = th_run(argv, NULL, NULL, &err, 30000);
        is_int(rc, 0, "promtool check metrics passes the scrape taken over TLS%s%.300s", err && *err ? ": " : "",
               err ? err : "");
        free(err);
        err = NULL;
    } else {
        printf("ok %d - # SKIP promtool check metrics over TLS: promtool is not installed (bash tools/monitoring.sh "
               "installs it)\n",
               ++tap_count_);
    }

    rc = curl(&out, NULL, hurl, "--cacert", cacert, "-i", NULL);
    ok(rc == 0 && out && !strncmp(out, "HTTP/1.1 401 ", 13), "no credentials: 401");
    ok(out && strstr(out, "WWW-Authenticate: Basic realm=\"outbox\""), "with WWW-Authenticate: Basic");
    free(out);
    out = NULL;
    rc = curl(&out, NULL, url, "--cacert", cacert, "-i", "-u", "prometheus:wrong", NULL);
    ok(rc == 0 && out && !strncmp(out, "HTTP/1.1 401 ", 13) && strstr(out, "WWW-Authenticate: Basic"),
       "a wrong password: 401 with WWW-Authenticate");
    ok(out && !strstr(out, "outbox_published_total"), "and no metrics");
    free(out);
    out = NULL;
    rc = curl(&out, NULL, url, "--cacert", cacert, "-i", "-u", "nobody:s3cret", NULL);
    ok(rc == 0 && out && !strncmp(out, "HTTP/1.1 401 ", 13), "an unknown user: 401");
    free(out);
    out = NULL;
    rc = curl(&out, NULL, url, "--cacert", cacert, "-i", "-H", "Authorization: Bearer abc", NULL);
    ok(rc == 0 && out && !strncmp(out, "HTTP/1.1 401 ", 13), "another scheme than Basic: 401");
    free(out);
    out = NULL;

    /* Plaintext to the TLS port: closed, not answered. */
    {
        char *resp = NULL;
        const char req[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        int st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000);
        ok(st == 0 && resp && !*resp, "plaintext HTTP to the TLS port: the connection is closed without an answer");
        free(resp);
    }
    rc = curl(&out, &err, hurl, "-k", "--tlsv1.2", "--tls-max", "1.2", "-u", "prometheus:s3cret", NULL);
    ok(rc == 0 && out && !strcmp(out, "ok\n"), "TLS 1.2 is served too (exit %d %.100s)", rc, err ? err : "");
    free(out);
    free(err);
    out = err = NULL;

    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    log = th_slurp(logpath);
    ok(strstr(log, "tls=on basic_auth_users=1") != NULL, "it said it serves TLS with one user");
    ok(strstr(log, "msg=\"metrics endpoint: authentication failed\"") != NULL, "and logged the failed logins");
    ok(!strstr(log, "level=error"), "no errors in its log");
    free(log);
    unlink(logpath);
    free(logpath);
    free(hash);
}

/* Plain HTTP with users (allowed, with a warning): 40 connections at once
 * with 40 different wrong passwords. One check runs at a time and 16
 * requests wait for theirs, the one being checked included; the others get
 * 503 at once. The right password, checked once before,
 * passes from the cache meanwhile, and rows keep being published. */
static void password_crowd(void)
{
    enum { N = 40 };
    char text[512], *log, *logpath, *hash = bcrypt("right", 10), req[512];
    int port, fds[N], n401 = 0, n503 = 0, i, st;
    int64_t t0;
    pid_t pid;
    char *resp = NULL;
    /* base64("prometheus:right") */
    const char good[] = "GET /healthz HTTP/1.1\r\nAuthorization: Basic cHJvbWV0aGV1czpyaWdodA==\r\n\r\n";

    snprintf(text, sizeof text, "basic_auth_users:\n  prometheus: \"%s\"\n", hash);
    pid = start("plain-auth.yml", text, &port, &logpath);
    st = ot_http_raw(port, good, sizeof good - 1, &resp, 10000 * th_slow());
    is_int(st, 200, "basic authentication over plain HTTP: the right password passes");
    free(resp);
    resp = NULL;
    {
        static const char bad64[] = "GET /healthz HTTP/1.1\r\nAuthorization: Basic !!!!\r\n\r\n";
        static const char nocolon[] = "GET /healthz HTTP/1.1\r\nAuthorization: Basic cHJvbWV0aGV1cw==\r\n\r\n";
        static const char two[] = "GET /healthz HTTP/1.1\r\nAuthorization: Basic cHJvbWV0aGV1czpyaWdodA==\r\n"
                                  "authorization: Basic cHJvbWV0aGV1czpyaWdodA==\r\n\r\n";
        char big[1400];
        is_int(ot_http_raw(port, bad64, sizeof bad64 - 1, NULL, 5000), 401, "bad base64: 401");
        is_int(ot_http_raw(port, nocolon, sizeof nocolon - 1, NULL, 5000), 401, "credentials without ':': 401");
        is_int(ot_http_raw(port, two, sizeof two - 1, NULL, 5000), 400, "two Authorization headers: 400");
        snprintf(big, sizeof big, "GET /healthz HTTP/1.1\r\nAuthorization: Basic %01100d\r\n\r\n", 0);
        is_int(ot_http_raw(port, big, strlen(big), NULL, 5000), 431, "an Authorization header over 1 KiB: 431");
    }
    for (i = 0; i < N; i++) {
        char cred[64], b64[128];
        static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        size_t k, o = 0, len;
        snprintf(cred, sizeof cred, "prometheus:wrong%02d", i);
        len = strlen(cred);
        for (k = 0; k < len; k += 3) {
            unsigned v = (unsigned char)cred[k] << 16 | (k + 1 < len ? (unsigned char)cred[k + 1] << 8 : 0) |
                         (k + 2 < len ? (unsigned char)cred[k + 2] : 0);
            b64[o++] = tab[v >> 18 & 63];
            b64[o++] = tab[v >> 12 & 63];
            b64[o++] = k + 1 < len ? tab[v >> 6 & 63] : '=';
            b64[o++] = k + 2 < len ? tab[v & 63] : '=';
        }
        b64[o] = '\0';
        snprintf(req, sizeof req, "GET /metrics HTTP/1.1\r\nAuthorization: Basic %s\r\n\r\n", b64);
        fds[i] = ot_connect(port, i % 2 ? "127.0.0.6" : "127.0.0.7", 0);
        if (send(fds[i], req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req))
            bail("send: %s", strerror(errno));
    }
    rt_insert_rows(db, "crowd", 0, 50, "crowd", 0);
    t0 = th_now_ms();
    st = ot_http_raw(port, good, sizeof good - 1, &resp, 5000 * th_slow());
    is_int(st, 200, "while they wait, the right password passes from the cache");
    ok(th_now_ms() - t0 < 1000 * th_slow(), "at once (%lld ms)", (long long)(th_now_ms() - t0));
    free(resp);
    resp = NULL;
    for (i = 0; i < N; i++) {
        char buf[256];
        size_t len = 0;
        int64_t deadline = th_now_ms() + 30000 * th_slow();
        for (;;) {
            struct pollfd p = {fds[i], POLLIN, 0};
            ssize_t r;
            if (th_now_ms() >= deadline || poll(&p, 1, 100) < 0)
                break;
            if (!p.revents)
                continue;
            r = recv(fds[i], buf + len, sizeof buf - 1 - len, 0);
            if (r <= 0)
                break;
            len += (size_t)r;
            if (len >= sizeof buf - 1)
                break;
        }
        buf[len] = '\0';
        n401 += !strncmp(buf, "HTTP/1.1 401 ", 13);
        n503 += !strncmp(buf, "HTTP/1.1 503 ", 13);
        close(fds[i]);
    }
    diag("40 wrong passwords at once: %d answered 401 after their check, %d answered 503 at once", n401, n503);
    ok(n401 >= 16 && n401 + n503 == N, "each is answered: 401 after its check (%d), or 503 (%d) beyond the queue",
       n401, n503);
    ok(n503 >= N - 16 - 1, "the queue holds 16 requests (%d got 503)", n503);
    {
        int64_t deadline = th_now_ms() + 10000 * th_slow();
        while (th_now_ms() < deadline && th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'crowd' "
                                                        "AND state = 2") < 50)
            th_sleep_ms(20);
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'crowd' AND state = 2"), 50,
               "the rows written meanwhile are published");
    }
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    log = th_slurp(logpath);
    ok(strstr(log, "basic authentication without TLS") != NULL, "it warned that passwords cross in the clear");
    free(log);
    unlink(logpath);
    free(logpath);
    free(hash);
}

/* Client certificates: RequireAndVerifyClientCert with the test CA. */
static void client_certs(void)
{
    char text[1024], url[128], *logpath, *out = NULL;
    const char *ca = tls_cert(certs, "ca.crt");
    int port, rc;
    pid_t pid;
    snprintf(text, sizeof text,
             "tls_server_config:\n  cert_file: %s\n  key_file: %s\n  client_ca_file: %s\n"
             "  client_auth_type: RequireAndVerifyClientCert\n",
             tls_cert(certs, "server.crt"), tls_cert(certs, "server.key"), ca);
    pid = start("mtls.yml", text, &port, &logpath);
    snprintf(url, sizeof url, "https://localhost:%d/healthz", port);
    rc = curl(&out, NULL, url, "--cacert", ca, NULL);
    ok(rc != 0 && (!out || !*out), "RequireAndVerifyClientCert: a client without a certificate gets no answer (curl "
                                  "exit %d)",
       rc);
    free(out);
    out = NULL;
    rc = curl(&out, NULL, url, "--cacert", ca, "--cert", tls_cert(certs, "client.crt"), "--key",
              tls_cert(certs, "client.key"), NULL);
    ok(rc == 0 && out && !strcmp(out, "ok\n"), "one with a certificate of the CA is answered (exit %d)", rc);
    free(out);
    out = NULL;
    rc = curl(&out, NULL, url, "--cacert", ca, "--cert", tls_cert(certs, "other.crt"), "--key",
              tls_cert(certs, "other.key"), NULL);
    ok(rc == 0 && out && !strcmp(out, "ok\n"), "(any certificate of that CA: names are not checked)");
    free(out);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    unlink(logpath);
    free(logpath);
}

/* A file that cannot be used: exit 2 at start, naming the problem. */
static void bad_files(void)
{
    static const struct {
        const char *name, *text, *want;
    } cases[] = {
        {"unknown.yml", "tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n  certfile: b\n",
         "line 4: unknown key 'certfile' in tls_server_config"},
        {"top.yml", "basic_auth_user:\n  a: b\n", "line 1: unknown key 'basic_auth_user'"},
        {"unsupported.yml", "http_server_config:\n  http2: false\n",
         "'http_server_config' is not supported here"},
        {"hash.yml", "basic_auth_users:\n  alice: secret\n", "user 'alice': not a bcrypt hash"},
        {"nokey.yml", "tls_server_config:\n  cert_file: server.crt\n", "tls_server_config: missing key_file"},
        {"nocert.yml", "tls_server_config:\n  cert_file: /no/such.crt\n  key_file: /no/such.key\n",
         "certificate file '/no/such.crt': No such file or directory"},
        {"yaml.yml", "tls_server_config: [\n", "not valid YAML"},
        {"auth.yml", "tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Always\n",
         "client_auth_type: unknown value 'Always'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *path = th_path(dir, cases[i].name), *err = NULL;
        int rc;
        write_text(path, cases[i].text);
        rc = rt_relay_run(10000, &err, dbpath, redis.url, "--metrics-listen", "127.0.0.1:1", "--metrics-web-config",
                          path, NULL);
        ok(rc == 2 && err && strstr(err, cases[i].want) && strstr(err, "metrics-web-config"),
           "%s: exit 2 (%d) saying \"%s\"", cases[i].name, rc, cases[i].want);
        if (rc != 2 || !err || !strstr(err, cases[i].want))
            th_diag_tail("relay", err, 3);
        free(err);
        free(path);
    }
    {
        char *err = NULL;
        int rc = rt_relay_run(10000, &err, dbpath, redis.url, "--metrics-listen", "127.0.0.1:1", "--metrics-web-config",
                              "/no/such/web.yml", NULL);
        ok(rc == 2 && err && strstr(err, "/no/such/web.yml: No such file or directory"), "a missing file: exit 2 (%d)",
           rc);
        free(err);
        rc = rt_relay_run(10000, &err, dbpath, redis.url, "--metrics-web-config", "/no/such/web.yml", NULL);
        ok(rc == 2 && err && strstr(err, "given without metrics-listen"), "without --metrics-listen: exit 2 (%d)", rc);
        free(err);
    }
}

int main(void)
{
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    certs = tls_certs_make();
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "web.db");
    db = rt_open(dbpath);
    tls_and_auth();
    password_crowd();
    client_certs();
    bad_files();
    sqlite3_close_v2(db);
    free(dbpath);
    th_rmtree(dir);
    free(dir);
    tls_certs_free(certs);
    th_redis_destroy(&redis);
    return tap_done();
}
