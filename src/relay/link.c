/*
 * link.c: the relay's Redis, over a target (src/redis/target.h): a single
 * node (redis://, rediss://, unix://), Sentinel or a Redis Cluster
 * (redis-cluster://, rediss-cluster://), created for the URL by
 * outbox__target_create. publish.c and idem_publish.c send through the link
 * and never ask which one it is; the target decides which node a command
 * goes to.
 *
 * A node is named by an opaque pointer: NULL for the single node, the
 * cluster's node otherwise. WAIT goes to the node that took the XADDs.
 *
 * Some answers say that Redis cannot be used as configured, and asking
 * again will not change them until Redis or the URL is changed: a plain URL
 * that names a cluster node (INFO cluster says cluster_enabled:1 at
 * connect, or a MOVED/ASK/CLUSTERDOWN reply: it would fail message by
 * message), credentials refused (WRONGPASS, NOAUTH, or every node of a
 * cluster: the target's refused hook), an ACL that forbids a command the
 * relay sends (NOPERM on XADD, EVALSHA, WAIT, or a command of the
 * handshake), no sentinel naming the master. Each is logged once as a
 * configuration error, publishing is held (no message fails one by one:
 * those in flight are released, their attempts not counted), /healthz says
 * why, and the lifecycle hears of it (a drain cannot finish and ends).
 * Publishing resumes once the check is passed: INFO cluster again every
 * 10 s, the next connection accepted, or a batch sent again 10 s later for
 * an ACL (nothing asks Redis what an ACL allows without a permission of its
 * own). Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis/cluster/target.h"
#include "relay_int.h"

#define RECHECK_MS 10000

/* Publishing is held: kind, and why (Redis's words included). */
static void hold(outbox_relay *r, enum link_problem_kind kind, const char *why)
{
    uint64_t now = uv_now(r->loop);
    r->redis.problem = kind;
    r->redis.acl_probe = 0;
    outbox__strlcpy(r->redis.misconfig, why, sizeof r->redis.misconfig);
    /* It goes into log lines and /healthz between double quotes. */
    for (char *p = r->redis.misconfig; *p; p++)
        if (*p == '"' || *p == '\n' || *p == '\r')
            *p = '\'';
    r->redis.misconfig_at = now;
    /* Once, and again at most once a minute while it lasts (a node that
     * answers INFO as a plain node but MOVED to commands flips back and
     * forth at every check). */
    if (!r->redis.misconfig_logged || now - r->redis.misconfig_logged >= 60000) {
        r->redis.misconfig_logged = now ? now : 1;
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"publishing held: %s\" redis=%s", r->redis.misconfig, r->cfg.url_desc);
    }
    if (r->redis.hooks.problem)
        r->redis.hooks.problem(r);
}

/* The problem of that kind is over (what: the log's words). */
static void resume(outbox_relay *r, enum link_problem_kind kind, const char *what)
{
    if (r->redis.problem != kind)
        return;
    LOG(r, OUTBOX_LOG_INFO, "msg=\"publishing resumed: %s\"", what);
    r->redis.problem = LP_NONE;
    r->redis.misconfig[0] = '\0';
}

static void cluster_problem(outbox_relay *r, const char *how)
{
    char url[200], why[400];
    const outbox__redis_url *node = outbox__target_node_url(r->redis.target);
    const char *host = node ? node->host : NULL;
    int port = node ? node->port : 0;
    if (host)
        snprintf(url, sizeof url, "%s://%s%s%s:%d", r->cfg.url.tls ? "rediss-cluster" : "redis-cluster",
                 strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", port);
    else
        snprintf(url, sizeof url, "redis-cluster://host:port");
    snprintf(why, sizeof why, "the Redis URL names a Redis Cluster node (%s): use a cluster URL, %s", how, url);
    hold(r, LP_CLUSTER_NODE, why);
}

/* An error reply saying that the user may not run the command at all
 * (Redis 7.0: "NOPERM this user has no permissions to run the 'xadd'
 * command"; inside a script: "ERR The user executing the script can't run
 * this command or subcommand ..."). A key the ACL does not cover ("NOPERM
 * ... access one of the keys") is not one: other topics' streams may be
 * allowed, so such a message fails on its own. */
static int acl_refusal(const redisReply *reply)
{
    return reply->str && (strstr(reply->str, "no permissions to run") != NULL ||
                          strstr(reply->str, "can't run this command or subcommand") != NULL);
}

/* ---- the check that a plain URL does not name a cluster node ---------- */

static void on_info(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_relay *r = data;
    int cluster;
    (void)conn;
    r->redis.info_pending = 0;
    if (r->redis.state != RC_STARTED)
        return;
    cluster = status == 0 && reply && reply->type == REDIS_REPLY_STRING && strstr(reply->str, "cluster_enabled:1");
    if (cluster) {
        cluster_problem(r, "cluster_enabled:1");
        return;
    }
    if (status != 0)
        return; /* the connection is gone: the next one checks again */
    resume(r, LP_CLUSTER_NODE, "the node is not a cluster node any more");
    if (r->redis.hooks.up)
        r->redis.hooks.up(r);
}

/* Asks whether the node is a cluster node; the relay is up once it is not
 * (an INFO refused by an ACL counts as not). */
static void check_node(outbox_relay *r)
{
    const char *argv[2] = {"INFO", "cluster"};
    size_t lens[2] = {4, 7};
    if (!outbox__target_ready(r->redis.target) || r->redis.info_pending)
        return;
    r->redis.misconfig_at = uv_now(r->loop);
    if (outbox__target_command_node(r->redis.target, NULL, 2, argv, lens, 0, on_info, r) == 0)
        r->redis.info_pending = 1;
}

/* ---- the target's events ---------------------------------------------- */

/* Up: a target that routes (a cluster) has its slot map; one that does not
 * is up for the relay once INFO says its node is not a cluster node. */
static void on_target_up(outbox__target *t, void *data)
{
    outbox_relay *r = data;
    resume(r, LP_REFUSED, outbox__target_routes(t) ? "a cluster node accepted the connection"
                                                    : "redis accepted the connection");
    if (!outbox__target_routes(t))
        check_node(r);
    else if (r->redis.hooks.up)
        r->redis.hooks.up(r);
}

static void on_target_down(outbox__target *t, int status, void *data)
{
    outbox_relay *r = data;
    (void)t;
    r->redis.info_pending = 0;
    if (r->redis.hooks.down)
        r->redis.hooks.down(r, status);
}

static void on_target_node_up(outbox__target *t, void *node, void *data)
{
    outbox_relay *r = data;
    (void)t;
    if (r->redis.hooks.node_up)
        r->redis.hooks.node_up(r, node);
}

static void on_target_refused(outbox__target *t, int status, const char *why, void *data)
{
    (void)t, (void)status;
    hold(data, LP_REFUSED, why);
}

/* ---- the interface ---------------------------------------------------- */

int outbox__link_init(outbox_relay *r, const struct link_hooks *hooks)
{
    outbox__target_options o;
    outbox__target_hooks th = {on_target_up, on_target_down, on_target_node_up, on_target_refused, r};
    outbox__target_options_defaults(&o);
    o.redis.connect_timeout_ms = r->cfg.s.connect_timeout_ms;
    o.redis.reply_timeout_ms = r->cfg.s.reply_timeout_ms;
    o.redis.client_name = "outbox-relay";
    o.redis.tls = r->cfg.tls; /* the target takes its own reference */
    o.log = &r->cfg.log;
    o.what = "relay";
    r->redis.hooks = *hooks;
    if (outbox__target_create(&r->redis.target, r->loop, &r->cfg.url, &o, &th) != 0)
        return OUTBOX_ENOMEM;
    r->redis.routes = outbox__target_routes(r->redis.target);
    r->redis.state = RC_INITIALISED;
    return 0;
}

void outbox__link_start(outbox_relay *r)
{
    r->redis.state = RC_STARTED;
    outbox__target_start(r->redis.target);
}

void outbox__link_discard(outbox_relay *r)
{
    if (r->redis.state != RC_INITIALISED)
        return;
    outbox__target_close(r->redis.target, NULL, NULL); /* never started: freed at once */
    r->redis.target = NULL;
    r->redis.state = RC_NONE;
}

int outbox__link_up(const outbox_relay *r)
{
    if (r->redis.state != RC_STARTED || !r->redis.target)
        return 0;
    if (r->redis.problem != LP_NONE)
        return 0;
    return outbox__target_reachable(r->redis.target) && !r->redis.info_pending;
}

int outbox__link_routes(const outbox_relay *r)
{
    return r->redis.routes;
}

const char *outbox__link_problem(const outbox_relay *r)
{
    return r->redis.problem != LP_NONE ? r->redis.misconfig : NULL;
}

void outbox__link_check(outbox_relay *r)
{
    if (r->redis.state != RC_STARTED || uv_now(r->loop) - r->redis.misconfig_at < RECHECK_MS)
        return;
    if (r->redis.problem == LP_CLUSTER_NODE) {
        check_node(r);
    } else if (r->redis.problem == LP_ACL) {
        /* The next batch tries: refused again, it is held again (and
         * logged at most once a minute); accepted, it is over. */
        r->redis.problem = LP_NONE;
        r->redis.misconfig[0] = '\0';
        r->redis.acl_probe = 1;
    }
}

int outbox__link_send(outbox_relay *r, const char *topic, const char *cmd, size_t len, outbox__redis_reply_cb cb,
                      void *data, void **node)
{
    /* The stream's name decides the slot: its key, its markers. */
    char stream[512];
    size_t pl, tl;
    if (node)
        *node = NULL;
    if (!outbox__link_up(r))
        return OUTBOX_ECLOSED;
    /* Two copies, not snprintf: this runs once per message, and glibc's
     * snprintf of "%s%s" cost about 850 instructions here, 6 % of all the
     * relay's work per message (docs/BENCHMARKS.md). */
    pl = strlen(r->cfg.stream_prefix);
    tl = strlen(topic);
    if (pl + tl >= sizeof stream)
        return OUTBOX_EINVAL;
    memcpy(stream, r->cfg.stream_prefix, pl);
    memcpy(stream + pl, topic, tl + 1);
    return outbox__target_command_key(r->redis.target, stream, pl + tl, cmd, len, 0, cb, data, node);
}

int outbox__link_node_argv(outbox_relay *r, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    if (r->redis.state != RC_STARTED || !r->redis.target)
        return OUTBOX_ECLOSED;
    return outbox__target_command_node(r->redis.target, node, argc, argv, lens, timeout_ms, cb, data);
}

void *outbox__link_node_of(const outbox_relay *r, const outbox__redis *conn)
{
    return r->redis.target && !r->redis.closing ? outbox__target_node_of(r->redis.target, conn) : NULL;
}

int outbox__link_lost(outbox_relay *r, const outbox__redis *conn, const redisReply *reply)
{
    if (!reply || !r->redis.target)
        return 0;
    if (reply->type != REDIS_REPLY_ERROR) {
        if (r->redis.acl_probe) {
            r->redis.acl_probe = 0;
            LOG(r, OUTBOX_LOG_INFO, "msg=\"publishing resumed: redis accepted a command the ACL refused before\"");
        }
        return 0;
    }
    if (acl_refusal(reply)) {
        char why[400];
        snprintf(why, sizeof why, "the ACL forbids a command the relay sends (%.300s)", reply->str);
        hold(r, LP_ACL, why);
        return 1; /* not executed: the message is released, not failed */
    }
    if (outbox__target_misrouted(r->redis.target, reply)) {
        char how[40];
        snprintf(how, sizeof how, "a %.*s reply", (int)(strchr(reply->str, ' ') - reply->str < 20 ? strchr(reply->str, ' ') - reply->str : 20), reply->str);
        cluster_problem(r, how);
        return 1; /* not executed: the message is released, not failed */
    }
    return outbox__target_lost(r->redis.target, conn, reply);
}

void outbox__link_hold(outbox_relay *r)
{
    if (r->redis.target && !r->redis.closing)
        outbox__target_hold(r->redis.target);
}

void outbox__link_reset(outbox_relay *r, const char *why)
{
    if (r->redis.target && !r->redis.closing)
        outbox__target_reset(r->redis.target, why);
}

static void on_target_closed(void *data)
{
    outbox_relay *r = data;
    r->redis.target = NULL;
    if (r->redis.close_cb)
        r->redis.close_cb(r->redis.close_data);
}

void outbox__link_close(outbox_relay *r, void (*cb)(void *data), void *data)
{
    r->redis.closing = 1;
    r->redis.close_cb = cb;
    r->redis.close_data = data;
    outbox__target_close(r->redis.target, on_target_closed, r);
}

size_t outbox__link_nodes(const outbox_relay *r, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                          uint64_t *refresh_failed)
{
    if (!r->redis.target || r->redis.closing) {
        *refreshes = *refresh_failed = 0;
        return 0;
    }
    return outbox__target_nodes(r->redis.target, st, n, refreshes, refresh_failed);
}
