/*
 * relay_int.h: what the relay's modules share (not installed).
 *
 * The relay is a folder of modules, each one concern; docs/ARCHITECTURE.md
 * has a paragraph on each. Calls run one way, from the top down:
 *
 *   group.c  group_relay.c  group_watch.c  group_ops.c  (group_int.h)
 *                    many databases over one link (outbox_relay_group)
 *   lifecycle.c      create, start, stop, destroy; the Redis up/down events
 *   sched.c  ops.c  retention.c  attach.c  dbwait.c
 *                    units of work and their timers; metrics, HTTP,
 *                    database figures; retention; attached connections;
 *                    waiting for a database on a full disk or locked
 *   drain.c          drain mode: when a drain is over, its timeout, its result
 *   wake.c  publish.c  idem_publish.c
 *                    WAL watch, data_version and checkpoints; XADD and WAIT;
 *                    idempotent publishing
 *   link.c           the relay's Redis: a target (redis/target.h), one node,
 *                    Sentinel or a cluster behind one interface
 *   claim.c  claim_write.c  claim_batch.c
 *                    choosing rows, claiming them; batch leases' keys and takeovers
 *   marks.c          writing and accounting marks
 *   encode.c  window.c  db.c  settings.c
 *                    row checks and commands; the in-flight window; the
 *                    connection and its statements; settings
 *
 * The few calls that run back up (a reply that schedules a unit, a stop
 * that may be able to finish) go through r->hooks, which lifecycle.c fills
 * in at create, the way a hiredis adapter fills ac->ev.
 *
 * Threads: every function here runs on the loop thread unless its comment
 * says otherwise. A unit's transaction runs on a libuv worker thread
 * (sched.c); while it runs, the loop does not touch r->db, r->cw, the
 * window's seq set or key map (it changes them only when the unit is done).
 */
#ifndef OUTBOX_SRC_RELAY_INT_H
#define OUTBOX_SRC_RELAY_INT_H

#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "ops/http.h"
#include "util/util.h"
#include "ops/metrics.h"
#include "outbox/relay.h"
#include "outbox/schema.h"
#include "redis/redis.h"
#include "store/sqlite_util.h"
#include "redis/target.h"

/* What became of one message; decides its mark. */
enum outcome {
    OUT_NONE = 0,
    OUT_PUBLISHED, /* Redis accepted it (and WAIT was satisfied) */
    OUT_RETRY,     /* a failure that counts: backoff, or dead when exhausted */
    OUT_RELEASE,   /* not its fault (connection lost, held back, stop): pending again, attempt not counted */
    OUT_DEAD,      /* cannot ever be published (invalid row) */
};

/* Where a claimed message is: held (not sent yet: behind its key's previous
 * message, or in a batch not sent yet), sent (its reply awaited), waiting
 * (accepted, its WAIT group's reply awaited), done (its mark is queued). */
enum msg_state { MSG_HELD, MSG_SENT, MSG_WAITING, MSG_DONE };

typedef struct wait_group wait_group;
typedef struct msg msg;
typedef struct relay_batch relay_batch;

/*
 * A batch lease this relay holds (outbox_batch, proto/schema.md): the new
 * rows of one claim, or the rows of an expired batch it took over. Its
 * messages point at it; it is freed with the last of them. A message that
 * fails, is handed back or is dead-lettered leaves the batch by its own
 * row's mark; the published ones wait in `published` until every message
 * has an outcome, then go to the mark queue together, the first one
 * (`batch_lead`) writing the batch's one published record after the rows'
 * own marks before it (window.c).
 */
struct relay_batch {
    int64_t lo, hi, token, attempts;
    size_t n, ndone, refs; /* messages claimed in it, with an outcome, not yet freed */
    msg *published, *published_tail;
    uint64_t parked_since; /* loop ms of the first message in `published` */
    relay_batch *next_live, *prev_live; /* r->win.batches, once the claim committed */
    int live;
    int applied; /* set by the lead's mark: the batch record was ours and is now published */
};

/* One claimed message, from its claim until its mark is written. */
struct msg {
    msg *next;     /* mark queue */
    msg *key_next; /* the next message of its key, held back behind this one */
    struct outbox_relay *r;
    wait_group *group;
    int64_t seq, token, attempts, created_at, replay_count;
    char *id, *topic, *key; /* in the same allocation; key "" when unkeyed */
    size_t klen;
    msg *km_next;     /* key map bucket */
    uint64_t km_hash; /* outbox__key_hash of topic and key: set by the claim, or when it enters the key map */
    int in_keymap;
    msg *chain_after; /* claimed behind this message of an earlier batch (linked after commit) */
    char *env;        /* idempotent mode: the envelope, sent with its stream's batch */
    size_t envlen;
    char *cmd; /* formatted XADD, in chunk, not malloc'd: kept to send it again (publish.c, park) */
    size_t cmdlen;
    struct msg_chunk *chunk; /* holds this message and its command (encode.c) */
    enum msg_state state;
    enum outcome outcome;
    int behind;            /* held behind an earlier message of its key */
    int took_over;         /* claimed from an expired lease */
    int mark_applied;      /* set by outbox__mark_write: the mark changed the row (not fenced) */
    const char *mark_what; /* set by outbox__mark_write: published, retry, dead or released */
    char *result;          /* stream entry id (published) or error text (failed); malloc'd or entry */
    char entry[48];        /* a published message's entry id, when it fits (window.c) */
    relay_batch *batch;    /* the batch lease it was claimed in, or NULL (a lease of its own) */
    int batch_lead;        /* its mark writes its batch's published record (see relay_batch) */
    int own_published;     /* published, but marked on its own row (its batch was slow to finish) */
    unsigned resends;      /* sent again after a lost connection (publish.c, park) */
    msg *park_next;        /* r->park's list */
};

/* The messages of one pipelined batch that wait for one WAIT reply: those
 * that one node took (link.c names nodes; NULL for a single node). */
struct wait_group {
    struct outbox_relay *r;
    void *node;
    size_t n, cap;
    msg **msgs;     /* NULL for a message that left the group */
    uint64_t since; /* loop ms of its first WAIT; a short one is asked again (publish.c) */
};

/* The WAIT groups of one batch, one per node that took messages. */
typedef struct wait_set {
    wait_group **g;
    size_t n, cap;
} wait_set;

/* The relay's life: created, running (start), stopping (stop), stopped
 * (every handle closed). Waiting: started, but the database could not be
 * opened yet (wait_for_db): only the handles of the wait, the schedule's
 * timers and the HTTP endpoint exist; running follows once it opened. */
enum relay_state { R_CREATED, R_WAITING, R_RUNNING, R_STOPPING, R_STOPPED };
/* Where the Redis connection (the link's target) is in its life. */
enum rc_state { RC_NONE, RC_INITIALISED, RC_STARTED, RC_CLOSING };

/* The calls that run back up the module order (see the top). */
typedef struct relay_hooks {
    void (*schedule)(outbox_relay *r);   /* run a unit of work soon */
    void (*parked)(outbox_relay *r);     /* a batch's published messages wait: a unit within PARKED_MS */
    void (*stop_check)(outbox_relay *r); /* a stop in progress may be able to finish */
    void (*closed)(outbox_relay *r);     /* one of the relay's handles finished closing */
    void (*db_opened)(outbox_relay *r);  /* the wait for the database is over: it is open */
} relay_hooks;

/* Configuration: set by create, read-only afterwards (any thread). */
struct relay_config {
    outbox_relay_settings s; /* its strings point at the copies below */
    outbox__logger log;
    char *db_path, *db_name, *stream_template, *redis_url_text, *worker_id, *stream_prefix, *metrics_listen;
    outbox__redis_url url;
    char url_desc[300];
    outbox__tls_config *tls; /* built at create for a rediss:// URL, else NULL */
    outbox__web_config *web; /* the metrics endpoint's, read at create; NULL: plain HTTP */
};

/* The relay's database connection and its statements (db.c). The loop
 * thread's while no unit runs, the unit's worker thread while one does. */
struct relay_db {
    sqlite3 *conn;
    sqlite3_stmt *q_new, *q_due, *q_expired, *q_key_prev, *q_defer, *q_claim, *q_published, *q_failed, *q_release,
        *q_data_version, *q_next_due, *q_next_lease, *q_drain, *q_cursor, *q_cursor_set, *q_top, *q_stray,
        *q_batch_new, *q_batch_rows, *q_batch_cands, *q_batch_expired, *q_batch_take, *q_batch_drop, *q_batch_leased,
        *q_batch_keys, *q_batch_leave, *q_batch_published, *q_batch_failed, *q_batch_release,
        *q_batch_row_published, *q_key_any, *q_begin, *q_commit, *q_plan;
    int last_rc; /* the SQLite code of the last failure that a step helper mapped (db.c) */
};

/* Waiting for the database (dbwait.c). The loop thread's, except the
 * try's results (try_*), which are the worker's while running. */
struct relay_dbwait {
    int waiting;          /* create could not open the database, for a reason that heals */
    int deferred;         /* a group's relay: create did not try, the first try is at start */
    uv_timer_t timer;     /* the next try */
    uv_work_t work;
    int running;          /* a try is on a worker thread (it has r->db) */
    unsigned failures;    /* failed opens so far, create's included */
    uint64_t since_ms;    /* monotonic ms the wait began (create's failure) */
    uint64_t logged_ms;   /* monotonic ms of the last warning */
    char why[512];        /* the last failure's reason */
    char logged[512];     /* the reason last logged */
    int try_e;            /* the try's OUTBOX_E* (0: open) */
    outbox__sqlfail try_f;
    char try_why[512];
};

/* What the link (link.c) tells the lifecycle: Redis can be used now; it
 * cannot any more (every pending reply callback already ran); it cannot be
 * used as configured (outbox__link_problem says why; publishing is held);
 * a node's connection is up (node NULL: the single node), before anything
 * queued for it is written: the idempotent script is loaded there. */
struct link_hooks {
    void (*up)(outbox_relay *r);
    void (*down)(outbox_relay *r, int status);
    void (*problem)(outbox_relay *r);
    void (*node_up)(outbox_relay *r, void *node);
};

/* Why Redis cannot be used as configured (link.c), and how the link finds
 * out that it can again. */
enum link_problem_kind {
    LP_NONE,
    LP_CLUSTER_NODE, /* a plain URL names a cluster node: INFO cluster again every 10 s */
    LP_REFUSED,      /* connecting is refused (credentials, an ACL, the sentinels): over once connected */
    LP_ACL,          /* an ACL forbids a command the relay sends: publishing is tried again every 10 s */
};

#define OUTBOX__LINK_WHY_MAX 700

/* The Redis connection layer (loop thread): a target (redis/target.h),
 * behind link.c. A relay creates its own at start; the relays of a group
 * (group.c) share the group's, each one subscribed to its events while it
 * runs. What the target's answers teach (a problem holding publishing, the
 * idempotent script's sha) is the link's, for every relay on it. */
struct relay_link {
    uv_loop_t *loop;
    const outbox__logger *log; /* its owner's: the relay's or the group's */
    const char *url_desc;
    int tls;                /* the URL is a rediss one (for the messages) */
    outbox__target *target; /* a single node, Sentinel or a cluster; NULL once closed */
    int routes;             /* the target routes by slot (OUTBOX__TARGET_ROUTES): a cluster */
    int closing;            /* target is being closed: no longer to be touched */
    void (*close_cb)(void *data);
    void *close_data;
    enum rc_state state;
    char idem_sha[41];   /* the idempotent publish script's sha, "" until loaded */
    int info_pending;    /* a single node's INFO cluster check awaits its reply */
    enum link_problem_kind problem; /* Redis cannot be used as configured, LP_NONE otherwise */
    char misconfig[OUTBOX__LINK_WHY_MAX]; /* why publishing is held, "" while problem is LP_NONE */
    uint64_t misconfig_at; /* loop ms of the last check */
    uint64_t misconfig_logged; /* loop ms of its last error line, 0 if none */
    int acl_probe; /* LP_ACL was lifted to try again: the next accepted command says it is over */
    uint64_t down_since; /* loop ms since when it cannot be used, 0 while usable (the group's /healthz) */
    outbox_relay **subs; /* the relays that hear its events (NULL: one that left while they were told) */
    size_t nsubs, subs_cap;
    int telling; /* events are being handed to subs: a relay leaving leaves a NULL */
};

/* A relay's use of a link: its own, or its group's. */
struct relay_redis {
    struct relay_link *l;
    struct relay_link own; /* l when the relay has a link of its own */
    int shared;            /* l is a group's */
    struct link_hooks hooks;
    enum rc_state state;   /* this relay's use of l */
    uint64_t down_since;   /* loop ms when Redis became unreachable, 0 while up */
};

/* The window (loop thread; read by the unit's worker while it runs, never
 * changed then): messages claimed and not yet marked, those awaiting a
 * reply, the mark queue, the newest message of each key, the seqs. */
struct relay_window {
    uint64_t inflight, awaiting;
    msg *marks_head, *marks_tail;
    uint64_t marks_len; /* how many are queued (a unit takes its own off) */
    uint64_t releases;  /* hand-backs (OUT_RELEASE) queued or in a unit, not yet accounted (sched.c) */
    /* The newest message held of each key (see outbox__keymap_put). */
    msg **keymap;
    size_t keymap_cap, keymap_len;
    /* In-flight seqs of the rows under a lease of their own, to tell our
     * own leases from expired ones. A batch lease's rows are not in it:
     * their rows are never leased on their own (state 1) while we hold
     * them, and the leases the set answers for (outbox_leased, a keyed
     * row's predecessor of state 1) are per-row ones. */
    int64_t *seqset;
    size_t seqset_cap, seqset_len, seqset_tombs;
    /* The batch leases this relay holds (claimed and committed). */
    relay_batch *batches;
};

typedef struct cand cand;
typedef struct bslot bslot;
typedef struct chunk chunk;

/* The claim's working state (the unit's worker thread): arrays kept from one
 * claim to the next and grown to the largest so far (claim.c says why). */
struct relay_claim_ws {
    cand *cs;
    int *chosen;
    int64_t *defer;
    size_t cap;
    bslot *slots;
    size_t scap;
    unsigned gen; /* a slot is in use in this claim iff its gen is this */
    chunk *arena;
    struct msg_chunk *mchunk; /* where new messages go (encode.c) */
    struct fkey *fk; /* other relays' batch keys (claim.c) */
    size_t fk_cap;
    /* Set by the unit before its claim: this relay holds no message but
     * those whose marks the unit wrote (claim.c may then read the plan). */
    int holds_nothing;
};

/* One unit of work: filled by the loop thread (outbox__sched_do_work), run
 * on a worker thread (unit_txn), read back on the loop thread (unit_done). */
struct relay_unit {
    int64_t now;
    unsigned want;
    int want_claim;
    msg *marks; /* detached from the queue, nmarks long */
    size_t nmarks;
    msg **claimed;
    size_t nclaimed, ndead;
    size_t ndeferred; /* rows the claim made due later: the next claim sees other rows */
    msg *settled;     /* claimed and marked at once (dead, or handed back) */
    size_t nwritten;  /* marks written when the budget ran out first, else 0 */
    int stopping;     /* the last marks: no time budget */
    uint64_t held, rest; /* in the window without a queued mark; marks left in the queue */
    int rc;           /* OUTBOX_E* of the transaction, 0 if it committed */
    int sqlite_rc;    /* the SQLite code behind rc (the busy retry tells locks from errors) */
    int sys_errno;    /* the system's errno behind it (sqlite3_system_errno), for the log */
    const char *what;
    uint64_t t0, t_claim0, t_end;
};

/* Scheduling (loop thread, except claim_row_ns: the worker's). */
struct relay_sched {
    uv_timer_t kick_timer; /* run a unit on the next loop turn (or after the lock gap) */
    uv_timer_t scan_timer; /* fallback scan and next-due wake-up */
    uv_timer_t busy_timer; /* database locked or failing: retry */
    uv_timer_t drain_timer; /* drain mode: drain_timeout_ms */
    uv_timer_t parked_timer; /* a batch's published messages wait for the rest of it: flushed in time */
    uv_work_t work;
    struct relay_unit unit;
    int running;              /* a unit is on a worker thread */
    int again;                /* work arrived while it ran: schedule another */
    uint64_t busy_delay_ms;   /* the busy retry's current delay */
    uint64_t lock_free_until; /* loop ms before which no new unit starts */
    uint64_t held_ns;         /* write lock held by units since the last lock gap */
    uint64_t last_end_ns;     /* hrtime the last unit's transaction ended */
    int unsent;               /* claimed messages of the last unit were handed back unsent */
    int last_claim_full;      /* the last claim got all it wanted: a backlog is draining */
    uint64_t claim_row_ns;    /* recent cost of one claimed row (worker thread only) */
    unsigned stop_failures;   /* units in a row that failed while stopping */
    int drained;              /* drain mode: on_drained was called */
    int drain_timed_out;      /* drain mode: on_drained was called because drain_timeout_ms expired */
    int drain_error;          /* drain mode: the drain cannot finish (outbox__drain_fail), 0 otherwise */
    uint64_t fail_since;      /* loop ms units began to fail with an error other than a lock; 0 once one commits */
    uint64_t fail_logged;     /* loop ms that failure was last logged */
    char fail_why[160];       /* its error, for the log and /healthz */
};

/* Cross-thread state of a unit's transaction (mutex, or atomics where
 * said): application connections attached on their own threads wait on it. */
struct relay_lock {
    uv_mutex_t mutex;
    uv_cond_t cond; /* broadcast when a unit's transaction ends */
    int sync_ok;    /* mutex and cond initialised */
    int txn_open;   /* a unit's transaction holds the write lock (mutex) */
    int in_unit;    /* unit_txn is between BEGIN and its end (atomic) */
    int yield;      /* an attached connection waits for the lock: the unit ends early (atomic) */
    int attached;   /* connections attached with a busy handler (atomic) */
};

/* Wake-ups (loop thread; ready is atomic). */
struct relay_wake {
    uv_async_t async; /* outbox_relay_wake and attached commits */
    int ready;        /* async is initialised (atomic: read by other threads) */
    uv_fs_event_t wal_watch;
    int wal_watch_active; /* watching (not while a unit runs: see outbox__wake_pause) */
    char *wal_path;
    uv_timer_t wal_timer; /* data_version re-checks after a WAL change */
    unsigned wal_rechecks;
    int64_t data_version;
    uint64_t foreign_commit_ms; /* loop time data_version last moved */
    int dv_pending;             /* a data_version check waits for the running unit */
};

/* Checkpoints, run on a worker thread with a connection of their own. */
struct relay_ckpt {
    uv_work_t work;
    int running;
    int restart;   /* the next checkpoint is a RESTART (the WAL grew large) */
    int pages;     /* the WAL's size after an attached connection's commit (atomic) */
    int own_pages; /* set by the WAL hook of the relay's own commits, on the committing thread */
    int last_pages; /* the WAL's size when the last checkpoint started */
    sqlite3 *db;
};

/* Retention (retention.c): the timer and the loop's fields are the loop
 * thread's; db, the statements and the step's results are the worker's
 * while running. */
struct relay_retention {
    uv_timer_t timer;
    uv_work_t work;
    int running;
    int64_t cutoff, limit; /* the step's: published before cutoff, limit rows at most */
    sqlite3 *db;
    sqlite3_stmt *q_rows, *q_batches, *q_batch_rows, *q_batch, *q_oldest, *q_holes;
    int64_t deleted;     /* rows the step deleted */
    uint64_t held_ns;    /* how long it held the write lock */
    int full;            /* it stopped at its budget or limit: more may be due */
    int rc;              /* SQLITE_OK, or the code of its failure */
    int pages;           /* the WAL's size after its commit */
    int64_t oldest;      /* the oldest published_at left after the step, or -1 */
    char err[160];       /* the connection could not be opened: why */
};

/* Counters and histograms (loop thread): every module counts, ops.c shows. */
struct relay_stats {
    uint64_t published_total, failed_total, dead_total, fenced_total, reconnects;
    uint64_t retries_total, duplicates_total, held_back_total, claims_total, retention_deleted;
    uint64_t checkpoints_total;
    outbox__topics topics;
    outbox__hist h_latency, h_claim_size, h_claim_secs, h_stall;
    /* The wall clock for h_latency, read again at each loop turn and every
     * LATENCY_CLOCK_USES marks within one (window.c). */
    int64_t clock_ms;
    uint64_t clock_turn;
    unsigned clock_uses;
};

/* Database figures for /metrics, /healthz and outbox_relay_stats_get. */
struct relay_dbstat {
    int ok;
    int64_t by_state[4], oldest_due_ms;
    char err[160];
};

/* Operations (loop thread; dbstat_tmp and dbstat_db: the worker's while
 * dbstat_running). */
struct relay_ops {
    uint64_t stall_max_ns, loop_mark_ns, loop_idle_ns;
    uv_prepare_t stall_prepare;
    uv_check_t stall_check;
    int stall_on; /* the probes run (not for a group's relay) */
    outbox__http *http;
    uv_work_t dbstat_work;
    int dbstat_running;
    uint64_t dbstat_at; /* loop ms of the last refresh */
    struct relay_dbstat dbstat, dbstat_tmp;
    sqlite3 *dbstat_db;
    outbox__http_req **waiting_reqs; /* requests waiting for a refresh */
    char **waiting_paths;
    size_t nwaiting, capwaiting;
};

/* Stop (loop thread). */
struct relay_stop {
    void (*cb)(outbox_relay *, void *);
    void *data;
    uv_timer_t shutdown_timer;
    int handles_open;       /* handles (and the connection) not closed yet; finish_stop at 0 */
    int closing;            /* the handles are being closed: the stop is past waiting */
    int in_finish;          /* inside the stop callback: destroy there is deferred */
    int destroy_pending;    /* destroy was called while running: free after the stop */
    int began;              /* the database opened and the rest started (wake-ups, retention, Redis) */
};

/*
 * Messages whose XADD was on a connection that was lost before its reply
 * came (publish.c): kept in the window, still leased, and sent again in the
 * order their replies failed once Redis is back, instead of being handed
 * back to the database. Handed back, their rows went pending one by one,
 * and every later row of their keys had to wait behind them as a row of
 * its own (claim.c, defer): after 3 s of resets a 160k-row backlog drained
 * in 11 s instead of 1.2 s. They are kept however long Redis stays away,
 * past their leases too: the relay never takes over its own messages
 * (outbox__win_seq_has, outbox__batch_ours), another relay that does
 * publishes them first (ours is a duplicate, its mark fenced), and the
 * window bounds their memory. A message is handed back after
 * PARK_MAX_RESENDS sends again, when publishing is held, when the relay
 * stops, and always with --wait-replicas (publish.c says why). Loop thread.
 */
struct relay_park {
    msg *head, *tail;
    size_t n;
    uv_timer_t timer; /* the send again after a loss while up (a cluster node) */
};

struct outbox_relay {
    uv_loop_t *loop;
    enum relay_state state;
    relay_hooks hooks;
    struct relay_config cfg;
    struct relay_db db;
    struct relay_dbwait dbwait;
    struct relay_redis redis;
    struct relay_window win;
    struct relay_park park;
    struct relay_claim_ws cw;
    struct relay_sched sched;
    struct relay_lock lock;
    struct relay_wake wake;
    struct relay_ckpt ckpt;
    struct relay_retention ret;
    struct relay_stats stats;
    struct relay_ops ops;
    struct relay_stop stop;
    const unsigned *share; /* a group's relay: its share of the group's window (group.c), else NULL */
    /* A group's relay opens its database on a worker thread after create
     * (dbwait.c, deferred); a failure goes to the group instead of a wait. */
    void (*open_failed)(outbox_relay *r, int e, const char *why, void *data);
    void *open_failed_data;
};

/* The window's size: inflight, or a group's relay's share of it. */
static inline unsigned outbox__win_cap(const outbox_relay *r)
{
    return r->share && *r->share < r->cfg.s.inflight ? *r->share : r->cfg.s.inflight;
}

#define LOG(r, lvl, ...) outbox__log(&(r)->cfg.log, (lvl), __VA_ARGS__)
/* The level of a relay's start, stop and drain lines: a group's relays
 * open and close as their databases have work, the group says the rest. */
#define LOG_LIFE(r) ((r)->redis.shared ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_INFO)


/* ---- lifecycle.c (for group.c) ---- */

/* Fills cfg from s (checked): the strings copied, the URL parsed, the TLS
 * configuration built when with_tls (a group's relays use the group's).
 * 0 or OUTBOX_E* with err. free: what init made (also after a failure). */
int outbox__relay_config_init(struct relay_config *cfg, const outbox_relay_settings *s, int with_tls, char *err,
                              size_t errlen);
void outbox__relay_config_free(struct relay_config *cfg);
/* outbox_relay_create, on a group's link (NULL: the relay's own). */
int outbox__relay_create_on(outbox_relay **out, uv_loop_t *loop, const outbox_relay_settings *s,
                            struct relay_link *link, char *err, size_t errlen);

/* ---- settings.c ---- */

/* Checks every setting; 0, or OUTBOX_EINVAL with err naming it. */
int outbox__relay_check_settings(const outbox_relay_settings *s, char *err, size_t errlen);
/* Replaces the settings left 0 whose default follows another (the reply
 * and WAIT timeouts) by the values in effect; after a successful check. */
void outbox__relay_settings_resolve(outbox_relay_settings *s);

/* ---- db.c ---- */

/* Opens r->db.conn on r->cfg.db_path, checks (or migrates) the schema and
 * prepares the statements. With wait_lock it waits for a lock (see
 * relay.h), else it tries once. 0 or the OUTBOX_E* of outbox_db_open /
 * outbox_schema_check, err saying why and *f (may be NULL) SQLite's code
 * behind it; r->db.conn may then be open: outbox__relay_db_close. Any
 * thread, while nothing else uses r->db. */
int outbox__relay_db_open(outbox_relay *r, int wait_lock, outbox__sqlfail *f, char *err, size_t errlen);
/* 1 when a failed open (e, f) may succeed later with nothing changed by
 * hand: a full disk (SQLITE_FULL, an I/O error, a -wal or -shm file that
 * cannot be created for want of space) or a lock (SQLITE_BUSY, LOCKED). 0
 * for what someone must fix: not a database, corrupt, no, a foreign or a
 * newer schema, a missing or read-only file. */
int outbox__relay_db_heals(int e, const outbox__sqlfail *f);
/* The statement at offset off of outbox_relay (a struct relay_db member),
 * prepared now if it was not yet (a group's relay prepares lazily); NULL if
 * it cannot be. Whoever owns r->db at the time. Use Q(r, q_name). */
sqlite3_stmt *outbox__relay_q(outbox_relay *r, size_t off);
#define Q(r, name) ((r)->db.name ? (r)->db.name : outbox__relay_q((r), offsetof(outbox_relay, db.name)))
/* Prepares the statements on r->db.conn (a database with the schema): all
 * of them, except for a group's relay (see outbox__relay_q). */
int outbox__relay_db_prepare(outbox_relay *r, char *err, size_t errlen);
/* A group's relay: conn does not checkpoint when it closes (db.c says why). */
void outbox__relay_db_no_close_ckpt(const outbox_relay *r, sqlite3 *conn);
/* Finalizes the statements and closes the connection; safe on a partial open. */
void outbox__relay_db_close(outbox_relay *r);
/* Maps a SQLite result code to OUTBOX_E* (0 for OK, ROW, DONE), keeping a
 * failure's code in r->db.last_rc. */
int outbox__relay_sqlerr(outbox_relay *r, int rc);
/* Steps a one-value statement and resets it: *v gets its value, or dflt
 * when it returns no row or NULL. 0 or OUTBOX_E*. */
int outbox__relay_step_int(outbox_relay *r, sqlite3_stmt *st, int64_t dflt, int64_t *v);
/* Steps a statement that returns nothing (or whose rows are not read) and
 * resets it. 0 or OUTBOX_E*. */
int outbox__relay_step_done(outbox_relay *r, sqlite3_stmt *st);

/* ---- encode.c (pure: any thread) ---- */

/* A copy for last_error: at most 200 bytes, control bytes made spaces.
 * malloc'd; NULL when out of memory. */
char *outbox__safe_text(const char *s, size_t len);
/* The same into out, which has room for len + 1 bytes (s may be out). */
char *outbox__safe_text_into(char *out, const char *s, size_t len);
/* Where a statement has the columns of a row to send (outbox__encode_row);
 * available_at -1 when it has none. */
typedef struct outbox__row_cols {
    int seq, id, topic, key, payload, headers, created_at, token, attempts, replay_count, available_at;
} outbox__row_cols;
/* As OUTBOX__SQL_CLAIM and OUTBOX__SQL_BATCH_ROWS return them. */
extern const outbox__row_cols outbox__claim_cols;
/* A row's columns, read once (outbox__row_read): the strings and blobs are
 * SQLite's, valid until the statement steps or resets. key and headers are
 * NULL when the column is; available_at 0 when cols has none. */
typedef struct outbox__row {
    const char *id, *topic, *key;
    const void *payload, *headers;
    size_t idl, tl, klen, plen, hlen;
    int64_t seq, token, attempts, created_at, replay_count, available_at;
} outbox__row;
void outbox__row_read(sqlite3_stmt *st, const outbox__row_cols *cols, outbox__row *v);
/* Builds *out from a row read by outbox__row_read: the row's fields and its
 * XADD command (the envelope alone in idempotent mode). A row the relay
 * cannot publish gets outcome OUT_DEAD and the reason as its result.
 * Returns 0 or OUTBOX_ENOMEM (*out, if set, is the caller's to free either
 * way). outbox__encode_row reads the current row of st (its columns at
 * cols) and encodes it. */
int outbox__encode(outbox_relay *r, const outbox__row *v, msg **out);
int outbox__encode_row(outbox_relay *r, sqlite3_stmt *st, const outbox__row_cols *cols, msg **out);
/* Messages and their commands are carved out of shared chunks, each freed
 * when its last message is: gives m's share back (any thread). */
void outbox__msg_release(msg *m);
/* Lets go of the chunk new messages were going in (claim_free). */
void outbox__encode_free(outbox_relay *r);

/* ---- window.c ---- */

/* The in-flight seq set. reserve makes room for n more adds (0 or
 * OUTBOX_ENOMEM), so that add, which needs room reserved, cannot fail: a
 * message of this relay missing from the set would look like another
 * relay's lease once its own expired. */
int outbox__win_seq_reserve(outbox_relay *r, size_t n);
void outbox__win_seq_add(outbox_relay *r, int64_t seq);
int outbox__win_seq_has(const outbox_relay *r, int64_t seq);
void outbox__win_seq_del(outbox_relay *r, int64_t seq);
/* A key's hash and equality (topic and key together). */
uint64_t outbox__key_hash(const char *topic, const char *key, size_t klen);
int outbox__same_key(const char *t1, const char *k1, size_t l1, const char *t2, const char *k2, size_t l2);
/* The newest message held of a key (h its outbox__key_hash), or NULL. */
msg *outbox__win_key_get(outbox_relay *r, uint64_t h, const char *topic, const char *key, size_t klen);
/* Makes m its key's newest message. Without memory for the table it is left
 * out: its successors then wait for its mark, which is slower, not wrong. */
void outbox__win_key_put(outbox_relay *r, msg *m);
/* Frees a message; NULL is a no-op. Its batch goes with its last message. */
void outbox__msg_free(msg *m);
/* A new batch lease of the claim (worker thread): m joins it. */
relay_batch *outbox__batch_new(int64_t lo, int64_t hi, int64_t token, int64_t attempts);
void outbox__batch_join(relay_batch *b, msg *m);
/* The claim committed: b is one of this relay's batches (r->win.batches). */
void outbox__batch_live(outbox_relay *r, relay_batch *b);
/* Is the batch lease (lo, token) one of this relay's? (worker thread, while
 * the loop does not change the list) */
int outbox__batch_ours(const outbox_relay *r, int64_t lo, int64_t token);
/* Frees a message that leaves the window (out of the key map and seq set). */
void outbox__win_retire(outbox_relay *r, msg *m);
/* Decides m's outcome (text, copied, becomes its result) and queues its
 * mark; schedules a unit. */
void outbox__win_queue_mark(outbox_relay *r, msg *m, enum outcome o, const char *text, size_t len);
/* Is m's successor in the queue part of the same batch's published group
 * (see relay_batch)? A unit never ends between them. */
int outbox__win_group_next(const msg *m);
/* Queues, as marks of their own rows, the published messages that have
 * waited at least ms for the rest of their batch (a batch held up by a
 * chained or slow message): a relay killed meanwhile would leave them to be
 * published again. Returns 1 if a batch's messages still wait, for less
 * than ms. */
int outbox__win_flush_parked(outbox_relay *r, uint64_t ms);
/* Frees the published messages still waiting for the rest of their batch
 * (destroy after a stop that gave up on replies). */
void outbox__win_free_parked(outbox_relay *r);
/* Hands back m's held-back successors (they were never sent). */
void outbox__win_release_chain(outbox_relay *r, msg *m, const char *why);
/* Hands back m (OUT_RELEASE, why) and its held-back successors (chain_why). */
void outbox__win_hand_back(outbox_relay *r, msg *m, const char *why, const char *chain_why);
/* Puts a detached list of marks back at the head of the queue. */
void outbox__win_requeue(outbox_relay *r, msg *first);

/* ---- marks.c ---- */

/* Writes m's mark inside the open transaction (worker thread); records in
 * m whether it applied. 0 or OUTBOX_E* (the transaction is then rolled
 * back). */
int outbox__mark_write(outbox_relay *r, msg *m, int64_t now);
/* Counts and logs a mark once its transaction committed (loop thread). */
void outbox__mark_account(outbox_relay *r, msg *m);

/* ---- claim.c (claim.h has the decisions) ---- */

/* Claims up to `want` rows inside the open transaction (worker thread).
 * *out gets the new messages in the order they were chosen; a key's
 * successors are linked behind their predecessor (key_next, or chain_after
 * for one of an earlier batch, linked after the commit) and flagged
 * `behind`. Rows that cannot be published are dead-lettered here (*ndead;
 * the messages go to *settled, with those handed back). *ndeferred counts
 * the rows made due later. 0 or OUTBOX_E*. */
int outbox__claim(outbox_relay *r, unsigned want, int64_t now, msg ***out, size_t *nout, size_t *ndead,
                  msg **settled, size_t *ndeferred);

/* ---- link.c ---- */

/* A link (the group's, or a relay's own): creates its target for cfg's URL
 * (outbox__target_create: a single node, Sentinel or a cluster); cfg must
 * outlive it. Opens it (connects, and keeps reconnecting). usable: 1 while
 * commands can be sent. Shut: closes it (cb once the target is freed, at
 * once when it never opened). hold_all: no more reconnects. */
int outbox__link_create(struct relay_link *l, uv_loop_t *loop, const struct relay_config *cfg);
void outbox__link_open(struct relay_link *l);
int outbox__link_usable(const struct relay_link *l);
void outbox__link_shut(struct relay_link *l, void (*cb)(void *data), void *data);
void outbox__link_hold_all(struct relay_link *l);
/* A relay's use of its link: with r->redis.shared (a group's relay,
 * r->redis.l set at create) it only takes the hooks; otherwise it creates
 * the relay's own link. Hooks are copied. 0 or OUTBOX_ENOMEM. */
int outbox__link_init(outbox_relay *r, const struct link_hooks *hooks);
/* The idempotent script's sha on the link ("" until loaded). */
char *outbox__link_idem_sha(outbox_relay *r);
/* Starts connecting (and keeps reconnecting). */
void outbox__link_start(outbox_relay *r);
/* Frees what an init of a start that failed created. */
void outbox__link_discard(outbox_relay *r);
/* 1 while commands can be sent (connected; a cluster with a slot map; not
 * held by a problem, see outbox__link_problem). */
int outbox__link_up(const outbox_relay *r);
/* 1 when the target routes by slot over many nodes (a cluster): each node
 * has its own scripts, and there are per node figures. */
int outbox__link_routes(const outbox_relay *r);
/* Why publishing is held because Redis cannot be used as configured (a
 * plain URL naming a cluster node, credentials refused, an ACL forbidding a
 * command the relay sends, no sentinel naming the master), or NULL. */
const char *outbox__link_problem(const outbox_relay *r);
/* Repeats the held check now and then (called by every unit, and by the
 * scan timer while a problem holds publishing). */
void outbox__link_check(outbox_relay *r);
/* Queues a formatted command about topic's stream (its slot picks the
 * node); *node (may be NULL) gets the node. 0, or an OUTBOX_E* without a
 * callback (OUTBOX_ECONNECT: the stream's node is down). */
int outbox__link_send(outbox_relay *r, const char *topic, const char *cmd, size_t len, outbox__redis_reply_cb cb,
                      void *data, void **node);
/* Queues a command for one node (WAIT, SCRIPT LOAD) behind what it took. */
int outbox__link_node_argv(outbox_relay *r, void *node, int argc, const char **argv, const size_t *lens,
                           uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data);
/* The node of the connection that answered. */
void *outbox__link_node_of(const outbox_relay *r, const outbox__redis *conn);
/* 1 if node (link_node_of's) is still a master: a cluster node the slot
 * map names; the single node always. */
int outbox__link_node_serves(const outbox_relay *r, const void *node);
/* For reply callbacks (every reply with status 0): 1 if the error reply
 * means the message's outcome is the connection's problem, not the
 * message's (release it): a Sentinel master demoted (outbox__target_lost),
 * a plain URL answered by a cluster node (outbox__target_misrouted), an
 * ACL that forbids the command (the last two hold publishing:
 * outbox__link_problem). */
int outbox__link_lost(outbox_relay *r, const outbox__redis *conn, const redisReply *reply);
/* Stop: no more reconnects. Shutdown timeout: drop the connections. Close. */
void outbox__link_hold(outbox_relay *r);
void outbox__link_reset(outbox_relay *r, const char *why);
void outbox__link_close(outbox_relay *r, void (*cb)(void *data), void *data);
/* A cluster's nodes (up to n in st) and map refreshes, for /metrics. */
size_t outbox__link_nodes(const outbox_relay *r, outbox__target_node_stats *st, size_t n, uint64_t *refreshes,
                          uint64_t *refresh_failed);

/* ---- publish.c, idem_publish.c ---- */

/* Sends m's XADD; with --wait-replicas it joins its node's group in ws
 * (created on demand). On failure its mark is queued (released). */
void outbox__pub_send(outbox_relay *r, msg *m, wait_set *ws);
/* Sends the WAIT of each group of ws, to its node, and empties ws. */
void outbox__pub_flush_groups(outbox_relay *r, wait_set *ws);
/* Keeps m, claimed and not answered (its connection was lost before the
 * reply, or was down when its claim came back), to send it once Redis is up
 * (r->park); 0 when it is to be handed back instead (stopping, its lease too
 * short, sent again too often). */
int outbox__pub_park(outbox_relay *r, msg *m);
/* The parked messages (r->park): init returns its handles (1); flush sends
 * them again (Redis is up again); release hands them all back (a stop). */
int outbox__pub_park_init(outbox_relay *r);
void outbox__pub_park_close(outbox_relay *r, uv_close_cb cb);
void outbox__pub_park_flush(outbox_relay *r);
void outbox__pub_park_release(outbox_relay *r, const char *why);
/* Idempotent mode: sends ms (n of them, in order) as one script call per
 * stream. */
void outbox__pub_idem_send(outbox_relay *r, msg **ms, size_t n);
/* Loads the idempotent publish script on a node (after it connected, or
 * NOSCRIPT from it). */
void outbox__pub_idem_load(outbox_relay *r, void *node);

/* ---- wake.c ---- */

/* Initialises and starts the wake-up handles; returns how many. */
int outbox__wake_init(outbox_relay *r);
/* Stops watching (a stop begins); closes the handles with cb. */
void outbox__wake_stop(outbox_relay *r);
void outbox__wake_close(outbox_relay *r, uv_close_cb cb);
/* Wakes the loop from any thread (a no-op before start and after stop). */
void outbox__wake_send(outbox_relay *r);
/* A unit is about to run / has run: the WAL watch is off meanwhile; resume
 * returns 1 if it was off (a look is then due). */
void outbox__wake_pause(outbox_relay *r);
int outbox__wake_resume(outbox_relay *r);
/* Has another connection committed? Schedules a unit and returns 1 if so. */
int outbox__wake_dv_changed(outbox_relay *r);
/* Looks now and again shortly after (a commit may not be visible yet). */
void outbox__wake_look(outbox_relay *r);
/* Starts a checkpoint on a worker thread if the WAL holds enough pages. */
void outbox__wake_checkpoint(outbox_relay *r, int pages);
/* The relay connection's WAL hook (on the committing thread). */
int outbox__wake_own_wal_hook(void *arg, sqlite3 *db, const char *name, int pages);

/* ---- sched.c ---- */

/* Initialises the scheduling timers; returns how many. Closes them with cb. */
int outbox__sched_init(outbox_relay *r);
/* A batch's first published message parked (window.c, through the parked
 * hook): a unit runs within PARKED_MS, which marks them on their own rows
 * if the batch is still not done (outbox__win_flush_parked). */
void outbox__sched_parked(outbox_relay *r);
void outbox__sched_close(outbox_relay *r, uv_close_cb cb);
/* Runs a unit soon (after the lock gap); the hooks.schedule target. */
void outbox__sched_schedule(outbox_relay *r);
/* Schedules a unit after delay ms (at most the scan interval). */
void outbox__sched_arm_scan(outbox_relay *r, uint64_t delay);
/* The relay connection's busy handler: waits only inside a unit. */
int outbox__sched_busy_handler(void *arg, int count);

/* ---- drain.c ---- */

/* Starts the drain's timeout (drain_timeout_ms), in drain mode. */
void outbox__drain_start(outbox_relay *r);
/* After a unit that found no more rows: in drain mode, the drain is over
 * (on_drained) once nothing is in flight or queued and no row is left,
 * rows waiting for a retry included, rows delayed by the application not.
 * p: the plan when it says no row is leased or waiting, else NULL. */
struct claim_plan;
void outbox__drain_check(outbox_relay *r, int64_t now, const struct claim_plan *p);
/* Drain mode: the drain cannot finish (code, e.g. OUTBOX_ECONFIG: Redis
 * cannot be used as configured) and ends on the next loop turn, as
 * drain_timeout_ms would end it: on_drained, with
 * outbox_relay_drain_result() returning code. A no-op without drain mode or
 * once the drain ended. */
void outbox__drain_fail(outbox_relay *r, int code);
/* Drain mode: a drain that ended (on_drained called) is armed again, and a
 * unit runs soon to see whether it is over again (a group's relay that
 * kept working while it lingered). */
void outbox__drain_rearm(outbox_relay *r);

/* ---- dbwait.c ---- */

/* Create could not open the database for a reason that heals (e, f, why):
 * the relay will wait for it. */
void outbox__dbwait_begin(outbox_relay *r, int e, const outbox__sqlfail *f, const char *why);
/* A group's relay: the database is opened on a worker thread once the relay
 * starts, instead of by create (the loop never waits for an open). */
void outbox__dbwait_defer(outbox_relay *r);
/* Initialises the wait's timer; returns 1 (the handle). When the relay
 * waits, logs it and arms the first try; hooks.db_opened follows the try
 * that opens the database. */
int outbox__dbwait_start(outbox_relay *r);
/* Stops trying (a stop begins); a try on a worker thread still ends
 * (r->dbwait.running). Closes the timer with cb. */
void outbox__dbwait_stop(outbox_relay *r);
void outbox__dbwait_close(outbox_relay *r, uv_close_cb cb);

/* ---- ops.c ---- */

/* Histograms and the topic table (create); their memory (destroy). */
void outbox__ops_init(outbox_relay *r);
void outbox__ops_free(outbox_relay *r);
/* Binds metrics_listen, if set. 0 or OUTBOX_E* with err. */
int outbox__ops_listen(outbox_relay *r, char *err, size_t errlen);
/* Starts the stall probes; returns the number of handles (the HTTP
 * server's included). Closes them with cb. */
int outbox__ops_start(outbox_relay *r);
void outbox__ops_close(outbox_relay *r, uv_close_cb cb);

/* ---- retention.c ---- */

/* Initialises the retention timer and starts it if retention_ms is set;
 * returns 1 (the handles). Stops it; closes it with cb. A step running on
 * a worker thread is r->ret.running (a stop waits for it). */
int outbox__retention_start(outbox_relay *r);
void outbox__retention_stop(outbox_relay *r);
void outbox__retention_close(outbox_relay *r, uv_close_cb cb);
/* Closes retention's connection (destroy, or a failed open; NULL-safe). */
void outbox__retention_close_db(struct relay_retention *rt);

#endif
