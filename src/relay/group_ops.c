/*
 * group_ops.c: what a group tells of itself (group_int.h): its figures
 * (outbox_relay_group_stats_get, the drain's result, one database's state)
 * and /metrics and /healthz, one endpoint for every database, with bounded
 * series: families summed over the databases, databases by state, at most
 * HEALTH_NAMES_MAX failing ones named. Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "group_int.h"
#include "ops/metrics.h"

/* ---- /metrics and /healthz ------------------------------------------------- */

/* Failing databases named in /metrics and /healthz, at most: the number
 * of series stays bounded whatever the number of databases. */
#define HEALTH_NAMES_MAX 20

/* Each database's backlog as last seen: an open one's from its relay's
 * figures (read on a worker thread, at most about a second old: a call
 * that finds them older starts a refresh, and a later scrape sees it). */
static void refresh_figures(outbox_relay_group *g)
{
    for (size_t i = 0; i < g->ndbs; i++) {
        gdb *d = g->dbs[i];
        outbox_relay_stats rs;
        if (d->state != G_OPEN || outbox_relay_stats_get(d->r, &rs) != 0 || rs.pending < 0 || rs.sending < 0)
            continue;
        d->fig_known = 1;
        d->fig_backlog = rs.pending + rs.sending;
        d->fig_oldest_ms = rs.oldest_pending_ms;
    }
}

int outbox__group_failing(const gdb *d, uint64_t now, const char **why, uint64_t *ms)
{
    *ms = 0;
    if (d->state == G_FAILED) {
        *why = d->why;
        return 1;
    }
    if (d->state == G_OPEN && d->r && d->r->sched.fail_since) {
        *why = d->r->sched.fail_why;
        *ms = now - d->r->sched.fail_since;
        return 1;
    }
    return 0;
}

static int by_backlog(const void *a, const void *b)
{
    const gdb *x = *(const gdb *const *)a, *y = *(const gdb *const *)b;
    if (x->fig_backlog != y->fig_backlog)
        return x->fig_backlog > y->fig_backlog ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The metrics_db_limit databases with the largest backlog by name, the
 * others together as db="other": as many series as that, whatever the
 * number of databases. */
static void backlog_series(outbox_relay_group *g, outbox__sbuf *b)
{
    const gdb **top = NULL;
    size_t n = 0, named;
    int64_t other = 0, other_oldest = 0;
    refresh_figures(g);
    if (g->ndbs && !(top = malloc(g->ndbs * sizeof *top))) {
        b->oom = 1;
        return;
    }
    for (size_t i = 0; i < g->ndbs; i++)
        if (g->dbs[i]->fig_known)
            top[n++] = g->dbs[i];
    if (n)
        qsort(top, n, sizeof *top, by_backlog);
    named = n < g->tmpl.metrics_db_limit ? n : g->tmpl.metrics_db_limit;
    while (named > 0 && top[named - 1]->fig_backlog == 0)
        named--; /* a database with nothing to do is not worth a series */
    for (size_t i = named; i < n; i++) {
        other += top[i]->fig_backlog;
        if (top[i]->fig_oldest_ms > other_oldest)
            other_oldest = top[i]->fig_oldest_ms;
    }
    outbox__sbuf_printf(b, "# HELP outbox_database_backlog Rows pending or being sent, of the %u databases with the "
                           "largest backlog, and of the others together (db=\"other\"), as last seen.\n"
                           "# TYPE outbox_database_backlog gauge\n",
                        g->tmpl.metrics_db_limit);
    for (size_t i = 0; i < named; i++) {
        outbox__sbuf_printf(b, "outbox_database_backlog{db=\"");
        outbox__prom_label_value(b, top[i]->name);
        outbox__sbuf_printf(b, "\"} %lld\n", (long long)top[i]->fig_backlog);
    }
    outbox__sbuf_printf(b, "outbox_database_backlog{db=\"other\"} %lld\n", (long long)other);
    outbox__sbuf_printf(b, "# HELP outbox_database_oldest_pending_seconds Age of the oldest due pending row, of the "
                           "same databases, and the oldest of the others (db=\"other\").\n"
                           "# TYPE outbox_database_oldest_pending_seconds gauge\n");
    for (size_t i = 0; i < named; i++) {
        outbox__sbuf_printf(b, "outbox_database_oldest_pending_seconds{db=\"");
        outbox__prom_label_value(b, top[i]->name);
        outbox__sbuf_printf(b, "\"} %.3f\n", (double)top[i]->fig_oldest_ms / 1000.0);
    }
    outbox__sbuf_printf(b, "outbox_database_oldest_pending_seconds{db=\"other\"} %.3f\n",
                        (double)other_oldest / 1000.0);
    free(top);
}

static void group_metrics(outbox_relay_group *g, outbox__sbuf *b)
{
    outbox_relay_group_stats st;
    size_t named = 0;
    uint64_t now = uv_now(g->loop);
    outbox_relay_group_stats_get(g, &st);
    outbox__sbuf_printf(b,
                        "# HELP outbox_databases Databases of the group by state.\n"
                        "# TYPE outbox_databases gauge\n"
                        "outbox_databases{state=\"open\"} %zu\noutbox_databases{state=\"closed\"} %zu\n"
                        "outbox_databases{state=\"failed\"} %zu\noutbox_databases{state=\"not_outbox\"} %zu\n",
                        st.open, st.closed, st.failed, st.not_outbox);
    outbox__sbuf_printf(b, "# HELP outbox_database_failing 1 for a database that cannot be opened or whose "
                           "transactions fail (at most %d named).\n# TYPE outbox_database_failing gauge\n",
                        HEALTH_NAMES_MAX);
    for (size_t i = 0; i < g->ndbs && named < HEALTH_NAMES_MAX; i++) {
        const char *why;
        uint64_t ms;
        if (outbox__group_failing(g->dbs[i], now, &why, &ms)) {
            outbox__sbuf_printf(b, "outbox_database_failing{db=\"");
            outbox__prom_label_value(b, g->dbs[i]->name);
            outbox__sbuf_printf(b, "\"} 1\n");
            named++;
        }
    }
    outbox__sbuf_printf(b,
                        "# HELP outbox_inflight Messages claimed and not yet marked, every database.\n"
                        "# TYPE outbox_inflight gauge\noutbox_inflight %llu\n"
                        "# HELP outbox_published_total Messages published (Redis accepted the XADD), every database.\n"
                        "# TYPE outbox_published_total counter\noutbox_published_total %llu\n"
                        "# HELP outbox_failed_total Failed publish attempts (error replies), every database.\n"
                        "# TYPE outbox_failed_total counter\noutbox_failed_total %llu\n"
                        "# HELP outbox_dead_lettered_total Messages that became dead, every database.\n"
                        "# TYPE outbox_dead_lettered_total counter\noutbox_dead_lettered_total %llu\n"
                        "# HELP outbox_redis_connected 1 while connected to Redis.\n"
                        "# TYPE outbox_redis_connected gauge\noutbox_redis_connected %d\n",
                        (unsigned long long)st.inflight, (unsigned long long)st.published_total,
                        (unsigned long long)st.failed_total, (unsigned long long)st.dead_total, st.redis_connected);
    backlog_series(g, b);
}

void outbox__group_on_http(void *data, outbox__http_req *req, const char *path)
{
    outbox_relay_group *g = data;
    outbox__sbuf b = {0};
    int status = 200;
    if (!strcmp(path, "/metrics")) {
        group_metrics(g, &b);
    } else if (!strcmp(path, "/healthz")) {
        uint64_t now = uv_now(g->loop), down = g->link.down_since ? now - g->link.down_since : 0;
        outbox_relay_group_stats st;
        size_t named = 0;
        outbox_relay_group_stats_get(g, &st);
        if (g->link.problem != LP_NONE) {
            status = 503;
            outbox__sbuf_printf(&b, "unhealthy: %s\n", g->link.misconfig);
        } else if (!outbox__link_usable(&g->link) && down >= g->tmpl.health_redis_down_ms) {
            status = 503;
            outbox__sbuf_printf(&b, "unhealthy: redis unreachable for %llu ms (%s)\n", (unsigned long long)down,
                                g->cfg.url_desc);
        } else {
            outbox__sbuf_printf(&b, "ok\n");
        }
        /* A tenant that cannot be read is its own problem, not the
         * process's: named, the answer still 200. */
        outbox__sbuf_printf(&b, "databases %zu open %zu closed %zu failed %zu not_outbox %zu\n", st.databases,
                            st.open, st.closed, st.failed, st.not_outbox);
        for (size_t i = 0; i < g->ndbs && named < HEALTH_NAMES_MAX; i++) {
            const char *why;
            uint64_t ms;
            if (!outbox__group_failing(g->dbs[i], now, &why, &ms))
                continue;
            if (g->dbs[i]->state == G_FAILED)
                outbox__sbuf_printf(&b, "failing: %s: %s\n", g->dbs[i]->name, why);
            else
                outbox__sbuf_printf(&b, "failing: %s: database errors for %llu ms: %s\n", g->dbs[i]->name,
                                    (unsigned long long)ms, why);
            named++;
        }
    } else {
        static const char nf[] = "not found: try /metrics or /healthz\n";
        outbox__http_respond(req, 404, "text/plain; charset=utf-8", nf, sizeof nf - 1);
        return;
    }
    if (b.oom)
        outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
    else
        outbox__http_respond(req, status,
                             path[1] == 'm' ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain; charset=utf-8",
                             b.p, b.len);
    outbox__sbuf_free(&b);
}

void outbox__group_on_http_closed(void *data)
{
    outbox_relay_group *g = data;
    g->http = NULL;
    g->handles_open--;
    outbox__group_stop_check(g);
}

int outbox_relay_group_drain_result(const outbox_relay_group *g, char *failed_dbs, size_t len)
{
    if (!g)
        return OUTBOX_EINVAL;
    if (failed_dbs && len)
        outbox__strlcpy(failed_dbs, g->drain_failed, len);
    if (!g->drain_done)
        return OUTBOX_ESTATE;
    return g->drain_error;
}

int outbox_relay_group_stats_get(const outbox_relay_group *g, outbox_relay_group_stats *st)
{
    if (!g || !st)
        return OUTBOX_EINVAL;
    memset(st, 0, sizeof *st);
    st->published_total = g->published_total;
    st->failed_total = g->failed_total;
    st->dead_total = g->dead_total;
    for (size_t i = 0; i < g->ndbs; i++) {
        const gdb *d = g->dbs[i];
        st->databases++;
        switch (d->state) {
        case G_OPEN:
        case G_CLOSING:
            st->open++;
            st->published_total += d->r->stats.published_total;
            st->failed_total += d->r->stats.failed_total;
            st->dead_total += d->r->stats.dead_total;
            st->inflight += d->r->win.inflight;
            break;
        case G_FAILED:
            st->failed++;
            break;
        case G_NOSCHEMA:
            st->not_outbox++;
            break;
        default:
            st->closed++;
            break;
        }
    }
    st->redis_connected = outbox__link_usable(&g->link);
    return 0;
}

int outbox_relay_group_db_state(const outbox_relay_group *g, const char *name, char *why, size_t len)
{
    static const int map[] = {[G_IDLE] = OUTBOX_GROUP_DB_CLOSED, [G_PROBING] = OUTBOX_GROUP_DB_CLOSED,
                              [G_WANTED] = OUTBOX_GROUP_DB_CLOSED, [G_OPEN] = OUTBOX_GROUP_DB_OPEN,
                              [G_CLOSING] = OUTBOX_GROUP_DB_OPEN, [G_FAILED] = OUTBOX_GROUP_DB_FAILED,
                              [G_NOSCHEMA] = OUTBOX_GROUP_DB_NOT_OUTBOX};
    const gdb *d;
    if (!g || !name)
        return OUTBOX_EINVAL;
    if (!(d = outbox__group_find_name(g, name)))
        return OUTBOX_GROUP_DB_UNKNOWN;
    if (why && len) {
        const char *w = d->why;
        uint64_t ms;
        if (d->state != G_NOSCHEMA && !outbox__group_failing(d, uv_now(g->loop), &w, &ms))
            w = "";
        outbox__strlcpy(why, w, len);
    }
    return map[d->state];
}
