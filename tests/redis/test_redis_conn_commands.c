/*
 * test_redis_conn_commands.c: the libuv Redis connection (src/redis/redis.c)
 * running commands on a real redis-server: over a Unix socket and TCP (by
 * address and by host name), binary-safe arguments, error replies, FIFO
 * order, SELECT and CLIENT SETNAME from the URL and the options, 10,000
 * pipelined commands, and a command queued by a reply callback written in
 * the same loop turn. Helpers: rc.h.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "rc.h"
#include "tap.h"

static void test_basic(const char *name, const char *url)
{
    rc_conn t;
    const char *setv[] = {"SET", "bin:key", "a\0b"};
    const size_t setl[] = {3, 7, 3};
    const char *getv[] = {"GET", "bin:key"};
    static const char raw_ping[] = "*1\r\n$4\r\nPING\r\n";
    char what[64];

    rc_init(&t);
    snprintf(what, sizeof what, "basic %s", name);
    is_int(rc_connect(&t, url, NULL), 0, "%s: connected", what);
    is_int(t.connects, 1, "%s: connect_cb once", what);
    is_str(t.connect_err, "", "%s: no error text", what);
    ok(outbox__redis_is_connected(t.r), "%s: is_connected", what);
    is_int(outbox__redis_connect(t.r, rc_on_connect, NULL), OUTBOX_ESTATE, "%s: second connect is ESTATE", what);

    is_int(rc_cmd(&t, 0, 0, "PING", NULL), 0, "%s: PING accepted", what);
    is_int(outbox__redis_pending(t.r), 1, "%s: one pending", what);
    is_int(outbox__redis_queued_bytes(t.r), sizeof raw_ping - 1, "%s: 14 bytes queued", what);
    is_int(outbox__redis_command_argv(t.r, 3, setv, setl, 0, rc_on_reply, &t.rec[1]), 0, "%s: binary SET", what);
    is_int(outbox__redis_command_argv(t.r, 2, getv, NULL, 0, rc_on_reply, &t.rec[2]), 0, "%s: GET", what);
    is_int(rc_cmd(&t, 3, 0, "NOSUCHCOMMAND", "x", NULL), 0, "%s: unknown command accepted", what);
    is_int(outbox__redis_command_raw(t.r, raw_ping, sizeof raw_ping - 1, 0, rc_on_reply, &t.rec[4]), 0,
           "%s: raw PING", what);
    is_int(outbox__redis_pending(t.r), 5, "%s: five pending", what);
    rc_run_until(&t, &t.rec[4].calls, 5000);

    is_int(t.rec[0].calls, 1, "%s: PING answered once", what);
    is_int(t.rec[0].type, REDIS_REPLY_STATUS, "%s: PING status reply", what);
    is_str(t.rec[0].str, "PONG", "%s: PONG", what);
    is_str(t.rec[1].str, "OK", "%s: SET OK", what);
    is_int(t.rec[2].type, REDIS_REPLY_STRING, "%s: GET bulk", what);
    ok(memcmp(t.rec[2].str, "a\0b", 3) == 0, "%s: binary-safe value", what);
    is_int(t.rec[3].status, 0, "%s: error reply has status 0", what);
    is_int(t.rec[3].type, REDIS_REPLY_ERROR, "%s: error reply type", what);
    ok(rc_starts_with(t.rec[3].str, "ERR unknown command"), "%s: error text '%s'", what, t.rec[3].str);
    is_str(t.rec[4].str, "PONG", "%s: raw PONG", what);
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq && t.rec[2].seq < t.rec[3].seq &&
           t.rec[3].seq < t.rec[4].seq,
       "%s: FIFO order", what);
    is_int(outbox__redis_pending(t.r), 0, "%s: nothing pending", what);
    is_int(outbox__redis_queued_bytes(t.r), 0, "%s: nothing queued", what);
    is_int(outbox__redis_command_argv(t.r, 0, getv, NULL, 0, rc_on_reply, NULL), OUTBOX_EINVAL,
           "%s: argc 0 is EINVAL", what);
    is_int(outbox__redis_command_raw(t.r, "", 0, 0, rc_on_reply, NULL), OUTBOX_EINVAL, "%s: empty raw is EINVAL",
           what);
    rc_close(&t);
    is_int(t.closes, 1, "%s: close_cb once", what);
    is_int(t.disconnects, 0, "%s: no disconnect_cb after close", what);
    rc_finish(&t, what);
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
            skip("no IPv6 loopback");
        }
    }
}

static void test_select_and_name(const th_redis *srv)
{
    rc_conn t;
    char url[400];
    redisContext *c;
    redisReply *rep;
    outbox__redis_options o;

    rc_init(&t);
    snprintf(url, sizeof url, "%s?db=3", srv->url);
    is_int(rc_connect(&t, url, NULL), 0, "db 3: connected");
    rc_cmd(&t, 0, 0, "SET", "selected", "in-three", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "OK", "  SET ok");
    rc_close(&t);
    rc_finish(&t, "select");

    c = th_redis_client(srv);
    rep = th_cmd(c, "GET selected");
    is_int(rep->type, REDIS_REPLY_NIL, "key not in db 0");
    freeReplyObject(rep);
    freeReplyObject(th_cmd(c, "SELECT 3"));
    rep = th_cmd(c, "GET selected");
    is_str(rep->str, "in-three", "key in db 3");
    freeReplyObject(rep);

    rc_init(&t);
    snprintf(url, sizeof url, "%s/5", srv->tcp_url);
    is_int(rc_connect(&t, url, NULL), 0, "db 5 over TCP: connected");
    rc_cmd(&t, 0, 0, "SET", "selected5", "x", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    rc_close(&t);
    rc_finish(&t, "select tcp");
    freeReplyObject(th_cmd(c, "SELECT 5"));
    rep = th_cmd(c, "EXISTS selected5");
    is_int(rep->integer, 1, "key in db 5");
    freeReplyObject(rep);

    rc_init(&t);
    snprintf(url, sizeof url, "%s?db=99", srv->url);
    is_int(rc_connect(&t, url, NULL), OUTBOX_EREDIS, "db 99: EREDIS");
    ok(rc_starts_with(t.connect_err, "SELECT: ERR DB index is out of range"), "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "select out of range");

    outbox__redis_options_defaults(&o);
    o.client_name = "outbox-test";
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, &o), 0, "client name: connected");
    rc_cmd(&t, 0, 0, "CLIENT", "GETNAME", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "outbox-test", "  CLIENT GETNAME");
    rep = th_cmd(c, "CLIENT LIST");
    ok(rep->str && strstr(rep->str, "name=outbox-test "), "  in CLIENT LIST");
    freeReplyObject(rep);
    rc_close(&t);
    rc_finish(&t, "client name");

    o.client_name = "has space";
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, &o), OUTBOX_EREDIS, "bad client name: EREDIS");
    ok(rc_starts_with(t.connect_err, "CLIENT SETNAME: ERR"), "  errstr '%s'", t.connect_err);
    rc_close(&t);
    rc_finish(&t, "bad client name");
    redisFree(c);
}

/* 10,000 pipelined commands. */
typedef struct pipe_state {
    rc_conn *t;
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
    rc_conn t;
    const char *argv[] = {"INCR", "pipeline:counter"};
    char *fmt;
    int len, i, accepted = 0;
    int64_t start;

    rc_init(&t);
    is_int(rc_connect(&t, srv->url, NULL), 0, "pipeline: connected");
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
    rc_run_until(&t, &t.done, 10000);
    is_int(ps.answered, 10000, "  all answered");
    ok(ps.in_order, "  in order, each once, with exact pending counts");
    is_int(outbox__redis_pending(t.r), 0, "  nothing pending");
    is_int(outbox__redis_queued_bytes(t.r), 0, "  nothing queued");
    diag("10000 pipelined INCR in %lld ms", (long long)(th_now_ms() - start));
    rc_close(&t);
    rc_finish(&t, "pipeline");
}

/*
 * A command queued by an I/O callback (here a reply callback) is written in
 * the same loop turn, before the next turn's timers run: an application's
 * timer may block the loop for a while (its own commit and fsync), and the
 * command must not wait for it. The timer below is due at once and blocks;
 * while it does, another connection looks for the command's effect.
 */
typedef struct same_turn {
    rc_conn *t;
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
    int64_t deadline = th_now_ms() + 200 * rc_slow;
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
    rc_conn t;
    same_turn st;
    redisContext *c;
    const char *argv[] = {"PING"};

    rc_init(&t);
    memset(&st, 0, sizeof st);
    st.t = &t;
    st.srv = srv;
    uv_timer_init(&t.loop, &st.timer);
    st.timer.data = &st;
    if ((c = th_redis_client(srv)) != NULL) {
        freeReplyObject(th_cmd(c, "DEL sameturn:key"));
        redisFree(c);
    }
    is_int(rc_connect(&t, srv->url, NULL), 0, "same turn: connected");
    is_int(outbox__redis_command_argv(t.r, 1, argv, NULL, 0, st_on_ping, &st), 0, "  PING queued");
    rc_run_until(&t, &t.done, 5000);
    is_int(st.issue_rc, 0, "  SET queued from the PING's reply callback");
    is_int(st.set_answered, 1, "  SET answered");
    ok(st.seen_while_blocked, "  SET reached Redis before the next turn's timer (which blocked the loop) ended");
    uv_close((uv_handle_t *)&st.timer, NULL);
    rc_close(&t);
    rc_finish(&t, "same turn");
}

int main(void)
{
    th_redis srv;
    int64_t start = rc_begin(&srv);

    test_basic("unix", srv.url);
    test_tcp_and_names(&srv);
    test_select_and_name(&srv);
    test_pipeline(&srv);
    test_same_turn_flush(&srv);
    return rc_end(&srv, start);
}
