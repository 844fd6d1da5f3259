/*
 * group_watch.c: a group's files (group_int.h): the directory watches (one
 * inotify watch per directory), what a file's event means (a new database,
 * a commit to a closed one, one deleted), and the probes that look at what
 * a closed database has to do, on a worker thread, through a read-only
 * connection. Loop thread, except probe_work.
 */
#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "group_int.h"
#include "sql.h"

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

void outbox__group_remember(gdb *d)
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
    d->p_next_due = d->p_next_lease = d->p_oldest_published = INT64_MAX;
    d->p_expired = 0;
    /* No busy wait (OUTBOX_OPEN_RELAY): a locked database is tried again
     * from 5 ms, doubling to 1 s (outbox__group_failed); a writer's busy
     * wait of 5 s held a worker thread and one of the PROBES_MAX slots per
     * try, and every other database's probe waited behind it. */
    e = outbox_db_open(d->path, OUTBOX_OPEN_READONLY | OUTBOX_OPEN_RELAY, &db, d->p_why, sizeof d->p_why);
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
        /* The drain's counts, when the next waiting row comes due and the
         * next lease runs out, and whether one ran out already: work
         * outside a drain too (a drain counts it among the leased rows),
         * since its holder died and nothing else would bring its rows back
         * before a commit to this database. */
        static const char *const sql[4] = {OUTBOX__SQL_DRAIN, OUTBOX__SQL_NEXT_DUE, OUTBOX__SQL_NEXT_LEASE,
                                           OUTBOX__SQL_EXPIRED_LEASE};
        int64_t expired = 0, *one[4] = {NULL, &d->p_next_due, &d->p_next_lease, &expired};
        for (int i = 0; i < 4 && e == 0; i++) {
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
                    *one[i] = sqlite3_column_int64(st, 0);
            } else {
                snprintf(d->p_why, sizeof d->p_why, "%s", sqlite3_errmsg(db));
                e = rc == SQLITE_BUSY ? OUTBOX_EBUSY : OUTBOX_ESQLITE;
            }
            sqlite3_finalize(st);
            st = NULL;
        }
        d->p_expired = expired != 0;
    }
    if (e == 0 && d->g->tmpl.retention_ms && !d->g->tmpl.drain) {
        /* Retention deletes published rows of an open database only: when
         * a closed one's come due, it is opened for them (probe_done). A
         * failure here leaves them for the next probe. */
        if (sqlite3_prepare_v2(db, OUTBOX__SQL_RETENTION_OLDEST, -1, &st, NULL) == SQLITE_OK &&
            sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL)
            d->p_oldest_published = sqlite3_column_int64(st, 0);
        sqlite3_finalize(st);
        st = NULL;
    }
    sqlite3_close_v2(db);
    d->p_e = e;
}

/* When retention has rows of a closed database to delete (unix ms), or
 * INT64_MAX: none. */
static int64_t retention_due(const gdb *d)
{
    int64_t ret = (int64_t)d->g->tmpl.retention_ms, slack = ret / 24;
    if (d->p_oldest_published == INT64_MAX)
        return INT64_MAX;
    slack = slack < RET_SLACK_MIN_MS ? RET_SLACK_MIN_MS : slack > RET_SLACK_MAX_MS ? RET_SLACK_MAX_MS : slack;
    return d->p_oldest_published + ret + slack;
}

static void probe_next(outbox_relay_group *g);

static void probe_done(uv_work_t *w, int status)
{
    gdb *d = w->data;
    outbox_relay_group *g = d->g;
    int64_t now = outbox_now_ms(), ret = retention_due(d);
    g->nprobes--;
    d->p_running = 0;
    d->state = G_IDLE;
    if (d->gone || g->state != R_RUNNING || status != 0) {
        if (d->gone)
            outbox__group_drop(d);
    } else if (d->p_e == OUTBOX_ENOSCHEMA && d->p_noschema) {
        int dirty = d->dirty;
        outbox__group_failed(d, OUTBOX_ENOSCHEMA, d->p_why);
        d->dirty = dirty;
        if (dirty)
            outbox__group_arm(g, NOSCHEMA_MS);
    } else if (d->p_e == OUTBOX_ENOSCHEMA || d->p_e == OUTBOX_ESCHEMANEWER) {
        /* An older schema the relay migrates, or none: the relay decides. */
        d->dirty = 0;
        outbox__group_want(d);
    } else if (d->p_e != 0) {
        outbox__group_failed(d, d->p_e, d->p_why);
    } else if (d->p_left[0] > 0 || d->p_expired || (g->tmpl.drain && (d->p_left[1] > 0 || d->p_left[2] > 0)) ||
               d->dirty || ret <= now) {
        GLOG(g, OUTBOX_LOG_DEBUG,
             "msg=\"database has work\" database=%s due=%lld waiting_retry=%lld leased=%lld expired_lease=%d "
             "changed=%d retention=%d",
             d->name, (long long)d->p_left[0], (long long)d->p_left[1], (long long)d->p_left[2], d->p_expired,
             d->dirty, ret <= now);
        d->dirty = 0;
        outbox__group_want(d);
    } else {
        int64_t next = d->p_next_due < d->p_next_lease ? d->p_next_due : d->p_next_lease;
        if (!(d->p_left[1] > 0 || d->p_left[2] > 0 || d->p_next_due != INT64_MAX))
            next = INT64_MAX;
        if (ret < next)
            next = ret;
        d->wake_at = next != INT64_MAX ? next : 0;
        if (d->wake_at)
            outbox__group_arm(g, d->wake_at > now ? (uint64_t)(d->wake_at - now) : 0);
        if (g->tmpl.drain)
            d->drained = 1;
    }
    probe_next(g);
    outbox__group_drain_check(g);
    outbox__group_stop_check(g);
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
            outbox__group_want(d);
            continue;
        }
        d->p_running = 1;
        g->nprobes++;
    }
}

/* Looks at what a closed database has to do, on a worker thread. */
void outbox__group_probe(gdb *d)
{
    outbox_relay_group *g = d->g;
    if (g->state != R_RUNNING || d->gone || (d->state != G_IDLE && d->state != G_FAILED && d->state != G_NOSCHEMA))
        return;
    d->state = G_PROBING;
    d->dirty = 0;
    outbox__group_remember(d);
    d->probe_next = NULL;
    if (g->probe_tail)
        g->probe_tail->probe_next = d;
    else
        g->probe_head = d;
    g->probe_tail = d;
    probe_next(g);
}

/* ---- the directories ---------------------------------------------------- */

/* Something happened to file in dir: a new database, a commit to a closed
 * one, one deleted. */
static void on_file(outbox_relay_group *g, gdir *dr, const char *file, int events)
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
    d = outbox__group_find_path(g, path);
    if (!d && (!dr->watched || !matches(g, base)))
        return;
    if (d && d->state == G_OPEN && events == UV_CHANGE) {
        /* A write to an open database (its relay's own commits write too):
         * its relay looks whether another connection committed; the file
         * is still there (a removal comes as a rename). */
        d->last_used = uv_now(g->loop);
        outbox__wake_look(d->r);
        return;
    }
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (!d || d->added)
            return; /* an added database that is missing fails when it opens */
        outbox__group_leave(d);
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
        d = outbox__group_add_entry(g, name, path, &e);
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
            outbox__group_remember(d);
            outbox__group_want(d);
        } else {
            outbox__group_probe(d);
        }
        return;
    }
    switch (d->state) {
    case G_IDLE:
        if (changed(d)) {
            GLOG(g, OUTBOX_LOG_DEBUG, "msg=\"database changed\" database=%s file=%s", d->name, file);
            outbox__group_remember(d);
            outbox__group_want(d);
        }
        break;
    case G_NOSCHEMA:
        /* Looked at again once it changed, at most once per NOSCHEMA_MS (an
         * application writing to a file that is no outbox). */
        if (uv_now(g->loop) - d->probed_at >= NOSCHEMA_MS) {
            outbox__group_probe(d);
        } else {
            d->dirty = 1;
            outbox__group_arm(g, d->probed_at + NOSCHEMA_MS - uv_now(g->loop));
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

void outbox__group_scan_dir(outbox_relay_group *g, gdir *dr)
{
    DIR *dh = opendir(dr->path);
    struct dirent *de;
    if (!dh) {
        GLOG(g, OUTBOX_LOG_ERROR, "msg=\"cannot read the directory\" dir=%s error=\"%s\"", dr->path, strerror(errno));
        return;
    }
    while ((de = readdir(dh)) != NULL)
        if (de->d_name[0] != '.' && matches(g, de->d_name))
            on_file(g, dr, de->d_name, UV_RENAME);
    closedir(dh);
}

static void on_dir_event(uv_fs_event_t *h, const char *file, int events, int status)
{
    gdir *dr = h->data;
    if (status != 0 || !file) {
        /* Lost events (the kernel's queue overflowed): look at everything. */
        if (dr->watched)
            outbox__group_scan_dir(dr->g, dr);
        return;
    }
    on_file(dr->g, dr, file, events);
}

gdir *outbox__group_dir_for(outbox_relay_group *g, const char *path, size_t len)
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

int outbox__group_watch(outbox_relay_group *g, gdir *dr)
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

