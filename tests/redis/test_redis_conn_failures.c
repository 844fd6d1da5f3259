/*
 * test_redis_conn_failures.c: the libuv Redis connection (src/redis/redis.c)
 * against a server that misbehaves: a real redis-server that does not
 * answer in time (reply timeout), and a fake one (fake_server.c) that splits
 * replies, sends garbage, stays silent, never accepts or hangs up mid-reply,
 * and the stall watch on a TCP connection to one that stops answering.
 * Helpers: rc.h.
 */
#include <stdio.h>
#include <string.h>

#include "fake_server.h"
#include "harness.h"
#include "rc.h"
#include "tap.h"

static void test_real_timeout(const th_redis *srv)
{
    rc_conn t;
    int64_t start;
    rc_init(&t);
    is_int(rc_connect(&t, srv->url, NULL), 0, "reply timeout: connected");
    start = th_now_ms();
    rc_cmd(&t, 0, 200, "BLPOP", "empty:list", "0", NULL);
    rc_cmd(&t, 1, 0, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 5000);
    is_int(t.rec[0].status, OUTBOX_ETIMEDOUT, "  BLPOP ETIMEDOUT");
    is_int(t.rec[1].status, OUTBOX_ETIMEDOUT, "  the PING behind it ETIMEDOUT");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1, "  each once");
    ok(t.rec[1].seq < t.disconnect_seq, "  before disconnect_cb");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 200 ms", "  errstr");
    ok(th_now_ms() - start >= 190 && th_now_ms() - start < 2000 * rc_slow, "  after about 200 ms (%lld)",
       (long long)(th_now_ms() - start));
    rc_close(&t);
    rc_finish(&t, "real timeout");
}

/* ---- fake server --------------------------------------------------------- */

static void test_fake_split(void)
{
    fake_server *fs = fake_server_start(FAKE_SPLIT, 0, 0);
    rc_conn t;
    char url[400];
    outbox__redis_options o;

    outbox__redis_options_defaults(&o);
    o.client_name = "split";
    rc_init(&t);
    snprintf(url, sizeof url, "%s?db=2&password=x", fake_server_url(fs));
    is_int(rc_connect(&t, url, &o), 0, "split replies: handshake of three commands");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_cmd(&t, 1, 0, "ECHO", "hello", NULL);
    rc_cmd(&t, 2, 0, "ARR", NULL);
    rc_cmd(&t, 3, 0, "ERR", NULL);
    rc_cmd(&t, 4, 0, "ECHO", "", NULL);
    rc_run_until(&t, &t.rec[4].calls, 10000);
    is_str(t.rec[0].str, "PONG", "  status reply");
    is_str(t.rec[1].str, "hello", "  bulk reply");
    is_int(t.rec[2].type, REDIS_REPLY_ARRAY, "  array reply");
    is_int(t.rec[2].elements, 3, "  with 3 elements");
    ok(t.rec[3].status == 0 && t.rec[3].type == REDIS_REPLY_ERROR, "  error reply");
    is_str(t.rec[3].str, "ERR fake failure", "  error text");
    ok(t.rec[4].type == REDIS_REPLY_STRING && t.rec[4].str[0] == '\0', "  empty bulk");
    is_int(fake_server_commands(fs), 8, "  server saw 3 + 5 commands");
    rc_close(&t);
    rc_finish(&t, "split");
    fake_server_stop(fs);
}

static void test_fake_garbage(void)
{
    fake_server *fs = fake_server_start(FAKE_GARBAGE, 3, 1);
    rc_conn t;
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), NULL), 0, "garbage: connected");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_cmd(&t, 1, 0, "PING", NULL);
    rc_cmd(&t, 2, 0, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == 0 && strcmp(t.rec[0].str, "PONG") == 0, "  first answered");
    is_int(t.rec[1].status, OUTBOX_EPROTO, "  second EPROTO");
    is_int(t.rec[2].status, OUTBOX_EPROTO, "  third EPROTO");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_EPROTO, "  EPROTO");
    ok(rc_starts_with(t.disconnect_err, "protocol error: "), "  errstr '%s'", t.disconnect_err);
    ok(t.rec[2].seq < t.disconnect_seq, "  pending failed before disconnect_cb");
    rc_close(&t);
    rc_finish(&t, "garbage");
    fake_server_stop(fs);

    /* Garbage as the answer to the handshake. */
    fs = fake_server_start(FAKE_GARBAGE, 1, 0);
    rc_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.client_name = "x";
        is_int(rc_connect(&t, fake_server_url(fs), &o), OUTBOX_ECONNECT, "garbage in handshake: ECONNECT");
        ok(rc_starts_with(t.connect_err, "handshake: protocol error"), "  errstr '%s'", t.connect_err);
    }
    rc_close(&t);
    rc_finish(&t, "garbage handshake");
    fake_server_stop(fs);
}

/* Replies that come slowly but steadily: each command is owed its reply
 * from the one before it, so a pipeline that takes longer in all than one
 * timeout is not given up (each ECHO reply is written a byte at a time). */
static void test_fake_progress(void)
{
    fake_server *fs = fake_server_start(FAKE_SPLIT, 0, 0);
    rc_conn t;
    char big[401];
    int64_t start, took;
    int i, all = 1;
    /* 406 bytes a reply, at least 0.3 ms a byte: 16 replies take at least
     * 1.9 s, each about 0.12 s. */
    memset(big, 'b', 400);
    big[400] = '\0';
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), NULL), 0, "slow but steady: connected");
    start = th_now_ms();
    for (i = 0; i < 16; i++)
        rc_cmd(&t, i, 1000, "ECHO", big, NULL);
    rc_run_until(&t, &t.rec[15].calls, 60000 * rc_slow);
    took = th_now_ms() - start;
    for (i = 0; i < 16; i++)
        all = all && t.rec[i].status == 0 && t.rec[i].type == REDIS_REPLY_STRING;
    ok(all, "  every reply came, none timed out (%lld ms in all, 1000 ms each)", (long long)took);
    ok(took > 1000, "  in more than one command's timeout (%lld ms)", (long long)took);
    is_int(t.disconnects, 0, "  the connection stayed");
    rc_close(&t);
    rc_finish(&t, "slow but steady");
    fake_server_stop(fs);
}

static void test_fake_silent(void)
{
    fake_server *fs = fake_server_start(FAKE_SILENT, 0, 0);
    rc_conn t;
    int64_t start;
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), NULL), 0, "silent: connected");
    start = th_now_ms();
    /* A command's timeout counts from when it is the oldest waiting: the
     * first one's 400 ms, not the second's shorter 150. */
    rc_cmd(&t, 0, 400, "PING", NULL);
    rc_cmd(&t, 1, 150, "PING", NULL);
    rc_cmd(&t, 2, 400, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == OUTBOX_ETIMEDOUT && t.rec[1].status == OUTBOX_ETIMEDOUT &&
           t.rec[2].status == OUTBOX_ETIMEDOUT,
       "  all ETIMEDOUT");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    ok(t.rec[0].seq < t.rec[1].seq && t.rec[1].seq < t.rec[2].seq, "  in order");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 400 ms", "  errstr names the oldest command's timeout");
    ok(th_now_ms() - start >= 390 && th_now_ms() - start < 2000 * rc_slow, "  after about 400 ms (%lld)",
       (long long)(th_now_ms() - start));
    rc_close(&t);
    rc_finish(&t, "silent");

    /* close() and a new command from inside a callback that is being
     * failed: the rest are still failed with the error, once, and no
     * disconnect_cb follows a close(). */
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), NULL), 0, "close while failing: connected");
    t.rec[0].issue_here = 5;
    t.rec[1].close_here = 1;
    rc_cmd(&t, 0, 100, "PING", NULL);
    rc_cmd(&t, 1, 100, "PING", NULL);
    rc_cmd(&t, 2, 100, "PING", NULL);
    rc_run_until(&t, &t.closes, 5000);
    is_int(t.rec[0].issue_rc, OUTBOX_ECLOSED, "  command from a failure callback: ECLOSED");
    is_int(t.rec[5].calls, 0, "  and never called back");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.rec[2].status, OUTBOX_ETIMEDOUT, "  the one after close() still gets ETIMEDOUT");
    is_int(t.disconnects, 0, "  no disconnect_cb after close()");
    is_int(t.closes, 1, "  close_cb once");
    rc_finish(&t, "close while failing");

    /* The default reply timeout applies when the command gives 0. */
    rc_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.reply_timeout_ms = 100;
        is_int(rc_connect(&t, fake_server_url(fs), &o), 0, "default reply timeout: connected");
    }
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 5000);
    is_int(t.rec[0].status, OUTBOX_ETIMEDOUT, "  ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 100 ms", "  errstr");
    rc_close(&t);
    rc_finish(&t, "default timeout");

    /* Handshake never answered: the connect timeout. */
    rc_init(&t);
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.connect_timeout_ms = 200;
        o.client_name = "x";
        is_int(rc_connect(&t, fake_server_url(fs), &o), OUTBOX_ETIMEDOUT, "unanswered handshake: ETIMEDOUT");
        is_str(t.connect_err, "connect timeout after 200 ms", "  errstr");
    }
    rc_close(&t);
    rc_finish(&t, "handshake timeout");
    fake_server_stop(fs);
}

static void test_fake_no_accept(void)
{
    fake_server *fs = fake_server_start(FAKE_NO_ACCEPT, 0, 0);
    rc_conn t;
    outbox__redis_options o;
    char url[400];
    outbox__redis_options_defaults(&o);
    o.connect_timeout_ms = 300;
    rc_init(&t);
    snprintf(url, sizeof url, "%s?password=x", fake_server_url(fs));
    is_int(rc_connect(&t, url, &o), OUTBOX_ETIMEDOUT, "never accepted: ETIMEDOUT");
    ok(t.connect_ms >= 290 && t.connect_ms < 2000 * rc_slow, "  after about 300 ms (%lld)", (long long)t.connect_ms);
    is_str(t.connect_err, "connect timeout after 300 ms", "  errstr");
    is_int(t.disconnects, 0, "  no disconnect_cb");
    rc_close(&t);
    rc_finish(&t, "no accept");
    is_int(fake_server_connections(fs), 0, "  the server accepted nothing");
    fake_server_stop(fs);
}

static void test_fake_close(void)
{
    fake_server *fs = fake_server_start(FAKE_CLOSE_MIDREPLY, 3, 1);
    rc_conn t;
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), NULL), 0, "closed mid-reply: connected");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_cmd(&t, 1, 0, "PING", NULL);
    rc_cmd(&t, 2, 0, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 5000);
    ok(t.rec[0].status == 0 && strcmp(t.rec[0].str, "PONG") == 0, "  first answered");
    is_int(t.rec[1].status, OUTBOX_ECLOSED, "  second ECLOSED");
    is_int(t.rec[2].status, OUTBOX_ECLOSED, "  third ECLOSED");
    ok(t.rec[0].calls == 1 && t.rec[1].calls == 1 && t.rec[2].calls == 1, "  each once");
    is_int(t.disconnects, 1, "  disconnect_cb once");
    is_int(t.disconnect_status, OUTBOX_ECLOSED, "  ECLOSED");
    rc_close(&t);
    rc_finish(&t, "close mid-reply");
    fake_server_stop(fs);

    /* The server hangs up during the handshake. */
    fs = fake_server_start(FAKE_CLOSE_MIDREPLY, 1, 0);
    rc_init(&t);
    {
        char url[400];
        snprintf(url, sizeof url, "%s?password=x", fake_server_url(fs));
        is_int(rc_connect(&t, url, NULL), OUTBOX_ECONNECT, "hang-up in handshake: ECONNECT");
        ok(rc_starts_with(t.connect_err, "handshake: "), "  errstr '%s'", t.connect_err);
    }
    rc_close(&t);
    rc_finish(&t, "hang-up in handshake");
    fake_server_stop(fs);
}

/*
 * The stall watch (conn.c) on a TCP connection whose server reads but stops
 * answering, its kernel still acknowledging every byte: a server that is
 * busy or paused, not a network that drops packets. After a second of
 * silence the watch sends its PING, sees it acknowledged and leaves the
 * connection alone: the command ends by its own reply timeout, no probe
 * connection is made. A command that may wait in the server (a timeout
 * above the reply timeout) is not watched at all: no PING.
 */
static void test_stall_acked(void)
{
    fake_server *fs = fake_server_start(FAKE_STALL_FIRST, 1, 0);
    outbox__redis_options o;
    rc_conn t;
    int64_t start;

    outbox__redis_options_defaults(&o);
    o.reply_timeout_ms = 2500;
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), &o), 0, "stall watch, acknowledged: connected over TCP");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    is_str(t.rec[0].str, "PONG", "  the first command answered");
    start = th_now_ms();
    rc_cmd(&t, 1, 0, "PING", NULL);
    rc_run_until(&t, &t.disconnects, 10000 * rc_slow);
    is_int(t.rec[1].status, OUTBOX_ETIMEDOUT, "  the unanswered one ETIMEDOUT");
    is_str(t.disconnect_err, "reply timeout after 2500 ms", "  by its reply timeout, not the watch");
    ok(th_now_ms() - start >= 2400, "  after about 2500 ms (%lld)", (long long)(th_now_ms() - start));
    ok(fake_server_commands(fs) >= 3, "  the watch's PING went behind it (%d commands)", fake_server_commands(fs));
    is_int(fake_server_connections(fs), 1, "  and no probe connection was made");
    rc_close(&t);
    rc_finish(&t, "stall watch, acknowledged");
    fake_server_stop(fs);

    fs = fake_server_start(FAKE_STALL_FIRST, 1, 0);
    outbox__redis_options_defaults(&o);
    o.reply_timeout_ms = 500;
    rc_init(&t);
    is_int(rc_connect(&t, fake_server_url(fs), &o), 0, "stall watch, blocking command: connected");
    rc_cmd(&t, 0, 0, "PING", NULL);
    rc_run_until(&t, &t.rec[0].calls, 5000);
    rc_cmd(&t, 1, 2500, "XREAD", "BLOCK", "2000", "STREAMS", "s", "$", NULL);
    rc_run_until(&t, &t.disconnects, 10000 * rc_slow);
    is_str(t.disconnect_err, "reply timeout after 2500 ms", "  ends by its own timeout");
    is_int(fake_server_commands(fs), 2, "  no PING of the watch while it may block");
    rc_close(&t);
    rc_finish(&t, "stall watch, blocking command");
    fake_server_stop(fs);
}

int main(void)
{
    th_redis srv;
    int64_t start = rc_begin(&srv);

    test_real_timeout(&srv);
    test_fake_split();
    test_fake_progress();
    test_fake_garbage();
    test_fake_silent();
    test_fake_no_accept();
    test_fake_close();
    test_stall_acked();
    return rc_end(&srv, start);
}
