/*
 * consumer.c: the consumer-group helper (include/outbox/consumer.h;
 * consumer_int.h): the object itself. Create (the settings' checks from
 * settings_table.h, the copies, the inbox database, the two targets),
 * start (the dedup module and the timers), stop and the closing of every
 * handle, destroy (deferred while the stop callback runs), the stats, the
 * group's figures (XINFO GROUPS), and
 * the hooks the lower files call back up through.
 *
 * Two targets (redis/target.h), created for the URL by
 * outbox__target_create: one for XREADGROUP ... BLOCK (a blocked command
 * holds its connection), one for everything else (group creation, XACK,
 * XCLAIM/XAUTOCLAIM/XPENDING, dead letters). The Redis dedup module has its
 * own. Every command names its key (the stream, or the dead stream); on a
 * cluster the target sends it to the node of that key's slot and follows
 * MOVED and ASK: the stream's consumer group and its pending entries move
 * with the stream key, and so do the dedup keys (the stream is their hash
 * tag). Each delivered entry becomes an `entry` that lives until it is
 * acknowledged, dead-lettered, or left pending for a later delivery.
 * Reading is in read.c, the handler and its dedup in dispatch.c, entries
 * and retries in deliver.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "consumer/consumer_int.h"
#include "consumer/settings_table.h"
#include "redis/cluster/target.h"
#include "store/sqlite_util.h"
#include "outbox/schema.h"

extern const char outbox__inbox_sql[];

static void maybe_finish(outbox_consumer *c);

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

/* Drained without an on_drained of the user's: the consumer stops. */
static void stop_when_drained(outbox_consumer *c, void *data)
{
    (void)data;
    outbox_consumer_stop(c, NULL, NULL);
}

/* hooks.entry_gone: an entry left, so there is room to read more, and a
 * stop waiting for the last entry may finish. */
static void entry_gone(outbox_consumer *c)
{
    outbox__consumer_kick_read(c);
    maybe_finish(c);
}

static int open_inbox(outbox_consumer *c, char *err, size_t errlen)
{
    char *m = NULL;
    int e = outbox_db_open(c->inbox_path, OUTBOX_OPEN_CREATE, &c->db, err, errlen);
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
    return e;
}

/* The two targets for url; the read target's commands block up to the
 * block time. */
static int create_targets(outbox_consumer *c, const outbox__redis_url *url)
{
    outbox__target_options o;
    outbox__target_hooks rh = {outbox__consumer_on_rd_up, NULL, NULL, NULL, c};
    outbox__target_hooks ch = {outbox__consumer_on_cmd_up, NULL, NULL, NULL, c};
    int e;
    outbox__target_options_defaults(&o);
    o.redis.client_name = "outbox-consumer";
    o.redis.tls = c->tls;
    o.log = &c->log;
    o.what = "command";
    e = outbox__target_create(&c->cmd, c->loop, url, &o, &ch);
    o.what = "read";
    o.blocking_ms = c->s.block_ms;
    if (e == 0 && (e = outbox__target_create(&c->rd, c->loop, url, &o, &rh)) != 0) {
        outbox__target_close(c->cmd, NULL, NULL); /* never started: freed at once */
        c->cmd = NULL;
    }
    return e;
}

int outbox_consumer_create(outbox_consumer **out, uv_loop_t *loop, const outbox_consumer_settings *s, char *err,
                           size_t errlen)
{
    outbox_consumer *c;
    outbox__redis_url url;
    outbox__tls_config *tls;
    char host[200], name[260];
    int e;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if ((e = outbox__consumer_check_settings(s, err, errlen)) != 0)
        return e;
    e = outbox__target_url_setup(s->redis_url, s->sentinel_user, s->sentinel_password, &s->tls, &url, &tls, err,
                                 errlen);
    if (e != 0)
        return e;
    c = calloc(1, sizeof *c);
    if (!c) {
        outbox__redis_url_free(&url);
        outbox__tls_config_unref(tls);
        return OUTBOX_ENOMEM;
    }
    c->loop = loop;
    c->s = *s;
    c->tls = tls; /* rediss://: shared by both targets and the dedup module */
    outbox_tls_defaults(&c->s.tls); /* the caller's strings; c->tls holds what they said */
    if (!c->s.on_drained)
        c->s.on_drained = stop_when_drained;
    c->hooks.dispatch = outbox__consumer_dispatch;
    c->hooks.complete = outbox__consumer_complete;
    c->hooks.entry_gone = entry_gone;
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
        e = OUTBOX_ENOMEM;
    } else {
        sprintf(c->dead_stream, "%s:dead", s->stream);
        strcpy(c->claim_cursor, "0-0");
        if (s->dedup == OUTBOX_DEDUP_SQLITE)
            e = open_inbox(c, err, errlen);
    }
    if (e == 0)
        e = create_targets(c, &url);
    outbox__redis_url_free(&url);
    if (e != 0) {
        consumer_free(c);
        return e;
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
    uv_timer_init(c->loop, &c->read_timer);
    c->retry_timer.data = c->claim_timer.data = c->gc_timer.data = c->read_timer.data = c;
    c->handles = 6; /* two targets, four timers */
    c->state = CS_RUNNING;
    LOG(c, OUTBOX_LOG_INFO, "msg=\"consumer started\" stream=%s group=%s consumer=%s dedup=%s", c->stream, c->group,
        c->consumer,
        c->s.dedup == OUTBOX_DEDUP_REDIS ? "redis" : c->s.dedup == OUTBOX_DEDUP_SQLITE ? "sqlite" : "none");
    outbox__target_start(c->cmd);
    outbox__target_start(c->rd);
    uv_timer_start(&c->claim_timer, outbox__consumer_on_claim_timer, c->s.claim_interval_ms, c->s.claim_interval_ms);
    if (c->db)
        uv_timer_start(&c->gc_timer, outbox__consumer_on_gc_timer, 1000, c->s.inbox_retention_ms / 10 < 3600000
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

static void on_target_closed(void *data)
{
    handle_gone(data);
}

static void on_dedup_closed(void *data)
{
    handle_gone(data);
}

/* Closes the handles once a stop has no entry left in flight. */
static void maybe_finish(outbox_consumer *c)
{
    outbox__target *cmd;
    if (c->state != CS_STOPPING || c->closing || c->inflight > 0)
        return;
    c->closing = 1;
    cmd = c->cmd;
    c->cmd = NULL;
    outbox__target_close(cmd, on_target_closed, c);
    if (c->dedup) {
        c->handles++;
        outbox_dedup_destroy(c->dedup, on_dedup_closed, c);
        c->dedup = NULL;
    }
    uv_close((uv_handle_t *)&c->retry_timer, on_timer_closed);
    uv_close((uv_handle_t *)&c->claim_timer, on_timer_closed);
    uv_close((uv_handle_t *)&c->gc_timer, on_timer_closed);
    uv_close((uv_handle_t *)&c->read_timer, on_timer_closed);
}

int outbox_consumer_stop(outbox_consumer *c, void (*cb)(outbox_consumer *c, void *data), void *data)
{
    outbox__target *rd;
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
    uv_timer_stop(&c->read_timer);
    /* The blocked XREADGROUP goes with its connection; anything it delivered
     * that we did not see stays pending in the group. */
    rd = c->rd;
    c->rd = NULL;
    outbox__target_close(rd, on_target_closed, c);
    /* Entries waiting for a retry stay pending in the group. */
    while ((e = c->retry_head) != NULL) {
        c->retry_head = e->rnext;
        e->in_retry = 0;
        outbox__consumer_entry_free(e);
    }
    maybe_finish(c);
    return 0;
}

void outbox_consumer_destroy(outbox_consumer *c)
{
    if (!c)
        return;
    if (c->state == CS_CREATED) {
        /* Never started: no handles, nothing to wait for (a target that
         * was not started is freed at once by its close). */
        outbox__target_close(c->rd, NULL, NULL);
        outbox__target_close(c->cmd, NULL, NULL);
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


typedef struct group_info_req {
    outbox_consumer *c;
    outbox_consumer_group_info_cb cb;
    void *data;
} group_info_req;

static void on_group_info(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    group_info_req *q = data;
    outbox_consumer_group_info gi = {0, -1};
    int found = 0;
    (void)conn;
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < reply->elements && !found; i++) {
            const redisReply *g = reply->element[i], *name, *v;
            if (g->type != REDIS_REPLY_ARRAY || !(name = outbox__reply_map_get(g, "name")) || !name->str ||
                strcmp(name->str, q->c->group) != 0)
                continue;
            found = 1;
            if ((v = outbox__reply_map_get(g, "pending")) && v->type == REDIS_REPLY_INTEGER)
                gi.pending = v->integer;
            /* Nil when Redis cannot tell (entries deleted); absent before 7.0. */
            if ((v = outbox__reply_map_get(g, "lag")) && v->type == REDIS_REPLY_INTEGER)
                gi.lag = v->integer;
        }
    }
    if (status == 0 && !found)
        status = OUTBOX_EREDIS;
    q->cb(q->c, status, status == 0 ? &gi : NULL, q->data);
    free(q);
}

int outbox_consumer_group_info_get(outbox_consumer *c, outbox_consumer_group_info_cb cb, void *data)
{
    const char *argv[3] = {"XINFO", "GROUPS", NULL};
    size_t lens[3];
    group_info_req *q;
    int e;
    if (!c || !cb || c->state != CS_RUNNING)
        return OUTBOX_ESTATE;
    if (!outbox__consumer_cmd_ready(c))
        return OUTBOX_ECONNECT;
    if (!(q = malloc(sizeof *q)))
        return OUTBOX_ENOMEM;
    q->c = c;
    q->cb = cb;
    q->data = data;
    argv[2] = c->stream;
    for (int i = 0; i < 3; i++)
        lens[i] = strlen(argv[i]);
    if ((e = outbox__consumer_command(c, c->stream, 3, argv, lens, on_group_info, q)) != 0)
        free(q);
    return e;
}
