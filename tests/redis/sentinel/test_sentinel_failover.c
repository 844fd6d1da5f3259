/*
 * test_sentinel_failover.c: the outbox-relay daemon on a redis-sentinel://
 * URL while the master is killed (a master, a replica, three sentinels;
 * sentinel_env.h).
 *   1. --wait-replicas 1: a backlog drains while more rows are committed;
 *      the master is SIGKILLed mid-drain; the sentinels promote the
 *      replica; the relay follows by itself. The new master has no replica
 *      until the old one is started again (it comes back as a master with
 *      no data and is demoted by the sentinels seconds later), so nothing
 *      may be marked published before then. After the final drain, every
 *      committed row is on the new master's stream: none lost.
 *   2. Without --wait-replicas, the same against the new master: an entry
 *      the dying master accepted and had not replicated is gone, and its
 *      row is marked published: the documented window. The test reports
 *      how many were lost (a TAP diagnostic) and checks that only rows
 *      marked published are missing.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "sentinel_env.h"
#include "tap.h"

#define BACKLOG 30000 /* big enough that a fast drain is still under way at the kill */
#define TRICKLE 40 /* rows per trickle step, 10 steps */

static sqlite3 *db;

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

static int64_t published(const char *topic)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2", topic);
}

/* Waits (20 s) until more than base rows of topic are published; returns
 * when, or -1. */
static int64_t wait_more_published(const char *topic, int64_t base)
{
    int64_t deadline = th_now_ms() + 20000 * th_slow();
    while (published(topic) <= base && th_now_ms() < deadline)
        th_sleep_ms(10);
    return published(topic) > base ? th_now_ms() : -1;
}

typedef struct phase {
    const char *topic;
    int wait_replicas;
    int victim; /* the master killed */
} phase;

static void run_phase(se_env *e, const char *dir, const char *dbpath, const phase *ph)
{
    char log[512], marked[64];
    int next = 1 - ph->victim, i, committed = BACKLOG;
    int64_t t_kill, t_promoted, t_resumed = -1, before, base;
    pid_t pid;
    redisContext *c;
    rt_audit a;
    char *text;

    snprintf(log, sizeof log, "%s/relay-%s.log", dir, ph->topic);
    rt_insert_rows(db, ph->topic, 0, BACKLOG, ph->topic, 0);
    /* Small batches and window: the drain takes long enough to be killed
     * in the middle of, however fast the machine. */
    if (ph->wait_replicas)
        pid = rt_relay_spawn(log, dbpath, e->url, "--wait-replicas", "1", "--wait-timeout-ms", "300",
                             "--max-attempts", "100000", "--backoff-min-ms", "50", "--backoff-max-ms", "300",
                             "--batch", "64", "--inflight", "256", NULL);
    else
        pid = rt_relay_spawn(log, dbpath, e->url, "--max-attempts", "100000", "--backoff-min-ms", "50",
                             "--backoff-max-ms", "300", "--batch", "64", "--inflight", "256", NULL);
    /* Mid-drain: some rows published, many not. The count is read again
     * after the kill: the drain may go on for as long as a read of it takes
     * on a loaded machine, and only what was not marked by then is certain
     * to have been left for the failover. */
    for (t_kill = th_now_ms(); th_now_ms() - t_kill < 20000 * th_slow() && published(ph->topic) < BACKLOG / 10;)
        th_sleep_ms(5);
    th_redis_kill(&e->node[ph->victim]);
    t_kill = th_now_ms();
    before = published(ph->topic);
    ok(before > 0 && before < BACKLOG, "%s: killing the master mid-drain (%lld of %d marked published after it)",
       ph->topic, (long long)before, BACKLOG);
    for (i = 0; i < 10; i++) {
        rt_insert_rows(db, ph->topic, committed, TRICKLE, ph->topic, 0);
        committed += TRICKLE;
        th_sleep_ms(100);
    }
    ok(se_wait_master(e, next, 30000 * th_slow()), "%s: the sentinels promoted node %d", ph->topic, next);
    t_promoted = th_now_ms();
    snprintf(marked, sizeof marked, "%lld", (long long)published(ph->topic));
    if (!ph->wait_replicas) {
        /* Publishing resumes on the new master by itself: rows committed
         * now are published. */
        base = published(ph->topic);
        rt_insert_rows(db, ph->topic, committed, TRICKLE, ph->topic, 0);
        committed += TRICKLE;
        t_resumed = wait_more_published(ph->topic, base);
        ok(t_resumed > 0, "%s: publishing resumed on the new master", ph->topic);
    } else {
        /* No replica to acknowledge: nothing more may count as published. */
        base = published(ph->topic);
        th_sleep_ms(1000);
        is_int(published(ph->topic), base, "%s: no replica for the new master: nothing marked published", ph->topic);
    }
    /* The old master comes back (as a master, until demoted), once every
     * sentinel knows of the failover: a sentinel that had not heard of it
     * yet could take the restarted, empty old master for the master still,
     * and the new master would resync from it. */
    ok(se_wait_all_named(e, next, 30000 * th_slow()), "%s: every sentinel names node %d", ph->topic, next);
    base = published(ph->topic);
    ok(th_redis_restart(&e->node[ph->victim]) == 0, "%s: the old master is started again", ph->topic);
    ok(se_wait_replica(e, ph->victim, 40000 * th_slow()), "%s: and demoted to a replica of node %d", ph->topic, next);
    if (ph->wait_replicas) {
        t_resumed = wait_more_published(ph->topic, base);
        ok(t_resumed > 0, "%s: publishing resumed once the new master has a replica", ph->topic);
    }
    rt_insert_rows(db, ph->topic, committed, TRICKLE, ph->topic, 0);
    committed += TRICKLE;
    ok(th_wait_until(60000 * th_slow(), settled, NULL), "%s: every row settles", ph->topic);
    is_int(th_stop(pid, SIGTERM, 15000), 0, "%s: the relay exits 0 on SIGTERM", ph->topic);

    c = th_redis_client(&e->node[next]);
    a = rt_audit_topic(db, c, "outbox:", ph->topic);
    redisFree(c);
    is_int(a.rows, committed, "%s: %d rows committed", ph->topic, committed);
    is_int(a.unpublished, 0, "%s: every row marked published", ph->topic);
    is_int(a.foreign, 0, "%s: no entry without a row", ph->topic);
    diag("%s: failover: sentinels promoted the replica %lld ms after the kill; marks resumed %lld ms after the "
         "kill (rows committed after the promotion, or with --wait-replicas after the old master is back, were "
         "published); %s rows were marked published at promotion",
         ph->topic, (long long)(t_promoted - t_kill), (long long)(t_resumed > 0 ? t_resumed - t_kill : -1), marked);
    diag("%s: on the new master: %ld entries, %ld lost, %ld duplicates", ph->topic, a.entries, a.missing, a.dups);
    if (ph->wait_replicas)
        is_int(a.missing, 0, "%s: with --wait-replicas 1 no committed message is lost", ph->topic);
    else
        ok(a.missing <= a.rows - a.unpublished, "%s: only rows marked published are missing (%ld lost)", ph->topic,
           a.missing);
    text = th_slurp(log);
    ok(rt_count_substr(text, "master switched") + rt_count_substr(text, "connection lost") > 0,
       "%s: the relay logged leaving the old master", ph->topic);
    if (a.missing && ph->wait_replicas)
        th_diag_tail("relay", text, 40);
    free(text);
}

/* A field of a flat name/value array (SENTINEL MASTER, one entry of
 * SENTINEL REPLICAS), "" if missing. */
static const char *field(const redisReply *r, const char *name)
{
    if (r && r->type == REDIS_REPLY_ARRAY)
        for (size_t k = 0; k + 1 < r->elements; k += 2)
            if (r->element[k]->type == REDIS_REPLY_STRING && strcmp(r->element[k]->str, name) == 0 &&
                r->element[k + 1]->type == REDIS_REPLY_STRING)
                return r->element[k + 1]->str;
    return "";
}

/* What sentinel i says: node 0 is the master, up (flags "master"), with one
 * replica that is up and linked (flags "slave", master-link-status ok), and
 * it knows the two other sentinels. 1 if all of that; else 0, with what it
 * said as a diagnostic when report is set. */
static int sentinel_sees_all_up(const se_env *e, int i, int report)
{
    redisContext *c = se_sentinel_client(e, i);
    redisReply *m = NULL, *reps = NULL, *rep;
    int good;
    if (c) {
        m = redisCommand(c, "SENTINEL MASTER " SE_MASTER_NAME);
        reps = redisCommand(c, "SENTINEL REPLICAS " SE_MASTER_NAME);
    }
    rep = reps && reps->type == REDIS_REPLY_ARRAY && reps->elements == 1 ? reps->element[0] : NULL;
    good = se_named_master(e, i) == 0 && strcmp(field(m, "flags"), "master") == 0 &&
           atoi(field(m, "num-slaves")) == 1 && atoi(field(m, "num-other-sentinels")) == SE_SENTINELS - 1 && rep &&
           strcmp(field(rep, "flags"), "slave") == 0 && strcmp(field(rep, "master-link-status"), "ok") == 0;
    if (!good && report)
        diag("sentinel %d: names node %d; master flags '%s', %s replicas (the one: flags '%s', link '%s'), %s other "
             "sentinels",
             i, se_named_master(e, i), field(m, "flags"), field(m, "num-slaves"), field(rep, "flags"),
             field(rep, "master-link-status"), field(m, "num-other-sentinels"));
    if (m)
        freeReplyObject(m);
    if (reps)
        freeReplyObject(reps);
    if (c)
        redisFree(c);
    return good;
}

static int all_sentinels_see_all_up(void *arg)
{
    for (int i = 0; i < SE_SENTINELS; i++)
        if (!sentinel_sees_all_up(arg, i, 0))
            return 0;
    return 1;
}

int main(void)
{
    se_env e;
    char *dir, *dbpath;
    phase ph1 = {"acked", 1, 0}, ph2 = {"unacked", 0, 1};

    se_world_start(&e, NULL, &dir, &dbpath, &db);
    /* se_world_start saw the replica acknowledge writes and each sentinel
     * count it; a sentinel reads the replica's link status from the
     * replica's own INFO, which it may not have asked for yet. */
    if (!ok(th_wait_until(10000 * th_slow(), all_sentinels_see_all_up, &e),
            "master, replica and three sentinels up, as each sentinel says: %s", e.url))
        for (int i = 0; i < SE_SENTINELS; i++)
            sentinel_sees_all_up(&e, i, 1);

    run_phase(&e, dir, dbpath, &ph1);
    run_phase(&e, dir, dbpath, &ph2);

    se_world_end(&e, dir, dbpath, db);
    return tap_done();
}
