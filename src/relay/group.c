/*
 * group.c: one relay process for many databases (outbox_relay_group,
 * outbox-relay --db-dir): the outbox of every SQLite file of a directory
 * (one per tenant), over one Redis link.
 *
 * Each database is an entry (struct gdb). While it has work, a relay runs
 * on it (lifecycle.c, outbox__relay_create_on the group's link; it opens
 * its database on a worker thread, dbwait.c's deferred open), with its
 * own leases, claims, marks, retries, window and wake-ups, exactly as a
 * relay of its own would; its stream entries and markers name it (db_name).
 * Every relay of the group runs in drain mode: when its drain ends (nothing
 * due, leased, in flight or waiting for a retry) the group hears of it,
 * and a relay that stayed so for LINGER_MS is closed: an idle database
 * costs no relay, no timer, no thread and no file descriptor, only its
 * entry. Its drain is armed again while it lingers and keeps working.
 *
 * A closed database is noticed again through the directory's watch (one
 * inotify watch per directory): a commit writes its -wal (or the file
 * itself), and an event for a file whose size, mtime or inode changed since
 * the group last looked opens it. Before the group opens a database it
 * did not just see change (found at start, a retry, a row delayed), a
 * probe on a worker thread reads what it has to do through a read-only
 * connection (the drain's own query): a database with nothing due is not
 * opened. After a relay closes, a probe looks again, so that a commit
 * during the close is not missed.
 *
 * Bounded: max_open_dbs relays at most (the least recently used idle one
 * is closed for a database that needs to open; one busy for a second or
 * more when none is idle, its rows handed back and its entry queued again);
 * each relay's window is the group's inflight divided among the relays
 * open, at least batch (outbox__win_cap), so one database with a huge
 * backlog holds back the others by one window share at most, and their
 * units take turns on libuv's worker threads.
 *
 * Isolation: a database that cannot be opened (corrupt, locked, not an
 * outbox, gone) affects only its entry: logged once per reason, tried again
 * after 1 s doubling to 60 s (a file without an outbox table is looked at
 * again when it changes). A drain (s->drain) drains every database found,
 * and those that appear meanwhile, then ends; each it could not drain is
 * named (outbox_relay_group_drain_result). Loop thread.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "group_int.h"

void outbox__group_set_share(outbox_relay_group *g)
{
    unsigned open = g->nopen ? (unsigned)g->nopen : 1, s = g->tmpl.inflight / open;
    g->share = s > g->tmpl.batch ? s : g->tmpl.batch;
}

/* ---- failures ---------------------------------------------------------- */

/* d could not be opened (e, why): logged when the reason is new, tried
 * again later (a drain names it instead). */
void outbox__group_failed(gdb *d, int e, const char *why)
{
    outbox_relay_group *g = d->g;
    uint64_t now = uv_now(g->loop);
    d->e = e;
    outbox__strlcpy(d->why, why && *why ? why : outbox_strerror(e), sizeof d->why);
    if (e == OUTBOX_ENOSCHEMA) {
        d->state = G_NOSCHEMA;
        if (strcmp(d->logged, d->why) != 0)
            GLOG(g, OUTBOX_LOG_INFO, "msg=\"not an outbox database (yet): watching it\" database=%s path=%s",
                 d->name, d->path);
    } else if (e == OUTBOX_EBUSY) {
        /* A lock passes in milliseconds (a writer's checkpoint at its
         * close, a migration): tried again from 5 ms, doubling to 1 s,
         * and said once it lasted a second. A drain waits for it too. */
        char q[400];
        if (!d->busy_since)
            d->busy_since = now ? now : 1;
        d->state = G_FAILED;
        d->retry_ms = d->retry_ms ? d->retry_ms * 2 : BUSY_FIRST_MS;
        if (d->retry_ms > RETRY_MIN_MS)
            d->retry_ms = RETRY_MIN_MS;
        d->retry_at = now + d->retry_ms;
        if (now - d->busy_since >= BUSY_QUIET_MS && strcmp(d->logged, d->why) != 0) {
            outbox__logfmt_quote(q, sizeof q, d->why);
            GLOG(g, OUTBOX_LOG_WARN, "msg=\"database locked; retrying\" database=%s for_ms=%llu error=%s",
                 d->name, (unsigned long long)(now - d->busy_since), q);
            outbox__strlcpy(d->logged, d->why, sizeof d->logged);
        }
        if (g->tmpl.drain && now - d->busy_since >= BUSY_DRAIN_MS)
            d->drain_failed = 1;
        else
            outbox__group_arm(g, d->retry_ms);
        outbox__group_remember(d);
        return;
    } else {
        char q[400];
        d->state = G_FAILED;
        d->retry_ms = d->retry_ms ? d->retry_ms * 2 : RETRY_MIN_MS;
        if (d->retry_ms > RETRY_MAX_MS)
            d->retry_ms = RETRY_MAX_MS;
        d->retry_at = now + d->retry_ms;
        if (strcmp(d->logged, d->why) != 0) {
            outbox__logfmt_quote(q, sizeof q, d->why);
            GLOG(g, OUTBOX_LOG_ERROR, "msg=\"cannot open the database%s\" database=%s error=%s err=%s",
                 g->tmpl.drain ? "" : "; retrying", d->name, q, outbox_err_name(e));
        }
        if (!g->tmpl.drain)
            outbox__group_arm(g, d->retry_ms);
    }
    outbox__strlcpy(d->logged, d->why, sizeof d->logged);
    if (g->tmpl.drain && e != OUTBOX_ENOSCHEMA)
        d->drain_failed = 1;
    outbox__group_remember(d);
}

/* ---- the queue of databases to open --------------------------------------- */

void outbox__group_want(gdb *d)
{
    outbox_relay_group *g = d->g;
    if (g->state != R_RUNNING || d->gone)
        return;
    if (d->state == G_OPEN) {
        d->last_used = uv_now(g->loop);
        outbox_relay_wake(d->r);
        return;
    }
    if (d->state == G_WANTED || d->state == G_PROBING || d->state == G_CLOSING) {
        d->dirty = 1;
        return;
    }
    d->state = G_WANTED;
    d->want_next = NULL;
    if (g->want_tail)
        g->want_tail->want_next = d;
    else
        g->want_head = d;
    g->want_tail = d;
    outbox__group_pump(g);
}

/* The open relay to close so that another database can open: the least
 * recently used idle one, else the least recently used that has run at
 * least EVICT_MIN_MS (its rows go back, its entry queued again); NULL. */
static gdb *victim(outbox_relay_group *g, uint64_t now, uint64_t *retry)
{
    gdb *idle = NULL, *busy = NULL;
    *retry = 0;
    for (size_t i = 0; i < g->ndbs; i++) {
        gdb *d = g->dbs[i];
        if (d->state != G_OPEN)
            continue;
        if (d->idle_since) {
            if (!idle || d->last_used < idle->last_used)
                idle = d;
        } else if (now - d->opened_at >= EVICT_MIN_MS) {
            if (!busy || d->last_used < busy->last_used)
                busy = d;
        } else if (!*retry || d->opened_at + EVICT_MIN_MS - now < *retry) {
            *retry = d->opened_at + EVICT_MIN_MS - now;
        }
    }
    return idle ? idle : busy;
}

void outbox__group_pump(outbox_relay_group *g)
{
    uint64_t now = uv_now(g->loop), retry;
    size_t closing = 0, busy = 0;
    if (g->state != R_RUNNING)
        return;
    for (size_t i = 0; i < g->ndbs; i++) {
        closing += g->dbs[i]->state == G_CLOSING;
        busy += g->dbs[i]->state == G_OPEN && !g->dbs[i]->idle_since;
    }
    while (g->want_head) {
        gdb *d = g->want_head;
        /* Opening more than that at once only makes every one of them
         * slower (their claims queue on the same worker threads); one that
         * drains makes room (on_relay_drained pumps). */
        if (busy >= BUSY_MAX)
            return;
        if (g->nopen >= g->tmpl.max_open_dbs) {
            gdb *v;
            if (closing >= 1)
                return; /* one is on its way out: its close pumps again */
            v = victim(g, now, &retry);
            if (!v) {
                outbox__group_arm(g, retry ? retry : 100);
                return;
            }
            if (!v->idle_since)
                v->requeue = 1;
            outbox__group_close_db(v);
            closing++;
            continue;
        }
        g->want_head = d->want_next;
        if (!g->want_head)
            g->want_tail = NULL;
        d->want_next = NULL;
        d->dirty = 0;
        if (d->gone) {
            outbox__group_drop(d);
            continue;
        }
        outbox__group_open_db(d);
        busy += d->state == G_OPEN;
    }
}

/* ---- the timer: lingering relays, retries, rows that become due ----------- */

static void on_timer(uv_timer_t *t)
{
    outbox_relay_group *g = t->data;
    uint64_t now = uv_now(g->loop), next = UINT64_MAX;
    int64_t wall = outbox_now_ms();
    g->timer_due = 0;
    if (g->state != R_RUNNING)
        return;
    for (size_t i = 0; i < g->ndbs; i++) {
        gdb *d = g->dbs[i];
        uint64_t at = UINT64_MAX;
        if (d->state == G_OPEN && d->idle_since) {
            if (now - d->idle_since >= LINGER_MS) {
                outbox_relay *r = d->r;
                uint64_t mark = r->stats.published_total + r->stats.failed_total + r->stats.dead_total;
                if (mark != d->idle_mark || r->win.inflight) {
                    /* It kept working: its drain is armed again. */
                    d->idle_since = 0;
                    d->last_used = now;
                    outbox__drain_rearm(r);
                } else {
                    outbox__group_close_db(d);
                }
            } else {
                at = d->idle_since + LINGER_MS;
            }
        } else if (d->state == G_NOSCHEMA && d->dirty) {
            if (now - d->probed_at >= NOSCHEMA_MS)
                outbox__group_probe(d);
            else
                at = d->probed_at + NOSCHEMA_MS;
        } else if (d->state == G_FAILED && (!g->tmpl.drain || (d->busy_since && !d->drain_failed))) {
            if (now >= d->retry_at)
                outbox__group_probe(d);
            else
                at = d->retry_at;
        } else if (d->state == G_IDLE && d->wake_at) {
            if (wall >= d->wake_at) {
                d->wake_at = 0;
                outbox__group_probe(d);
            } else {
                at = now + (uint64_t)(d->wake_at - wall);
            }
        }
        if (at < next)
            next = at;
    }
    outbox__group_pump(g);
    if (next != UINT64_MAX)
        outbox__group_arm(g, next > now ? next - now : 0);
}

void outbox__group_arm(outbox_relay_group *g, uint64_t delay)
{
    uint64_t due = uv_now(g->loop) + delay;
    if (g->state != R_RUNNING)
        return;
    if (g->timer_due && g->timer_due <= due)
        return;
    g->timer_due = due;
    uv_timer_start(&g->timer, on_timer, delay, 0);
}

/* ---- the drain ------------------------------------------------------------ */

static void drain_end(outbox_relay_group *g, int e)
{
    size_t off = 0;
    if (g->drain_done)
        return;
    g->drain_done = 1;
    if (!g->drain_error)
        g->drain_error = e;
    for (size_t i = 0; i < g->ndbs; i++) {
        gdb *d = g->dbs[i];
        if (d->drained && !d->drain_failed)
            continue;
        if (d->state == G_NOSCHEMA)
            continue;
        if (!d->drain_failed && !e)
            continue;
        if (!g->drain_error)
            g->drain_error = OUTBOX_EIO;
        if (off < sizeof g->drain_failed - 1) {
            /* An open one whose transactions fail (a full filesystem) was
             * waited for, as a relay's own drain waits: its error says why. */
            const char *why = d->why;
            uint64_t ms;
            if (!why[0] && !outbox__group_failing(d, uv_now(g->loop), &why, &ms))
                why = "not drained";
            off += (size_t)snprintf(g->drain_failed + off, sizeof g->drain_failed - off, "%s%s (%s)",
                                    off ? ", " : "", d->name, why);
        }
        if (off >= sizeof g->drain_failed)
            off = sizeof g->drain_failed - 1;
    }
    if (g->drain_error)
        GLOG(g, OUTBOX_LOG_ERROR, "msg=\"drain incomplete\" err=%s databases=%zu not_drained=\"%s\"",
             outbox_err_name(g->drain_error), g->ndbs, g->drain_failed);
    else
        GLOG(g, OUTBOX_LOG_INFO, "msg=drained databases=%zu published=%llu dead=%llu", g->ndbs,
             (unsigned long long)g->published_total, (unsigned long long)g->dead_total);
    if (g->on_drained)
        g->on_drained(g, g->on_drained_data);
    else
        outbox_relay_group_stop(g, NULL, NULL);
}

/* Drain mode: over once no database is queued, probing, open or closing. */
void outbox__group_drain_check(outbox_relay_group *g)
{
    if (!g->tmpl.drain || g->drain_done || g->state != R_RUNNING || g->starting)
        return;
    if (g->drain_error == OUTBOX_ECONFIG) {
        drain_end(g, OUTBOX_ECONFIG);
        return;
    }
    for (size_t i = 0; i < g->ndbs; i++) {
        enum gstate s = g->dbs[i]->state;
        if (s == G_WANTED || s == G_PROBING || s == G_OPEN || s == G_CLOSING)
            return;
        if (s == G_FAILED && g->dbs[i]->busy_since && !g->dbs[i]->drain_failed)
            return; /* locked: tried again soon */
    }
    drain_end(g, 0);
}

static void on_drain_timeout(uv_timer_t *t)
{
    outbox_relay_group *g = t->data;
    if (g->state == R_RUNNING)
        drain_end(g, OUTBOX_ETIMEDOUT);
}

/* ---- the interface -------------------------------------------------------- */

static int split_globs(outbox_relay_group *g, const char *spec, char *err, size_t errlen)
{
    const char *p = spec;
    while (*p) {
        const char *c = strchr(p, ',');
        size_t n = c ? (size_t)(c - p) : strlen(p);
        char **ng;
        if (n) {
            ng = realloc(g->globs, (g->nglobs + 1) * sizeof *ng);
            if (!ng)
                return OUTBOX_ENOMEM;
            g->globs = ng;
            if (!(g->globs[g->nglobs] = strndup(p, n)))
                return OUTBOX_ENOMEM;
            if (strchr(g->globs[g->nglobs], '/'))
                return outbox__errf(err, errlen, OUTBOX_EINVAL, "db-glob: '%s' holds a '/' (file names only)",
                                    g->globs[g->nglobs]);
            g->nglobs++;
        }
        p += n + (c ? 1 : 0);
    }
    if (!g->nglobs)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db-glob: no pattern given");
    return 0;
}

static void group_free(outbox_relay_group *g)
{
    outbox__group_entries_free(g);
    for (size_t i = 0; i < g->ndirs; i++) {
        free(g->dirs[i]->path);
        free(g->dirs[i]);
    }
    free(g->dirs);
    for (size_t i = 0; i < g->nglobs; i++)
        free(g->globs[i]);
    free(g->globs);
    free(g->db_dir);
    outbox__relay_config_free(&g->cfg);
    free(g);
}

int outbox_relay_group_create(outbox_relay_group **out, uv_loop_t *loop, const outbox_relay_settings *s, char *err,
                              size_t errlen)
{
    outbox_relay_group *g;
    outbox_relay_settings c;
    struct stat st;
    int e;
    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (s->db_path)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db: a group's databases come from db-dir or "
                                                       "outbox_relay_group_add, not db");
    if (s->db_name)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db_name: a group names each database after its file");
    if (s->db_dir && stat(s->db_dir, &st) != 0)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db-dir: '%s': %s", s->db_dir, strerror(errno));
    if (s->db_dir && !S_ISDIR(st.st_mode))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db-dir: '%s' is not a directory", s->db_dir);
    c = *s;
    c.db_path = s->db_dir ? s->db_dir : "(group)"; /* checked as a relay's settings */
    if (!c.db_dir)
        c.db_dir = "(added databases)"; /* stream_template needs a group, not a directory */
    if ((e = outbox__relay_check_settings(&c, err, errlen)) != 0)
        return e;
    g = calloc(1, sizeof *g);
    if (!g)
        return OUTBOX_ENOMEM;
    g->loop = loop;
    e = outbox__relay_config_init(&g->cfg, &c, 1, err, errlen);
    if (e == 0)
        e = split_globs(g, s->db_glob ? s->db_glob : "*.db", err, errlen);
    if (e == 0 && s->db_dir) {
        size_t n = strlen(s->db_dir);
        while (n > 1 && s->db_dir[n - 1] == '/')
            n--;
        if (!(g->db_dir = strndup(s->db_dir, n)))
            e = OUTBOX_ENOMEM;
    }
    if (e != 0) {
        group_free(g);
        return e;
    }
    g->tmpl = g->cfg.s;
    g->tmpl.db_path = NULL;
    g->tmpl.db_dir = NULL;
    g->tmpl.log = s->log ? s->log : outbox_log_stderr;
    g->tmpl.log_data = s->log_data;
    g->on_drained = NULL;
    g->state = R_CREATED;
    outbox__group_set_share(g);
    *out = g;
    return 0;
}

void outbox_relay_group_on_drained(outbox_relay_group *g, void (*cb)(outbox_relay_group *g, void *data),
                                   void *data)
{
    if (!g)
        return;
    g->on_drained = cb;
    g->on_drained_data = data;
}

int outbox_relay_group_add(outbox_relay_group *g, const char *name, const char *path, char *err, size_t errlen)
{
    gdb *d;
    gdir *dr;
    int e;
    char q[220];
    if (err && errlen)
        err[0] = '\0';
    if (!g || !name || !path || !*path)
        return OUTBOX_EINVAL;
    if (g->state != R_CREATED && g->state != R_RUNNING)
        return OUTBOX_ESTATE;
    {
        outbox_relay_settings t = g->tmpl;
        t.db_path = path;
        t.db_name = name;
        t.stream_template = NULL; /* checked at create; a relay gets a prefix */
        if ((e = outbox__relay_check_settings(&t, q, sizeof q)) != 0)
            return outbox__errf(err, errlen, e, "%s", q);
    }
    if (outbox__group_find_path(g, path))
        return outbox__errf(err, errlen, OUTBOX_EDUPLICATE, "%s: the group publishes it already", path);
    d = outbox__group_add_entry(g, name, path, &e);
    if (!d)
        return outbox__errf(err, errlen, e, e == OUTBOX_EDUPLICATE ? "%s: a database of that name is in the group"
                                                                   : "%s: out of memory", name);
    d->added = 1;
    dr = outbox__group_dir_for(g, path, d->dirlen ? d->dirlen : 1);
    if (dr && d->dirlen == 0) {
        free(dr->path);
        dr->path = strdup(".");
    }
    if (dr && g->state == R_RUNNING)
        outbox__group_watch(g, dr);
    if (g->state == R_RUNNING)
        outbox__group_want(d);
    return 0;
}

int outbox_relay_group_remove(outbox_relay_group *g, const char *name)
{
    gdb *d;
    if (!g || !name)
        return OUTBOX_EINVAL;
    if (!(d = outbox__group_find_name(g, name)) || d->gone)
        return OUTBOX_ESTATE;
    outbox__group_leave(d);
    return 0;
}

int outbox_relay_group_start(outbox_relay_group *g)
{
    int e;
    if (!g || g->state != R_CREATED)
        return OUTBOX_ESTATE;
    if (g->cfg.s.metrics_listen) {
        char herr[300];
        e = outbox__http_start(&g->http, g->loop, g->cfg.s.metrics_listen, g->cfg.web, NULL, outbox__group_on_http, g,
                               &g->cfg.log, herr, sizeof herr);
        if (e != 0) {
            GLOG(g, OUTBOX_LOG_ERROR, "msg=\"cannot start\" error=\"%s\"", herr);
            return e;
        }
        GLOG(g, OUTBOX_LOG_INFO, "msg=\"serving /metrics and /healthz\" listen=%s", g->cfg.s.metrics_listen);
    }
    if (outbox__link_create(&g->link, g->loop, &g->cfg) != 0)
        return OUTBOX_ENOMEM;
    uv_timer_init(g->loop, &g->timer);
    g->timer.data = g;
    uv_timer_init(g->loop, &g->drain_timer);
    g->drain_timer.data = g;
    uv_timer_init(g->loop, &g->settle_timer);
    g->settle_timer.data = g;
    g->handles_open = 3 + (g->http ? 1 : 0);
    g->state = R_RUNNING;
    if (g->db_dir) {
        gdir *dr = outbox__group_dir_for(g, g->db_dir, strlen(g->db_dir));
        if (!dr)
            return OUTBOX_ENOMEM;
        dr->watched = 1;
        if ((e = outbox__group_watch(g, dr)) != 0) {
            /* What started closes again; destroy frees it once closed. */
            outbox_relay_group_stop(g, NULL, NULL);
            return e;
        }
    }
    for (size_t i = 0; i < g->ndirs; i++)
        outbox__group_watch(g, g->dirs[i]);
    outbox__link_open(&g->link);
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"started\" worker=%s db_dir=%s redis=%s max_open_dbs=%u", g->cfg.worker_id,
         g->db_dir ? g->db_dir : "none", g->cfg.url_desc, g->tmpl.max_open_dbs);
    if (g->tmpl.drain && g->tmpl.drain_timeout_ms)
        uv_timer_start(&g->drain_timer, on_drain_timeout, g->tmpl.drain_timeout_ms, 0);
    /* What is there now: each database probed (a drain has each one's
     * drain decide), then the directory's events. */
    g->starting = 1;
    for (size_t i = 0; i < g->ndbs; i++)
        outbox__group_probe(g->dbs[i]);
    for (size_t i = 0; i < g->ndirs; i++)
        if (g->dirs[i]->watched)
            outbox__group_scan_dir(g, g->dirs[i]);
    g->starting = 0;
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"databases found\" count=%zu", g->ndbs);
    outbox__group_drain_check(g);
    return 0;
}

static void on_handle_closed(uv_handle_t *h)
{
    outbox_relay_group *g = h->data;
    if (h->type == UV_FS_EVENT)
        g = ((gdir *)h->data)->g;
    g->handles_open--;
    outbox__group_stop_check(g);
}

static void on_link_closed(void *data)
{
    outbox_relay_group *g = data;
    g->link_closed = 1;
    outbox__group_stop_check(g);
}

void outbox__group_stop_check(outbox_relay_group *g)
{
    void (*cb)(outbox_relay_group *, void *);
    if (g->state != R_STOPPING || g->nopen || g->nprobes)
        return;
    if (g->handles_open > 0 || g->link.state == RC_STARTED) {
        if (g->link.state == RC_STARTED || g->link.state == RC_INITIALISED)
            outbox__link_shut(&g->link, on_link_closed, g);
        if (g->handles_open > 0 && !uv_is_closing((uv_handle_t *)&g->timer)) {
            uv_close((uv_handle_t *)&g->timer, on_handle_closed);
            uv_close((uv_handle_t *)&g->drain_timer, on_handle_closed);
            uv_close((uv_handle_t *)&g->settle_timer, on_handle_closed);
            if (g->http)
                outbox__http_close(g->http, outbox__group_on_http_closed, g);
            for (size_t i = 0; i < g->ndirs; i++)
                if (g->dirs[i]->active) {
                    g->dirs[i]->active = 0;
                    uv_close((uv_handle_t *)&g->dirs[i]->ev, on_handle_closed);
                }
        }
        return;
    }
    if (!g->link_closed && g->link.state != RC_NONE)
        return;
    g->state = R_STOPPED;
    GLOG(g, OUTBOX_LOG_INFO, "msg=stopped databases=%zu published=%llu failed=%llu dead=%llu", g->ndbs,
         (unsigned long long)g->published_total, (unsigned long long)g->failed_total,
         (unsigned long long)g->dead_total);
    cb = g->stop_cb;
    g->in_stop_cb = 1;
    if (cb)
        cb(g, g->stop_data);
    g->in_stop_cb = 0;
    if (g->destroy_pending)
        group_free(g);
}

int outbox_relay_group_stop(outbox_relay_group *g, void (*cb)(outbox_relay_group *g, void *data), void *data)
{
    if (!g || g->state != R_RUNNING)
        return OUTBOX_ESTATE;
    g->state = R_STOPPING;
    g->stop_cb = cb;
    g->stop_data = data;
    GLOG(g, OUTBOX_LOG_INFO, "msg=stopping databases=%zu open=%zu", g->ndbs, g->nopen);
    g->want_head = g->want_tail = NULL;
    g->probe_head = g->probe_tail = NULL;
    for (size_t i = 0; i < g->ndbs; i++) {
        gdb *d = g->dbs[i];
        if (d->state == G_WANTED)
            d->state = G_IDLE;
        if (d->state == G_OPEN)
            outbox__group_close_db(d);
    }
    /* Probes waiting for a turn never ran: only running ones are awaited. */
    for (size_t i = 0; i < g->ndbs; i++)
        if (g->dbs[i]->state == G_PROBING && !g->dbs[i]->p_running)
            g->dbs[i]->state = G_IDLE;
    outbox__group_stop_check(g);
    return 0;
}

void outbox_relay_group_destroy(outbox_relay_group *g)
{
    if (!g)
        return;
    if (g->state == R_CREATED || (g->state == R_STOPPED && !g->in_stop_cb)) {
        if (g->state == R_CREATED && g->link.state == RC_INITIALISED)
            outbox__link_shut(&g->link, NULL, NULL);
        group_free(g);
        return;
    }
    g->destroy_pending = 1;
    if (g->state == R_RUNNING)
        outbox_relay_group_stop(g, NULL, NULL);
}
