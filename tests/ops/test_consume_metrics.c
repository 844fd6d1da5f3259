/*
 * outbox-consume --metrics-listen: /metrics with the consumer's counters
 * (applied, duplicates, failures, dead letters) and the group's pending
 * entries and lag, labelled by stream and group, valid for promtool where it
 * is installed; /healthz 503 once Redis is gone; the endpoint's limits (one
 * client's idle connections do not lock a probe out); TLS and basic auth
 * from --metrics-web-config; a file that cannot be used exits 2.
 */
#include <crypt.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "consumer/ct.h"
#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"
#include "tls_certs.h"

#define SERIES(name) name "{stream=\"outbox:orders\",group=\"billing\"}"

static th_redis redis;

/* The scrape's value of series, waiting up to timeout_ms for it to reach
 * at least want. */
static double wait_metric(int port, const char *series, double want, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms * th_slow();
    double v = -1;
    for (;;) {
        char *body = NULL;
        if (ot_http_get(port, "/metrics", &body) == 200)
            v = ot_prom_val(body, series);
        free(body);
        if (v >= want || th_now_ms() >= deadline)
            return v;
        th_sleep_ms(50);
    }
}

static void figures(const char *dir)
{
    redisContext *c = th_redis_client(&redis);
    char listen[64], *out = th_path(dir, "out.log"), *err = th_path(dir, "err.log"), *body = NULL;
    int port = th_free_port(), st, fds[100], i;
    double lag_seen = -1, v;
    pid_t pid;
    int64_t deadline;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);

    for (i = 0; i < 20; i++) {
        char id[16];
        snprintf(id, sizeof id, "m-%d", i);
        ct_xadd_msg(c, "outbox:orders", id, "orders", "x", 1, NULL);
    }
    ct_xadd_msg(c, "outbox:orders", "m-3", "orders", "x", 1, NULL); /* a duplicate */
    ct_xadd_fields(c, "outbox:orders", NULL, 2, "id", "bad-1", (size_t)5, "envelope", "not msgpack", (size_t)11);
    {
        /* One message at a time, each taking 100 ms: the group lags. */
        const char *args[] = {"--redis", redis.url, "--stream", "outbox:orders", "--group", "billing", "--exec",
                              "sleep 0.1", "--max-inflight", "1", "--batch", "1", "--metrics-listen", listen,
                              "--health-redis-down-ms", "1500", NULL};
        pid = ct_consume_spawn(args, NULL, out, err);
    }
    deadline = th_now_ms() + 5000 * th_slow();
    while (th_now_ms() < deadline && lag_seen <= 0) {
        if (ot_http_get(port, "/metrics", &body) == 200)
            lag_seen = ot_prom_val(body, SERIES("outbox_consumer_lag"));
        free(body);
        body = NULL;
        th_sleep_ms(50);
    }
    ok(lag_seen > 0, "outbox_consumer_lag shows the entries not yet delivered (%.0f)", lag_seen);
    v = wait_metric(port, SERIES("outbox_consumer_applied_total"), 20, 15000);
    is_int((long long)v, 20, "outbox_consumer_applied_total counts the 20 messages applied");
    v = wait_metric(port, SERIES("outbox_consumer_dead_lettered_total"), 1, 5000);
    is_int((long long)v, 1, "outbox_consumer_dead_lettered_total the malformed entry");
    th_sleep_ms(1200); /* the group's figures are asked for every second */
    st = ot_http_get(port, "/metrics", &body);
    is_int(st, 200, "/metrics answers");
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_duplicates_total")), 1,
           "outbox_consumer_duplicates_total the message sent twice");
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_failures_total")), 0,
           "outbox_consumer_failures_total 0");
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_pending")), 0, "outbox_consumer_pending 0 once done");
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_lag")), 0, "outbox_consumer_lag 0");
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_redis_up")), 1, "outbox_consumer_redis_up 1");
    {
        const char *why = NULL;
        int bad = ot_prom_check(body, &why);
        is_int(bad, 0, "the scrape is valid exposition format (%s)", why ? why : "");
    }
    {
        char *path = th_path(dir, "scrape.txt"), cmd[400];
        char *argv[] = {"sh", "-c", cmd, NULL};
        FILE *f = fopen(path, "w");
        if (!f || fputs(body, f) < 0 || fclose(f) != 0)
            bail("cannot write %s", path);
        snprintf(cmd, sizeof cmd, "command -v promtool >/dev/null || exit 77; promtool check metrics < '%s'", path);
        st = th_run(argv, NULL, NULL, NULL, 30000);
        if (st == 77)
            printf("ok %d - # SKIP promtool check metrics: promtool is not installed\n", ++tap_count_);
        else
            is_int(st, 0, "promtool check metrics passes it");
        free(path);
    }
    free(body);
    body = NULL;

    /* One client's idle connections do not lock a probe out. */
    for (i = 0; i < 100; i++)
        fds[i] = ot_connect(port, "127.0.0.1", 1);
    th_sleep_ms(100);
    st = ot_http_get(port, "/healthz", &body);
    is_int(st, 200, "with 100 idle connections of one client open, /healthz answers 200");
    ok(body && !strcmp(body, "ok\n"), "its body says ok");
    free(body);
    body = NULL;
    for (i = 0; i < 100; i++)
        close(fds[i]);

    th_redis_stop(&redis);
    deadline = th_now_ms() + 8000 * th_slow();
    while (th_now_ms() < deadline && (st = ot_http_get(port, "/healthz", &body)) != 503) {
        free(body);
        body = NULL;
        th_sleep_ms(100);
    }
    is_int(st, 503, "Redis gone: /healthz answers 503 after --health-redis-down-ms");
    ok(body && strstr(body, "unhealthy: redis has not answered"), "saying why (%s)", body ? body : "");
    free(body);
    body = NULL;
    ot_http_get(port, "/metrics", &body);
    is_int((long long)ot_prom_val(body, SERIES("outbox_consumer_redis_up")), 0, "outbox_consumer_redis_up 0");
    ok(ot_prom_val(body, SERIES("outbox_consumer_pending")) < 0, "and no pending figure it does not know");
    free(body);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "outbox-consume stops cleanly");
    redisFree(c);
    free(out);
    free(err);
}

static void web_config(const char *dir)
{
    tls_certs *certs = tls_certs_make();
    char listen[64], text[1024], url[128], *web = th_path(dir, "web.yml"), *out = NULL, *log = th_path(dir, "c.log");
    char salt[CRYPT_GENSALT_OUTPUT_SIZE];
    struct crypt_data cd;
    const char *hash;
    int port = th_free_port(), rc;
    pid_t pid;
    FILE *f;
    int64_t deadline;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    memset(&cd, 0, sizeof cd);
    if (!crypt_gensalt_rn("$2b$", 4, NULL, 0, salt, sizeof salt) ||
        !(hash = crypt_rn("s3cret", salt, &cd, (int)sizeof cd)) || hash[0] == '*')
        bail("libcrypt cannot make a bcrypt hash");
    snprintf(text, sizeof text, "tls_server_config:\n  cert_file: %s\n  key_file: %s\nbasic_auth_users:\n  prom: %s\n",
             tls_cert(certs, "server.crt"), tls_cert(certs, "server.key"), hash);
    if (!(f = fopen(web, "w")) || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s", web);
    {
        const char *args[] = {"--redis", redis.url, "--stream", "outbox:orders", "--group", "billing", "--print",
                              "--metrics-listen", listen, "--metrics-web-config", web, NULL};
        pid = ct_consume_spawn(args, NULL, NULL, log);
    }
    snprintf(url, sizeof url, "https://localhost:%d/metrics", port);
    deadline = th_now_ms() + 10000 * th_slow();
    do {
        char *argv[] = {"curl", "-sS", "--max-time", "5", "--cacert", (char *)tls_cert(certs, "ca.crt"), "-u",
                        "prom:s3cret", url, NULL};
        free(out);
        out = NULL;
        rc = th_run(argv, NULL, &out, NULL, 10000);
        if (rc == 0 && out && strstr(out, "outbox_consumer_applied_total"))
            break;
        th_sleep_ms(100);
    } while (th_now_ms() < deadline);
    ok(rc == 0 && out && strstr(out, SERIES("outbox_consumer_applied_total")),
       "--metrics-web-config: curl scrapes outbox-consume over TLS with the password (exit %d)", rc);
    free(out);
    out = NULL;
    {
        char *argv[] = {"curl", "-sS", "-i", "--max-time", "5", "--cacert", (char *)tls_cert(certs, "ca.crt"), url,
                        NULL};
        rc = th_run(argv, NULL, &out, NULL, 10000);
        ok(rc == 0 && out && !strncmp(out, "HTTP/1.1 401 ", 13) && strstr(out, "WWW-Authenticate: Basic"),
           "without the password: 401 with WWW-Authenticate");
        free(out);
        out = NULL;
    }
    is_int(th_stop(pid, SIGTERM, 10000), 0, "outbox-consume stops cleanly");
    {
        char *err = NULL;
        const char *args[] = {"--redis", redis.url, "--stream", "s", "--group", "g", "--print", "--metrics-listen",
                              listen, "--metrics-web-config", "/no/such.yml", NULL};
        if (!(f = fopen(web, "w")) || fputs("tls_server_config:\n  cert_file: a\n", f) < 0 || fclose(f) != 0)
            bail("cannot write %s", web);
        rc = ct_consume_run(args, NULL, NULL, &err, 10000);
        ok(rc == 2 && err && strstr(err, "--metrics-web-config: /no/such.yml: No such file or directory"),
           "a missing web configuration: exit 2 (%d)", rc);
        free(err);
        err = NULL;
        args[10] = web;
        rc = ct_consume_run(args, NULL, NULL, &err, 10000);
        ok(rc == 2 && err && strstr(err, "tls_server_config: missing key_file"),
           "one without key_file: exit 2 naming it (%d)", rc);
        free(err);
        err = NULL;
        args[8] = "1.2.3";
        rc = ct_consume_run(args, NULL, NULL, &err, 10000);
        ok(rc == 2 && err && strstr(err, "--metrics-listen: '1.2.3' has no port"), "a listen address without a port: "
           "exit 2 naming --metrics-listen (%d)", rc);
        free(err);
        err = NULL;
        args[7] = "--metrics-web-config";
        args[8] = web;
        args[9] = NULL;
        rc = ct_consume_run(args, NULL, NULL, &err, 10000);
        ok(rc == 2 && err && strstr(err, "--metrics-web-config: given without --metrics-listen"),
           "--metrics-web-config without --metrics-listen: exit 2 (%d)", rc);
        free(err);
    }
    free(web);
    free(log);
    tls_certs_free(certs);
}

int main(void)
{
    char *dir;
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    web_config(dir);
    figures(dir);
    th_rmtree(dir);
    free(dir);
    th_redis_destroy(&redis);
    return tap_done();
}
