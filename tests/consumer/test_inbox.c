/*
 * test_inbox.c: the consumer-group helper in SQLite inbox mode, where the
 * message id is recorded in the same transaction as the effect.
 *
 * A consumer process (forked, its own loop) applies a stream of messages as
 * rows in its own database and is killed with SIGKILL at random moments,
 * several times, restarted after each kill; a final consumer on the test's
 * loop then finishes the work (taking over what the dead ones left pending
 * with XAUTOCLAIM). Whatever the moment of each kill, every message's effect
 * exists exactly once, the inbox agrees with the effects, and every entry is
 * acknowledged. Some messages fail on their first delivery: the rollback
 * takes their inbox row with it, and the retry applies them.
 *
 * Also: old inbox rows are deleted after the inbox retention, batch after
 * batch, and the clean-up keeps running afterwards.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define STREAM "outbox:inbox"
#define GROUP "svc"
#define KILLS 6

static th_redis srv;
static redisContext *rc;
static char *dir, *dbpath;
static int n_msgs;

static sqlite3 *open_db(const char *path)
{
    sqlite3 *db;
    char err[300];
    if (outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0)
        bail("open %s: %s", path, err);
    return db;
}

static void exec_sql(sqlite3 *db, const char *sql)
{
    char *m = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &m) != SQLITE_OK)
        bail("%s: %s", sql, m ? m : "?");
}

static long long sql_int(const char *path, const char *sql)
{
    sqlite3 *db = open_db(path);
    sqlite3_stmt *st;
    long long v = -1;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("%s: %s", sql, sqlite3_errmsg(db));
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return v;
}

/* Every 97th message fails on its first delivery. */
static int fails_first(const char *id)
{
    return atoi(id + 2) % 97 == 5;
}

static int apply(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    sqlite3_stmt *st;
    int rc_;
    (void)c;
    (void)data;
    if (!dv->db)
        return 1;
    if (sqlite3_prepare_v2(dv->db, "INSERT INTO effects(message_id, entry_id, deliveries) VALUES (?1, ?2, ?3)", -1,
                           &st, NULL) != SQLITE_OK)
        return 1;
    sqlite3_bind_text(st, 1, dv->msg->id, -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 2, dv->entry_id, -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 3, (sqlite3_int64)dv->deliveries);
    rc_ = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc_ != SQLITE_DONE)
        return 1;
    /* The effect is written, then the handler fails: all of it must go. */
    if (fails_first(dv->msg->id) && dv->deliveries == 1)
        return 1;
    return 0;
}

static void settings(outbox_consumer_settings *s, const char *path)
{
    outbox_consumer_defaults(s);
    s->redis_url = srv.url;
    s->stream = STREAM;
    s->group = GROUP;
    s->dedup = OUTBOX_DEDUP_SQLITE;
    s->inbox_db_path = path;
    s->batch = 50;
    s->max_inflight = 50;
    s->block_ms = 200;
    s->min_idle_ms = 300;
    s->claim_interval_ms = 100;
    s->retry_ms = 50;
    s->handler = apply;
    s->log_level = OUTBOX_LOG_WARN;
}

/* The consumer process: runs until killed. Never returns; never runs the
 * test's atexit handlers (they would stop the shared redis-server). */
static void child_main(void)
{
    uv_loop_t loop;
    outbox_consumer_settings s;
    outbox_consumer *c;
    char err[300];
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (uv_loop_init(&loop) != 0)
        _exit(3);
    settings(&s, dbpath);
    if (outbox_consumer_create(&c, &loop, &s, err, sizeof err) != 0) {
        fprintf(stderr, "child: %s\n", err);
        _exit(3);
    }
    if (outbox_consumer_start(c) != 0)
        _exit(3);
    uv_run(&loop, UV_RUN_DEFAULT);
    _exit(4);
}

static long long effects_now(void)
{
    return sql_int(dbpath, "SELECT count(*) FROM effects");
}

/* The group's last delivered id equals the stream's last id: every entry
 * was read by someone. */
static int all_delivered(void)
{
    redisReply *g = th_cmd(rc, "XINFO GROUPS %s", STREAM), *l = th_cmd(rc, "XREVRANGE %s + - COUNT 1", STREAM);
    int same = 0;
    if (g->type == REDIS_REPLY_ARRAY && g->elements == 1 && l->type == REDIS_REPLY_ARRAY && l->elements == 1) {
        const redisReply *f = g->element[0];
        for (size_t k = 0; k + 1 < f->elements; k += 2)
            if (strcmp(f->element[k]->str, "last-delivered-id") == 0)
                same = strcmp(f->element[k + 1]->str, l->element[0]->element[0]->str) == 0;
    }
    freeReplyObject(g);
    freeReplyObject(l);
    return same;
}

static int finished(void *arg)
{
    static int64_t last;
    (void)arg;
    /* Polled from the loop: look at most every 100 ms. */
    if (th_now_ms() - last < 100)
        return 0;
    last = th_now_ms();
    return ct_pending(rc, STREAM, GROUP) == 0 && all_delivered() && effects_now() >= n_msgs;
}

static void on_stopped(outbox_consumer *c, void *data)
{
    (void)c;
    (*(int *)data)++;
}

static void test_kills(void)
{
    unsigned seed = (unsigned)th_now_ms();
    long long progress[KILLS];
    int mid = 0;
    sqlite3 *db;

    n_msgs = th_slow() > 1 ? 500 : 2000;
    db = open_db(dbpath);
    /* No UNIQUE here: a double application must be visible. */
    exec_sql(db, "CREATE TABLE effects(message_id TEXT NOT NULL, entry_id TEXT NOT NULL, deliveries INTEGER)");
    sqlite3_close_v2(db);
    for (int i = 0; i < n_msgs; i++) {
        char id[32], payload[64];
        snprintf(id, sizeof id, "i-%05d", i);
        snprintf(payload, sizeof payload, "{\"n\":%d}", i);
        ct_xadd_msg(rc, STREAM, id, "inbox", payload, strlen(payload), NULL);
    }
    srand(seed);
    diag("%d messages, %d kills, seed %u", n_msgs, KILLS, seed);
    for (int k = 0; k < KILLS; k++) {
        pid_t pid;
        long long before = effects_now(), target = 0;
        int jitter = rand() % 20, st = -2, waited = 0;
        int64_t t0 = th_now_ms();
        fflush(stdout);
        fflush(stderr);
        pid = fork();
        if (pid < 0)
            bail("fork");
        if (pid == 0)
            child_main();
        if (k == 0) {
            /* During start-up: connecting, creating the group, first read. */
            th_sleep_ms(jitter * th_slow());
        } else {
            /* Somewhere in the middle of the remaining work, whatever the
             * machine's speed: wait for a random amount of progress. */
            long long left = n_msgs - before;
            target = before + 1 + (left > KILLS ? rand() % (left / (KILLS - k + 1)) : 0);
            while (effects_now() < target && (st = th_wait(pid, 0)) == -2 && th_now_ms() - t0 < 30000 * th_slow())
                th_sleep_ms(2);
            th_sleep_ms(jitter);
        }
        waited = (int)(th_now_ms() - t0);
        if (st == -2) {
            kill(pid, SIGKILL);
            st = th_wait(pid, 10000);
        }
        if (st != 128 + SIGKILL)
            diag("consumer process %d ended with status %d, not by the kill", k, st);
        progress[k] = effects_now();
        if (progress[k] > before && progress[k] < n_msgs)
            mid++;
        diag("kill %d after %d ms (target %lld): %lld effects, %lld pending", k, waited, target, progress[k],
             ct_pending(rc, STREAM, GROUP));
    }
    ok(mid >= KILLS - 2, "kills landed while messages were being applied (%d of %d)", mid, KILLS);

    {
        uv_loop_t loop;
        outbox_consumer_settings s;
        outbox_consumer *c;
        char err[300];
        int stopped = 0;
        if (uv_loop_init(&loop) != 0)
            bail("uv_loop_init");
        settings(&s, dbpath);
        s.consumer = "final";
        is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "final consumer created");
        is_int(outbox_consumer_start(c), 0, "final consumer started");
        ok(ct_run_until_cond(&loop, finished, NULL, 60000 * th_slow()),
           "the final consumer finished the work: nothing pending, everything delivered");
        is_int(outbox_consumer_stop(c, on_stopped, &stopped), 0, "stop");
        ok(ct_run_until(&loop, &stopped, 10000), "stop callback ran");
        outbox_consumer_destroy(c);
        is_int(ct_loop_finish(&loop, 5000), 0, "uv_loop_close() == 0 after the final consumer");
    }

    is_int(effects_now(), n_msgs, "exactly %d effects", n_msgs);
    is_int(sql_int(dbpath, "SELECT count(DISTINCT message_id) FROM effects"), n_msgs,
           "%d distinct message ids: no effect applied twice, none lost", n_msgs);
    is_int(sql_int(dbpath, "SELECT count(*) FROM outbox_inbox"), n_msgs, "%d inbox rows", n_msgs);
    is_int(sql_int(dbpath, "SELECT count(*) FROM effects e LEFT JOIN outbox_inbox i "
                           "ON i.message_id = e.message_id AND i.stream = '" STREAM "' WHERE i.rowid IS NULL"),
           0, "every effect has its inbox row (same transaction)");
    is_int(sql_int(dbpath, "SELECT count(*) FROM effects WHERE message_id NOT LIKE 'i-_____'"), 0,
           "no foreign effects");
    {
        long long nf = 0;
        for (int i = 0; i < n_msgs; i++) {
            char id[32];
            snprintf(id, sizeof id, "i-%05d", i);
            nf += fails_first(id);
        }
        is_int(sql_int(dbpath, "SELECT count(*) FROM effects WHERE CAST(substr(message_id, 3) AS INTEGER) % 97 = 5 "
                               "AND deliveries >= 2"),
               nf, "the %lld messages whose first attempt failed were applied on a later delivery", nf);
    }
    is_int(ct_pending(rc, STREAM, GROUP), 0, "every entry acknowledged");
    is_int(th_xlen(rc, STREAM ":dead"), 0, "nothing dead-lettered");
}

typedef struct gc_arg {
    const char *path;
    const char *where;
} gc_arg;

static int rows_gone(void *arg)
{
    static int64_t last;
    gc_arg *a = arg;
    char sql[200];
    if (th_now_ms() - last < 50)
        return 0;
    last = th_now_ms();
    snprintf(sql, sizeof sql, "SELECT count(*) FROM outbox_inbox WHERE %s", a->where);
    return sql_int(a->path, sql) == 0;
}

static void insert_old(const char *path, int n, const char *prefix, int64_t at)
{
    sqlite3 *db = open_db(path);
    char sql[300];
    exec_sql(db, "BEGIN");
    for (int i = 0; i < n; i++) {
        snprintf(sql, sizeof sql,
                 "INSERT INTO outbox_inbox(message_id, stream, entry_id, received_at) "
                 "VALUES ('%s-%d', 'outbox:x', '1-%d', %lld)",
                 prefix, i, i, (long long)at);
        exec_sql(db, sql);
    }
    exec_sql(db, "COMMIT");
    sqlite3_close_v2(db);
}

static void test_gc(void)
{
    char *path = th_path(dir, "gc.db");
    uv_loop_t loop;
    outbox_consumer_settings s;
    outbox_consumer *c;
    char err[300];
    int stopped = 0;
    gc_arg first = {path, "message_id LIKE 'old-%'"}, later = {path, "message_id LIKE 'later-%'"};

    if (uv_loop_init(&loop) != 0)
        bail("uv_loop_init");
    settings(&s, path);
    s.stream = "outbox:gc";
    s.inbox_retention_ms = 3000; /* clean-up every 300 ms, the first after 1 s */
    is_int(outbox_consumer_create(&c, &loop, &s, err, sizeof err), 0, "gc: consumer created (inbox table made)");
    insert_old(path, 2500, "old", 1000);
    insert_old(path, 5, "recent", outbox_now_ms());
    is_int(outbox_consumer_start(c), 0, "gc: started");
    ok(ct_run_until_cond(&loop, rows_gone, &first, 10000 * th_slow()),
       "2500 inbox rows older than the retention deleted (in batches)");
    is_int(sql_int(path, "SELECT count(*) FROM outbox_inbox WHERE message_id LIKE 'recent-%'"), 5,
           "rows within the retention kept");
    insert_old(path, 3, "later", 1000);
    ok(ct_run_until_cond(&loop, rows_gone, &later, 3000 * th_slow()),
       "rows that became old later are deleted too: the clean-up keeps running");
    is_int(outbox_consumer_stop(c, on_stopped, &stopped), 0, "gc: stop");
    ct_run_until(&loop, &stopped, 10000);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "gc: uv_loop_close() == 0");
    free(path);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();
    dbpath = th_path(dir, "consumer.db");

    test_kills();
    test_gc();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    free(dbpath);
    return tap_done();
}
