/*
 * Idempotent publishing (--idempotent): relays killed with SIGKILL at random
 * moments, right after Redis appended entries and before the rows were
 * marked, leave no duplicate entries; a lost mark (rows set back to pending
 * by SQL) publishes nothing twice and keeps the original entry ids; a
 * WRONGTYPE stream dead-letters only its own topic; SCRIPT FLUSH mid-run
 * costs nothing but a reload of the script.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

#define N_BACKLOG 5000

/* Flags every relay here shares: a short lease so that the rows of a killed
 * relay are taken over within a second (the reply and WAIT timeouts must be
 * below the lease). */
#define IDEM_FLAGS "--idempotent", "--lease-ms", "1000", "--reply-timeout-ms", "500", "--wait-timeout-ms", "1"

static th_redis redis;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;
static redisContext *rc;

/* Every id of the stream exactly once and every row of the topic in it. */
static void check_stream_exact(const char *topic, long want, const char *what)
{
    char stream[200];
    rt_stream s;
    size_t i;
    long dups = 0, unknown = 0;
    sqlite3_stmt *st;
    snprintf(stream, sizeof stream, "outbox:%s", topic);
    s = rt_stream_read(rc, stream);
    is_int(s.n, want, "%s: the stream holds exactly %ld entries", what, want);
    /* Ids in the stream against the table, through a temp table. */
    th_sql_exec(db, "CREATE TEMP TABLE IF NOT EXISTS seen(id TEXT, eid TEXT)");
    th_sql_exec(db, "DELETE FROM seen");
    th_sql_exec(db, "BEGIN");
    if (sqlite3_prepare_v2(db, "INSERT INTO seen VALUES (?1, ?2)", -1, &st, NULL) != SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    for (i = 0; i < s.n; i++) {
        sqlite3_bind_text(st, 1, s.e[i].id ? s.e[i].id : "", -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 2, s.e[i].eid, -1, SQLITE_STATIC);
        sqlite3_step(st);
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    th_sql_exec(db, "COMMIT");
    dups = (long)th_sql_int(db, "SELECT count(*) - count(DISTINCT id) FROM seen");
    unknown = (long)th_sql_int(db, "SELECT count(*) FROM seen WHERE id NOT IN (SELECT id FROM outbox_messages WHERE topic = %Q)",
                           topic);
    is_int(dups, 0, "%s: no id appears twice in the stream", what);
    is_int(unknown, 0, "%s: every entry belongs to a committed row", what);
    is_int(th_sql_int(db,
                  "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2 AND "
                  "stream_id NOT IN (SELECT eid FROM seen)",
                  topic),
           0, "%s: every published row's stream_id is an entry of the stream", what);
    is_int(th_sql_int(db,
                  "SELECT count(*) FROM outbox_messages o JOIN seen s ON s.id = o.id WHERE o.topic = %Q AND "
                  "o.stream_id IS NOT NULL AND o.stream_id IS NOT s.eid",
                  topic),
           0, "%s: each row's stream_id, where kept (not in a batch), is the entry that carries its id", what);
    /* Per key, stream order is commit (seq) order. */
    is_int(th_sql_int(db,
                  "SELECT count(*) FROM (SELECT o.seq, lag(o.seq) OVER (PARTITION BY o.key ORDER BY s.rowid) AS prev "
                  "FROM seen s JOIN outbox_messages o ON o.id = s.id WHERE o.topic = %Q AND o.key IS NOT NULL) WHERE prev > seq",
                  topic),
           0, "%s: the messages of each key are in commit order", what);
    rt_stream_free(&s);
}

static void kill_loop(void)
{
    int kill_no, hits = 0, kills = 0, suppressed;
    long window_rows = 0, last_gap = 0;
    char *log;
    int64_t t0 = th_now_ms();

    rt_insert_rows(db, "m", 0, N_BACKLOG, "orders", 0);
    /* A tenth of the messages carry one of 7 keys: their order is checked
     * too. (Few, because the rows a killed relay leaves leased hold their
     * keys back until the lease expires, and the claim looks only 4 batches
     * ahead past held-back rows.) */
    th_sql_exec(db, "UPDATE outbox SET key = 'k' || (seq %% 7) WHERE topic = 'orders' AND seq %% 10 = 0");
    for (kill_no = 0; kill_no < 10; kill_no++) {
        /* Kill once progress passes a random point of this tenth of the
         * backlog (or after 3 s, when the rest waits for a lease). */
        int64_t target = (int64_t)N_BACKLOG * kill_no / 10 + rand() % (N_BACKLOG / 10);
        int64_t deadline, published, spawned = th_now_ms();
        long long xlen;
        pid_t pid = rt_relay_spawn(logpath, dbpath, redis.url, IDEM_FLAGS, "--batch", "8", "--inflight", "16",
                                   NULL);
        deadline = th_now_ms() + 3000 * th_slow();
        while (th_now_ms() < deadline && th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") < target)
            th_sleep_ms(1);
        th_sleep_ms(rand() % 5);
        th_stop(pid, SIGKILL, 5000);
        kills++;
        published = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
        xlen = th_xlen(rc, "outbox:orders");
        last_gap = (long)(xlen - published);
        if (xlen > published) {
            hits++;
            window_rows += last_gap;
        }
        diag("kill %d after %lld ms: published rows %lld, sending rows %lld, stream entries %lld", kill_no + 1,
             (long long)(th_now_ms() - spawned), (long long)published,
             (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1"), xlen);
        if (published == N_BACKLOG)
            break;
    }
    ok(hits >= 1, "a SIGKILL hit the window between XADD and mark at least once (%d of %d kills, %ld rows)", hits,
       kills, window_rows);
    {
        char *err = NULL;
        int st = rt_relay_run(20000 * th_slow(), &err, dbpath, redis.url, IDEM_FLAGS, "--drain", NULL);
        is_int(st, 0, "the final --drain run exits 0");
        if (st != 0)
            th_diag_tail("drain", err, 10);
        /* The rows appended but not marked at the last kill are the only
         * ones in the stream and not published: each is sent again and
         * suppressed, once. */
        is_int(rt_count_substr(err, "duplicate publish suppressed"), last_gap,
               "the --drain run suppressed exactly the %ld rows left in the window by the last kill", last_gap);
        log = th_slurp(logpath);
        suppressed = rt_count_substr(log, "duplicate publish suppressed") + rt_count_substr(err, "duplicate publish suppressed");
        free(log);
        free(err);
    }
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'orders' AND state = 2"), N_BACKLOG,
           "every row is published");
    check_stream_exact("orders", N_BACKLOG, "after 10 kills");
    ok(suppressed >= hits, "duplicates were suppressed (%d in the logs)", suppressed);
    diag("kill loop took %lld ms", (long long)(th_now_ms() - t0));
}

/* The marks of published rows are lost (set back to pending by SQL): a
 * relay publishes them again, Redis appends nothing, and the rows get their
 * original entry ids back. */
static void lost_marks(void)
{
    int port = th_free_port(), tries;
    char listen[64], *metrics = NULL, *log;
    pid_t pid;
    double v = -1;
    int64_t reset, start;
    redisReply *rep;

    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    /* The entry ids of those rows, from the stream (a row published in a
     * batch keeps none). */
    {
        rt_stream s = rt_stream_read(rc, "outbox:orders");
        size_t i;
        th_sql_exec(db, "CREATE TABLE orig(id TEXT, stream_id TEXT)");
        for (i = 0; i < s.n; i++)
            if (s.e[i].id)
                th_sql_exec(db, "INSERT INTO orig SELECT id, %Q FROM outbox WHERE id = %Q AND seq %% 10 = 3", s.e[i].eid,
                            s.e[i].id);
        rt_stream_free(&s);
    }
    th_sql_exec(db, "UPDATE outbox SET state = 0, stream_id = NULL, published_at = NULL, available_at = 0 "
                "WHERE topic = 'orders' AND seq %% 10 = 3");
    reset = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0");
    ok(reset >= 450, "%lld rows lost their mark", (long long)reset);
    if (truncate(logpath, 0) != 0)
        bail("truncate %s", logpath);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, IDEM_FLAGS, "--metrics-listen", listen, NULL);
    start = th_now_ms();
    while (th_now_ms() - start < 10000 * th_slow() &&
           th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2") < N_BACKLOG)
        th_sleep_ms(10);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"), N_BACKLOG, "the reset rows are published again");
    is_int(th_xlen(rc, "outbox:orders"), N_BACKLOG, "XLEN is unchanged: nothing appended twice");
    is_int(th_sql_int(db, "SELECT count(*) FROM orig o JOIN outbox_messages b ON b.id = o.id WHERE b.stream_id IS NOT o.stream_id"),
           0, "every republished row has its ORIGINAL stream entry id");
    /* The marks are committed just before the counter is read: retry. */
    for (tries = 0; tries < 50; tries++) {
        free(metrics);
        metrics = NULL;
        if (ot_http_get(port, "/metrics", &metrics) == 200 &&
            ot_prom_get(metrics, "outbox_duplicates_suppressed_total", &v) && v >= (double)reset)
            break;
        th_sleep_ms(20);
    }
    is_int((long long)v, reset, "outbox_duplicates_suppressed_total counts every suppressed republish");
    is_int((long long)ot_prom_val(metrics, "outbox_published_total{topic=\"orders\"}"), reset,
           "outbox_published_total{topic=\"orders\"} counts them as published");
    free(metrics);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly on SIGTERM");
    log = th_slurp(logpath);
    is_int(rt_count_substr(log, "duplicate publish suppressed"), reset, "the log names each suppressed duplicate");
    free(log);
    check_stream_exact("orders", N_BACKLOG, "after the lost marks");
    th_sql_exec(db, "DROP TABLE orig");
    /* The marker: key layout and retention. */
    rep = th_cmd(rc, "PTTL outbox:idem:{outbox:orders}:m-000001");
    ok(rep->type == REDIS_REPLY_INTEGER && rep->integer > 3000000 && rep->integer <= 3600000,
       "the publish marker of m-000001 lives under outbox:idem:{outbox:orders}: with the default 1 h retention "
       "(PTTL %lld)",
       rep->type == REDIS_REPLY_INTEGER ? rep->integer : -99);
    freeReplyObject(rep);
}

/* A stream key of the wrong type: the script's XADD fails for that topic's
 * messages only; they retry and go dead after --max-attempts; the other
 * topic flows. */
static void wrongtype(void)
{
    int i;
    char *log;
    pid_t pid;
    int64_t start;
    freeReplyObject(th_cmd(rc, "SET outbox:bad not-a-stream"));
    for (i = 0; i < 10; i++) {
        rt_insert_rows(db, "bad", i, 1, "bad", 0);
        rt_insert_rows(db, "good", i * 20, 20, "good", 0);
    }
    if (truncate(logpath, 0) != 0)
        bail("truncate %s", logpath);
    /* Not --drain: a row waiting out its backoff is not due, and drain
     * stops once nothing is due. */
    pid = rt_relay_spawn(logpath, dbpath, redis.url, IDEM_FLAGS, "--max-attempts", "2", "--backoff-min-ms", "20",
                         "--backoff-max-ms", "40", "--batch", "16", NULL);
    start = th_now_ms();
    while (th_now_ms() - start < 10000 * th_slow() &&
           (th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND state = 3") < 10 ||
            th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'good' AND state = 2") < 200))
        th_sleep_ms(5);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND state = 3"), 10,
           "every message of the WRONGTYPE topic goes dead (%lld ms)", (long long)(th_now_ms() - start));
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND state = 3 "
                      "AND last_error LIKE '%%WRONGTYPE%%'"),
           10, "each dead message names WRONGTYPE");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND attempts = 2"), 10,
           "each one spent exactly --max-attempts 2 (held-back rounds do not count)");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'good' AND state = 2"), 200,
           "the other topic's 200 messages are published");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    check_stream_exact("good", 200, "good topic");
    log = th_slurp(logpath);
    is_int(rt_count_substr(log, "msg=\"dead-lettered\""), 10, "the log reports the 10 dead letters");
    free(log);
    freeReplyObject(th_cmd(rc, "DEL outbox:bad"));
}

static long long cmdstat_calls(const char *cmd)
{
    redisReply *rep = th_cmd(rc, "INFO commandstats");
    char needle[64];
    const char *p;
    long long calls = 0;
    snprintf(needle, sizeof needle, "cmdstat_%s:calls=", cmd);
    p = rep->type == REDIS_REPLY_STRING ? strstr(rep->str, needle) : NULL;
    if (p)
        calls = atoll(p + strlen(needle));
    freeReplyObject(rep);
    return calls;
}

/* SCRIPT FLUSH while publishing: the calls in flight fail with NOSCRIPT,
 * their messages are handed back without counting an attempt, and the
 * relay loads the script again. */
static void script_flush(void)
{
    const int n = 20000;
    pid_t pid;
    int64_t start, at_flush1 = -1, at_flush2 = -1;
    long long eval_calls, evalsha_calls;

    rt_insert_rows(db, "f", 0, n, "flush", 0);
    if (truncate(logpath, 0) != 0)
        bail("truncate %s", logpath);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, IDEM_FLAGS, "--batch", "8", "--inflight", "32", NULL);
    start = th_now_ms();
    while (th_now_ms() - start < 20000 * th_slow()) {
        int64_t p = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'flush' AND state = 2");
        if (at_flush1 < 0 && p >= n / 4) {
            freeReplyObject(th_cmd(rc, "SCRIPT FLUSH"));
            freeReplyObject(th_cmd(rc, "CONFIG RESETSTAT"));
            at_flush1 = p;
        } else if (at_flush2 < 0 && p >= n / 2) {
            freeReplyObject(th_cmd(rc, "SCRIPT FLUSH"));
            at_flush2 = p;
        }
        if (p == n)
            break;
        th_sleep_ms(2);
    }
    ok(at_flush1 >= 0 && at_flush1 < n && at_flush2 >= 0 && at_flush2 < n,
       "SCRIPT FLUSH ran twice mid-run (at %lld and %lld published)", (long long)at_flush1, (long long)at_flush2);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'flush' AND state = 2"), n,
           "publishing continues after SCRIPT FLUSH: all %d published", n);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'flush' AND attempts <> 1"), 0,
           "NOSCRIPT cost no message an attempt");
    eval_calls = cmdstat_calls("eval");
    evalsha_calls = cmdstat_calls("evalsha");
    ok(evalsha_calls > 10 * (eval_calls + 1),
       "the relay loads the script again instead of sending it with every call (EVAL %lld, EVALSHA %lld since the "
       "first flush)",
       eval_calls, evalsha_calls);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly");
    check_stream_exact("flush", n, "after SCRIPT FLUSH");
}

/* Keyed messages over few keys, a backlog of several batches: a message
 * behind one of its key from an earlier script call is chained and sent
 * once that one is appended, so its row goes with its batch instead of
 * being handed back and claimed again on its own; per-key order holds. */
static void chains(void)
{
    char *err = NULL;
    int st;
    rt_insert_rows(db, "chain", 0, 4000, "chains", 4);
    st = rt_relay_run(30000 * th_slow(), &err, dbpath, redis.url, IDEM_FLAGS, "--drain", NULL);
    is_int(st, 0, "chains: --drain --idempotent exits 0");
    if (st != 0)
        th_diag_tail("drain", err, 10);
    free(err);
    check_stream_exact("chains", 4000, "chains");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'chains' AND state = 2"), 4000,
           "chains: every row is published");
    /* Rows published on their own keep a state of their own in the table;
     * a batch's rows do not. Held back and claimed again one by one, all
     * but the first batch's 512 took that way. Valgrind's pace can make a
     * batch outlast the 250 ms its published messages wait for the rest. */
    if (th_slow() == 1)
        ok(th_sql_int(db, "SELECT count(*) FROM outbox WHERE topic = 'chains' AND state = 2") <= 400,
           "chains: at most a tenth of the rows published outside their batch (%lld)",
           (long long)th_sql_int(db, "SELECT count(*) FROM outbox WHERE topic = 'chains' AND state = 2"));
    else
        skip("chains: the batch timing under valgrind");
}

int main(void)
{
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "idem.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    rc = th_redis_client(&redis);

    kill_loop();
    lost_marks();
    wrongtype();
    script_flush();
    chains();

    redisFree(rc);
    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
