/*
 * test_stats.c: outbox_relay_stats_get answers from the figures /metrics
 * shows, refreshed off the loop thread: OUTBOX_EBUSY (figures -1) before the
 * first refresh, then the table's counts and the oldest due pending row's
 * age; the counters and the window are current at every call. Redis is down
 * (a socket path nobody listens on), so nothing leaves pending.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "relay/rt.h"
#include "tap.h"

typedef struct state {
    outbox_relay *r;
    sqlite3 *db;
    uv_timer_t poll;
    int polls, first_rc, ready;
    outbox_relay_stats st;
    int64_t t_ready;
} state;

static void on_stopped(outbox_relay *r, void *data)
{
    state *s = data;
    (void)r;
    uv_close((uv_handle_t *)&s->poll, NULL);
}

static void on_poll(uv_timer_t *t)
{
    state *s = t->data;
    int rc = outbox_relay_stats_get(s->r, &s->st);
    s->polls++;
    if (rc == 0 || s->polls > 400) {
        s->ready = rc == 0;
        s->t_ready = rt_unix_ms();
        uv_timer_stop(t);
        outbox_relay_stop(s->r, on_stopped, s);
    }
}

int main(void)
{
    uv_loop_t loop;
    outbox_relay_settings cfg;
    state s;
    char err[256], *dir = th_tmpdir(), *dbpath, url[600];
    int64_t oldest, pending;

    memset(&s, 0, sizeof s);
    dbpath = rt_make_db(dir, "app.db");
    s.db = rt_open(dbpath);
    rt_insert_rows(s.db, "st", 0, 100, "stats", 0);
    th_sql_exec(s.db, "UPDATE outbox SET created_at = created_at - 5000, available_at = available_at - 5000");
    rt_insert_rows(s.db, "dead", 0, 3, "stats", 0);
    th_sql_exec(s.db, "UPDATE outbox SET state = 3 WHERE id LIKE 'dead-%%'");
    oldest = th_sql_int(s.db, "SELECT min(available_at) FROM outbox_messages WHERE state = 0");
    pending = th_sql_int(s.db, "SELECT count(*) FROM outbox_messages WHERE state = 0");

    uv_loop_init(&loop);
    outbox_relay_defaults(&cfg);
    cfg.db_path = dbpath;
    snprintf(url, sizeof url, "unix://%s/nobody.sock", dir);
    cfg.redis_url = url;
    cfg.log_level = OUTBOX_LOG_ERROR;
    cfg.retention_ms = 0;
    ok(outbox_relay_create(&s.r, &loop, &cfg, err, sizeof err) == 0, "create (%s)", err);
    ok(outbox_relay_start(s.r) == 0, "start");
    s.first_rc = outbox_relay_stats_get(s.r, &s.st);
    is_int(s.first_rc, OUTBOX_EBUSY, "before the first refresh: OUTBOX_EBUSY");
    ok(s.st.pending == -1 && s.st.dead == -1 && s.st.redis_connected == 0, "figures -1, not connected");
    uv_timer_init(&loop, &s.poll);
    s.poll.data = &s;
    uv_timer_start(&s.poll, on_poll, 5, 5);
    uv_run(&loop, UV_RUN_DEFAULT);
    ok(s.ready, "a later call answers 0 (after %d polls)", s.polls);
    is_int(s.st.pending, pending, "pending as counted in the table");
    ok(s.st.dead == 3 && s.st.sending == 0 && s.st.published == 0, "dead 3, sending 0, published 0");
    ok(s.st.oldest_pending_ms >= 5000 && s.st.oldest_pending_ms <= s.t_ready - oldest,
       "oldest pending age %lld ms: from the oldest due row (at most %lld)", (long long)s.st.oldest_pending_ms,
       (long long)(s.t_ready - oldest));
    outbox_relay_destroy(s.r);
    is_int(uv_loop_close(&loop), 0, "loop closed cleanly");
    sqlite3_close(s.db);
    free(dbpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
