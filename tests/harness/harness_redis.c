/*
 * harness_redis.c: see harness.h. redis-server started in a temporary
 * directory and stopped by its pid, and a synchronous client.
 *
 * Every redis-server started here runs in a temporary directory from
 * th_tmpdir, is recorded for the clean-up at exit as th_spawn's children are
 * (harness_proc.c), and gets PR_SET_PDEATHSIG: a test that bails out or
 * crashes does not leave servers or temporary directories behind.
 */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness_int.h"
#include "tap.h"

/* Another process could take the port before redis-server binds it;
 * th_redis_start retries in that case. */
/* A loopback port bound (not listening) by *fd, or -1. */
static int bound_port(int *fd)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port = -1;
    *fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (*fd < 0)
        return -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(*fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(*fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (port < 0) {
        close(*fd);
        *fd = -1;
    }
    return port;
}

int th_free_port(void)
{
    int fd, port = bound_port(&fd);
    if (fd >= 0)
        close(fd);
    return port;
}

int th_refused_port(int *fd)
{
    return bound_port(fd);
}

static int write_config(th_redis *r)
{
    char *conf = th_path(r->dir, "redis.conf");
    FILE *f = fopen(conf, "w");
    if (!f) {
        diag("cannot write %s: %s", conf, strerror(errno));
        free(conf);
        return -1;
    }
    fprintf(f, "port %d\n", r->port);
    /* "-::1": also IPv6 loopback when the host has it (optional bind). */
    if (r->port)
        fprintf(f, "bind 127.0.0.1 -::1\n");
    fprintf(f,
            "unixsocket %s\n"
            "unixsocketperm 700\n"
            "dir %s\n"
            "logfile %s/redis.log\n"
            "daemonize no\n"
            "save \"\"\n"
            "appendonly no\n"
            "databases 16\n",
            r->sock, r->dir, r->dir);
    fputs(r->extra, f);
    if (r->extra[0] && r->extra[strlen(r->extra) - 1] != '\n')
        fputc('\n', f);
    fclose(f);
    free(conf);
    return 0;
}

static void print_log_tail(const th_redis *r)
{
    char *log = th_path(r->dir, "redis.log"), line[512];
    FILE *f = fopen(log, "r");
    free(log);
    if (!f)
        return;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        diag("redis.log: %s", line);
    }
    fclose(f);
}

/* The password from a "requirepass" line of the extra config, if any. */
static int config_password(const th_redis *r, char *pw, size_t len)
{
    const char *p = r->extra;
    while (p && *p) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (n > 12 && strncmp(p, "requirepass ", 12) == 0 && n - 12 < len) {
            memcpy(pw, p + 12, n - 12);
            pw[n - 12] = '\0';
            return 1;
        }
        p = nl ? nl + 1 : NULL;
    }
    return 0;
}

/* Waits until the server answers on its socket (PING, or an authentication
 * error, which also proves it is up). */
static int wait_ready(th_redis *r, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    while (th_now_ms() < deadline) {
        struct timeval tv = {1, 0};
        redisContext *c;
        int st = th_wait(r->pid, 0);
        if (st >= 0) {
            diag("redis-server exited during start-up (status %d)", st);
            r->pid = 0;
            return -1;
        }
        c = redisConnectUnixWithTimeout(r->sock, tv);
        if (c && !c->err) {
            redisReply *rep = redisCommand(c, "PING");
            int up = rep && (rep->type == REDIS_REPLY_STATUS ||
                             (rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "NOAUTH", 6) == 0));
            if (rep)
                freeReplyObject(rep);
            redisFree(c);
            if (up)
                return 0;
        } else if (c) {
            redisFree(c);
        }
        th_sleep_ms(10);
    }
    diag("redis-server did not answer PING within %d ms", timeout_ms);
    return -1;
}

static int launch(th_redis *r)
{
    char *conf = th_path(r->dir, "redis.conf");
    char *out = th_path(r->dir, "redis.stdout");
    char *argv[] = {"redis-server", conf, NULL};
    int out_fd = open(out, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    r->pid = th__spawn_fds(argv, NULL, out_fd, out_fd, 1);
    if (out_fd >= 0)
        close(out_fd);
    free(conf);
    free(out);
    if (r->pid < 0) {
        r->pid = 0;
        return -1;
    }
    th__track_pid(r->pid);
    if (wait_ready(r, 5000) < 0) {
        print_log_tail(r);
        th_redis_kill(r);
        return -1;
    }
    return 0;
}

int th_redis_start(th_redis *r, int with_tcp, const char *extra_conf)
{
    struct sockaddr_un sa;
    int attempt;

    memset(r, 0, sizeof *r);
    if (extra_conf && strlen(extra_conf) >= sizeof r->extra) {
        diag("th_redis_start: extra config too long");
        return -1;
    }
    snprintf(r->extra, sizeof r->extra, "%s", extra_conf ? extra_conf : "");
    r->dir = th_tmpdir();
    if ((size_t)snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir) >= sizeof sa.sun_path) {
        /* A long $TMPDIR would make the socket path unusable. */
        th_rmtree(r->dir);
        free(r->dir);
        setenv("TMPDIR", "/tmp", 1);
        r->dir = th_tmpdir();
        snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    }
    snprintf(r->url, sizeof r->url, "unix://%s", r->sock);

    for (attempt = 0; attempt < 3; attempt++) {
        if (with_tcp) {
            r->port = th_free_port();
            if (r->port <= 0) {
                diag("no free loopback port");
                break;
            }
            snprintf(r->tcp_url, sizeof r->tcp_url, "redis://127.0.0.1:%d", r->port);
        }
        if (write_config(r) < 0)
            break;
        if (launch(r) == 0)
            return 0;
        if (!with_tcp)
            break; /* retrying only helps when the port was taken */
    }
    diag("could not start redis-server (is it installed?)");
    th_redis_destroy(r);
    return -1;
}

void th_redis_stop(th_redis *r)
{
    if (!r || r->pid <= 0)
        return;
    th_stop(r->pid, SIGTERM, 5000);
    r->pid = 0;
}

void th_redis_kill(th_redis *r)
{
    if (!r || r->pid <= 0)
        return;
    th_stop(r->pid, SIGKILL, -1);
    r->pid = 0;
}

int th_redis_restart(th_redis *r)
{
    if (!r || !r->dir)
        return -1;
    if (r->pid > 0)
        th_redis_stop(r);
    return launch(r);
}

void th_redis_destroy(th_redis *r)
{
    if (!r)
        return;
    th_redis_stop(r);
    if (r->dir) {
        th_rmtree(r->dir);
        free(r->dir);
        r->dir = NULL;
    }
}

/* ---- client -------------------------------------------------------------- */

redisContext *th_redis_client(const th_redis *r)
{
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    char pw[256];
    if (!c)
        bail("redis client: out of memory");
    if (c->err)
        bail("redis client %s: %s", r->sock, c->errstr);
    if (config_password(r, pw, sizeof pw)) {
        redisReply *rep = th_cmd(c, "AUTH %s", pw);
        if (rep->type == REDIS_REPLY_ERROR)
            bail("redis client AUTH: %s", rep->str);
        freeReplyObject(rep);
    }
    return c;
}

redisReply *th_cmd(redisContext *c, const char *fmt, ...)
{
    va_list ap;
    redisReply *rep;
    va_start(ap, fmt);
    rep = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (!rep)
        bail("redis command failed: %s", c->errstr);
    return rep;
}

long long th_xlen(redisContext *c, const char *stream)
{
    redisReply *rep = redisCommand(c, "XLEN %s", stream);
    long long n = -1;
    if (!rep)
        return -1;
    if (rep->type == REDIS_REPLY_INTEGER)
        n = rep->integer;
    freeReplyObject(rep);
    return n;
}
