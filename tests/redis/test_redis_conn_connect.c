/*
 * test_redis_conn_connect.c: the libuv Redis connection (src/redis/redis.c)
 * before and while it connects: commands and close() before the connection
 * is up, invalid arguments, refused connections (TCP, by name, Unix), a host
 * name that does not resolve, close() while resolving, and AUTH (password,
 * ACL users, percent-encoded credentials, wrong ones) against a real
 * redis-server. Helpers: rc.h.
 */
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "rc.h"
#include "tap.h"

static void test_states(const th_redis *srv)
{
    rc_conn t;
    outbox__redis_url u;
    outbox__redis_options o;

    /* Commands before the connection is up. */
    rc_init(&t);
    outbox__redis_url_parse(srv->url, &u, NULL, 0);
    is_int(outbox__redis_create(&t.r, &t.loop, &u, NULL, &t), 0, "create");
    is_int(rc_cmd(&t, 0, 0, "PING", NULL), OUTBOX_ESTATE, "command before connect is ESTATE");
    ok(!outbox__redis_is_connected(t.r), "not connected before connect");
    is_str(outbox__redis_errstr(t.r), "", "errstr empty at first");
    is_int(outbox__redis_connect(t.r, rc_on_connect, rc_on_disconnect), 0, "connect");
    is_int(rc_cmd(&t, 0, 0, "PING", NULL), OUTBOX_ESTATE, "command while connecting is ESTATE");
    rc_close(&t);
    is_int(t.connects, 1, "close while connecting: connect_cb called");
    is_int(t.connect_status, OUTBOX_ECLOSED, "  with ECLOSED");
    ok(t.connect_seq < t.close_seq, "  before close_cb");
    is_int(t.closes, 1, "  close_cb once");
    is_int(t.rec[0].calls, 0, "  refused commands never called back");
    rc_finish(&t, "close while connecting");

    /* Closing an object that never connected. */
    rc_init(&t);
    is_int(outbox__redis_create(&t.r, &t.loop, &u, NULL, &t), 0, "create again");
    rc_close(&t);
    is_int(t.closes, 1, "close without connect: close_cb once");
    is_int(t.connects, 0, "  no connect_cb");
    rc_finish(&t, "close without connect");
    outbox__redis_close(NULL, rc_on_close, &t);
    is_int(t.closes, 1, "close(NULL) is a no-op: its close_cb is not called");

    /* Invalid arguments. */
    rc_init(&t);
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
    rc_finish(&t, "invalid arguments");

    /* Close with commands queued, from outside any callback. */
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, NULL), 0, "connected");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_cmd(&t, 1, 0, "PING", NULL);
    rc_cmd(&t, 2, 0, "PING", NULL);
    outbox__redis_close(t.r, rc_on_close, &t);
    t.r = NULL;
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1,
       "close fails queued commands before it returns");
    ok(t.rec[0].status == OUTBOX_ECLOSED && t.rec[2].status == OUTBOX_ECLOSED, "  with ECLOSED");
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq, "  in order");
    is_int(t.closes, 0, "  close_cb not yet");
    rc_run_until(&t, &t.closes, 5000);
    is_int(t.closes, 1, "  close_cb once, later");
    ok(t.rec[0].calls == 1 && t.rec[2].calls == 1, "  no second callback");
    rc_finish(&t, "close with queued commands");
    outbox__redis_url_free(&u);
}

static void test_refused(void)
{
    rc_conn t;
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
    rc_init(&t);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    is_int(rc_connect(&t, url, NULL), OUTBOX_ECONNECT, "tcp refused: ECONNECT");
    ok(t.connect_ms < 1000 * rc_slow, "  promptly (%lld ms)", (long long)t.connect_ms);
    ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
    ok(!outbox__redis_is_connected(t.r), "  not connected");
    is_int(rc_cmd(&t, 0, 0, "PING", NULL), OUTBOX_ECLOSED, "  command after a failed connect is ECLOSED");
    rc_close(&t);
    is_int(t.connects, 1, "  connect_cb once");
    is_int(t.disconnects, 0, "  no disconnect_cb (never connected)");
    rc_finish(&t, "tcp refused");

    /* By name: localhost may resolve to several addresses, all refused. */
    rc_init(&t);
    snprintf(url, sizeof url, "redis://localhost:%d", port);
    is_int(rc_connect(&t, url, NULL), OUTBOX_ECONNECT, "localhost refused: ECONNECT");
    ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "localhost refused");

    /* Unix: no such file, and a socket file nobody listens on. */
    dir = th_tmpdir();
    path = th_path(dir, "nothing.sock");
    rc_init(&t);
    snprintf(url, sizeof url, "unix://%s", path);
    is_int(rc_connect(&t, url, NULL), OUTBOX_ECONNECT, "unix missing: ECONNECT");
    ok(strstr(t.connect_err, "no such file") != NULL, "  errstr '%s'", t.connect_err);
    ok(t.connect_ms < 1000 * rc_slow, "  promptly");
    rc_close(&t);
    rc_finish(&t, "unix missing");
    {
        struct sockaddr_un sa;
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
        bind(fd, (struct sockaddr *)&sa, sizeof sa);
        rc_init(&t);
        is_int(rc_connect(&t, url, NULL), OUTBOX_ECONNECT, "unix not listening: ECONNECT");
        ok(strstr(t.connect_err, "connection refused") != NULL, "  errstr '%s'", t.connect_err);
        rc_close(&t);
        rc_finish(&t, "unix not listening");
        close(fd);
    }
    free(path);
    th_rmtree(dir);
    free(dir);

    /* A name that does not resolve. */
    rc_init(&t);
    {
        outbox__redis_options o;
        int st;
        outbox__redis_options_defaults(&o);
        o.connect_timeout_ms = 3000;
        st = rc_connect(&t, "redis://no-such-host.invalid:6379", &o);
        ok(st == OUTBOX_ECONNECT || st == OUTBOX_ETIMEDOUT, "unresolvable host: ECONNECT (got %d)", st);
        if (st == OUTBOX_ECONNECT)
            ok(rc_starts_with(t.connect_err, "resolve no-such-host.invalid: "), "  errstr '%s'", t.connect_err);
        else
            is_str(t.connect_err, "connect timeout after 3000 ms",
                   "  resolver timed out (no DNS here): the connect timeout of 3000 ms");
    }
    rc_close(&t);
    rc_finish(&t, "unresolvable");

    /* close() while uv_getaddrinfo is still in flight. */
    rc_init(&t);
    {
        outbox__redis_url u;
        outbox__redis_url_parse("redis://localhost:1", &u, NULL, 0);
        outbox__redis_create(&t.r, &t.loop, &u, NULL, &t);
        outbox__redis_url_free(&u);
        outbox__redis_connect(t.r, rc_on_connect, rc_on_disconnect);
        outbox__redis_close(t.r, rc_on_close, &t);
        t.r = NULL;
        is_int(t.connects, 1, "close while resolving: connect_cb at once");
        is_int(t.connect_status, OUTBOX_ECLOSED, "  ECLOSED");
        rc_run_until(&t, &t.closes, 5000);
        is_int(t.closes, 1, "  close_cb once the resolver returned");
    }
    rc_finish(&t, "close while resolving");
}

static void test_auth(void)
{
    th_redis srv;
    rc_conn t;
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

    rc_init(&t);
    snprintf(url, sizeof url, "%s?password=s3cret", srv.url);
    is_int(rc_connect(&t, url, NULL), 0, "AUTH password: connected");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "PONG", "  PING works");
    rc_close(&t);
    rc_finish(&t, "auth password");

    rc_init(&t);
    snprintf(url, sizeof url, "%s?password=wrong", srv.url);
    is_int(rc_connect(&t, url, NULL), OUTBOX_EAUTH, "wrong password: EAUTH");
    ok(rc_starts_with(t.connect_err, "AUTH: WRONGPASS"), "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "auth wrong password");

    rc_init(&t);
    is_int(rc_connect(&t, srv.url, NULL), 0, "no password: connects (no handshake)");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_int(t.rec[0].status, 0, "  PING status 0");
    ok(t.rec[0].type == REDIS_REPLY_ERROR && rc_starts_with(t.rec[0].str, "NOAUTH"), "  NOAUTH error reply '%s'",
       t.rec[0].str);
    rc_close(&t);
    rc_finish(&t, "no password");

    rc_init(&t);
    snprintf(url, sizeof url, "%s?db=3", srv.url);
    is_int(rc_connect(&t, url, NULL), OUTBOX_EAUTH, "SELECT without password: EAUTH");
    ok(rc_starts_with(t.connect_err, "SELECT: NOAUTH"), "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "select noauth");

    rc_init(&t);
    snprintf(url, sizeof url, "%s?user=alice&password=pw", srv.url);
    is_int(rc_connect(&t, url, NULL), 0, "ACL user over unix: connected");
    rc_cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "alice", "  ACL WHOAMI is alice");
    rc_close(&t);
    rc_finish(&t, "acl unix");

    rc_init(&t);
    snprintf(url, sizeof url, "redis://alice:pw@127.0.0.1:%d/2", srv.port);
    is_int(rc_connect(&t, url, NULL), 0, "ACL user over TCP with SELECT: connected");
    rc_cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    rc_cmd(&t, 1, 0, "SET", "authdb", "two", NULL);
    rc_run_until(&t, &t.rec[1].calls, 5000);
    is_str(t.rec[0].str, "alice", "  ACL WHOAMI is alice");
    rc_close(&t);
    rc_finish(&t, "acl tcp");

    rc_init(&t);
    snprintf(url, sizeof url, "redis://bob:p%%40ss%%3Aw%%25rd@127.0.0.1:%d", srv.port);
    is_int(rc_connect(&t, url, NULL), 0, "percent-encoded password: connected");
    rc_cmd(&t, 0, 0, "ACL", "WHOAMI", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "bob", "  ACL WHOAMI is bob");
    rc_close(&t);
    rc_finish(&t, "percent password");

    rc_init(&t);
    snprintf(url, sizeof url, "redis://alice:nope@127.0.0.1:%d", srv.port);
    is_int(rc_connect(&t, url, NULL), OUTBOX_EAUTH, "ACL wrong password: EAUTH");
    ok(rc_starts_with(t.connect_err, "AUTH: WRONGPASS"), "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "acl wrong");

    rc_init(&t);
    snprintf(url, sizeof url, "redis://mallory:pw@127.0.0.1:%d", srv.port);
    is_int(rc_connect(&t, url, NULL), OUTBOX_EAUTH, "unknown ACL user: EAUTH");
    rc_close(&t);
    rc_finish(&t, "acl unknown user");

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

int main(void)
{
    th_redis srv;
    int64_t start = rc_begin(&srv);

    test_states(&srv);
    test_refused();
    test_auth();
    return rc_end(&srv, start);
}
