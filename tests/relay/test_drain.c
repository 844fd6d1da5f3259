/*
 * test_drain.c: outbox-relay --drain exits once every row is settled. Rows
 * waiting for a retry hold the drain: with one topic's stream key a string
 * (every XADD there fails with WRONGTYPE), the drain ends only when those
 * rows are dead after --max-attempts, the other topic published. A row the
 * application delayed (available_at an hour ahead) does not hold it. With
 * --drain-timeout-ms the drain gives up: exit 1, the rows left logged, also
 * while Redis cannot be reached at all. In the C API,
 * outbox_relay_drain_result() tells the two ends apart.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

static th_redis srv;
static char *dir;
static redisContext *c;

/* A new database in dir, with a writer connection. */
static sqlite3 *fresh_db(const char *name, char **path)
{
    *path = rt_make_db(dir, name);
    return rt_open(*path);
}

/* Rows of db matching where (SQL). */
static int64_t rows(sqlite3 *db, const char *where)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE %s", where);
}

/* The number after "<key>=" in text, or -1. */
static long field(const char *text, const char *key)
{
    char k[64];
    const char *p;
    snprintf(k, sizeof k, " %s=", key);
    p = text ? strstr(text, k) : NULL;
    return p ? strtol(p + strlen(k), NULL, 10) : -1;
}

/* 200 rows over two topics, 100 of them (40 keyed) on a stream Redis
 * refuses: the drain waits for their retries until they are dead. */
static void retries_hold_the_drain(void)
{
    char *path, *err = NULL;
    sqlite3 *db = fresh_db("retry.db", &path);
    int st;

    rt_insert_rows(db, "good", 0, 100, "good", 0);
    rt_insert_rows(db, "bad", 0, 60, "bad", 0);
    rt_insert_rows(db, "badk", 0, 40, "bad", 4);
    freeReplyObject(th_cmd(c, "SET outbox:bad x"));

    st = rt_relay_run(60000 * th_slow(), &err, path, srv.url, "--drain", "--max-attempts", "2", "--backoff-min-ms",
                      "10", "--backoff-max-ms", "20", NULL);
    is_int(st, 0, "retries: --drain exits 0");
    is_int(rows(db, "state < 2"), 0,
           "retries: no row is left pending or leased");
    is_int(rows(db, "topic = 'good' AND state = 2"), 100,
           "retries: the good topic is published");
    is_int(rows(db, "topic = 'bad' AND state = 3 AND attempts = 2"), 100,
           "retries: the refused topic is dead, each after 2 attempts");
    is_int(th_xlen(c, "outbox:good"), 100, "retries: one entry per good row");
    ok(err && strstr(err, "msg=drained published=100 dead=100"),
       "retries: the log says drained published=100 dead=100");
    if (st != 0 || !err || !strstr(err, "dead=100"))
        th_diag_tail("retries", err ? err : "", 8);
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

/* A delayed message (never attempted, due in an hour) does not hold the
 * drain; nor does a keyed row behind it. */
static void delayed_rows_do_not_hold(void)
{
    char *path, *err = NULL;
    sqlite3 *db = fresh_db("delayed.db", &path);
    int64_t t0;
    int st;

    rt_insert_rows(db, "now", 0, 20, "events", 0);
    th_sql_exec(db, "INSERT INTO outbox(id, topic, key, payload, available_at) VALUES ('later-1', 'events', 'k', 'x', "
                    "%lld)",
                (long long)(rt_unix_ms() + 3600000));
    th_sql_exec(db, "INSERT INTO outbox(id, topic, key, payload) VALUES ('later-2', 'events', 'k', 'y')");
    t0 = th_now_ms();
    st = rt_relay_run(30000 * th_slow(), &err, path, srv.url, "--drain", NULL);
    is_int(st, 0, "delayed: --drain exits 0");
    ok(th_now_ms() - t0 < 10000 * th_slow(), "delayed: without waiting for the delayed row (%lld ms)",
       (long long)(th_now_ms() - t0));
    is_int(rows(db, "id LIKE 'now-%' AND state = 2"), 20,
           "delayed: the rows due are published");
    is_int(rows(db, "id = 'later-1' AND state = 0 AND attempts = 0"), 1,
           "delayed: the delayed row is still pending, never attempted");
    is_int(rows(db, "id = 'later-2' AND state = 0 AND attempts = 0"), 1,
           "delayed: the row of its key behind it waits with it");
    if (st != 0)
        th_diag_tail("delayed", err ? err : "", 8);
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

/* The drain timeout: rows that keep failing, and a Redis nobody listens
 * on. The relay stops at the timeout, logs the rows left, exits 1. */
static void drain_timeout(void)
{
    char *path, *err = NULL;
    sqlite3 *db = fresh_db("timeout.db", &path);
    int64_t t0, ms;
    int st;

    rt_insert_rows(db, "stuck", 0, 20, "stuck", 0);
    freeReplyObject(th_cmd(c, "SET outbox:stuck x"));
    t0 = th_now_ms();
    st = rt_relay_run(30000 * th_slow(), &err, path, srv.url, "--drain", "--drain-timeout-ms", "1500",
                      "--max-attempts", "1000", "--backoff-min-ms", "50", "--backoff-max-ms", "100", NULL);
    ms = th_now_ms() - t0;
    is_int(st, 1, "timeout: exit 1");
    ok(ms >= 1500 && ms < 15000 * th_slow(), "timeout: after the timeout (%lld ms)", (long long)ms);
    ok(err && strstr(err, "drain timeout"), "timeout: the log says drain timeout");
    is_int(field(err, "due") + field(err, "waiting_retry") + field(err, "leased"), 20,
           "timeout: and counts the 20 rows left (due=%ld waiting_retry=%ld leased=%ld)", field(err, "due"),
           field(err, "waiting_retry"), field(err, "leased"));
    ok(err && !strstr(err, "msg=drained"), "timeout: not logged as drained");
    is_int(rows(db, "state = 1"), 0,
           "timeout: the stop handed every claimed row back");
    if (st != 1 || !err || !strstr(err, "drain timeout"))
        th_diag_tail("timeout", err ? err : "", 8);
    free(err);
    err = NULL;

    t0 = th_now_ms();
    st = rt_relay_run(30000 * th_slow(), &err, path, "unix:///nonexistent/outbox-test/redis.sock", "--drain",
                      "--drain-timeout-ms", "1000", NULL);
    ms = th_now_ms() - t0;
    is_int(st, 1, "timeout without Redis: exit 1");
    ok(ms >= 1000 && ms < 15000 * th_slow(), "timeout without Redis: after the timeout (%lld ms)", (long long)ms);
    is_int(field(err, "due") + field(err, "waiting_retry") + field(err, "leased"), 20,
           "timeout without Redis: the 20 rows left are counted (due=%ld waiting_retry=%ld leased=%ld)",
           field(err, "due"), field(err, "waiting_retry"), field(err, "leased"));
    if (st != 1)
        th_diag_tail("timeout without Redis", err ? err : "", 8);
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

typedef struct api_run {
    int calls, result;
} api_run;

static void api_on_drained(outbox_relay *r, void *data)
{
    api_run *x = data;
    x->calls++;
    x->result = outbox_relay_drain_result(r);
    outbox_relay_stop(r, NULL, NULL);
}

static void quiet(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    (void)level;
    (void)msg;
}

/* The C API on the test's own loop: outbox_relay_drain_result() tells a
 * drain done (0) from one whose drain_timeout_ms expired (OUTBOX_ETIMEDOUT),
 * and a lease of 3000 ms with the defaults is accepted (the reply timeout,
 * 0, follows it). */
static void drain_result_api(const char *topic, int timeout_ms, int want)
{
    char *path, err[512], name[32];
    sqlite3 *db;
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    uv_loop_t loop;
    api_run x = {0, 1};
    int e;

    snprintf(name, sizeof name, "api-%s.db", topic);
    db = fresh_db(name, &path);
    rt_insert_rows(db, "api", 0, 10, topic, 0);
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    is_int((int)s.reply_timeout_ms, 0, "api %s: the default reply timeout is 0 (follows the lease)", topic);
    s.db_path = path;
    s.redis_url = srv.url;
    s.lease_ms = 3000;
    s.drain = 1;
    s.drain_timeout_ms = (uint64_t)timeout_ms;
    s.backoff_min_ms = 50;
    s.backoff_max_ms = 100;
    s.max_attempts = 1000;
    s.on_drained = api_on_drained;
    s.on_drained_data = &x;
    s.log = quiet;
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    is_int(e, 0, "api %s: created with lease_ms 3000 (%s)", topic, e ? err : "");
    if (e != 0) {
        uv_loop_close(&loop);
        sqlite3_close_v2(db);
        free(path);
        return;
    }
    is_int(outbox_relay_drain_result(r), OUTBOX_ESTATE, "api %s: no result before the drain ends", topic);
    outbox_relay_start(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(x.calls, 1, "api %s: on_drained called once", topic);
    is_int(x.result, want, "api %s: outbox_relay_drain_result() is %s", topic, outbox_err_name(want));
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&loop), 0, "api %s: the loop closes cleanly", topic);
    sqlite3_close_v2(db);
    free(path);
}

int main(void)
{
    char *dbpath;
    sqlite3 *db;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    retries_hold_the_drain();
    delayed_rows_do_not_hold();
    drain_timeout();
    drain_result_api("good", 0, 0);
    drain_result_api("stuck", 1000, OUTBOX_ETIMEDOUT);
    is_int(outbox_relay_drain_result(NULL), OUTBOX_EINVAL, "outbox_relay_drain_result(NULL): OUTBOX_EINVAL");
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
