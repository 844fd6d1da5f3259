/*
 * cluster.h: commands routed to the nodes of a Redis Cluster (internal).
 *
 * The one place that decides which node a command goes to. An
 * outbox__cluster holds the slot map (16384 slots, each naming the master
 * that serves it), read from CLUSTER SHARDS (Redis 7) or, where that is
 * unknown, CLUSTER SLOTS, and one outbox__redis connection per node, opened
 * on demand when the first command for it comes (same user, password and TLS
 * configuration for every node: those of the URL). A command names the key
 * it is about; the key's slot (slot.h: CRC16 with hash tags) picks the node.
 *
 * Redirections and cluster errors are handled here, as the maintained
 * clients do, because each of them means that the command was NOT executed:
 * - MOVED slot host:port: the slot is fixed in the map at once, the command
 *   is resent to that node, and a refresh of the whole map is scheduled
 *   (at most one per refresh_min_ms).
 * - ASK slot host:port: ASKING and the command are pipelined to that node;
 *   the map is unchanged (the slot is being migrated).
 * - TRYAGAIN (a multi-key command during a slot move), CLUSTERDOWN, LOADING:
 *   the command is sent again after a short backoff (retry_min_ms doubling
 *   to retry_max_ms), until its deadline; then the caller gets the last
 *   error reply. CLUSTERDOWN and LOADING also refresh the map (every 200 ms
 *   for 10 s after a node said CLUSTERDOWN: map.c).
 * - A node that was a master and serves no slot in a new map (a failover)
 *   has its connection closed: its commands in flight get OUTBOX_ECLOSED
 *   (unknown outcome) at once; it connects again on demand.
 * - READONLY (a master demoted by a failover): the map is refreshed and the
 *   command sent again after the backoff.
 * At most max_redirects MOVED/ASK in a row per command (reset by a backoff
 * retry); then the caller gets the error reply "redirect loop: MOVED 1234
 * to 127.0.0.1:7001 5 times". A MOVED or ASK that does not parse is an error
 * reply "malformed MOVED reply '...'" for the caller, never a crash.
 *
 * Contract:
 * - Every command accepted (return 0) gets its reply callback called exactly
 *   once: with status 0 and the final reply (which may be an error reply:
 *   the command's own, the last TRYAGAIN/CLUSTERDOWN/LOADING after its
 *   deadline, or one of this module's: redirect loop, malformed
 *   redirection), or with a negative status and reply NULL:
 *   OUTBOX_ECLOSED / OUTBOX_ETIMEDOUT / OUTBOX_EPROTO when the node's
 *   connection was lost or timed out with the command in flight (the
 *   outcome is UNKNOWN: it may have been executed), OUTBOX_ECONNECT when
 *   the node could not be connected to (never sent: not executed), or
 *   OUTBOX_ECLOSED from outbox__cluster_close(). conn is the connection
 *   that gave the reply (NULL when none did): outbox__cluster_node_of()
 *   names its node, where a WAIT for the command must go.
 *   What the caller does with each: a reply is final (an error reply from
 *   a redirection or retry means the command was not executed: it may be
 *   counted as a failed attempt); OUTBOX_ECONNECT: not executed, send it
 *   again later if wanted; OUTBOX_ECLOSED / OUTBOX_ETIMEDOUT / OUTBOX_EPROTO:
 *   treat as maybe executed (the relay releases its message: sent again, a
 *   duplicate at worst).
 * - A function that returns an error calls no callback.
 * - Replies come in FIFO order per node for the commands that no node
 *   redirected; a redirected or retried command's reply comes when its new
 *   node answers, after replies to commands sent later. Callers that need
 *   an order across commands (a key's messages) send the next only once the
 *   previous one's reply came.
 * - A node whose connection failed is "down" for a backoff (node_retry_min_ms
 *   doubling to node_retry_max_ms): commands routed to it fail at once with
 *   OUTBOX_ECONNECT (a return value, or the callback for a resent one) so
 *   that traffic for the other nodes keeps flowing and a window does not
 *   fill with commands for a dead node; the map is refreshed meanwhile.
 * - Nodes are never freed before the cluster: outbox__cluster_node pointers
 *   stay valid until close.
 * - All callbacks run on the loop thread. Not thread-safe.
 */
#ifndef OUTBOX_SRC_CLUSTER_H
#define OUTBOX_SRC_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "util/util.h"
#include "redis/redis.h"
#include "redis/target.h"

typedef struct outbox__cluster outbox__cluster;
typedef struct outbox__cluster_node outbox__cluster_node;

typedef struct outbox__cluster_options {
    outbox__redis_options redis; /* every node's connection (timeouts, client name, TLS) */
    unsigned max_redirects;      /* MOVED/ASK in a row per command; default 5 */
    uint64_t refresh_min_ms;     /* throttle of map refreshes after MOVED; default 1000 */
    uint64_t retry_min_ms, retry_max_ms;           /* TRYAGAIN & co backoff; default 20, 500 */
    uint64_t node_retry_min_ms, node_retry_max_ms; /* a down node; default 100, 500 */
} outbox__cluster_options;

void outbox__cluster_options_defaults(outbox__cluster_options *o);

/* What the owner hears about (each may be NULL). */
typedef struct outbox__cluster_hooks {
    /* A slot map is loaded (the first time, or again after on_down):
     * commands can be sent. */
    void (*on_ready)(outbox__cluster *c, void *data);
    /* No node of the URL or of the last map could be reached or gave a map
     * (status OUTBOX_EAUTH when every node tried refused the credentials,
     * else OUTBOX_ECONNECT; details in outbox__cluster_errstr()); refreshes
     * go on with a backoff and on_ready follows when one succeeds. Commands
     * are still accepted and routed by the last map, if any. */
    void (*on_down)(outbox__cluster *c, int status, void *data);
    /* A node's connection is up; called before the commands queued for it
     * are written, so that what the owner sends here (SCRIPT LOAD) goes
     * first. */
    void (*on_node_up)(outbox__cluster *c, outbox__cluster_node *n, outbox__redis *conn, void *data);
    void *data;
} outbox__cluster_hooks;

/*
 * url must be a Cluster URL (url->cluster set); it is copied. opt is copied
 * (opt->redis.client_name must stay valid; opt->redis.tls gets a reference
 * of its own, and a rediss-cluster:// URL without one gets the default TLS
 * configuration). log is borrowed, what names the owner in log lines.
 * Returns 0, OUTBOX_EINVAL (no seed list; TLS options without TLS) or
 * OUTBOX_ENOMEM. Nothing is connected before outbox__cluster_start().
 */
int outbox__cluster_create(outbox__cluster **out, uv_loop_t *loop, const outbox__redis_url *url,
                           const outbox__cluster_options *opt, const outbox__logger *log, const char *what,
                           const outbox__cluster_hooks *hooks);
/* Creates the timers and starts reading the slot map from the seeds. */
void outbox__cluster_start(outbox__cluster *c);
/* 1 once a slot map is loaded (stays 1: a later failure keeps the last). */
int outbox__cluster_ready(const outbox__cluster *c);
/* 1 while ready and the last refresh found a node that answered: 0 from
 * on_down until the next on_ready (no node reachable: the owner may stop
 * sending, and say it is down). */
int outbox__cluster_reachable(const outbox__cluster *c);

/*
 * Queues a command (RESP-formatted, copied) about key (klen bytes: its slot
 * picks the node; a command about several keys must keep them in one slot,
 * with a hash tag). timeout_ms 0 means the connection's reply timeout; it
 * bounds the whole life of the command, retries included. *node (if not
 * NULL) gets the node it was queued on. Returns 0, OUTBOX_ESTATE (no slot
 * map yet, or closing), OUTBOX_ECONNECT (its node is down, see above),
 * OUTBOX_ENOMEM.
 */
int outbox__cluster_command_raw(outbox__cluster *c, const char *key, size_t klen, const char *cmd, size_t len,
                                uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data,
                                outbox__cluster_node **node);
/* The same from arguments (formatted with redisFormatCommandArgv). */
int outbox__cluster_command_argv(outbox__cluster *c, const char *key, size_t klen, int argc, const char **argv,
                                 const size_t *argvlen, uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data,
                                 outbox__cluster_node **node);
/*
 * Queues a command for one node, behind what was queued for it before
 * (WAIT after a batch, SCRIPT LOAD): no routing, no redirection handled
 * (the caller gets MOVED & co as they are). Returns as above.
 */
int outbox__cluster_node_command_argv(outbox__cluster *c, outbox__cluster_node *n, int argc, const char **argv,
                                      const size_t *argvlen, uint64_t timeout_ms, outbox__redis_reply_cb cb,
                                      void *data);

/* The node whose current connection conn is, or NULL. */
outbox__cluster_node *outbox__cluster_node_of(const outbox__cluster *c, const outbox__redis *conn);
/* 1 if n serves slots in the current map (a master the map names). */
int outbox__cluster_node_serves(const outbox__cluster_node *n);

/* Per node counters, for stats and /metrics (their fields: redis/target.h). */
typedef outbox__target_node_stats outbox__cluster_node_stats;

/* The number of nodes known; fills st (up to n of them). */
size_t outbox__cluster_node_stats_get(const outbox__cluster *c, outbox__cluster_node_stats *st, size_t n);
/* Slot map refreshes done, and those that failed. */
uint64_t outbox__cluster_refreshes(const outbox__cluster *c, uint64_t *failed);
/* Asks for a map refresh now (throttled like one after MOVED). */
void outbox__cluster_refresh(outbox__cluster *c);
/* The last refresh failure's detail, "" if none. */
const char *outbox__cluster_errstr(const outbox__cluster *c);

/* Drops every node's connection: the commands pending on them, waiting
 * for a connect or for a retry get OUTBOX_ECLOSED (unknown outcome for those
 * in flight); nodes reconnect on demand. */
void outbox__cluster_reset(outbox__cluster *c, const char *why);

/* Closes every connection and timer: pending commands get OUTBOX_ECLOSED
 * (or their connection's own error), then cb (may be NULL) once everything
 * is closed and freed. May be called from inside any callback of the
 * cluster's. NULL is a no-op. */
void outbox__cluster_close(outbox__cluster *c, void (*cb)(void *data), void *data);

#endif
