/*
 * lifecycle.c: create, start, stop and destroy; the Redis connection's up
 * and down events; the hooks the lower modules call back up through. Loop
 * thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "claim.h"
#include "redis/sentinel.h"
#include "relay_int.h"
#include "settings_table.h"

static void finish_stop(outbox_relay *r);
static void stop_check(outbox_relay *r);
static void begin(outbox_relay *r);
static void on_db_opened(outbox_relay *r);

/* Connected (a single node), or a cluster's slot map loaded: claims may go. */
static void on_redis_up(outbox_relay *r)
{
    r->redis.down_since = 0;
    outbox__pub_park_flush(r); /* the messages the loss left without a reply first */
    outbox__sched_schedule(r);
}

/* A node's connection is up (the single node's, or each of a cluster's as
 * it connects): the idempotent script is loaded there first. */
static void on_redis_node_up(outbox_relay *r, void *node)
{
    if (r->cfg.s.idempotent)
        outbox__pub_idem_load(r, node);
}

/* The connection was lost (or no cluster node answers): every pending reply
 * callback already ran and parked its message to send it again (or handed
 * it back); the link reconnects. */
static void on_redis_down(outbox_relay *r, int status)
{
    r->stats.reconnects++;
    r->redis.down_since = uv_now(r->loop);
    /* A group's relays share the connection: the group says it once. */
    if (!r->redis.shared || r->park.n)
        LOG(r, OUTBOX_LOG_WARN, "msg=\"in-flight messages kept to send again\" count=%zu err=%s", r->park.n,
            outbox_err_name(status));
    stop_check(r); /* lost while stopping: nothing more to wait for */
}

/* Redis cannot be used as configured (link.c logged why and holds
 * publishing). A daemon waits for the operator to fix Redis or the
 * configuration underneath it; a drain cannot finish that way and ends. */
static void on_redis_problem(outbox_relay *r)
{
    outbox__drain_fail(r, OUTBOX_ECONFIG);
}

/* One handle (or the Redis connection) closed: the stop ends with the last. */
static void handle_closed(outbox_relay *r)
{
    if (--r->stop.handles_open == 0)
        finish_stop(r);
}

static void on_handle_closed(uv_handle_t *h)
{
    handle_closed(h->data);
}

static void on_conn_closed(void *data)
{
    outbox_relay *r = data;
    if (--r->stop.handles_open == 0)
        finish_stop(r);
    else
        stop_check(r);
}

/* Closes the connection and stops reconnecting, once; the relay's stop
 * waits for it like for a handle. */
static void close_redis(outbox_relay *r)
{
    if (r->redis.state != RC_STARTED)
        return;
    r->redis.state = RC_CLOSING;
    r->stop.handles_open++;
    outbox__link_close(r, on_conn_closed, r);
}

/* Drain mode without an on_drained of the user's: the relay stops. */
static void stop_when_drained(outbox_relay *r, void *data)
{
    (void)data;
    outbox_relay_stop(r, NULL, NULL);
}

static char *dupstr(const char *s)
{
    return s ? strdup(s) : NULL;
}

void outbox__relay_config_free(struct relay_config *cfg)
{
    free(cfg->metrics_listen);
    outbox__web_config_free(cfg->web);
    outbox__redis_url_free(&cfg->url);
    outbox__tls_config_unref(cfg->tls);
    free(cfg->db_path);
    free(cfg->db_name);
    free(cfg->stream_template);
    free(cfg->redis_url_text);
    free(cfg->worker_id);
    free(cfg->stream_prefix);
    memset(cfg, 0, sizeof *cfg);
}

static void free_fields(outbox_relay *r)
{
    outbox__link_discard(r); /* initialised by a start that failed */
    /* The relay's own connection last: the last connection to close
     * checkpoints the WAL and removes the -wal and -shm files, which the
     * read-only one of the database figures cannot do. */
    sqlite3_close_v2(r->ckpt.db);
    outbox__ops_free(r);
    outbox__relay_db_close(r);
    if (r->lock.sync_ok) {
        uv_cond_destroy(&r->lock.cond);
        uv_mutex_destroy(&r->lock.mutex);
    }
    outbox__relay_config_free(&r->cfg);
    free(r->wake.wal_path);
    free(r->win.seqset);
    free(r->win.keymap);
    outbox__claim_free(r);
    free(r);
}

/* The TLS configuration is built once, here: a file that cannot be used
 * fails create, not every connection attempt, and reconnects do not read the
 * files again. TLS settings with a URL that is not rediss:// would not apply:
 * refused, naming the option. */
static int tls_config(struct relay_config *cfg, const outbox_relay_settings *s, char *err, size_t errlen)
{
    char why[512];
    const char *given = outbox__relay_tls_option_given(s);
    int e;
    /* The caller's strings are not kept: cfg->tls holds what they said. */
    outbox_tls_defaults(&cfg->s.tls);
    if (!cfg->url.tls) {
        if (given)
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "%s: given but the Redis URL is not rediss://, rediss-sentinel:// or rediss-cluster:// (TLS is only used with those)",
                                given);
        return 0;
    }
    if ((e = outbox__tls_config_create(&cfg->tls, &s->tls, why, sizeof why)) != 0)
        return outbox__errf(err, errlen, e, "tls: %s", why[0] ? why : outbox_strerror(e));
    return 0;
}

/* The settings' strings are copied; the copy's pointers point at them. */
int outbox__relay_config_init(struct relay_config *cfg, const outbox_relay_settings *s, int with_tls, char *err,
                              size_t errlen)
{
    char host[256], wid[300], msgbuf[512];
    int e;

    cfg->s = *s;
    outbox__relay_settings_resolve(&cfg->s);
    cfg->log.fn = s->log;
    cfg->log.data = s->log_data;
    cfg->log.min_level = s->log_level;
    e = outbox__sentinel_url_parse(s->redis_url, s->sentinel_user, s->sentinel_password, &cfg->url, msgbuf,
                                   sizeof msgbuf);
    if (e != 0)
        return outbox__errf(err, errlen, e, "redis: %s", msgbuf);
    /* They live on in the URL's copy only. */
    cfg->s.sentinel_user = cfg->s.sentinel_password = NULL;
    outbox__redis_url_describe(&cfg->url, cfg->url_desc, sizeof cfg->url_desc);
    if (!with_tls)
        outbox_tls_defaults(&cfg->s.tls); /* a group's relay: the group's link has the TLS configuration */
    else if ((e = tls_config(cfg, s, err, errlen)) != 0)
        return e;
    /* Read once, here: a file that cannot be used fails create, and the
     * endpoint never reads it again. */
    if (s->metrics_web_config && (e = outbox__web_config_load(&cfg->web, s->metrics_web_config, msgbuf,
                                                               sizeof msgbuf)) != 0)
        return outbox__errf(err, errlen, e, "metrics-web-config: %s", msgbuf[0] ? msgbuf : outbox_strerror(e));
    cfg->s.metrics_web_config = NULL;
    if (!s->worker_id) {
        if (gethostname(host, sizeof host) != 0)
            strcpy(host, "localhost");
        host[sizeof host - 1] = '\0';
        snprintf(wid, sizeof wid, "%s:%ld", host, (long)getpid());
    } else {
        outbox__strlcpy(wid, s->worker_id, sizeof wid);
    }
    cfg->db_path = dupstr(s->db_path);
    cfg->db_name = dupstr(s->db_name);
    cfg->stream_template = dupstr(s->stream_template);
    cfg->redis_url_text = dupstr(s->redis_url);
    cfg->worker_id = dupstr(wid);
    cfg->stream_prefix = dupstr(s->stream_prefix);
    cfg->metrics_listen = dupstr(s->metrics_listen);
    if (!cfg->db_path || (s->db_name && !cfg->db_name) || (s->stream_template && !cfg->stream_template) || !cfg->redis_url_text || !cfg->worker_id || !cfg->stream_prefix ||
        (s->metrics_listen && !cfg->metrics_listen))
        return OUTBOX_ENOMEM;
    cfg->s.db_path = cfg->db_path;
    cfg->s.db_name = cfg->db_name;
    cfg->s.stream_template = cfg->stream_template;
    /* A group keeps its own copies of these (group.c); nothing else reads them. */
    cfg->s.db_dir = cfg->s.db_glob = NULL;
    cfg->s.redis_url = cfg->redis_url_text;
    cfg->s.worker_id = cfg->worker_id;
    cfg->s.stream_prefix = cfg->stream_prefix;
    cfg->s.metrics_listen = cfg->metrics_listen;
    if (!cfg->s.on_drained) {
        cfg->s.on_drained = stop_when_drained;
        cfg->s.on_drained_data = NULL;
    }
    return 0;
}

/* The relay's connection is open: its hooks. Registering a WAL hook turns
 * off auto-checkpoint on it: checkpoints run on a worker thread instead of
 * inside our commits. */
static void db_hooks(outbox_relay *r)
{
    sqlite3_wal_hook(r->db.conn, outbox__wake_own_wal_hook, r);
    sqlite3_busy_handler(r->db.conn, outbox__sched_busy_handler, r);
}

/* Opens the database at create. With wait_for_db, a failure that heals
 * (a full disk, a lock) is the start of a wait instead (dbwait.c). */
static int open_db(outbox_relay *r, char *err, size_t errlen)
{
    outbox__sqlfail f;
    char why[512] = "";
    int e = outbox__relay_db_open(r, 1, &f, why, sizeof why);
    if (e == 0) {
        db_hooks(r);
        return 0;
    }
    outbox__relay_db_close(r);
    if (r->cfg.s.wait_for_db && outbox__relay_db_heals(e, &f)) {
        outbox__dbwait_begin(r, e, &f, why[0] ? why : outbox_strerror(e));
        return 0;
    }
    if (err && errlen)
        outbox__strlcpy(err, why, errlen);
    return e;
}

int outbox_relay_create(outbox_relay **out, uv_loop_t *loop, const outbox_relay_settings *s, char *err,
                        size_t errlen)
{
    if (s && s->db_dir) {
        if (err && errlen)
            err[0] = '\0';
        if (out)
            *out = NULL;
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "db-dir: a directory of databases needs a group (outbox_relay_group_create)");
    }
    return outbox__relay_create_on(out, loop, s, NULL, err, errlen);
}

int outbox__relay_create_on(outbox_relay **out, uv_loop_t *loop, const outbox_relay_settings *s,
                            struct relay_link *link, char *err, size_t errlen)
{
    outbox_relay *r;
    int e;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if ((e = outbox__relay_check_settings(s, err, errlen)) != 0)
        return e;
    r = calloc(1, sizeof *r);
    if (!r)
        return OUTBOX_ENOMEM;
    r->loop = loop;
    if (link) {
        r->redis.l = link;
        r->redis.shared = 1;
    }
    r->hooks.schedule = outbox__sched_schedule;
    r->hooks.parked = outbox__sched_parked;
    r->hooks.stop_check = stop_check;
    r->hooks.closed = handle_closed;
    r->hooks.db_opened = on_db_opened;
    if (uv_mutex_init(&r->lock.mutex) == 0) {
        if (uv_cond_init(&r->lock.cond) == 0)
            r->lock.sync_ok = 1;
        else
            uv_mutex_destroy(&r->lock.mutex);
    }
    e = outbox__relay_config_init(&r->cfg, s, !link, err, errlen);
    if (e == 0) {
        outbox__ops_init(r);
        if (link)
            outbox__dbwait_defer(r); /* opened on a worker thread at start */
        else
            e = open_db(r, err, errlen);
    }
    if (e != 0) {
        free_fields(r);
        return e;
    }
    *out = r;
    return 0;
}

int outbox_relay_start(outbox_relay *r)
{
    int e;
    char err[300];
    if (!r || r->state != R_CREATED)
        return OUTBOX_ESTATE;
    /* Binding the metrics port (and memory) are the only things that can
     * fail: first, so a failed start leaves nothing to close. */
    if (r->redis.state == RC_NONE) {
        static const struct link_hooks hooks = {on_redis_up, on_redis_down, on_redis_problem, on_redis_node_up};
        if (outbox__link_init(r, &hooks) != 0)
            return OUTBOX_ENOMEM;
    }
    e = outbox__ops_listen(r, err, sizeof err);
    if (e != 0) {
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot start\" error=\"%s\"", err);
        return e;
    }
    /* Every handle initialised here is counted, and closed by stop_check. */
    r->stop.handles_open = outbox__sched_init(r);
    r->stop.handles_open += outbox__pub_park_init(r);
    uv_timer_init(r->loop, &r->stop.shutdown_timer);
    r->stop.shutdown_timer.data = r;
    r->stop.handles_open++;
    r->stop.handles_open += outbox__ops_start(r);
    r->stop.handles_open += outbox__dbwait_start(r);
    if (r->dbwait.waiting)
        r->state = R_WAITING; /* on_db_opened begins */
    else
        begin(r);
    return 0;
}

/* The database is open: what needs it starts (wake-ups, retention), then
 * Redis and the first scan. */
static void begin(outbox_relay *r)
{
    r->stop.began = 1;
    r->stop.handles_open += outbox__wake_init(r);
    r->stop.handles_open += outbox__retention_start(r);
    r->redis.down_since = uv_now(r->loop);
    r->state = R_RUNNING;
    LOG(r, LOG_LIFE(r), "msg=started worker=%s db=%s redis=%s batch=%u inflight=%u", r->cfg.worker_id,
        r->cfg.db_path, r->cfg.url_desc, r->cfg.s.batch, r->cfg.s.inflight);
    outbox__link_start(r);
    /* The first unit: a kick, which a link already up (a group's) also
     * asks for, so that the two make one unit, not a second one behind
     * the first (a scan timer of 0 ms did). The scan timer follows it. */
    outbox__sched_schedule(r);
    /* A group's relay was opened for a commit whose directory events came
     * while it opened (the group hands events only to running relays):
     * looks again shortly, as after any change to the WAL. */
    if (r->redis.shared)
        outbox__wake_look(r);
}

/* The wait for the database is over (dbwait.c). */
static void on_db_opened(outbox_relay *r)
{
    db_hooks(r);
    begin(r);
}

static void finish_stop(outbox_relay *r)
{
    void (*cb)(outbox_relay *, void *) = r->stop.cb;
    void *data = r->stop.data;
    r->state = R_STOPPED;
    LOG(r, LOG_LIFE(r), "msg=stopped published=%llu failed=%llu dead=%llu fenced=%llu",
        (unsigned long long)r->stats.published_total, (unsigned long long)r->stats.failed_total,
        (unsigned long long)r->stats.dead_total, (unsigned long long)r->stats.fenced_total);
    r->stop.in_finish = 1;
    if (cb)
        cb(r, data);
    r->stop.in_finish = 0;
    if (r->stop.destroy_pending)
        free_fields(r);
}

/* A stop in progress ends once nothing is awaited any more: no reply, no
 * work on a worker thread, no mark left to write. Then every handle closes. */
static void stop_check(outbox_relay *r)
{
    msg *m;
    if (r->state != R_STOPPING || r->stop.closing)
        return;
    if (r->win.awaiting > 0 || r->ckpt.running || r->ops.dbstat_running || r->ret.running || r->sched.running ||
        r->dbwait.running)
        return;
    if (r->win.marks_head) {
        /* Marks still to write: a unit writes them (or its busy retry does).
         * A database that fails 200 units in a row loses only the marks: the
         * rows' leases expire and another relay publishes them again
         * (duplicates, never a loss). */
        if (r->sched.stop_failures <= 200) {
            outbox__sched_schedule(r);
            return;
        }
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot write the last marks; their rows will be taken over when the "
                                 "leases expire\"");
        while ((m = r->win.marks_head) != NULL) {
            r->win.marks_head = m->next;
            r->win.inflight--;
            outbox__win_retire(r, m);
        }
        r->win.marks_tail = NULL;
        r->win.marks_len = 0;
        r->win.releases = 0;
    }
    r->stop.closing = 1;
    close_redis(r);
    outbox__sched_close(r, on_handle_closed);
    outbox__pub_park_close(r, on_handle_closed);
    uv_close((uv_handle_t *)&r->stop.shutdown_timer, on_handle_closed);
    outbox__dbwait_close(r, on_handle_closed);
    if (r->stop.began) {
        outbox__wake_close(r, on_handle_closed);
        outbox__retention_close(r, on_handle_closed);
    }
    outbox__ops_close(r, on_handle_closed);
}

/* How often the timeout looks again at messages claimed before the stop
 * that were not sent yet when it expired. */
#define SHUTDOWN_RECHECK_MS 20

static void on_shutdown_timeout(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    if (r->win.awaiting) {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"shutdown timeout: handing back messages without a reply\" count=%llu",
            (unsigned long long)r->win.awaiting);
        /* Dropping fails every pending reply: each one releases its row. */
        outbox__link_reset(r, "shutdown timeout");
    }
    /* A claim that was running when the stop came still sends its messages
     * afterwards: once they wait for replies they are handed back too, so
     * that the stop never outlasts the timeout by much. */
    if (r->win.inflight > r->win.awaiting)
        uv_timer_start(&r->stop.shutdown_timer, on_shutdown_timeout, SHUTDOWN_RECHECK_MS, 0);
    stop_check(r);
}

int outbox_relay_stop(outbox_relay *r, void (*cb)(outbox_relay *r, void *data), void *data)
{
    if (!r || (r->state != R_RUNNING && r->state != R_WAITING))
        return OUTBOX_ESTATE;
    r->state = R_STOPPING;
    r->stop.cb = cb;
    r->stop.data = data;
    LOG(r, LOG_LIFE(r), "msg=stopping inflight=%llu awaiting_replies=%llu", (unsigned long long)r->win.inflight,
        (unsigned long long)r->win.awaiting);
    uv_timer_stop(&r->sched.scan_timer);
    /* Stopped while waiting for the database: a try on a worker thread
     * still ends (stop_check waits for it); nothing else was started. */
    outbox__dbwait_stop(r);
    if (r->stop.began) {
        outbox__retention_stop(r);
        outbox__wake_stop(r);
        /* No more reconnects; a live connection stays for the replies awaited. */
        outbox__link_hold(r);
        outbox__pub_park_release(r, "held back: relay stopping");
        /* Messages awaiting replies, or claimed and about to be sent (a
         * unit's claim running now): either may wait for Redis. */
        if (r->win.awaiting || r->win.inflight || r->sched.running)
            uv_timer_start(&r->stop.shutdown_timer, on_shutdown_timeout, r->cfg.s.shutdown_timeout_ms, 0);
        outbox__sched_schedule(r);
    }
    stop_check(r);
    return 0;
}

void outbox_relay_destroy(outbox_relay *r)
{
    if (!r)
        return;
    if (r->state == R_CREATED || (r->state == R_STOPPED && !r->stop.in_finish)) {
        free_fields(r);
        return;
    }
    r->stop.destroy_pending = 1;
    if (r->state == R_RUNNING || r->state == R_WAITING)
        outbox_relay_stop(r, NULL, NULL);
}
