/*
 * target_node.c: the target (target.h) of a single node or of the master
 * that Sentinel names, over an rconn (rconn.h): one connection, kept
 * connected. Every command goes to it, whatever its key; its one node is
 * named NULL. Loop thread.
 */
#include <stdlib.h>
#include <string.h>

#include "redis/rconn.h"
#include "redis/target.h"

typedef struct node_target {
    outbox__target t; /* first: the interface's part */
    outbox__rconn rc;
    void (*close_cb)(void *data);
    void *close_data;
} node_target;

#define NT(t) ((node_target *)(t))
#define CNT(t) ((const node_target *)(t))

static void on_rc_up(outbox__rconn *rc, void *data)
{
    node_target *nt = data;
    (void)rc;
    if (nt->t.hooks.node_up)
        nt->t.hooks.node_up(&nt->t, NULL, nt->t.hooks.data);
    /* node_up may have closed the target: then no up. */
    if (!nt->t.closing && nt->t.hooks.up)
        nt->t.hooks.up(&nt->t, nt->t.hooks.data);
}

static void on_rc_down(outbox__rconn *rc, int status, void *data)
{
    node_target *nt = data;
    (void)rc;
    if (nt->t.hooks.down)
        nt->t.hooks.down(&nt->t, status, nt->t.hooks.data);
}

static void on_rc_refused(outbox__rconn *rc, int status, const char *why, void *data)
{
    node_target *nt = data;
    (void)rc;
    if (nt->t.hooks.refused)
        nt->t.hooks.refused(&nt->t, status, why, nt->t.hooks.data);
}

static void nt_start(outbox__target *t)
{
    outbox__rconn_start(&NT(t)->rc);
}

static int nt_ready(const outbox__target *t)
{
    return outbox__rconn_get(&CNT(t)->rc) != NULL;
}

static int nt_command_key(outbox__target *t, const char *key, size_t klen, const char *cmd, size_t len,
                          uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, void **node)
{
    outbox__redis *conn = outbox__rconn_get(&NT(t)->rc);
    (void)key, (void)klen, (void)node;
    if (!conn)
        return OUTBOX_ECONNECT;
    return outbox__redis_command_raw(conn, cmd, len, timeout_ms, cb, data);
}

static int nt_command_key_argv(outbox__target *t, const char *key, size_t klen, int argc, const char **argv,
                               const size_t *lens, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    outbox__redis *conn = outbox__rconn_get(&NT(t)->rc);
    (void)key, (void)klen;
    if (!conn)
        return OUTBOX_ECONNECT;
    return outbox__redis_command_argv(conn, argc, argv, lens, timeout_ms, cb, data);
}

static int nt_command_node(outbox__target *t, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    outbox__redis *conn = outbox__rconn_get(&NT(t)->rc);
    (void)node;
    if (!conn)
        return OUTBOX_ECLOSED;
    return outbox__redis_command_argv(conn, argc, argv, lens, timeout_ms, cb, data);
}

static void *nt_node_of(const outbox__target *t, const outbox__redis *conn)
{
    (void)t, (void)conn;
    return NULL;
}

/* The one node is the master while its connection lasts (a Sentinel
 * switch drops it). */
static int nt_serves(const outbox__target *t, const void *node)
{
    (void)t, (void)node;
    return 1;
}

static int nt_lost(outbox__target *t, const outbox__redis *conn, const redisReply *reply)
{
    return outbox__rconn_redirect_error(&NT(t)->rc, conn, reply);
}

static int is_word(const redisReply *reply, const char *w)
{
    size_t n = strlen(w);
    return reply->len > n && memcmp(reply->str, w, n) == 0 && reply->str[n] == ' ';
}

static int nt_misrouted(const outbox__target *t, const redisReply *reply)
{
    (void)t;
    return is_word(reply, "MOVED") || is_word(reply, "ASK") || is_word(reply, "CLUSTERDOWN");
}

static int nt_unavailable(const outbox__target *t, const redisReply *reply)
{
    (void)t, (void)reply;
    return 0;
}

static const outbox__redis_url *nt_node_url(const outbox__target *t)
{
    const node_target *nt = CNT(t);
    return nt->rc.node.host ? &nt->rc.node : &nt->rc.url;
}

static void nt_refresh(outbox__target *t)
{
    (void)t;
}

static void nt_hold(outbox__target *t)
{
    outbox__rconn_hold(&NT(t)->rc);
}

static void nt_reset(outbox__target *t, const char *why)
{
    outbox__rconn_reset(&NT(t)->rc, why);
}

static size_t nt_nodes(const outbox__target *t, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                       uint64_t *refresh_failed)
{
    (void)t, (void)st, (void)n, (void)refreshes, (void)refresh_failed;
    return 0;
}

static void nt_closed(void *data)
{
    node_target *nt = data;
    void (*cb)(void *) = nt->close_cb;
    void *cbdata = nt->close_data;
    free(nt);
    if (cb)
        cb(cbdata);
}

static void nt_close(outbox__target *t, void (*cb)(void *data), void *data)
{
    node_target *nt = NT(t);
    nt->close_cb = cb;
    nt->close_data = data;
    if (!t->started) {
        outbox__rconn_discard(&nt->rc);
        nt_closed(nt);
        return;
    }
    outbox__rconn_close(&nt->rc, nt_closed, nt);
}

static const struct outbox__target_ops node_ops = {
    .kind = "node",
    .flags = 0,
    .start = nt_start,
    .ready = nt_ready,
    .reachable = nt_ready,
    .command_key = nt_command_key,
    .command_key_argv = nt_command_key_argv,
    .command_node = nt_command_node,
    .node_of = nt_node_of,
    .serves = nt_serves,
    .lost = nt_lost,
    .misrouted = nt_misrouted,
    .unavailable = nt_unavailable,
    .node_url = nt_node_url,
    .refresh = nt_refresh,
    .hold = nt_hold,
    .reset = nt_reset,
    .nodes = nt_nodes,
    .close = nt_close,
};

int outbox__target_node_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                               const outbox__target_options *opt, const outbox__target_hooks *hooks)
{
    node_target *nt;
    int e;
    *out = NULL;
    if (url->cluster)
        return OUTBOX_EINVAL;
    if (!(nt = calloc(1, sizeof *nt)))
        return OUTBOX_ENOMEM;
    /* On a single node nothing of the target's own waits behind a blocked
     * command (the ROLE check comes before anything is sent): blocking_ms
     * changes nothing here. */
    e = outbox__rconn_init(&nt->rc, loop, url, &opt->redis, opt->log, opt->what ? opt->what : "redis");
    if (e != 0) {
        outbox__rconn_discard(&nt->rc);
        free(nt);
        return e;
    }
    nt->t.ops = &node_ops;
    if (hooks)
        nt->t.hooks = *hooks;
    nt->rc.on_up = on_rc_up;
    nt->rc.on_down = on_rc_down;
    nt->rc.on_refused = on_rc_refused;
    nt->rc.data = nt;
    *out = &nt->t;
    return 0;
}
