/*
 * The run's environment: a private redis-server on a Unix socket in the
 * temporary directory (no persistence: the relay is measured, not Redis's
 * disk), hiredis helpers and the redis-benchmark reference.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

redisContext *bench_redis_connect(const bench *b)
{
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(b->sock, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    return c;
}

int bench_env_start(bench *b, char *err, size_t errlen)
{
    char logpath[PATH_MAX + 32];
    const char *argv[24];
    int a = 0;
    uint64_t deadline;

    snprintf(b->sock, sizeof b->sock, "%s/redis.sock", b->tmpdir);
    snprintf(b->redis_url, sizeof b->redis_url, "unix://%s", b->sock);
    bench_path(b, logpath, sizeof logpath, "redis.log");
    argv[a++] = "redis-server";
    argv[a++] = "--port";
    argv[a++] = "0";
    argv[a++] = "--unixsocket";
    argv[a++] = b->sock;
    argv[a++] = "--unixsocketperm";
    argv[a++] = "700";
    argv[a++] = "--save";
    argv[a++] = "";
    argv[a++] = "--appendonly";
    argv[a++] = "no";
    argv[a++] = "--dir";
    argv[a++] = b->tmpdir;
    argv[a++] = "--logfile";
    argv[a++] = logpath;
    argv[a++] = "--daemonize";
    argv[a++] = "no";
    argv[a++] = "--loglevel";
    argv[a++] = "warning";
    argv[a] = NULL;
    if (bench_spawn(argv, NULL, NULL, &b->redis_pid) != 0) {
        snprintf(err, errlen, "cannot start redis-server: %s", strerror(errno));
        return -1;
    }
    deadline = bench_mono_us() + 10000000u;
    while (bench_mono_us() < deadline) {
        int st;
        if (waitpid(b->redis_pid, &st, WNOHANG) == b->redis_pid) {
            char tail[512];
            bench_tail_file(logpath, tail, sizeof tail, 3);
            snprintf(err, errlen, "redis-server exited at start: %s", tail);
            b->redis_pid = 0;
            return -1;
        }
        if (access(b->sock, F_OK) == 0) {
            b->rc = bench_redis_connect(b);
            if (b->rc) {
                redisReply *r = redisCommand(b->rc, "PING");
                int ok = r && r->type == REDIS_REPLY_STATUS;
                freeReplyObject(r);
                if (ok)
                    return 0;
                redisFree(b->rc);
                b->rc = NULL;
            }
        }
        bench_sleep_ms(10);
    }
    snprintf(err, errlen, "redis-server did not answer on %s within 10 s", b->sock);
    return -1;
}

void bench_env_stop(bench *b)
{
    if (b->rc) {
        redisFree(b->rc);
        b->rc = NULL;
    }
    if (b->redis_pid > 0) {
        bench_stop(b->redis_pid, NULL, NULL, 10000);
        b->redis_pid = 0;
    }
}

redisReply *bench_redis(bench *b, const char *fmt, ...)
{
    va_list ap;
    redisReply *r;
    if (!b->rc) {
        b->rc = bench_redis_connect(b);
        if (!b->rc)
            return NULL;
    }
    va_start(ap, fmt);
    r = redisvCommand(b->rc, fmt, ap);
    va_end(ap);
    if (!r) {
        /* The connection is broken: reconnect next time. */
        redisFree(b->rc);
        b->rc = NULL;
    }
    return r;
}

int bench_redis_flush(bench *b)
{
    redisReply *r = bench_redis(b, "FLUSHALL SYNC");
    int ok = r && r->type == REDIS_REPLY_STATUS;
    freeReplyObject(r);
    return ok ? 0 : -1;
}

long long bench_streams_len(redisContext *c)
{
    long long total = 0;
    int i;
    for (i = 0; i < BENCH_TOPICS; i++)
        redisAppendCommand(c, "XLEN outbox:bench.t%d", i);
    for (i = 0; i < BENCH_TOPICS; i++) {
        void *rp = NULL;
        redisReply *r;
        if (redisGetReply(c, &rp) != REDIS_OK)
            return -1;
        r = rp;
        if (r->type == REDIS_REPLY_INTEGER)
            total += r->integer;
        else
            total = -1000000000000LL;
        freeReplyObject(r);
    }
    return total < 0 ? -1 : total;
}

long long bench_redis_used_memory(bench *b)
{
    redisReply *r = bench_redis(b, "INFO memory");
    long long v = -1;
    if (r && r->type == REDIS_REPLY_STRING) {
        const char *p = strstr(r->str, "used_memory:");
        if (p)
            v = atoll(p + 12);
    }
    freeReplyObject(r);
    return v;
}

int bench_redis_benchmark(bench *b, long n, int clients, int pipeline, size_t envelope_len, double *rps,
                          double *p50_ms, char *err, size_t errlen)
{
    char out[PATH_MAX + 32], nbuf[32], cbuf[16], pbuf[16];
    char id[37], *env = NULL, *text = NULL;
    const char *argv[24];
    int a = 0, status = 0;
    pid_t pid;
    FILE *f;
    size_t cap = 0, len = 0;
    const char *p, *last = NULL;

    *rps = 0;
    *p50_ms = 0;
    memset(id, 'i', 36);
    id[36] = '\0';
    env = malloc(envelope_len + 1);
    if (!env)
        return -1;
    memset(env, 'e', envelope_len);
    env[envelope_len] = '\0';
    snprintf(nbuf, sizeof nbuf, "%ld", n);
    snprintf(cbuf, sizeof cbuf, "%d", clients);
    snprintf(pbuf, sizeof pbuf, "%d", pipeline);
    bench_path(b, out, sizeof out, "redis-benchmark.out");
    unlink(out);
    argv[a++] = "redis-benchmark";
    argv[a++] = "-s";
    argv[a++] = b->sock;
    argv[a++] = "-n";
    argv[a++] = nbuf;
    argv[a++] = "-c";
    argv[a++] = cbuf;
    argv[a++] = "-P";
    argv[a++] = pbuf;
    argv[a++] = "-q";
    argv[a++] = "XADD";
    argv[a++] = "outbox:bench";
    argv[a++] = "*";
    argv[a++] = "id";
    argv[a++] = id;
    argv[a++] = "envelope";
    argv[a++] = env;
    argv[a] = NULL;
    if (bench_spawn(argv, out, out, &pid) != 0) {
        snprintf(err, errlen, "cannot run redis-benchmark: %s", strerror(errno));
        free(env);
        return -1;
    }
    free(env);
    if (bench_wait(pid, &status, NULL, 600000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char st[32];
        snprintf(err, errlen, "redis-benchmark failed (%s)", bench_status_text(status, st, sizeof st));
        return -1;
    }
    f = fopen(out, "r");
    if (!f) {
        snprintf(err, errlen, "cannot read redis-benchmark output");
        return -1;
    }
    for (;;) {
        if (len + 4096 >= cap) {
            cap = cap ? cap * 2 : 65536;
            char *np = realloc(text, cap);
            if (!np)
                break;
            text = np;
        }
        size_t got = fread(text + len, 1, cap - len - 1, f);
        if (!got)
            break;
        len += got;
    }
    fclose(f);
    if (!text) {
        snprintf(err, errlen, "empty redis-benchmark output");
        return -1;
    }
    text[len] = '\0';
    /* The final line reads "<command>: 92592.59 requests per second, p50=0.135 msec";
     * progress lines before it use "rps=". */
    for (p = text; (p = strstr(p, " requests per second")) != NULL; p++)
        last = p;
    if (!last) {
        snprintf(err, errlen, "no 'requests per second' in the redis-benchmark output");
        free(text);
        return -1;
    }
    p = last;
    while (p > text && (p[-1] == '.' || (p[-1] >= '0' && p[-1] <= '9')))
        p--;
    *rps = strtod(p, NULL);
    p = strstr(last, "p50=");
    if (p)
        *p50_ms = strtod(p + 4, NULL);
    free(text);
    freeReplyObject(bench_redis(b, "DEL outbox:bench"));
    if (*rps <= 0) {
        snprintf(err, errlen, "could not parse the redis-benchmark rate");
        return -1;
    }
    return 0;
}
