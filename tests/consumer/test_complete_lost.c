/*
 * test_complete_lost.c: the dedup complete of an applied message that never
 * reaches Redis (the consumer's connections killed between the effect and
 * the complete, as a reset or a black hole does) is sent again once the
 * consumer has reconnected, and the effect is applied once. Before, the
 * entry was acknowledged on a dead connection, stayed pending, came back
 * after the dedup lease and was applied a second time (outbox-consume
 * through the network-fault suite's faults: 99 effects applied twice in one
 * run). A message whose complete went through is untouched.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define STREAM "outbox:lost"
#define GROUP "g"

static th_redis srv;
static redisContext *rc;

typedef struct seen {
    int cut, other; /* applications of m-cut and m-other */
    int killed;     /* connections killed in m-cut's first application */
    int stopped;
} seen;

/* Every client of the server but the test's own: the consumer's
 * connections (reading, commands, dedup). */
static int kill_others(void)
{
    redisReply *r = th_cmd(rc, "CLIENT LIST");
    int n = 0;
    char *line, *save = NULL, *copy = strdup(r->str ? r->str : "");
    freeReplyObject(r);
    for (line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        long long id;
        if (strstr(line, " name=the-test ") || sscanf(line, "id=%lld", &id) != 1)
            continue;
        freeReplyObject(th_cmd(rc, "CLIENT KILL ID %lld", id));
        n++;
    }
    free(copy);
    return n;
}

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    seen *s = data;
    if (!strcmp(dv->msg->id, "m-cut")) {
        s->cut++;
        /* The effect is applied; the connections die before the consumer
         * can send the complete (it learns of it only on its next loop
         * turn, after this call). */
        if (s->cut == 1)
            s->killed = kill_others();
    } else {
        s->other++;
    }
    outbox_consumer_done(c, dv, 0);
    return 0;
}

static void on_stopped(outbox_consumer *c, void *data)
{
    (void)c;
    ((seen *)data)->stopped = 1;
}

static void on_drained(outbox_consumer *c, void *data)
{
    outbox_consumer_stop(c, on_stopped, data);
}

int main(void)
{
    uv_loop_t loop;
    outbox_consumer_settings cs;
    outbox_consumer_stats st;
    outbox_consumer *c;
    seen s = {0};
    char err[300], *v;

    /* What consumer.h asks of an embedding program: a write to a killed
     * connection must fail, not end the process. */
    signal(SIGPIPE, SIG_IGN);
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    freeReplyObject(th_cmd(rc, "CLIENT SETNAME the-test"));
    ct_group_create(rc, STREAM, GROUP);
    ct_xadd_msg(rc, STREAM, "m-cut", "lost", "x", 1, NULL);
    ct_xadd_msg(rc, STREAM, "m-other", "lost", "y", 1, NULL);

    if (uv_loop_init(&loop) != 0)
        bail("uv_loop_init");
    outbox_consumer_defaults(&cs);
    cs.redis_url = srv.url;
    cs.stream = STREAM;
    cs.group = GROUP;
    cs.dedup = OUTBOX_DEDUP_REDIS;
    /* A short lease and take-over: a second application would come long
     * before the drain could end without one. */
    cs.dedup_lease_ms = 1500;
    cs.min_idle_ms = 200;
    cs.claim_interval_ms = 100;
    cs.block_ms = 100;
    cs.retry_ms = 50;
    cs.max_inflight = 1;
    cs.drain = 1;
    cs.on_drained = on_drained;
    cs.handler = handler;
    cs.data = &s;
    cs.log_level = OUTBOX_LOG_ERROR;
    if (outbox_consumer_create(&c, &loop, &cs, err, sizeof err) != 0)
        bail("outbox_consumer_create: %s", err);
    if (outbox_consumer_start(c) != 0)
        bail("outbox_consumer_start");
    ok(ct_run_until(&loop, &s.stopped, 30000 * th_slow()), "the consumer drained the stream and stopped");
    outbox_consumer_stats_get(c, &st);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "uv_loop_close() == 0");

    ok(s.killed >= 1, "the consumer's connections were killed after m-cut's effect (%d)", s.killed);
    is_int(s.cut, 1, "m-cut applied once: its complete was sent again after the reconnect");
    is_int(s.other, 1, "m-other applied once");
    v = ct_get(rc, "dedup:" GROUP ":{" STREAM "}:m-cut");
    is_str(v, "D", "m-cut's dedup key is D");
    free(v);
    v = ct_get(rc, "dedup:" GROUP ":{" STREAM "}:m-other");
    is_str(v, "D", "m-other's dedup key is D");
    free(v);
    is_int(ct_pending(rc, STREAM, GROUP), 0, "every entry acknowledged");
    is_int(th_xlen(rc, STREAM ":dead"), 0, "nothing dead-lettered");

    redisFree(rc);
    th_redis_destroy(&srv);
    return tap_done();
}
