/*
 * test_redis_down.c: Redis is not running when the relay starts. The relay
 * keeps running and retrying with backoff, logs the outage once rather than
 * once per attempt, claims nothing while it cannot publish, and publishes
 * everything once Redis comes up (on the same socket path).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 2000
#define DOWN_MS 3000

static sqlite3 *db;

static int all_published(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") == N;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    pid_t pid;
    int64_t up_at;
    int done, lines_down;

    /* Start once to learn the socket path, then stop. */
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    th_redis_stop(&srv);

    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    log = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    rt_insert_rows(db, "d", 0, N, "down", 0);

    pid = rt_relay_spawn(log, dbpath, srv.url, NULL);
    th_sleep_ms(DOWN_MS);
    is_int(th_wait(pid, 0), -2, "the relay is still running after %d ms without Redis", DOWN_MS);
    text = th_slurp(log);
    lines_down = th_count_lines(text);
    diag("%d log lines during the outage", lines_down);
    ok(lines_down <= 5, "no flood of log lines while Redis is down (%d lines in %d ms)", lines_down, DOWN_MS);
    ok(strstr(text, "redis unreachable") != NULL, "the outage is logged");
    if (lines_down > 5)
        th_diag_tail("relay", text, 10);
    free(text);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0 AND attempts = 0"), N,
           "nothing was claimed while Redis was down");

    is_int(th_redis_restart(&srv), 0, "redis-server started");
    up_at = th_now_ms();
    done = th_wait_until(20000 * th_slow(), all_published, NULL);
    ok(done, "everything is published once Redis is up");
    diag("published %lld ms after Redis came up", (long long)(th_now_ms() - up_at));
    c = th_redis_client(&srv);
    is_int(th_xlen(c, "outbox:down"), N, "%d entries in the stream", N);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE attempts <> 1"), 0, "each row took one attempt");

    is_int(th_stop(pid, SIGTERM, 15000), 0, "SIGTERM: the relay exits 0");
    text = th_slurp(log);
    ok(strstr(text, "redis reachable again") != NULL, "the recovery is logged");
    ok(th_count_lines(text) <= 10, "%d log lines in all", th_count_lines(text));
    if (!done)
        th_diag_tail("relay", text, 20);
    free(text);

    redisFree(c);
    sqlite3_close_v2(db);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(log);
    free(dbpath);
    free(dir);
    return tap_done();
}
