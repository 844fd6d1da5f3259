/*
 * consumer_int.h: what the files of the consumer-group helper share
 * (internal; the module's contract is include/outbox/consumer.h).
 *
 *   consumer.c          the object: defaults, create, start, stop (its
 *                       handles and the deferred free), destroy, stats
 *   consumer_read.c     the group, XREADGROUP, the drain check, and the
 *                       recovery of idle pending entries (XAUTOCLAIM)
 *   consumer_deliver.c  entries, the retry list and its XCLAIM timer, XACK
 *                       and dead letters
 *   consumer_dedup.c    handing an entry to the handler through the chosen
 *                       dedup (Redis or the SQLite inbox),
 *                       outbox_consumer_done, and the inbox clean-up
 *
 * docs/ARCHITECTURE.md ("The consumer helper") says what each may call.
 * Everything runs on the loop thread, the handler's calls included.
 */
#ifndef OUTBOX_SRC_CONSUMER_INT_H
#define OUTBOX_SRC_CONSUMER_INT_H

#include <stddef.h>
#include <stdint.h>

#include "outbox/consumer.h"
#include "redis/cluster/cluster.h"
#include "consumer/dedup.h"
#include "redis/rconn.h"

enum cstate { CS_CREATED, CS_RUNNING, CS_STOPPING, CS_STOPPED };

typedef struct entry {
    outbox_delivery dv; /* first: outbox_consumer_done() gets it back */
    struct outbox_consumer *c;
    struct entry *next, *prev; /* all live entries */
    struct entry *rnext;       /* retry list */
    uint64_t retry_at;
    int in_retry;
    int recheck;               /* retry without counting a delivery (see outbox__consumer_schedule_recheck) */
    int handler_running;
    char *entry_id, *msg_id;
    char *raw_env;
    size_t raw_len;
    outbox_envelope *env;
} entry;

struct outbox_consumer {
    /* Settings and names, copied at create, read-only after it (loop thread). */
    uv_loop_t *loop;
    outbox_consumer_settings s;
    outbox__logger log;
    char *redis_url, *stream, *group, *consumer, *inbox_path, *ns, *dead_stream;
    char *sentinel_user, *sentinel_password; /* for the dedup module */
    /* Connections and dedup (consumer.c opens and closes them; loop thread).
     * A Cluster URL: two cluster layers (cluster.h) instead of rd and cmd,
     * one for the blocking reads and one for the rest, both routing by the
     * stream's slot, so the reads follow the stream when its slot moves. */
    outbox__rconn rd, cmd;
    outbox__cluster *crd, *ccmd;
    outbox__tls_config *tls; /* rediss://: shared by rd, cmd and the dedup module */
    outbox_dedup *dedup;
    /* The SQLite inbox (consumer_dedup.c; loop thread). */
    sqlite3 *db;
    sqlite3_stmt *q_insert, *q_gc;
    /* Reading and recovery (consumer_read.c; loop thread). */
    enum cstate state;
    int group_ready, group_creating, reading, checking_drain, drained;
    int read_interrupted; /* Cluster: logged once until a read succeeds */
    int cluster_hinted;   /* a plain URL answered like a cluster node: said once */
    char claim_cursor[64];
    /* Entries and retries (consumer_deliver.c; loop thread). */
    entry *live;
    entry *retry_head;
    uint64_t inflight;
    /* Handles and the stop (consumer.c; loop thread). */
    uv_timer_t retry_timer, claim_timer, gc_timer;
    uv_timer_t read_timer; /* Cluster: reads again after a failed read */
    int handles;
    void (*stop_cb)(outbox_consumer *, void *);
    void *stop_data;
    int destroy_pending, in_finish, closing;
    /* Counters, written by every file (loop thread). */
    outbox_consumer_stats st;
};

#define LOG(c, lvl, ...) outbox__log(&(c)->log, (lvl), __VA_ARGS__)

/* consumer.c: closes the handles once a stop has no entry left in flight. */
void outbox__consumer_maybe_finish(outbox_consumer *c);
/* consumer.c: the command connection (or cluster layer) can take commands. */
int outbox__consumer_cmd_ready(const outbox_consumer *c);
/* consumer.c: a command about key (the stream, or the dead stream) on the
 * command connection, or through the cluster layer to the node of key's
 * slot. 0 (cb follows, exactly once), or an error and no callback:
 * OUTBOX_ECONNECT when not connected, and those of
 * outbox__redis_command_argv / outbox__cluster_command_argv. */
int outbox__consumer_command(outbox_consumer *c, const char *key, int argc, const char **argv, const size_t *lens,
                             outbox__redis_reply_cb cb, void *data);

/* consumer_read.c */
void outbox__consumer_kick_read(outbox_consumer *c);
void outbox__consumer_on_cmd_up(outbox__rconn *rc, void *data);
void outbox__consumer_on_rd_up(outbox__rconn *rc, void *data);
void outbox__consumer_on_claim_timer(uv_timer_t *t);
void outbox__consumer_on_read_timer(uv_timer_t *t);
void outbox__consumer_on_cmd_ready(outbox__cluster *cl, void *data);
void outbox__consumer_on_rd_ready(outbox__cluster *cl, void *data);

/* consumer_deliver.c */
entry *outbox__consumer_entry_from_reply(outbox_consumer *c, const redisReply *r, uint64_t deliveries);
entry *outbox__consumer_entry_find(outbox_consumer *c, const char *entry_id);
void outbox__consumer_entry_free(entry *e);
void outbox__consumer_schedule_retry(entry *e, const char *why);
void outbox__consumer_schedule_recheck(entry *e, const char *why);
void outbox__consumer_ack(entry *e);
void outbox__consumer_dead_letter(entry *e, const char *reason);

/* consumer_dedup.c */
void outbox__consumer_dispatch(entry *e);
void outbox__consumer_on_gc_timer(uv_timer_t *t);

#endif
