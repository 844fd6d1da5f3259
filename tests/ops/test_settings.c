/*
 * The operations settings are checked before anything starts: bad
 * --metrics-listen values, idempotent mode combined with --wait-replicas,
 * a retention below a second, out-of-range values all exit 2 naming the
 * setting; a metrics port already in use makes the daemon exit 2 with
 * "cannot listen" before it claims anything.
 */
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

static char *dir, *dbpath;
static const char *url = "unix:///nonexistent/outbox-test/redis.sock";

static void refused(const char *what, const char *needle, ...)
{
    /* Up to 4 extra arguments. */
    va_list ap;
    const char *a[5] = {NULL, NULL, NULL, NULL, NULL};
    char *err = NULL;
    int i, st;
    va_start(ap, needle);
    for (i = 0; i < 4 && (a[i] = va_arg(ap, const char *)) != NULL; i++)
        ;
    va_end(ap);
    st = rt_relay_run(10000, &err, dbpath, url, a[0], a[1], a[2], a[3], NULL);
    is_int(st, 2, "%s: exit 2", what);
    ok(err && strstr(err, needle), "%s: the message names %s", what, needle);
    if (st != 2 || !err || !strstr(err, needle))
        th_diag_tail(what, err ? err : "", 5);
    free(err);
}

static void bad_listen(void)
{
    static const char *const bad[] = {
        "127.0.0.1",       /* no port */
        "127.0.0.1:",      /* empty port */
        "127.0.0.1:0",     /* port 0 */
        "127.0.0.1:70000", /* beyond 65535 */
        "127.0.0.1:-1",
        "127.0.0.1:+80",   /* not digits only */
        "127.0.0.1: 80",
        "127.0.0.1:80x",
        "example.com:9464", /* a host name other than localhost */
        "256.1.1.1:9464",
        "[::1",             /* unterminated */
        "[::1]",
        "[::1]:",
        "[nonsense]:9464",
        "",
    };
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char what[80];
        snprintf(what, sizeof what, "--metrics-listen '%s'", bad[i]);
        refused(what, "metrics-listen", "--metrics-listen", bad[i], NULL);
    }
}

static void port_in_use(void)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), st;
    char listen_at[64], *err = NULL;
    int64_t t0;
    sqlite3 *db;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 4) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        bail("cannot listen on a loopback port: %s", strerror(errno));
    snprintf(listen_at, sizeof listen_at, "127.0.0.1:%d", ntohs(a.sin_port));
    db = rt_open(dbpath);
    rt_insert_rows(db, "p", 0, 10, "t", 0);
    t0 = th_now_ms();
    st = rt_relay_run(10000, &err, dbpath, url, "--metrics-listen", listen_at, NULL);
    is_int(st, 2, "a metrics port in use: exit 2");
    ok(err && strstr(err, "cannot listen"), "the message says cannot listen");
    if (!err || !strstr(err, "cannot listen"))
        th_diag_tail("port in use", err ? err : "", 5);
    ok(th_now_ms() - t0 < 3000, "at once (%lld ms)", (long long)(th_now_ms() - t0));
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 0 OR attempts <> 0"), 0,
           "nothing was claimed");
    free(err);
    sqlite3_close_v2(db);
    close(fd);
}

static void good_listen(void)
{
    th_redis redis;
    int port = th_free_port(), st = 0;
    char listen_at[64], *log = th_path(dir, "relay.log");
    pid_t pid;
    int64_t deadline;
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    snprintf(listen_at, sizeof listen_at, "localhost:%d", port);
    pid = rt_relay_spawn(log, dbpath, redis.url, "--metrics-listen", listen_at, NULL);
    deadline = th_now_ms() + 5000;
    while (th_now_ms() < deadline && (st = ot_http_get(port, "/healthz", NULL)) != 200)
        th_sleep_ms(10);
    is_int(st, 200, "--metrics-listen localhost:PORT serves /healthz on 127.0.0.1");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "and stops cleanly");
    th_redis_destroy(&redis);
    free(log);
}

int main(void)
{
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "settings.db");

    bad_listen();
    refused("--idempotent --wait-replicas 1", "wait-replicas", "--idempotent", "--wait-replicas", "1", NULL);
    refused("--retention-ms 5", "retention-ms", "--retention-ms", "5", NULL);
    refused("--retention-ms 999", "retention-ms", "--retention-ms", "999", NULL);
    refused("--retention-batch 0", "retention-batch", "--retention-batch", "0", NULL);
    refused("--retention-batch 100001", "retention-batch", "--retention-batch", "100001", NULL);
    refused("--health-redis-down-ms 0", "health-redis-down-ms", "--health-redis-down-ms", "0", NULL);
    refused("--idempotent-retention-ms 999", "idempotent-retention-ms", "--idempotent", "--idempotent-retention-ms",
            "999", NULL);
    port_in_use();
    good_listen();

    free(dbpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
