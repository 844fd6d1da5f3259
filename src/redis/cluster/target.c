/*
 * cluster/target.c: the target (redis/target.h) of a Redis Cluster, over
 * the cluster layer (cluster.h), which routes each command by its key's
 * slot and follows redirections; and outbox__target_create, the factory
 * that picks the implementation for a URL (cluster/target.h says why it is
 * here). Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis/cluster/cluster.h"
#include "redis/cluster/target.h"

typedef struct cluster_target {
    outbox__target t; /* first: the interface's part */
    outbox__cluster *cl;
    void (*close_cb)(void *data);
    void *close_data;
} cluster_target;

#define CT(t) ((cluster_target *)(t))
#define CCT(t) ((const cluster_target *)(t))

static void on_ready(outbox__cluster *cl, void *data)
{
    cluster_target *ct = data;
    (void)cl;
    if (ct->t.hooks.up)
        ct->t.hooks.up(&ct->t, ct->t.hooks.data);
}

static void on_down(outbox__cluster *cl, int status, void *data)
{
    cluster_target *ct = data;
    if (status == OUTBOX_EAUTH && ct->t.hooks.refused) {
        char why[600];
        snprintf(why, sizeof why, "redis refused the credentials (every cluster node tried: %s)",
                 outbox__cluster_errstr(cl));
        ct->t.hooks.refused(&ct->t, status, why, ct->t.hooks.data);
    }
    if (!ct->t.closing && ct->t.hooks.down)
        ct->t.hooks.down(&ct->t, status, ct->t.hooks.data);
}

static void on_node_up(outbox__cluster *cl, outbox__cluster_node *n, outbox__redis *conn, void *data)
{
    cluster_target *ct = data;
    (void)cl, (void)conn;
    if (ct->t.hooks.node_up)
        ct->t.hooks.node_up(&ct->t, n, ct->t.hooks.data);
}

static void ct_start(outbox__target *t)
{
    outbox__cluster_start(CT(t)->cl);
}

static int ct_ready(const outbox__target *t)
{
    return outbox__cluster_ready(CCT(t)->cl);
}

static int ct_reachable(const outbox__target *t)
{
    return outbox__cluster_reachable(CCT(t)->cl);
}

static int ct_command_key(outbox__target *t, const char *key, size_t klen, const char *cmd, size_t len,
                          uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, void **node)
{
    outbox__cluster_node *where = NULL;
    int e = outbox__cluster_command_raw(CT(t)->cl, key, klen, cmd, len, timeout_ms, cb, data, &where);
    if (e == 0 && node)
        *node = where;
    return e;
}

static int ct_command_key_argv(outbox__target *t, const char *key, size_t klen, int argc, const char **argv,
                               const size_t *lens, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    return outbox__cluster_command_argv(CT(t)->cl, key, klen, argc, argv, lens, timeout_ms, cb, data, NULL);
}

static int ct_command_node(outbox__target *t, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    if (!node)
        return OUTBOX_EINVAL;
    return outbox__cluster_node_command_argv(CT(t)->cl, node, argc, argv, lens, timeout_ms, cb, data);
}

static void *ct_node_of(const outbox__target *t, const outbox__redis *conn)
{
    return outbox__cluster_node_of(CCT(t)->cl, conn);
}

static int ct_serves(const outbox__target *t, const void *node)
{
    (void)t;
    return outbox__cluster_node_serves(node);
}

static int ct_lost(outbox__target *t, const outbox__redis *conn, const redisReply *reply)
{
    (void)t, (void)conn, (void)reply;
    return 0; /* the layer followed the redirections already */
}

static int ct_misrouted(const outbox__target *t, const redisReply *reply)
{
    (void)t, (void)reply;
    return 0;
}

static int starts_with(const redisReply *reply, const char *word)
{
    size_t n = strlen(word);
    return reply->len >= n && memcmp(reply->str, word, n) == 0;
}

static int ct_unavailable(const outbox__target *t, const redisReply *reply)
{
    static const char *const given_up[] = {"CLUSTERDOWN", "TRYAGAIN", "LOADING",       "READONLY",
                                           "MOVED",       "ASK",      "redirect loop", "malformed"};
    (void)t;
    for (size_t i = 0; i < sizeof given_up / sizeof given_up[0]; i++)
        if (starts_with(reply, given_up[i]))
            return 1;
    return 0;
}

static const outbox__redis_url *ct_node_url(const outbox__target *t)
{
    (void)t;
    return NULL;
}

static void ct_refresh(outbox__target *t)
{
    outbox__cluster_refresh(CT(t)->cl);
}

static void ct_hold(outbox__target *t)
{
    (void)t; /* nodes connect on demand: nothing reconnects by itself */
}

static void ct_reset(outbox__target *t, const char *why)
{
    outbox__cluster_reset(CT(t)->cl, why);
}

static size_t ct_nodes(const outbox__target *t, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                       uint64_t *refresh_failed)
{
    *refreshes = outbox__cluster_refreshes(CCT(t)->cl, refresh_failed);
    return outbox__cluster_node_stats_get(CCT(t)->cl, st, n);
}

static void ct_closed(void *data)
{
    cluster_target *ct = data;
    void (*cb)(void *) = ct->close_cb;
    void *cbdata = ct->close_data;
    free(ct);
    if (cb)
        cb(cbdata);
}

static void ct_close(outbox__target *t, void (*cb)(void *data), void *data)
{
    cluster_target *ct = CT(t);
    ct->close_cb = cb;
    ct->close_data = data;
    outbox__cluster_close(ct->cl, ct_closed, ct); /* never started: freed at once */
}

static const struct outbox__target_ops cluster_ops = {
    .kind = "cluster",
    .flags = OUTBOX__TARGET_ROUTES,
    .start = ct_start,
    .ready = ct_ready,
    .reachable = ct_reachable,
    .command_key = ct_command_key,
    .command_key_argv = ct_command_key_argv,
    .command_node = ct_command_node,
    .node_of = ct_node_of,
    .serves = ct_serves,
    .lost = ct_lost,
    .misrouted = ct_misrouted,
    .unavailable = ct_unavailable,
    .node_url = ct_node_url,
    .refresh = ct_refresh,
    .hold = ct_hold,
    .reset = ct_reset,
    .nodes = ct_nodes,
    .close = ct_close,
};

int outbox__target_cluster_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                                  const outbox__target_options *opt, const outbox__target_hooks *hooks)
{
    cluster_target *ct;
    outbox__cluster_options co;
    outbox__cluster_hooks ch = {on_ready, on_down, on_node_up, NULL};
    int e;
    *out = NULL;
    if (!url->cluster)
        return OUTBOX_EINVAL;
    if (!(ct = calloc(1, sizeof *ct)))
        return OUTBOX_ENOMEM;
    outbox__cluster_options_defaults(&co);
    co.redis = opt->redis;
    /* A node's connection carries the blocked commands and the layer's own
     * (its map refreshes) alike: those may wait behind a blocked command
     * for up to its block, which must not count as the connection timing
     * out. */
    co.redis.reply_timeout_ms += opt->blocking_ms;
    ch.data = ct;
    e = outbox__cluster_create(&ct->cl, loop, url, &co, opt->log, opt->what ? opt->what : "redis", &ch);
    if (e != 0) {
        free(ct);
        return e;
    }
    ct->t.ops = &cluster_ops;
    if (hooks)
        ct->t.hooks = *hooks;
    *out = &ct->t;
    return 0;
}

int outbox__target_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                          const outbox__target_options *opt, const outbox__target_hooks *hooks)
{
    return url->cluster ? outbox__target_cluster_create(out, loop, url, opt, hooks)
                        : outbox__target_node_create(out, loop, url, opt, hooks);
}
