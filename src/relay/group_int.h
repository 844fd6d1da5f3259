/*
 * group_int.h: what the files of one relay process for many databases share
 * (internal; the contract is outbox/relay.h's outbox_relay_group). How the
 * group works: group.c's opening comment.
 *
 *   group.c        the queue of databases to open, the timer, the
 *                  drain, creating, starting and stopping
 *   group_entries.c  the entries: added, found by name and path, dropped
 *   group_relay.c  the relay of an open database: opened, drained, closed
 *   group_watch.c  the files: the directory watches, what changed, the
 *                  probes of closed databases on worker threads
 *   group_ops.c    the group's figures, /metrics and /healthz
 *
 * Loop thread, except a probe's work function.
 */
#ifndef OUTBOX_SRC_RELAY_GROUP_INT_H
#define OUTBOX_SRC_RELAY_GROUP_INT_H

#include <stdint.h>
#include <sys/types.h>

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
/* A closed database's published rows that retention deletes reopen it this
 * long after the oldest comes due, a 24th of the retention between these
 * bounds: every reopening deletes all that is due by then, so a database
 * that went quiet after a span of publishing reopens at most every
 * RET_SLACK_MAX_MS until its rows are gone (with the default day, hourly). */
#define RET_SLACK_MIN_MS 1000
#define RET_SLACK_MAX_MS 3600000

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
    gdb *path_next, *name_next; /* the group's hash chains (group.c) */
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
    int64_t p_oldest_published; /* with retention: its oldest published row's time, INT64_MAX: none */
    int p_expired;              /* a lease expired: a dead relay's rows to take over */
    char p_why[300];
    /* Its backlog as /metrics last saw it (group_ops.c): its relay's
     * figures while open, 0 once it drained; fig_known 0 until then. */
    int fig_known;
    int64_t fig_backlog, fig_oldest_ms;
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
    /* The entries by path and by name: a directory's events name a file,
     * and every write of an open database is one (a walk of every entry
     * per event was most of the loop's time with a thousand open). */
    gdb **by_path, **by_name;
    size_t nbuckets; /* a power of two, at least ndbs */
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

/* ---- group_entries.c ---- */

/* The entries: by path, by name; a new one (NULL, *e OUTBOX_EDUPLICATE or
 * OUTBOX_ENOMEM); dropped (freed, out of the array); gone (its file went
 * away: closed, then dropped); all freed (the group's end). */
gdb *outbox__group_find_path(const outbox_relay_group *g, const char *path);
gdb *outbox__group_find_name(const outbox_relay_group *g, const char *name);
gdb *outbox__group_add_entry(outbox_relay_group *g, const char *name, const char *path, int *e);
void outbox__group_drop(gdb *d);
void outbox__group_leave(gdb *d);
void outbox__group_entries_free(outbox_relay_group *g);

/* ---- group.c ---- */

/* Each relay's share of the window: inflight divided among those open. */
void outbox__group_set_share(outbox_relay_group *g);
/* d could not be opened (e, why): logged once per reason, retried with a
 * backoff (G_FAILED), or looked at when it changes (G_NOSCHEMA). */
void outbox__group_failed(gdb *d, int e, const char *why);
/* d has work: into the queue of databases to open (or woken if open);
 * pump opens from that queue as far as the bounds allow. */
void outbox__group_want(gdb *d);
void outbox__group_pump(outbox_relay_group *g);
/* The group's timer at most delay ms from now (lingering relays, retries,
 * rows that become due). */
void outbox__group_arm(outbox_relay_group *g, uint64_t delay);
/* A drain that has nothing left ends; a stop whose relays, probes and
 * handles are all done calls its callback. */
void outbox__group_drain_check(outbox_relay_group *g);
void outbox__group_stop_check(outbox_relay_group *g);

/* ---- group_relay.c ---- */

/* A relay on d (G_OPEN), or d failed; d's relay stopped (G_CLOSING), freed
 * on the next loop turn. */
void outbox__group_open_db(gdb *d);
void outbox__group_close_db(gdb *d);

/* ---- group_watch.c ---- */

/* The files as the group last saw them (a later event compares). */
void outbox__group_remember(gdb *d);
/* What a closed database has to do, read on a worker thread (G_PROBING). */
void outbox__group_probe(gdb *d);
/* The entry of a directory (added if new; NULL without memory); its watch
 * started (0 or OUTBOX_EIO, logged); every matching file looked at. */
gdir *outbox__group_dir_for(outbox_relay_group *g, const char *path, size_t len);
int outbox__group_watch(outbox_relay_group *g, gdir *dr);
void outbox__group_scan_dir(outbox_relay_group *g, gdir *dr);

/* ---- group_ops.c ---- */

/* Is d failing: it cannot be opened (*why: its reason), or its relay's
 * transactions fail with an error other than a lock (a full or read-only
 * filesystem, an I/O error; the relay retries them, sched.c), for *ms? */
int outbox__group_failing(const gdb *d, uint64_t now, const char **why, uint64_t *ms);

/* The endpoint's callbacks (ops/http.h). */
void outbox__group_on_http(void *data, outbox__http_req *req, const char *path);
void outbox__group_on_http_closed(void *data);

#endif
