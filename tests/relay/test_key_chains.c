/*
 * test_key_chains.c: per-key order when a key's rows span many batches.
 *
 * 1. One key, 3000 rows, --batch 8: the relay chains each batch's rows of
 *    the key behind its own messages still on their way (instead of waiting
 *    for their marks). Every message arrives, in commit order.
 * 2. A key whose head keeps failing (its stream key holds a string) with a
 *    backlog far larger than the claim window, and another topic written
 *    after it: that topic is published while the key waits (its rows are
 *    deferred with the head's retry), and the key follows in order once the
 *    string is deleted.
 * 3. A row written with a later available_at: the rows of its key before it
 *    go first, those after it wait for it, other keys do not.
 * 4. Rows made to wait behind a failing head go once it succeeds, even while
 *    an older new row of another key stays held (behind another relay's
 *    lease): the claim has seen that older row, so it knows it is not theirs.
 *    A window of 16 messages leaves some of the key's rows new when the head
 *    first fails.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

static sqlite3 *db;

static int topic_done(void *arg)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state <> 2", (const char *)arg) == 0;
}

/* Some never-claimed row of the topic waits past its created_at (defer). */
static int key_made_to_wait(void *arg)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 0 "
                          "AND available_at > created_at AND lease_token = 0", (const char *)arg) > 0;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log1, *log2, *text;
    redisContext *c;
    redisReply *rep;
    pid_t pid;
    rt_audit a;
    int done;
    int64_t t0, took;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log1 = th_path(dir, "relay1.log");
    log2 = th_path(dir, "relay2.log");

    /* 1. One key across hundreds of small batches. */
    rt_insert_rows(db, "one", 0, 3000, "one", 1);
    pid = rt_relay_spawn(log1, dbpath, srv.url, "--batch", "8", "--inflight", "1024", NULL);
    done = th_wait_until(60000 * th_slow(), topic_done, (void *)"one");
    ok(done, "one key: all 3000 published");
    a = rt_audit_topic(db, c, "outbox:", "one");
    is_int(a.missing, 0, "one key: every message is in the stream");
    is_int(a.foreign, 0, "one key: no entry without a row");
    is_int(a.order_violations, 0, "one key: stream order is commit order");
    is_int(a.dups, 0, "one key: no duplicates");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "one key: the relay exits 0 on SIGTERM");

    /* 2. A failing head with a backlog of 600 behind it (window: 4 x 8 rows),
     *    then 200 rows of another topic. */
    rt_insert_rows(db, "stuck", 0, 600, "stuck", 1);
    rt_insert_rows(db, "free", 0, 200, "free", 0);
    freeReplyObject(th_cmd(c, "SET outbox:stuck x"));
    t0 = rt_unix_ms();
    pid = rt_relay_spawn(log2, dbpath, srv.url, "--batch", "8", "--backoff-min-ms", "3000", "--backoff-max-ms",
                         "3000", "--max-attempts", "1000", NULL);
    done = th_wait_until(20000 * th_slow(), topic_done, (void *)"free");
    took = rt_unix_ms() - t0;
    ok(done, "failing key: the other topic is published");
    ok(took < 2500 * th_slow(), "failing key: the other topic did not wait for the retry (%lld ms)",
       (long long)took);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'stuck' AND state = 2"), 0,
           "failing key: nothing of the key published while its head fails");
    rep = th_cmd(c, "DEL outbox:stuck");
    is_int(rep->integer, 1, "failing key: the string was still in place");
    freeReplyObject(rep);
    done = th_wait_until(60000 * th_slow(), topic_done, (void *)"stuck");
    ok(done, "failing key: everything published after the DEL");
    a = rt_audit_topic(db, c, "outbox:", "stuck");
    is_int(a.missing, 0, "failing key: every message is in the stream");
    is_int(a.order_violations, 0, "failing key: stream order is commit order");
    text = th_slurp(log2);
    ok(rt_count_substr(text, "publish failed, will retry") >= 1, "failing key: the relay saw the failure");
    if (!done)
        th_diag_tail("relay", text, 15);
    free(text);
    is_int(th_stop(pid, SIGTERM, 15000), 0, "failing key: the relay exits 0 on SIGTERM");

    /* 3. k: a (new), b (due in 1.5 s), c (new); j: d (new). */
    {
        int64_t due = rt_unix_ms() + 1500 * th_slow(); /* the relay starts slowly under valgrind */
        th_sql_exec(db,
                    "INSERT INTO outbox(id, topic, key, payload) VALUES ('dl-a', 'delayed', 'k', x'61');"
                    "INSERT INTO outbox(id, topic, key, payload, available_at) VALUES "
                    "('dl-b', 'delayed', 'k', x'62', %lld);"
                    "INSERT INTO outbox(id, topic, key, payload) VALUES ('dl-c', 'delayed', 'k', x'63');"
                    "INSERT INTO outbox(id, topic, key, payload) VALUES ('dl-d', 'delayed', 'j', x'64');",
                    (long long)due);
        pid = rt_relay_spawn(log1, dbpath, srv.url, NULL);
        done = th_wait_until(20000 * th_slow(), topic_done, (void *)"delayed");
        ok(done, "delayed row: everything published");
        ok(th_sql_int(db, "SELECT published_at FROM outbox_messages WHERE id = 'dl-a'") < due,
           "delayed row: the row of its key before it did not wait");
        ok(th_sql_int(db, "SELECT published_at FROM outbox_messages WHERE id = 'dl-d'") < due,
           "delayed row: another key did not wait");
        ok(th_sql_int(db, "SELECT published_at FROM outbox_messages WHERE id = 'dl-b'") >= due,
           "delayed row: published when due");
        ok(th_sql_int(db, "SELECT published_at FROM outbox_messages WHERE id = 'dl-c'") >=
               th_sql_int(db, "SELECT published_at FROM outbox_messages WHERE id = 'dl-b'"),
           "delayed row: the row of its key after it waited for it");
        a = rt_audit_topic(db, c, "outbox:", "delayed");
        is_int(a.missing, 0, "delayed row: every message is in the stream");
        is_int(a.order_violations, 0, "delayed row: stream order is commit order");
        is_int(th_stop(pid, SIGTERM, 15000), 0, "delayed row: the relay exits 0 on SIGTERM");
    }

    /* 4. j1 leased by another relay for a minute, j2 (new) behind it; then
     *    40 rows of key k whose head fails until the DEL. */
    th_sql_exec(db,
                "INSERT INTO outbox(id, topic, key, payload, state, lease_owner, lease_token, lease_until) "
                "VALUES ('held-j1', 'heldj', 'j', x'01', 1, 'another-relay', 1, %lld);"
                "INSERT INTO outbox(id, topic, key, payload) VALUES ('held-j2', 'heldj', 'j', x'02');",
                (long long)(rt_unix_ms() + 60000));
    rt_insert_rows(db, "wk", 0, 40, "waitk", 1);
    freeReplyObject(th_cmd(c, "SET outbox:waitk x"));
    pid = rt_relay_spawn(log2, dbpath, srv.url, "--batch", "8", "--inflight", "16", "--backoff-min-ms", "200",
                         "--backoff-max-ms", "200", "--max-attempts", "1000", NULL);
    /* The head fails and its key's rows never claimed are made to wait
     * behind it. The window of 16 keeps 24 of the 40 unclaimed when the
     * head's error comes back: with the default window, claims chaining the
     * key's rows behind their own messages on the way may take all 40 first
     * (as fast claims on a loaded machine did), and none is then a new row. */
    ok(th_wait_until(10000 * th_slow(), key_made_to_wait, (void *)"waitk"),
       "behind a failing head: its key's new rows were made to wait");
    rep = th_cmd(c, "DEL outbox:waitk");
    is_int(rep->integer, 1, "behind a failing head: the string was still in place");
    freeReplyObject(rep);
    t0 = rt_unix_ms();
    done = th_wait_until(20000 * th_slow(), topic_done, (void *)"waitk");
    took = rt_unix_ms() - t0;
    ok(done, "behind a failing head: all published after the DEL, in %lld ms (a lease of 60 s is held elsewhere)",
       (long long)took);
    a = rt_audit_topic(db, c, "outbox:", "waitk");
    is_int(a.missing, 0, "behind a failing head: every message is in the stream");
    is_int(a.order_violations, 0, "behind a failing head: stream order is commit order");
    is_int(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'held-j2'"), 0,
           "the row behind the other relay's lease still waits");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "behind a failing head: the relay exits 0 on SIGTERM");

    /* 5. h0 leased by another relay for a minute, 200 new rows of its key
     *    behind it (the walk looks 4 x 8 rows ahead), then 50 rows of another
     *    topic; later the lease expires. */
    th_sql_exec(db,
                "INSERT INTO outbox(id, topic, key, payload, state, lease_owner, lease_token, lease_until) "
                "VALUES ('behind-h0', 'behind', 'h', x'01', 1, 'another-relay', 1, %lld);",
                (long long)(rt_unix_ms() + 60000));
    rt_insert_rows(db, "behind", 1, 200, "behind", 0);
    th_sql_exec(db, "UPDATE outbox SET key = 'h' WHERE topic = 'behind'");
    rt_insert_rows(db, "after", 0, 50, "after", 0);
    t0 = rt_unix_ms();
    pid = rt_relay_spawn(log1, dbpath, srv.url, "--batch", "8", NULL);
    done = th_wait_until(20000 * th_slow(), topic_done, (void *)"after");
    took = rt_unix_ms() - t0;
    ok(done, "behind another relay's lease: the other topic is published (%lld ms)", (long long)took);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'behind' AND state <> 0"), 1,
           "behind another relay's lease: its key's rows still wait");
    th_sql_exec(db, "UPDATE outbox SET lease_until = %lld WHERE id = 'behind-h0'", (long long)rt_unix_ms());
    done = th_wait_until(20000 * th_slow(), topic_done, (void *)"behind");
    ok(done, "behind another relay's lease: all published once the lease expired");
    a = rt_audit_topic(db, c, "outbox:", "behind");
    is_int(a.missing, 0, "behind another relay's lease: every message is in the stream");
    is_int(a.order_violations, 0, "behind another relay's lease: stream order is commit order");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "behind another relay's lease: the relay exits 0 on SIGTERM");

    free(log1);
    free(log2);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
