/*
 * test_deadletter.c: a stream Redis keeps refusing (WRONGTYPE: the key
 * holds a string) dead-letters only its own messages, after exactly
 * --max-attempts attempts, with last_error naming the Redis error, while
 * another topic's messages, committed interleaved with them, flow
 * completely. Keyed messages of the broken stream are dead-lettered too
 * (a dead message stops blocking its key).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N_GOOD 2000
#define N_BAD 100
#define N_BAD_KEYED 60

static sqlite3 *db;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    redisReply *rep;
    pid_t pid;
    rt_audit a;
    int i, done;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log = th_path(dir, "relay.log");
    /* Interleaved commits: good, bad, bad keyed. */
    for (i = 0; i < 20; i++) {
        rt_insert_rows(db, "good", i * (N_GOOD / 20), N_GOOD / 20, "good", 0);
        rt_insert_rows(db, "bad", i * (N_BAD / 20), N_BAD / 20, "bad", 0);
        rt_insert_rows(db, "badk", i * (N_BAD_KEYED / 20), N_BAD_KEYED / 20, "bad", 6);
    }
    freeReplyObject(th_cmd(c, "SET outbox:bad x"));

    pid = rt_relay_spawn(log, dbpath, srv.url, "--max-attempts", "3", "--backoff-min-ms", "20",
                         "--backoff-max-ms", "50", NULL);
    done = th_wait_until(30000 * th_slow(), settled, NULL);
    ok(done, "every row settles (published or dead)");

    a = rt_audit_topic(db, c, "outbox:", "good");
    is_int(a.rows, N_GOOD, "good: %d rows", N_GOOD);
    is_int(a.unpublished, 0, "good: every row is published");
    is_int(a.missing, 0, "good: every message is in its stream");
    is_int(th_xlen(c, "outbox:good"), N_GOOD, "good: one entry each");

    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad'"), N_BAD + N_BAD_KEYED, "bad: %d rows",
           N_BAD + N_BAD_KEYED);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND state = 3"), N_BAD + N_BAD_KEYED,
           "bad: every row is dead");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND attempts = 3"), N_BAD + N_BAD_KEYED,
           "bad: each after exactly 3 attempts");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND last_error LIKE '%%WRONGTYPE%%'"),
           N_BAD + N_BAD_KEYED, "bad: last_error names WRONGTYPE");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'bad' AND (lease_owner IS NOT NULL OR "
                      "stream_id IS NOT NULL)"),
           0, "bad: dead rows hold no lease and no stream id");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'good' AND state = 3"), 0,
           "good: nothing dead");
    rep = th_cmd(c, "GET outbox:bad");
    ok(rep->type == REDIS_REPLY_STRING && strcmp(rep->str, "x") == 0, "the string key was left alone");
    freeReplyObject(rep);

    is_int(th_stop(pid, SIGTERM, 15000), 0, "SIGTERM: the relay exits 0");
    text = th_slurp(log);
    is_int(rt_count_substr(text, "msg=\"dead-lettered\""), N_BAD + N_BAD_KEYED, "each dead letter is logged once");
    {
        char line[64];
        snprintf(line, sizeof line, "msg=stopped published=%d failed=", N_GOOD);
        ok(strstr(text, line) != NULL, "the stop line counts %d published", N_GOOD);
        snprintf(line, sizeof line, " dead=%d ", N_BAD + N_BAD_KEYED);
        ok(strstr(text, line) != NULL, "the stop line counts %d dead", N_BAD + N_BAD_KEYED);
    }
    if (!done)
        th_diag_tail("relay", text, 20);
    free(text);

    free(log);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
