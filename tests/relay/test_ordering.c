/*
 * test_ordering.c: per-key ordering under injected Redis failures.
 *
 * Keyed messages (a few keys, many messages each) are published while
 * Redis refuses the XADDs for a while, in two ways:
 *   - WRONGTYPE: the stream key holds a string (SET before the relay
 *     starts, DEL a second after its first failure);
 *   - OOM: CONFIG SET maxmemory 1 while the relay is publishing (half the
 *     rows are committed after it), back to 0 a second after the first
 *     failure.
 * Afterwards every message is in its stream and, for each key, the first
 * appearances follow commit (seq) order. Unkeyed messages mixed in flow too.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 3000
#define KEYS 6

static sqlite3 *db;
static const char *topic;

static int all_published(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state <> 2", topic) == 0;
}

static int some_published(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2", topic) >= 100;
}

/* Keyed rows first to first + n - 1 of N, with some unkeyed ones mixed in,
 * in one commit order (one transaction: the relay may be running). */
static void write_rows(const char *prefix, const char *t, int first, int n)
{
    th_sql_exec(db, "BEGIN IMMEDIATE");
    rt_insert_rows_in_txn(db, prefix, first, n, t, KEYS);
    th_sql_exec(db, "UPDATE outbox SET key = NULL WHERE topic = %Q AND key IS NOT NULL AND seq %% 10 = 0", t);
    th_sql_exec(db, "COMMIT");
}

/* Waits (bounded) until the relay's log shows a failed publish. */
static int failure_logged(const char *log, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int seen = 0;
    while (!seen && th_now_ms() < deadline) {
        char *text = th_slurp(log);
        seen = strstr(text, "publish failed, will retry") != NULL;
        free(text);
        if (!seen)
            th_sleep_ms(10);
    }
    return seen;
}

static void report(const char *what, const rt_audit *a, const char *log, long failures_logged)
{
    char *text = th_slurp(log);
    long fails = rt_count_substr(text, "publish failed, will retry");
    is_int(a->rows, N, "%s: %d rows", what, N);
    is_int(a->missing, 0, "%s: every message is in the stream", what);
    is_int(a->unpublished, 0, "%s: every row is published", what);
    is_int(a->foreign, 0, "%s: no entry without a row", what);
    is_int(a->order_violations, 0, "%s: per key, first appearances follow commit order", what);
    diag("%s: %ld duplicate entries, %ld failed attempts logged", what, a->dups, fails);
    ok(fails >= failures_logged, "%s: the relay did see failures (%ld)", what, fails);
    free(text);
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log1, *log2;
    redisContext *c;
    redisReply *rep;
    pid_t pid;
    rt_audit a;
    int done;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log1 = th_path(dir, "relay1.log");
    log2 = th_path(dir, "relay2.log");

    /* WRONGTYPE from the start, for a second. */
    topic = "wt";
    write_rows("wt", topic, 0, N);
    freeReplyObject(th_cmd(c, "SET outbox:wt x"));
    pid = rt_relay_spawn(log1, dbpath, srv.url, "--backoff-min-ms", "50", "--backoff-max-ms", "200",
                         "--max-attempts", "1000", NULL);
    /* Failed attempts (however long the start takes), for a second. */
    if (!failure_logged(log1, 20000 * th_slow()))
        diag("wrongtype: no failed attempt logged");
    th_sleep_ms(1000);
    rep = th_cmd(c, "DEL outbox:wt");
    is_int(rep->integer, 1, "wrongtype: the string was still in place after a second");
    freeReplyObject(rep);
    done = th_wait_until(30000 * th_slow(), all_published, NULL);
    ok(done, "wrongtype: everything published after the DEL");
    a = rt_audit_topic(db, c, "outbox:", topic);
    report("wrongtype", &a, log1, 1);
    is_int(th_stop(pid, SIGTERM, 15000), 0, "wrongtype: the relay exits 0 on SIGTERM");
    if (!done) {
        char *text = th_slurp(log1);
        th_diag_tail("relay", text, 15);
        free(text);
    }

    /* OOM in the middle of publishing, for a second: half the rows are
     * published from (at least 100 of them), then Redis runs out of
     * memory, then the other half is committed, so that the relay meets
     * the OOM errors however fast it drained the first half. */
    topic = "oom";
    write_rows("oom", topic, 0, N / 2);
    pid = rt_relay_spawn(log2, dbpath, srv.url, "--backoff-min-ms", "50", "--backoff-max-ms", "200",
                         "--max-attempts", "1000", NULL);
    ok(th_wait_until(10000 * th_slow(), some_published, NULL), "oom: publishing started");
    rep = th_cmd(c, "CONFIG SET maxmemory 1");
    ok(rep->type == REDIS_REPLY_STATUS, "oom: maxmemory 1");
    freeReplyObject(rep);
    diag("oom: %lld of %d published when Redis ran out of memory",
         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'oom' AND state = 2"), N);
    write_rows("oom", topic, N / 2, N - N / 2);
    if (!failure_logged(log2, 20000 * th_slow()))
        diag("oom: no failed attempt logged");
    th_sleep_ms(1000);
    freeReplyObject(th_cmd(c, "CONFIG SET maxmemory 0"));
    done = th_wait_until(30000 * th_slow(), all_published, NULL);
    ok(done, "oom: everything published after maxmemory 0");
    a = rt_audit_topic(db, c, "outbox:", topic);
    report("oom", &a, log2, 1);
    {
        char *text = th_slurp(log2);
        ok(strstr(text, "OOM") != NULL, "oom: the relay logged Redis' OOM error");
        if (!done)
            th_diag_tail("relay", text, 15);
        free(text);
    }
    is_int(th_stop(pid, SIGTERM, 15000), 0, "oom: the relay exits 0 on SIGTERM");

    free(log1);
    free(log2);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
