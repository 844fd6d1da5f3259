/*
 * The metrics HTTP server defends itself and the relay keeps publishing:
 * malformed requests (400), other methods (405 with Allow), unknown paths
 * (404), an oversized head (431), request bodies (413), a long target (414),
 * the head's deadline from its first byte (408 for a client stuck in its
 * request line and for one trickling a byte at a time; a silent client is
 * closed), one client opening more connections than its bound (its oldest
 * idle ones closed, its request still answered, another client's connection
 * untouched), a relay with a low open files limit keeping its table below
 * it, all while a writer commits 2,000 rows that must all be published.
 */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

/* The server's limits (outbox__http_limits_default, src/http.c). */
#define PER_CLIENT 32
#define HEAD_MS 5000
#define IDLE_MS 5000
#define N_CONNS 100

static th_redis redis;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;
static int port, written;

static void write_some(void)
{
    if (written < 2000) {
        rt_insert_rows(db, "w", written, 100, "web", 0);
        written += 100;
    }
}

/* A socket connected to the relay's port from 127.0.0.1 (blocking unless
 * nonblock). */
static int connect_port(int nonblock)
{
    return ot_connect(port, "127.0.0.1", nonblock);
}

/* Reads until EOF or the deadline; returns the bytes (malloc'd) or NULL on
 * timeout. */
static char *read_reply(int fd, int64_t deadline)
{
    char *buf = malloc(65536);
    size_t len = 0;
    if (!buf)
        bail("out of memory");
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        int64_t left = deadline - th_now_ms();
        ssize_t n;
        if (left <= 0) {
            free(buf);
            return NULL;
        }
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        n = recv(fd, buf + len, 65535 - len, 0);
        if (n > 0) {
            len += (size_t)n;
            if (len < 65535)
                continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        break;
    }
    buf[len] = '\0';
    return buf;
}

static void check_status(const char *what, const char *req, size_t len, int want, char **resp_out)
{
    char *resp = NULL;
    int st = ot_http_raw(port, req, len, &resp, 5000 * th_slow());
    is_int(st, want, "%s answers %d", what, want);
    if (st != want && resp)
        diag("reply: %.*s", (int)strcspn(resp, "\r\n"), resp);
    if (resp_out)
        *resp_out = resp;
    else
        free(resp);
    write_some();
}

/* A literal request: its length from sizeof. */
#define CHECK_LIT(what, lit, want, out) check_status(what, lit, sizeof lit - 1, want, out)

static void malformed(void)
{
    char *resp = NULL, *allow, *big;
    size_t i;

    CHECK_LIT("a garbage request line", "hello there\r\n\r\n", 400, NULL);
    CHECK_LIT("binary garbage", "\x01\x02\x03\x04\r\n\r\n", 400, NULL);
    CHECK_LIT("POST /metrics", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, &resp);
    allow = resp ? ot_http_header(resp, "Allow") : NULL;
    ok(allow && strstr(allow, "GET") && strstr(allow, "HEAD"), "the 405 has Allow: GET, HEAD (%s)",
       allow ? allow : "none");
    free(allow);
    free(resp);
    CHECK_LIT("DELETE /healthz", "DELETE /healthz HTTP/1.1\r\n\r\n", 405, NULL);
    CHECK_LIT("GET /x", "GET /x HTTP/1.1\r\nHost: x\r\n\r\n", 404, NULL);

    /* A 10 KiB header: the head limit is 8 KiB. */
    big = malloc(11000);
    if (!big)
        bail("out of memory");
    strcpy(big, "GET /metrics HTTP/1.1\r\nX-Big: ");
    for (i = strlen(big); i < 10240 + 30; i++)
        big[i] = 'a';
    memcpy(big + i, "\r\n\r\n", 5);
    check_status("a 10 KiB header", big, strlen(big), 431, NULL);
    /* Many small headers past 8 KiB. */
    strcpy(big, "GET /metrics HTTP/1.1\r\n");
    while (strlen(big) < 9000)
        strcat(big, "X-Header: 0123456789abcdef\r\n");
    strcat(big, "\r\n");
    check_status("9 KiB of small headers", big, strlen(big), 431, NULL);
    /* A 2 KiB target. */
    strcpy(big, "GET /");
    for (i = 5; i < 2048; i++)
        big[i] = 'p';
    strcpy(big + i, " HTTP/1.1\r\n\r\n");
    check_status("a 2 KiB request target", big, strlen(big), 414, NULL);
    free(big);

    CHECK_LIT("a GET with Content-Length: 5", "GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 413, NULL);
    CHECK_LIT("a chunked GET",
              "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 413, NULL);
    CHECK_LIT("HTTP/1.0 GET /healthz", "GET /healthz HTTP/1.0\r\n\r\n", 200, NULL);
    CHECK_LIT("GET /metrics?name[]=x (query ignored)", "GET /metrics?name[]=x HTTP/1.1\r\n\r\n", 200, NULL);
    CHECK_LIT("HEAD /metrics", "HEAD /metrics HTTP/1.1\r\n\r\n", 200, &resp);
    ok(resp && ot_http_body(resp) && !*ot_http_body(resp), "HEAD gets no body");
    free(resp);
    /* Pipelined second request after a complete one: answered once. */
    {
        const char req[] = "GET /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n";
        int st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000 * th_slow());
        is_int(st, 200, "two pipelined requests: the first is answered");
        ok(resp && rt_count_substr(resp, "HTTP/1.1") == 1, "and only one response is sent (Connection: close)");
        free(resp);
    }
}

/* A client that half-closes right after its request (nc -N, some health
 * checkers) still gets the answer, also when the answer waits for a refresh
 * of the database figures (they are at most a second old). */
static void half_close(void)
{
    static const char *const paths[] = {"/healthz", "/metrics"};
    size_t i;
    for (i = 0; i < 2; i++) {
        char req[128], *reply;
        int fd;
        th_sleep_ms(1100);
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", paths[i]);
        fd = connect_port(0);
        if (send(fd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req) || shutdown(fd, SHUT_WR) != 0)
            bail("send: %s", strerror(errno));
        reply = read_reply(fd, th_now_ms() + 5000 * th_slow());
        ok(reply && strncmp(reply, "HTTP/1.1 200 ", 13) == 0, "GET %s then a half-close: answered 200 (%.*s)",
           paths[i], reply ? (int)strcspn(reply, "\r\n") : 7, reply ? reply : "timeout");
        free(reply);
        close(fd);
        write_some();
    }
}

/* 1 while fd is open with nothing to read; 0 once the server closed it. */
static int still_open(int fd)
{
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* One client opens 100 connections that send nothing: it holds at most
 * PER_CLIENT, each one beyond closing its oldest; a request of it is still
 * answered (closing one more), and another client's connection (other_fd,
 * from another address) is not touched. */
static void one_client_many_connections(int other_fd)
{
    int fds[N_CONNS], closed[N_CONNS], nclosed = 0, i, st, oldest_closed = 1, newest_open = 1;
    int64_t deadline;
    char *body = NULL;

    for (i = 0; i < N_CONNS; i++) {
        fds[i] = connect_port(1);
        closed[i] = 0;
    }
    deadline = th_now_ms() + 3000 * th_slow();
    while (th_now_ms() < deadline && nclosed < N_CONNS - PER_CLIENT) {
        struct pollfd p[N_CONNS];
        for (i = 0; i < N_CONNS; i++) {
            p[i].fd = closed[i] ? -1 : fds[i];
            p[i].events = POLLIN;
            p[i].revents = 0;
        }
        if (poll(p, N_CONNS, 50) <= 0)
            continue;
        for (i = 0; i < N_CONNS; i++)
            if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) && !still_open(fds[i])) {
                closed[i] = 1;
                nclosed++;
            }
    }
    th_sleep_ms(100);
    for (i = 0; i < N_CONNS; i++) {
        if (!closed[i] && !still_open(fds[i])) {
            closed[i] = 1;
            nclosed++;
        }
        if (i < N_CONNS - PER_CLIENT && !closed[i])
            oldest_closed = 0;
        if (i >= N_CONNS - PER_CLIENT && closed[i])
            newest_open = 0;
    }
    is_int(nclosed, N_CONNS - PER_CLIENT, "%d idle connections from one client: %d beyond its bound of %d are closed",
           N_CONNS, N_CONNS - PER_CLIENT, PER_CLIENT);
    ok(oldest_closed && newest_open, "the oldest ones: its %d newest stay open", PER_CLIENT);
    st = ot_http_get(port, "/healthz", &body);
    is_int(st, 200, "a request of that client is answered all the same");
    free(body);
    deadline = th_now_ms() + 2000 * th_slow();
    while (th_now_ms() < deadline && still_open(fds[N_CONNS - PER_CLIENT]))
        th_sleep_ms(10);
    ok(!still_open(fds[N_CONNS - PER_CLIENT]), "and it closed that client's oldest idle connection");
    ok(still_open(other_fd), "another client's unfinished request is not touched");
    for (i = 0; i < N_CONNS; i++)
        close(fds[i]);
    write_some();
}

/* The deadlines: a client stuck in its request line, one trickling a byte
 * every 400 ms (the deadline runs from the first byte, and the bytes after
 * it do not move it) and one sending nothing, each from an address of its
 * own. other_fd (from 127.0.0.5) is left half-sent for the bound per client
 * later: it was opened just before. */
static void deadlines(void)
{
    static const char trickle[] = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    int slow = ot_connect(port, "127.0.0.2", 0), silent = ot_connect(port, "127.0.0.3", 0);
    int drip = ot_connect(port, "127.0.0.4", 0), fds[3] = {slow, silent, drip};
    int64_t t0 = th_now_ms(), done[3] = {0, 0, 0}, next_drip = t0;
    char got[3][64] = {"", "", ""};
    size_t sent = 0, i;

    if (send(slow, "GET /metr", 9, MSG_NOSIGNAL) != 9)
        bail("send: %s", strerror(errno));
    while (th_now_ms() - t0 < 15000 * th_slow() && (!done[0] || !done[1] || !done[2])) {
        struct pollfd p[3];
        if (!done[2] && th_now_ms() >= next_drip && sent < sizeof trickle - 1) {
            if (send(drip, trickle + sent, 1, MSG_NOSIGNAL) == 1)
                sent++;
            next_drip += 400;
        }
        for (i = 0; i < 3; i++) {
            p[i].fd = done[i] ? -1 : fds[i];
            p[i].events = POLLIN;
            p[i].revents = 0;
        }
        if (poll(p, 3, 50) > 0)
            for (i = 0; i < 3; i++)
                if (p[i].revents) {
                    ssize_t n = recv(fds[i], got[i], sizeof got[i] - 1, 0);
                    got[i][n > 0 ? n : 0] = '\0';
                    done[i] = th_now_ms() - t0;
                }
        write_some();
    }
    ok(!strncmp(got[0], "HTTP/1.1 408 ", 13), "a client stuck in its request line gets 408 (%.*s)",
       (int)strcspn(got[0], "\r\n"), got[0]);
    ok(done[0] >= HEAD_MS - 500 && done[0] <= HEAD_MS + 3000 * th_slow(), "once the head's deadline passed (%lld ms)",
       (long long)done[0]);
    ok(!strncmp(got[2], "HTTP/1.1 408 ", 13), "a client trickling a byte every 400 ms gets 408 too (%.*s)",
       (int)strcspn(got[2], "\r\n"), got[2]);
    ok(done[2] >= HEAD_MS - 500 && done[2] <= HEAD_MS + 3000 * th_slow(),
       "%d ms after its first byte, its %zu bytes since notwithstanding", (int)done[2], sent);
    ok(done[1] && !got[1][0], "a client that sent nothing is closed without a reply");
    ok(done[1] >= IDLE_MS - 500 && done[1] <= IDLE_MS + 3000 * th_slow(), "after the idle deadline (%lld ms)",
       (long long)done[1]);
    for (i = 0; i < 3; i++)
        close(fds[i]);
}

/* A relay started with a low open files limit (64) keeps its table (a
 * quarter of it, 16) below what its descriptors allow: 60 idle connections
 * do not make it meet EMFILE, whose remedy in libuv would close the probe
 * waiting to be accepted too. */
static void low_fd_limit(void)
{
    struct rlimit rl, low;
    char listen[64], *log, *logpath2 = th_path(dir, "low.log");
    int p2 = th_free_port(), fds[60], i, st = 0;
    int64_t deadline;
    pid_t pid;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", p2);
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        bail("getrlimit: %s", strerror(errno));
    low.rlim_cur = 64;
    low.rlim_max = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &low) != 0)
        bail("setrlimit: %s", strerror(errno));
    pid = rt_relay_spawn(logpath2, dbpath, redis.url, "--metrics-listen", listen, NULL);
    setrlimit(RLIMIT_NOFILE, &rl);
    deadline = th_now_ms() + 5000 * th_slow();
    while (th_now_ms() < deadline && (st = ot_http_get(p2, "/healthz", NULL)) != 200)
        th_sleep_ms(10);
    is_int(st, 200, "a relay with an open files limit of 64 serves /healthz");
    for (i = 0; i < 60; i++) {
        fds[i] = ot_connect(p2, "127.0.0.1", 1);
        if (send(fds[i], "GET /he", 7, MSG_NOSIGNAL) < 0 && errno != EAGAIN && errno != ENOTCONN)
            bail("send: %s", strerror(errno));
    }
    th_sleep_ms(200);
    is_int(ot_http_get(p2, "/healthz", NULL), 200, "with 60 unfinished requests open, a probe is answered");
    for (i = 0; i < 60; i++)
        close(fds[i]);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "and it stops cleanly");
    log = th_slurp(logpath2);
    ok(strstr(log, "fewer connections for a low open files limit\" max_connections=16 nofile=64") != NULL,
       "it said it holds 16 connections at most");
    ok(!strstr(log, "out of file descriptors"), "and never ran out of descriptors");
    free(log);
    free(logpath2);
}

int main(void)
{
    pid_t pid;
    char listen[64], *log;
    int slow_fd, other_fd, st = 0;
    int64_t t_slow, deadline;

    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "http.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    port = th_free_port();
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, NULL);
    deadline = th_now_ms() + 5000 * th_slow();
    while (th_now_ms() < deadline && (st = ot_http_get(port, "/healthz", NULL)) != 200)
        th_sleep_ms(10);
    is_int(st, 200, "the relay serves /healthz");

    deadlines();
    malformed();
    half_close();
    other_fd = ot_connect(port, "127.0.0.5", 0);
    if (send(other_fd, "GET /he", 7, MSG_NOSIGNAL) != 7)
        bail("send: %s", strerror(errno));
    one_client_many_connections(other_fd);
    close(other_fd);
    while ((int)written < 2000)
        write_some();

    deadline = th_now_ms() + 10000 * th_slow();
    while (th_now_ms() < deadline && th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") < written)
        th_sleep_ms(10);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"), 2000,
           "the 2,000 rows written meanwhile are all published");
    {
        redisContext *c = th_redis_client(&redis);
        is_int(th_xlen(c, "outbox:web"), 2000, "and appended to their stream");
        redisFree(c);
    }
    low_fd_limit();
    /* A stop does not wait for a client that never finishes its request. */
    slow_fd = connect_port(0);
    if (send(slow_fd, "GET /he", 7, MSG_NOSIGNAL) != 7)
        bail("send: %s", strerror(errno));
    th_sleep_ms(50);
    t_slow = th_now_ms();
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly on SIGTERM with a client mid-request");
    ok(th_now_ms() - t_slow < 2000, "at once (%lld ms)", (long long)(th_now_ms() - t_slow));
    close(slow_fd);
    log = th_slurp(logpath);
    ok(!strstr(log, "level=error"), "no errors in the relay's log");
    ok(strstr(log, "a client at its bound of connections opened another") != NULL,
       "the closed connections are logged as a warning");
    free(log);

    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
