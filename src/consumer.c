/*
 * The consumer-group helper (see include/outbox/consumer.h).
 *
 * Two Redis connections: one for XREADGROUP ... BLOCK (a blocked command
 * holds its connection), one for everything else (group creation, XACK,
 * XCLAIM/XAUTOCLAIM/XPENDING, dead letters). The Redis dedup module has its
 * own. Each delivered entry becomes an `entry` that lives until it is
 * acknowledged, dead-lettered, or left pending for a later delivery.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "outbox/consumer.h"
#include "dedup.h"
#include "rconn.h"
#include "sqlite_util.h"
#include "outbox/schema.h"

extern const char outbox__inbox_sql[];

enum cstate { CS_CREATED, CS_RUNNING, CS_STOPPING, CS_STOPPED };

typedef struct entry {
    outbox_delivery dv; /* first: outbox_consumer_done() gets it back */
    struct outbox_consumer *c;
    struct entry *next, *prev; /* all live entries */
    struct entry *rnext;       /* retry list */
    uint64_t retry_at;
    int in_retry;
    int recheck;               /* retry without counting a delivery (see schedule_recheck) */
    int handler_running;
    char *entry_id, *msg_id;
    char *raw_env;
    size_t raw_len;
    outbox_envelope *env;
} entry;

struct outbox_consumer {
    uv_loop_t *loop;
    outbox_consumer_settings s;
    outbox__logger log;
    char *redis_url, *stream, *group, *consumer, *inbox_path, *ns, *dead_stream;
    char *sentinel_user, *sentinel_password; /* for the dedup module */
    outbox__rconn rd, cmd;
    outbox__tls_config *tls; /* rediss://: shared by rd, cmd and the dedup module */
    outbox_dedup *dedup;
    sqlite3 *db;
    sqlite3_stmt *q_insert, *q_gc;
    enum cstate state;
    int group_ready, group_creating, reading, checking_drain, drained;
    entry *live;
    entry *retry_head;
    uint64_t inflight;
    uv_timer_t retry_timer, claim_timer, gc_timer;
    int handles;
    char claim_cursor[64];
    void (*stop_cb)(outbox_consumer *, void *);
    void *stop_data;
    int destroy_pending, in_finish, closing;
    outbox_consumer_stats st;
};

#define LOG(c, lvl, ...) outbox__log(&(c)->log, (lvl), __VA_ARGS__)

static void kick_read(outbox_consumer *c);
static void maybe_finish(outbox_consumer *c);
static void dispatch(entry *e);
static void on_retry_timer(uv_timer_t *t);

void outbox_consumer_defaults(outbox_consumer_settings *s)
{
    memset(s, 0, sizeof *s);
    s->dedup = OUTBOX_DEDUP_REDIS;
    s->key_namespace = NULL;
    s->dedup_lease_ms = 30000;
    s->dedup_retention_ms = 7ull * 24 * 3600 * 1000;
    s->inbox_retention_ms = 7ull * 24 * 3600 * 1000;
    s->batch = 100;
    s->max_inflight = 100;
    s->block_ms = 2000;
    s->min_idle_ms = 60000;
    s->claim_interval_ms = 5000;
    s->max_deliveries = 5;
    s->retry_ms = 1000;
    s->log = outbox_log_stderr;
    s->log_level = OUTBOX_LOG_INFO;
    outbox_tls_defaults(&s->tls);
}

/* ------------------------------------------------------------------ */
/* entries */

static void entry_free(entry *e)
{
    outbox_consumer *c = e->c;
    if (e->prev)
        e->prev->next = e->next;
    else
        c->live = e->next;
    if (e->next)
        e->next->prev = e->prev;
    c->inflight--;
    outbox_envelope_free(e->env);
    free(e->entry_id);
    free(e->msg_id);
    free(e->raw_env);
    free(e);
    kick_read(c);
    maybe_finish(c);
}

static entry *entry_find(outbox_consumer *c, const char *entry_id)
{
    for (entry *e = c->live; e; e = e->next)
        if (strcmp(e->entry_id, entry_id) == 0)
            return e;
    return NULL;
}

static void schedule_retry(entry *e, const char *why)
{
    outbox_consumer *c = e->c;
    entry **pp;
    if (c->state != CS_RUNNING) {
        /* Stopping: leave it pending in the group; it is delivered again
         * (to us after a restart, or to another consumer via XAUTOCLAIM). */
        entry_free(e);
        return;
    }
    LOG(c, OUTBOX_LOG_DEBUG, "msg=\"will retry\" id=%s entry=%s reason=\"%s\"", e->msg_id ? e->msg_id : "-",
        e->entry_id, why);
    e->retry_at = uv_now(c->loop) + c->s.retry_ms;
    e->in_retry = 1;
    /* Appending keeps the list ordered by retry_at (one fixed delay). */
    for (pp = &c->retry_head; *pp; pp = &(*pp)->rnext)
        ;
    e->rnext = NULL;
    *pp = e;
    if (!uv_is_active((uv_handle_t *)&c->retry_timer))
        uv_timer_start(&c->retry_timer, on_retry_timer, c->s.retry_ms, 0);
}

/* Retries an entry whose handler did not run (someone else holds the dedup
 * key, Redis or the database was unavailable): the retry re-checks that the
 * entry is still pending with XCLAIM JUSTID, which does not count a
 * delivery. Counting these would dead-letter an entry while another
 * consumer is still applying it, or while its dead owner's lease runs out. */
static void schedule_recheck(entry *e, const char *why)
{
    e->recheck = 1;
    schedule_retry(e, why);
}

/* ------------------------------------------------------------------ */
/* acknowledgement and dead letters */

static void on_ack(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    if (status == 0 && reply && outbox__rconn_redirect_error(&e->c->cmd, conn, reply))
        status = OUTBOX_ECLOSED; /* the old master: it stays pending and comes again */
    if (status == 0 && reply->type == REDIS_REPLY_INTEGER)
        e->c->st.acked++;
    else
        LOG(e->c, OUTBOX_LOG_WARN, "msg=\"XACK failed; the entry stays pending and is recognised as done when "
                                   "delivered again\" id=%s entry=%s",
            e->msg_id ? e->msg_id : "-", e->entry_id);
    entry_free(e);
}

static void ack(entry *e)
{
    outbox_consumer *c = e->c;
    outbox__redis *conn = outbox__rconn_get(&c->cmd);
    const char *argv[4] = {"XACK", c->stream, c->group, e->entry_id};
    size_t lens[4] = {4, strlen(c->stream), strlen(c->group), strlen(e->entry_id)};
    if (!conn || outbox__redis_command_argv(conn, 4, argv, lens, 0, on_ack, e) != 0)
        on_ack(NULL, OUTBOX_ECONNECT, NULL, e);
}

static void on_dead_added(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    if (status == 0 && outbox__rconn_redirect_error(&e->c->cmd, conn, reply))
        status = OUTBOX_ECLOSED;
    if (status == 0 && reply->type == REDIS_REPLY_STRING) {
        e->c->st.dead_lettered++;
        ack(e);
    } else {
        LOG(e->c, OUTBOX_LOG_ERROR, "msg=\"cannot write to the dead stream; entry left pending\" entry=%s stream=%s",
            e->entry_id, e->c->dead_stream);
        schedule_recheck(e, "dead stream write failed");
    }
}

/* Copies the entry to <stream>:dead with the reason, then acknowledges it,
 * so one poison message cannot block the group. */
static void dead_letter(entry *e, const char *reason)
{
    outbox_consumer *c = e->c;
    outbox__redis *conn = outbox__rconn_get(&c->cmd);
    char deliveries[24];
    const char *argv[16];
    size_t lens[16];
    int n = 0;

    LOG(c, OUTBOX_LOG_ERROR, "msg=\"dead-lettered\" id=%s entry=%s deliveries=%llu reason=\"%s\"",
        e->msg_id ? e->msg_id : "-", e->entry_id, (unsigned long long)e->dv.deliveries, reason);
    snprintf(deliveries, sizeof deliveries, "%llu", (unsigned long long)e->dv.deliveries);
#define ARG(s, l) (argv[n] = (s), lens[n++] = (l))
    ARG("XADD", 4);
    ARG(c->dead_stream, strlen(c->dead_stream));
    ARG("*", 1);
    ARG("id", 2);
    ARG(e->msg_id ? e->msg_id : "", e->msg_id ? strlen(e->msg_id) : 0);
    ARG("envelope", 8);
    ARG(e->raw_env ? e->raw_env : "", e->raw_len);
    ARG("source_entry", 12);
    ARG(e->entry_id, strlen(e->entry_id));
    ARG("group", 5);
    ARG(c->group, strlen(c->group));
    ARG("deliveries", 10);
    ARG(deliveries, strlen(deliveries));
    ARG("reason", 6);
    ARG(reason, strlen(reason));
#undef ARG
    if (!conn || outbox__redis_command_argv(conn, n, argv, lens, 0, on_dead_added, e) != 0)
        schedule_recheck(e, "not connected");
}

/* ------------------------------------------------------------------ */
/* dedup: Redis */

static void run_handler(entry *e)
{
    outbox_consumer *c = e->c;
    e->handler_running = 1;
    c->s.handler(c, &e->dv, c->s.data);
}

static void on_completed(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    (void)d;
    (void)r;
    if (status == OUTBOX_ELEASE)
        LOG(e->c, OUTBOX_LOG_WARN,
            "msg=\"dedup lease expired before complete: the effect may be applied twice; raise the dedup lease\" "
            "id=%s",
            e->msg_id);
    else if (status != 0)
        LOG(e->c, OUTBOX_LOG_WARN,
            "msg=\"dedup complete failed: a redelivery will apply the effect again after the lease\" id=%s err=%s",
            e->msg_id, outbox_err_name(status));
    ack(e);
}

static void on_abandoned(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    (void)d;
    (void)r;
    (void)status; /* if this fails the processing key expires after its lease */
    schedule_retry(e, "handler failed");
}

static void on_begun(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    outbox_consumer *c = e->c;
    (void)d;
    if (status != 0) {
        LOG(c, OUTBOX_LOG_WARN, "msg=\"dedup begin failed; not processing\" id=%s err=%s detail=\"%s\"", e->msg_id,
            outbox_err_name(status), outbox_dedup_errstr(c->dedup));
        /* An error answer about this message's key (WRONGTYPE) is the
         * message's problem and counts towards max_deliveries; Redis being
         * unreachable is not. */
        if (status == OUTBOX_EREDIS)
            schedule_retry(e, "dedup error");
        else
            schedule_recheck(e, "dedup unavailable");
        return;
    }
    switch (r) {
    case OUTBOX_DEDUP_FIRST:
        run_handler(e);
        break;
    case OUTBOX_DEDUP_DONE:
        c->st.duplicates++;
        LOG(c, OUTBOX_LOG_DEBUG, "msg=\"duplicate skipped\" id=%s entry=%s", e->msg_id, e->entry_id);
        ack(e);
        break;
    default:
        c->st.busy++;
        schedule_recheck(e, "another consumer is applying it");
        break;
    }
}

/* ------------------------------------------------------------------ */
/* dedup: SQLite inbox */

static void run_inbox(entry *e)
{
    outbox_consumer *c = e->c;
    int rc, status;

    rc = sqlite3_exec(c->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        schedule_recheck(e, sqlite3_errmsg(c->db));
        return;
    }
    sqlite3_bind_text(c->q_insert, 1, e->msg_id, -1, SQLITE_STATIC);
    sqlite3_bind_text(c->q_insert, 2, c->stream, -1, SQLITE_STATIC);
    sqlite3_bind_text(c->q_insert, 3, e->entry_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(c->q_insert, 4, outbox_now_ms());
    rc = sqlite3_step(c->q_insert);
    sqlite3_reset(c->q_insert);
    if (rc != SQLITE_DONE) {
        int dup = (sqlite3_extended_errcode(c->db) & 0xff) == SQLITE_CONSTRAINT;
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
        if (dup) {
            c->st.duplicates++;
            ack(e);
        } else {
            schedule_recheck(e, sqlite3_errmsg(c->db));
        }
        return;
    }
    e->dv.db = c->db;
    status = c->s.handler(c, &e->dv, c->s.data);
    e->dv.db = NULL;
    if (status == 0 && sqlite3_exec(c->db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK) {
        c->st.applied++;
        ack(e);
        return;
    }
    if (!sqlite3_get_autocommit(c->db))
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
    c->st.failed++;
    schedule_retry(e, status ? "handler failed" : "commit failed");
}

/* ------------------------------------------------------------------ */

static void dispatch(entry *e)
{
    outbox_consumer *c = e->c;
    int rc;
    char why[96];

    if (!e->env) {
        dead_letter(e, "malformed entry");
        return;
    }
    if (e->dv.deliveries > c->s.max_deliveries) {
        snprintf(why, sizeof why, "delivered %llu times, more than max_deliveries %u",
                 (unsigned long long)e->dv.deliveries, c->s.max_deliveries);
        dead_letter(e, why);
        return;
    }
    c->st.delivered++;
    switch (c->s.dedup) {
    case OUTBOX_DEDUP_REDIS:
        rc = outbox_dedup_begin(c->dedup, c->stream, e->msg_id, on_begun, e);
        if (rc != 0)
            on_begun(c->dedup, rc, 0, e);
        break;
    case OUTBOX_DEDUP_SQLITE:
        run_inbox(e);
        break;
    default:
        run_handler(e);
        break;
    }
}

void outbox_consumer_done(outbox_consumer *c, const outbox_delivery *dv, int status)
{
    entry *e = (entry *)dv;
    int rc;
    if (!c || !dv || !e->handler_running || c->s.dedup == OUTBOX_DEDUP_SQLITE)
        return;
    e->handler_running = 0;
    if (status == 0) {
        c->st.applied++;
        if (c->s.dedup == OUTBOX_DEDUP_REDIS) {
            rc = outbox_dedup_complete(c->dedup, c->stream, e->msg_id, on_completed, e);
            if (rc != 0)
                on_completed(c->dedup, rc, 0, e);
        } else {
            ack(e);
        }
    } else {
        c->st.failed++;
        LOG(c, OUTBOX_LOG_WARN, "msg=\"handler failed; entry left pending for retry\" id=%s entry=%s status=%d",
            e->msg_id, e->entry_id, status);
        if (c->s.dedup == OUTBOX_DEDUP_REDIS) {
            rc = outbox_dedup_abandon(c->dedup, c->stream, e->msg_id, on_abandoned, e);
            if (rc != 0)
                on_abandoned(c->dedup, rc, 0, e);
        } else {
            schedule_retry(e, "handler failed");
        }
    }
}

/* Builds an entry from [id, [field, value, ...]]; NULL if the reply has
 * another shape. */
static entry *entry_from_reply(outbox_consumer *c, const redisReply *r, uint64_t deliveries)
{
    entry *e;
    const redisReply *fields;
    char err[160];
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING)
        return NULL;
    e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->c = c;
    e->entry_id = strndup(r->element[0]->str, r->element[0]->len);
    e->dv.stream = c->stream;
    e->dv.entry_id = e->entry_id;
    e->dv.deliveries = deliveries;
    fields = r->element[1];
    if (fields->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i + 1 < fields->elements; i += 2) {
            const redisReply *k = fields->element[i], *v = fields->element[i + 1];
            if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
                continue;
            if (k->len == 2 && memcmp(k->str, "id", 2) == 0 && !e->msg_id)
                e->msg_id = strndup(v->str, v->len);
            else if (k->len == 8 && memcmp(k->str, "envelope", 8) == 0 && !e->raw_env) {
                e->raw_env = malloc(v->len ? v->len : 1);
                if (e->raw_env) {
                    memcpy(e->raw_env, v->str, v->len);
                    e->raw_len = v->len;
                }
            }
        }
    }
    if (e->raw_env && e->msg_id) {
        int rc = outbox_envelope_decode(e->raw_env, e->raw_len, &e->env, err, sizeof err);
        if (rc != 0)
            LOG(c, OUTBOX_LOG_WARN, "msg=\"undecodable envelope\" entry=%s err=%s detail=\"%s\"", e->entry_id,
                outbox_err_name(rc), err);
        else if (strcmp(e->env->id, e->msg_id) != 0) {
            LOG(c, OUTBOX_LOG_WARN, "msg=\"entry id field differs from the envelope's id\" entry=%s", e->entry_id);
            outbox_envelope_free(e->env);
            e->env = NULL;
        }
    }
    e->dv.msg = e->env;
    /* Link it as live. */
    e->next = c->live;
    if (c->live)
        c->live->prev = e;
    c->live = e;
    c->inflight++;
    return e;
}

/* ------------------------------------------------------------------ */
/* reading */

static void ensure_group(outbox_consumer *c);

static void on_drain_check(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    (void)conn;
    c->checking_drain = 0;
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY && reply->elements == 0 && c->inflight == 0 &&
        c->state == CS_RUNNING && !c->drained) {
        c->drained = 1;
        LOG(c, OUTBOX_LOG_INFO, "msg=drained applied=%llu duplicates=%llu dead=%llu",
            (unsigned long long)c->st.applied, (unsigned long long)c->st.duplicates,
            (unsigned long long)c->st.dead_lettered);
        if (c->s.on_drained)
            c->s.on_drained(c, c->s.data);
        else
            outbox_consumer_stop(c, NULL, NULL);
        return;
    }
    kick_read(c);
}

static void check_drained(outbox_consumer *c)
{
    outbox__redis *conn = outbox__rconn_get(&c->cmd);
    const char *argv[7] = {"XPENDING", c->stream, c->group, "-", "+", "1", c->consumer};
    size_t lens[7];
    if (!c->s.drain || c->drained || c->inflight || !conn || c->checking_drain)
        return;
    for (int i = 0; i < 7; i++)
        lens[i] = strlen(argv[i]);
    if (outbox__redis_command_argv(conn, 7, argv, lens, 0, on_drain_check, c) == 0)
        c->checking_drain = 1;
}

static void on_read(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    size_t got = 0;
    c->reading = 0;
    if (status != 0 || outbox__rconn_redirect_error(&c->rd, conn, reply))
        return; /* the connection is being re-established; on_up reads again */
    if (reply->type == REDIS_REPLY_ERROR) {
        if (strncmp(reply->str, "NOGROUP", 7) == 0) {
            c->group_ready = 0;
            ensure_group(c);
        } else {
            LOG(c, OUTBOX_LOG_ERROR, "msg=\"XREADGROUP failed\" error=\"%.200s\"", reply->str);
        }
        return;
    }
    if (reply->type == REDIS_REPLY_ARRAY) {
        for (size_t s = 0; s < reply->elements; s++) {
            const redisReply *sr = reply->element[s];
            if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 || sr->element[1]->type != REDIS_REPLY_ARRAY)
                continue;
            for (size_t i = 0; i < sr->element[1]->elements; i++) {
                entry *e = entry_from_reply(c, sr->element[1]->element[i], 1);
                if (e) {
                    got++;
                    dispatch(e);
                }
            }
        }
    }
    if (got == 0 && c->inflight == 0 && !c->retry_head)
        check_drained(c);
    kick_read(c);
}

static void kick_read(outbox_consumer *c)
{
    outbox__redis *conn = outbox__rconn_get(&c->rd);
    char count[16], block[24];
    unsigned n;
    if (c->state != CS_RUNNING || !c->group_ready || c->reading || !conn || c->checking_drain || c->drained)
        return;
    if (c->inflight >= c->s.max_inflight)
        return;
    n = c->s.max_inflight - (unsigned)c->inflight;
    if (n > c->s.batch)
        n = c->s.batch;
    snprintf(count, sizeof count, "%u", n);
    /* Draining only needs to know whether anything is left. */
    snprintf(block, sizeof block, "%llu", (unsigned long long)(c->s.drain && c->s.block_ms > 100 ? 100 : c->s.block_ms));
    {
        const char *argv[10] = {"XREADGROUP", "GROUP", c->group, c->consumer, "COUNT", count,
                                "BLOCK",      block,   "STREAMS", c->stream};
        const char *all[11];
        size_t lens[11];
        memcpy(all, argv, sizeof argv);
        all[10] = ">";
        for (int i = 0; i < 11; i++)
            lens[i] = strlen(all[i]);
        if (outbox__redis_command_argv(conn, 11, all, lens, c->s.block_ms + 10000, on_read, c) == 0)
            c->reading = 1;
    }
}

static void on_group(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    c->group_creating = 0;
    if (status != 0 || outbox__rconn_redirect_error(&c->cmd, conn, reply))
        return; /* on_up creates it on the next connection */
    if (reply->type == REDIS_REPLY_STATUS || (reply->type == REDIS_REPLY_ERROR && !strncmp(reply->str, "BUSYGROUP", 9))) {
        c->group_ready = 1;
        kick_read(c);
    } else {
        LOG(c, OUTBOX_LOG_ERROR, "msg=\"cannot create the consumer group\" stream=%s group=%s error=\"%.200s\"",
            c->stream, c->group, reply->type == REDIS_REPLY_ERROR ? reply->str : "unexpected reply");
    }
}

static void ensure_group(outbox_consumer *c)
{
    outbox__redis *conn = outbox__rconn_get(&c->cmd);
    /* A new group starts at the beginning of the stream: every message the
     * relay published is processed, also those written before the group. */
    const char *argv[6] = {"XGROUP", "CREATE", c->stream, c->group, "0", "MKSTREAM"};
    size_t lens[6];
    if (c->group_ready || c->group_creating || !conn)
        return;
    for (int i = 0; i < 6; i++)
        lens[i] = strlen(argv[i]);
    if (outbox__redis_command_argv(conn, 6, argv, lens, 0, on_group, c) == 0)
        c->group_creating = 1;
}

static void on_cmd_up(outbox__rconn *rc, void *data)
{
    (void)rc;
    ensure_group(data);
}

static void on_rd_up(outbox__rconn *rc, void *data)
{
    (void)rc;
    kick_read(data);
}

/* ------------------------------------------------------------------ */
/* retries and recovery */

typedef struct claim_ctx {
    outbox_consumer *c;
    entry *e;         /* retry of a known entry, or NULL for XAUTOCLAIM */
    uint64_t deliveries;
    redisReply *claimed;
} claim_ctx;

static void on_xclaim(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *old = data;
    outbox_consumer *c = old->c;
    entry *e;
    uint64_t deliveries = old->dv.deliveries + 1;
    (void)conn;
    if (status != 0) {
        schedule_retry(old, "not connected");
        return;
    }
    if (c->state != CS_RUNNING || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0 ||
        reply->element[0]->type != REDIS_REPLY_ARRAY) {
        /* Not pending for the group any more (acknowledged by someone), or
         * stopping (it stays pending): it is not ours to process now. */
        entry_free(old);
        return;
    }
    entry_free(old);
    e = entry_from_reply(c, reply->element[0], deliveries);
    if (e)
        dispatch(e);
}

static void on_recheck(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    (void)conn;
    if (status != 0) {
        schedule_retry(e, "not connected");
        return;
    }
    if (e->c->state != CS_RUNNING || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0) {
        entry_free(e);
        return;
    }
    e->recheck = 0;
    dispatch(e);
}

static void on_retry_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    uint64_t now = uv_now(c->loop);
    while (c->retry_head && c->retry_head->retry_at <= now) {
        entry *e = c->retry_head;
        outbox__redis *conn = outbox__rconn_get(&c->cmd);
        c->retry_head = e->rnext;
        e->in_retry = 0;
        if (!conn || c->state != CS_RUNNING) {
            if (c->state != CS_RUNNING) {
                entry_free(e);
                continue;
            }
            schedule_retry(e, "not connected");
            continue;
        }
        {
            /* XCLAIM to ourselves with no idle condition: counts a delivery
             * and returns the entry if it is still pending; with JUSTID it
             * only says whether it is, without counting. */
            const char *argv[7] = {"XCLAIM", c->stream, c->group, c->consumer, "0", e->entry_id, "JUSTID"};
            int argc = e->recheck ? 7 : 6;
            size_t lens[7];
            for (int i = 0; i < argc; i++)
                lens[i] = strlen(argv[i]);
            if (outbox__redis_command_argv(conn, argc, argv, lens, 0, e->recheck ? on_recheck : on_xclaim, e) != 0)
                schedule_retry(e, "not connected");
        }
    }
    if (c->retry_head)
        uv_timer_start(&c->retry_timer, on_retry_timer, c->retry_head->retry_at - now, 0);
}

static void on_pending_count(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    claim_ctx *x = data;
    outbox_consumer *c = x->c;
    uint64_t deliveries = 1;
    entry *e;
    (void)conn;
    /* [[id, consumer, idle, deliveries]] */
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1 &&
        reply->element[0]->type == REDIS_REPLY_ARRAY && reply->element[0]->elements == 4 &&
        reply->element[0]->element[3]->type == REDIS_REPLY_INTEGER)
        deliveries = (uint64_t)reply->element[0]->element[3]->integer;
    if (status == 0 && c->state == CS_RUNNING) {
        e = entry_from_reply(c, x->claimed, deliveries);
        if (e) {
            c->st.claimed++;
            LOG(c, OUTBOX_LOG_INFO, "msg=\"recovered an idle pending entry\" entry=%s deliveries=%llu", e->entry_id,
                (unsigned long long)deliveries);
            dispatch(e);
        }
    }
    freeReplyObject(x->claimed);
    free(x);
}

static redisReply *reply_copy(const redisReply *r)
{
    /* The module frees replies after the callback; keep what we need by
     * copying the [id, fields] pair into a fresh reply tree. */
    redisReply *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    n->type = r->type;
    n->integer = r->integer;
    if (r->str) {
        n->str = malloc(r->len + 1);
        if (!n->str) {
            free(n);
            return NULL;
        }
        memcpy(n->str, r->str, r->len);
        n->str[r->len] = '\0';
        n->len = r->len;
    }
    if (r->type == REDIS_REPLY_ARRAY && r->elements) {
        n->element = calloc(r->elements, sizeof *n->element);
        if (!n->element) {
            freeReplyObject(n);
            return NULL;
        }
        n->elements = r->elements;
        for (size_t i = 0; i < r->elements; i++)
            if (!(n->element[i] = reply_copy(r->element[i]))) {
                freeReplyObject(n);
                return NULL;
            }
    }
    return n;
}

static void on_autoclaim(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_consumer *c = data;
    (void)conn;
    /* [next-cursor, [[id, fields] ...], [deleted ids]] */
    if (status != 0 || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2 ||
        reply->element[0]->type != REDIS_REPLY_STRING || reply->element[1]->type != REDIS_REPLY_ARRAY) {
        if (status == 0 && reply->type == REDIS_REPLY_ERROR)
            LOG(c, OUTBOX_LOG_WARN, "msg=\"XAUTOCLAIM failed\" error=\"%.200s\"", reply->str);
        return;
    }
    snprintf(c->claim_cursor, sizeof c->claim_cursor, "%.*s", (int)reply->element[0]->len, reply->element[0]->str);
    for (size_t i = 0; i < reply->element[1]->elements; i++) {
        const redisReply *er = reply->element[1]->element[i];
        claim_ctx *x;
        if (er->type != REDIS_REPLY_ARRAY || er->elements != 2 || er->element[0]->type != REDIS_REPLY_STRING ||
            entry_find(c, er->element[0]->str))
            continue;
        x = calloc(1, sizeof *x);
        if (!x)
            break;
        x->c = c;
        x->claimed = reply_copy(er);
        if (!x->claimed) {
            free(x);
            break;
        }
        {
            const char *argv[7] = {"XPENDING", c->stream, c->group, er->element[0]->str, er->element[0]->str, "1",
                                   c->consumer};
            size_t lens[7];
            for (int k = 0; k < 7; k++)
                lens[k] = strlen(argv[k]);
            if (outbox__redis_command_argv(conn, 7, argv, lens, 0, on_pending_count, x) != 0) {
                freeReplyObject(x->claimed);
                free(x);
            }
        }
    }
}

static void on_claim_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    outbox__redis *conn = outbox__rconn_get(&c->cmd);
    char idle[24], count[16];
    /* A Redis error answering the group creation or a read (LOADING,
     * MISCONF, NOPERM ...) stops the read loop: retry both from here. */
    ensure_group(c);
    kick_read(c);
    if (!conn || !c->group_ready || c->state != CS_RUNNING || c->inflight >= c->s.max_inflight)
        return;
    snprintf(idle, sizeof idle, "%llu", (unsigned long long)c->s.min_idle_ms);
    snprintf(count, sizeof count, "%u", c->s.batch);
    {
        const char *argv[8] = {"XAUTOCLAIM", c->stream, c->group, c->consumer, idle, c->claim_cursor, "COUNT",
                               count};
        size_t lens[8];
        for (int i = 0; i < 8; i++)
            lens[i] = strlen(argv[i]);
        outbox__redis_command_argv(conn, 8, argv, lens, 0, on_autoclaim, c);
    }
}

static void on_gc_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    int rc;
    if (!c->db)
        return;
    /* Small batches, so the consumer's own writers are not held up. */
    sqlite3_bind_int64(c->q_gc, 1, outbox_now_ms() - (int64_t)c->s.inbox_retention_ms);
    rc = sqlite3_step(c->q_gc);
    sqlite3_reset(c->q_gc);
    /* A full batch: the next one soon, keeping the periodic repeat (a
     * repeat of 0 here would end the clean-up for good). */
    if (rc == SQLITE_DONE && sqlite3_changes(c->db) == 1000)
        uv_timer_start(&c->gc_timer, on_gc_timer, 10, uv_timer_get_repeat(&c->gc_timer));
}

/* ------------------------------------------------------------------ */
/* create / start / stop */

static char *dup_or(const char *s, const char *dflt)
{
    return strdup(s ? s : dflt);
}

static void consumer_free(outbox_consumer *c)
{
    sqlite3_finalize(c->q_insert);
    sqlite3_finalize(c->q_gc);
    sqlite3_close_v2(c->db);
    outbox__tls_config_unref(c->tls);
    free(c->redis_url);
    free(c->stream);
    free(c->group);
    free(c->consumer);
    free(c->inbox_path);
    free(c->ns);
    free(c->dead_stream);
    free(c->sentinel_user);
    free(c->sentinel_password);
    free(c);
}

static int bad(char *err, size_t errlen, const char *what)
{
    if (err && errlen)
        snprintf(err, errlen, "%s", what);
    return OUTBOX_EINVAL;
}

int outbox_consumer_create(outbox_consumer **out, uv_loop_t *loop, const outbox_consumer_settings *s, char *err,
                           size_t errlen)
{
    outbox_consumer *c;
    outbox__redis_url url;
    char msg[600], host[200], name[260];
    int e;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!s->redis_url || !*s->redis_url)
        return bad(err, errlen, "redis: no Redis URL given");
    if (!s->stream || !*s->stream || strlen(s->stream) > 256)
        return bad(err, errlen, "stream: need a stream name of 1..256 bytes");
    if (!s->group || !*s->group || strlen(s->group) > 200)
        return bad(err, errlen, "group: need a group name of 1..200 bytes");
    if (s->consumer && (!*s->consumer || strlen(s->consumer) > 200))
        return bad(err, errlen, "consumer: need a name of 1..200 bytes");
    if (s->dedup == OUTBOX_DEDUP_REDIS) {
        /* Checked here, not first when start() creates the dedup module:
         * the default namespace is "dedup:<group>". */
        const char *ns = s->key_namespace ? s->key_namespace : s->group;
        size_t nslen = strlen(ns) + (s->key_namespace ? 0 : 6);
        if (!*ns || nslen > 256 || strpbrk(ns, "{} "))
            return bad(err, errlen, "namespace: the dedup key namespace (default dedup:<group>) must be 1..256 "
                                    "bytes without braces or spaces");
    }
    if (!s->handler)
        return bad(err, errlen, "handler: required");
    if (s->dedup != OUTBOX_DEDUP_NONE && s->dedup != OUTBOX_DEDUP_REDIS && s->dedup != OUTBOX_DEDUP_SQLITE)
        return bad(err, errlen, "dedup: unknown mode");
    if (s->dedup == OUTBOX_DEDUP_SQLITE && (!s->inbox_db_path || !*s->inbox_db_path))
        return bad(err, errlen, "inbox: the SQLite dedup mode needs an inbox database path");
    if (s->batch < 1 || s->batch > 10000 || s->max_inflight < 1 || s->max_inflight > 100000)
        return bad(err, errlen, "batch must be 1..10000 and max_inflight 1..100000");
    if (s->block_ms < 1 || s->min_idle_ms < 1 || s->claim_interval_ms < 1 || s->retry_ms < 1 || s->max_deliveries < 1)
        return bad(err, errlen, "block, min-idle, claim interval, retry and max deliveries must be at least 1");
    e = outbox__sentinel_url_parse(s->redis_url, s->sentinel_user, s->sentinel_password, &url, msg, sizeof msg);
    if (e != 0) {
        if (err && errlen)
            snprintf(err, errlen, "redis: %s", msg);
        return e;
    }
    c = calloc(1, sizeof *c);
    if (!c) {
        outbox__redis_url_free(&url);
        return OUTBOX_ENOMEM;
    }
    c->loop = loop;
    c->s = *s;
    outbox_tls_defaults(&c->s.tls); /* the caller's strings; c->tls holds what they said */
    c->log.fn = s->log;
    c->log.data = s->log_data;
    c->log.min_level = s->log_level;
    if (!s->consumer) {
        if (gethostname(host, sizeof host) != 0)
            strcpy(host, "localhost");
        host[sizeof host - 1] = '\0';
        snprintf(name, sizeof name, "%s:%ld", host, (long)getpid());
    }
    c->redis_url = strdup(s->redis_url);
    c->stream = strdup(s->stream);
    c->group = strdup(s->group);
    c->consumer = dup_or(s->consumer, name);
    c->inbox_path = s->inbox_db_path ? strdup(s->inbox_db_path) : NULL;
    if (s->key_namespace) {
        c->ns = strdup(s->key_namespace);
    } else {
        /* Each group applies every message once: its own namespace. */
        c->ns = malloc(strlen(s->group) + 7);
        if (c->ns)
            sprintf(c->ns, "dedup:%s", s->group);
    }
    c->dead_stream = malloc(strlen(s->stream) + 6);
    c->sentinel_user = s->sentinel_user ? strdup(s->sentinel_user) : NULL;
    c->sentinel_password = s->sentinel_password ? strdup(s->sentinel_password) : NULL;
    if (!c->redis_url || !c->stream || !c->group || !c->consumer || !c->ns || !c->dead_stream ||
        (s->inbox_db_path && !c->inbox_path) || (s->sentinel_user && !c->sentinel_user) ||
        (s->sentinel_password && !c->sentinel_password)) {
        outbox__redis_url_free(&url);
        consumer_free(c);
        return OUTBOX_ENOMEM;
    }
    sprintf(c->dead_stream, "%s:dead", s->stream);
    strcpy(c->claim_cursor, "0-0");
    e = outbox__tls_config_for_url(url.tls, &s->tls, &c->tls, msg, sizeof msg);
    if (e != 0) {
        if (err && errlen)
            snprintf(err, errlen, "tls: %s", msg);
        outbox__redis_url_free(&url);
        consumer_free(c);
        return e;
    }

    if (s->dedup == OUTBOX_DEDUP_SQLITE) {
        char *m = NULL;
        e = outbox_db_open(c->inbox_path, OUTBOX_OPEN_CREATE, &c->db, err, errlen);
        if (e == 0 && sqlite3_exec(c->db, outbox__inbox_sql, NULL, NULL, &m) != SQLITE_OK) {
            if (err && errlen)
                snprintf(err, errlen, "inbox: cannot create table outbox_inbox: %s", m ? m : "error");
            e = OUTBOX_ESQLITE;
        }
        sqlite3_free(m);
        if (e == 0 &&
            (sqlite3_prepare_v3(c->db,
                                "INSERT INTO outbox_inbox(message_id, stream, entry_id, received_at) "
                                "VALUES (?1, ?2, ?3, ?4)",
                                -1, SQLITE_PREPARE_PERSISTENT, &c->q_insert, NULL) != SQLITE_OK ||
             sqlite3_prepare_v3(c->db,
                                "DELETE FROM outbox_inbox WHERE rowid IN (SELECT rowid FROM outbox_inbox "
                                "WHERE received_at < ?1 ORDER BY received_at LIMIT 1000)",
                                -1, SQLITE_PREPARE_PERSISTENT, &c->q_gc, NULL) != SQLITE_OK)) {
            if (err && errlen)
                snprintf(err, errlen, "inbox: %s", sqlite3_errmsg(c->db));
            e = OUTBOX_ESQLITE;
        }
        if (e != 0) {
            outbox__redis_url_free(&url);
            consumer_free(c);
            return e;
        }
    }
    {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.client_name = "outbox-consumer";
        o.tls = c->tls;
        e = outbox__rconn_init(&c->rd, loop, &url, &o, &c->log, "read");
        if (e == 0) {
            e = outbox__rconn_init(&c->cmd, loop, &url, &o, &c->log, "command");
            if (e != 0)
                outbox__rconn_discard(&c->rd);
        }
        outbox__redis_url_free(&url);
        if (e != 0) {
            consumer_free(c);
            return e;
        }
        c->rd.on_up = on_rd_up;
        c->rd.data = c;
        c->cmd.on_up = on_cmd_up;
        c->cmd.data = c;
    }
    /* No libuv handle exists before start: a consumer that is never started
     * is freed at once by destroy. */
    *out = c;
    return 0;
}

int outbox_consumer_start(outbox_consumer *c)
{
    if (!c || c->state != CS_CREATED)
        return OUTBOX_ESTATE;
    if (c->s.dedup == OUTBOX_DEDUP_REDIS) {
        outbox_dedup_settings ds;
        char err[300];
        outbox_dedup_defaults(&ds);
        ds.redis_url = c->redis_url;
        ds.sentinel_user = c->sentinel_user;
        ds.sentinel_password = c->sentinel_password;
        ds.key_namespace = c->ns;
        ds.lease_ms = c->s.dedup_lease_ms;
        ds.retention_ms = c->s.dedup_retention_ms;
        ds.log = c->s.log;
        ds.log_data = c->s.log_data;
        ds.log_level = c->s.log_level;
        if (outbox__dedup_create_shared(&c->dedup, c->loop, &ds, c->tls, err, sizeof err) != 0) {
            LOG(c, OUTBOX_LOG_ERROR, "msg=\"cannot create the dedup module\" detail=\"%s\"", err);
            return OUTBOX_EINVAL;
        }
    }
    uv_timer_init(c->loop, &c->retry_timer);
    uv_timer_init(c->loop, &c->claim_timer);
    uv_timer_init(c->loop, &c->gc_timer);
    c->retry_timer.data = c->claim_timer.data = c->gc_timer.data = c;
    c->handles = 5; /* two connections, three timers */
    c->state = CS_RUNNING;
    LOG(c, OUTBOX_LOG_INFO, "msg=\"consumer started\" stream=%s group=%s consumer=%s dedup=%s", c->stream, c->group,
        c->consumer,
        c->s.dedup == OUTBOX_DEDUP_REDIS ? "redis" : c->s.dedup == OUTBOX_DEDUP_SQLITE ? "sqlite" : "none");
    outbox__rconn_start(&c->cmd);
    outbox__rconn_start(&c->rd);
    uv_timer_start(&c->claim_timer, on_claim_timer, c->s.claim_interval_ms, c->s.claim_interval_ms);
    if (c->db)
        uv_timer_start(&c->gc_timer, on_gc_timer, 1000, c->s.inbox_retention_ms / 10 < 3600000
                                                            ? (c->s.inbox_retention_ms / 10 ? c->s.inbox_retention_ms / 10 : 1)
                                                            : 3600000);
    return 0;
}

static void finish_stop(outbox_consumer *c)
{
    void (*cb)(outbox_consumer *, void *) = c->stop_cb;
    c->state = CS_STOPPED;
    LOG(c, OUTBOX_LOG_INFO, "msg=\"consumer stopped\" applied=%llu duplicates=%llu failed=%llu dead=%llu",
        (unsigned long long)c->st.applied, (unsigned long long)c->st.duplicates, (unsigned long long)c->st.failed,
        (unsigned long long)c->st.dead_lettered);
    c->in_finish = 1;
    if (cb)
        cb(c, c->stop_data);
    c->in_finish = 0;
    if (c->destroy_pending)
        consumer_free(c);
}

static void handle_gone(outbox_consumer *c)
{
    if (--c->handles == 0)
        finish_stop(c);
}

static void on_timer_closed(uv_handle_t *h)
{
    handle_gone(h->data);
}

static void on_rconn_closed(void *data)
{
    handle_gone(data);
}

static void on_dedup_closed(void *data)
{
    handle_gone(data);
}

static void maybe_finish(outbox_consumer *c)
{
    if (c->state != CS_STOPPING || c->closing || c->inflight > 0)
        return;
    c->closing = 1;
    outbox__rconn_close(&c->cmd, on_rconn_closed, c);
    if (c->dedup) {
        c->handles++;
        outbox_dedup_destroy(c->dedup, on_dedup_closed, c);
        c->dedup = NULL;
    }
    uv_close((uv_handle_t *)&c->retry_timer, on_timer_closed);
    uv_close((uv_handle_t *)&c->claim_timer, on_timer_closed);
    uv_close((uv_handle_t *)&c->gc_timer, on_timer_closed);
}

int outbox_consumer_stop(outbox_consumer *c, void (*cb)(outbox_consumer *c, void *data), void *data)
{
    entry *e;
    if (!c || c->state != CS_RUNNING)
        return OUTBOX_ESTATE;
    c->state = CS_STOPPING;
    c->stop_cb = cb;
    c->stop_data = data;
    LOG(c, OUTBOX_LOG_INFO, "msg=\"consumer stopping\" inflight=%llu", (unsigned long long)c->inflight);
    uv_timer_stop(&c->claim_timer);
    uv_timer_stop(&c->gc_timer);
    uv_timer_stop(&c->retry_timer);
    /* The blocked XREADGROUP goes with its connection; anything it delivered
     * that we did not see stays pending in the group. */
    outbox__rconn_close(&c->rd, on_rconn_closed, c);
    /* Entries waiting for a retry stay pending in the group. */
    while ((e = c->retry_head) != NULL) {
        c->retry_head = e->rnext;
        e->in_retry = 0;
        entry_free(e);
    }
    maybe_finish(c);
    return 0;
}

void outbox_consumer_destroy(outbox_consumer *c)
{
    if (!c)
        return;
    if (c->state == CS_CREATED) {
        /* Never started: no handles, nothing to wait for. */
        outbox__rconn_discard(&c->rd);
        outbox__rconn_discard(&c->cmd);
        consumer_free(c);
        return;
    }
    if (c->state == CS_STOPPED && !c->in_finish) {
        consumer_free(c);
        return;
    }
    c->destroy_pending = 1;
    if (c->state == CS_RUNNING)
        outbox_consumer_stop(c, NULL, NULL);
}

void outbox_consumer_stats_get(const outbox_consumer *c, outbox_consumer_stats *st)
{
    if (!c || !st)
        return;
    *st = c->st;
    st->inflight = c->inflight;
}
