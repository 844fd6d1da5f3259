/*
 * consumer.c: the consumer-group helper (include/outbox/consumer.h;
 * consumer_int.h): the object itself. Defaults, create (the checks of the
 * settings, the copies, the inbox database, the two connections), start
 * (the dedup module and the timers), stop and the closing of every handle,
 * destroy (deferred while the stop callback runs), the stats and the group's
 * figures (XINFO GROUPS).
 *
 * Two Redis connections: one for XREADGROUP ... BLOCK (a blocked command
 * holds its connection), one for everything else (group creation, XACK,
 * XCLAIM/XAUTOCLAIM/XPENDING, dead letters). The Redis dedup module has its
 * own. With a Cluster URL the two connections are two cluster layers
 * (cluster.h): every command names its key (the stream, or the dead
 * stream), and the layer sends it to the node of that key's slot and
 * follows MOVED and ASK; the stream's consumer group and its pending
 * entries move with the stream key, and so do the dedup keys (the stream
 * is their hash tag). Each delivered entry becomes an `entry` that lives until it is
 * acknowledged, dead-lettered, or left pending for a later delivery.
 * Reading is in consumer_read.c, entries and retries in consumer_deliver.c,
 * the handler and its dedup in consumer_dedup.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "consumer_int.h"
#include "sqlite_util.h"
#include "outbox/schema.h"

extern const char outbox__inbox_sql[];

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
    if (url.cluster) {
        outbox__cluster_options o;
        outbox__cluster_hooks rh = {outbox__consumer_on_rd_ready, NULL, NULL, c};
        outbox__cluster_hooks ch = {outbox__consumer_on_cmd_ready, NULL, NULL, c};
        outbox__cluster_options_defaults(&o);
        o.redis.client_name = "outbox-consumer";
        o.redis.tls = c->tls;
        e = outbox__cluster_create(&c->ccmd, loop, &url, &o, &c->log, "command", &ch);
        /* The read layer's own commands (its slot map refreshes) may wait
         * behind a blocked XREADGROUP on a node's connection: up to the
         * block, which must not count as that connection timing out. */
        o.redis.reply_timeout_ms = s->block_ms + o.redis.reply_timeout_ms;
        if (e == 0 && (e = outbox__cluster_create(&c->crd, loop, &url, &o, &c->log, "read", &rh)) != 0) {
            outbox__cluster_close(c->ccmd, NULL, NULL); /* never started: freed at once */
            c->ccmd = NULL;
        }
        outbox__redis_url_free(&url);
        if (e != 0) {
            consumer_free(c);
            return e;
        }
    } else {
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
        c->rd.on_up = outbox__consumer_on_rd_up;
        c->rd.data = c;
        c->cmd.on_up = outbox__consumer_on_cmd_up;
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
    uv_timer_init(c->loop, &c->read_timer);
    c->retry_timer.data = c->claim_timer.data = c->gc_timer.data = c->read_timer.data = c;
    c->handles = 6; /* two connections (or cluster layers), four timers */
    c->state = CS_RUNNING;
    LOG(c, OUTBOX_LOG_INFO, "msg=\"consumer started\" stream=%s group=%s consumer=%s dedup=%s", c->stream, c->group,
        c->consumer,
        c->s.dedup == OUTBOX_DEDUP_REDIS ? "redis" : c->s.dedup == OUTBOX_DEDUP_SQLITE ? "sqlite" : "none");
    if (c->ccmd) {
        outbox__cluster_start(c->ccmd);
        outbox__cluster_start(c->crd);
    } else {
        outbox__rconn_start(&c->cmd);
        outbox__rconn_start(&c->rd);
    }
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

static void on_rconn_closed(void *data)
{
    handle_gone(data);
}

static void on_dedup_closed(void *data)
{
    handle_gone(data);
}

void outbox__consumer_maybe_finish(outbox_consumer *c)
{
    if (c->state != CS_STOPPING || c->closing || c->inflight > 0)
        return;
    c->closing = 1;
    if (c->ccmd) {
        outbox__cluster_close(c->ccmd, on_rconn_closed, c);
        c->ccmd = NULL;
    } else {
        outbox__rconn_close(&c->cmd, on_rconn_closed, c);
    }
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
    if (c->crd) {
        outbox__cluster *rd = c->crd;
        c->crd = NULL;
        outbox__cluster_close(rd, on_rconn_closed, c);
    } else {
        outbox__rconn_close(&c->rd, on_rconn_closed, c);
    }
    /* Entries waiting for a retry stay pending in the group. */
    while ((e = c->retry_head) != NULL) {
        c->retry_head = e->rnext;
        e->in_retry = 0;
        outbox__consumer_entry_free(e);
    }
    outbox__consumer_maybe_finish(c);
    return 0;
}

void outbox_consumer_destroy(outbox_consumer *c)
{
    if (!c)
        return;
    if (c->state == CS_CREATED) {
        /* Never started: no handles, nothing to wait for (a cluster layer
         * that was not started is freed at once by its close). */
        if (c->ccmd) {
            outbox__cluster_close(c->crd, NULL, NULL);
            outbox__cluster_close(c->ccmd, NULL, NULL);
        } else {
            outbox__rconn_discard(&c->rd);
            outbox__rconn_discard(&c->cmd);
        }
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

int outbox__consumer_cmd_ready(const outbox_consumer *c)
{
    return c->ccmd ? outbox__cluster_ready(c->ccmd) : outbox__rconn_get(&c->cmd) != NULL;
}

int outbox__consumer_command(outbox_consumer *c, const char *key, int argc, const char **argv, const size_t *lens,
                             outbox__redis_reply_cb cb, void *data)
{
    outbox__redis *conn;
    if (c->ccmd)
        return outbox__cluster_command_argv(c->ccmd, key, strlen(key), argc, argv, lens, 0, cb, data, NULL);
    if (!(conn = outbox__rconn_get(&c->cmd)))
        return OUTBOX_ECONNECT;
    return outbox__redis_command_argv(conn, argc, argv, lens, 0, cb, data);
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

/* A field of one group's flat key/value list, or NULL. */
static const redisReply *group_field(const redisReply *g, const char *name)
{
    for (size_t i = 0; i + 1 < g->elements; i += 2)
        if (g->element[i]->type == REDIS_REPLY_STATUS || g->element[i]->type == REDIS_REPLY_STRING)
            if (!strcmp(g->element[i]->str, name))
                return g->element[i + 1];
    return NULL;
}

static void on_group_info(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    group_info_req *q = data;
    outbox_consumer_group_info gi = {0, -1};
    int found = 0;
    (void)conn;
    if (status == 0 && reply->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < reply->elements && !found; i++) {
            const redisReply *g = reply->element[i], *name, *v;
            if (g->type != REDIS_REPLY_ARRAY || !(name = group_field(g, "name")) || !name->str ||
                strcmp(name->str, q->c->group) != 0)
                continue;
            found = 1;
            if ((v = group_field(g, "pending")) && v->type == REDIS_REPLY_INTEGER)
                gi.pending = v->integer;
            /* Nil when Redis cannot tell (entries deleted); absent before 7.0. */
            if ((v = group_field(g, "lag")) && v->type == REDIS_REPLY_INTEGER)
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
