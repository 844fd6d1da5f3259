/*
 * cluster_int.h: what the files of the cluster layer share (internal; the
 * module's contract is cluster.h).
 *
 *   cluster.c      the object, its nodes and their connections, commands,
 *                  redirections and retries
 *   cluster_map.c  the slot map: refreshes (CLUSTER SHARDS, CLUSTER SLOTS)
 *                  and parsing their replies
 *
 * Everything runs on the loop thread.
 */
#ifndef OUTBOX_SRC_CLUSTER_INT_H
#define OUTBOX_SRC_CLUSTER_INT_H

#include "redis/cluster/cluster.h"
#include "redis/cluster/slot.h"

enum node_state { NS_IDLE, NS_CONNECTING, NS_UP };

typedef struct ccmd ccmd;

struct outbox__cluster_node {
    outbox__cluster *c;
    size_t index;
    char *host;
    int port;
    char name[280]; /* host:port ([v6]:port) */
    outbox__redis *conn;
    enum node_state state;
    uint64_t down_until; /* loop ms: commands fail at once until then */
    unsigned failures;   /* connect failures in a row */
    ccmd *wait_head, *wait_tail; /* queued until its connection is up */
    int master;        /* serves slots in the current map */
    int was_master;    /* ... in the map before it (map.c, while a new one is taken) */
    int probe_wait;    /* a refresh waits for this node's connect */
    uint64_t said_down; /* loop ms of its last CLUSTERDOWN (0: none): asked for the map last (map.c) */
    uint64_t moved, ask, tryagain, errors;
};

/* One command, from its submission until its callback. */
struct ccmd {
    ccmd *next;
    outbox__cluster *c;
    outbox__redis_reply_cb cb;
    void *data;
    unsigned slot;
    uint64_t deadline; /* loop ms; the whole life of the command */
    uint64_t due;      /* a backoff retry's time */
    unsigned redirects, retries;
    int asking; /* send ASKING first (ASK redirection) */
    int direct; /* a node command: no routing, no redirection */
    outbox__cluster_node *target; /* NULL: the slot's node in the map */
    size_t len;
    char cmd[];
};

struct outbox__cluster {
    uv_loop_t *loop;
    outbox__redis_url url; /* the seeds, user, password, TLS */
    outbox__cluster_options opt;
    outbox__cluster_hooks hooks;
    const outbox__logger *log;
    char what[32];
    char desc[300];

    outbox__cluster_node **nodes;
    size_t nnodes, capnodes;
    uint16_t slots[OUTBOX__SLOTS]; /* node index + 1; 0 when no node serves it */

    int started, closing, ready, down_reported;
    int handles; /* timers and connections not closed yet */
    void (*close_cb)(void *data);
    void *close_data;

    uv_timer_t retry_timer; /* backoff retries */
    ccmd *retry_head;       /* sorted by due */
    uv_timer_t refresh_timer; /* throttled or backed-off refresh */
    int refresh_armed;

    /* The map refresh in progress (cluster_map.c). */
    int refreshing, refresh_again, use_slots;
    size_t *probe_order, nprobe, probe;
    /* Of the nodes this refresh tried: how many refused the credentials,
     * and whether any failed otherwise (on_down's status). */
    size_t refused;
    int failed_otherwise;
    uint64_t last_refresh, refreshes, refresh_failed;
    unsigned refresh_failures; /* in a row */
    char errstr[512];
};

/* ---- cluster.c ---- */

/* The node at host:port, added (not connected) if new; NULL without memory. */
outbox__cluster_node *outbox__cluster_node_get(outbox__cluster *c, const char *host, size_t hlen, int port);
/* Starts connecting n (idle). 0 or OUTBOX_ENOMEM. */
int outbox__cluster_node_connect(outbox__cluster_node *n);
/* n was a master and serves no slot in the new map (a failover promoted
 * its replica; the last of its slots moved away): its connection is closed,
 * so that what waits there (a WAIT its replicas cannot answer, the commands
 * queued behind it) is handed back at once, as after a lost connection
 * (unknown outcome), instead of answering CLUSTERDOWN one by one. It
 * connects again on demand. */
void outbox__cluster_node_retire(outbox__cluster *c, outbox__cluster_node *n);

/* ---- cluster_map.c ---- */

/* A refresh now if none ran for refresh_min_ms (SAID_DOWN_REFRESH_MS while a
 * node lately answered CLUSTERDOWN), else when that is over. */
void outbox__cluster_map_refresh_soon(outbox__cluster *c);
/* n's connection is up (or failed: status < 0): a refresh waiting for it
 * goes on. */
void outbox__cluster_map_node_event(outbox__cluster *c, outbox__cluster_node *n, int status);
void outbox__cluster_map_on_timer(uv_timer_t *t);

#endif
