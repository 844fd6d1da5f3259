/*
 * target.c: the interface of target.h, calling through each target's table
 * of operations, and the URL and TLS set-up every owner of a target does.
 * Loop thread.
 */
#include <stdio.h>
#include <string.h>

#include "redis/sentinel.h"
#include "redis/target.h"

void outbox__target_options_defaults(outbox__target_options *o)
{
    memset(o, 0, sizeof *o);
    outbox__redis_options_defaults(&o->redis);
}

int outbox__target_url_setup(const char *text, const char *sentinel_user, const char *sentinel_password,
                             const outbox_tls_settings *tls, outbox__redis_url *url, outbox__tls_config **cfg,
                             char *err, size_t errlen)
{
    char msg[600];
    int e;
    *cfg = NULL;
    e = outbox__sentinel_url_parse(text, sentinel_user, sentinel_password, url, msg, sizeof msg);
    if (e != 0)
        return outbox__errf(err, errlen, e, "redis: %s", msg);
    e = tls ? outbox__tls_config_for_url(url->tls, tls, cfg, msg, sizeof msg) : 0;
    if (e != 0) {
        outbox__redis_url_free(url);
        return outbox__errf(err, errlen, e, "tls: %s", msg);
    }
    return 0;
}

void outbox__target_start(outbox__target *t)
{
    if (t->started || t->closing)
        return;
    t->started = 1;
    t->ops->start(t);
}

int outbox__target_ready(const outbox__target *t)
{
    return !t->closing && t->ops->ready(t);
}

int outbox__target_reachable(const outbox__target *t)
{
    return !t->closing && t->ops->reachable(t);
}

int outbox__target_routes(const outbox__target *t)
{
    return (t->ops->flags & OUTBOX__TARGET_ROUTES) != 0;
}

int outbox__target_command_key(outbox__target *t, const char *key, size_t klen, const char *cmd, size_t len,
                               uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, void **node)
{
    if (node)
        *node = NULL;
    if (t->closing)
        return OUTBOX_ECLOSED;
    return t->ops->command_key(t, key, klen, cmd, len, timeout_ms, cb, data, node);
}

int outbox__target_command_key_argv(outbox__target *t, const char *key, int argc, const char **argv,
                                    const size_t *lens, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    if (t->closing)
        return OUTBOX_ECLOSED;
    return t->ops->command_key_argv(t, key, strlen(key), argc, argv, lens, timeout_ms, cb, data);
}

int outbox__target_command_node(outbox__target *t, void *node, int argc, const char **argv, const size_t *lens,
                                uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    if (t->closing)
        return OUTBOX_ECLOSED;
    return t->ops->command_node(t, node, argc, argv, lens, timeout_ms, cb, data);
}

void *outbox__target_node_of(const outbox__target *t, const outbox__redis *conn)
{
    return t->closing ? NULL : t->ops->node_of(t, conn);
}

int outbox__target_serves(const outbox__target *t, const void *node)
{
    return !t->closing && t->ops->serves(t, node);
}

int outbox__target_lost(outbox__target *t, const outbox__redis *conn, const redisReply *reply)
{
    if (!reply || reply->type != REDIS_REPLY_ERROR || !reply->str)
        return 0;
    return t->ops->lost(t, conn, reply);
}

int outbox__target_misrouted(const outbox__target *t, const redisReply *reply)
{
    if (!reply || reply->type != REDIS_REPLY_ERROR || !reply->str)
        return 0;
    return t->ops->misrouted(t, reply);
}

int outbox__target_unavailable(const outbox__target *t, const redisReply *reply)
{
    if (!reply || reply->type != REDIS_REPLY_ERROR || !reply->str)
        return 0;
    return t->ops->unavailable(t, reply);
}

const outbox__redis_url *outbox__target_node_url(const outbox__target *t)
{
    return t->ops->node_url(t);
}

void outbox__target_refresh(outbox__target *t)
{
    if (t->started && !t->closing)
        t->ops->refresh(t);
}

void outbox__target_hold(outbox__target *t)
{
    if (t->started && !t->closing)
        t->ops->hold(t);
}

void outbox__target_reset(outbox__target *t, const char *why)
{
    if (t->started && !t->closing)
        t->ops->reset(t, why);
}

size_t outbox__target_nodes(const outbox__target *t, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                            uint64_t *refresh_failed)
{
    *refreshes = *refresh_failed = 0;
    if (t->closing)
        return 0;
    return t->ops->nodes(t, st, n, refreshes, refresh_failed);
}

void outbox__target_close(outbox__target *t, void (*cb)(void *data), void *data)
{
    if (!t || t->closing)
        return;
    t->closing = 1;
    t->ops->close(t, cb, data);
}
