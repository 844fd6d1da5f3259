/*
 * The metrics endpoint under a crowd of slow and hostile clients, as a
 * liveness probe meets it: 3,000 connections holding half-sent requests
 * (each one opened again as soon as the relay closes it), from 16
 * addresses, and 64 clients from the probe's own address sending one byte
 * of a request head a second (opened again a second after they are
 * closed). Meanwhile, every 0.5 s, a probe (a new connection: GET /healthz)
 * must be answered 200, timed against a 200 ms target, and a row committed
 * just before it must be published within 1 s; the relay's open descriptors
 * stay within its connection table. Run over plain HTTP, then over TLS with
 * basic authentication (the flood then sends the start of a TLS hello).
 *
 * Each run lasts OUTBOX_FLOOD_SECONDS (the suite's default is 6; the full
 * run is OUTBOX_FLOOD_SECONDS=15 meson test -C build ops_http_flood).
 */
#include <arpa/inet.h>
#include <crypt.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <dirent.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"
#include "tls_certs.h"

#define N_FLOOD 3000
#define N_FLOOD_ADDRS 16
#define N_TRICKLE 64
#define N_SOCK (N_FLOOD + N_TRICKLE)
#define PROBE_EVERY_MS 500
#define TARGET_MS 200
/* The relay's table (outbox__http_limits_default) at the open files limit
 * it is started with: a quarter of 1024. */
#define RELAY_NOFILE 1024
#define TABLE 256

static th_redis redis;

typedef struct flood {
    int port, tls;
    int ep;
    int fd[N_SOCK];
    int connected[N_SOCK];
    size_t sent[N_SOCK];
    int64_t next_at[N_SOCK]; /* a trickler's next byte, or a reopen */
    atomic_int stop;
    long opened, closed_by_server, open_failed;
} flood;

/* What a flood connection sends once: a request head without its end, or
 * the start of a TLS record that announces a 512-byte hello. */
static const char plain_half[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: flood\r\n";
static const char tls_half[] = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03";
/* What a trickler sends, a byte a second: a head that never ends. */
static const char plain_trickle[] =
    "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trickle: aaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

static void flood_open(flood *f, int i)
{
    struct sockaddr_in src, dst;
    struct epoll_event ev;
    int one = 1, fd;
    char from[32];
    f->fd[i] = -1;
    f->connected[i] = 0;
    f->sent[i] = 0;
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        f->open_failed++;
        f->next_at[i] = th_now_ms() + 100;
        return;
    }
    /* The port is chosen at connect, by the whole address pair: thousands of
     * reconnects from one address do not run out of ports at bind. */
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    snprintf(from, sizeof from, "127.0.0.%d", i < N_FLOOD ? 2 + i % N_FLOOD_ADDRS : 1);
    memset(&src, 0, sizeof src);
    src.sin_family = AF_INET;
    inet_pton(AF_INET, from, &src.sin_addr);
    memset(&dst, 0, sizeof dst);
    dst.sin_family = AF_INET;
    dst.sin_port = htons((uint16_t)f->port);
    dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0 ||
        (connect(fd, (struct sockaddr *)&dst, sizeof dst) != 0 && errno != EINPROGRESS)) {
        close(fd);
        f->open_failed++;
        f->next_at[i] = th_now_ms() + 100;
        return;
    }
    ev.events = EPOLLOUT | EPOLLIN | EPOLLRDHUP;
    ev.data.u32 = (uint32_t)i;
    if (epoll_ctl(f->ep, EPOLL_CTL_ADD, fd, &ev) != 0)
        bail("epoll_ctl: %s", strerror(errno));
    f->fd[i] = fd;
    f->next_at[i] = 0;
    f->opened++;
}

static void flood_close(flood *f, int i, int by_server)
{
    epoll_ctl(f->ep, EPOLL_CTL_DEL, f->fd[i], NULL);
    close(f->fd[i]);
    f->fd[i] = -1;
    f->closed_by_server += by_server;
    /* The crowd comes back at once; a trickler at its next byte. */
    f->next_at[i] = i < N_FLOOD ? 0 : th_now_ms() + 1000;
}

static void trickle_byte(flood *f, int i)
{
    char b;
    if (f->tls)
        b = f->sent[i] < sizeof tls_half - 1 ? tls_half[f->sent[i]] : 'a';
    else
        b = f->sent[i] < sizeof plain_trickle - 1 ? plain_trickle[f->sent[i]] : 'a';
    if (send(f->fd[i], &b, 1, MSG_NOSIGNAL) == 1)
        f->sent[i]++;
}

static void *flood_main(void *arg)
{
    flood *f = arg;
    struct epoll_event evs[512];
    int i;
    for (i = 0; i < N_SOCK; i++)
        flood_open(f, i);
    while (!atomic_load(&f->stop)) {
        int64_t now = th_now_ms();
        int n = epoll_wait(f->ep, evs, 512, 20);
        for (int k = 0; k < n; k++) {
            i = (int)evs[k].data.u32;
            if (f->fd[i] < 0)
                continue;
            if (evs[k].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
                char buf[512];
                ssize_t r = recv(f->fd[i], buf, sizeof buf, 0);
                if (r > 0 && !(evs[k].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
                    continue; /* a 408, its close comes next */
                if (r < 0 && errno == EAGAIN && !(evs[k].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
                    continue;
                flood_close(f, i, 1);
                continue;
            }
            if ((evs[k].events & EPOLLOUT) && !f->connected[i]) {
                struct epoll_event ev = {EPOLLIN | EPOLLRDHUP, {.u32 = (uint32_t)i}};
                f->connected[i] = 1;
                epoll_ctl(f->ep, EPOLL_CTL_MOD, f->fd[i], &ev);
                if (i < N_FLOOD) {
                    const char *half = f->tls ? tls_half : plain_half;
                    size_t len = f->tls ? sizeof tls_half - 1 : sizeof plain_half - 1;
                    if (send(f->fd[i], half, len, MSG_NOSIGNAL) > 0)
                        f->sent[i] = len;
                } else {
                    f->next_at[i] = now;
                }
            }
        }
        now = th_now_ms();
        for (i = 0; i < N_SOCK; i++) {
            if (f->fd[i] < 0) {
                if (now >= f->next_at[i])
                    flood_open(f, i);
            } else if (i >= N_FLOOD && f->connected[i] && now >= f->next_at[i]) {
                trickle_byte(f, i);
                f->next_at[i] = now + 1000;
            }
        }
    }
    for (i = 0; i < N_SOCK; i++)
        if (f->fd[i] >= 0)
            close(f->fd[i]);
    return NULL;
}

/* Open descriptors of a process, and how many of them are sockets. */
static int fd_count(pid_t pid, int *sockets)
{
    char path[64], link[340], target[64];
    DIR *d;
    struct dirent *e;
    int n = 0;
    *sockets = 0;
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    if (!(d = opendir(path)))
        return -1;
    while ((e = readdir(d)) != NULL) {
        ssize_t k;
        if (e->d_name[0] == '.')
            continue;
        n++;
        snprintf(link, sizeof link, "%s/%s", path, e->d_name);
        k = readlink(link, target, sizeof target - 1);
        if (k > 7 && !strncmp(target, "socket:", 7))
            (*sockets)++;
    }
    closedir(d);
    return n;
}

/* One probe over TLS: a fresh connection, handshake (the CA verified, the
 * name localhost), GET /healthz with the credentials. The status, or -1. */
static int tls_probe(SSL_CTX *ctx, int port, const char *auth, int timeout_ms)
{
    struct sockaddr_in a;
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    char req[512], resp[4096];
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), st = -1;
    size_t len = 0;
    SSL *ssl = NULL;
    if (fd < 0)
        return -1;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || !(ssl = SSL_new(ctx)))
        goto out;
    SSL_set_fd(ssl, fd);
    SSL_set_tlsext_host_name(ssl, "localhost");
    SSL_set1_host(ssl, "localhost");
    if (SSL_connect(ssl) != 1)
        goto out;
    snprintf(req, sizeof req, "GET /healthz HTTP/1.1\r\nHost: localhost\r\nAuthorization: %s\r\n\r\n", auth);
    if (SSL_write(ssl, req, (int)strlen(req)) <= 0)
        goto out;
    for (;;) {
        int n = SSL_read(ssl, resp + len, (int)(sizeof resp - 1 - len));
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    resp[len] = '\0';
    if (len >= 12 && strncmp(resp, "HTTP/1.1 ", 9) == 0)
        st = atoi(resp + 9);
out:
    SSL_free(ssl);
    ERR_clear_error();
    close(fd);
    return st;
}

/* The CPU time a process used so far, in ms (user and system). */
static long cpu_ms(pid_t pid)
{
    char path[64], buf[1024], *p;
    unsigned long ut = 0, st = 0;
    FILE *f;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if (!(f = fopen(path, "r")))
        return -1;
    p = fgets(buf, sizeof buf, f);
    fclose(f);
    /* After the command's closing parenthesis: state, then fields 4..; utime
     * and stime are the 14th and 15th. */
    if (!p || !(p = strrchr(buf, ')')) ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (long)((ut + st) * 1000 / (unsigned long)sysconf(_SC_CLK_TCK));
}

static int cmp_int(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

/* A web configuration for TLS with the test certificates and one user,
 * "probe", whose password is "s3cret" (bcrypt, cost 10). */
static char *write_web_config(const char *dir, tls_certs *certs)
{
    char salt[CRYPT_GENSALT_OUTPUT_SIZE], text[1024];
    struct crypt_data cd;
    const char *hash;
    char *path = th_path(dir, "web.yml");
    FILE *f;
    memset(&cd, 0, sizeof cd);
    if (!crypt_gensalt_rn("$2b$", 10, NULL, 0, salt, sizeof salt) ||
        !(hash = crypt_rn("s3cret", salt, &cd, (int)sizeof cd)) || hash[0] == '*')
        bail("libcrypt cannot make a bcrypt hash");
    snprintf(text, sizeof text,
             "tls_server_config:\n  cert_file: %s\n  key_file: %s\nbasic_auth_users:\n  probe: '%s'\n",
             tls_cert(certs, "server.crt"), tls_cert(certs, "server.key"), hash);
    if (!(f = fopen(path, "w")) || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s", path);
    return path;
}

static void run(int tls, int seconds, tls_certs *certs)
{
    static flood f;
    char *dir = th_tmpdir(), *dbpath = rt_make_db(dir, "flood.db"), *logpath = th_path(dir, "relay.log");
    char listen[64], *web = NULL, *log;
    const char *mode = tls ? "TLS" : "plain";
    sqlite3 *db = rt_open(dbpath);
    SSL_CTX *ctx = NULL;
    int nprobes = seconds * 1000 / PROBE_EVERY_MS, lat[64], status[64], fds_base, fds_max = 0, i, bad = 0, slow = 0;
    int socks_base, socks_max = 0;
    long cpu0, cpu1;
    int64_t t_flood;
    int64_t ins_ms[64];
    struct rlimit rl;
    pthread_t th;
    pid_t pid;
    int port = th_free_port(), st = 0;
    const char *auth = "Basic cHJvYmU6czNjcmV0"; /* probe:s3cret */
    int64_t deadline;

    if (nprobes > 64)
        nprobes = 64;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    if (tls) {
        web = write_web_config(dir, certs);
        if (!(ctx = SSL_CTX_new(TLS_client_method())) || SSL_CTX_load_verify_file(ctx, tls_cert(certs, "ca.crt")) != 1)
            bail("cannot make the probe's TLS context");
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    }
    /* The relay runs with an ordinary limit; the test raised its own. */
    getrlimit(RLIMIT_NOFILE, &rl);
    {
        struct rlimit relay = {RELAY_NOFILE, rl.rlim_max};
        setrlimit(RLIMIT_NOFILE, &relay);
        pid = tls ? rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, "--metrics-web-config", web,
                                   NULL)
                  : rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, NULL);
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    deadline = th_now_ms() + 10000 * th_slow();
    while (th_now_ms() < deadline && st != 200) {
        st = tls ? tls_probe(ctx, port, auth, 2000) : ot_http_get(port, "/healthz", NULL);
        if (st != 200)
            th_sleep_ms(20);
    }
    /* That first authenticated request paid for the bcrypt check; the
     * probes below find it in the cache. */
    is_int(st, 200, "%s: the relay serves /healthz", mode);
    fds_base = fd_count(pid, &socks_base);

    memset(&f, 0, sizeof f);
    f.port = port;
    f.tls = tls;
    if ((f.ep = epoll_create1(EPOLL_CLOEXEC)) < 0)
        bail("epoll_create1: %s", strerror(errno));
    if (pthread_create(&th, NULL, flood_main, &f) != 0)
        bail("pthread_create");
    th_sleep_ms(1000); /* the crowd in place */
    cpu0 = cpu_ms(pid);
    t_flood = th_now_ms();

    for (i = 0; i < nprobes; i++) {
        static const char probe[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: probe\r\n\r\n";
        int64_t t0, t1;
        int n, socks;
        ins_ms[i] = rt_unix_ms();
        rt_insert_rows(db, "p", i, 1, "flood", 0);
        t0 = th_now_ms();
        status[i] = tls ? tls_probe(ctx, port, auth, 2000 * th_slow())
                        : ot_http_raw(port, probe, sizeof probe - 1, NULL, 2000 * th_slow());
        t1 = th_now_ms();
        lat[i] = (int)(t1 - t0);
        if (status[i] != 200)
            bad++;
        if (lat[i] > TARGET_MS)
            slow++;
        n = fd_count(pid, &socks);
        if (n > fds_max)
            fds_max = n;
        if (socks > socks_max)
            socks_max = socks;
        if (t1 - t0 < PROBE_EVERY_MS)
            th_sleep_ms((int)(PROBE_EVERY_MS - (t1 - t0)));
    }
    cpu1 = cpu_ms(pid);
    t_flood = th_now_ms() - t_flood;
    atomic_store(&f.stop, 1);
    pthread_join(th, NULL);
    close(f.ep);

    {
        int sorted[64];
        memcpy(sorted, lat, sizeof(int) * (size_t)nprobes);
        qsort(sorted, (size_t)nprobes, sizeof(int), cmp_int);
        diag("%s: %d probes over %d s: p50 %d ms, p90 %d ms, max %d ms; relay descriptors %d (%d sockets) before, "
             "%d (%d sockets) at most; the relay's CPU %ld%%; flood connections opened %ld, closed by the relay %ld, "
             "failed to open %ld",
             mode, nprobes, seconds, sorted[nprobes / 2], sorted[nprobes * 9 / 10], sorted[nprobes - 1], fds_base,
             socks_base, fds_max, socks_max, t_flood > 0 ? (cpu1 - cpu0) * 100 / t_flood : -1, f.opened,
             f.closed_by_server, f.open_failed);
        is_int(bad, 0, "%s: every probe under the flood is answered 200", mode);
        for (i = 0; i < nprobes && bad; i++)
            if (status[i] != 200)
                diag("probe %d: status %d after %d ms", i, status[i], lat[i]);
        /* The target is TARGET_MS for each probe (printed above, and how
         * many missed it); a machine shared with other work can delay any
         * process that long, so the checks are the median against the
         * target, and each probe within a second: a refused connection or
         * a dropped SYN (retransmitted a second later) fails them. */
        ok(sorted[nprobes / 2] <= TARGET_MS * th_slow(), "%s: the median probe within %d ms (%d ms; %d of %d over)",
           mode, TARGET_MS * th_slow(), sorted[nprobes / 2], slow, nprobes);
        ok(sorted[nprobes - 1] <= 1000 * th_slow(), "%s: each within %d ms (the slowest %d ms)", mode, 1000 * th_slow(),
           sorted[nprobes - 1]);
    }
    ok(f.closed_by_server > N_FLOOD, "%s: the relay closed the crowd's connections to make room (%ld)", mode,
       f.closed_by_server);
    /* The table, a newcomer accepted before the connection it replaces is
     * closed, one accept held for the next loop turn. */
    ok(socks_max > 0 && socks_max <= socks_base + TABLE + 2,
       "%s: the relay's sockets stay within its table of %d: %d at most, %d before", mode, TABLE, socks_max,
       socks_base);

    /* Each row committed before a probe: published within a second. */
    {
        redisContext *c = th_redis_client(&redis);
        rt_stream s;
        int late = 0, missing = 0, worst = 0;
        deadline = th_now_ms() + 5000 * th_slow();
        while (th_now_ms() < deadline && th_xlen(c, "outbox:flood") < nprobes)
            th_sleep_ms(20);
        s = rt_stream_read(c, "outbox:flood");
        for (i = 0; i < nprobes; i++) {
            char id[32];
            size_t k;
            snprintf(id, sizeof id, "p-%06d", i);
            for (k = 0; k < s.n; k++)
                if (s.e[k].id && !strcmp(s.e[k].id, id))
                    break;
            if (k == s.n) {
                missing++;
                continue;
            }
            {
                int d = (int)(strtoll(s.e[k].eid, NULL, 10) - ins_ms[i]);
                if (d > worst)
                    worst = d;
                if (d > 1000 * th_slow())
                    late++;
            }
        }
        is_int(missing, 0, "%s: every row committed under the flood is published", mode);
        is_int(late, 0, "%s: each within 1 s of its commit (the slowest %d ms)", mode, worst);
        rt_stream_free(&s);
        th_sql_exec(db, "DELETE FROM outbox");
        freeReplyObject(redisCommand(c, "DEL outbox:flood"));
        redisFree(c);
    }
    is_int(th_stop(pid, SIGTERM, 10000 * th_slow()), 0, "%s: the relay stops cleanly", mode);
    log = th_slurp(logpath);
    ok(!strstr(log, "level=error"), "%s: no errors in the relay's log", mode);
    ok(strstr(log, "connection table full") != NULL, "%s: it said the table was full", mode);
    free(log);
    SSL_CTX_free(ctx);
    free(web);
    sqlite3_close_v2(db);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
}

int main(void)
{
    const char *v = getenv("OUTBOX_FLOOD_SECONDS");
    int seconds = v && atoi(v) > 0 ? atoi(v) : 6;
    struct rlimit rl;
    tls_certs *certs;

    if (seconds > 30)
        seconds = 30;
    signal(SIGPIPE, SIG_IGN);
    /* The crowd's sockets, the probes', the harness'. */
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_max < N_SOCK + 256) {
        skip_all("the open files limit (hard %llu) is below the %d sockets the flood needs",
                 (unsigned long long)rl.rlim_max, N_SOCK + 256);
    }
    rl.rlim_cur = rl.rlim_max < 16384 ? rl.rlim_max : 16384;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        bail("setrlimit: %s", strerror(errno));
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    certs = tls_certs_make();
    run(0, seconds, certs);
    run(1, seconds, certs);
    tls_certs_free(certs);
    th_redis_destroy(&redis);
    return tap_done();
}
