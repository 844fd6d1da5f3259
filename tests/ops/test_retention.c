/*
 * Retention deletes published rows older than --retention-ms and nothing
 * else: not pending, sending or dead rows (whatever their published_at), not
 * recent published rows. The first pass runs a second after start; a full
 * step is followed by the next one after a pause, so a large set goes in
 * several small transactions while publishing goes on; a step ends after
 * about 1 ms with the write lock even when --retention-batch allows more;
 * a step that found the lock taken comes again 2 ms later. --retention-ms
 * 0 keeps everything.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

static th_redis redis;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;

/* n rows of prefix in `state`, published_at = now - age_ms (NULL when
 * age_ms < 0), with whatever else that state needs. */
static void rows(const char *prefix, int n, int state, int64_t age_ms)
{
    int64_t now = rt_unix_ms();
    rt_insert_rows(db, prefix, 0, n, "ret", 0);
    th_sql_exec(db,
            "UPDATE outbox SET state = %d, published_at = CASE WHEN %d THEN NULL ELSE %lld END, "
            "stream_id = CASE %d WHEN 2 THEN '1-1' END, lease_owner = CASE %d WHEN 1 THEN 'someone-else' END, "
            "lease_token = %d, lease_until = CASE %d WHEN 1 THEN %lld END, "
            "available_at = CASE %d WHEN 0 THEN %lld ELSE available_at END WHERE id LIKE '%q-%%'",
            state, age_ms < 0, (long long)(now - age_ms), state, state, state == 1, state, (long long)(now + 3600000),
            state, (long long)(now + 3600000), prefix);
}

static int64_t count_prefix(const char *prefix)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id LIKE '%q-%%'", prefix);
}

/* Waits, in naps of nap_ms, until no row of prefix is left or timeout_ms
 * after start; returns when they were gone (ms after start) or -1. */
static int64_t gone_after(const char *prefix, int64_t start, int64_t timeout_ms, unsigned nap_ms)
{
    while (th_now_ms() - start < timeout_ms && count_prefix(prefix) > 0)
        th_sleep_ms(nap_ms);
    return count_prefix(prefix) == 0 ? th_now_ms() - start : -1;
}

/* The published rows of topic, once want of them are (or timeout_ms after
 * start). */
static int64_t published_by(const char *topic, int64_t want, int64_t start, int64_t timeout_ms)
{
    const char *q = "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2";
    while (th_now_ms() - start < timeout_ms && th_sql_int(db, q, topic) < want)
        th_sleep_ms(10);
    return th_sql_int(db, q, topic);
}

static void only_eligible(void)
{
    char listen[64], *log, *text = NULL;
    int port = th_free_port();
    pid_t pid;
    int64_t start, gone_at;

    rows("old", 20, 2, 120000);        /* published two minutes ago: deleted */
    rows("recent", 5, 2, 30000);       /* published 30 s ago: kept */
    rows("edge", 5, 2, 50000);         /* 50 s: kept */
    rows("nullpub", 3, 2, -1);         /* published, published_at NULL: kept */
    rows("pending", 5, 0, 120000);     /* not due for an hour */
    rows("sending", 5, 1, 120000);     /* leased by another relay for an hour */
    rows("dead", 5, 3, 120000);        /* dead rows are never deleted */

    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    start = th_now_ms();
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--retention-ms", "60000", "--retention-batch", "7",
                         "--log-level", "debug", "--metrics-listen", listen, NULL);
    th_sleep_ms(500);
    is_int(count_prefix("old"), 20, "nothing is deleted before the first pass, a second after start");
    gone_at = gone_after("old", start, 8000 * th_slow(), 5);
    is_int(count_prefix("old"), 0, "the published rows older than 60 s are deleted (%lld ms after start)",
           (long long)gone_at);
    ok(gone_at >= 900 && gone_at < 3000 * th_slow(), "by the first pass and its immediate follow-ups (%lld ms)",
       (long long)gone_at);
    th_sleep_ms(300);
    is_int(count_prefix("recent"), 5, "published rows 30 s old are kept");
    is_int(count_prefix("edge"), 5, "published rows 50 s old are kept");
    is_int(count_prefix("nullpub"), 3, "published rows without published_at are kept");
    is_int(count_prefix("pending"), 5, "pending rows are kept");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id LIKE 'pending-%%' AND state = 0"), 5,
           "and still pending");
    is_int(count_prefix("sending"), 5, "sending rows are kept");
    is_int(count_prefix("dead"), 5, "dead rows are kept");
    log = th_slurp(logpath);
    is_int(rt_count_substr(log, "retention deleted published rows\" count=7"), 2, "two full batches of 7 ...");
    is_int(rt_count_substr(log, "retention deleted published rows\" count=6"), 1, "... then the remaining 6");
    free(log);
    ot_http_get(port, "/metrics", &text);
    is_int((long long)ot_prom_val(text, "outbox_retention_deleted_total"), 20, "outbox_retention_deleted_total");
    free(text);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
}

static void large_set(void)
{
    pid_t pid;
    int64_t start, gone_at;
    char *log;
    int batches;

    rows("bulk", 3000, 2, 600000);
    rt_insert_rows(db, "fresh", 0, 1000, "ret2", 0);
    if (truncate(logpath, 0) != 0)
        bail("truncate %s", logpath);
    start = th_now_ms();
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--retention-ms", "60000", "--retention-batch", "100",
                         "--log-level", "debug", NULL);
    gone_at = gone_after("bulk", start, 10000 * th_slow(), 10);
    is_int(count_prefix("bulk"), 0, "3,000 old published rows are gone within 10 s (%lld ms)", (long long)gone_at);
    is_int(published_by("ret2", 1000, start, 10000 * th_slow()), 1000,
           "1,000 rows committed at the same time are published meanwhile, and kept");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    log = th_slurp(logpath);
    batches = rt_count_substr(log, "retention deleted published rows\" count=100");
    is_int(batches, 30, "in 30 transactions of --retention-batch 100");
    free(log);
}

/* The sum of the counts of the log's retention lines, their number and
 * the longest time one held the write lock (us). */
static void retention_lines(const char *log, long long *sum, int *steps, long long *max_held_us)
{
    const char *p = log;
    *sum = 0;
    *steps = 0;
    *max_held_us = 0;
    while ((p = strstr(p, "retention deleted published rows\" count=")) != NULL) {
        long long c = 0, h = -1;
        const char *held;
        p += strlen("retention deleted published rows\" count=");
        c = strtoll(p, NULL, 10);
        held = strstr(p, "held_us=");
        if (held && held < strchr(p, '\n'))
            h = strtoll(held + 8, NULL, 10);
        *sum += c;
        (*steps)++;
        if (h > *max_held_us)
            *max_held_us = h;
    }
}

/* --retention-batch large enough for everything at once: the steps are
 * cut by time instead (about 1 ms of the lock each), so that neither an
 * application's writer nor the relay's own transactions wait long, and
 * publishing goes on while retention works through them. */
static void time_budget(void)
{
    pid_t pid;
    int64_t start, gone_at;
    long long sum, max_held;
    int steps;
    char *log;
    int64_t others;

    /* Rows of the earlier cases that are not old enough yet may become so
     * during this one on a slow run (valgrind): counted in the log too. */
    others = th_sql_int(db, "SELECT count(*) FROM outbox_messages");
    rows("big", 20000, 2, 600000);
    rt_insert_rows(db, "live", 0, 2000, "ret3", 0);
    if (truncate(logpath, 0) != 0)
        bail("truncate %s", logpath);
    start = th_now_ms();
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--retention-ms", "60000", "--retention-batch", "100000",
                         "--log-level", "debug", NULL);
    gone_at = gone_after("big", start, 20000 * th_slow(), 10);
    is_int(count_prefix("big"), 0, "20,000 old published rows are gone (%lld ms)", (long long)gone_at);
    is_int(published_by("ret3", 2000, start, 20000 * th_slow()), 2000,
           "the 2,000 rows committed with them are published meanwhile, and kept");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    log = th_slurp(logpath);
    retention_lines(log, &sum, &steps, &max_held);
    others -= th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id NOT LIKE 'big-%%' AND id NOT LIKE 'live-%%'");
    is_int(sum, 20000 + others, "the retention lines of the log add up to the 20,000 rows (and %lld older ones)",
           (long long)others);
    ok(steps >= 3, "in %d transactions, not one: --retention-batch 100000 allows all at once, the time budget "
                   "cuts them", steps);
    ok(max_held > 0 && max_held < 50000 * th_slow(),
       "no step held the write lock for long (the longest %lld us)", max_held);
    free(log);
}

/* An application holding the write lock nearly all the time (9 ms of every
 * 10): retention's step does not wait for the lock, so it must come again
 * soon when it found it taken (2 ms), not after the full interval (10 s). */
static void busy_writer(void)
{
    pid_t pid;
    int64_t start, gone_at = -1;
    rows("held", 200, 2, 600000);
    th_sql_exec(db, "CREATE TABLE IF NOT EXISTS app (x INTEGER)");
    start = th_now_ms();
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--retention-ms", "60000", NULL);
    while (th_now_ms() - start < 5000 * th_slow() && gone_at < 0) {
        th_sql_exec(db, "BEGIN IMMEDIATE");
        th_sql_exec(db, "INSERT INTO app VALUES (1)");
        th_sleep_ms(9);
        th_sql_exec(db, "COMMIT");
        th_sleep_ms(1);
        if (count_prefix("held") == 0)
            gone_at = th_now_ms() - start;
    }
    ok(gone_at >= 0, "old published rows are deleted within 5 s while an application holds the write lock 90%% "
                     "of the time (%lld ms)", (long long)gone_at);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
}

static void keep_forever(void)
{
    pid_t pid;
    rows("ancient", 50, 2, 86400000LL * 400);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--retention-ms", "0", NULL);
    th_sleep_ms(1500);
    is_int(count_prefix("ancient"), 50, "--retention-ms 0 keeps published rows of any age");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
}

int main(void)
{
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "retention.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);

    only_eligible();
    large_set();
    time_budget();
    busy_writer();
    keep_forever();

    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
