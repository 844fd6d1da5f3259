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
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>

#include "ops/http.h"
#include "relay_int.h"
#include "sql.h"

#define LINGER_MS 5000        /* an idle relay stays open this long */
#define EVICT_MIN_MS 1000     /* a busy relay runs at least this long before it is closed for another */
#define RETRY_MIN_MS 1000     /* a database that failed to open: the first retry */
#define RETRY_MAX_MS 60000
#define BUSY_FIRST_MS 5       /* a lock (another connection's checkpoint or migration): tried again soon */
#define BUSY_QUIET_MS 1000    /* ... and said only once it lasted this long */
#define BUSY_DRAIN_MS 10000   /* a drain gives up on a database locked this long */
#define NOSCHEMA_MS 100       /* a file that is no outbox yet is looked at again at most this often */
#define PROBES_MAX 2          /* probes on worker threads at once */
#define HELD_RETRY_MS 10000   /* Redis cannot be used as configured: databases tried again */
#define BUSY_MAX 32           /* databases opened and not drained yet, at most: the rest wait their turn */

enum gstate {
    G_IDLE,     /* closed; wake_at may say when it has work */
    G_PROBING,  /* its probe runs (or waits for a turn) */
    G_WANTED,   /* in the queue of databases to open */
    G_OPEN,     /* a relay runs on it */
    G_CLOSING,  /* its relay is stopping */
    G_FAILED,   /* it could not be opened: retry_at */
    G_NOSCHEMA, /* not an outbox database (yet): looked at again when it changes */
};

typedef struct fsnap {
    int ok;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} fsnap;

typedef struct gdb gdb;
struct gdb {
    outbox_relay_group *g;
    char *name, *path;
    size_t dirlen; /* path's directory part */
    enum gstate state;
    outbox_relay *r;
    gdb *want_next, *probe_next;
    fsnap snap_db, snap_wal; /* the files when the group last looked */
    int dirty;               /* changed while probing or closing */
    int gone;                /* the file went away, or remove was called */
    int added;               /* by outbox_relay_group_add, not found in a watched directory */
    int drained;             /* drain mode: it was drained (or had nothing to do) */
    int p_running;           /* its probe is on a worker thread */
    int p_noschema;          /* the probe found no outbox table at all */
    uint64_t probed_at;      /* loop ms of its last probe */
    int drain_failed;        /* drain mode: it could not be drained (the reason in why) */
    int requeue;             /* closed for another with work left: queued again once closed */
    int settle;              /* its relay stopped: freed from the settle timer */
    int open_failed;         /* its relay could not open it: open_e, open_why */
    int open_e;
    char open_why[300];
    uint64_t opened_at, idle_since, last_used;
    uint64_t idle_mark; /* the relay's published + failed + dead when it went idle */
    int64_t wake_at;    /* unix ms at which a closed database has work (a retry, a delayed row), 0: none */
    uint64_t retry_at;  /* G_FAILED: loop ms of the next try */
    uint64_t retry_ms;
    uint64_t busy_since; /* loop ms it began to be found locked, 0 if not */
    int e;               /* the last failure's OUTBOX_E*, 0 if none */
    char why[300];
    char logged[300];    /* the failure last logged */
    /* The probe's (worker thread while it runs). */
    uv_work_t work;
    int p_e;
    int64_t p_left[3], p_next_due, p_next_lease;
    char p_why[300];
};

typedef struct gdir {
    outbox_relay_group *g;
    char *path;
    uv_fs_event_t ev;
    int watched; /* a directory of db_dir (its files are found), not only of added ones */
    int active;
} gdir;

struct outbox_relay_group {
    uv_loop_t *loop;
    enum relay_state state;
    outbox_relay_settings tmpl; /* the databases' settings; strings are cfg's */
    struct relay_config cfg;
    struct relay_link link;
    char *db_dir;
    char **globs;
    size_t nglobs;
    gdb **dbs;
    size_t ndbs, capdbs;
    gdir **dirs;
    size_t ndirs;
    gdb *want_head, *want_tail;
    gdb *probe_head, *probe_tail;
    size_t nprobes; /* running */
    size_t nopen;   /* G_OPEN and G_CLOSING */
    unsigned share;
    uv_timer_t timer;
    uint64_t timer_due; /* loop ms the timer is armed for, 0: not armed */
    uv_timer_t drain_timer;
    uv_timer_t settle_timer; /* frees stopped relays outside their stop callback */
    int handles_open;
    int link_closed;
    int starting; /* start is finding the databases: no drain ends meanwhile */
    int drain_done, drain_error;
    char drain_failed[1024];
    void (*on_drained)(outbox_relay_group *g, void *data);
    void *on_drained_data;
    void (*stop_cb)(outbox_relay_group *g, void *data);
    void *stop_data;
    int in_stop_cb, destroy_pending;
    uint64_t published_total, failed_total, dead_total; /* of the relays closed so far */
    outbox__http *http; /* /metrics and /healthz, with metrics_listen */
};

#define GLOG(g, lvl, ...) outbox__log(&(g)->cfg.log, (lvl), __VA_ARGS__)

static void pump(outbox_relay_group *g);
static void probe(gdb *d);
static void want(gdb *d);
static void arm(outbox_relay_group *g, uint64_t delay);
static void drain_check(outbox_relay_group *g);
static void stop_check(outbox_relay_group *g);

/* ---- files ------------------------------------------------------------ */

static void snap(const char *path, fsnap *s)
{
    struct stat st;
    memset(s, 0, sizeof *s);
    if (stat(path, &st) != 0)
        return;
    s->ok = 1;
    s->dev = st.st_dev;
    s->ino = st.st_ino;
    s->size = st.st_size;
    s->mtime = st.st_mtim;
}

static int snap_same(const fsnap *a, const fsnap *b)
{
    if (a->ok != b->ok)
        return 0;
    return !a->ok || (a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
                      a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec);
}

static void snap_both(gdb *d, fsnap *db, fsnap *wal)
{
    char w[4200];
    snap(d->path, db);
    snprintf(w, sizeof w, "%s-wal", d->path);
    snap(w, wal);
    /* An empty -wal is no -wal: the last connection to close removes it,
     * a reader that opens the database (a probe) creates it. A commit
     * writes at least a header and a frame. */
    if (wal->ok && wal->size == 0)
        memset(wal, 0, sizeof *wal);
}

/* Have the files changed since the group last looked? */
static int changed(gdb *d)
{
    fsnap db, wal;
    snap_both(d, &db, &wal);
    return !snap_same(&db, &d->snap_db) || !snap_same(&wal, &d->snap_wal);
}

static void remember(gdb *d)
{
    snap_both(d, &d->snap_db, &d->snap_wal);
}

static int matches(const outbox_relay_group *g, const char *file)
{
    for (size_t i = 0; i < g->nglobs; i++)
        if (fnmatch(g->globs[i], file, FNM_PERIOD) == 0)
            return 1;
    return 0;
}

/* The database's name: the file name without its directory and ".db". */
static char *name_of(const char *file)
{
    size_t n = strlen(file);
    char *s;
    if (n > 3 && !strcmp(file + n - 3, ".db"))
        n -= 3;
    s = malloc(n + 1);
    if (s) {
        memcpy(s, file, n);
        s[n] = '\0';
    }
    return s;
}

/* ---- entries ---------------------------------------------------------- */

static gdb *find_path(const outbox_relay_group *g, const char *path)
{
    for (size_t i = 0; i < g->ndbs; i++)
        if (!strcmp(g->dbs[i]->path, path))
            return g->dbs[i];
    return NULL;
}

static gdb *find_name(const outbox_relay_group *g, const char *name)
{
    for (size_t i = 0; i < g->ndbs; i++)
        if (!strcmp(g->dbs[i]->name, name))
            return g->dbs[i];
    return NULL;
}

static void free_gdb(gdb *d)
{
    free(d->name);
    free(d->path);
    free(d);
}

/* Drops an entry that has nothing running (not open, probing or queued). */
static void drop(gdb *d)
{
    outbox_relay_group *g = d->g;
    for (size_t i = 0; i < g->ndbs; i++)
        if (g->dbs[i] == d) {
            g->dbs[i] = g->dbs[--g->ndbs];
            break;
        }
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"database dropped\" database=%s", d->name);
    free_gdb(d);
}

static void close_db(gdb *d);

/* The database leaves the group (its file went away, or remove): its relay
 * stops first; one queued, probing or closing is dropped once that ends. */
static void leave(gdb *d)
{
    d->gone = 1;
    if (d->state == G_OPEN)
        close_db(d);
    else if (d->state == G_IDLE || d->state == G_FAILED || d->state == G_NOSCHEMA)
        drop(d);
}

static gdb *add_entry(outbox_relay_group *g, const char *name, const char *path, int *e)
{
    gdb *d;
    const char *slash;
    if (find_name(g, name)) {
        *e = OUTBOX_EDUPLICATE;
        return NULL;
    }
    if (g->ndbs == g->capdbs) {
        size_t cap = g->capdbs ? g->capdbs * 2 : 64;
        gdb **n = realloc(g->dbs, cap * sizeof *n);
        if (!n) {
            *e = OUTBOX_ENOMEM;
            return NULL;
        }
        g->dbs = n;
        g->capdbs = cap;
    }
    d = calloc(1, sizeof *d);
    if (!d || !(d->name = strdup(name)) || !(d->path = strdup(path))) {
        if (d)
            free_gdb(d);
        *e = OUTBOX_ENOMEM;
        return NULL;
    }
    d->g = g;
    slash = strrchr(path, '/');
    d->dirlen = slash ? (size_t)(slash - path) : 0;
    d->state = G_IDLE;
    d->work.data = d;
    g->dbs[g->ndbs++] = d;
    *e = 0;
    return d;
}

static void set_share(outbox_relay_group *g)
{
    unsigned open = g->nopen ? (unsigned)g->nopen : 1, s = g->tmpl.inflight / open;
    g->share = s > g->tmpl.batch ? s : g->tmpl.batch;
}

/* ---- failures ---------------------------------------------------------- */

/* d could not be opened (e, why): logged when the reason is new, tried
 * again later (a drain names it instead). */
static void failed(gdb *d, int e, const char *why)
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
            arm(g, d->retry_ms);
        remember(d);
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
            arm(g, d->retry_ms);
    }
    outbox__strlcpy(d->logged, d->why, sizeof d->logged);
    if (g->tmpl.drain && e != OUTBOX_ENOSCHEMA)
        d->drain_failed = 1;
    remember(d);
}

/* ---- the relays --------------------------------------------------------- */

/* The relays' lines name their database. */
static void relay_log(void *data, outbox_log_level level, const char *line)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    char buf[4096], q[300];
    outbox__logfmt_quote(q, sizeof q, d->name);
    snprintf(buf, sizeof buf, "%s database=%s", line, q);
    g->tmpl.log(g->tmpl.log_data, level, buf);
}


static void on_relay_drained(outbox_relay *r, void *data)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    int e = outbox_relay_drain_result(r);
    if (d->state != G_OPEN)
        return;
    if (e == OUTBOX_ECONFIG) {
        /* Redis cannot be used as configured: the link said why. */
        if (g->tmpl.drain) {
            if (!g->drain_error)
                g->drain_error = OUTBOX_ECONFIG;
            d->drain_failed = 1;
            outbox__strlcpy(d->why, outbox_strerror(e), sizeof d->why);
        } else {
            d->wake_at = outbox_now_ms() + HELD_RETRY_MS;
        }
        close_db(d);
        return;
    }
    d->retry_ms = 0; /* it opened: failures begin again from the start */
    d->busy_since = 0;
    d->logged[0] = '\0';
    d->idle_since = uv_now(g->loop);
    d->idle_mark = r->stats.published_total + r->stats.failed_total + r->stats.dead_total;
    if (g->tmpl.drain) {
        d->drained = 1;
        close_db(d);
        return;
    }
    arm(g, LINGER_MS);
    pump(g);
}

static void on_settle(uv_timer_t *t);

/* A relay stopped: it is freed on the next loop turn, outside its stop
 * callback, so that its connections are closed (the last one checkpoints
 * and removes the -wal) before the group looks at the files. */
static void on_relay_stopped(outbox_relay *r, void *data)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    (void)r;
    d->settle = 1;
    uv_timer_start(&g->settle_timer, on_settle, 0, 0);
}

static void settled(gdb *d)
{
    outbox_relay_group *g = d->g;
    outbox_relay *r = d->r;
    d->settle = 0;
    g->published_total += r->stats.published_total;
    g->failed_total += r->stats.failed_total;
    g->dead_total += r->stats.dead_total;
    outbox_relay_destroy(r);
    d->r = NULL;
    g->nopen--;
    set_share(g);
    d->state = G_IDLE;
    if (d->open_failed && !d->gone && g->state == R_RUNNING) {
        d->open_failed = 0;
        failed(d, d->open_e, d->open_why);
        return;
    }
    if (d->gone || g->state == R_STOPPING) {
        if (d->gone)
            drop(d);
    } else if (d->requeue) {
        d->requeue = 0;
        want(d);
    } else if (!g->tmpl.drain || !d->drained) {
        /* A commit while it closed would wake nobody: look again. */
        probe(d);
    } else {
        remember(d);
    }
}

static void on_settle(uv_timer_t *t)
{
    outbox_relay_group *g = t->data;
    size_t i = 0;
    while (i < g->ndbs) {
        gdb *d = g->dbs[i];
        if (d->settle) {
            settled(d); /* may drop d: the array changes at i */
            continue;
        }
        i++;
    }
    pump(g);
    drain_check(g);
    stop_check(g);
}

static void close_db(gdb *d)
{
    if (d->state != G_OPEN)
        return;
    d->state = G_CLOSING;
    d->idle_since = 0;
    if (outbox_relay_stop(d->r, on_relay_stopped, d) != 0)
        on_relay_stopped(d->r, d);
}

/* The relay could not open its database (on its worker thread): it stops,
 * and the entry fails once it is freed (settled). */
static void on_open_failed(outbox_relay *r, int e, const char *why, void *data)
{
    gdb *d = data;
    (void)r;
    d->open_failed = 1;
    d->open_e = e;
    outbox__strlcpy(d->open_why, why, sizeof d->open_why);
    close_db(d);
}

static void open_db(gdb *d)
{
    outbox_relay_group *g = d->g;
    outbox_relay_settings s = g->tmpl;
    char err[512], prefix[400];
    int e;
    s.db_path = d->path;
    s.db_name = d->name;
    s.db_dir = NULL;
    s.drain = 1;
    s.drain_timeout_ms = 0;
    s.on_drained = on_relay_drained;
    s.on_drained_data = d;
    s.log = relay_log;
    s.log_data = d;
    s.wait_for_db = 0;
    s.metrics_listen = NULL; /* the group's endpoint speaks for all */
    s.stream_template = NULL;
    if (g->tmpl.stream_template) {
        /* "...%db...%topic": the relay's prefix is the part before %topic,
         * with the database's name in it (the template was checked). */
        const char *t = g->tmpl.stream_template, *at = strstr(t, "%db");
        snprintf(prefix, sizeof prefix, "%.*s%s%.*s", (int)(at - t), t, d->name,
                 (int)(strlen(t) - 6 - (size_t)(at + 3 - t)), at + 3);
        s.stream_prefix = prefix;
    }
    e = outbox__relay_create_on(&d->r, g->loop, &s, &g->link, err, sizeof err);
    if (e == 0) {
        d->r->share = &g->share;
        d->r->open_failed = on_open_failed;
        d->r->open_failed_data = d;
        g->nopen++;
        set_share(g);
        if ((e = outbox_relay_start(d->r)) != 0) {
            outbox_relay_destroy(d->r);
            d->r = NULL;
            g->nopen--;
            set_share(g);
            snprintf(err, sizeof err, "cannot start: %s", outbox_strerror(e));
        }
    }
    if (e != 0) {
        d->r = NULL;
        failed(d, e, err);
        drain_check(g);
        return;
    }
    d->state = G_OPEN;
    d->e = 0;
    d->wake_at = 0;
    d->opened_at = d->last_used = uv_now(g->loop);
}

/* ---- the queue of databases to open --------------------------------------- */

static void want(gdb *d)
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
    pump(g);
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

static void pump(outbox_relay_group *g)
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
                arm(g, retry ? retry : 100);
                return;
            }
            if (!v->idle_since)
                v->requeue = 1;
            close_db(v);
            closing++;
            continue;
        }
        g->want_head = d->want_next;
        if (!g->want_head)
            g->want_tail = NULL;
        d->want_next = NULL;
        d->dirty = 0;
        if (d->gone) {
            drop(d);
            continue;
        }
        open_db(d);
        busy += d->state == G_OPEN;
    }
}

/* ---- probes ------------------------------------------------------------- */

static void probe_work(uv_work_t *w)
{
    gdb *d = w->data;
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t now = outbox_now_ms();
    int e, rc;
    d->p_why[0] = '\0';
    d->p_left[0] = d->p_left[1] = d->p_left[2] = 0;
    d->p_next_due = d->p_next_lease = INT64_MAX;
    e = outbox_db_open(d->path, OUTBOX_OPEN_READONLY, &db, d->p_why, sizeof d->p_why);
    d->p_noschema = 0;
    if (e == 0)
        e = outbox_schema_check(db, d->p_why, sizeof d->p_why);
    if (e == OUTBOX_ENOSCHEMA) {
        /* No table at all (an application still creating it), or an older
         * schema that a relay migrates. */
        rc = sqlite3_prepare_v2(db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'outbox'",
                                -1, &st, NULL);
        if (rc == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) == 0)
            d->p_noschema = 1;
        sqlite3_finalize(st);
        st = NULL;
    }
    if (e == 0) {
        static const char *const sql[3] = {OUTBOX__SQL_DRAIN, OUTBOX__SQL_NEXT_DUE, OUTBOX__SQL_NEXT_LEASE};
        for (int i = 0; i < 3 && e == 0; i++) {
            rc = sqlite3_prepare_v2(db, sql[i], -1, &st, NULL);
            if (rc == SQLITE_OK) {
                sqlite3_bind_int64(st, 1, now);
                if (i == 0)
                    sqlite3_bind_int64(st, 2, 1);
                rc = sqlite3_step(st);
            }
            if (rc == SQLITE_ROW) {
                if (i == 0)
                    for (int k = 0; k < 3; k++)
                        d->p_left[k] = sqlite3_column_int64(st, k);
                else if (sqlite3_column_type(st, 0) != SQLITE_NULL)
                    *(i == 1 ? &d->p_next_due : &d->p_next_lease) = sqlite3_column_int64(st, 0);
            } else {
                snprintf(d->p_why, sizeof d->p_why, "%s", sqlite3_errmsg(db));
                e = rc == SQLITE_BUSY ? OUTBOX_EBUSY : OUTBOX_ESQLITE;
            }
            sqlite3_finalize(st);
            st = NULL;
        }
    }
    sqlite3_close_v2(db);
    d->p_e = e;
}

static void probe_next(outbox_relay_group *g);

static void probe_done(uv_work_t *w, int status)
{
    gdb *d = w->data;
    outbox_relay_group *g = d->g;
    int64_t now = outbox_now_ms();
    g->nprobes--;
    d->p_running = 0;
    d->state = G_IDLE;
    if (d->gone || g->state != R_RUNNING || status != 0) {
        if (d->gone)
            drop(d);
    } else if (d->p_e == OUTBOX_ENOSCHEMA && d->p_noschema) {
        int dirty = d->dirty;
        failed(d, OUTBOX_ENOSCHEMA, d->p_why);
        d->dirty = dirty;
        if (dirty)
            arm(g, NOSCHEMA_MS);
    } else if (d->p_e == OUTBOX_ENOSCHEMA || d->p_e == OUTBOX_ESCHEMANEWER) {
        /* An older schema the relay migrates, or none: the relay decides. */
        d->dirty = 0;
        want(d);
    } else if (d->p_e != 0) {
        failed(d, d->p_e, d->p_why);
    } else if (d->p_left[0] > 0 || (g->tmpl.drain && (d->p_left[1] > 0 || d->p_left[2] > 0)) || d->dirty) {
        GLOG(g, OUTBOX_LOG_DEBUG, "msg=\"database has work\" database=%s due=%lld waiting_retry=%lld leased=%lld "
                                  "changed=%d", d->name, (long long)d->p_left[0], (long long)d->p_left[1],
             (long long)d->p_left[2], d->dirty);
        d->dirty = 0;
        want(d);
    } else {
        int64_t next = d->p_next_due < d->p_next_lease ? d->p_next_due : d->p_next_lease;
        d->wake_at = next != INT64_MAX && (d->p_left[1] > 0 || d->p_left[2] > 0 || d->p_next_due != INT64_MAX)
                         ? next
                         : 0;
        if (d->wake_at)
            arm(g, d->wake_at > now ? (uint64_t)(d->wake_at - now) : 0);
        if (g->tmpl.drain)
            d->drained = 1;
    }
    probe_next(g);
    drain_check(g);
    stop_check(g);
}

static void probe_next(outbox_relay_group *g)
{
    while (g->probe_head && g->nprobes < PROBES_MAX && g->state == R_RUNNING) {
        gdb *d = g->probe_head;
        g->probe_head = d->probe_next;
        if (!g->probe_head)
            g->probe_tail = NULL;
        d->probe_next = NULL;
        d->probed_at = uv_now(g->loop);
        if (uv_queue_work(g->loop, &d->work, probe_work, probe_done) != 0) {
            d->state = G_IDLE;
            want(d);
            continue;
        }
        d->p_running = 1;
        g->nprobes++;
    }
}

/* Looks at what a closed database has to do, on a worker thread. */
static void probe(gdb *d)
{
    outbox_relay_group *g = d->g;
    if (g->state != R_RUNNING || d->gone || (d->state != G_IDLE && d->state != G_FAILED && d->state != G_NOSCHEMA))
        return;
    d->state = G_PROBING;
    d->dirty = 0;
    remember(d);
    d->probe_next = NULL;
    if (g->probe_tail)
        g->probe_tail->probe_next = d;
    else
        g->probe_head = d;
    g->probe_tail = d;
    probe_next(g);
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
                    outbox__sched_drain_rearm(r);
                } else {
                    close_db(d);
                }
            } else {
                at = d->idle_since + LINGER_MS;
            }
        } else if (d->state == G_NOSCHEMA && d->dirty) {
            if (now - d->probed_at >= NOSCHEMA_MS)
                probe(d);
            else
                at = d->probed_at + NOSCHEMA_MS;
        } else if (d->state == G_FAILED && (!g->tmpl.drain || (d->busy_since && !d->drain_failed))) {
            if (now >= d->retry_at)
                probe(d);
            else
                at = d->retry_at;
        } else if (d->state == G_IDLE && d->wake_at) {
            if (wall >= d->wake_at) {
                d->wake_at = 0;
                probe(d);
            } else {
                at = now + (uint64_t)(d->wake_at - wall);
            }
        }
        if (at < next)
            next = at;
    }
    pump(g);
    if (next != UINT64_MAX)
        arm(g, next > now ? next - now : 0);
}

static void arm(outbox_relay_group *g, uint64_t delay)
{
    uint64_t due = uv_now(g->loop) + delay;
    if (g->state != R_RUNNING)
        return;
    if (g->timer_due && g->timer_due <= due)
        return;
    g->timer_due = due;
    uv_timer_start(&g->timer, on_timer, delay, 0);
}

/* ---- the directories ---------------------------------------------------- */

/* Something happened to file in dir: a new database, a commit to a closed
 * one, one deleted. */
static void on_file(outbox_relay_group *g, gdir *dr, const char *file)
{
    char path[4200], base[4096];
    size_t n = strlen(file);
    struct stat st;
    gdb *d;
    int e;
    if (n >= sizeof base)
        return;
    memcpy(base, file, n + 1);
    /* A commit writes the -wal (or the -journal); -shm changes on reads. */
    if (n > 4 && !strcmp(base + n - 4, "-wal"))
        base[n - 4] = '\0';
    else if (n > 8 && !strcmp(base + n - 8, "-journal"))
        base[n - 8] = '\0';
    else if (n > 4 && !strcmp(base + n - 4, "-shm"))
        return;
    snprintf(path, sizeof path, "%s/%s", dr->path, base);
    d = find_path(g, path);
    if (!d && (!dr->watched || !matches(g, base)))
        return;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (!d || d->added)
            return; /* an added database that is missing fails when it opens */
        leave(d);
        return;
    }
    if (!d) {
        char *name = name_of(base);
        if (!name)
            return;
        if (strchr(name, ':') || strlen(name) > 200) {
            /* db_name's rules (settings.c): said once, when it appears. */
            GLOG(g, OUTBOX_LOG_WARN, "msg=\"file ignored: its name cannot name a database (':' or over 200 "
                                     "bytes)\" path=%s", path);
            free(name);
            return;
        }
        d = add_entry(g, name, path, &e);
        if (!d) {
            if (e == OUTBOX_EDUPLICATE)
                GLOG(g, OUTBOX_LOG_WARN, "msg=\"a database of that name is published already: file ignored\" "
                                        "database=%s path=%s", name, path);
            free(name);
            return;
        }
        free(name);
        /* At start one line says how many; later each one found. */
        GLOG(g, g->starting ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_INFO, "msg=\"database found\" database=%s path=%s",
             d->name, d->path);
        /* A drain opens every database anyway: no probe first. */
        if (g->tmpl.drain) {
            remember(d);
            want(d);
        } else {
            probe(d);
        }
        return;
    }
    switch (d->state) {
    case G_IDLE:
        if (changed(d)) {
            GLOG(g, OUTBOX_LOG_DEBUG, "msg=\"database changed\" database=%s file=%s", d->name, file);
            remember(d);
            want(d);
        }
        break;
    case G_NOSCHEMA:
        /* Looked at again once it changed, at most once per NOSCHEMA_MS (an
         * application writing to a file that is no outbox). */
        if (uv_now(g->loop) - d->probed_at >= NOSCHEMA_MS) {
            probe(d);
        } else {
            d->dirty = 1;
            arm(g, d->probed_at + NOSCHEMA_MS - uv_now(g->loop));
        }
        break;
    case G_PROBING:
        /* Changed since the probe began: its answer may be too old. */
        if (changed(d))
            d->dirty = 1;
        break;
    case G_CLOSING:
        break; /* a probe follows the close */
    case G_OPEN:
        d->last_used = uv_now(g->loop);
        outbox__wake_look(d->r); /* its own watch (wake.c) is the group's */
        break;
    default:
        break; /* queued, or failed: its retry comes */
    }
}

static void scan_dir(outbox_relay_group *g, gdir *dr)
{
    DIR *dh = opendir(dr->path);
    struct dirent *de;
    if (!dh) {
        GLOG(g, OUTBOX_LOG_ERROR, "msg=\"cannot read the directory\" dir=%s error=\"%s\"", dr->path, strerror(errno));
        return;
    }
    while ((de = readdir(dh)) != NULL)
        if (de->d_name[0] != '.' && matches(g, de->d_name))
            on_file(g, dr, de->d_name);
    closedir(dh);
}

static void on_dir_event(uv_fs_event_t *h, const char *file, int events, int status)
{
    gdir *dr = h->data;
    (void)events;
    if (status != 0 || !file) {
        /* Lost events (the kernel's queue overflowed): look at everything. */
        if (dr->watched)
            scan_dir(dr->g, dr);
        return;
    }
    on_file(dr->g, dr, file);
}

static gdir *dir_for(outbox_relay_group *g, const char *path, size_t len)
{
    gdir **n, *dr;
    for (size_t i = 0; i < g->ndirs; i++)
        if (strlen(g->dirs[i]->path) == len && !memcmp(g->dirs[i]->path, path, len))
            return g->dirs[i];
    n = realloc(g->dirs, (g->ndirs + 1) * sizeof *n);
    if (!n)
        return NULL;
    g->dirs = n;
    dr = calloc(1, sizeof *dr);
    if (!dr || !(dr->path = strndup(path, len))) {
        free(dr);
        return NULL;
    }
    dr->g = g;
    dr->ev.data = dr;
    g->dirs[g->ndirs++] = dr;
    return dr;
}

static int watch(outbox_relay_group *g, gdir *dr)
{
    int e;
    if (dr->active)
        return 0;
    uv_fs_event_init(g->loop, &dr->ev);
    dr->ev.data = dr;
    e = uv_fs_event_start(&dr->ev, on_dir_event, dr->path, 0);
    if (e != 0) {
        uv_close((uv_handle_t *)&dr->ev, NULL);
        GLOG(g, OUTBOX_LOG_ERROR, "msg=\"cannot watch the directory\" dir=%s error=\"%s\"", dr->path,
             uv_strerror(e));
        return OUTBOX_EIO;
    }
    dr->active = 1;
    g->handles_open++;
    return 0;
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
        if (off < sizeof g->drain_failed - 1)
            off += (size_t)snprintf(g->drain_failed + off, sizeof g->drain_failed - off, "%s%s (%s)",
                                    off ? ", " : "", d->name, d->why[0] ? d->why : "not drained");
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
static void drain_check(outbox_relay_group *g)
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

/* ---- /metrics and /healthz ------------------------------------------------- */

/* Failing databases named in /metrics and /healthz, at most: the number
 * of series stays bounded whatever the number of databases. */
#define HEALTH_NAMES_MAX 20

static void prom_label(outbox__sbuf *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            outbox__sbuf_printf(b, "\\%c", *v);
        else if (*v == '\n')
            outbox__sbuf_printf(b, "\\n");
        else
            outbox__sbuf_printf(b, "%c", *v);
    }
}

static void group_metrics(outbox_relay_group *g, outbox__sbuf *b)
{
    outbox_relay_group_stats st;
    size_t named = 0;
    outbox_relay_group_stats_get(g, &st);
    outbox__sbuf_printf(b,
                        "# HELP outbox_databases Databases of the group by state.\n"
                        "# TYPE outbox_databases gauge\n"
                        "outbox_databases{state=\"open\"} %zu\noutbox_databases{state=\"closed\"} %zu\n"
                        "outbox_databases{state=\"failed\"} %zu\noutbox_databases{state=\"not_outbox\"} %zu\n",
                        st.open, st.closed, st.failed, st.not_outbox);
    outbox__sbuf_printf(b, "# HELP outbox_database_failing 1 for a database that cannot be opened (at most %d "
                           "named).\n# TYPE outbox_database_failing gauge\n",
                        HEALTH_NAMES_MAX);
    for (size_t i = 0; i < g->ndbs && named < HEALTH_NAMES_MAX; i++)
        if (g->dbs[i]->state == G_FAILED) {
            outbox__sbuf_printf(b, "outbox_database_failing{db=\"");
            prom_label(b, g->dbs[i]->name);
            outbox__sbuf_printf(b, "\"} 1\n");
            named++;
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
}

static void on_http(void *data, outbox__http_req *req, const char *path)
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
        for (size_t i = 0; i < g->ndbs && named < HEALTH_NAMES_MAX; i++)
            if (g->dbs[i]->state == G_FAILED) {
                outbox__sbuf_printf(&b, "failing: %s: %s\n", g->dbs[i]->name, g->dbs[i]->why);
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

static void on_http_closed(void *data)
{
    outbox_relay_group *g = data;
    g->http = NULL;
    g->handles_open--;
    stop_check(g);
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
    for (size_t i = 0; i < g->ndbs; i++)
        free_gdb(g->dbs[i]);
    free(g->dbs);
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
    set_share(g);
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
    if (find_path(g, path))
        return outbox__errf(err, errlen, OUTBOX_EDUPLICATE, "%s: the group publishes it already", path);
    d = add_entry(g, name, path, &e);
    if (!d)
        return outbox__errf(err, errlen, e, e == OUTBOX_EDUPLICATE ? "%s: a database of that name is in the group"
                                                                   : "%s: out of memory", name);
    d->added = 1;
    dr = dir_for(g, path, d->dirlen ? d->dirlen : 1);
    if (dr && d->dirlen == 0) {
        free(dr->path);
        dr->path = strdup(".");
    }
    if (dr && g->state == R_RUNNING)
        watch(g, dr);
    if (g->state == R_RUNNING)
        want(d);
    return 0;
}

int outbox_relay_group_remove(outbox_relay_group *g, const char *name)
{
    gdb *d;
    if (!g || !name)
        return OUTBOX_EINVAL;
    if (!(d = find_name(g, name)) || d->gone)
        return OUTBOX_ESTATE;
    leave(d);
    return 0;
}

int outbox_relay_group_start(outbox_relay_group *g)
{
    int e;
    if (!g || g->state != R_CREATED)
        return OUTBOX_ESTATE;
    if (g->cfg.s.metrics_listen) {
        char herr[300];
        e = outbox__http_start(&g->http, g->loop, g->cfg.s.metrics_listen, g->cfg.web, NULL, on_http, g,
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
        gdir *dr = dir_for(g, g->db_dir, strlen(g->db_dir));
        if (!dr)
            return OUTBOX_ENOMEM;
        dr->watched = 1;
        if ((e = watch(g, dr)) != 0) {
            /* What started closes again; destroy frees it once closed. */
            outbox_relay_group_stop(g, NULL, NULL);
            return e;
        }
    }
    for (size_t i = 0; i < g->ndirs; i++)
        watch(g, g->dirs[i]);
    outbox__link_open(&g->link);
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"started\" worker=%s db_dir=%s redis=%s max_open_dbs=%u", g->cfg.worker_id,
         g->db_dir ? g->db_dir : "none", g->cfg.url_desc, g->tmpl.max_open_dbs);
    if (g->tmpl.drain && g->tmpl.drain_timeout_ms)
        uv_timer_start(&g->drain_timer, on_drain_timeout, g->tmpl.drain_timeout_ms, 0);
    /* What is there now: each database probed (a drain has each one's
     * drain decide), then the directory's events. */
    g->starting = 1;
    for (size_t i = 0; i < g->ndbs; i++)
        probe(g->dbs[i]);
    for (size_t i = 0; i < g->ndirs; i++)
        if (g->dirs[i]->watched)
            scan_dir(g, g->dirs[i]);
    g->starting = 0;
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"databases found\" count=%zu", g->ndbs);
    drain_check(g);
    return 0;
}

static void on_handle_closed(uv_handle_t *h)
{
    outbox_relay_group *g = h->data;
    if (h->type == UV_FS_EVENT)
        g = ((gdir *)h->data)->g;
    g->handles_open--;
    stop_check(g);
}

static void on_link_closed(void *data)
{
    outbox_relay_group *g = data;
    g->link_closed = 1;
    stop_check(g);
}

static void stop_check(outbox_relay_group *g)
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
                outbox__http_close(g->http, on_http_closed, g);
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
        if (d->state == G_OPEN) {
            d->state = G_CLOSING;
            if (outbox_relay_stop(d->r, on_relay_stopped, d) != 0)
                on_relay_stopped(d->r, d);
        }
    }
    /* Probes waiting for a turn never ran: only running ones are awaited. */
    for (size_t i = 0; i < g->ndbs; i++)
        if (g->dbs[i]->state == G_PROBING && !g->dbs[i]->p_running)
            g->dbs[i]->state = G_IDLE;
    stop_check(g);
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
    if (!(d = find_name(g, name)))
        return OUTBOX_GROUP_DB_UNKNOWN;
    if (why && len)
        outbox__strlcpy(why, d->state == G_FAILED || d->state == G_NOSCHEMA ? d->why : "", len);
    return map[d->state];
}
