/*
 * test_fencing.c: a stale worker's late marks are refused.
 *
 * The relay runs embedded on this test's own loop. Redis holds every write
 * (CLIENT PAUSE ... WRITE, from a second client), so the relay's XADDs wait
 * for their replies with the rows claimed (state 1: new rows, claimed in
 * batch leases of "relay-a"). Meanwhile the leases are taken over by SQL, as
 * another relay would after they expired: new owner, token + 1 (of the batch
 * records, and of any row leased on its own). When Redis answers, relay-a's
 * marks (published, one per batch) must change nothing: the rows keep the
 * other owner's token, owner and state, and the relay counts every message
 * in fenced_total.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 200
#define PAUSE_MS 9000

typedef struct test {
    uv_loop_t loop;
    uv_timer_t poll;
    outbox_relay *relay;
    sqlite3 *db;
    redisContext *c;
    int phase;
    int64_t t0, takeover_at;
    int stopped;
    long fenced_logged;
    long xlen_at_takeover;
    long claimed_seen;
    outbox_relay_stats st;
} test;

static void on_log(void *data, outbox_log_level level, const char *msg)
{
    test *t = data;
    (void)level;
    if (strstr(msg, "mark refused") && strstr(msg, "mark=published"))
        t->fenced_logged++;
}

static void on_stopped(outbox_relay *r, void *data)
{
    test *t = data;
    (void)r;
    t->stopped = 1;
}

static void finish(test *t)
{
    uv_timer_stop(&t->poll);
    uv_close((uv_handle_t *)&t->poll, NULL);
    if (outbox_relay_stop(t->relay, on_stopped, t) != 0)
        t->stopped = 1;
}

static void on_poll(uv_timer_t *h)
{
    test *t = h->data;
    int64_t now = th_now_ms();

    if (now - t->t0 > 20000 * th_slow()) {
        diag("timed out in phase %d", t->phase);
        finish(t);
        return;
    }
    switch (t->phase) {
    case 0:
        /* Wait until relay-a holds every row and its XADDs are waiting. */
        t->claimed_seen =
            (long)th_sql_int(t->db, "SELECT count(*) FROM outbox_messages WHERE state = 1 AND lease_owner = 'relay-a'");
        if (t->claimed_seen < N)
            return;
        t->xlen_at_takeover = (long)th_xlen(t->c, "outbox:fence");
        t->takeover_at = now - t->t0;
        /* The takeover another relay would do once the lease expired. */
        th_sql_exec(t->db, "UPDATE outbox SET lease_owner = 'relay-b', lease_token = lease_token + 1, "
                       "lease_until = %lld WHERE state = 1",
                (long long)(rt_unix_ms() + 600000));
        th_sql_exec(t->db, "UPDATE outbox_batch SET owner = 'relay-b', token = token + 1, lease_until = %lld "
                       "WHERE state = 1",
                (long long)(rt_unix_ms() + 600000));
        /* Then Redis answers. */
        freeReplyObject(th_cmd(t->c, "CLIENT UNPAUSE"));
        t->phase = 1;
        return;
    case 1:
        /* The replies come now that the pause ended; each mark is refused. */
        outbox_relay_stats_get(t->relay, &t->st);
        if (t->st.fenced_total < N || t->st.inflight > 0)
            return;
        finish(t);
        t->phase = 2;
        return;
    default:
        return;
    }
}

int main(void)
{
    th_redis srv;
    test t;
    outbox_relay_settings s;
    char *dir, *dbpath, err[512];
    redisReply *rep;
    int e, pause_ms;

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    memset(&t, 0, sizeof t);
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    t.db = rt_open(dbpath);
    rt_insert_rows(t.db, "f", 0, N, "fence", 0);
    t.c = th_redis_client(&srv);

    is_int(uv_loop_init(&t.loop), 0, "loop initialised");
    outbox_relay_defaults(&s);
    s.db_path = dbpath;
    s.redis_url = srv.url;
    s.worker_id = "relay-a";
    s.log = on_log;
    s.log_data = &t;
    e = outbox_relay_create(&t.relay, &t.loop, &s, err, sizeof err);
    is_int(e, 0, "outbox_relay_create (%s)", err);
    if (e != 0)
        bail("cannot create the relay");

    /* Ended by the test at the takeover; at most just below the relay's
     * 10 s reply timeout, also under valgrind. */
    pause_ms = PAUSE_MS;
    rep = th_cmd(t.c, "CLIENT PAUSE %d WRITE", pause_ms);
    ok(rep->type == REDIS_REPLY_STATUS, "CLIENT PAUSE WRITE accepted");
    freeReplyObject(rep);
    t.t0 = th_now_ms();
    is_int(outbox_relay_start(t.relay), 0, "outbox_relay_start");
    uv_timer_init(&t.loop, &t.poll);
    t.poll.data = &t;
    uv_timer_start(&t.poll, on_poll, 5, 5);
    uv_run(&t.loop, UV_RUN_DEFAULT);

    is_int(t.claimed_seen, N, "relay-a claimed all %d rows while Redis held the writes", N);
    is_int(t.xlen_at_takeover, 0, "no XADD had been answered at the takeover");
    ok(t.takeover_at > 0 && t.takeover_at < pause_ms,
       "the takeover happened while the replies were held (at %lld ms)", (long long)t.takeover_at);
    is_int(t.st.fenced_total, N, "fenced_total counts every refused mark");
    is_int(t.st.published_total, 0, "no mark counted as published");
    is_int(t.fenced_logged, N, "each refused mark is logged, each one a 'published' mark");
    is_int(th_sql_int(t.db, "SELECT count(*) FROM outbox_messages WHERE state = 1 AND lease_owner = 'relay-b' "
                        "AND lease_token = 2 AND stream_id IS NULL AND published_at IS NULL"),
           N, "every row keeps the new owner, its token and state 1");
    is_int(th_xlen(t.c, "outbox:fence"), N, "the XADDs themselves were appended (at-least-once)");
    ok(t.stopped, "the relay stopped");

    outbox_relay_destroy(t.relay);
    uv_run(&t.loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&t.loop), 0, "uv_loop_close");

    redisFree(t.c);
    sqlite3_close_v2(t.db);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dbpath);
    free(dir);
    return tap_done();
}
