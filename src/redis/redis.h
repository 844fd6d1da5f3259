/*
 * redis.h: the project's own Redis connection on a libuv loop (internal).
 *
 * Why not hiredis' async context: in hiredis 0.14.1 its libuv adapter swallows
 * socket errors (a dead server is never reported and pending callbacks never
 * run), and it has no timeouts and no backpressure. Here libuv owns the socket
 * (uv_tcp_t or uv_pipe_t) and hiredis only formats commands
 * (redisFormatCommandArgv) and parses replies (redisReader).
 *
 * One outbox__redis object is one connection attempt and, if it succeeds, one
 * connection. Reconnecting means creating a new object. The lifecycle:
 *
 *   create -> connect -> (connect_cb status 0) -> commands ... -> close
 *                     \-> (connect_cb status <0) -> close
 *
 * With a rediss:// URL the TLS handshake (tls.h) runs right after the TCP
 * connect, inside the connect timeout, and everything after it (AUTH,
 * SELECT, SETNAME, commands) is encrypted; a TLS connection also sends a
 * PING in the handshake when it has nothing else to send, so that a server
 * that refuses the client only after the TLS handshake (a missing client
 * certificate under TLS 1.3) fails the connect, not the first command.
 *
 * Contract:
 * - Every command accepted (return 0) gets its reply callback called exactly
 *   once: with status 0 and a reply (which may be a REDIS_REPLY_ERROR reply),
 *   or with a negative status (OUTBOX_ECLOSED, OUTBOX_ETIMEDOUT, OUTBOX_EPROTO,
 *   OUTBOX_ECONNECT, OUTBOX_ETLS) and reply NULL when the connection fails or
 *   is closed before the reply arrived. Callbacks run in FIFO order.
 * - A function that returns an error calls no callback.
 * - When an established connection fails (EOF, read/write error, reply
 *   timeout, protocol error), every pending command is failed with the error,
 *   in order, and then the disconnect callback runs once. The object stays
 *   allocated until the owner calls outbox__redis_close(); commands issued
 *   after the failure return OUTBOX_ECLOSED.
 * - outbox__redis_close() may be called at any time, also from inside any of
 *   the object's own callbacks; it fails pending commands with OUTBOX_ECLOSED
 *   (their callbacks run before close returns or on a later loop turn, never
 *   after close_cb), closes the libuv handles and frees the memory after the
 *   last handle's close callback, then calls close_cb. After close() the owner
 *   must not touch the object. No disconnect callback is called for a failure
 *   caused by close().
 * - All callbacks run on the loop thread. The object is not thread-safe.
 */
#ifndef OUTBOX_SRC_REDIS_H
#define OUTBOX_SRC_REDIS_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>
#include <uv.h>

#include "outbox/common.h"
#include "tls/tls.h"

/* Where to ask for the master of a Sentinel URL (see sentinel.h). */
typedef struct outbox__redis_sentinels {
    char **hosts;   /* the sentinels' host names or addresses, in URL order */
    int *ports;     /* their ports, default 26379 */
    size_t n;       /* at least 1 */
    char *master;   /* the master's name (the URL's #fragment) */
    char *user;     /* the sentinels' own ACL user, or NULL */
    char *password; /* the sentinels' own password, or NULL */
} outbox__redis_sentinels;

/* The seed nodes of a Redis Cluster URL (see cluster.h). */
typedef struct outbox__redis_seeds {
    char **hosts; /* host names or addresses, in URL order */
    int *ports;   /* their ports, default 6379 */
    size_t n;     /* at least 1 */
} outbox__redis_seeds;

/* A parsed Redis URL. Strings are owned by the struct (see _free). */
typedef struct outbox__redis_url {
    char *host;     /* TCP host name or address; NULL for a Unix socket */
    int port;       /* TCP port, default 6379 */
    char *path;     /* Unix socket path; NULL for TCP */
    char *user;     /* ACL user name or NULL */
    char *password; /* password or NULL */
    int db;         /* database number, default 0 */
    int tls;        /* 1 for rediss:// (TCP only), and rediss-sentinel:// */
    /* A Sentinel URL: the sentinels to ask; host and path are then NULL
     * until a connection is made to the node they name. NULL otherwise. */
    outbox__redis_sentinels *sentinel;
    /* A Cluster URL: the seed nodes; host and path are then NULL (each
     * node's connection gets a copy naming the node). NULL otherwise. */
    outbox__redis_seeds *cluster;
} outbox__redis_url;

/*
 * Parses `redis://[[user]:password@]host[:port][/db]` (host may be a name, an
 * IPv4 address or a bracketed IPv6 address; user and password are
 * percent-decoded), the same with `rediss://` for TLS (tls 1; default port
 * 6379 as well), and `unix:///path/to/sock[?db=N]` (also `redis+unix://`, and
 * `?password=...` / `?user=...` query parameters; no TLS). Returns 0, or
 * OUTBOX_EURL with a specific message ("bad scheme 'http', expected
 * redis://, rediss://, unix://, ...",
 * "port 99999 out of range 1..65535", "database 'x' is not a number", ...)
 * written to err (always NUL-terminated when errlen > 0). On error *out is
 * left zeroed. OUTBOX_ENOMEM on allocation failure.
 *
 * Also Sentinel URLs, `redis-sentinel://[[user]:password@]host[:port][,host
 * [:port]...][/db]#master-name` (and `rediss-sentinel://`): the hosts are the
 * sentinels (default port 26379), the user, password and db are the data
 * nodes'; with rediss-sentinel:// (tls 1) the sentinels and the data nodes
 * are spoken to over TLS. "missing master name ...", "empty sentinel list",
 * ...
 *
 * And Cluster URLs, `redis-cluster://[[user]:password@]host[:port][,host
 * [:port]...][/0]` (and `rediss-cluster://`): the seed nodes (default port
 * 6379) to read the slot map from; user, password and TLS apply to every
 * node; the database can only be 0 ("database 1 with redis-cluster://: a
 * Redis Cluster has only database 0", "empty seed node list: ...").
 */
int outbox__redis_url_parse(const char *url, outbox__redis_url *out, char *err, size_t errlen);
/* Deep copy; 0 or OUTBOX_ENOMEM. */
int outbox__redis_url_copy(outbox__redis_url *dst, const outbox__redis_url *src);
/* Frees the strings and zeroes the struct; NULL is a no-op. */
void outbox__redis_url_free(outbox__redis_url *u);
/* Writes a printable form without the password ("redis://user:***@host:6379/0",
 * "rediss://host:6379/0" or "unix:///path?db=0"). */
void outbox__redis_url_describe(const outbox__redis_url *u, char *buf, size_t len);

typedef struct outbox__redis outbox__redis;

/*
 * The bound on noticing a TCP peer that went silent without a reset (a
 * black hole, a dead host): keepalive probes start after
 * OUTBOX__REDIS_KEEPALIVE_IDLE_S of silence, one a second, and the
 * connection fails after OUTBOX__REDIS_KEEPALIVE_PROBES unanswered ones; bytes
 * sent and unacknowledged for OUTBOX__REDIS_DEAD_PEER_MS (TCP_USER_TIMEOUT)
 * fail it too. Every TCP connection gets them (conn.c), again at every
 * reconnect. A connection with commands outstanding is also bounded by their
 * reply timeout, usually sooner.
 */
#define OUTBOX__REDIS_KEEPALIVE_IDLE_S 5
#define OUTBOX__REDIS_KEEPALIVE_PROBES 5
#define OUTBOX__REDIS_DEAD_PEER_MS                                                                                    \
    ((OUTBOX__REDIS_KEEPALIVE_IDLE_S + OUTBOX__REDIS_KEEPALIVE_PROBES) * 1000)

/*
 * The reconnect backoff of every connection layer (rconn.c, the sentinels'
 * rounds, a cluster's nodes and slot map): OUTBOX__RECONNECT_MIN_MS doubling
 * to OUTBOX__RECONNECT_MAX_MS, each wait drawn from the upper half of its
 * step (outbox__backoff_ms). The cap bounds the time from a healed network
 * or a restarted Redis to publishing again: with 5 s, a relay that failed a
 * few times during a 3 s run of resets came back up to 5 s after the last
 * one. At 500 ms a process tries at most about three times a second, at a
 * random phase, so processes that lost Redis together do not come back in
 * step.
 */
#define OUTBOX__RECONNECT_MIN_MS 100
#define OUTBOX__RECONNECT_MAX_MS 500

typedef struct outbox__redis_options {
    uint64_t connect_timeout_ms; /* resolve + connect + TLS + handshake; default 5000; 0 = none */
    uint64_t reply_timeout_ms;   /* default deadline of each command; default 10000; 0 = none */
    const char *client_name;     /* CLIENT SETNAME during the handshake if non-NULL (copied) */
    /* TLS configuration for a rediss:// URL (tls.h); create takes its own
     * reference. Default NULL: a rediss:// URL then gets the default
     * configuration (system trust store, verification on), built by create.
     * Must be NULL for other URLs. */
    outbox__tls_config *tls;
    /* The replicas the owner's WAITs ask for (--wait-replicas); 0: none.
     * With a Sentinel URL each discovery checks it against the replicas the
     * sentinels know and their replica-priority (sentinel.c). */
    unsigned wait_replicas;
} outbox__redis_options;

void outbox__redis_options_defaults(outbox__redis_options *o);

/* A RESP2 map (a flat array of keys and values, as CLUSTER SHARDS, XINFO
 * GROUPS or SENTINEL REPLICAS answer): the value of key, or NULL when m is
 * not an array or has no such key (a string or status key, compared whole). */
const redisReply *outbox__reply_map_get(const redisReply *m, const char *key);

/* connect_cb: status 0 once the handshake (AUTH, SELECT, SETNAME) succeeded;
 * otherwise OUTBOX_ECONNECT / OUTBOX_ETIMEDOUT / OUTBOX_EAUTH / OUTBOX_EREDIS /
 * OUTBOX_ETLS / OUTBOX_ECLOSED, with details in outbox__redis_errstr() (for
 * OUTBOX_ETLS the reason: "TLS: certificate verification failed for
 * 'localhost': certificate has expired", ...). Called exactly once
 * per successful outbox__redis_connect(), unless close() comes first (then it
 * is called with OUTBOX_ECLOSED). */
typedef void (*outbox__redis_connect_cb)(outbox__redis *r, int status, void *data);
/* Called once when an established connection fails (not after close()). */
typedef void (*outbox__redis_disconnect_cb)(outbox__redis *r, int status, void *data);
/* reply is owned by the module and valid only during the call. */
typedef void (*outbox__redis_reply_cb)(outbox__redis *r, int status, redisReply *reply, void *data);
typedef void (*outbox__redis_close_cb)(void *data);

/*
 * Creates a connection object. url is copied. data is passed to the connect
 * and disconnect callbacks. Returns 0, OUTBOX_EINVAL (also for opt->tls with
 * a URL that is not rediss://) or OUTBOX_ENOMEM.
 */
int outbox__redis_create(outbox__redis **out, uv_loop_t *loop, const outbox__redis_url *url,
                         const outbox__redis_options *opt, void *data);

/* Starts resolving (uv_getaddrinfo for host names), connecting and the
 * handshake. Returns 0 (connect_cb will follow) or OUTBOX_ESTATE if already
 * started / closed. disconnect_cb may be NULL. */
int outbox__redis_connect(outbox__redis *r, outbox__redis_connect_cb connect_cb,
                          outbox__redis_disconnect_cb disconnect_cb);

/* Queues one command. Only allowed once connect_cb reported success and
 * before failure/close; otherwise OUTBOX_ECLOSED (or OUTBOX_ESTATE before the
 * connection is up). timeout_ms 0 means the default reply timeout; a
 * longer one marks a command that may wait in the server (BLOCK, WAIT), so
 * that the connection's silence meanwhile is not taken for a network that
 * dropped it (the stall watch, conn.c). Bytes are
 * copied; output is coalesced and written once per loop turn: in the same
 * turn when queued from a timer or an I/O callback, else in the next.
 * Returns 0, OUTBOX_ENOMEM, OUTBOX_ECLOSED, OUTBOX_ESTATE. */
int outbox__redis_command_argv(outbox__redis *r, int argc, const char **argv, const size_t *argvlen,
                               uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
/* The same with an already RESP-formatted command (copied). */
int outbox__redis_command_raw(outbox__redis *r, const char *cmd, size_t len, uint64_t timeout_ms,
                              outbox__redis_reply_cb cb, void *data);

/* Replies that answer no command: pub/sub messages (arrays starting with
 * "message" or "pmessage") on a subscribed connection. Once a callback is
 * set, they go to it, in order with the replies, instead of failing the
 * connection as a protocol error; reply is valid during the call only. */
typedef void (*outbox__redis_push_cb)(outbox__redis *r, redisReply *reply, void *data);
void outbox__redis_set_push_cb(outbox__redis *r, outbox__redis_push_cb cb, void *data);

/* Commands waiting for their reply, and bytes queued but not yet written. */
size_t outbox__redis_pending(const outbox__redis *r);
size_t outbox__redis_queued_bytes(const outbox__redis *r);
/* 1 while connected and usable. */
int outbox__redis_is_connected(const outbox__redis *r);
/* The last error's detail ("connect: connection refused", "AUTH: WRONGPASS
 * invalid username-password pair", "reply timeout after 10000 ms"), "" if none.
 * Valid until the next call into the object. */
const char *outbox__redis_errstr(const outbox__redis *r);
/* What a failed connection attempt with this status means, for logs:
 * "redis refused the credentials (...)" for OUTBOX_EAUTH, "redis refused the
 * connection set-up" for another error reply during the handshake (SELECT),
 * "TLS with redis failed" for OUTBOX_ETLS, else "redis unreachable". Redis
 * answering but refusing is a configuration problem, not an outage. */
const char *outbox__redis_failure_text(int status);

/* See the contract above. close_cb may be NULL. NULL r is a no-op. */
void outbox__redis_close(outbox__redis *r, outbox__redis_close_cb close_cb, void *data);

#endif
