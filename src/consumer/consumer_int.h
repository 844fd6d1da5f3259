/*
 * consumer_int.h: what the files of the consumer-group helper share
 * (internal; the module's contract is include/outbox/consumer.h).
 * Calls run one way, from the top down:
 *
 *   consumer.c    the object: create, start, stop (its handles and the
 *                 deferred free), destroy, stats; the hooks below
 *   read.c        the group, XREADGROUP, the drain check, and the recovery
 *                 of idle pending entries (XAUTOCLAIM)
 *   dispatch.c    handing an entry to the handler through the chosen dedup
 *                 (Redis or the SQLite inbox), outbox_consumer_done, and
 *                 the inbox clean-up
 *   deliver.c     entries, the retry list and its XCLAIM timer, XACK and
 *                 dead letters
 *   settings.c    the settings table (settings_table.h): defaults, checks
 *
 * The calls that run back up (a retried entry to dispatch, an entry gone:
 * read more, a stop may finish) go through c->hooks, which consumer.c fills
 * in at create, like the relay's r->hooks. Every command goes to a target
 * (redis/target.h), which decides the node: none of these files asks
 * whether it is a single node or a cluster. docs/ARCHITECTURE.md ("The
 * consumer helper") has more. Everything runs on the loop thread, the
 * handler's calls included.
 */
#ifndef OUTBOX_SRC_CONSUMER_INT_H
#define OUTBOX_SRC_CONSUMER_INT_H

#include <stddef.h>
#include <stdint.h>

#include "consumer/dedup.h"
#include "outbox/consumer.h"
#include "redis/target.h"

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
    int completing;            /* its effect is applied: the retry sends the dedup complete again */
    uint64_t complete_by;      /* loop ms: past it the processing key has expired, no more tries */
    char *entry_id, *msg_id;
    char *db_field;            /* the entry's db field, or NULL */
    char *db_id;               /* "<db>:<id>" when the message names its database, else NULL */
    char *raw_env;
    size_t raw_len;
    outbox_envelope *env;
} entry;

/* The calls that run back up the file order (see the top). */
typedef struct consumer_hooks {
    void (*dispatch)(entry *e);             /* a retried entry goes to the handler again */
    void (*complete)(entry *e);             /* an applied entry's dedup complete, sent again */
    void (*entry_gone)(outbox_consumer *c); /* an entry was freed: read more, a stop may finish */
} consumer_hooks;

struct outbox_consumer {
    /* Settings and names, copied at create, read-only after it (loop thread). */
    uv_loop_t *loop;
    outbox_consumer_settings s;
    outbox__logger log;
    char *redis_url, *stream, *group, *consumer, *inbox_path, *ns, *dead_stream;
    char *sentinel_user, *sentinel_password; /* for the dedup module */
    consumer_hooks hooks;
    /* Redis and dedup (consumer.c opens and closes them; loop thread). Two
     * targets (redis/target.h), one for the blocking reads and one for the
     * rest, both sending by the stream's key (a cluster routes by its slot,
     * so the reads follow the stream when its slot moves). NULL once their
     * close began (rd at stop, cmd once no entry is left). */
    outbox__target *rd, *cmd;
    outbox__tls_config *tls; /* rediss://: shared by rd, cmd and the dedup module */
    outbox_dedup *dedup;
    /* The SQLite inbox (consumer_dedup.c; loop thread). */
    sqlite3 *db;
    sqlite3_stmt *q_insert, *q_gc;
    /* Reading and recovery (consumer_read.c; loop thread). */
    enum cstate state;
    int group_ready, group_creating, reading, checking_drain, drained;
    int read_interrupted; /* a target that routes: logged once until a read succeeds */
    int cluster_hinted;   /* a plain URL answered like a cluster node: said once */
    char claim_cursor[64];
    /* Entries and retries (consumer_deliver.c; loop thread). */
    entry *live;
    entry *retry_head;
    uint64_t inflight;
    /* Handles and the stop (consumer.c; loop thread). */
    uv_timer_t retry_timer, claim_timer, gc_timer;
    uv_timer_t read_timer; /* a target that routes: reads again after a failed read */
    int handles;
    void (*stop_cb)(outbox_consumer *, void *);
    void *stop_data;
    int destroy_pending, in_finish, closing;
    /* Counters, written by every file (loop thread). */
    outbox_consumer_stats st;
};

#define LOG(c, lvl, ...) outbox__log(&(c)->log, (lvl), __VA_ARGS__)

/* The id that the dedup keys and the inbox rows are keyed on: message ids
 * are unique per database, so a message that names its database is
 * "<db>:<id>" there, one that does not its plain id (proto/dedup.md). */
static inline const char *outbox__consumer_dedup_id(const entry *e)
{
    return e->db_id ? e->db_id : e->msg_id;
}

/* The command target can take commands (not once its close began). */
static inline int outbox__consumer_cmd_ready(const outbox_consumer *c)
{
    return c->cmd && outbox__target_ready(c->cmd);
}

/* A command about key (the stream, or the dead stream) through the command
 * target, to the node of key's slot on a cluster. 0 (cb follows, exactly
 * once), or an error and no callback: OUTBOX_ECONNECT when not connected
 * (or closing), and those of outbox__target_command_key_argv. */
static inline int outbox__consumer_command(outbox_consumer *c, const char *key, int argc, const char **argv,
                                           const size_t *lens, outbox__redis_reply_cb cb, void *data)
{
    if (!c->cmd)
        return OUTBOX_ECONNECT;
    return outbox__target_command_key_argv(c->cmd, key, argc, argv, lens, 0, cb, data);
}

/* read.c */
void outbox__consumer_kick_read(outbox_consumer *c);
void outbox__consumer_on_cmd_up(outbox__target *t, void *data);
void outbox__consumer_on_rd_up(outbox__target *t, void *data);
void outbox__consumer_on_claim_timer(uv_timer_t *t);
void outbox__consumer_on_read_timer(uv_timer_t *t);

/* dispatch.c */
void outbox__consumer_dispatch(entry *e);
void outbox__consumer_on_gc_timer(uv_timer_t *t);

/* deliver.c */
entry *outbox__consumer_entry_from_reply(outbox_consumer *c, const redisReply *r, uint64_t deliveries);
entry *outbox__consumer_entry_find(outbox_consumer *c, const char *entry_id);
void outbox__consumer_entry_free(entry *e);
void outbox__consumer_schedule_retry(entry *e, const char *why);
void outbox__consumer_schedule_recheck(entry *e, const char *why);
/* dispatch.c: the dedup complete of an applied entry, (again) now. */
void outbox__consumer_complete(entry *e);
void outbox__consumer_ack(entry *e);
void outbox__consumer_dead_letter(entry *e, const char *reason);

#endif
