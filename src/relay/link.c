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

#define LLOG(l, lvl, ...) outbox__log((l)->log, (lvl), __VA_ARGS__)

/* ---- the relays that hear the link's events --------------------------- */

static int subscribe(struct relay_link *l, outbox_relay *r)
{
    if (l->nsubs == l->subs_cap) {
        size_t cap = l->subs_cap ? l->subs_cap * 2 : 8;
        outbox_relay **n = realloc(l->subs, cap * sizeof *n);
        if (!n)
            return OUTBOX_ENOMEM;
        l->subs = n;
        l->subs_cap = cap;
    }
    l->subs[l->nsubs++] = r;
    return 0;
}

static void compact(struct relay_link *l)
{
    size_t i, j = 0;
    for (i = 0; i < l->nsubs; i++)
        if (l->subs[i])
            l->subs[j++] = l->subs[i];
    l->nsubs = j;
}

static void unsubscribe(struct relay_link *l, outbox_relay *r)
{
    size_t i;
    for (i = 0; i < l->nsubs; i++)
        if (l->subs[i] == r) {
            l->subs[i] = NULL;
            break;
        }
    if (!l->telling)
        compact(l);
}

/* Each relay on the link hears of an event (kind, status). A relay may
 * leave meanwhile (a drain that ends stops it): it leaves a NULL, and the
 * ones that join are not told. */
enum tell { T_UP, T_DOWN, T_PROBLEM };

static void tell(struct relay_link *l, enum tell what, int status)
{
    size_t i, n = l->nsubs;
    if (what == T_UP)
        l->down_since = 0;
    else if (!l->down_since)
        l->down_since = uv_now(l->loop) ? uv_now(l->loop) : 1;
    l->telling++;
    for (i = 0; i < n; i++) {
        outbox_relay *r = l->subs[i];
        if (!r || (r->redis.state != RC_STARTED && r->redis.state != RC_CLOSING))
            continue;
        if (what == T_UP && r->redis.hooks.up)
            r->redis.hooks.up(r);
        else if (what == T_DOWN && r->redis.hooks.down)
            r->redis.hooks.down(r, status);
        else if (what == T_PROBLEM && r->redis.hooks.problem)
            r->redis.hooks.problem(r);
    }
    if (--l->telling == 0)
        compact(l);
}

/* Publishing is held: kind, and why (Redis's words included). */
static void hold(struct relay_link *l, enum link_problem_kind kind, const char *why)
{
    uint64_t now = uv_now(l->loop);
    l->problem = kind;
    l->acl_probe = 0;
    outbox__strlcpy(l->misconfig, why, sizeof l->misconfig);
    /* It goes into log lines and /healthz between double quotes. */
    for (char *p = l->misconfig; *p; p++)
        if (*p == '"' || *p == '\n' || *p == '\r')
            *p = '\'';
    l->misconfig_at = now;
    /* Once, and again at most once a minute while it lasts (a node that
     * answers INFO as a plain node but MOVED to commands flips back and
     * forth at every check). */
    if (!l->misconfig_logged || now - l->misconfig_logged >= 60000) {
        l->misconfig_logged = now ? now : 1;
        LLOG(l, OUTBOX_LOG_ERROR, "msg=\"publishing held: %s\" redis=%s", l->misconfig, l->url_desc);
    }
    tell(l, T_PROBLEM, 0);
}

/* The problem of that kind is over (what: the log's words). */
static void resume(struct relay_link *l, enum link_problem_kind kind, const char *what)
{
    if (l->problem != kind)
        return;
    LLOG(l, OUTBOX_LOG_INFO, "msg=\"publishing resumed: %s\"", what);
    l->problem = LP_NONE;
    l->misconfig[0] = '\0';
}

static void cluster_problem(struct relay_link *l, const char *how)
{
    char url[200], why[400];
    const outbox__redis_url *node = outbox__target_node_url(l->target);
    const char *host = node ? node->host : NULL;
    int port = node ? node->port : 0;
    if (host)
        snprintf(url, sizeof url, "%s://%s%s%s:%d", l->tls ? "rediss-cluster" : "redis-cluster",
                 strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", port);
    else
        snprintf(url, sizeof url, "redis-cluster://host:port");
    snprintf(why, sizeof why, "the Redis URL names a Redis Cluster node (%s): use a cluster URL, %s", how, url);
    hold(l, LP_CLUSTER_NODE, why);
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
    struct relay_link *l = data;
    int cluster;
    (void)conn;
    l->info_pending = 0;
    if (l->state != RC_STARTED)
        return;
    cluster = status == 0 && reply && reply->type == REDIS_REPLY_STRING && strstr(reply->str, "cluster_enabled:1");
    if (cluster) {
        cluster_problem(l, "cluster_enabled:1");
        return;
    }
    if (status != 0)
        return; /* the connection is gone: the next one checks again */
    resume(l, LP_CLUSTER_NODE, "the node is not a cluster node any more");
    tell(l, T_UP, 0);
}

/* Asks whether the node is a cluster node; the relay is up once it is not
 * (an INFO refused by an ACL counts as not). */
static void check_node(struct relay_link *l)
{
    const char *argv[2] = {"INFO", "cluster"};
    size_t lens[2] = {4, 7};
    if (!outbox__target_ready(l->target) || l->info_pending)
        return;
    l->misconfig_at = uv_now(l->loop);
    if (outbox__target_command_node(l->target, NULL, 2, argv, lens, 0, on_info, l) == 0)
        l->info_pending = 1;
}

/* ---- the target's events ---------------------------------------------- */

/* Up: a target that routes (a cluster) has its slot map; one that does not
 * is up for the relay once INFO says its node is not a cluster node. */
static void on_target_up(outbox__target *t, void *data)
{
    struct relay_link *l = data;
    resume(l, LP_REFUSED, outbox__target_routes(t) ? "a cluster node accepted the connection"
                                                    : "redis accepted the connection");
    if (!outbox__target_routes(t))
        check_node(l);
    else
        tell(l, T_UP, 0);
}

static void on_target_down(outbox__target *t, int status, void *data)
{
    struct relay_link *l = data;
    (void)t;
    l->info_pending = 0;
    tell(l, T_DOWN, status);
}

/* A node's connection is up: one relay loads the idempotent script there
 * (the sha is the link's, for all of them). */
static void on_target_node_up(outbox__target *t, void *node, void *data)
{
    struct relay_link *l = data;
    size_t i;
    (void)t;
    for (i = 0; i < l->nsubs; i++) {
        outbox_relay *r = l->subs[i];
        if (r && r->redis.state == RC_STARTED && r->redis.hooks.node_up) {
            r->redis.hooks.node_up(r, node);
            return;
        }
    }
}

static void on_target_refused(outbox__target *t, int status, const char *why, void *data)
{
    (void)t, (void)status;
    hold(data, LP_REFUSED, why);
}

/* ---- the link itself -------------------------------------------------- */

int outbox__link_create(struct relay_link *l, uv_loop_t *loop, const struct relay_config *cfg)
{
    outbox__target_options o;
    outbox__target_hooks th = {on_target_up, on_target_down, on_target_node_up, on_target_refused, l};
    memset(l, 0, sizeof *l);
    l->loop = loop;
    l->log = &cfg->log;
    l->url_desc = cfg->url_desc;
    l->tls = cfg->url.tls;
    outbox__target_options_defaults(&o);
    o.redis.connect_timeout_ms = cfg->s.connect_timeout_ms;
    o.redis.reply_timeout_ms = cfg->s.reply_timeout_ms;
    o.redis.client_name = "outbox-relay";
    o.redis.wait_replicas = cfg->s.wait_replicas;
    o.redis.tls = cfg->tls; /* the target takes its own reference */
    o.log = &cfg->log;
    o.what = "relay";
    if (outbox__target_create(&l->target, loop, &cfg->url, &o, &th) != 0)
        return OUTBOX_ENOMEM;
    l->routes = outbox__target_routes(l->target);
    l->state = RC_INITIALISED;
    return 0;
}

void outbox__link_open(struct relay_link *l)
{
    if (l->state != RC_INITIALISED)
        return;
    l->state = RC_STARTED;
    l->down_since = uv_now(l->loop) ? uv_now(l->loop) : 1;
    outbox__target_start(l->target);
}

/* Usable: connected, not held by a problem, not waiting for INFO. */
static int usable(const struct relay_link *l)
{
    if (l->state != RC_STARTED || !l->target || l->problem != LP_NONE)
        return 0;
    return outbox__target_reachable(l->target) && !l->info_pending;
}

int outbox__link_usable(const struct relay_link *l)
{
    return usable(l);
}

static void on_target_closed(void *data)
{
    struct relay_link *l = data;
    l->target = NULL;
    free(l->subs);
    l->subs = NULL;
    l->nsubs = l->subs_cap = 0;
    if (l->close_cb)
        l->close_cb(l->close_data);
}

void outbox__link_shut(struct relay_link *l, void (*cb)(void *data), void *data)
{
    if (l->state == RC_INITIALISED) {
        outbox__target_close(l->target, NULL, NULL); /* never started: freed at once */
        l->target = NULL;
        l->state = RC_NONE;
        free(l->subs);
        l->subs = NULL;
        l->nsubs = l->subs_cap = 0;
        if (cb)
            cb(data);
        return;
    }
    if (l->state != RC_STARTED) {
        if (cb)
            cb(data);
        return;
    }
    l->state = RC_CLOSING;
    l->closing = 1;
    l->close_cb = cb;
    l->close_data = data;
    outbox__target_close(l->target, on_target_closed, l);
}

void outbox__link_hold_all(struct relay_link *l)
{
    if (l->target && !l->closing)
        outbox__target_hold(l->target);
}

/* ---- a relay on the link ---------------------------------------------- */

int outbox__link_init(outbox_relay *r, const struct link_hooks *hooks)
{
    r->redis.hooks = *hooks;
    if (r->redis.shared) {
        r->redis.state = RC_INITIALISED;
        return 0;
    }
    if (outbox__link_create(&r->redis.own, r->loop, &r->cfg) != 0)
        return OUTBOX_ENOMEM;
    r->redis.l = &r->redis.own;
    r->redis.state = RC_INITIALISED;
    return 0;
}

void outbox__link_start(outbox_relay *r)
{
    struct relay_link *l = r->redis.l;
    if (subscribe(l, r) != 0) {
        /* Without a place among the link's relays it would never hear that
         * Redis is up: its scans still run, and a unit finding the link up
         * sends (link_up asks the link itself). */
        LOG(r, OUTBOX_LOG_WARN, "msg=\"out of memory: the relay does not hear the connection's events\"");
    }
    r->redis.state = RC_STARTED;
    if (!r->redis.shared)
        outbox__link_open(l);
    else if (usable(l) && r->redis.hooks.up)
        r->redis.hooks.up(r); /* the group's link is up already */
}

void outbox__link_discard(outbox_relay *r)
{
    if (r->redis.state != RC_INITIALISED)
        return;
    if (!r->redis.shared)
        outbox__link_shut(&r->redis.own, NULL, NULL);
    r->redis.state = RC_NONE;
}

int outbox__link_up(const outbox_relay *r)
{
    if (r->redis.state != RC_STARTED)
        return 0;
    return usable(r->redis.l);
}

int outbox__link_routes(const outbox_relay *r)
{
    return r->redis.l ? r->redis.l->routes : 0;
}

const char *outbox__link_problem(const outbox_relay *r)
{
    const struct relay_link *l = r->redis.l;
    return l && l->problem != LP_NONE ? l->misconfig : NULL;
}

char *outbox__link_idem_sha(outbox_relay *r)
{
    return r->redis.l->idem_sha;
}

void outbox__link_check(outbox_relay *r)
{
    struct relay_link *l = r->redis.l;
    if (r->redis.state != RC_STARTED || l->state != RC_STARTED || uv_now(l->loop) - l->misconfig_at < RECHECK_MS)
        return;
    if (l->problem == LP_CLUSTER_NODE) {
        check_node(l);
    } else if (l->problem == LP_ACL) {
        /* The next batch tries: refused again, it is held again (and
         * logged at most once a minute); accepted, it is over. */
        l->problem = LP_NONE;
        l->misconfig[0] = '\0';
        l->acl_probe = 1;
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
    return outbox__target_command_key(r->redis.l->target, stream, pl + tl, cmd, len, 0, cb, data, node);
}

int outbox__link_node_argv(outbox_relay *r, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data)
{
    struct relay_link *l = r->redis.l;
    if (r->redis.state != RC_STARTED || l->state != RC_STARTED || !l->target)
        return OUTBOX_ECLOSED;
    return outbox__target_command_node(l->target, node, argc, argv, lens, timeout_ms, cb, data);
}

void *outbox__link_node_of(const outbox_relay *r, const outbox__redis *conn)
{
    const struct relay_link *l = r->redis.l;
    return l && l->target && !l->closing ? outbox__target_node_of(l->target, conn) : NULL;
}

int outbox__link_node_serves(const outbox_relay *r, const void *node)
{
    const struct relay_link *l = r->redis.l;
    return l && l->target && !l->closing && outbox__target_serves(l->target, node);
}

int outbox__link_lost(outbox_relay *r, const outbox__redis *conn, const redisReply *reply)
{
    struct relay_link *l = r->redis.l;
    if (!reply || !l || !l->target)
        return 0;
    if (reply->type != REDIS_REPLY_ERROR) {
        if (l->acl_probe) {
            l->acl_probe = 0;
            LLOG(l, OUTBOX_LOG_INFO, "msg=\"publishing resumed: redis accepted a command the ACL refused before\"");
        }
        return 0;
    }
    if (acl_refusal(reply)) {
        char why[400];
        snprintf(why, sizeof why, "the ACL forbids a command the relay sends (%.300s)", reply->str);
        hold(l, LP_ACL, why);
        return 1; /* not executed: the message is released, not failed */
    }
    if (outbox__target_misrouted(l->target, reply)) {
        char how[40];
        snprintf(how, sizeof how, "a %.*s reply", (int)(strchr(reply->str, ' ') - reply->str < 20 ? strchr(reply->str, ' ') - reply->str : 20), reply->str);
        cluster_problem(l, how);
        return 1; /* not executed: the message is released, not failed */
    }
    return outbox__target_lost(l->target, conn, reply);
}

void outbox__link_hold(outbox_relay *r)
{
    /* A group's link goes on for the other relays: the group holds it. */
    if (!r->redis.shared)
        outbox__link_hold_all(r->redis.l);
}

void outbox__link_reset(outbox_relay *r, const char *why)
{
    struct relay_link *l = r->redis.l;
    /* On a group's link this drops the other relays' commands too: they
     * are sent again, as after any lost connection. */
    if (l->target && !l->closing)
        outbox__target_reset(l->target, why);
}

void outbox__link_close(outbox_relay *r, void (*cb)(void *data), void *data)
{
    /* A relay on its own link hears of it to the end (the loss of its
     * replies); one on a group's leaves it now, and may be freed. */
    if (r->redis.shared) {
        unsubscribe(r->redis.l, r);
        cb(data);
        return;
    }
    outbox__link_shut(r->redis.l, cb, data);
}

size_t outbox__link_nodes(const outbox_relay *r, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                          uint64_t *refresh_failed)
{
    const struct relay_link *l = r->redis.l;
    if (!l || !l->target || l->closing) {
        *refreshes = *refresh_failed = 0;
        return 0;
    }
    return outbox__target_nodes(l->target, st, n, refreshes, refresh_failed);
}
