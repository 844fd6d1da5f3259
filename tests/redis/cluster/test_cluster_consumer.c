/*
 * test_cluster_consumer.c: the consumer-group helper with the Redis dedup
 * module on a redis-cluster:// URL (cluster_env.h: 3 masters with a
 * replica each) follows its stream while the stream's slot moves.
 *
 * Three streams, each in the lowest slot of another master, one consumer
 * for each on the test's loop; a writer thread XADDs messages to all three
 * all along (following MOVED and ASK itself, ce_cmd_argv) while a driver
 * thread moves the slots under them:
 *   1. `redis-cli --cluster reshard` of stream 0's slot to another master;
 *   2. a manual migration of stream 1's slot: the stream key MIGRATEd
 *      first, its dedup keys left on the source for a while (the ASK window
 *      held open about 1.5 s while both keep working), then the rest and
 *      SETSLOT NODE;
 *   3. CLUSTER FAILOVER of the master of stream 2.
 * At the end every message the writer wrote is applied exactly once (the
 * handler counts the effects), every entry is acknowledged on the stream's
 * owner (XPENDING 0) and each message's dedup marker is "D" there: the
 * dedup keys moved with their stream.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../consumer/ct.h"
#include "cluster_env.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define NS 3      /* streams */
#define MAXMSG 4000 /* per stream, at most */
#define GROUP "g"

static ce_env env;
static char stream[NS][64];

/* Effects, counted on the loop thread. */
static int applied[NS][MAXMSG];
/* The writer's progress (its thread writes, the main thread reads once
 * the writer is joined or under the lock). */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int written[NS];
static int writer_failed;
static volatile int stop_writing;
/* The driver's results (read after the join). */
static int drv_reshard, drv_ask_begin, drv_ask_named, drv_ask_keys, drv_ask_finish, drv_failover;
static int drv_owner_before[NS], drv_owner_after[NS];
static volatile int driver_done;

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    int k = -1, i = -1;
    (void)data;
    if (sscanf(dv->msg->id, "s%d-%d", &k, &i) == 2 && k >= 0 && k < NS && i >= 0 && i < MAXMSG)
        applied[k][i]++;
    outbox_consumer_done(c, dv, 0);
    return 0;
}

/* XADD of message i to stream k through the slot map, retried until it is
 * accepted (a retry after a lost reply is a duplicate entry of the same
 * message: the dedup module's job). */
static int write_one(int k, int i)
{
    char id[32];
    size_t len;
    char *envl;
    const char *argv[7];
    size_t lens[7];
    redisReply *r;
    int good;
    snprintf(id, sizeof id, "s%d-%d", k, i);
    envl = ct_envelope(id, "orders", "x", 1, &len);
    argv[0] = "XADD", lens[0] = 4;
    argv[1] = stream[k], lens[1] = strlen(stream[k]);
    argv[2] = "*", lens[2] = 1;
    argv[3] = "id", lens[3] = 2;
    argv[4] = id, lens[4] = strlen(id);
    argv[5] = "envelope", lens[5] = 8;
    argv[6] = envl, lens[6] = len;
    r = ce_cmd_argv(&env, stream[k], 7, argv, lens, 20000);
    good = r && r->type == REDIS_REPLY_STRING;
    if (!good)
        diag("writer: XADD %s to %s: %s", id, stream[k], r && r->type == REDIS_REPLY_ERROR ? r->str : "no answer");
    if (r)
        freeReplyObject(r);
    free(envl);
    return good;
}

static void *writer(void *arg)
{
    (void)arg;
    for (int i = 0; i < MAXMSG && !stop_writing; i++) {
        for (int k = 0; k < NS; k++) {
            if (!write_one(k, i)) {
                pthread_mutex_lock(&mu);
                writer_failed++;
                pthread_mutex_unlock(&mu);
                return NULL;
            }
            pthread_mutex_lock(&mu);
            written[k] = i + 1;
            pthread_mutex_unlock(&mu);
        }
        th_sleep_ms(4);
    }
    return NULL;
}

static void *driver(void *arg)
{
    int slot, to, m;
    (void)arg;
    for (int k = 0; k < NS; k++)
        drv_owner_before[k] = ce_owner(&env, stream[k]);
    th_sleep_ms(800);
    /* 1. The whole slot of stream 0 (the lowest of its master) with
     * redis-cli. */
    to = drv_owner_before[1];
    drv_reshard = ce_reshard(&env, drv_owner_before[0], to, 1);
    th_sleep_ms(800);
    /* 2. Stream 1's slot by hand: the stream first, so that for a while the
     * stream is on the target and most of its dedup keys on the source. */
    slot = ce_slot_of(&env, stream[1]);
    to = drv_owner_before[2];
    drv_ask_begin = ce_migrate_begin(&env, slot, to, 0);
    drv_ask_named = ce_migrate_named(&env, stream[1]);
    th_sleep_ms(1500);
    drv_ask_keys = ce_migrate_keys(&env, 20);
    th_sleep_ms(500);
    drv_ask_finish = ce_migrate_finish(&env);
    th_sleep_ms(800);
    /* 3. A graceful failover of stream 2's master. */
    m = ce_owner(&env, stream[2]);
    drv_failover = ce_failover(&env, ce_replica_of(&env, m));
    th_sleep_ms(800);
    for (int k = 0; k < NS; k++)
        drv_owner_after[k] = ce_owner(&env, stream[k]);
    driver_done = 1;
    return NULL;
}

static int all_applied(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&mu);
    for (int k = 0; k < NS; k++)
        for (int i = 0; i < written[k]; i++)
            if (!applied[k][i]) {
                pthread_mutex_unlock(&mu);
                return 0;
            }
    pthread_mutex_unlock(&mu);
    return 1;
}

static int is_done(void *arg)
{
    (void)arg;
    return driver_done;
}

/* Messages of stream k whose dedup marker is "D" on the stream's owner. */
static int markers_done(int k, int n)
{
    int owner = ce_owner(&env, stream[k]), done = 0;
    redisContext *c = ce_client(&env, owner);
    char key[160];
    if (!c)
        return -1;
    for (int i = 0; i < n; i++) {
        redisReply *r;
        snprintf(key, sizeof key, "dedup:" GROUP ":{%s}:s%d-%d", stream[k], k, i);
        r = redisCommand(c, "GET %s", key);
        done += r && r->type == REDIS_REPLY_STRING && strcmp(r->str, "D") == 0;
        if (r)
            freeReplyObject(r);
    }
    redisFree(c);
    return done;
}

int main(void)
{
    uv_loop_t loop;
    outbox_consumer *c[NS];
    outbox_consumer_settings s;
    pthread_t wt, dt;
    char err[512];
    int m[CE_MAX_NODES];

    if (ce_start(&env, 3, 1, 0, NULL) != 0)
        skip_all("cannot start a cluster of 3 masters with a replica each");
    ce_master_list(&env, m);
    for (int k = 0; k < NS; k++)
        if (ce_name_in_slot(&env, ce_lowest_slot(&env, m[k]), "outbox:orders-", stream[k], sizeof stream[k]) != 0)
            bail("no stream name for master %d", m[k]);

    uv_loop_init(&loop);
    for (int k = 0; k < NS; k++) {
        outbox_consumer_defaults(&s);
        s.redis_url = env.url;
        s.stream = stream[k];
        s.group = GROUP;
        s.handler = handler;
        s.block_ms = 200;
        s.min_idle_ms = 1000;
        s.claim_interval_ms = 300;
        s.retry_ms = 100;
        s.max_deliveries = 1000; /* redeliveries around the moves are no poison */
        s.log_level = OUTBOX_LOG_WARN;
        is_int(outbox_consumer_create(&c[k], &loop, &s, err, sizeof err), 0, "consumer of %s created on %s%s%s",
               stream[k], env.url, err[0] ? ": " : "", err);
        if (!c[k])
            bail("cannot go on without the consumer");
        is_int(outbox_consumer_start(c[k]), 0, "consumer of %s started", stream[k]);
    }
    pthread_create(&wt, NULL, writer, NULL);
    pthread_create(&dt, NULL, driver, NULL);
    ok(ct_run_until_cond(&loop, is_done, NULL, 150000 * th_slow()), "the driver finished its moves");
    pthread_join(dt, NULL);
    ct_run_for(&loop, 500);
    stop_writing = 1;
    pthread_join(wt, NULL);
    is_int(writer_failed, 0, "the writer got every XADD accepted");
    is_int(drv_reshard, 0, "1. redis-cli --cluster reshard of %s's slot", stream[0]);
    ok(drv_owner_after[0] != drv_owner_before[0], "   it moved from node %d to node %d", drv_owner_before[0],
       drv_owner_after[0]);
    is_int(drv_ask_begin, 0, "2. SETSLOT MIGRATING/IMPORTING of %s's slot", stream[1]);
    is_int(drv_ask_named, 1, "   the stream MIGRATEd first");
    ok(drv_ask_keys >= 0, "   then %d more keys of the slot", drv_ask_keys);
    is_int(drv_ask_finish, 0, "   the rest and SETSLOT NODE");
    ok(drv_owner_after[1] != drv_owner_before[1], "   it moved from node %d to node %d", drv_owner_before[1],
       drv_owner_after[1]);
    is_int(drv_failover, 0, "3. CLUSTER FAILOVER of %s's master", stream[2]);
    ok(drv_owner_after[2] != drv_owner_before[2], "   its master went from node %d to node %d", drv_owner_before[2],
       drv_owner_after[2]);
    diag("written: %d, %d, %d", written[0], written[1], written[2]);

    ok(ct_run_until_cond(&loop, all_applied, NULL, 30000 * th_slow()), "every message written is applied");
    ct_run_for(&loop, 500);
    for (int k = 0; k < NS; k++) {
        int missing = 0, twice = 0;
        outbox_consumer_stats st;
        redisContext *rc = ce_client(&env, ce_owner(&env, stream[k]));
        for (int i = 0; i < written[k]; i++) {
            missing += applied[k][i] == 0;
            twice += applied[k][i] > 1;
        }
        for (int i = written[k]; i < MAXMSG; i++)
            twice += applied[k][i] != 0; /* nothing the writer did not write */
        is_int(missing, 0, "%s: none of the %d messages missing", stream[k], written[k]);
        is_int(twice, 0, "%s: none applied twice", stream[k]);
        outbox_consumer_stats_get(c[k], &st);
        diag("%s: delivered %llu applied %llu duplicates %llu busy %llu claimed %llu acked %llu", stream[k],
             (unsigned long long)st.delivered, (unsigned long long)st.applied, (unsigned long long)st.duplicates,
             (unsigned long long)st.busy, (unsigned long long)st.claimed, (unsigned long long)st.acked);
        ok(rc != NULL, "%s: its owner answers", stream[k]);
        if (rc) {
            is_int(ct_pending(rc, stream[k], GROUP), 0, "%s: nothing pending on its owner", stream[k]);
            redisFree(rc);
        }
        is_int(markers_done(k, written[k]), written[k], "%s: every dedup marker is D on the owner", stream[k]);
    }
    for (int k = 0; k < NS; k++) {
        outbox_consumer_stop(c[k], NULL, NULL);
        outbox_consumer_destroy(c[k]);
    }
    is_int(ct_loop_finish(&loop, 10000), 0, "the loop closes cleanly");
    ce_stop(&env);
    return tap_done();
}
