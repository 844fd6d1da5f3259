/*
 * Checkpoints under a WAL that cannot start over: a reader keeps an old
 * snapshot open, so no checkpoint can finish the whole WAL and the next
 * writer cannot rewind it. Its size then stays above the 1,000-page
 * threshold after every commit, and the relay must not start a checkpoint
 * after each of its own commits (each one ends in an fsync of the database
 * file, which slows the fsyncs of the application's durable commits), but
 * only once the WAL grew by the threshold again. outbox_checkpoints_total
 * counts them.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

static th_redis redis;
static char *dir, *dbpath, *logpath;

static long long wal_frames(void)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s-wal", dbpath);
    if (stat(path, &st) != 0 || st.st_size < 32)
        return 0;
    return (long long)((st.st_size - 32) / (4096 + 24)); /* header, then frames of a page and its header */
}

int main(void)
{
    char listen[64], *text = NULL, prefix[32];
    int port = th_free_port(), i, code;
    sqlite3 *db, *reader;
    sqlite3_stmt *st;
    long long frames0, frames, ckpts;
    int64_t start;
    pid_t pid;

    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "checkpoints.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    reader = rt_open(dbpath);

    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, NULL);
    /* Started and connected (however long that takes), so that it
     * publishes the transactions below one by one. */
    for (start = th_now_ms(); th_now_ms() - start < 20000 * th_slow();) {
        double up = -1;
        if (ot_http_get(port, "/metrics", &text) == 200)
            up = ot_prom_val(text, "outbox_redis_connected");
        free(text);
        text = NULL;
        if (up == 1)
            break;
        th_sleep_ms(10);
    }
    th_sleep_ms(300);

    /* The reader's snapshot: held to the end. */
    th_sql_exec(reader, "BEGIN");
    if (sqlite3_prepare_v2(reader, "SELECT count(*) FROM outbox", -1, &st, NULL) != SQLITE_OK ||
        sqlite3_step(st) != SQLITE_ROW)
        bail("reader: %s", sqlite3_errmsg(reader));
    sqlite3_finalize(st);
    frames0 = wal_frames();

    /* 400 small transactions, each published by the relay in a unit of its
     * own: some 800 commits, the relay's included. */
    for (i = 0; i < 400; i++) {
        snprintf(prefix, sizeof prefix, "ck%03d", i);
        rt_insert_rows(db, prefix, 0, 5, "ckpt", 0);
        th_sleep_ms(2);
    }
    start = th_now_ms();
    while (th_now_ms() - start < 20000 * th_slow() &&
           th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") < 2000)
        th_sleep_ms(20);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"), 2000,
           "the 2,000 rows of 400 transactions are published");
    th_sleep_ms(1100); /* /metrics' database figures are at most a second old; the counters are live */
    /* A checkpoint still running (slowly under valgrind) is waited for. */
    for (start = th_now_ms();;) {
        code = ot_http_get(port, "/metrics", &text);
        ckpts = (long long)ot_prom_val(text, "outbox_checkpoints_total");
        if (ckpts >= 1 || th_now_ms() - start > 1000 * (th_slow() - 1))
            break;
        free(text);
        text = NULL;
        th_sleep_ms(50);
    }
    frames = wal_frames() - frames0;
    ok(code == 200, "GET /metrics");
    free(text);
    ok(frames > 1500, "the WAL grew by %lld frames while the reader held its snapshot", frames);
    ok(ckpts >= 1, "checkpoints ran (%lld)", ckpts);
    ok(ckpts <= frames / 1000 + 2,
       "one per 1,000 frames of growth at most, not one per commit: %lld for %lld frames", ckpts, frames);

    sqlite3_exec(reader, "COMMIT", NULL, NULL, NULL);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    sqlite3_close_v2(reader);
    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
