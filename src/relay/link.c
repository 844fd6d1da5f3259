/*
 * link.c: the relay's Redis, one interface to either a single node (an
 * rconn: redis://, rediss://, unix://, Sentinel) or a Redis Cluster (a
 * cluster.h object: redis-cluster://, rediss-cluster://). publish.c and
 * idem_publish.c send through it and never ask which one it is; the cluster
 * layer decides which node a command goes to.
 *
 * A node is named by an opaque pointer: NULL for the single node, the
 * cluster's node otherwise. WAIT goes to the node that took the XADDs.
 *
 * Some answers say that Redis cannot be used as configured, and asking
 * again will not change them until Redis or the URL is changed: a plain URL
 * that names a cluster node (INFO cluster says cluster_enabled:1 at
 * connect, or a MOVED/ASK/CLUSTERDOWN reply: it would fail message by
 * message), credentials refused (WRONGPASS, NOAUTH: rconn.h, or every node
 * of a cluster), an ACL that forbids a command the relay sends (NOPERM on
 * XADD, EVALSHA, WAIT, or a command of the handshake), no sentinel naming
 * the master. Each is logged once as a configuration error, publishing is
 * held (no message fails one by one: those in flight are released, their
 * attempts not counted), /healthz says why, and the lifecycle hears of it
 * (a drain cannot finish and ends). Publishing resumes once the check is
 * passed: INFO cluster again every 10 s, the next connection accepted, or a
 * batch sent again 10 s later for an ACL (nothing asks Redis what an ACL
 * allows without a permission of its own). Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis/cluster/cluster.h"
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
    const char *host = r->redis.rc.node.host ? r->redis.rc.node.host : r->cfg.url.host;
    int port = r->redis.rc.node.host ? r->redis.rc.node.port : r->cfg.url.port;
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

/* ---- the single node -------------------------------------------------- */

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
    outbox__redis *conn = outbox__rconn_get(&r->redis.rc);
    if (!conn || r->redis.info_pending)
        return;
    r->redis.misconfig_at = uv_now(r->loop);
    if (outbox__redis_command_argv(conn, 2, argv, lens, 0, on_info, r) == 0)
        r->redis.info_pending = 1;
}

static void on_rc_up(outbox__rconn *rc, void *data)
{
    outbox_relay *r = data;
    (void)rc;
    resume(r, LP_REFUSED, "redis accepted the connection");
    check_node(r);
}

static void on_rc_down(outbox__rconn *rc, int status, void *data)
{
    outbox_relay *r = data;
    (void)rc;
    r->redis.info_pending = 0;
    if (r->redis.hooks.down)
        r->redis.hooks.down(r, status);
}

static void on_rc_refused(outbox__rconn *rc, int status, const char *why, void *data)
{
    (void)rc, (void)status;
    hold(data, LP_REFUSED, why);
}

/* ---- the cluster ------------------------------------------------------ */

static void on_cluster_ready(outbox__cluster *c, void *data)
{
    outbox_relay *r = data;
    (void)c;
    resume(r, LP_REFUSED, "a cluster node accepted the connection");
    if (r->redis.hooks.up)
        r->redis.hooks.up(r);
}

static void on_cluster_down(outbox__cluster *c, int status, void *data)
{
    outbox_relay *r = data;
    if (status == OUTBOX_EAUTH) {
        char why[600];
        snprintf(why, sizeof why, "redis refused the credentials (every cluster node tried: %s)",
                 outbox__cluster_errstr(c));
        hold(r, LP_REFUSED, why);
    }
    if (r->redis.hooks.down)
        r->redis.hooks.down(r, status);
}

static void on_node_up(outbox__cluster *c, outbox__cluster_node *n, outbox__redis *conn, void *data)
{
    outbox_relay *r = data;
    (void)c, (void)conn;
    if (r->cfg.s.idempotent)
        outbox__pub_idem_load(r, n);
}

/* ---- the interface ---------------------------------------------------- */

int outbox__link_init(outbox_relay *r, const struct link_hooks *hooks)
{
    outbox__redis_options o;
    outbox__redis_options_defaults(&o);
    o.connect_timeout_ms = r->cfg.s.connect_timeout_ms;
    o.reply_timeout_ms = r->cfg.s.reply_timeout_ms;
    o.client_name = "outbox-relay";
    o.tls = r->cfg.tls; /* the rconn or the cluster takes its own reference */
    r->redis.hooks = *hooks;
    if (r->cfg.url.cluster) {
        outbox__cluster_options co;
        outbox__cluster_hooks ch = {on_cluster_ready, on_cluster_down, on_node_up, r};
        outbox__cluster_options_defaults(&co);
        co.redis = o;
        if (outbox__cluster_create(&r->redis.cluster, r->loop, &r->cfg.url, &co, &r->cfg.log, "relay", &ch) != 0)
            return OUTBOX_ENOMEM;
    } else {
        if (outbox__rconn_init(&r->redis.rc, r->loop, &r->cfg.url, &o, &r->cfg.log, "relay") != 0)
            return OUTBOX_ENOMEM;
        r->redis.rc.on_up = on_rc_up;
        r->redis.rc.on_down = on_rc_down;
        r->redis.rc.on_refused = on_rc_refused;
        r->redis.rc.data = r;
    }
    r->redis.state = RC_INITIALISED;
    return 0;
}

void outbox__link_start(outbox_relay *r)
{
    r->redis.state = RC_STARTED;
    if (r->redis.cluster)
        outbox__cluster_start(r->redis.cluster);
    else
        outbox__rconn_start(&r->redis.rc);
}

void outbox__link_discard(outbox_relay *r)
{
    if (r->redis.state != RC_INITIALISED)
        return;
    if (r->redis.cluster)
        outbox__cluster_close(r->redis.cluster, NULL, NULL); /* never started: freed at once */
    else
        outbox__rconn_discard(&r->redis.rc);
    r->redis.cluster = NULL;
    r->redis.state = RC_NONE;
}

int outbox__link_up(const outbox_relay *r)
{
    if (r->redis.state != RC_STARTED)
        return 0;
    if (r->redis.problem != LP_NONE)
        return 0;
    if (r->redis.cluster)
        return !r->redis.cluster_closing && outbox__cluster_reachable(r->redis.cluster);
    return outbox__rconn_get(&r->redis.rc) != NULL && !r->redis.info_pending;
}

const char *outbox__link_problem(const outbox_relay *r)
{
    return r->redis.problem != LP_NONE ? r->redis.misconfig : NULL;
}

void outbox__link_check(outbox_relay *r)
{
    if (r->redis.state != RC_STARTED || uv_now(r->loop) - r->redis.misconfig_at < RECHECK_MS)
        return;
    if (r->redis.problem == LP_CLUSTER_NODE && !r->redis.cluster) {
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
    if (node)
        *node = NULL;
    if (!outbox__link_up(r))
        return OUTBOX_ECLOSED;
    if (r->redis.cluster) {
        /* The stream's name decides the slot: its key, its markers. */
        char stream[512];
        int n = snprintf(stream, sizeof stream, "%s%s", r->cfg.stream_prefix, topic);
        outbox__cluster_node *where = NULL;
        int e;
        if (n < 0 || (size_t)n >= sizeof stream)
            return OUTBOX_EINVAL;
        e = outbox__cluster_command_raw(r->redis.cluster, stream, (size_t)n, cmd, len, 0, cb, data, &where);
        if (e == 0 && node)
            *node = where;
        return e;
    }
    return outbox__redis_command_raw(outbox__rconn_get(&r->redis.rc), cmd, len, 0, cb, data);
}

int outbox__link_node_argv(outbox_relay *r, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    if (r->redis.state != RC_STARTED)
        return OUTBOX_ECLOSED;
    if (r->redis.cluster)
        return node ? outbox__cluster_node_command_argv(r->redis.cluster, node, argc, argv, lens, timeout_ms, cb, data)
                    : OUTBOX_EINVAL;
    if (!outbox__rconn_get(&r->redis.rc))
        return OUTBOX_ECLOSED;
    return outbox__redis_command_argv(outbox__rconn_get(&r->redis.rc), argc, argv, lens, timeout_ms, cb, data);
}

void *outbox__link_node_of(const outbox_relay *r, const outbox__redis *conn)
{
    return r->redis.cluster && !r->redis.cluster_closing ? outbox__cluster_node_of(r->redis.cluster, conn) : NULL;
}

static int is_word(const redisReply *reply, const char *w)
{
    size_t n = strlen(w);
    return reply->len > n && memcmp(reply->str, w, n) == 0 && reply->str[n] == ' ';
}

int outbox__link_lost(outbox_relay *r, const outbox__redis *conn, const redisReply *reply)
{
    if (!reply)
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
    if (r->redis.cluster)
        return 0; /* the cluster layer handled redirections already */
    if (is_word(reply, "MOVED") || is_word(reply, "ASK") || is_word(reply, "CLUSTERDOWN")) {
        char how[40];
        snprintf(how, sizeof how, "a %.*s reply", (int)(strchr(reply->str, ' ') - reply->str < 20 ? strchr(reply->str, ' ') - reply->str : 20), reply->str);
        cluster_problem(r, how);
        return 1; /* not executed: the message is released, not failed */
    }
    return outbox__rconn_redirect_error(&r->redis.rc, conn, reply);
}

void outbox__link_hold(outbox_relay *r)
{
    if (!r->redis.cluster)
        outbox__rconn_hold(&r->redis.rc);
}

void outbox__link_reset(outbox_relay *r, const char *why)
{
    if (r->redis.cluster)
        outbox__cluster_reset(r->redis.cluster, why);
    else
        outbox__rconn_reset(&r->redis.rc, why);
}

void outbox__link_close(outbox_relay *r, void (*cb)(void *data), void *data)
{
    if (r->redis.cluster) {
        outbox__cluster *c = r->redis.cluster;
        r->redis.cluster_closing = 1;
        outbox__cluster_close(c, cb, data);
    } else {
        outbox__rconn_close(&r->redis.rc, cb, data);
    }
}

size_t outbox__link_nodes(const outbox_relay *r, outbox__cluster_node_stats *st, size_t n, uint64_t *refreshes,
                          uint64_t *refresh_failed)
{
    if (!r->redis.cluster || r->redis.cluster_closing) {
        *refreshes = *refresh_failed = 0;
        return 0;
    }
    *refreshes = outbox__cluster_refreshes(r->redis.cluster, refresh_failed);
    return outbox__cluster_node_stats_get(r->redis.cluster, st, n);
}
