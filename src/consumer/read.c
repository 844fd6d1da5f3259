/*
 * read.c: reading for the consumer-group helper (consumer_int.h): creating
 * the group, the XREADGROUP loop on the read target, the drain check
 * (XPENDING for this consumer) and the periodic recovery of entries left
 * idle by a consumer that went away (XAUTOCLAIM, then XPENDING for the
 * delivery count). Loop thread.
 *
 * The read goes through its own target (c->rd) by the stream's key: on a
 * cluster the blocked XREADGROUP waits on the connection of the stream's
 * master only, and a read answered MOVED or ASK is sent to the node named
 * by the cluster layer. On a target that routes (OUTBOX__TARGET_ROUTES),
 * what the layer cannot hide ends the read: the node's connection lost,
 * UNBLOCKED (the source's MIGRATE deleted the stream key in a reshard; a
 * failover demoted the master), CLUSTERDOWN past the deadline. No up event
 * follows, so the read timer reads again shortly, after asking for a fresh
 * slot map; that read gets the ASK or MOVED that leads to the new owner. A
 * single node's read comes again with its connection's up event.
 * Entries delivered to a read whose reply was lost stay pending for this
 * consumer and come back through XAUTOCLAIM, on whichever node owns the
 * stream by then.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer/consumer_int.h"

/* ------------------------------------------------------------------ */
/* reading */

static void ensure_group(outbox_consumer *c);

#define READ_AGAIN_MS 100

/* A plain URL naming a node of a Redis Cluster works until the stream's
 * slot is elsewhere; then every read and write is answered MOVED (or ASK,
 * or CLUSTERDOWN). That is a configuration error: say so once, naming the
 * URL to use. 1 if reply is such an answer. */
static int plain_url_to_cluster(outbox_consumer *c, const outbox__target *t, const redisReply *reply)
{
    const outbox__redis_url *u;
    if (!t || !outbox__target_misrouted(t, reply))
        return 0;
    u = outbox__target_node_url(t);
    if (!c->cluster_hinted++) {
        if (u && u->host)
            LOG(c, OUTBOX_LOG_ERROR,
                "msg=\"the Redis URL names a Redis Cluster node: use a cluster URL, %s://%s%s%s:%d\" stream=%s "
                "reply=\"%.200s\"",
                u->tls ? "rediss-cluster" : "redis-cluster", strchr(u->host, ':') ? "[" : "", u->host,
                strchr(u->host, ':') ? "]" : "", u->port, c->stream, reply->str);
        else
            LOG(c, OUTBOX_LOG_ERROR,
                "msg=\"the Redis URL names a Redis Cluster node: use a cluster URL, redis-cluster://host:port\" "
                "stream=%s reply=\"%.200s\"",
                c->stream, reply->str);
    }
    return 1;
}

/* A target that routes: a read (or the group's creation) that failed is
 * tried again soon, the map refreshed first (throttled by the layer); 1.
 * A single node's comes again with its next up event: 0. Also 0 once the
 * read target's close began (a stop). */
static int read_again_later(outbox_consumer *c)
{
    if (!c->rd || !outbox__target_routes(c->rd))
        return 0;
    if (c->state != CS_RUNNING)
        return 1;
    outbox__target_refresh(c->rd);
    if (!uv_is_active((uv_handle_t *)&c->read_timer))
        uv_timer_start(&c->read_timer, outbox__consumer_on_read_timer, READ_AGAIN_MS, 0);
    return 1;
}

void outbox__consumer_on_read_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    ensure_group(c);
    outbox__consumer_kick_read(c);
}

static void on_drain_check(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    (void)conn;
    c->checking_drain = 0;
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY && reply->elements == 0 && c->inflight == 0 &&
        c->state == CS_RUNNING && !c->drained) {
        c->drained = 1;
        LOG(c, OUTBOX_LOG_INFO, "msg=drained applied=%llu duplicates=%llu dead=%llu",
            (unsigned long long)c->st.applied, (unsigned long long)c->st.duplicates,
            (unsigned long long)c->st.dead_lettered);
        c->s.on_drained(c, c->s.data); /* consumer.c's default stops */
        return;
    }
    outbox__consumer_kick_read(c);
}

static void check_drained(outbox_consumer *c)
{
    const char *argv[7] = {"XPENDING", c->stream, c->group, "-", "+", "1", c->consumer};
    size_t lens[7];
    if (!c->s.drain || c->drained || c->inflight || !outbox__consumer_cmd_ready(c) || c->checking_drain)
        return;
    for (int i = 0; i < 7; i++)
        lens[i] = strlen(argv[i]);
    if (outbox__consumer_command(c, c->stream, 7, argv, lens, on_drain_check, c) == 0)
        c->checking_drain = 1;
}

static void on_read(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    size_t got = 0;
    c->reading = 0;
    if (status != 0 || (c->rd && outbox__target_lost(c->rd, conn, reply))) {
        /* A single node: the connection is being re-established and its up
         * event reads again. A target that routes: the layer lost the
         * node's connection (or could not reach it); read again once the
         * map says where. */
        if (read_again_later(c) && status != 0)
            LOG(c, c->read_interrupted++ ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_INFO,
                "msg=\"read interrupted, reading again\" stream=%s err=%s", c->stream, outbox_err_name(status));
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        if (strncmp(reply->str, "NOGROUP", 7) == 0) {
            c->group_ready = 0;
            ensure_group(c);
        } else if (read_again_later(c)) {
            /* A target that routes: UNBLOCKED (the master was demoted),
             * CLUSTERDOWN or TRYAGAIN after the layer's retries: the slot is
             * changing hands. */
            LOG(c, c->read_interrupted++ ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_INFO,
                "msg=\"read interrupted, reading again\" stream=%s reply=\"%.200s\"", c->stream, reply->str);
        } else if (!plain_url_to_cluster(c, c->rd, reply)) {
            LOG(c, OUTBOX_LOG_ERROR, "msg=\"XREADGROUP failed\" error=\"%.200s\"", reply->str);
        }
        return;
    }
    c->read_interrupted = 0;
    if (reply->type == REDIS_REPLY_ARRAY) {
        for (size_t s = 0; s < reply->elements; s++) {
            const redisReply *sr = reply->element[s];
            if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 || sr->element[1]->type != REDIS_REPLY_ARRAY)
                continue;
            for (size_t i = 0; i < sr->element[1]->elements; i++) {
                entry *e = outbox__consumer_entry_from_reply(c, sr->element[1]->element[i], 1);
                if (e) {
                    got++;
                    outbox__consumer_dispatch(e);
                }
            }
        }
    }
    if (got == 0 && c->inflight == 0 && !c->retry_head)
        check_drained(c);
    outbox__consumer_kick_read(c);
}

void outbox__consumer_kick_read(outbox_consumer *c)
{
    char count[16], block[24];
    unsigned n;
    int e;
    if (c->state != CS_RUNNING || !c->group_ready || c->reading || !c->rd || !outbox__target_ready(c->rd) ||
        c->checking_drain || c->drained)
        return;
    if (c->inflight >= c->s.max_inflight)
        return;
    n = c->s.max_inflight - (unsigned)c->inflight;
    if (n > c->s.batch)
        n = c->s.batch;
    snprintf(count, sizeof count, "%u", n);
    /* Draining only needs to know whether anything is left. */
    snprintf(block, sizeof block, "%llu", (unsigned long long)(c->s.drain && c->s.block_ms > 100 ? 100 : c->s.block_ms));
    {
        const char *argv[10] = {"XREADGROUP", "GROUP", c->group, c->consumer, "COUNT", count,
                                "BLOCK",      block,   "STREAMS", c->stream};
        const char *all[11];
        size_t lens[11];
        memcpy(all, argv, sizeof argv);
        all[10] = ">";
        for (int i = 0; i < 11; i++)
            lens[i] = strlen(all[i]);
        e = outbox__target_command_key_argv(c->rd, c->stream, 11, all, lens, c->s.block_ms + 10000, on_read, c);
        if (e == 0)
            c->reading = 1;
        else
            read_again_later(c); /* the node is down for the layer's backoff */
    }
}

static void on_group(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    c->group_creating = 0;
    if (status != 0 || (c->cmd && outbox__target_lost(c->cmd, conn, reply))) {
        read_again_later(c); /* routes; a single node's up event creates it on the next connection */
        return;
    }
    if (reply->type == REDIS_REPLY_STATUS || (reply->type == REDIS_REPLY_ERROR && !strncmp(reply->str, "BUSYGROUP", 9))) {
        c->group_ready = 1;
        outbox__consumer_kick_read(c);
    } else if (!plain_url_to_cluster(c, c->cmd, reply)) {
        LOG(c, OUTBOX_LOG_ERROR, "msg=\"cannot create the consumer group\" stream=%s group=%s error=\"%.200s\"",
            c->stream, c->group, reply->type == REDIS_REPLY_ERROR ? reply->str : "unexpected reply");
    }
}

static void ensure_group(outbox_consumer *c)
{
    /* A new group starts at the beginning of the stream: every message the
     * relay published is processed, also those written before the group. */
    const char *argv[6] = {"XGROUP", "CREATE", c->stream, c->group, "0", "MKSTREAM"};
    size_t lens[6];
    if (c->group_ready || c->group_creating || !outbox__consumer_cmd_ready(c))
        return;
    for (int i = 0; i < 6; i++)
        lens[i] = strlen(argv[i]);
    if (outbox__consumer_command(c, c->stream, 6, argv, lens, on_group, c) == 0)
        c->group_creating = 1;
}

void outbox__consumer_on_cmd_up(outbox__target *t, void *data)
{
    (void)t;
    ensure_group(data);
}

void outbox__consumer_on_rd_up(outbox__target *t, void *data)
{
    (void)t;
    outbox__consumer_kick_read(data);
}

/* ------------------------------------------------------------------ */
/* recovery of idle pending entries */

typedef struct claim_ctx {
    outbox_consumer *c;
    entry *e;         /* retry of a known entry, or NULL for XAUTOCLAIM */
    uint64_t deliveries;
    redisReply *claimed;
} claim_ctx;

static void on_pending_count(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    claim_ctx *x = data;
    outbox_consumer *c = x->c;
    uint64_t deliveries = 1;
    entry *e;
    (void)conn;
    /* [[id, consumer, idle, deliveries]] */
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1 &&
        reply->element[0]->type == REDIS_REPLY_ARRAY && reply->element[0]->elements == 4 &&
        reply->element[0]->element[3]->type == REDIS_REPLY_INTEGER)
        deliveries = (uint64_t)reply->element[0]->element[3]->integer;
    if (status == 0 && c->state == CS_RUNNING) {
        e = outbox__consumer_entry_from_reply(c, x->claimed, deliveries);
        if (e) {
            c->st.claimed++;
            LOG(c, OUTBOX_LOG_INFO, "msg=\"recovered an idle pending entry\" entry=%s deliveries=%llu", e->entry_id,
                (unsigned long long)deliveries);
            outbox__consumer_dispatch(e);
        }
    }
    freeReplyObject(x->claimed);
    free(x);
}

static redisReply *reply_copy(const redisReply *r)
{
    /* The module frees replies after the callback; keep what we need by
     * copying the [id, fields] pair into a fresh reply tree. */
    redisReply *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    n->type = r->type;
    n->integer = r->integer;
    if (r->str) {
        n->str = malloc(r->len + 1);
        if (!n->str) {
            free(n);
            return NULL;
        }
        memcpy(n->str, r->str, r->len);
        n->str[r->len] = '\0';
        n->len = r->len;
    }
    if (r->type == REDIS_REPLY_ARRAY && r->elements) {
        n->element = calloc(r->elements, sizeof *n->element);
        if (!n->element) {
            freeReplyObject(n);
            return NULL;
        }
        n->elements = r->elements;
        for (size_t i = 0; i < r->elements; i++)
            if (!(n->element[i] = reply_copy(r->element[i]))) {
                freeReplyObject(n);
                return NULL;
            }
    }
    return n;
}

static void on_autoclaim(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    (void)conn;
    /* [next-cursor, [[id, fields] ...], [deleted ids]] */
    if (status != 0 || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2 ||
        reply->element[0]->type != REDIS_REPLY_STRING || reply->element[1]->type != REDIS_REPLY_ARRAY) {
        if (status == 0 && reply->type == REDIS_REPLY_ERROR)
            LOG(c, OUTBOX_LOG_WARN, "msg=\"XAUTOCLAIM failed\" error=\"%.200s\"", reply->str);
        return;
    }
    snprintf(c->claim_cursor, sizeof c->claim_cursor, "%.*s", (int)reply->element[0]->len, reply->element[0]->str);
    for (size_t i = 0; i < reply->element[1]->elements; i++) {
        const redisReply *er = reply->element[1]->element[i];
        claim_ctx *x;
        if (er->type != REDIS_REPLY_ARRAY || er->elements != 2 || er->element[0]->type != REDIS_REPLY_STRING ||
            outbox__consumer_entry_find(c, er->element[0]->str))
            continue;
        x = calloc(1, sizeof *x);
        if (!x)
            break;
        x->c = c;
        x->claimed = reply_copy(er);
        if (!x->claimed) {
            free(x);
            break;
        }
        {
            const char *argv[7] = {"XPENDING", c->stream, c->group, er->element[0]->str, er->element[0]->str, "1",
                                   c->consumer};
            size_t lens[7];
            for (int k = 0; k < 7; k++)
                lens[k] = strlen(argv[k]);
            if (outbox__consumer_command(c, c->stream, 7, argv, lens, on_pending_count, x) != 0) {
                freeReplyObject(x->claimed);
                free(x);
            }
        }
    }
}

void outbox__consumer_on_claim_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    char idle[24], count[16];
    /* A Redis error answering the group creation or a read (LOADING,
     * MISCONF, NOPERM ...) stops the read loop: retry both from here. */
    ensure_group(c);
    outbox__consumer_kick_read(c);
    if (!outbox__consumer_cmd_ready(c) || !c->group_ready || c->state != CS_RUNNING ||
        c->inflight >= c->s.max_inflight)
        return;
    snprintf(idle, sizeof idle, "%llu", (unsigned long long)c->s.min_idle_ms);
    snprintf(count, sizeof count, "%u", c->s.batch);
    {
        const char *argv[8] = {"XAUTOCLAIM", c->stream, c->group, c->consumer, idle, c->claim_cursor, "COUNT",
                               count};
        size_t lens[8];
        for (int i = 0; i < 8; i++)
            lens[i] = strlen(argv[i]);
        outbox__consumer_command(c, c->stream, 8, argv, lens, on_autoclaim, c);
    }
}

