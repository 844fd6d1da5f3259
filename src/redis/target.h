/*
 * target.h: one interface over the Redis deployments (internal).
 *
 * A target is where an owner's commands go: a single node (redis://,
 * rediss://, unix://) or the master that Sentinel names (redis-sentinel://,
 * rediss-sentinel://), both kept connected by an rconn (rconn.h), or a Redis
 * Cluster (redis-cluster://, rediss-cluster://) through the cluster layer
 * (cluster/cluster.h). The owners (the relay's link, the consumer, the dedup
 * module) send through it and never ask which one it is: a command names
 * the key it is about, and the target decides the node (a cluster by the
 * key's slot; a single node has one). Modelled on redis' ConnectionType
 * (src/connection.h) and wlroots' backend interface: a table of operations
 * (struct outbox__target_ops) that each implementation fills, behind the
 * functions below, which call through it.
 *
 * Where each piece lives, so that calls run one way (redis/cluster sits
 * above redis):
 *   redis/target.h, target.c   the interface, these functions, and the
 *                              URL and TLS set-up every owner does
 *   redis/target_node.c        a single node or Sentinel, over rconn.h
 *   redis/cluster/target.c     a Redis Cluster, over cluster.h, and the
 *                              factory that picks one for a URL
 *                              (redis/cluster/target.h): only the level that
 *                              knows both implementations can choose, so the
 *                              factory is not in this folder
 *
 * Nodes. A node is named by an opaque pointer: NULL for the single node, a
 * cluster's node otherwise (valid until close). command_key says which node
 * took a command; node_of names the node of the connection that answered.
 *
 * The real differences between the deployments are the target's, never a
 * branch at a call site: what up and down mean (see the hooks), lost()
 * (a Sentinel master demoted), misrouted() (a plain URL answered by a
 * cluster node), unavailable() (a cluster that could not serve a slot in
 * time), and OUTBOX__TARGET_ROUTES (many nodes, each with its own scripts
 * and its own failures, which no up event announces again).
 *
 * Loop thread only. Contract of the commands as in redis.h and cluster.h:
 * every command accepted (return 0) gets its callback exactly once; a
 * function that returns an error calls no callback.
 */
#ifndef OUTBOX_SRC_REDIS_TARGET_H
#define OUTBOX_SRC_REDIS_TARGET_H

#include <stddef.h>
#include <stdint.h>

#include "outbox/tls.h"
#include "redis/redis.h"
#include "util/util.h"

typedef struct outbox__target outbox__target;

/* What the owner hears (each may be NULL). */
typedef struct outbox__target_hooks {
    /* Commands can be sent now: a single node's connection is up (with a
     * Sentinel URL, ROLE said master); a cluster's slot map is loaded (the
     * first time, or again after down). */
    void (*up)(outbox__target *t, void *data);
    /* Commands cannot be sent for now: a single node's established
     * connection was lost (every command pending on it already got its
     * callback; the target reconnects and up follows); no node of a cluster
     * answers (status; commands are still routed by the last map, up
     * follows once a node answers). */
    void (*down)(outbox__target *t, int status, void *data);
    /* A node's connection is up, before anything queued for it is written
     * (a single node: before up), so that what the owner sends to node here
     * (SCRIPT LOAD) goes first. */
    void (*node_up)(outbox__target *t, void *node, void *data);
    /* A connection attempt was refused with an answer that retrying will
     * not change until Redis or the settings change (why: the words for the
     * log): credentials refused (status OUTBOX_EAUTH; a cluster: by every
     * node tried), an ACL refusing a command of the handshake, every
     * sentinel refusing its credentials or not knowing the master. The
     * target keeps retrying with backoff, as for any failure; up follows if
     * Redis comes to accept. */
    void (*refused)(outbox__target *t, int status, const char *why, void *data);
    void *data;
} outbox__target_hooks;

typedef struct outbox__target_options {
    /* Every connection's: timeouts, client name, the TLS configuration of a
     * TLS URL (a reference is taken; NULL: the default configuration). */
    outbox__redis_options redis;
    /* The commands sent through this target may block this long
     * (XREADGROUP ... BLOCK): the target's own commands that may wait behind
     * one on a node's connection (a cluster's slot map refreshes) get that
     * much more time. 0: none block. */
    uint64_t blocking_ms;
    const outbox__logger *log; /* borrowed */
    const char *what;          /* names the owner in log lines ("relay", "read") */
} outbox__target_options;

void outbox__target_options_defaults(outbox__target_options *o);

/* Per node counters of a deployment of many nodes, for stats and /metrics. */
typedef struct outbox__target_node_stats {
    const char *name; /* "host:port", valid until close */
    int connected;    /* its connection is up */
    int master;       /* it serves slots in the current map */
    uint64_t moved, ask; /* redirections it answered */
    uint64_t tryagain;   /* TRYAGAIN, CLUSTERDOWN, LOADING it answered */
    uint64_t errors;     /* connections to it that failed or were lost */
} outbox__target_node_stats;

/* The target's flags (ops->flags). */
enum {
    /* Many nodes, commands routed by their key's slot and redirections
     * followed inside (a cluster): what a node has (a script) another may
     * not; a command that failed on one node is not announced again by an
     * up event, the owner tries again on its own (after a refresh); there
     * are per node figures. */
    OUTBOX__TARGET_ROUTES = 1,
};

/* The table each implementation fills; the functions below call through it. */
struct outbox__target_ops {
    const char *kind; /* "node", "cluster" */
    unsigned flags;
    void (*start)(outbox__target *t);
    int (*ready)(const outbox__target *t);
    int (*reachable)(const outbox__target *t);
    int (*command_key)(outbox__target *t, const char *key, size_t klen, const char *cmd, size_t len,
                       uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, void **node);
    int (*command_key_argv)(outbox__target *t, const char *key, size_t klen, int argc, const char **argv,
                            const size_t *lens, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
    int (*command_node)(outbox__target *t, void *node, int argc, const char **argv, const size_t *lens,
                        uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
    void *(*node_of)(const outbox__target *t, const outbox__redis *conn);
    int (*serves)(const outbox__target *t, const void *node);
    int (*lost)(outbox__target *t, const outbox__redis *conn, const redisReply *reply);
    int (*misrouted)(const outbox__target *t, const redisReply *reply);
    int (*unavailable)(const outbox__target *t, const redisReply *reply);
    const outbox__redis_url *(*node_url)(const outbox__target *t);
    void (*refresh)(outbox__target *t);
    void (*hold)(outbox__target *t);
    void (*reset)(outbox__target *t, const char *why);
    size_t (*nodes)(const outbox__target *t, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                    uint64_t *refresh_failed);
    /* Closes everything; cb once the memory is freed. Never started: at once. */
    void (*close)(outbox__target *t, void (*cb)(void *data), void *data);
};

/* The part every implementation starts with. */
struct outbox__target {
    const struct outbox__target_ops *ops;
    outbox__target_hooks hooks;
    int started, closing;
};

/* ---- the URL and TLS set-up (target.c) ---- */

/*
 * What every owner does with its settings: parses text (with a Sentinel
 * URL's own credentials, which may be NULL; outbox__sentinel_url_parse)
 * into *url and, for a TLS URL, builds the TLS configuration of tls into
 * *cfg (one reference; NULL for another URL, with which TLS settings are
 * refused). tls NULL: the URL only (the caller has its TLS configuration;
 * *cfg NULL). 0, or the error with err "redis: ..." or "tls: ..."; then
 * nothing is left to free.
 */
int outbox__target_url_setup(const char *text, const char *sentinel_user, const char *sentinel_password,
                             const outbox_tls_settings *tls, outbox__redis_url *url, outbox__tls_config **cfg,
                             char *err, size_t errlen);

/* ---- the implementations ---- */

/* A single node or Sentinel URL (url->cluster NULL); url and opt copied,
 * hooks copied. 0, OUTBOX_EINVAL (TLS options without a TLS URL, a Cluster
 * URL), OUTBOX_ENOMEM. Nothing connects before start. */
int outbox__target_node_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                               const outbox__target_options *opt, const outbox__target_hooks *hooks);

/* ---- the interface ---- */

/* Starts connecting (and keeps reconnecting). */
void outbox__target_start(outbox__target *t);
/* 1 once commands can be sent (a cluster: a slot map is loaded, and stays
 * so through a later failure). */
int outbox__target_ready(const outbox__target *t);
/* 1 while ready and not down (a cluster: a node answered the last refresh);
 * 0 once closing. */
int outbox__target_reachable(const outbox__target *t);
/* t->ops->flags & OUTBOX__TARGET_ROUTES. */
int outbox__target_routes(const outbox__target *t);
/*
 * Queues a RESP-formatted command (copied) about key (klen bytes; a cluster
 * routes it by the key's slot, a single node ignores it). timeout_ms 0: the
 * connection's reply timeout. *node (may be NULL) gets the node it went to.
 * 0, or OUTBOX_ECONNECT (not connected; a cluster: the key's node is down),
 * OUTBOX_ESTATE, OUTBOX_ECLOSED, OUTBOX_ENOMEM, and no callback.
 */
int outbox__target_command_key(outbox__target *t, const char *key, size_t klen, const char *cmd, size_t len,
                               uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, void **node);
/* The same from arguments, about the NUL-terminated key. */
int outbox__target_command_key_argv(outbox__target *t, const char *key, int argc, const char **argv,
                                    const size_t *lens, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
/* Queues a command for one node (NULL: the single node), behind what it
 * took (WAIT, SCRIPT LOAD, INFO): no routing, no redirection followed.
 * A cluster needs a node (OUTBOX_EINVAL without). Returns as above. */
int outbox__target_command_node(outbox__target *t, void *node, int argc, const char **argv, const size_t *lens,
                                uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
/* The node whose current connection conn is (NULL: the single node, or
 * none). */
void *outbox__target_node_of(const outbox__target *t, const outbox__redis *conn);
/* 1 if node (as node_of names it) is still a master of the deployment: a
 * cluster node the current slot map names for some slots; the single node
 * always (a Sentinel switch drops its connection). */
int outbox__target_serves(const outbox__target *t, const void *node);
/*
 * For reply callbacks: 1 if the error reply says that conn no longer talks
 * to the right node and the target has dealt with it (a Sentinel master
 * demoted: READONLY, MASTERDOWN, UNBLOCKED; the connection is dropped and
 * the sentinels asked again, down follows). The command's outcome is
 * unknown. 0 otherwise, and always for a cluster (it follows redirections
 * itself) and a plain URL.
 */
int outbox__target_lost(outbox__target *t, const outbox__redis *conn, const redisReply *reply);
/* 1 if reply is a cluster's redirection or CLUSTERDOWN (MOVED, ASK,
 * CLUSTERDOWN) reaching the owner of a target that does not route: its URL
 * names a cluster node, a configuration error. 0 for a cluster target. */
int outbox__target_misrouted(const outbox__target *t, const redisReply *reply);
/* 1 if reply is what a cluster hands on when it could not serve the key's
 * slot in time (CLUSTERDOWN, TRYAGAIN, LOADING, READONLY, MOVED, ASK after
 * its retries, a redirect loop, a malformed redirection): the deployment
 * unavailable, not the command's problem. 0 for a single node. */
int outbox__target_unavailable(const outbox__target *t, const redisReply *reply);
/* The URL of the node spoken to: a Sentinel URL's current master once
 * named, else the URL; NULL for a cluster. */
const outbox__redis_url *outbox__target_node_url(const outbox__target *t);
/* A cluster: asks for a slot map refresh now (throttled). A single node:
 * nothing. */
void outbox__target_refresh(outbox__target *t);
/* A stop in progress: no more reconnects; a live connection stays. */
void outbox__target_hold(outbox__target *t);
/* Drops the connections (their pending commands fail); they come again. */
void outbox__target_reset(outbox__target *t, const char *why);
/* The nodes (up to n in st; how many are known) and the map refreshes (done,
 * failed) of a target that routes; 0 and none for a single node. */
size_t outbox__target_nodes(const outbox__target *t, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                            uint64_t *refresh_failed);
/* Closes every connection and timer (pending commands get OUTBOX_ECLOSED),
 * then cb (may be NULL) once the target is freed; a target never started is
 * freed at once (cb before close returns). May be called from inside any
 * of its callbacks; after it, only the callbacks still due may touch t.
 * NULL is a no-op. */
void outbox__target_close(outbox__target *t, void (*cb)(void *data), void *data);

#endif
