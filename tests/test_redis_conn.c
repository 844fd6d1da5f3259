/*
 * test_redis_conn.c: the libuv Redis connection (src/redis.c) against a real
 * redis-server (Unix socket, TCP by address and by host name) and against a
 * misbehaving fake server (fake_server.c).
 *
 * Every test runs on its own loop, closes everything it opened and checks
 * that uv_loop_close() succeeds. Callbacks record what they saw; the checks
 * come after the loop ran, so a missing or doubled callback is counted, not
 * assumed.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "fake_server.h"
#include "harness.h"
#include "redis.h"
#include "tap.h"

/* Timing bounds are multiplied by this under valgrind. */
static int slow = 1;

typedef struct T T;

typedef struct rec {
    T *t;
    int calls;
    int status;
    int type; /* -1 when no reply */
    long long integer;
    size_t elements;
    char str[128];
    int seq; /* event order */
    int close_here; /* call close() from this callback */
    int issue_here; /* issue another command from this callback */
    int issue_rc;
} rec;

struct T {
    uv_loop_t loop;
    uv_timer_t wd; /* wakes the loop so run_until can check its deadline */
    outbox__redis *r;
    int seq;
    int connects, connect_status, connect_seq;
    int disconnects, disconnect_status, disconnect_seq;
    int closes, close_seq;
    int close_in_connect_cb;
    int issue_in_connect_cb;
    int close_in_disconnect_cb;
    int64_t t0, connect_ms, disconnect_ms;
    char connect_err[256], disconnect_err[256];
    rec rec[16];
    int done; /* general purpose flag */
};

static void wd_cb(uv_timer_t *h)
{
    (void)h;
}

static void t_init(T *t)
{
    memset(t, 0, sizeof *t);
    if (uv_loop_init(&t->loop) != 0)
        bail("uv_loop_init");
    uv_timer_init(&t->loop, &t->wd);
    uv_timer_start(&t->wd, wd_cb, 10, 10);
    uv_unref((uv_handle_t *)&t->wd);
    t->t0 = th_now_ms();
    for (int i = 0; i < 16; i++) {
        t->rec[i].t = t;
        t->rec[i].type = -1;
    }
}

/* Runs the loop until *flag becomes non-zero, the loop has nothing left, or
 * ms milliseconds passed. Returns *flag. */
static int run_until(T *t, const int *flag, int ms)
{
    int64_t deadline = th_now_ms() + (int64_t)ms * slow;
    while (!*flag && th_now_ms() < deadline)
        if (uv_run(&t->loop, UV_RUN_ONCE) == 0 && !*flag && !uv_loop_alive(&t->loop))
            break;
    return *flag;
}

/* Drains the loop and checks that it closes cleanly. */
static void t_finish(T *t, const char *name)
{
    int64_t deadline = th_now_ms() + 5000 * slow;
    while (uv_loop_alive(&t->loop) && th_now_ms() < deadline)
        uv_run(&t->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&t->wd, NULL);
    uv_run(&t->loop, UV_RUN_NOWAIT);
    is_int(uv_loop_close(&t->loop), 0, "%s: loop closed cleanly", name);
}

static void on_reply(outbox__redis *r, int status, redisReply *reply, void *data);

static void on_connect(outbox__redis *r, int status, void *data)
{
    T *t = data;
    t->connects++;
    t->connect_status = status;
    t->connect_seq = ++t->seq;
    t->connect_ms = th_now_ms() - t->t0;
    snprintf(t->connect_err, sizeof t->connect_err, "%s", outbox__redis_errstr(r));
    if (t->issue_in_connect_cb) {
        const char *argv[] = {"PING"};
        t->rec[0].issue_rc = outbox__redis_command_argv(r, 1, argv, NULL, 0, on_reply, &t->rec[0]);
    }
    if (t->close_in_connect_cb) {
        outbox__redis_close(r, NULL, NULL);
        t->r = NULL;
        /* once more, from inside: must be harmless */
        outbox__redis_close(r, NULL, NULL);
    }
}

static void on_close(void *data);

static void on_disconnect(outbox__redis *r, int status, void *data)
{
    T *t = data;
    t->disconnects++;
    t->disconnect_status = status;
    t->disconnect_seq = ++t->seq;
    t->disconnect_ms = th_now_ms() - t->t0;
    snprintf(t->disconnect_err, sizeof t->disconnect_err, "%s", outbox__redis_errstr(r));
    if (t->close_in_disconnect_cb) {
        outbox__redis_close(r, on_close, t);
        t->r = NULL;
    }
}

static void on_close(void *data)
{
    T *t = data;
    t->closes++;
    t->close_seq = ++t->seq;
}

static void on_reply(outbox__redis *r, int status, redisReply *reply, void *data)
{
    rec *c = data;
    T *t = c->t;
    c->calls++;
    c->status = status;
    c->seq = ++t->seq;
    if (reply) {
        c->type = reply->type;
        c->integer = reply->integer;
        c->elements = reply->elements;
        if (reply->str) {
            size_t n = reply->len < sizeof c->str - 1 ? reply->len : sizeof c->str - 1;
            memcpy(c->str, reply->str, n);
            c->str[n] = '\0';
        }
    }
    if (c->issue_here) {
        const char *argv[] = {"PING"};
        c->issue_rc = outbox__redis_command_argv(r, 1, argv, NULL, 0, on_reply, &t->rec[c->issue_here]);
    }
    if (c->close_here) {
        outbox__redis_close(r, on_close, t);
        t->r = NULL;
    }
}

/* Issues a command from NULL-terminated arguments, recording into rec[i]. */
static int cmd(T *t, int i, uint64_t timeout_ms, const char *a0, ...)
{
    const char *argv[16];
    int argc = 0;
    va_list ap;
    va_start(ap, a0);
    for (const char *a = a0; a && argc < 16; a = va_arg(ap, const char *))
        argv[argc++] = a;
    va_end(ap);
    return outbox__redis_command_argv(t->r, argc, argv, NULL, timeout_ms, on_reply, &t->rec[i]);
}

/* Creates t->r for url and connects; returns connect_cb's status (or -999
 * if it never came). */
static int t_connect(T *t, const char *url, const outbox__redis_options *o)
{
    outbox__redis_url u;
    char err[256];
    int rc;
    if ((rc = outbox__redis_url_parse(url, &u, err, sizeof err)) != 0) {
        diag("bad URL %s: %s", url, err);
        return rc;
    }
    rc = outbox__redis_create(&t->r, &t->loop, &u, o, t);
    outbox__redis_url_free(&u);
    if (rc != 0)
        return rc;
    t->t0 = th_now_ms();
    if ((rc = outbox__redis_connect(t->r, on_connect, on_disconnect)) != 0)
        return rc;
    if (!run_until(t, &t->connects, 10000))
        return -999;
    return t->connect_status;
}

static void t_close(T *t)
{
    if (t->r) {
        outbox__redis_close(t->r, on_close, t);
        t->r = NULL;
    }
    run_until(t, &t->closes, 5000);
}

static int starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* ---- real redis-server --------------------------------------------------- */

static void test_basic(const char *name, const char *url)
{
    T t;
    const char *setv[] = {"SET", "bin:key", "a\0b"};
    const size_t setl[] = {3, 7, 3};
    const char *getv[] = {"GET", "bin:key"};
    static const char raw_ping[] = "*1\r\n$4\r\nPING\r\n";
    char what[64];

    t_init(&t);
    snprintf(what, sizeof what, "basic %s", name);
    is_int(t_connect(&t, url, NULL), 0, "%s: connected", what);
    is_int(t.connects, 1, "%s: connect_cb once", what);
    is_str(t.connect_err, "", "%s: no error text", what);
    ok(outbox__redis_is_connected(t.r), "%s: is_connected", what);
    is_int(outbox__redis_connect(t.r, on_connect, NULL), OUTBOX_ESTATE, "%s: second connect is ESTATE", what);

    is_int(cmd(&t, 0, 0, "PING", NULL), 0, "%s: PING accepted", what);
    is_int(outbox__redis_pending(t.r), 1, "%s: one pending", what);
    is_int(outbox__redis_queued_bytes(t.r), sizeof raw_ping - 1, "%s: 14 bytes queued", what);
    is_int(outbox__redis_command_argv(t.r, 3, setv, setl, 0, on_reply, &t.rec[1]), 0, "%s: binary SET", what);
    is_int(outbox__redis_command_argv(t.r, 2, getv, NULL, 0, on_reply, &t.rec[2]), 0, "%s: GET", what);
    is_int(cmd(&t, 3, 0, "NOSUCHCOMMAND", "x", NULL), 0, "%s: unknown command accepted", what);
    is_int(outbox__redis_command_raw(t.r, raw_ping, sizeof raw_ping - 1, 0, on_reply, &t.rec[4]), 0,
           "%s: raw PING", what);
    is_int(outbox__redis_pending(t.r), 5, "%s: five pending", what);
    run_until(&t, &t.rec[4].calls, 5000);

    is_int(t.rec[0].calls, 1, "%s: PING answered once", what);
    is_int(t.rec[0].type, REDIS_REPLY_STATUS, "%s: PING status reply", what);
    is_str(t.rec[0].str, "PONG", "%s: PONG", what);
    is_str(t.rec[1].str, "OK", "%s: SET OK", what);
    is_int(t.rec[2].type, REDIS_REPLY_STRING, "%s: GET bulk", what);
    ok(memcmp(t.rec[2].str, "a\0b", 3) == 0, "%s: binary-safe value", what);
    is_int(t.rec[3].status, 0, "%s: error reply has status 0", what);
    is_int(t.rec[3].type, REDIS_REPLY_ERROR, "%s: error reply type", what);
    ok(starts_with(t.rec[3].str, "ERR unknown command"), "%s: error text '%s'", what, t.rec[3].str);
    is_str(t.rec[4].str, "PONG", "%s: raw PONG", what);
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq && t.rec[2].seq < t.rec[3].seq &&
           t.rec[3].seq < t.rec[4].seq,
       "%s: FIFO order", what);
    is_int(outbox__redis_pending(t.r), 0, "%s: nothing pending", what);
    is_int(outbox__redis_queued_bytes(t.r), 0, "%s: nothing queued", what);
    is_int(outbox__redis_command_argv(t.r, 0, getv, NULL, 0, on_reply, NULL), OUTBOX_EINVAL,
           "%s: argc 0 is EINVAL", what);
    is_int(outbox__redis_command_raw(t.r, "", 0, 0, on_reply, NULL), OUTBOX_EINVAL, "%s: empty raw is EINVAL",
           what);
    t_close(&t);
    is_int(t.closes, 1, "%s: close_cb once", what);
    is_int(t.disconnects, 0, "%s: no disconnect_cb after close", what);
    t_finish(&t, what);
}

static void test_states(const th_redis *srv)
{
    T t;
    outbox__redis_url u;
    outbox__redis_options o;

    /* Commands before the connection is up. */
    t_init(&t);
    outbox__redis_url_parse(srv->url, &u, NULL, 0);
    is_int(outbox__redis_create(&t.r, &t.loop, &u, NULL, &t), 0, "create");
    is_int(cmd(&t, 0, 0, "PING", NULL), OUTBOX_ESTATE, "command before connect is ESTATE");
    ok(!outbox__redis_is_connected(t.r), "not connected before connect");
    is_str(outbox__redis_errstr(t.r), "", "errstr empty at first");
    is_int(outbox__redis_connect(t.r, on_connect, on_disconnect), 0, "connect");
    is_int(cmd(&t, 0, 0, "PING", NULL), OUTBOX_ESTATE, "command while connecting is ESTATE");
    t_close(&t);
    is_int(t.connects, 1, "close while connecting: connect_cb called");
    is_int(t.connect_status, OUTBOX_ECLOSED, "  with ECLOSED");
    ok(t.connect_seq < t.close_seq, "  before close_cb");
    is_int(t.closes, 1, "  close_cb once");
    is_int(t.rec[0].calls, 0, "  refused commands never called back");
    t_finish(&t, "close while connecting");

    /* Closing an object that never connected. */
    t_init(&t);
    is_int(outbox__redis_create(&t.r, &t.loop, &u, NULL, &t), 0, "create again");
    t_close(&t);
    is_int(t.closes, 1, "close without connect: close_cb once");
    is_int(t.connects, 0, "  no connect_cb");
    t_finish(&t, "close without connect");
    outbox__redis_close(NULL, on_close, &t);
    ok(1, "close(NULL) is a no-op");

    /* Invalid arguments. */
    t_init(&t);
    {
        outbox__redis *r = (outbox__redis *)&t; /* must not be touched */
        outbox__redis_url bad;
        is_int(outbox__redis_create(&r, &t.loop, NULL, NULL, NULL), OUTBOX_EINVAL, "create without URL");
        ok(r == NULL, "  *out set to NULL");
        memset(&bad, 0, sizeof bad);
        is_int(outbox__redis_create(&r, &t.loop, &bad, NULL, NULL), OUTBOX_EINVAL, "create with empty URL");
        bad.host = "h";
        bad.port = 0;
        is_int(outbox__redis_create(&r, &t.loop, &bad, NULL, NULL), OUTBOX_EINVAL, "create with port 0");
        is_int(outbox__redis_create(&r, NULL, &u, NULL, NULL), OUTBOX_EINVAL, "create without loop");
    }
    outbox__redis_options_defaults(&o);
    is_int(o.connect_timeout_ms, 5000, "default connect timeout 5000");
    is_int(o.reply_timeout_ms, 10000, "default reply timeout 10000");
    ok(o.client_name == NULL, "default client name NULL");
    t_finish(&t, "invalid arguments");

    /* Close with commands queued, from outside any callback. */
    t_init(&t);
    is_int(t_connect(&t, srv->url, NULL), 0, "connected");
    cmd(&t, 0, 0, "PING", NULL);
    cmd(&t, 1, 0, "PING", NULL);
    cmd(&t, 2, 0, "PING", NULL);
    outbox__redis_close(t.r, on_close, &t);
    t.r = NULL;
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1,
       "close fails queued commands before it returns");
    ok(t.rec[0].status == OUTBOX_ECLOSED && t.rec[2].status == OUTBOX_ECLOSED, "  with ECLOSED");
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq, "  in order");
    is_int(t.closes, 0, "  close_cb not yet");
    run_until(&t, &t.closes, 5000);
    is_int(t.closes, 1, "  close_cb once, later");
    ok(t.rec[0].calls == 1 && t.rec[2].calls == 1, "  no second callback");
    t_finish(&t, "close with queued commands");
    outbox__redis_url_free(&u);
}

static void test_tcp_and_names(const th_redis *srv)
{
    char url[128];
    test_basic("tcp 127.0.0.1", srv->tcp_url);
    snprintf(url, sizeof url, "redis://localhost:%d", srv->port);
    test_basic("tcp localhost", url);

    /* A literal IPv6 address, when the host has IPv6 loopback. */
    {
        int fd = socket(AF_INET6, SOCK_STREAM, 0), has_v6;
        struct sockaddr_in6 a;
        memset(&a, 0, sizeof a);
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_loopback;
        a.sin6_port = htons((uint16_t)srv->port);
        has_v6 = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
        if (fd >= 0)
            close(fd);
        if (has_v6) {
            snprintf(url, sizeof url, "redis://[::1]:%d", srv->port);
            test_basic("tcp [::1]", url);
        } else {
            ok(1, "# SKIP no IPv6 loopback");
        }
    }
}

static void test_refused(void)
{
    T t;
    char url[300], *dir, *path;
    int port;

    /* TCP: a loopback port with nothing listening. */
    {
        struct sockaddr_in a;
        socklen_t len = sizeof a;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        bind(fd, (struct sockaddr *)&a, sizeof a);
        getsockname(fd, (struct sockaddr *)&a, &len);
        port = ntohs(a.sin_port);
        close(fd); /* bound, never listened, now closed: refused */
    }
    t_init(&t);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    is_int(t_connect(&t, url, NULL), OUTBOX_ECONNECT, "tcp refused: ECONNECT");
    ok(t.connect_ms < 1000 * slow, "  promptly (%lld ms)", (long long)t.connect_ms);
    ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
    ok(!outbox__redis_is_connected(t.r), "  not connected");
    is_int(cmd(&t, 0, 0, "PING", NULL), OUTBOX_ECLOSED, "  command after a failed connect is ECLOSED");
    t_close(&t);
    is_int(t.connects, 1, "  connect_cb once");
    is_int(t.disconnects, 0, "  no disconnect_cb (never connected)");
    t_finish(&t, "tcp refused");

    /* By name: localhost may resolve to several addresses, all refused. */
    t_init(&t);
    snprintf(url, sizeof url, "redis://localhost:%d", port);
    is_int(t_connect(&t, url, NULL), OUTBOX_ECONNECT, "localhost refused: ECONNECT");
    ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "localhost refused");

    /* Unix: no such file, and a socket file nobody listens on. */
    dir = th_tmpdir();
    path = th_path(dir, "nothing.sock");
    t_init(&t);
    snprintf(url, sizeof url, "unix://%s", path);
    is_int(t_connect(&t, url, NULL), OUTBOX_ECONNECT, "unix missing: ECONNECT");
    ok(strstr(t.connect_err, "no such file") != NULL, "  errstr '%s'", t.connect_err);
    ok(t.connect_ms < 1000 * slow, "  promptly");
    t_close(&t);
    t_finish(&t, "unix missing");
    {
        struct sockaddr_un sa;
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
        bind(fd, (struct sockaddr *)&sa, sizeof sa);
        t_init(&t);
        is_int(t_connect(&t, url, NULL), OUTBOX_ECONNECT, "unix not listening: ECONNECT");
        ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
        t_close(&t);
        t_finish(&t, "unix not listening");
        close(fd);
    }
    free(path);
    th_rmtree(dir);
    free(dir);

    /* A name that does not resolve. */
    t_init(&t);
    {
        outbox__redis_options o;
        int st;
        outbox__redis_options_defaults(&o);
        o.connect_timeout_ms = 3000;
        st = t_connect(&t, "redis://no-such-host.invalid:6379", &o);
        ok(st == OUTBOX_ECONNECT || st == OUTBOX_ETIMEDOUT, "unresolvable host: ECONNECT (got %d)", st);
        if (st == OUTBOX_ECONNECT)
            ok(starts_with(t.connect_err, "resolve no-such-host.invalid: "), "  errstr '%s'", t.connect_err);
        else
            ok(1, "  resolver timed out (no DNS here)");
    }
    t_close(&t);
    t_finish(&t, "unresolvable");

    /* close() while uv_getaddrinfo is still in flight. */
    t_init(&t);
    {
        outbox__redis_url u;
        outbox__redis_url_parse("redis://localhost:1", &u, NULL, 0);
        outbox__redis_create(&t.r, &t.loop, &u, NULL, &t);
        outbox__redis_url_free(&u);
        outbox__redis_connect(t.r, on_connect, on_disconnect);
        outbox__redis_close(t.r, on_close, &t);
        t.r = NULL;
        is_int(t.connects, 1, "close while resolving: connect_cb at once");
        is_int(t.connect_status, OUTBOX_ECLOSED, "  ECLOSED");
        run_until(&t, &t.closes, 5000);
        is_int(t.closes, 1, "  close_cb once the resolver returned");
    }
    t_finish(&t, "close while resolving");
}

static void test_auth(void)
{
    th_redis srv;
    T t;
    char url[512];
    redisContext *c;
    redisReply *rep;

    if (th_redis_start(&srv, 1,
                       "requirepass s3cret\n"
                       "user alice on >pw ~* &* +@all\n"
                       "user bob on >p@ss:w%rd ~* &* +@all\n") != 0) {
        ok(0, "redis-server with requirepass started");
        return;
    }

    t_init(&t);
    snprintf(url, sizeof url, "%s?password=s3cret", srv.url);
    is_int(t_connect(&t, url, NULL), 0, "AUTH password: connected");
    cmd(&t, 0, 0, "PING", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "PONG", "  PING works");
    t_close(&t);
    t_finish(&t, "auth password");

    t_init(&t);
    snprintf(url, sizeof url, "%s?password=wrong", srv.url);
    is_int(t_connect(&t, url, NULL), OUTBOX_EAUTH, "wrong password: EAUTH");
    ok(starts_with(t.connect_err, "AUTH: WRONGPASS"), "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "auth wrong password");

    t_init(&t);
    is_int(t_connect(&t, srv.url, NULL), 0, "no password: connects (no handshake)");
    cmd(&t, 0, 0, "PING", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_int(t.rec[0].status, 0, "  PING status 0");
    ok(t.rec[0].type == REDIS_REPLY_ERROR && starts_with(t.rec[0].str, "NOAUTH"), "  NOAUTH error reply '%s'",
       t.rec[0].str);
    t_close(&t);
    t_finish(&t, "no password");

    t_init(&t);
    snprintf(url, sizeof url, "%s?db=3", srv.url);
    is_int(t_connect(&t, url, NULL), OUTBOX_EAUTH, "SELECT without password: EAUTH");
    ok(starts_with(t.connect_err, "SELECT: NOAUTH"), "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "select noauth");

    t_init(&t);
    snprintf(url, sizeof url, "%s?user=alice&password=pw", srv.url);
    is_int(t_connect(&t, url, NULL), 0, "ACL user over unix: connected");
    cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "alice", "  ACL WHOAMI is alice");
    t_close(&t);
    t_finish(&t, "acl unix");

    t_init(&t);
    snprintf(url, sizeof url, "redis://alice:pw@127.0.0.1:%d/2", srv.port);
    is_int(t_connect(&t, url, NULL), 0, "ACL user over TCP with SELECT: connected");
    cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    cmd(&t, 1, 0, "SET", "authdb", "two", NULL);
    run_until(&t, &t.rec[1].calls, 5000);
    is_str(t.rec[0].str, "alice", "  ACL WHOAMI is alice");
    t_close(&t);
    t_finish(&t, "acl tcp");

    t_init(&t);
    snprintf(url, sizeof url, "redis://bob:p%%40ss%%3Aw%%25rd@127.0.0.1:%d", srv.port);
    is_int(t_connect(&t, url, NULL), 0, "percent-encoded password: connected");
    cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "bob", "  ACL WHOAMI is bob");
    t_close(&t);
    t_finish(&t, "percent password");

    t_init(&t);
    snprintf(url, sizeof url, "redis://alice:nope@127.0.0.1:%d", srv.port);
    is_int(t_connect(&t, url, NULL), OUTBOX_EAUTH, "ACL wrong password: EAUTH");
    ok(starts_with(t.connect_err, "AUTH: WRONGPASS"), "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "acl wrong");

    t_init(&t);
    snprintf(url, sizeof url, "redis://mallory:pw@127.0.0.1:%d", srv.port);
    is_int(t_connect(&t, url, NULL), OUTBOX_EAUTH, "unknown ACL user: EAUTH");
    t_close(&t);
    t_finish(&t, "acl unknown user");

    /* th_redis_client authenticates with the requirepass from the config. */
    c = th_redis_client(&srv);
    rep = th_cmd(c, "SELECT 2");
    freeReplyObject(rep);
    rep = th_cmd(c, "GET authdb");
    is_str(rep->str, "two", "alice's SET went to db 2");
    freeReplyObject(rep);
    redisFree(c);
    th_redis_destroy(&srv);
}

static void test_select_and_name(const th_redis *srv)
{
    T t;
    char url[400];
    redisContext *c;
    redisReply *rep;
    outbox__redis_options o;

    t_init(&t);
    snprintf(url, sizeof url, "%s?db=3", srv->url);
    is_int(t_connect(&t, url, NULL), 0, "db 3: connected");
    cmd(&t, 0, 0, "SET", "selected", "in-three", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "OK", "  SET ok");
    t_close(&t);
    t_finish(&t, "select");

    c = th_redis_client(srv);
    rep = th_cmd(c, "GET selected");
    is_int(rep->type, REDIS_REPLY_NIL, "key not in db 0");
    freeReplyObject(rep);
    freeReplyObject(th_cmd(c, "SELECT 3"));
    rep = th_cmd(c, "GET selected");
    is_str(rep->str, "in-three", "key in db 3");
    freeReplyObject(rep);

    t_init(&t);
    snprintf(url, sizeof url, "%s/5", srv->tcp_url);
    is_int(t_connect(&t, url, NULL), 0, "db 5 over TCP: connected");
    cmd(&t, 0, 0, "SET", "selected5", "x", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    t_close(&t);
    t_finish(&t, "select tcp");
    freeReplyObject(th_cmd(c, "SELECT 5"));
    rep = th_cmd(c, "EXISTS selected5");
    is_int(rep->integer, 1, "key in db 5");
    freeReplyObject(rep);

    t_init(&t);
    snprintf(url, sizeof url, "%s?db=99", srv->url);
    is_int(t_connect(&t, url, NULL), OUTBOX_EREDIS, "db 99: EREDIS");
    ok(starts_with(t.connect_err, "SELECT: ERR DB index is out of range"), "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "select out of range");

    outbox__redis_options_defaults(&o);
    o.client_name = "outbox-test";
    t_init(&t);
    is_int(t_connect(&t, srv->url, &o), 0, "client name: connected");
    cmd(&t, 0, 0, "CLIENT", "GETNAME", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "outbox-test", "  CLIENT GETNAME");
    rep = th_cmd(c, "CLIENT LIST");
    ok(rep->str && strstr(rep->str, "name=outbox-test "), "  in CLIENT LIST");
    freeReplyObject(rep);
    t_close(&t);
    t_finish(&t, "client name");

    o.client_name = "has space";
    t_init(&t);
    is_int(t_connect(&t, srv->url, &o), OUTBOX_EREDIS, "bad client name: EREDIS");
    ok(starts_with(t.connect_err, "CLIENT SETNAME: ERR"), "  errstr '%s'", t.connect_err);
    t_close(&t);
    t_finish(&t, "bad client name");
    redisFree(c);
}

/* 10,000 pipelined commands. */
typedef struct pipe_state {
    T *t;
    int next;      /* index expected next */
    int in_order;  /* all replies came in order with the right value */
    int answered;
    size_t min_pending_seen;
} pipe_state;

static pipe_state ps;

static void on_incr(outbox__redis *r, int status, redisReply *reply, void *data)
{
    int i = (int)(intptr_t)data;
    if (status != 0 || !reply || reply->type != REDIS_REPLY_INTEGER || reply->integer != i + 1 || i != ps.next)
        ps.in_order = 0;
    ps.next = i + 1;
    ps.answered++;
    if (outbox__redis_pending(r) != (size_t)(10000 - ps.answered))
        ps.in_order = 0;
    if (ps.answered == 10000)
        ps.t->done = 1;
}

static void test_pipeline(const th_redis *srv)
{
    T t;
    const char *argv[] = {"INCR", "pipeline:counter"};
    char *fmt;
    int len, i, accepted = 0;
    int64_t start;

    t_init(&t);
    is_int(t_connect(&t, srv->url, NULL), 0, "pipeline: connected");
    len = redisFormatCommandArgv(&fmt, 2, argv, NULL);
    redisFreeCommand(fmt);
    memset(&ps, 0, sizeof ps);
    ps.t = &t;
    ps.in_order = 1;
    start = th_now_ms();
    for (i = 0; i < 10000; i++)
        accepted += outbox__redis_command_argv(t.r, 2, argv, NULL, 0, on_incr, (void *)(intptr_t)i) == 0;
    is_int(accepted, 10000, "10000 commands accepted");
    is_int(outbox__redis_pending(t.r), 10000, "  10000 pending");
    is_int(outbox__redis_queued_bytes(t.r), 10000 * (size_t)len, "  queued bytes exact");
    run_until(&t, &t.done, 10000);
    is_int(ps.answered, 10000, "  all answered");
    ok(ps.in_order, "  in order, each once, with exact pending counts");
    is_int(outbox__redis_pending(t.r), 0, "  nothing pending");
    is_int(outbox__redis_queued_bytes(t.r), 0, "  nothing queued");
    diag("10000 pipelined INCR in %lld ms", (long long)(th_now_ms() - start));
    t_close(&t);
    t_finish(&t, "pipeline");
}

/*
 * A command queued by an I/O callback (here a reply callback) is written in
 * the same loop turn, before the next turn's timers run: an application's
 * timer may block the loop for a while (its own commit and fsync), and the
 * command must not wait for it. The timer below is due at once and blocks;
 * while it does, another connection looks for the command's effect.
 */
typedef struct same_turn {
    T *t;
    const th_redis *srv;
    uv_timer_t timer;
    int issue_rc;
    int seen_while_blocked; /* 1: the SET reached Redis while the loop was blocked */
    int set_answered;
} same_turn;

static void st_on_set(outbox__redis *r, int status, redisReply *reply, void *data)
{
    same_turn *st = data;
    (void)r;
    (void)reply;
    st->set_answered = status == 0 ? 1 : -1;
    st->t->done = 1;
}

static void st_on_timer(uv_timer_t *h)
{
    same_turn *st = h->data;
    redisContext *c = th_redis_client(st->srv);
    int64_t deadline = th_now_ms() + 200 * slow;
    /* The loop is blocked here: only what was written before can arrive. */
    while (c && th_now_ms() < deadline && !st->seen_while_blocked) {
        redisReply *rep = th_cmd(c, "EXISTS sameturn:key");
        st->seen_while_blocked = rep && rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
        freeReplyObject(rep);
        if (!st->seen_while_blocked)
            usleep(1000);
    }
    if (c)
        redisFree(c);
}

static void st_on_ping(outbox__redis *r, int status, redisReply *reply, void *data)
{
    same_turn *st = data;
    const char *argv[] = {"SET", "sameturn:key", "1"};
    (void)status;
    (void)reply;
    st->issue_rc = outbox__redis_command_argv(r, 3, argv, NULL, 0, st_on_set, st);
    uv_timer_start(&st->timer, st_on_timer, 0, 0);
}

static void test_same_turn_flush(const th_redis *srv)
{
    T t;
    same_turn st;
    redisContext *c;
    const char *argv[] = {"PING"};

    t_init(&t);
    memset(&st, 0, sizeof st);
    st.t = &t;
    st.srv = srv;
    uv_timer_init(&t.loop, &st.timer);
    st.timer.data = &st;
    if ((c = th_redis_client(srv)) != NULL) {
        freeReplyObject(th_cmd(c, "DEL sameturn:key"));
        redisFree(c);
    }
    is_int(t_connect(&t, srv->url, NULL), 0, "same turn: connected");
    is_int(outbox__redis_command_argv(t.r, 1, argv, NULL, 0, st_on_ping, &st), 0, "  PING queued");
    run_until(&t, &t.done, 5000);
    is_int(st.issue_rc, 0, "  SET queued from the PING's reply callback");
    is_int(st.set_answered, 1, "  SET answered");
    ok(st.seen_while_blocked, "  SET reached Redis before the next turn's timer (which blocked the loop) ended");
    uv_close((uv_handle_t *)&st.timer, NULL);
    t_close(&t);
    t_finish(&t, "same turn");
}

static void test_reentrancy(const th_redis *srv)
{
    T t;
    int i;

    /* close() from inside a reply callback. */
    t_init(&t);
    is_int(t_connect(&t, srv->url, NULL), 0, "close in reply cb: connected");
    t.rec[1].close_here = 1;
    for (i = 0; i < 5; i++)
        cmd(&t, i, 0, "PING", NULL);
    run_until(&t, &t.closes, 5000);
    is_int(t.closes, 1, "  close_cb once");
    for (i = 0; i < 5; i++)
        is_int(t.rec[i].calls, 1, "  command %d called back once", i);
    ok(t.rec[0].status == 0 && t.rec[1].status == 0, "  first two answered");
    ok(t.rec[2].status == OUTBOX_ECLOSED && t.rec[3].status == OUTBOX_ECLOSED && t.rec[4].status == OUTBOX_ECLOSED,
       "  the rest ECLOSED");
    ok(t.rec[2].seq < t.rec[3].seq && t.rec[3].seq < t.rec[4].seq && t.rec[4].seq < t.close_seq,
       "  in order, all before close_cb");
    is_int(t.disconnects, 0, "  no disconnect_cb");
    t_finish(&t, "close in reply cb");

    /* New commands from inside reply callbacks, then close in the last. */
    t_init(&t);
    is_int(t_connect(&t, srv->url, NULL), 0, "commands from reply cb: connected");
    for (i = 0; i < 9; i++)
        t.rec[i].issue_here = i + 1;
    t.rec[9].close_here = 1;
    cmd(&t, 0, 0, "PING", NULL);
    run_until(&t, &t.closes, 5000);
    for (i = 0; i < 10; i++)
        if (t.rec[i].calls != 1 || t.rec[i].status != 0 || strcmp(t.rec[i].str, "PONG") != 0)
            break;
    is_int(i, 10, "  a chain of 10 commands, each issued by the previous reply");
    is_int(t.rec[0].issue_rc, 0, "  issue from callback accepted");
    is_int(t.closes, 1, "  closed from the last reply");
    t_finish(&t, "commands from reply cb");

    /* close() from inside connect_cb, success. */
    t_init(&t);
    t.close_in_connect_cb = 1;
    is_int(t_connect(&t, srv->url, NULL), 0, "close in connect_cb (success)");
    t.r = NULL;
    run_until(&t, &t.done, 200); /* let the deferred free happen */
    is_int(t.connects, 1, "  connect_cb once");
    t_finish(&t, "close in connect_cb");

    /* close() from inside connect_cb reached through handshake replies. */
    t_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.client_name = "closing";
        t.close_in_connect_cb = 1;
        is_int(t_connect(&t, srv->url, &o), 0, "close in connect_cb after a handshake");
        t.r = NULL;
    }
    t_finish(&t, "close in connect_cb after handshake");

    /* close() from inside connect_cb, failure. */
    t_init(&t);
    t.close_in_connect_cb = 1;
    is_int(t_connect(&t, "unix:///nonexistent/outbox.sock", NULL), OUTBOX_ECONNECT, "close in connect_cb (failure)");
    t.r = NULL;
    t_finish(&t, "close in failed connect_cb");

    /* A command issued and close() called from inside connect_cb. */
    t_init(&t);
    t.issue_in_connect_cb = 1;
    t.close_in_connect_cb = 1;
    is_int(t_connect(&t, srv->url, NULL), 0, "command then close in connect_cb");
    t.r = NULL;
    is_int(t.rec[0].issue_rc, 0, "  command accepted in connect_cb");
    is_int(t.rec[0].calls, 1, "  called back once");
    is_int(t.rec[0].status, OUTBOX_ECLOSED, "  with ECLOSED");
    t_finish(&t, "command then close in connect_cb");
}

/* Kills redis-server with commands in flight: a BLPOP that never returns
 * holds every later command in the server, unprocessed. */
#define KILL_N 2000
static int kill_calls[KILL_N], kill_status[KILL_N];
static int kill_answered;

static void on_kill_reply(outbox__redis *r, int status, redisReply *reply, void *data)
{
    int i = (int)(intptr_t)data;
    (void)r;
    (void)reply;
    kill_calls[i]++;
    kill_status[i] = status;
    if (status == 0)
        kill_answered++;
}

static void test_kill(void)
{
    th_redis srv;
    T t;
    int i, once = 1, ok_first = 1, closed_rest = 1, total = 0;
    const char *ping[] = {"PING"};
    const char *blpop[] = {"BLPOP", "never", "0"};

    if (th_redis_start(&srv, 0, NULL) != 0) {
        ok(0, "redis-server for the kill test started");
        return;
    }
    t_init(&t);
    is_int(t_connect(&t, srv.url, NULL), 0, "kill: connected");
    memset(kill_calls, 0, sizeof kill_calls);
    kill_answered = 0;
    for (i = 0; i < KILL_N; i++) {
        if (i == 100)
            outbox__redis_command_argv(t.r, 3, blpop, NULL, 0, on_kill_reply, (void *)(intptr_t)i);
        else
            outbox__redis_command_argv(t.r, 1, ping, NULL, 0, on_kill_reply, (void *)(intptr_t)i);
    }
    /* Wait for the 100 answers before the BLPOP, then kill. */
    while (kill_answered < 100 && th_now_ms() - t.t0 < 5000 * slow)
        uv_run(&t.loop, UV_RUN_ONCE);
    is_int(kill_answered, 100, "  100 answered before the BLPOP");
    th_redis_kill(&srv);
    run_until(&t, &t.disconnects, 5000);
    for (i = 0; i < KILL_N; i++) {
        total += kill_calls[i];
        if (kill_calls[i] != 1)
            once = 0;
        if (i < 100 && kill_status[i] != 0)
            ok_first = 0;
        if (i >= 100 && kill_status[i] != OUTBOX_ECLOSED)
            closed_rest = 0;
    }
    is_int(total, KILL_N, "  %d callbacks in all", KILL_N);
    ok(once, "  each command called back exactly once");
    ok(ok_first, "  the first 100 answered");
    ok(closed_rest, "  the other %d failed with ECLOSED", KILL_N - 100);
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ECLOSED, "  with ECLOSED");
    ok(t.disconnect_err[0] != '\0', "  errstr '%s'", t.disconnect_err);
    ok(!outbox__redis_is_connected(t.r), "  not connected");
    is_int(outbox__redis_pending(t.r), 0, "  nothing pending");
    is_int(outbox__redis_queued_bytes(t.r), 0, "  nothing queued");
    is_int(cmd(&t, 0, 0, "PING", NULL), OUTBOX_ECLOSED, "  new command: ECLOSED");
    run_until(&t, &t.done, 100);
    is_int(t.disconnects, 1, "  still one disconnect_cb");
    t_close(&t);
    is_int(t.closes, 1, "  close_cb once");
    t_finish(&t, "kill");

    /* The same server again, on the same socket: a new object connects. */
    is_int(th_redis_restart(&srv), 0, "restart redis-server");
    t_init(&t);
    is_int(t_connect(&t, srv.url, NULL), 0, "  reconnected with a new object");
    cmd(&t, 0, 0, "PING", NULL);
    run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "PONG", "  PING after restart");
    /* Stop the server gracefully this time, and close from disconnect_cb. */
    t.close_in_disconnect_cb = 1;
    th_redis_stop(&srv);
    run_until(&t, &t.closes, 5000);
    is_int(t.disconnects, 1, "  graceful stop: disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ECLOSED, "  ECLOSED");
    is_int(t.closes, 1, "  closed from disconnect_cb");
    t_finish(&t, "restart");
    th_redis_destroy(&srv);
}

static void test_real_timeout(const th_redis *srv)
{
    T t;
    int64_t start;
    t_init(&t);
    is_int(t_connect(&t, srv->url, NULL), 0, "reply timeout: connected");
    start = th_now_ms();
    cmd(&t, 0, 200, "BLPOP", "empty:list", "0", NULL);
    cmd(&t, 1, 0, "PING", NULL);
    run_until(&t, &t.disconnects, 5000);
    is_int(t.rec[0].status, OUTBOX_ETIMEDOUT, "  BLPOP ETIMEDOUT");
    is_int(t.rec[1].status, OUTBOX_ETIMEDOUT, "  the PING behind it ETIMEDOUT");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1, "  each once");
    ok(t.rec[1].seq < t.disconnect_seq, "  before disconnect_cb");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 200 ms", "  errstr");
    ok(th_now_ms() - start >= 190 && th_now_ms() - start < 2000 * slow, "  after about 200 ms (%lld)",
       (long long)(th_now_ms() - start));
    t_close(&t);
    t_finish(&t, "real timeout");
}

/* ---- fake server --------------------------------------------------------- */

static void test_fake_split(void)
{
    fake_server *fs = fake_server_start(FAKE_SPLIT, 0, 0);
    T t;
    char url[400];
    outbox__redis_options o;

    outbox__redis_options_defaults(&o);
    o.client_name = "split";
    t_init(&t);
    snprintf(url, sizeof url, "%s?db=2&password=x", fake_server_url(fs));
    is_int(t_connect(&t, url, &o), 0, "split replies: handshake of three commands");
    cmd(&t, 0, 0, "PING", NULL);
    cmd(&t, 1, 0, "ECHO", "hello", NULL);
    cmd(&t, 2, 0, "ARR", NULL);
    cmd(&t, 3, 0, "ERR", NULL);
    cmd(&t, 4, 0, "ECHO", "", NULL);
    run_until(&t, &t.rec[4].calls, 10000);
    is_str(t.rec[0].str, "PONG", "  status reply");
    is_str(t.rec[1].str, "hello", "  bulk reply");
    is_int(t.rec[2].type, REDIS_REPLY_ARRAY, "  array reply");
    is_int(t.rec[2].elements, 3, "  with 3 elements");
    ok(t.rec[3].status == 0 && t.rec[3].type == REDIS_REPLY_ERROR, "  error reply");
    is_str(t.rec[3].str, "ERR fake failure", "  error text");
    ok(t.rec[4].type == REDIS_REPLY_STRING && t.rec[4].str[0] == '\0', "  empty bulk");
    is_int(fake_server_commands(fs), 8, "  server saw 3 + 5 commands");
    t_close(&t);
    t_finish(&t, "split");
    fake_server_stop(fs);
}

static void test_fake_garbage(void)
{
    fake_server *fs = fake_server_start(FAKE_GARBAGE, 3, 1);
    T t;
    t_init(&t);
    is_int(t_connect(&t, fake_server_url(fs), NULL), 0, "garbage: connected");
    cmd(&t, 0, 0, "PING", NULL);
    cmd(&t, 1, 0, "PING", NULL);
    cmd(&t, 2, 0, "PING", NULL);
    run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == 0 && strcmp(t.rec[0].str, "PONG") == 0, "  first answered");
    is_int(t.rec[1].status, OUTBOX_EPROTO, "  second EPROTO");
    is_int(t.rec[2].status, OUTBOX_EPROTO, "  third EPROTO");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_EPROTO, "  EPROTO");
    ok(starts_with(t.disconnect_err, "protocol error: "), "  errstr '%s'", t.disconnect_err);
    ok(t.rec[2].seq < t.disconnect_seq, "  pending failed before disconnect_cb");
    t_close(&t);
    t_finish(&t, "garbage");
    fake_server_stop(fs);

    /* Garbage as the answer to the handshake. */
    fs = fake_server_start(FAKE_GARBAGE, 1, 0);
    t_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.client_name = "x";
        is_int(t_connect(&t, fake_server_url(fs), &o), OUTBOX_ECONNECT, "garbage in handshake: ECONNECT");
        ok(starts_with(t.connect_err, "handshake: protocol error"), "  errstr '%s'", t.connect_err);
    }
    t_close(&t);
    t_finish(&t, "garbage handshake");
    fake_server_stop(fs);
}

static void test_fake_silent(void)
{
    fake_server *fs = fake_server_start(FAKE_SILENT, 0, 0);
    T t;
    int64_t start;
    t_init(&t);
    is_int(t_connect(&t, fake_server_url(fs), NULL), 0, "silent: connected");
    start = th_now_ms();
    /* The shortest deadline is not the first command's. */
    cmd(&t, 0, 5000, "PING", NULL);
    cmd(&t, 1, 150, "PING", NULL);
    cmd(&t, 2, 5000, "PING", NULL);
    run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == OUTBOX_ETIMEDOUT && t.rec[1].status == OUTBOX_ETIMEDOUT &&
           t.rec[2].status == OUTBOX_ETIMEDOUT,
       "  all ETIMEDOUT");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq, "  in order");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 150 ms", "  errstr names the expired command");
    ok(th_now_ms() - start >= 140 && th_now_ms() - start < 1500 * slow, "  after about 150 ms (%lld)",
       (long long)(th_now_ms() - start));
    t_close(&t);
    t_finish(&t, "silent");

    /* close() and a new command from inside a callback that is being
     * failed: the rest are still failed with the error, once, and no
     * disconnect_cb follows a close(). */
    t_init(&t);
    is_int(t_connect(&t, fake_server_url(fs), NULL), 0, "close while failing: connected");
    t.rec[0].issue_here = 5;
    t.rec[1].close_here = 1;
    cmd(&t, 0, 100, "PING", NULL);
    cmd(&t, 1, 100, "PING", NULL);
    cmd(&t, 2, 100, "PING", NULL);
    run_until(&t, &t.closes, 5000);
    is_int(t.rec[0].issue_rc, OUTBOX_ECLOSED, "  command from a failure callback: ECLOSED");
    is_int(t.rec[5].calls, 0, "  and never called back");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.rec[2].status, OUTBOX_ETIMEDOUT, "  the one after close() still gets ETIMEDOUT");
    is_int(t.disconnects, 0, "  no disconnect_cb after close()");
    is_int(t.closes, 1, "  close_cb once");
    t_finish(&t, "close while failing");

    /* The default reply timeout applies when the command gives 0. */
    t_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.reply_timeout_ms = 100;
        is_int(t_connect(&t, fake_server_url(fs), &o), 0, "default reply timeout: connected");
    }
    cmd(&t, 0, 0, "PING", NULL);
    run_until(&t, &t.disconnects, 5000);
    is_int(t.rec[0].status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 100 ms", "  errstr");
    t_close(&t);
    t_finish(&t, "default timeout");

    /* Handshake never answered: the connect timeout. */
    t_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.connect_timeout_ms = 200;
        o.client_name = "x";
        is_int(t_connect(&t, fake_server_url(fs), &o), OUTBOX_ETIMEDOUT, "unanswered handshake: ETIMEDOUT");
        is_str(t.connect_err, "connect timeout after 200 ms", "  errstr");
    }
    t_close(&t);
    t_finish(&t, "handshake timeout");
    fake_server_stop(fs);
}

static void test_fake_no_accept(void)
{
    fake_server *fs = fake_server_start(FAKE_NO_ACCEPT, 0, 0);
    T t;
    outbox__redis_options o;
    char url[400];
    outbox__redis_options_defaults(&o);
    o.connect_timeout_ms = 300;
    t_init(&t);
    snprintf(url, sizeof url, "%s?password=x", fake_server_url(fs));
    is_int(t_connect(&t, url, &o), OUTBOX_ETIMEDOUT, "never accepted: ETIMEDOUT");
    ok(t.connect_ms >= 290 && t.connect_ms < 2000 * slow, "  after about 300 ms (%lld)", (long long)t.connect_ms);
    is_str(t.connect_err, "connect timeout after 300 ms", "  errstr");
    is_int(t.disconnects, 0, "  no disconnect_cb");
    t_close(&t);
    t_finish(&t, "no accept");
    is_int(fake_server_connections(fs), 0, "  the server accepted nothing");
    fake_server_stop(fs);
}

static void test_fake_close(void)
{
    fake_server *fs = fake_server_start(FAKE_CLOSE_MIDREPLY, 3, 1);
    T t;
    t_init(&t);
    is_int(t_connect(&t, fake_server_url(fs), NULL), 0, "closed mid-reply: connected");
    cmd(&t, 0, 0, "PING", NULL);
    cmd(&t, 1, 0, "PING", NULL);
    cmd(&t, 2, 0, "PING", NULL);
    run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == 0 && strcmp(t.rec[0].str, "PONG") == 0, "  first answered");
    is_int(t.rec[1].status, OUTBOX_ECLOSED, "  second ECLOSED");
    is_int(t.rec[2].status, OUTBOX_ECLOSED, "  third ECLOSED");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ECLOSED, "  ECLOSED");
    t_close(&t);
    t_finish(&t, "close mid-reply");
    fake_server_stop(fs);

    /* The server hangs up during the handshake. */
    fs = fake_server_start(FAKE_CLOSE_MIDREPLY, 1, 0);
    t_init(&t);
    {
        char url[400];
        snprintf(url, sizeof url, "%s?password=x", fake_server_url(fs));
        is_int(t_connect(&t, url, NULL), OUTBOX_ECONNECT, "hang-up in handshake: ECONNECT");
        ok(starts_with(t.connect_err, "handshake: "), "  errstr '%s'", t.connect_err);
    }
    t_close(&t);
    t_finish(&t, "hang-up in handshake");
    fake_server_stop(fs);
}

int main(void)
{
    th_redis srv;
    int64_t start = th_now_ms();

    /* libuv writes with write(2): a peer that went away raises SIGPIPE, which
     * the process using the library must ignore. */
    signal(SIGPIPE, SIG_IGN);
    if (getenv("OUTBOX_UNDER_VALGRIND"))
        slow = 5;

    if (th_redis_start(&srv, 1, NULL) != 0)
        skip_all("redis-server not available");

    test_basic("unix", srv.url);
    test_tcp_and_names(&srv);
    test_states(&srv);
    test_refused();
    test_select_and_name(&srv);
    test_pipeline(&srv);
    test_same_turn_flush(&srv);
    test_reentrancy(&srv);
    test_real_timeout(&srv);
    test_auth();
    test_kill();
    test_fake_split();
    test_fake_garbage();
    test_fake_silent();
    test_fake_no_accept();
    test_fake_close();

    th_redis_destroy(&srv);
    diag("total %lld ms", (long long)(th_now_ms() - start));
    return tap_done();
}
