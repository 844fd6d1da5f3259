/*
 * The run's environment: a private redis-server on a Unix socket in the
 * temporary directory (no persistence: the relay is measured, not Redis's
 * disk), a second one with a plaintext and a TLS loopback port for the TLS
 * drain, hiredis helpers and the redis-benchmark reference.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

/* Starts redis-server on the Unix socket sock (no persistence, its log in
 * the temporary directory under logname) with the extra arguments (NULL
 * terminated, may be NULL), and waits until PING answers there; *rc is then
 * a connection on the socket. */
static int server_start(const bench *b, const char *sock, const char *logname, const char *const *extra,
                        pid_t *pid, redisContext **rc, char *err, size_t errlen)
{
    char logpath[PATH_MAX + 32];
    const char *argv[48];
    int a = 0;
    uint64_t deadline;
    struct timeval tv = {5, 0};

    bench_path(b, logpath, sizeof logpath, logname);
    argv[a++] = "redis-server";
    argv[a++] = "--port";
    argv[a++] = "0";
    argv[a++] = "--unixsocket";
    argv[a++] = sock;
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
    /* A later "--port" wins over the one above. */
    for (; extra && *extra && a < 47; extra++)
        argv[a++] = *extra;
    argv[a] = NULL;
    if (bench_spawn(argv, NULL, NULL, pid) != 0) {
        snprintf(err, errlen, "cannot start redis-server: %s", strerror(errno));
        return -1;
    }
    deadline = bench_mono_us() + 10000000u;
    while (bench_mono_us() < deadline) {
        int st;
        if (waitpid(*pid, &st, WNOHANG) == *pid) {
            char tail[512];
            bench_tail_file(logpath, tail, sizeof tail, 3);
            snprintf(err, errlen, "redis-server exited at start: %s", tail);
            *pid = 0;
            return -1;
        }
        if (access(sock, F_OK) == 0) {
            *rc = redisConnectUnixWithTimeout(sock, tv);
            if (*rc && !(*rc)->err) {
                redisReply *r = redisCommand(*rc, "PING");
                int ok = r && r->type == REDIS_REPLY_STATUS;
                freeReplyObject(r);
                if (ok)
                    return 0;
            }
            redisFree(*rc);
            *rc = NULL;
        }
        bench_sleep_ms(10);
    }
    snprintf(err, errlen, "redis-server did not answer on %s within 10 s", sock);
    return -1;
}

/* Closes rc and stops the server started by server_start. */
static void server_stop(pid_t *pid, redisContext **rc)
{
    if (*rc) {
        redisFree(*rc);
        *rc = NULL;
    }
    if (*pid > 0) {
        bench_stop(*pid, NULL, NULL, 10000);
        *pid = 0;
    }
}

int bench_env_start(bench *b, char *err, size_t errlen)
{
    snprintf(b->sock, sizeof b->sock, "%s/redis.sock", b->tmpdir);
    snprintf(b->redis_url, sizeof b->redis_url, "unix://%s", b->sock);
    return server_start(b, b->sock, "redis.log", NULL, &b->redis_pid, &b->rc, err, errlen);
}

int bench_free_port(void)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

/* Runs the openssl command with the NULL-terminated arguments. */
static int run_openssl(const bench *b, const char *const *args, char *err, size_t errlen)
{
    const char *argv[32];
    char out[PATH_MAX + 32], tail[300], st[32];
    int a = 0, status = 0;
    pid_t pid;
    argv[a++] = "openssl";
    for (; *args && a < 31; args++)
        argv[a++] = *args;
    argv[a] = NULL;
    bench_path(b, out, sizeof out, "openssl.out");
    if (bench_spawn(argv, out, out, &pid) != 0) {
        snprintf(err, errlen, "cannot run openssl: %s", strerror(errno));
        return -1;
    }
    if (bench_wait(pid, &status, NULL, 60000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        bench_tail_file(out, tail, sizeof tail, 3);
        snprintf(err, errlen, "openssl %s: %s: %s", argv[1], bench_status_text(status, st, sizeof st), tail);
        return -1;
    }
    return 0;
}

int bench_tls_server_start(bench *b, bench_tls_server *t, char *err, size_t errlen)
{
    char port[16], tls_port[16];
    memset(t, 0, sizeof t[0]);
    bench_path(b, t->cert, sizeof t->cert, "tls-server.crt");
    bench_path(b, t->key, sizeof t->key, "tls-server.key");
    bench_path(b, t->sock, sizeof t->sock, "redis-tls.sock");
    {
        /* A self-signed certificate for 127.0.0.1, which is also its own CA:
         * the relay verifies it as it would any server's. */
        const char *args[] = {"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                              "-nodes", "-keyout", t->key, "-out", t->cert, "-days", "2", "-subj", "/CN=localhost",
                              "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", NULL};
        if (run_openssl(b, args, err, errlen) != 0)
            return -1;
    }
    t->port = bench_free_port();
    t->tls_port = bench_free_port();
    if (t->port < 0 || t->tls_port < 0 || t->port == t->tls_port) {
        snprintf(err, errlen, "cannot find two free loopback ports");
        return -1;
    }
    snprintf(port, sizeof port, "%d", t->port);
    snprintf(tls_port, sizeof tls_port, "%d", t->tls_port);
    snprintf(t->tcp_url, sizeof t->tcp_url, "redis://127.0.0.1:%d", t->port);
    snprintf(t->tls_url, sizeof t->tls_url, "rediss://127.0.0.1:%d", t->tls_port);
    {
        const char *extra[] = {"--bind", "127.0.0.1", "--port", port, "--tls-port", tls_port, "--tls-cert-file",
                               t->cert, "--tls-key-file", t->key, "--tls-ca-cert-file", t->cert,
                               "--tls-auth-clients", "no", NULL};
        return server_start(b, t->sock, "redis-tls.log", extra, &t->pid, &t->rc, err, errlen);
    }
}

void bench_tls_server_stop(bench_tls_server *t)
{
    server_stop(&t->pid, &t->rc);
}

int bench_tcp_server_start(bench *b, bench_tcp_server *t, char *err, size_t errlen)
{
    char port[16];
    memset(t, 0, sizeof t[0]);
    t->port = bench_free_port();
    if (t->port < 0) {
        snprintf(err, errlen, "cannot find a free loopback port");
        return -1;
    }
    snprintf(port, sizeof port, "%d", t->port);
    snprintf(t->url, sizeof t->url, "redis://127.0.0.1:%d", t->port);
    bench_path(b, t->sock, sizeof t->sock, "redis-tcp.sock");
    {
        const char *extra[] = {"--bind", "127.0.0.1", "--port", port, NULL};
        return server_start(b, t->sock, "redis-tcp.log", extra, &t->pid, &t->rc, err, errlen);
    }
}

void bench_tcp_server_stop(bench_tcp_server *t)
{
    server_stop(&t->pid, &t->rc);
}

/* CLUSTER INFO of one node says the cluster is up and every slot served. */
static int cluster_node_ok(redisContext *c)
{
    redisReply *r = redisCommand(c, "CLUSTER INFO");
    int ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok") &&
             strstr(r->str, "cluster_slots_ok:16384") && strstr(r->str, "cluster_known_nodes:3");
    freeReplyObject(r);
    return ok;
}

int bench_cluster_start(bench *b, bench_cluster *c, char *err, size_t errlen)
{
    char addr[BENCH_CLUSTER_MASTERS][32], out[PATH_MAX + 32], tail[400], st[32];
    const char *argv[16];
    int i, a = 0, status = 0, up = 0;
    uint64_t deadline;
    pid_t pid;

    memset(c, 0, sizeof c[0]);
    for (i = 0; i < BENCH_CLUSTER_MASTERS; i++) {
        char port[16], sock[PATH_MAX + 32], conf[64], log[64], name[48];
        int k, tries = 0;
        /* The cluster bus listens on port + 10000, which must be a port too
         * (and free: a clash shows as a failed start below). */
        do {
            c->port[i] = bench_free_port();
            for (k = 0; k < i && c->port[k] != c->port[i]; k++)
                ;
        } while (++tries < 1000 && (c->port[i] > 55535 || k < i));
        if (c->port[i] < 0 || c->port[i] > 55535 || k < i) {
            snprintf(err, errlen, "cannot find a free loopback port below 55536 for a cluster node");
            return -1;
        }
        snprintf(port, sizeof port, "%d", c->port[i]);
        snprintf(name, sizeof name, "redis-cluster-%d.sock", i);
        bench_path(b, sock, sizeof sock, name);
        snprintf(conf, sizeof conf, "cluster-nodes-%d.conf", i);
        snprintf(log, sizeof log, "redis-cluster-%d.log", i);
        {
            const char *extra[] = {"--bind", "127.0.0.1", "--port", port, "--cluster-enabled", "yes",
                                   "--cluster-config-file", conf, "--cluster-node-timeout", "5000", NULL};
            if (server_start(b, sock, log, extra, &c->pid[i], &c->rc[i], err, errlen) != 0)
                return -1;
        }
        snprintf(addr[i], sizeof addr[i], "127.0.0.1:%d", c->port[i]);
    }
    snprintf(c->url, sizeof c->url, "redis-cluster://%s,%s,%s", addr[0], addr[1], addr[2]);
    argv[a++] = "redis-cli";
    argv[a++] = "--cluster";
    argv[a++] = "create";
    for (i = 0; i < BENCH_CLUSTER_MASTERS; i++)
        argv[a++] = addr[i];
    argv[a++] = "--cluster-replicas";
    argv[a++] = "0";
    argv[a++] = "--cluster-yes";
    argv[a] = NULL;
    bench_path(b, out, sizeof out, "redis-cli-cluster-create.out");
    if (bench_spawn(argv, out, out, &pid) != 0) {
        snprintf(err, errlen, "cannot run redis-cli: %s", strerror(errno));
        return -1;
    }
    if (bench_wait(pid, &status, NULL, 60000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        bench_tail_file(out, tail, sizeof tail, 3);
        snprintf(err, errlen, "redis-cli --cluster create: %s: %s", bench_status_text(status, st, sizeof st), tail);
        return -1;
    }
    deadline = bench_mono_us() + 30000000u;
    while (bench_mono_us() < deadline) {
        for (i = 0, up = 0; i < BENCH_CLUSTER_MASTERS; i++)
            up += cluster_node_ok(c->rc[i]);
        if (up == BENCH_CLUSTER_MASTERS)
            return 0;
        bench_sleep_ms(50);
    }
    snprintf(err, errlen, "the cluster was not up within 30 s (%d of %d nodes say cluster_state:ok)", up,
             BENCH_CLUSTER_MASTERS);
    return -1;
}

void bench_cluster_stop(bench_cluster *c)
{
    int i;
    for (i = 0; i < BENCH_CLUSTER_MASTERS; i++)
        server_stop(&c->pid[i], &c->rc[i]);
}

int bench_cluster_flush(bench_cluster *c)
{
    int i, rc = 0;
    for (i = 0; i < BENCH_CLUSTER_MASTERS; i++) {
        redisReply *r = redisCommand(c->rc[i], "FLUSHALL SYNC");
        if (!r || r->type != REDIS_REPLY_STATUS)
            rc = -1;
        freeReplyObject(r);
    }
    return rc;
}

long long bench_cluster_streams_len(bench_cluster *c)
{
    long long total = 0;
    int t, i;
    for (t = 0; t < BENCH_TOPICS; t++) {
        int found = 0;
        /* Every master answers XLEN of a key it does not hold with MOVED. */
        for (i = 0; i < BENCH_CLUSTER_MASTERS; i++) {
            redisReply *r = redisCommand(c->rc[i], "XLEN outbox:bench.t%d", t);
            if (!r)
                return -1;
            if (r->type == REDIS_REPLY_INTEGER) {
                total += r->integer;
                found++;
            } else if (r->type != REDIS_REPLY_ERROR || strncmp(r->str, "MOVED ", 6) != 0) {
                freeReplyObject(r);
                return -1;
            }
            freeReplyObject(r);
        }
        if (found != 1)
            return -1;
    }
    return total;
}

void bench_env_stop(bench *b)
{
    server_stop(&b->redis_pid, &b->rc);
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
    const bench_bm_target t = {b->sock, NULL, 0, 0, "outbox:bench", 0, 0};
    return bench_redis_benchmark_to(b, &t, n, clients, pipeline, envelope_len, rps, p50_ms, err, errlen);
}

int bench_redis_benchmark_user(bench *b, long n, double *rps, char *err, size_t errlen)
{
    const bench_bm_target t = {b->sock, NULL, 0, 0, "outbox:bench", 0, 1};
    double p50;
    return bench_redis_benchmark_to(b, &t, n, 4, 64, BENCH_USER_PAYLOAD, rps, &p50, err, errlen);
}

double bench_redis_us_per(bench *b, int64_t before, long n)
{
    int64_t after = bench_proc_cpu_ns(b->redis_pid);
    if (before < 0 || after < 0 || n <= 0)
        return -1;
    return (double)(after - before) / 1e3 / (double)n;
}

int bench_redis_benchmark_user_shape(bench *b, long n, size_t envelope_len, double *rps, double *redis_us, char *err,
                                     size_t errlen)
{
    /* -r replaces __rand_int__ with 12 digits: streams outbox:bench.t000000000000 to ...7. */
    const bench_bm_target t = {b->sock, NULL, 0, 0, "outbox:bench.t__rand_int__", BENCH_TOPICS, 0};
    double p50;
    int64_t c0 = bench_proc_cpu_ns(b->redis_pid);
    int rc = bench_redis_benchmark_to(b, &t, n, 4, 64, envelope_len, rps, &p50, err, errlen);
    if (redis_us)
        *redis_us = bench_redis_us_per(b, c0, n);
    for (int k = 0; k < BENCH_TOPICS; k++)
        freeReplyObject(bench_redis(b, "DEL outbox:bench.t%012d", k));
    return rc;
}

int bench_redis_benchmark_to(bench *b, const bench_bm_target *t, long n, int clients, int pipeline,
                             size_t envelope_len, double *rps, double *p50_ms, char *err, size_t errlen)
{
    char portbuf[16], rbuf[16];
    char out[PATH_MAX + 32], nbuf[32], cbuf[16], pbuf[16];
    char id[37], *env = NULL, *text = NULL;
    const char *argv[24];
    int a = 0, status = 0;
    pid_t pid;
    const char *p, *last = NULL;

    *rps = 0;
    *p50_ms = 0;
    memset(id, 'i', 36);
    id[36] = '\0';
    if (t->user_form)
        snprintf(id, sizeof id, "m-0000001");
    env = malloc(envelope_len + 1);
    if (!env)
        return -1;
    memset(env, t->user_form ? 'p' : 'e', envelope_len);
    env[envelope_len] = '\0';
    snprintf(nbuf, sizeof nbuf, "%ld", n);
    snprintf(cbuf, sizeof cbuf, "%d", clients);
    snprintf(pbuf, sizeof pbuf, "%d", pipeline);
    bench_path(b, out, sizeof out, "redis-benchmark.out");
    unlink(out);
    argv[a++] = "redis-benchmark";
    if (t->sock) {
        argv[a++] = "-s";
        argv[a++] = t->sock;
    } else {
        snprintf(portbuf, sizeof portbuf, "%d", t->port);
        argv[a++] = "-h";
        argv[a++] = t->host;
        argv[a++] = "-p";
        argv[a++] = portbuf;
    }
    if (t->cluster)
        argv[a++] = "--cluster";
    if (t->keyspace) {
        snprintf(rbuf, sizeof rbuf, "%d", t->keyspace);
        argv[a++] = "-r";
        argv[a++] = rbuf;
    }
    argv[a++] = "-n";
    argv[a++] = nbuf;
    argv[a++] = "-c";
    argv[a++] = cbuf;
    argv[a++] = "-P";
    argv[a++] = pbuf;
    argv[a++] = "-q";
    argv[a++] = "XADD";
    argv[a++] = t->key;
    argv[a++] = "*";
    argv[a++] = "id";
    argv[a++] = id;
    argv[a++] = t->user_form ? "payload" : "envelope";
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
    if (!(text = bench_read_file(out, NULL))) {
        snprintf(err, errlen, "cannot read redis-benchmark output");
        return -1;
    }
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
    if (t->sock == b->sock)
        freeReplyObject(bench_redis(b, "DEL outbox:bench"));
    if (*rps <= 0) {
        snprintf(err, errlen, "could not parse the redis-benchmark rate");
        return -1;
    }
    return 0;
}
