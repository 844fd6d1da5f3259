/*
 * ops.c: what operating the relay needs: the loop-stall measure, the
 * database figures (refreshed on a worker thread
 * with a read-only connection of their own), /metrics and /healthz, and
 * outbox_relay_stats_get. Loop thread, except dbstat_run.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/figures.h"
#include "relay_int.h"
#include "util/array.h"

static void answer(outbox_relay *r, outbox__http_req *req, const char *path);
static void dbstat_refresh(outbox_relay *r);

static const double latency_bounds[] = {0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
static const double size_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
static const double claim_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1};
static const double stall_bounds[] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};

void outbox__ops_init(outbox_relay *r)
{
    outbox__topics_init(&r->stats.topics, 1000);
    outbox__hist_init(&r->stats.h_latency, latency_bounds, OUTBOX_ARRAY_LEN(latency_bounds));
    outbox__hist_init(&r->stats.h_claim_size, size_bounds, OUTBOX_ARRAY_LEN(size_bounds));
    outbox__hist_init(&r->stats.h_claim_secs, claim_bounds, OUTBOX_ARRAY_LEN(claim_bounds));
    outbox__hist_init(&r->stats.h_stall, stall_bounds, OUTBOX_ARRAY_LEN(stall_bounds));
}

/* An iteration's own work is the time from the end of one poll (check) to
 * the start of the next (prepare): that is how long the loop was stalled. */
static void on_stall_check(uv_check_t *h)
{
    (void)h;
}

/* From one prepare to the next is one loop iteration; minus the time the
 * loop slept in the kernel (uv_metrics_idle_time) it is the time the
 * iteration's callbacks held the loop. */
static void on_stall_prepare(uv_prepare_t *h)
{
    outbox_relay *r = h->data;
    uint64_t now = uv_hrtime(), idle = uv_metrics_idle_time(r->loop), d;
    if (!r->ops.loop_mark_ns) {
        r->ops.loop_mark_ns = now;
        r->ops.loop_idle_ns = idle;
        return;
    }
    d = now - r->ops.loop_mark_ns - (idle - r->ops.loop_idle_ns);
    r->ops.loop_mark_ns = now;
    r->ops.loop_idle_ns = idle;
    if (d > r->ops.stall_max_ns)
        r->ops.stall_max_ns = d;
    outbox__hist_observe(&r->stats.h_stall, (double)d / 1e9);
}

/* Runs on a libuv worker thread with its own read-only connection, so that
 * even a slow disk never holds up publishing. The figures come from the
 * batch records, the cursor and the indexes (src/figures.h): their cost
 * does not grow with the table. */
static void dbstat_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    struct relay_dbstat *d = &r->ops.dbstat_tmp;
    outbox__figures f;
    int64_t now = outbox_now_ms();
    int rc;
    memset(d, 0, sizeof *d);
    if (!r->ops.dbstat_db) {
        rc = sqlite3_open_v2(r->cfg.db_path, &r->ops.dbstat_db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
        if (rc != SQLITE_OK) {
            snprintf(d->err, sizeof d->err, "cannot open the database: %s",
                     r->ops.dbstat_db ? sqlite3_errmsg(r->ops.dbstat_db) : sqlite3_errstr(rc));
            sqlite3_close_v2(r->ops.dbstat_db);
            r->ops.dbstat_db = NULL;
            return;
        }
        sqlite3_busy_timeout(r->ops.dbstat_db, 1000);
    }
    if (outbox__figures_read(r->ops.dbstat_db, now, &f) != 0) {
        snprintf(d->err, sizeof d->err, "database query failed: %s", sqlite3_errmsg(r->ops.dbstat_db));
        return;
    }
    memcpy(d->by_state, f.by_state, sizeof d->by_state);
    d->oldest_due_ms = f.oldest_due_at >= 0 ? now - f.oldest_due_at : 0;
    d->ok = 1;
}

static void dbstat_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    size_t i, n = r->ops.nwaiting;
    (void)status;
    r->ops.dbstat_running = 0;
    r->ops.dbstat = r->ops.dbstat_tmp;
    r->ops.dbstat_at = uv_now(r->loop);
    r->ops.nwaiting = 0;
    for (i = 0; i < n; i++) {
        answer(r, r->ops.waiting_reqs[i], r->ops.waiting_paths[i]);
        free(r->ops.waiting_paths[i]);
    }
    r->hooks.stop_check(r);
}

/* One per-topic counter family. Topics beyond the table's limit are counted
 * in the shared "_other" entry, which must be shown too or the family's sum
 * would fall short of the total; a real topic of that name gets its sum, so
 * no two series carry the same labels. */
static void topic_family(outbox__sbuf *b, const outbox_relay *r, const char *name, size_t off)
{
    const outbox__topics *t = &r->stats.topics;
    uint64_t other = *(const uint64_t *)(const void *)((const char *)&t->other + off);
    size_t i;
    for (i = 0; i <= t->cap; i++) {
        const outbox__topic_stat *ts = i < t->cap ? &t->slots[i] : &t->other;
        uint64_t v;
        if (!ts->topic)
            continue;
        if (i < t->cap) {
            v = *(const uint64_t *)(const void *)((const char *)ts + off);
            if (strcmp(ts->topic, t->other.topic) == 0) {
                v += other;
                other = 0;
            }
        } else if (other) {
            v = other;
        } else {
            continue;
        }
        outbox__sbuf_printf(b, "%s{topic=\"", name);
        outbox__prom_label_value(b, ts->topic);
        outbox__sbuf_printf(b, "\"} %llu\n", (unsigned long long)v);
    }
}

/* Per node figures of a cluster (nothing for a single node). */
static void cluster_metrics(outbox_relay *r, outbox__sbuf *b)
{
    static const struct {
        const char *name, *help, *type;
        size_t off;
    } fam[] = {
        {"outbox_redis_node_connected", "1 while the relay's connection to this cluster node is up.", "gauge",
         offsetof(outbox__target_node_stats, connected)},
        {"outbox_redis_node_master", "1 while this cluster node serves slots in the relay's slot map.", "gauge",
         offsetof(outbox__target_node_stats, master)},
        {"outbox_redis_node_moved_total", "MOVED redirections this cluster node answered.", "counter",
         offsetof(outbox__target_node_stats, moved)},
        {"outbox_redis_node_ask_total", "ASK redirections this cluster node answered.", "counter",
         offsetof(outbox__target_node_stats, ask)},
        {"outbox_redis_node_tryagain_total", "TRYAGAIN, CLUSTERDOWN, LOADING or READONLY replies retried.", "counter",
         offsetof(outbox__target_node_stats, tryagain)},
        {"outbox_redis_node_errors_total", "Connections to this cluster node that failed or were lost.", "counter",
         offsetof(outbox__target_node_stats, errors)},
    };
    outbox__target_node_stats st[64];
    uint64_t refreshes, failed;
    size_t n = outbox__link_nodes(r, st, OUTBOX_ARRAY_LEN(st), &refreshes, &failed);
    if (!outbox__link_routes(r))
        return;
    if (n > OUTBOX_ARRAY_LEN(st))
        n = OUTBOX_ARRAY_LEN(st);
    for (size_t f = 0; f < OUTBOX_ARRAY_LEN(fam); f++) {
        outbox__sbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", fam[f].name, fam[f].help, fam[f].name, fam[f].type);
        for (size_t i = 0; i < n; i++) {
            const char *p = (const char *)&st[i] + fam[f].off;
            unsigned long long v = fam[f].off <= offsetof(outbox__target_node_stats, master)
                                       ? (unsigned long long)*(const int *)p
                                       : (unsigned long long)*(const uint64_t *)p;
            outbox__sbuf_printf(b, "%s{node=\"%s\"} %llu\n", fam[f].name, st[i].name, v);
        }
    }
    outbox__sbuf_printf(b,
                        "# HELP outbox_redis_slot_map_refreshes_total Cluster slot map refreshes that succeeded.\n"
                        "# TYPE outbox_redis_slot_map_refreshes_total counter\noutbox_redis_slot_map_refreshes_total %llu\n"
                        "# HELP outbox_redis_slot_map_refresh_failures_total Cluster slot map refreshes that no node answered.\n"
                        "# TYPE outbox_redis_slot_map_refresh_failures_total counter\n"
                        "outbox_redis_slot_map_refresh_failures_total %llu\n",
                        (unsigned long long)refreshes, (unsigned long long)failed);
}

static void write_metrics(outbox_relay *r, outbox__sbuf *b)
{
    static const char *const states[OUTBOX_STATE_COUNT] = {"pending", "sending", "published", "dead"};
    size_t i;

    outbox__sbuf_printf(b, "# HELP outbox_messages Outbox rows by state (from the database).\n"
                           "# TYPE outbox_messages gauge\n");
    for (i = 0; i < OUTBOX_STATE_COUNT; i++)
        if (r->ops.dbstat.ok)
            outbox__sbuf_printf(b, "outbox_messages{state=\"%s\"} %lld\n", states[i],
                                (long long)r->ops.dbstat.by_state[i]);
    /* Without the database's figures (it does not answer, or the relay
     * waits for it) the gauge has no sample: 0 would say nothing waits. */
    outbox__sbuf_printf(b, "# HELP outbox_oldest_pending_seconds Age of the oldest due pending row.\n"
                           "# TYPE outbox_oldest_pending_seconds gauge\n");
    if (r->ops.dbstat.ok)
        outbox__sbuf_printf(b, "outbox_oldest_pending_seconds %.3f\n", (double)r->ops.dbstat.oldest_due_ms / 1000.0);
    outbox__sbuf_printf(b,
                        "# HELP outbox_inflight Messages claimed by this relay and not yet marked.\n"
                        "# TYPE outbox_inflight gauge\noutbox_inflight %llu\n"
                        "# HELP outbox_awaiting_replies Messages sent to Redis awaiting their reply.\n"
                        "# TYPE outbox_awaiting_replies gauge\noutbox_awaiting_replies %llu\n",
                        (unsigned long long)r->win.inflight, (unsigned long long)r->win.awaiting);
    outbox__sbuf_printf(b, "# HELP outbox_published_total Messages published (Redis accepted the XADD).\n"
                           "# TYPE outbox_published_total counter\n");
    topic_family(b, r, "outbox_published_total", offsetof(outbox__topic_stat, published));
    outbox__sbuf_printf(b, "# HELP outbox_failed_total Failed publish attempts (error replies).\n"
                           "# TYPE outbox_failed_total counter\n");
    topic_family(b, r, "outbox_failed_total", offsetof(outbox__topic_stat, failed));
    outbox__sbuf_printf(b, "# HELP outbox_dead_lettered_total Messages that became dead.\n"
                           "# TYPE outbox_dead_lettered_total counter\n");
    topic_family(b, r, "outbox_dead_lettered_total", offsetof(outbox__topic_stat, dead));
    outbox__sbuf_printf(b,
                        "# HELP outbox_retries_total Messages scheduled for another attempt.\n"
                        "# TYPE outbox_retries_total counter\noutbox_retries_total %llu\n"
                        "# HELP outbox_fenced_total Marks refused because the lease was taken over.\n"
                        "# TYPE outbox_fenced_total counter\noutbox_fenced_total %llu\n"
                        "# HELP outbox_duplicates_suppressed_total Idempotent mode: second publishes not appended.\n"
                        "# TYPE outbox_duplicates_suppressed_total counter\noutbox_duplicates_suppressed_total %llu\n"
                        "# HELP outbox_redis_reconnects_total Established Redis connections that were lost.\n"
                        "# TYPE outbox_redis_reconnects_total counter\noutbox_redis_reconnects_total %llu\n"
                        "# HELP outbox_redis_connected 1 while connected to Redis.\n"
                        "# TYPE outbox_redis_connected gauge\noutbox_redis_connected %d\n"
                        "# HELP outbox_retention_deleted_total Published rows deleted by retention.\n"
                        "# TYPE outbox_retention_deleted_total counter\noutbox_retention_deleted_total %llu\n"
                        "# HELP outbox_claims_total Claim transactions that claimed at least one row.\n"
                        "# TYPE outbox_claims_total counter\noutbox_claims_total %llu\n"
                        "# HELP outbox_checkpoints_total WAL checkpoints the relay ran (worker thread).\n"
                        "# TYPE outbox_checkpoints_total counter\noutbox_checkpoints_total %llu\n",
                        (unsigned long long)r->stats.retries_total, (unsigned long long)r->stats.fenced_total,
                        (unsigned long long)r->stats.duplicates_total, (unsigned long long)r->stats.reconnects,
                        outbox__link_up(r), (unsigned long long)r->stats.retention_deleted,
                        (unsigned long long)r->stats.claims_total, (unsigned long long)r->stats.checkpoints_total);
    cluster_metrics(r, b);
    outbox__sbuf_printf(b, "# HELP outbox_publish_latency_seconds From commit (created_at) to Redis accepting it.\n"
                           "# TYPE outbox_publish_latency_seconds histogram\n");
    outbox__prom_hist(b, "outbox_publish_latency_seconds", "", &r->stats.h_latency);
    outbox__sbuf_printf(b, "# HELP outbox_claim_batch_size Rows per claim transaction.\n"
                           "# TYPE outbox_claim_batch_size histogram\n");
    outbox__prom_hist(b, "outbox_claim_batch_size", "", &r->stats.h_claim_size);
    outbox__sbuf_printf(b, "# HELP outbox_claim_duration_seconds Time of a claim transaction (marks included).\n"
                           "# TYPE outbox_claim_duration_seconds histogram\n");
    outbox__prom_hist(b, "outbox_claim_duration_seconds", "", &r->stats.h_claim_secs);
    outbox__sbuf_printf(b, "# HELP outbox_loop_stall_seconds Time the event loop spent per iteration outside poll.\n"
                           "# TYPE outbox_loop_stall_seconds histogram\n");
    outbox__prom_hist(b, "outbox_loop_stall_seconds", "", &r->stats.h_stall);
    outbox__sbuf_printf(b,
                        "# HELP outbox_loop_stall_max_seconds Longest event-loop iteration since start.\n"
                        "# TYPE outbox_loop_stall_max_seconds gauge\noutbox_loop_stall_max_seconds %.6f\n",
                        (double)r->ops.stall_max_ns / 1e9);
}

static void answer(outbox_relay *r, outbox__http_req *req, const char *path)
{
    if (strcmp(path, "/metrics") == 0) {
        outbox__sbuf b = {0};
        write_metrics(r, &b);
        if (b.oom)
            outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
        else
            outbox__http_respond(req, 200, "text/plain; version=0.0.4; charset=utf-8", b.p, b.len);
        outbox__sbuf_free(&b);
        return;
    }
    /* /healthz */
    {
        /* Room for the longest URL description and database error, and a
         * database path of a few hundred bytes (a longer one is cut). */
        char body[sizeof r->cfg.url_desc + sizeof r->dbwait.why + OUTBOX__LINK_WHY_MAX + 512];
        uint64_t now = uv_now(r->loop), down = r->redis.down_since ? now - r->redis.down_since : 0;
        int n;
        if (!r->stop.began)
            n = snprintf(body, sizeof body, "unhealthy: waiting for the database %s: %s\n", r->cfg.db_path,
                         r->dbwait.why);
        else if (r->sched.fail_since)
            n = snprintf(body, sizeof body, "unhealthy: database %s failing for %llu ms: %s\n", r->cfg.db_path,
                         (unsigned long long)(now - r->sched.fail_since), r->sched.fail_why);
        else if (!r->ops.dbstat.ok)
            n = snprintf(body, sizeof body, "unhealthy: %s\n", r->ops.dbstat.err[0] ? r->ops.dbstat.err : "database not checked");
        else if (outbox__link_problem(r))
            n = snprintf(body, sizeof body, "unhealthy: %s\n", outbox__link_problem(r));
        else if (!outbox__link_up(r) && down >= r->cfg.s.health_redis_down_ms)
            n = snprintf(body, sizeof body, "unhealthy: redis unreachable for %llu ms (%s)\n",
                         (unsigned long long)down, r->cfg.url_desc);
        else
            n = snprintf(body, sizeof body, "ok\n");
        if (n < 0)
            n = 0;
        else if ((size_t)n >= sizeof body)
            n = (int)sizeof body - 1; /* snprintf's length is what it wanted to write */
        outbox__http_respond(req, body[0] == 'o' ? 200 : 503, "text/plain; charset=utf-8", body, (size_t)n);
    }
}

static void on_http(void *data, outbox__http_req *req, const char *path)
{
    outbox_relay *r = data;
    if (strcmp(path, "/metrics") != 0 && strcmp(path, "/healthz") != 0) {
        static const char nf[] = "not found: try /metrics or /healthz\n";
        outbox__http_respond(req, 404, "text/plain; charset=utf-8", nf, sizeof nf - 1);
        return;
    }
    /* Database figures at most a second old; a refresh runs off the loop.
     * None while the relay waits for its database. */
    if (!r->stop.began || (r->ops.dbstat_at && uv_now(r->loop) - r->ops.dbstat_at < 1000 && !r->ops.dbstat_running)) {
        answer(r, req, path);
        return;
    }
    if (r->ops.nwaiting == r->ops.capwaiting) {
        /* Two arrays of one capacity: it goes up once both have grown (one
         * that grew alone is merely bigger than it needs to be). */
        size_t cap_reqs = r->ops.capwaiting, cap_paths = r->ops.capwaiting;
        if (OUTBOX__GROW(r->ops.waiting_reqs, &cap_reqs, r->ops.nwaiting, 1, 8) != 0 ||
            OUTBOX__GROW(r->ops.waiting_paths, &cap_paths, r->ops.nwaiting, 1, 8) != 0) {
            outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
            return;
        }
        r->ops.capwaiting = cap_paths;
    }
    r->ops.waiting_paths[r->ops.nwaiting] = strdup(path);
    if (!r->ops.waiting_paths[r->ops.nwaiting]) {
        outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
        return;
    }
    r->ops.waiting_reqs[r->ops.nwaiting++] = req;
    dbstat_refresh(r);
}

static void on_http_closed(void *data)
{
    outbox_relay *r = data;
    r->ops.http = NULL;
    r->hooks.closed(r);
}

/* Starts a refresh of the database figures unless one runs. */
static void dbstat_refresh(outbox_relay *r)
{
    if (r->ops.dbstat_running)
        return;
    r->ops.dbstat_work.data = r;
    if (uv_queue_work(r->loop, &r->ops.dbstat_work, dbstat_run, dbstat_done) == 0)
        r->ops.dbstat_running = 1;
}

int outbox__ops_listen(outbox_relay *r, char *err, size_t errlen)
{
    if (r->cfg.s.metrics_listen) {
        const outbox__web_config *w = r->cfg.web;
        int e = outbox__http_start(&r->ops.http, r->loop, r->cfg.s.metrics_listen, w, NULL, on_http, r, &r->cfg.log,
                                   err, errlen);
        if (e != 0)
            return e;
        LOG(r, OUTBOX_LOG_INFO, "msg=\"serving /metrics and /healthz\" listen=%s tls=%s basic_auth_users=%zu",
            r->cfg.s.metrics_listen, w && w->tls ? "on" : "off", w ? w->nusers : (size_t)0);
    }
    return 0;
}

int outbox__ops_start(outbox_relay *r)
{
    /* A group's relays share the loop: a probe pair each would run at
     * every loop turn for every open database. */
    if (r->redis.shared)
        return r->ops.http ? 1 : 0;
    r->ops.stall_on = 1;
    /* Idle-time accounting for the stall measure; harmless if refused. */
    uv_loop_configure(r->loop, UV_METRICS_IDLE_TIME);
    uv_prepare_init(r->loop, &r->ops.stall_prepare);
    uv_check_init(r->loop, &r->ops.stall_check);
    r->ops.stall_prepare.data = r->ops.stall_check.data = r;
    uv_prepare_start(&r->ops.stall_prepare, on_stall_prepare);
    uv_check_start(&r->ops.stall_check, on_stall_check);
    /* The stall probes must not keep the loop alive by themselves. */
    uv_unref((uv_handle_t *)&r->ops.stall_prepare);
    uv_unref((uv_handle_t *)&r->ops.stall_check);
    return 2 + (r->ops.http ? 1 : 0);
}

void outbox__ops_close(outbox_relay *r, uv_close_cb cb)
{
    if (r->ops.stall_on) {
        uv_close((uv_handle_t *)&r->ops.stall_prepare, cb);
        uv_close((uv_handle_t *)&r->ops.stall_check, cb);
    }
    if (r->ops.http) {
        outbox__http *h = r->ops.http;
        outbox__http_close(h, on_http_closed, r);
    }
}

void outbox__ops_free(outbox_relay *r)
{
    sqlite3_close_v2(r->ops.dbstat_db);
    outbox__retention_close_db(&r->ret);
    outbox__topics_free(&r->stats.topics);
    free(r->ops.waiting_reqs);
    free(r->ops.waiting_paths);
}

int outbox_relay_stats_get(outbox_relay *r, outbox_relay_stats *st)
{
    const struct relay_dbstat *d;
    if (!r || !st)
        return OUTBOX_EINVAL;
    memset(st, 0, sizeof *st);
    st->published_total = r->stats.published_total;
    st->failed_total = r->stats.failed_total;
    st->dead_total = r->stats.dead_total;
    st->fenced_total = r->stats.fenced_total;
    st->reconnects = r->stats.reconnects;
    st->inflight = r->win.inflight;
    st->redis_connected = outbox__link_up(r);
    /* The figures /metrics shows, refreshed off the loop at most once a
     * second: counting a large table here would stall the loop. */
    if (r->state == R_RUNNING && (!r->ops.dbstat_at || uv_now(r->loop) - r->ops.dbstat_at >= 1000))
        dbstat_refresh(r);
    d = &r->ops.dbstat;
    if (!d->ok) {
        st->pending = st->sending = st->published = st->dead = -1;
        return r->ops.dbstat_at ? OUTBOX_ESQLITE : OUTBOX_EBUSY; /* the refresh failed, or none finished yet */
    }
    st->pending = d->by_state[OUTBOX_STATE_PENDING];
    st->sending = d->by_state[OUTBOX_STATE_SENDING];
    st->published = d->by_state[OUTBOX_STATE_PUBLISHED];
    st->dead = d->by_state[OUTBOX_STATE_DEAD];
    st->oldest_pending_ms = d->oldest_due_ms;
    return 0;
}

int outbox_relay_nodes_get(outbox_relay *r, outbox_relay_node_stats *out, size_t cap, size_t *n,
                           uint64_t *refreshes)
{
    outbox__target_node_stats st[64];
    uint64_t refr = 0, failed;
    size_t total, i;
    if (!r || (!out && cap > 0))
        return OUTBOX_EINVAL;
    total = outbox__link_nodes(r, st, OUTBOX_ARRAY_LEN(st), &refr, &failed);
    for (i = 0; i < total && i < cap && i < OUTBOX_ARRAY_LEN(st); i++) {
        memset(&out[i], 0, sizeof out[i]);
        outbox__strlcpy(out[i].node, st[i].name, sizeof out[i].node);
        out[i].connected = st[i].connected;
        out[i].master = st[i].master;
        out[i].moved = st[i].moved;
        out[i].ask = st[i].ask;
        out[i].tryagain = st[i].tryagain;
        out[i].errors = st[i].errors;
    }
    if (n)
        *n = total;
    if (refreshes)
        *refreshes = refr;
    return 0;
}
