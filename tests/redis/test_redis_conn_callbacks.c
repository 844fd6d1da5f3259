/*
 * test_redis_conn_callbacks.c: the libuv Redis connection (src/redis/redis.c)
 * calls every callback exactly once: close() and new commands from inside
 * reply and connect callbacks, and a redis-server killed (then restarted,
 * then stopped) with 2,000 commands in flight. Helpers: rc.h.
 */
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "rc.h"
#include "tap.h"

static void test_reentrancy(const th_redis *srv)
{
    rc_conn t;
    int i;

    /* close() from inside a reply callback. */
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, NULL), 0, "close in reply cb: connected");
    t.rec[1].close_here = 1;
    for (i = 0; i < 5; i++)
        rc_cmd(&t, i, 0, "PING", NULL);
    rc_run_until(&t, &t.closes, 5000);
    is_int(t.closes, 1, "  close_cb once");
    for (i = 0; i < 5; i++)
        is_int(t.rec[i].calls, 1, "  command %d called back once", i);
    ok(t.rec[0].status == 0 && t.rec[1].status == 0, "  first two answered");
    ok(t.rec[2].status == OUTBOX_ECLOSED && t.rec[3].status == OUTBOX_ECLOSED && t.rec[4].status == OUTBOX_ECLOSED,
       "  the rest ECLOSED");
    ok(t.rec[2].seq < t.rec[3].seq && t.rec[3].seq < t.rec[4].seq && t.rec[4].seq < t.close_seq,
       "  in order, all before close_cb");
    is_int(t.disconnects, 0, "  no disconnect_cb");
    rc_finish(&t, "close in reply cb");

    /* New commands from inside reply callbacks, then close in the last. */
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, NULL), 0, "commands from reply cb: connected");
    for (i = 0; i < 9; i++)
        t.rec[i].issue_here = i + 1;
    t.rec[9].close_here = 1;
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.closes, 5000);
    for (i = 0; i < 10; i++)
        if (t.rec[i].calls != 1 || t.rec[i].status != 0 || strcmp(t.rec[i].str, "PONG") != 0)
            break;
    is_int(i, 10, "  a chain of 10 commands, each issued by the previous reply");
    is_int(t.rec[0].issue_rc, 0, "  issue from callback accepted");
    is_int(t.closes, 1, "  closed from the last reply");
    rc_finish(&t, "commands from reply cb");

    /* close() from inside connect_cb, success. */
    rc_init(&t);
    t.close_in_connect_cb = 1;
    is_int(rc_connect(&t, srv->url, NULL), 0, "close in connect_cb (success)");
    t.r = NULL;
    rc_run_until(&t, &t.done, 200); /* let the deferred free happen */
    is_int(t.connects, 1, "  connect_cb once");
    rc_finish(&t, "close in connect_cb");

    /* close() from inside connect_cb reached through handshake replies. */
    rc_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.client_name = "closing";
        t.close_in_connect_cb = 1;
        is_int(rc_connect(&t, srv->url, &o), 0, "close in connect_cb after a handshake");
        t.r = NULL;
    }
    rc_finish(&t, "close in connect_cb after handshake");

    /* close() from inside connect_cb, failure. */
    rc_init(&t);
    t.close_in_connect_cb = 1;
    is_int(rc_connect(&t, "unix:///nonexistent/outbox.sock", NULL), OUTBOX_ECONNECT, "close in connect_cb (failure)");
    t.r = NULL;
    rc_finish(&t, "close in failed connect_cb");

    /* A command issued and close() called from inside connect_cb. */
    rc_init(&t);
    t.issue_in_connect_cb = 1;
    t.close_in_connect_cb = 1;
    is_int(rc_connect(&t, srv->url, NULL), 0, "command then close in connect_cb");
    t.r = NULL;
    is_int(t.rec[0].issue_rc, 0, "  command accepted in connect_cb");
    is_int(t.rec[0].calls, 1, "  called back once");
    is_int(t.rec[0].status, OUTBOX_ECLOSED, "  with ECLOSED");
    rc_finish(&t, "command then close in connect_cb");
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
    rc_conn t;
    int i, once = 1, ok_first = 1, closed_rest = 1, total = 0;
    const char *ping[] = {"PING"};
    const char *blpop[] = {"BLPOP", "never", "0"};

    if (th_redis_start(&srv, 0, NULL) != 0) {
        ok(0, "redis-server for the kill test started");
        return;
    }
    rc_init(&t);
    is_int(rc_connect(&t, srv.url, NULL), 0, "kill: connected");
    memset(kill_calls, 0, sizeof kill_calls);
    kill_answered = 0;
    for (i = 0; i < KILL_N; i++) {
        if (i == 100)
            outbox__redis_command_argv(t.r, 3, blpop, NULL, 0, on_kill_reply, (void *)(intptr_t)i);
        else
            outbox__redis_command_argv(t.r, 1, ping, NULL, 0, on_kill_reply, (void *)(intptr_t)i);
    }
    /* Wait for the 100 answers before the BLPOP, then kill. */
    while (kill_answered < 100 && th_now_ms() - t.t0 < 5000 * rc_slow)
        uv_run(&t.loop, UV_RUN_ONCE);
    is_int(kill_answered, 100, "  100 answered before the BLPOP");
    th_redis_kill(&srv);
    rc_run_until(&t, &t.disconnects, 5000);
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
    is_int(rc_cmd(&t, 0, 0, "PING", NULL), OUTBOX_ECLOSED, "  new command: ECLOSED");
    rc_run_until(&t, &t.done, 100);
    is_int(t.disconnects, 1, "  still one disconnect_cb");
    rc_close(&t);
    is_int(t.closes, 1, "  close_cb once");
    rc_finish(&t, "kill");

    /* The same server again, on the same socket: a new object connects. */
    is_int(th_redis_restart(&srv), 0, "restart redis-server");
    rc_init(&t);
    is_int(rc_connect(&t, srv.url, NULL), 0, "  reconnected with a new object");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "PONG", "  PING after restart");
    /* Stop the server gracefully this time, and close from disconnect_cb. */
    t.close_in_disconnect_cb = 1;
    th_redis_stop(&srv);
    rc_run_until(&t, &t.closes, 5000);
    is_int(t.disconnects, 1, "  graceful stop: disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ECLOSED, "  ECLOSED");
    is_int(t.closes, 1, "  closed from disconnect_cb");
    rc_finish(&t, "restart");
    th_redis_destroy(&srv);
}

int main(void)
{
    th_redis srv;
    int64_t start = rc_begin(&srv);

    test_reentrancy(&srv);
    test_kill();
    return rc_end(&srv, start);
}
