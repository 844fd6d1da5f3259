/*
 * The metrics HTTP server defends itself and the relay keeps publishing:
 * malformed requests (400), other methods (405 with Allow), unknown paths
 * (404), an oversized head (431), request bodies (413), a long target (414),
 * a slow client (408 after the idle timeout), a silent client (closed),
 * more connections than the limit (the excess closed at once), all while a
 * writer commits 2,000 rows that must all be published.
 */
#include <errno.h>
#include <netinet/in.h>
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

#define N_CONNS 100
#define MAX_CONNS 64 /* the server's limit (src/http.c) */

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

/* A socket connected to the relay's port (blocking unless nonblock). */
static int connect_port(int nonblock)
{
    struct sockaddr_in a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
    if (fd < 0)
        bail("socket: %s", strerror(errno));
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && !(nonblock && errno == EINPROGRESS))
        bail("connect 127.0.0.1:%d: %s", port, strerror(errno));
    return fd;
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

static void too_many_connections(void)
{
    int fds[N_CONNS], closed[N_CONNS], nclosed = 0, i, st = 0;
    int64_t deadline;
    char *body = NULL;

    for (i = 0; i < N_CONNS; i++) {
        fds[i] = connect_port(1);
        closed[i] = 0;
    }
    deadline = th_now_ms() + 5000 * th_slow();
    /* Connections beyond the limit are accepted and closed at once. */
    while (th_now_ms() < deadline && nclosed < N_CONNS - MAX_CONNS) {
        struct pollfd p[N_CONNS];
        for (i = 0; i < N_CONNS; i++) {
            p[i].fd = closed[i] ? -1 : fds[i];
            p[i].events = POLLIN;
            p[i].revents = 0;
        }
        if (poll(p, N_CONNS, 50) <= 0)
            continue;
        for (i = 0; i < N_CONNS; i++) {
            char c;
            ssize_t n;
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            n = recv(fds[i], &c, 1, 0);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                closed[i] = 1;
                nclosed++;
            }
        }
    }
    th_sleep_ms(200);
    write_some();
    ok(nclosed >= N_CONNS - MAX_CONNS, "%d connections at once: %d beyond the limit of %d are closed", N_CONNS,
       nclosed, MAX_CONNS);
    for (i = 0; i < N_CONNS; i++)
        close(fds[i]);
    /* The server notices the closes on its next loop turns. */
    deadline = th_now_ms() + 3000 * th_slow();
    while (th_now_ms() < deadline) {
        free(body);
        body = NULL;
        if ((st = ot_http_get(port, "/metrics", &body)) == 200)
            break;
        th_sleep_ms(20);
    }
    is_int(st, 200, "once they are gone, /metrics answers again");
    ok(body && strstr(body, "outbox_published_total"), "with metrics");
    free(body);
    write_some();
}

int main(void)
{
    pid_t pid;
    char listen[64], *reply, *log;
    int slow_fd, silent_fd, st = 0;
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

    /* Half a request line, then nothing; and a client that sends nothing.
     * Both are checked at the end, after the idle timeout. */
    slow_fd = connect_port(0);
    if (send(slow_fd, "GET /metr", 9, MSG_NOSIGNAL) != 9)
        bail("send: %s", strerror(errno));
    silent_fd = connect_port(0);
    t_slow = th_now_ms();

    malformed();
    half_close();
    too_many_connections();
    while ((int)written < 2000)
        write_some();

    /* The slow client: 408 once the 10 s idle timeout passed. */
    reply = read_reply(slow_fd, t_slow + 14000);
    ok(reply && strncmp(reply, "HTTP/1.1 408 ", 13) == 0, "a client stuck in its request line gets 408 (%.*s)",
       reply ? (int)strcspn(reply, "\r\n") : 7, reply ? reply : "timeout");
    ok(th_now_ms() - t_slow >= 9000 && th_now_ms() - t_slow <= 13000, "after the idle timeout (%lld ms)",
       (long long)(th_now_ms() - t_slow));
    free(reply);
    reply = read_reply(silent_fd, t_slow + 14000);
    ok(reply && !*reply, "a client that sent nothing is closed without a reply");
    free(reply);
    close(slow_fd);
    close(silent_fd);

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
    free(log);

    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
