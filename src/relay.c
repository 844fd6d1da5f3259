/*
 * The relay: lease scanner, pipelined XADD, fenced batched marks, retries,
 * dead letters, wake-ups, graceful stop. See include/outbox/relay.h.
 *
 * One unit of work (do_work) is one SQLite transaction on the loop thread:
 * it writes the marks collected from Redis replies since the last one, then
 * claims the next batch if the in-flight window has room. Claimed rows are
 * sent only after that transaction committed. Replies come back through the
 * connection module in order; each one turns its message into a mark.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "http.h"
#include "idem.h"
#include "internal.h"
#include "metrics.h"
#include "outbox/envelope.h"
#include "outbox/relay.h"
#include "outbox/schema.h"
#include "outbox/writer.h"
#include "rconn.h"
#include "redis.h"
#include "relay_sql.h"
#include "sqlite_util.h"

enum { ROW_PENDING = 0, ROW_SENDING = 1, ROW_PUBLISHED = 2, ROW_DEAD = 3 };

/* Marks written per transaction at most (see do_work). */
#define MARKS_PER_TXN 512

/* A unit's transaction holds the database's write lock: it stops writing
 * marks and sizes its claim to end after about this long (ns), so that an
 * application's writer never waits much longer for the lock. */
#define TXN_BUDGET_NS 4000000u

/* What became of one message; decides its mark. */
enum outcome {
    OUT_NONE = 0,
    OUT_PUBLISHED,  /* Redis accepted it (and WAIT was satisfied) */
    OUT_RETRY,      /* a failure that counts: backoff, or dead when exhausted */
    OUT_RELEASE,    /* not its fault (connection lost, held back, stop): pending again, attempt not counted */
    OUT_DEAD,       /* cannot ever be published (invalid row) */
};

enum msg_state { MSG_HELD, MSG_SENT, MSG_WAITING, MSG_DONE };

typedef struct wait_group wait_group;
typedef struct cand cand;
typedef struct bslot bslot;
typedef struct chunk chunk;

typedef struct msg {
    struct msg *next;     /* mark queue */
    struct msg *key_next; /* the next message of its key, held back behind this one */
    struct outbox_relay *r;
    wait_group *group;
    int64_t seq, token, attempts, created_at, replay_count;
    char *id, *topic, *key; /* key: "" when unkeyed */
    size_t klen;
    struct msg *km_next;     /* keymap bucket */
    int in_keymap;
    struct msg *chain_after; /* claimed behind this message of an earlier batch (linked after commit) */
    char *env; /* idempotent mode: the envelope, sent with its stream's batch */
    size_t envlen;
    char *cmd; /* formatted XADD, until sent */
    size_t cmdlen;
    enum msg_state state;
    enum outcome outcome;
    int behind; /* held behind an earlier message of its key */
    int took_over; /* claimed from an expired lease */
    int mark_applied; /* set by write_mark: the mark changed the row (not fenced) */
    const char *mark_what; /* set by write_mark: published, retry, dead or released */
    char *result; /* stream entry id (published) or error text (failed); malloc'd */
} msg;

struct wait_group {
    struct outbox_relay *r;
    size_t n, cap;
    msg **msgs; /* NULL for a message that left the group */
};

enum relay_state { R_CREATED, R_RUNNING, R_STOPPING, R_STOPPED };
/* Where the Redis connection (an rconn) is in its life. */
enum rc_state { RC_NONE, RC_INITIALISED, RC_STARTED, RC_CLOSING };

struct outbox_relay {
    uv_loop_t *loop;
    outbox_relay_settings s;
    outbox__logger log;
    char *db_path, *redis_url_text, *worker_id, *stream_prefix, *metrics_listen;
    outbox__redis_url url;
    char url_desc[300];

    sqlite3 *db;
    sqlite3_stmt *q_new, *q_due, *q_expired, *q_key_prev, *q_defer, *q_claim, *q_published, *q_failed, *q_release, *q_dead,
        *q_data_version, *q_next_due, *q_next_lease, *q_drain, *q_retention, *q_cursor, *q_cursor_set, *q_top,
        *q_stray;
    int64_t data_version;
    uint64_t foreign_commit_ms; /* loop time data_version last moved */

    enum relay_state state;
    /* The Redis connection, kept connected (rconn.h). */
    outbox__rconn rc;
    enum rc_state rc_state;

    /* Handles. */
    uv_timer_t kick_timer;      /* zero-delay: run do_work on the next loop turn */
    uv_timer_t scan_timer;      /* fallback scan and next-due wake-up */
    uv_timer_t busy_timer;      /* database locked: retry */
    uv_timer_t shutdown_timer;
    uv_async_t wake_async;
    uv_fs_event_t wal_watch;
    int wal_watch_active; /* watching (not while a unit runs: see wal_watch_pause) */
    char *wal_path;
    uv_timer_t wal_timer;       /* data_version re-checks after a WAL change */
    unsigned wal_rechecks;
    int handles_open;

    /* Messages claimed and not yet marked (the window), those awaiting a
     * reply, and the mark queue. */
    uint64_t inflight, awaiting;
    msg *marks_head, *marks_tail;
    uint64_t busy_delay_ms;
    uint64_t lock_free_until; /* loop ms before which no new write transaction starts */
    int last_claim_full;

    /* The newest message held of each key (see keymap_put). */
    msg **keymap;
    size_t keymap_cap, keymap_len;

    /* In-flight seqs, to tell our own leases from expired ones. */
    int64_t *seqset;
    size_t seqset_cap, seqset_len, seqset_tombs;

    /* Envelope scratch buffer. */
    char *envbuf;
    size_t envcap;

    /* The unit of work (see unit_run). */
    uv_work_t unit_work;
    int unit_running, unit_again;
    struct unit {
        int64_t now;
        unsigned want;
        int want_claim;
        msg *marks; /* detached from the queue, nmarks long */
        size_t nmarks;
        msg **claimed;
        size_t nclaimed, ndead;
        size_t ndeferred; /* rows the claim made due later: the next claim sees other rows */
        msg *settled; /* claimed and marked at once (dead, or handed back) */
        size_t nwritten; /* marks written when the budget ran out first, else 0 */
        int stopping; /* the last marks: no time budget */
        uint64_t held, rest; /* in the window without a queued mark; marks left in the queue */
        int rc;
        const char *what;
        uint64_t t0, t_claim0, t_end;
    } unit;
    int own_wal_pages; /* set by the WAL hook of the relay's own commits */
    /* A unit's transaction is open (it holds the write lock): attached
     * connections wait on txn_cond for it to end (attach_busy). */
    uv_mutex_t txn_mutex;
    uv_cond_t txn_cond;
    int txn_sync_ok; /* mutex and cond initialised */
    int txn_open;
    int in_unit; /* unit_run is between BEGIN and its end (worker thread; see unit_busy) */
    int yield; /* an attached connection waits for the lock: the unit ends early (atomic) */
    int attach_busy_ms; /* the attached connection's busy timeout, restored by detach */
    int attached;       /* connections attached with attach_busy (atomic: attach/detach run on their threads) */
    int wake_ready;     /* wake_async is initialised (atomic: read by attached connections' threads) */
    int dv_pending;     /* a data_version check waits for the running unit */
    uint64_t claim_row_ns; /* recent cost of one claimed row (worker thread only) */
    /* The claim's working arrays (see claim), kept from one claim to the
     * next and grown to the largest so far; used by one unit at a time. */
    struct {
        cand *cs;
        int *chosen;
        int64_t *defer;
        size_t cap;
        bslot *slots;
        size_t scap;
        unsigned gen; /* a slot is in use in this claim iff its gen is this */
        chunk *arena;
    } cw;
    sqlite3 *stats_db;  /* outbox_relay_stats_get's own connection */

    /* Checkpointing on a worker thread. */
    uv_work_t ckpt_work;
    int ckpt_running;
    int ckpt_restart; /* the next checkpoint is a RESTART (the WAL grew large) */
    int ckpt_pages; /* set from other threads by the attach hook: atomics */
    sqlite3 *ckpt_db;

    /* Stop. */
    void (*stop_cb)(outbox_relay *, void *);
    void *stop_data;
    int destroy_pending;
    int in_finish;
    int closing;
    unsigned stop_flush_failures; /* units in a row that failed while stopping */
    int drained_signalled;

    /* Counters. */
    uint64_t published_total, failed_total, dead_total, fenced_total, reconnects;

    /* Metrics (see relay_metrics below). */
    outbox__topics topics;
    outbox__hist h_latency, h_claim_size, h_claim_secs, h_stall;
    uint64_t retries_total, duplicates_total, held_back_total, claims_total, retention_deleted;
    uint64_t stall_max_ns, loop_mark_ns, loop_idle_ns;
    uv_prepare_t stall_prepare;
    uv_check_t stall_check;
    uv_timer_t retention_timer;
    outbox__http *http;
    int http_closing;
    uint64_t down_since_wall; /* loop ms when Redis became unreachable, 0 while up */
    /* Database figures for /metrics and /healthz, refreshed off the loop. */
    uv_work_t dbstat_work;
    int dbstat_running;
    uint64_t dbstat_at;  /* loop ms of the last refresh */
    struct dbstat {
        int ok;
        int64_t by_state[4], oldest_due_ms;
        char err[160];
    } dbstat, dbstat_tmp;
    sqlite3 *dbstat_db;
    outbox__http_req **waiting_reqs;
    char **waiting_paths;
    size_t nwaiting, capwaiting;
    /* Idempotent publishing. */
    char idem_sha[41];
};

#define LOG(r, lvl, ...) outbox__log(&(r)->log, (lvl), __VA_ARGS__)

/* The Redis connection when it is up, else NULL. */
static outbox__redis *redis_conn(const outbox_relay *r)
{
    return r->rc_state == RC_STARTED ? outbox__rconn_get(&r->rc) : NULL;
}

static void schedule_work(outbox_relay *r);
static void maybe_finish_stop(outbox_relay *r);
static void on_conn_closed(void *data);
static void maybe_checkpoint(outbox_relay *r, int pages);
static int data_version_changed(outbox_relay *r);
static void wal_watch_pause(outbox_relay *r);
static int wal_watch_resume(outbox_relay *r);
static void on_wal_change(uv_fs_event_t *h, const char *filename, int events, int status);
static void wal_look(outbox_relay *r);
static void send_msg(outbox_relay *r, msg *m, wait_group **grp);
static void on_scan(uv_timer_t *t);
static void on_handle_closed(uv_handle_t *h);
static void finish_stop(outbox_relay *r);
static void init_metrics(outbox_relay *r);
static int start_ops(outbox_relay *r, char *err, size_t errlen);
static void start_ops_handles(outbox_relay *r);
static void close_ops(outbox_relay *r);
static void on_busy_retry(uv_timer_t *t);

/* ------------------------------------------------------------------ */
/* settings */

void outbox_relay_defaults(outbox_relay_settings *s)
{
    memset(s, 0, sizeof *s);
    s->stream_prefix = "outbox:";
    s->batch = 512;
    s->inflight = 8192;
    s->lease_ms = 30000;
    s->scan_interval_ms = 1000;
    s->max_attempts = 10;
    s->backoff_min_ms = 500;
    s->backoff_max_ms = 60000;
    s->maxlen = 0;
    s->max_payload = OUTBOX_PAYLOAD_DEFAULT_MAX;
    s->shutdown_timeout_ms = 10000;
    s->wait_replicas = 0;
    s->wait_timeout_ms = 1000;
    s->connect_timeout_ms = 5000;
    s->reply_timeout_ms = 10000;
    s->log = outbox_log_stderr;
    s->log_level = OUTBOX_LOG_INFO;
    s->idempotent = 0;
    s->idempotent_retention_ms = 3600000;
    s->health_redis_down_ms = 30000;
    s->retention_ms = 86400000;
    s->retention_batch = 1000;
}

static int check_settings(const outbox_relay_settings *s, char *err, size_t errlen)
{
    if (!s->db_path || !*s->db_path)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db: no database path given");
    if (!s->redis_url || !*s->redis_url)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "redis: no Redis URL given");
    if (s->batch < 1 || s->batch > 100000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "batch: %u is out of range 1..100000", s->batch);
    if (s->inflight < 1 || s->inflight > 1000000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "inflight: %u is out of range 1..1000000", s->inflight);
    if (s->lease_ms < 1000 || s->lease_ms > 86400000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "lease-ms: %llu is out of range 1000..86400000",
                            (unsigned long long)s->lease_ms);
    if (s->scan_interval_ms < 1 || s->scan_interval_ms > 3600000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "scan-interval-ms: %llu is out of range 1..3600000",
                            (unsigned long long)s->scan_interval_ms);
    if (s->max_attempts < 1 || s->max_attempts > 1000000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "max-attempts: %u is out of range 1..1000000", s->max_attempts);
    if (s->backoff_min_ms < 1 || s->backoff_min_ms > s->backoff_max_ms || s->backoff_max_ms > 86400000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "backoff-min-ms/backoff-max-ms: need 1 <= min (%llu) <= max (%llu) <= 86400000",
                            (unsigned long long)s->backoff_min_ms, (unsigned long long)s->backoff_max_ms);
    if (!s->stream_prefix || strlen(s->stream_prefix) > 128 || strpbrk(s->stream_prefix, "{} \t\r\n"))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "stream-prefix: must be at most 128 bytes without braces or spaces");
    if (s->max_payload < 1 || s->max_payload > OUTBOX_PAYLOAD_HARD_MAX)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "max-payload: %zu is out of range 1..%d", s->max_payload,
                            OUTBOX_PAYLOAD_HARD_MAX);
    if (s->shutdown_timeout_ms > 3600000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "shutdown-timeout-ms: %llu is out of range 0..3600000",
                            (unsigned long long)s->shutdown_timeout_ms);
    if (s->wait_replicas > 100)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "wait-replicas: %u is out of range 0..100", s->wait_replicas);
    if (s->wait_replicas && (s->wait_timeout_ms < 1 || s->wait_timeout_ms >= s->lease_ms / 2))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "wait-timeout-ms: %llu must be at least 1 and below half of lease-ms",
                            (unsigned long long)s->wait_timeout_ms);
    /* WAIT is only sent with wait_replicas; without it its timeout does not
     * delay a reply. */
    if (s->reply_timeout_ms < 1 ||
        s->reply_timeout_ms + (s->wait_replicas ? s->wait_timeout_ms : 0) >= s->lease_ms)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "reply timeout %llu ms (plus wait-timeout-ms) must be below lease-ms %llu, so that "
                            "a stuck connection is given up before its leases expire",
                            (unsigned long long)s->reply_timeout_ms, (unsigned long long)s->lease_ms);
    if (s->connect_timeout_ms < 1)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "connect timeout must be at least 1 ms");
    if (s->worker_id && (!*s->worker_id || strlen(s->worker_id) > 200))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "worker-id: must be 1..200 bytes");
    if ((unsigned)s->log_level > OUTBOX_LOG_ERROR)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "log-level: unknown level %d", (int)s->log_level);
    if (s->idempotent && (s->idempotent_retention_ms < 1000 || s->idempotent_retention_ms > 30ull * 86400000))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "idempotent-retention-ms: %llu is out of range 1000..2592000000",
                            (unsigned long long)s->idempotent_retention_ms);
    if (s->idempotent && s->wait_replicas)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "idempotent and wait-replicas cannot be combined in this version");
    if (s->metrics_listen) {
        struct sockaddr_storage ss;
        char why[200];
        if (outbox__http_parse_listen(s->metrics_listen, &ss, why, sizeof why) != 0)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "metrics-listen: %s", why);
    }
    if (s->health_redis_down_ms < 1)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "health-redis-down-ms: must be at least 1");
    if (s->retention_ms && s->retention_ms < 1000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "retention-ms: %llu is below 1000 (0 keeps published rows)",
                            (unsigned long long)s->retention_ms);
    if (s->retention_batch < 1 || s->retention_batch > 100000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "retention-batch: %u is out of range 1..100000",
                            s->retention_batch);
    return 0;
}

/* ------------------------------------------------------------------ */
/* small helpers */

static uint64_t rand64(void)
{
    static __thread uint64_t x;
    if (x == 0)
        x = (uint64_t)outbox_now_ms() * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid();
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

/* Exponential backoff with jitter: attempt 1 waits about min, each further
 * attempt doubles, capped at max; the wait is drawn from [d/2, d]. */
static uint64_t backoff_ms(const outbox_relay *r, int64_t attempts)
{
    uint64_t d = r->s.backoff_min_ms;
    for (int64_t i = 1; i < attempts && d < r->s.backoff_max_ms; i++)
        d *= 2;
    if (d > r->s.backoff_max_ms)
        d = r->s.backoff_max_ms;
    d = d / 2 + rand64() % (d / 2 + 1);
    return d < r->s.backoff_min_ms ? r->s.backoff_min_ms : d;
}

/* Copies an error for last_error: short, printable, one line. */
static char *safe_text(const char *s, size_t len)
{
    size_t n = len > 200 ? 200 : len, i;
    char *out = malloc(n + 1);
    if (!out)
        return NULL;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        out[i] = (c < ' ' || c == 0x7f) ? ' ' : (char)c;
    }
    out[n] = '\0';
    return out;
}

/* In-flight seq set: open addressing with linear probing, tombstones = -1. */
static size_t seq_hash(int64_t seq, size_t cap)
{
    return (size_t)(((uint64_t)seq * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
}

static int seqset_add(outbox_relay *r, int64_t seq)
{
    size_t i;
    /* Rebuild when live entries and tombstones fill half the table, not
     * only the live ones: a lookup of an absent seq stops only at an empty
     * slot, and every add may turn one into a tombstone for good. */
    if ((r->seqset_len + r->seqset_tombs + 1) * 2 > r->seqset_cap) {
        size_t ncap = r->seqset_cap ? r->seqset_cap : 1024, k;
        int64_t *n, *old = r->seqset;
        while ((r->seqset_len + 1) * 4 > ncap)
            ncap *= 2;
        n = malloc(ncap * sizeof *n);
        if (!n)
            return OUTBOX_ENOMEM;
        for (k = 0; k < ncap; k++)
            n[k] = 0;
        for (k = 0; k < r->seqset_cap; k++)
            if (old[k] > 0) {
                i = seq_hash(old[k], ncap);
                while (n[i] != 0)
                    i = (i + 1) & (ncap - 1);
                n[i] = old[k];
            }
        free(old);
        r->seqset = n;
        r->seqset_cap = ncap;
        r->seqset_tombs = 0;
    }
    i = seq_hash(seq, r->seqset_cap);
    while (r->seqset[i] > 0)
        i = (i + 1) & (r->seqset_cap - 1);
    if (r->seqset[i] < 0)
        r->seqset_tombs--;
    r->seqset[i] = seq;
    r->seqset_len++;
    return 0;
}

static int seqset_has(const outbox_relay *r, int64_t seq)
{
    size_t i;
    if (!r->seqset_cap)
        return 0;
    for (i = seq_hash(seq, r->seqset_cap); r->seqset[i] != 0; i = (i + 1) & (r->seqset_cap - 1))
        if (r->seqset[i] == seq)
            return 1;
    return 0;
}

static void seqset_del(outbox_relay *r, int64_t seq)
{
    size_t i;
    if (!r->seqset_cap)
        return;
    for (i = seq_hash(seq, r->seqset_cap); r->seqset[i] != 0; i = (i + 1) & (r->seqset_cap - 1))
        if (r->seqset[i] == seq) {
            r->seqset[i] = -1;
            r->seqset_len--;
            r->seqset_tombs++;
            return;
        }
}

static void msg_free(msg *m)
{
    if (!m)
        return;
    free(m->cmd);
    free(m->env);
    free(m->result);
    free(m);
}

/* ------------------------------------------------------------------ */
/* marks */

static void queue_mark(outbox_relay *r, msg *m, enum outcome o, const char *text, size_t len)
{
    char *copy = text ? safe_text(text, len) : NULL; /* text may be m->result */
    if (o == OUT_PUBLISHED) {
        /* Commit (created_at) to Redis accepting it. */
        int64_t lat = outbox_now_ms() - m->created_at;
        outbox__hist_observe(&r->h_latency, lat > 0 ? (double)lat / 1000.0 : 0.0);
    }
    m->outcome = o;
    m->state = MSG_DONE;
    free(m->result);
    m->result = copy;
    m->next = NULL;
    if (r->marks_tail)
        r->marks_tail->next = m;
    else
        r->marks_head = m;
    r->marks_tail = m;
    schedule_work(r);
}

/* Releases m's held-back successors: they were never sent. */
static void release_chain(outbox_relay *r, msg *m, const char *why)
{
    msg *n = m->key_next;
    m->key_next = NULL;
    while (n) {
        msg *next = n->key_next;
        n->key_next = NULL;
        queue_mark(r, n, OUT_RELEASE, why, strlen(why));
        n = next;
    }
}

static int bind_fence(sqlite3_stmt *st, int first, const outbox_relay *r, const msg *m)
{
    sqlite3_bind_int64(st, first, m->seq);
    sqlite3_bind_text(st, first + 1, r->worker_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, first + 2, m->token);
    return 0;
}

/* Writes one mark inside the open transaction. Returns 0, or the SQLite
 * error code that aborts the transaction. */
static int write_mark(outbox_relay *r, msg *m, int64_t now)
{
    sqlite3_stmt *st;
    int rc;
    const char *what;

    switch (m->outcome) {
    case OUT_PUBLISHED:
        st = r->q_published;
        bind_fence(st, 1, r, m);
        sqlite3_bind_int64(st, 4, now);
        sqlite3_bind_text(st, 5, m->result, -1, SQLITE_STATIC);
        what = "published";
        break;
    case OUT_RETRY:
        st = r->q_failed;
        bind_fence(st, 1, r, m);
        if (m->attempts >= (int64_t)r->s.max_attempts) {
            sqlite3_bind_int(st, 4, ROW_DEAD);
            what = "dead";
        } else {
            sqlite3_bind_int(st, 4, ROW_PENDING);
            what = "retry";
        }
        /* Its key's later rows wait as long: claims that meet them move
         * them behind it (defer). */
        sqlite3_bind_int64(st, 5, now + (int64_t)backoff_ms(r, m->attempts));
        sqlite3_bind_text(st, 6, m->result ? m->result : "unknown error", -1, SQLITE_STATIC);
        break;
    case OUT_DEAD:
        st = r->q_failed;
        bind_fence(st, 1, r, m);
        sqlite3_bind_int(st, 4, ROW_DEAD);
        sqlite3_bind_int64(st, 5, now);
        sqlite3_bind_text(st, 6, m->result ? m->result : "invalid row", -1, SQLITE_STATIC);
        what = "dead";
        break;
    case OUT_RELEASE:
    default:
        st = r->q_release;
        bind_fence(st, 1, r, m);
        sqlite3_bind_int64(st, 4, now);
        what = "released";
        break;
    }
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (rc != SQLITE_DONE)
        return rc;
    m->mark_what = what;
    m->mark_applied = sqlite3_changes(r->db) > 0;
    return SQLITE_OK;
}

/* Counts and logs a mark written by write_mark (on the loop thread). */
static void mark_account(outbox_relay *r, msg *m)
{
    const char *what = m->mark_what ? m->mark_what : "released";
    if (!m->mark_applied) {
        r->fenced_total++;
        LOG(r, OUTBOX_LOG_WARN,
            "msg=\"mark refused: lease taken over by another relay\" id=%s seq=%lld token=%lld mark=%s", m->id,
            (long long)m->seq, (long long)m->token, what);
        return;
    }
    {
        outbox__topic_stat *ts = outbox__topics_get(&r->topics, m->topic ? m->topic : "_unknown");
        if (m->outcome == OUT_PUBLISHED)
            ts->published++;
        else if (m->outcome == OUT_DEAD || (m->outcome == OUT_RETRY && strcmp(what, "dead") == 0))
            ts->dead++;
        else if (m->outcome == OUT_RETRY)
            ts->retried++;
        if (m->outcome == OUT_RETRY)
            ts->failed++;
        if (m->outcome == OUT_RETRY && strcmp(what, "retry") == 0)
            r->retries_total++;
    }
    if (m->outcome == OUT_PUBLISHED) {
        r->published_total++;
        LOG(r, OUTBOX_LOG_DEBUG, "msg=published id=%s seq=%lld entry=%s", m->id, (long long)m->seq, m->result);
    } else if (m->outcome == OUT_RETRY || m->outcome == OUT_DEAD) {
        char q[256];
        outbox__logfmt_quote(q, sizeof q, m->result ? m->result : "");
        r->failed_total++;
        if (strcmp(what, "dead") == 0) {
            r->dead_total++;
            LOG(r, OUTBOX_LOG_ERROR, "msg=\"dead-lettered\" id=%s seq=%lld attempts=%lld error=%s", m->id,
                (long long)m->seq, (long long)m->attempts, q);
        } else {
            LOG(r, OUTBOX_LOG_WARN, "msg=\"publish failed, will retry\" id=%s seq=%lld attempts=%lld error=%s",
                m->id, (long long)m->seq, (long long)m->attempts, q);
        }
    }
}

/* ------------------------------------------------------------------ */
/* per-key chains */

/*
 * The newest message this relay holds (claimed, not yet marked) of each
 * ordering key. A row whose key predecessor is that message, still on its
 * way, is claimed and chained behind it (sent when it is accepted) instead
 * of waiting for its mark: otherwise a key with a message in flight would
 * hold its next row back for a whole round trip plus a mark.
 */
static uint64_t key_hash(const char *topic, const char *key, size_t klen)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p;
    for (p = (const unsigned char *)topic; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
    for (size_t i = 0; i < klen; i++)
        h = (h ^ (unsigned char)key[i]) * 1099511628211ull;
    return h;
}

static int same_key(const char *t1, const char *k1, size_t l1, const char *t2, const char *k2, size_t l2)
{
    return l1 == l2 && memcmp(k1, k2, l1) == 0 && strcmp(t1, t2) == 0;
}

/* The link that points at the key's entry, or at the NULL ending its bucket. */
static msg **keymap_link(outbox_relay *r, const char *topic, const char *key, size_t klen)
{
    msg **l = &r->keymap[key_hash(topic, key, klen) & (r->keymap_cap - 1)];
    while (*l && !same_key((*l)->topic, (*l)->key, (*l)->klen, topic, key, klen))
        l = &(*l)->km_next;
    return l;
}

static msg *keymap_get(outbox_relay *r, const char *topic, const char *key, size_t klen)
{
    return r->keymap_cap ? *keymap_link(r, topic, key, klen) : NULL;
}

/* Makes m its key's newest message. Without memory for the table it is left
 * out: its successors then wait for its mark, which is slower, not wrong. */
static void keymap_put(outbox_relay *r, msg *m)
{
    msg **l;
    if (r->keymap_len * 2 >= r->keymap_cap) {
        size_t ncap = r->keymap_cap ? r->keymap_cap * 2 : 1024, i;
        msg **n = calloc(ncap, sizeof *n);
        if (n) {
            for (i = 0; i < r->keymap_cap; i++) {
                msg *e = r->keymap[i];
                while (e) {
                    msg *next = e->km_next;
                    msg **b = &n[key_hash(e->topic, e->key, e->klen) & (ncap - 1)];
                    e->km_next = *b;
                    *b = e;
                    e = next;
                }
            }
            free(r->keymap);
            r->keymap = n;
            r->keymap_cap = ncap;
        } else if (!r->keymap_cap) {
            return;
        }
    }
    l = keymap_link(r, m->topic, m->key, m->klen);
    if (*l) {
        msg *old = *l;
        m->km_next = old->km_next;
        old->km_next = NULL;
        old->in_keymap = 0;
    } else {
        m->km_next = NULL;
        r->keymap_len++;
    }
    *l = m;
    m->in_keymap = 1;
}

static void keymap_drop(outbox_relay *r, msg *m)
{
    msg **l;
    if (!m->in_keymap)
        return;
    l = keymap_link(r, m->topic, m->key, m->klen);
    if (*l == m) {
        *l = m->km_next;
        r->keymap_len--;
    }
    m->in_keymap = 0;
    m->km_next = NULL;
}

/* Frees a message that leaves the window. */
static void msg_retire(outbox_relay *r, msg *m)
{
    keymap_drop(r, m);
    seqset_del(r, m->seq);
    msg_free(m);
}

/* ------------------------------------------------------------------ */
/* claim */

/* The fields of a row that the envelope and the checks need. */
typedef struct rowview {
    const char *id, *topic, *key;
    const void *payload, *headers;
    size_t klen, plen, hlen;
    int64_t created_at;
} rowview;

/* A row the claim looked at. */
struct cand {
    int64_t seq;
    const char *topic, *key; /* in the claim's arena */
    size_t klen;
    int64_t token;      /* lease_token: 0 = never claimed */
    int64_t available_at, created_at;
    enum { S_EXPIRED, S_WAITING, S_NEW } source; /* outbox_leased, outbox_due or the walk of new rows */
    int prev;     /* index of its key predecessor chosen in this batch, or -1 */
    msg *after;   /* or the message of an earlier batch it goes after */
    msg *m;       /* the claimed message */
    msg *eff_after; /* what it ended up behind (for a successor of a dead row) */
    int eff_in_batch; /* eff_after was claimed in this batch */
    int deferred;     /* defer gave it a later available_at */
    enum { C_SEEN, C_CHOSEN, C_DEAD, C_RELEASED } fate;
};

/* Strings copied for the length of one claim. */
struct chunk {
    struct chunk *next;
    size_t used, cap;
    char data[];
};

static const char *arena_dup(chunk **a, const char *s, size_t len)
{
    char *p;
    if (!*a || (*a)->cap - (*a)->used < len + 1) {
        size_t cap = len + 1 > 16384 ? len + 1 : 16384;
        chunk *c = malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->next = *a;
        c->used = 0;
        c->cap = cap;
        *a = c;
    }
    p = (*a)->data + (*a)->used;
    memcpy(p, s, len);
    p[len] = '\0';
    (*a)->used += len + 1;
    return p;
}

static void arena_free(chunk *a)
{
    while (a) {
        chunk *n = a->next;
        free(a);
        a = n;
    }
}

/* Empties an arena for the next claim, keeping its first chunk. */
static void arena_reset(chunk **a)
{
    if (*a) {
        arena_free((*a)->next);
        (*a)->next = NULL;
        (*a)->used = 0;
    }
}

/* Per key, in one claim: its newest row chosen and its held rows. */
struct bslot {
    unsigned gen;     /* the claim that uses it (claim_ctx.gen); any other: an empty slot */
    int first;        /* index of the key's first row seen */
    int last_chosen;  /* index of its newest row chosen, or -1 */
    int64_t held_min; /* the lowest seq of its rows held back, INT64_MAX if none */
    int64_t wait_until; /* its held rows were made due no earlier than this (see defer), or 0 */
};

typedef struct claim_ctx {
    outbox_relay *r;
    int64_t now;
    unsigned want;
    cand *cs;
    size_t n, cap;
    int *chosen;
    size_t nchosen;
    int64_t new_from; /* outbox_cursor: no new row before this seq */
    int64_t new_pos;  /* every new row before this seq was seen (INT64_MAX: all of them) */
    int64_t *defer;   /* (seq, available_at) pairs: rows to make due later (see defer) */
    size_t ndefer;
    bslot *slots;
    size_t scap;
    unsigned gen;
    chunk *arena;
} claim_ctx;

static bslot *bslot_find(claim_ctx *x, const char *topic, const char *key, size_t klen)
{
    size_t i = (size_t)key_hash(topic, key, klen) & (x->scap - 1);
    while (x->slots[i].gen == x->gen) {
        const cand *o = &x->cs[x->slots[i].first];
        if (same_key(o->topic, o->key, o->klen, topic, key, klen))
            return &x->slots[i];
        i = (i + 1) & (x->scap - 1);
    }
    return &x->slots[i];
}

/* Adds the current row of st (seq, topic, key, lease_token, available_at,
 * created_at) as a candidate. */
static int add_cand(claim_ctx *x, sqlite3_stmt *st, int source)
{
    const char *topic = (const char *)sqlite3_column_text(st, 1);
    const char *key = sqlite3_column_type(st, 2) == SQLITE_NULL ? NULL : (const char *)sqlite3_column_text(st, 2);
    size_t klen = key ? (size_t)sqlite3_column_bytes(st, 2) : 0;
    cand *c;
    if (x->n == x->cap)
        return SQLITE_NOMEM; /* sized for the most a claim looks at */
    if (!topic)
        return SQLITE_NOMEM;
    c = &x->cs[x->n];
    memset(c, 0, sizeof *c);
    c->seq = sqlite3_column_int64(st, 0);
    c->topic = arena_dup(&x->arena, topic, strlen(topic));
    c->key = key ? arena_dup(&x->arena, key, klen) : NULL;
    c->klen = klen;
    c->token = sqlite3_column_int64(st, 3);
    c->available_at = sqlite3_column_int64(st, 4);
    c->created_at = sqlite3_column_int64(st, 5);
    c->source = source;
    c->prev = -1;
    if (!c->topic || (key && !c->key))
        return SQLITE_NOMEM;
    x->n++;
    return SQLITE_OK;
}

static void choose(claim_ctx *x, int idx, int prev, msg *after)
{
    cand *c = &x->cs[idx];
    c->prev = prev;
    c->after = after;
    c->fate = C_CHOSEN;
    x->chosen[x->nchosen++] = idx;
    if (c->klen)
        bslot_find(x, c->topic, c->key, c->klen)->last_chosen = idx;
}

/* A pending row held back by a row made to wait becomes due no earlier than
 * it (`at`): a new row leaves the new rows for the waiting rows (available_at
 * after its created_at), and a waiting row moves behind it in outbox_due.
 * Otherwise the walks would meet such rows again and again, and a long run
 * of them would keep the walk of outbox_due from ever reaching the row they
 * wait for. A new row held back for another reason is made a waiting row
 * due at once (`at` 0): the walk of new rows never comes back to a row it
 * has seen (see scan_pending). Written after the walks (see claim). */
static void defer(claim_ctx *x, cand *c, bslot *bs, int64_t at)
{
    if (c->source == S_EXPIRED)
        return;
    if (c->source == S_NEW && at <= c->created_at)
        at = c->created_at + 1;
    if (bs && at > bs->wait_until)
        bs->wait_until = at; /* its later rows wait as long */
    if (at <= c->available_at)
        return;
    c->deferred = 1;
    x->defer[2 * x->ndefer] = c->seq;
    x->defer[2 * x->ndefer + 1] = at;
    x->ndefer++;
}

enum decision { D_FREE, D_IN_BATCH, D_AFTER, D_HELD_OURS, D_HELD };

/*
 * Per-key order: a keyed row may go when every earlier row of its key is
 * published or dead, or was chosen earlier in this batch (it is sent after
 * it), or is this relay's own message still on its way (it is chained
 * behind it). Otherwise it waits. The earlier unfinished rows of a key are
 * found in two places:
 * - New rows are walked in seq order, so those before a new
 *   row were seen earlier in this claim (its bslot). A row claimed before
 *   (lease_token > 0) has no new row before it: it was claimed after them,
 *   and every row that goes back to pending becomes a waiting row. A waiting
 *   row never claimed (written with a later available_at, or a new row made
 *   to wait by defer) goes only when the walk of new rows has already seen
 *   every new row older than it, so its bslot knows those of its key.
 * - Leased and waiting rows are in outbox_key; the newest one before the row
 *   is looked up.
 * Unfinished rows of a key always form its tail, because a row is never
 * sent before its predecessor is appended, so the newest unfinished
 * predecessor decides. A row requeued by outbox-replay is the exception: it
 * goes before its key's rows still pending, after those already published.
 */
static enum decision decide(claim_ctx *x, cand *c, bslot *bs, int *prev, msg **after, int *rc)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *st = r->q_key_prev;
    int64_t pseq, pstate, ptoken, pavail;
    int mine, lc = bs->last_chosen;
    enum decision d = D_HELD;

    *prev = -1;
    *after = NULL;
    *rc = SQLITE_OK;
    if (bs->held_min < c->seq) {
        if (bs->wait_until)
            defer(x, c, bs, bs->wait_until);
        return D_HELD;
    }
    if (c->source == S_WAITING && c->token == 0 && x->new_pos <= c->seq)
        return D_HELD;
    if (lc >= 0 && x->cs[lc].seq > c->seq)
        return D_HELD; /* cannot happen: a key's rows are chosen in seq order */
    sqlite3_bind_text(st, 1, c->topic, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, c->key, (int)c->klen, SQLITE_STATIC);
    sqlite3_bind_int64(st, 3, c->seq);
    *rc = sqlite3_step(st);
    if (*rc != SQLITE_ROW) {
        sqlite3_reset(st);
        if (*rc != SQLITE_DONE)
            return D_HELD; /* *rc says why */
        *rc = SQLITE_OK;
        *prev = lc;
        return lc >= 0 ? D_IN_BATCH : D_FREE;
    }
    *rc = SQLITE_OK;
    pseq = sqlite3_column_int64(st, 0);
    pstate = sqlite3_column_int64(st, 1);
    mine = sqlite3_column_type(st, 2) == SQLITE_TEXT &&
           strcmp((const char *)sqlite3_column_text(st, 2), r->worker_id) == 0;
    ptoken = sqlite3_column_int64(st, 3);
    pavail = sqlite3_column_int64(st, 4);
    sqlite3_reset(st);
    if (lc >= 0 && x->cs[lc].seq >= pseq) {
        *prev = lc;
        return D_IN_BATCH;
    }
    if (pstate == ROW_SENDING && mine && seqset_has(r, pseq)) {
        msg *m = keymap_get(r, c->topic, c->key, c->klen);
        d = D_HELD_OURS;
        /* Its state changes on the loop thread meanwhile: only the chain is
         * decided here, unit_done settles it (settle_chain). Idempotent mode
         * sends a stream's batch in one script call that stops at the first
         * failure: a later call could not know that an earlier one failed,
         * so it never chains. */
        if (m && m->seq == pseq && m->token == ptoken && !r->s.idempotent) {
            *after = m;
            d = D_AFTER;
        }
    } else if (pstate == ROW_PENDING) {
        /* Behind a row made to wait: wait as long. */
        defer(x, c, bs, pavail);
    }
    return d;
}

/* Decides one candidate just added and chooses it if it may go. */
static int consider(claim_ctx *x, int idx)
{
    cand *c = &x->cs[idx];
    int prev = -1, rc = SQLITE_OK;
    msg *after = NULL;
    enum decision d = D_FREE;
    bslot *bs = NULL;

    if (c->klen) {
        bs = bslot_find(x, c->topic, c->key, c->klen);
        if (bs->gen != x->gen) {
            bs->gen = x->gen;
            bs->first = idx;
            bs->last_chosen = -1;
            bs->held_min = INT64_MAX;
            bs->wait_until = 0;
        }
    }
    if (c->source == S_NEW && c->available_at > x->now) {
        /* Not due (its created_at is in the future): a waiting row. */
        defer(x, c, bs, c->available_at);
        d = D_HELD;
    } else if (bs) {
        d = decide(x, c, bs, &prev, &after, &rc);
        if (rc != SQLITE_OK)
            return rc;
    }
    if (d == D_HELD_OURS || d == D_HELD) {
        if (bs && c->seq < bs->held_min)
            bs->held_min = c->seq;
        if (c->source == S_NEW && !c->deferred)
            defer(x, c, NULL, 0);
        return SQLITE_OK;
    }
    choose(x, idx, prev, after);
    return SQLITE_OK;
}

/* Steps a one-value statement: *v gets its value, or dflt when it returns
 * no row or NULL. */
static int step_int(sqlite3_stmt *st, int64_t dflt, int64_t *v)
{
    int rc = sqlite3_step(st);
    *v = rc == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL ? sqlite3_column_int64(st, 0) : dflt;
    sqlite3_reset(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* Moves outbox_cursor past the new rows the walk saw (see scan_pending). */
static int move_cursor(claim_ctx *x)
{
    outbox_relay *r = x->r;
    int64_t to = x->new_pos, top;
    int rc;
    if (to == INT64_MAX) {
        /* Every new row seen: the next one comes after the last row. */
        rc = step_int(r->q_top, 0, &top);
        if (rc != SQLITE_OK)
            return rc;
        to = top + 1;
    }
    if (to <= x->new_from)
        return SQLITE_OK;
    sqlite3_bind_int64(r->q_cursor_set, 1, to);
    rc = sqlite3_step(r->q_cursor_set);
    sqlite3_reset(r->q_cursor_set);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* Steps q_expired and considers each row until the batch is full; our own
 * leases (still in flight) are skipped. */
static int scan_expired(claim_ctx *x)
{
    sqlite3_stmt *st = x->r->q_expired;
    int rc;
    sqlite3_bind_int64(st, 1, x->now);
    sqlite3_bind_int64(st, 2, x->want);
    while (x->nchosen < x->want && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (seqset_has(x->r, sqlite3_column_int64(st, 0)))
            continue;
        rc = add_cand(x, st, S_EXPIRED);
        if (rc == SQLITE_OK)
            rc = consider(x, (int)x->n - 1);
        if (rc != SQLITE_OK)
            break;
    }
    sqlite3_reset(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/*
 * Walks the waiting rows that are due (outbox_due) and the new rows (the
 * table from outbox_cursor.new_from) together, oldest available_at first,
 * and considers each row until the batch is full. Each walk looks further
 * than `want`, so that rows held back by their key do not starve the rest.
 * Every new row seen is claimed or made to wait (consider, defer), so the
 * cursor moves past all of them: the next walk starts at the first new row
 * not seen, or after the last row when there was none.
 */
static int scan_pending(claim_ctx *x)
{
    outbox_relay *r = x->r;
    sqlite3_stmt *w = r->q_due, *n = r->q_new;
    int64_t limit = (int64_t)x->want * 4, nread = 0, last = 0;
    int rw, rn, rc = SQLITE_OK;

    rc = sqlite3_step(r->q_stray);
    sqlite3_reset(r->q_stray);
    if (rc != SQLITE_DONE)
        return rc;
    rc = step_int(r->q_cursor, 0, &x->new_from);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_bind_int64(w, 1, x->now);
    sqlite3_bind_int64(w, 2, limit);
    sqlite3_bind_int64(n, 1, limit);
    sqlite3_bind_int64(n, 2, x->new_from);
    rn = sqlite3_step(n);
    rw = sqlite3_step(w);
    x->new_pos = rn == SQLITE_ROW ? sqlite3_column_int64(n, 0) : INT64_MAX;
    while (x->nchosen < x->want && (rw == SQLITE_ROW || rn == SQLITE_ROW)) {
        int take_new = rw != SQLITE_ROW ||
                       (rn == SQLITE_ROW && (sqlite3_column_int64(n, 4) < sqlite3_column_int64(w, 4) ||
                                             (sqlite3_column_int64(n, 4) == sqlite3_column_int64(w, 4) &&
                                              sqlite3_column_int64(n, 0) < sqlite3_column_int64(w, 0))));
        rc = add_cand(x, take_new ? n : w, take_new ? S_NEW : S_WAITING);
        if (rc == SQLITE_OK)
            rc = consider(x, (int)x->n - 1);
        if (rc != SQLITE_OK)
            break;
        if (take_new) {
            last = x->cs[x->n - 1].seq;
            nread++;
            rn = sqlite3_step(n);
            /* Seen so far: every new row before the next one, or all of
             * them when the walk ended before its limit. */
            x->new_pos = rn == SQLITE_ROW ? sqlite3_column_int64(n, 0) : nread < limit ? INT64_MAX : last + 1;
        } else {
            rw = sqlite3_step(w);
        }
    }
    if (rc == SQLITE_OK && rw != SQLITE_ROW && rw != SQLITE_DONE)
        rc = rw;
    if (rc == SQLITE_OK && rn != SQLITE_ROW && rn != SQLITE_DONE)
        rc = rn;
    sqlite3_reset(w);
    sqlite3_reset(n);
    if (rc == SQLITE_OK)
        rc = move_cursor(x);
    return rc;
}

/* Writes the new due times that defer collected. */
static int write_deferred(claim_ctx *x)
{
    sqlite3_stmt *st = x->r->q_defer;
    size_t i;
    int rc;
    for (i = 0; i < x->ndefer; i++) {
        sqlite3_bind_int64(st, 1, x->defer[2 * i]);
        sqlite3_bind_int64(st, 2, x->defer[2 * i + 1]);
        rc = sqlite3_step(st);
        sqlite3_reset(st);
        if (rc != SQLITE_DONE)
            return rc;
    }
    return SQLITE_OK;
}

static int build_command(outbox_relay *r, msg *m, const rowview *c)
{
    outbox_envelope e;
    size_t need, envlen = 0;
    char stream[400], maxlen[24];
    const char *argv[10];
    size_t lens[10];
    int argc = 0, len;

    memset(&e, 0, sizeof e);
    e.version = OUTBOX_ENVELOPE_VERSION;
    e.id = c->id;
    e.topic = c->topic;
    e.key = c->key;
    e.key_len = c->klen;
    e.payload = c->payload;
    e.payload_len = c->plen;
    e.headers = c->headers;
    e.headers_len = c->hlen;
    e.created_at = c->created_at;
    need = outbox_envelope_max_size(&e);
    if (need > r->envcap) {
        char *nb = realloc(r->envbuf, need);
        if (!nb)
            return OUTBOX_ENOMEM;
        r->envbuf = nb;
        r->envcap = need;
    }
    if (outbox_envelope_encode(&e, r->envbuf, r->envcap, &envlen) != 0)
        return OUTBOX_EINVAL;
    if (r->s.idempotent) {
        /* Sent later with the rest of its stream's batch in one script call. */
        m->env = malloc(envlen ? envlen : 1);
        if (!m->env)
            return OUTBOX_ENOMEM;
        memcpy(m->env, r->envbuf, envlen);
        m->envlen = envlen;
        return 0;
    }
    snprintf(stream, sizeof stream, "%s%s", r->stream_prefix, c->topic);
    argv[argc] = "XADD";
    lens[argc++] = 4;
    argv[argc] = stream;
    lens[argc++] = strlen(stream);
    if (r->s.maxlen) {
        snprintf(maxlen, sizeof maxlen, "%llu", (unsigned long long)r->s.maxlen);
        argv[argc] = "MAXLEN";
        lens[argc++] = 6;
        argv[argc] = "~";
        lens[argc++] = 1;
        argv[argc] = maxlen;
        lens[argc++] = strlen(maxlen);
    }
    argv[argc] = "*";
    lens[argc++] = 1;
    argv[argc] = "id";
    lens[argc++] = 2;
    argv[argc] = c->id;
    lens[argc++] = strlen(c->id);
    argv[argc] = "envelope";
    lens[argc++] = 8;
    argv[argc] = r->envbuf;
    lens[argc++] = envlen;
    len = redisFormatCommandArgv(&m->cmd, argc, argv, lens);
    if (len < 0)
        return OUTBOX_ENOMEM;
    m->cmdlen = (size_t)len;
    return 0;
}

/* Checks a row written by plain SQL against what the relay can publish;
 * returns NULL or a reason to dead-letter it. */
static const char *row_problem(const outbox_relay *r, const rowview *v, char *buf, size_t len)
{
    if (v->plen > r->s.max_payload) {
        snprintf(buf, len, "payload is %zu bytes, the relay's limit is %zu", v->plen, r->s.max_payload);
        return buf;
    }
    if (outbox_validate_topic(v->topic, buf, len) != 0)
        return buf;
    if (outbox_validate_id(v->id, buf, len) != 0)
        return buf;
    if (v->klen && outbox_validate_key(v->key, v->klen, buf, len) != 0)
        return buf;
    if (v->hlen && outbox_validate_headers(v->headers, v->hlen, buf, len) != 0)
        return buf;
    return NULL;
}

static int cmp_seq_idx(const void *a, const void *b)
{
    const int64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Turns the current row of q_claim into a message for its candidate. */
static int take_row(claim_ctx *x, sqlite3_stmt *st, const int64_t *index)
{
    outbox_relay *r = x->r;
    int64_t key[2], *hit;
    rowview v;
    size_t idl, tl;
    cand *c;
    msg *m;
    char why[256];
    const char *problem;

    key[0] = sqlite3_column_int64(st, 0);
    hit = bsearch(key, index, x->nchosen, 2 * sizeof(int64_t), cmp_seq_idx);
    if (!hit)
        return SQLITE_OK; /* not asked for: impossible */
    c = &x->cs[hit[1]];
    memset(&v, 0, sizeof v);
    v.id = (const char *)sqlite3_column_text(st, 1);
    idl = (size_t)sqlite3_column_bytes(st, 1);
    v.topic = (const char *)sqlite3_column_text(st, 2);
    tl = (size_t)sqlite3_column_bytes(st, 2);
    if (sqlite3_column_type(st, 3) != SQLITE_NULL) {
        v.key = (const char *)sqlite3_column_text(st, 3);
        v.klen = (size_t)sqlite3_column_bytes(st, 3);
    }
    v.payload = sqlite3_column_blob(st, 4);
    v.plen = (size_t)sqlite3_column_bytes(st, 4);
    if (sqlite3_column_type(st, 5) != SQLITE_NULL) {
        v.headers = sqlite3_column_blob(st, 5);
        v.hlen = (size_t)sqlite3_column_bytes(st, 5);
    }
    v.created_at = sqlite3_column_int64(st, 6);
    if (!v.id || !v.topic)
        return SQLITE_NOMEM;
    m = calloc(1, sizeof *m + idl + 1 + tl + 1 + v.klen + 1);
    if (!m)
        return SQLITE_NOMEM;
    m->r = r;
    m->seq = key[0];
    m->token = sqlite3_column_int64(st, 7);
    m->attempts = sqlite3_column_int64(st, 8);
    m->replay_count = sqlite3_column_int64(st, 9);
    m->created_at = v.created_at;
    m->id = (char *)(m + 1);
    memcpy(m->id, v.id, idl + 1);
    m->topic = m->id + idl + 1;
    memcpy(m->topic, v.topic, tl + 1);
    m->key = m->topic + tl + 1;
    if (v.klen)
        memcpy(m->key, v.key, v.klen);
    m->key[v.klen] = '\0';
    m->klen = v.klen;
    m->state = MSG_HELD;
    m->took_over = c->source == S_EXPIRED;
    c->m = m;
    problem = row_problem(r, &v, why, sizeof why);
    if (problem) {
        /* Never publishable: dead in this same transaction. */
        m->outcome = OUT_DEAD;
        m->result = safe_text(problem, strlen(problem));
        return SQLITE_OK;
    }
    return build_command(r, m, &v) == 0 ? SQLITE_OK : SQLITE_NOMEM;
}

/* Claims the chosen rows with one UPDATE ... RETURNING. */
static int claim_chosen(claim_ctx *x)
{
    outbox_relay *r = x->r;
    int64_t *index;
    char *list, *p;
    size_t i;
    int rc;

    index = malloc(x->nchosen * 2 * sizeof *index);
    list = malloc(x->nchosen * 21 + 2);
    if (!index || !list) {
        free(index);
        free(list);
        return SQLITE_NOMEM;
    }
    /* The seqs as a JSON array, for json_each() in the statement. */
    p = list;
    *p++ = '[';
    for (i = 0; i < x->nchosen; i++) {
        index[2 * i] = x->cs[x->chosen[i]].seq;
        index[2 * i + 1] = x->chosen[i];
        p += sprintf(p, "%s%lld", i ? "," : "", (long long)index[2 * i]);
    }
    *p++ = ']';
    qsort(index, x->nchosen, 2 * sizeof *index, cmp_seq_idx);
    sqlite3_bind_text(r->q_claim, 1, r->worker_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(r->q_claim, 2, x->now + (int64_t)r->s.lease_ms);
    sqlite3_bind_text(r->q_claim, 3, list, (int)(p - list), SQLITE_STATIC);
    sqlite3_bind_int64(r->q_claim, 4, x->now);
    while ((rc = sqlite3_step(r->q_claim)) == SQLITE_ROW) {
        rc = take_row(x, r->q_claim, index);
        if (rc != SQLITE_OK)
            break;
    }
    sqlite3_reset(r->q_claim);
    sqlite3_clear_bindings(r->q_claim);
    free(list);
    free(index);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/*
 * Makes the claim's working arrays hold cap candidates, and starts a new
 * generation of key slots (a slot of an older one reads as empty, so they
 * are not cleared per claim). The arrays outlive the claim: allocated and
 * freed per claim, their hundreds of KiB went back to the kernel under
 * glibc's default heap trimming and were faulted in again each time, which
 * made one claim in six or seven take 1 to 3 ms in an application's process.
 */
static int claim_arrays(outbox_relay *r, size_t cap)
{
    size_t scap = 16;
    if (cap > r->cw.cap) {
        cand *cs = realloc(r->cw.cs, cap * sizeof *cs);
        int *chosen;
        int64_t *defer;
        if (!cs)
            return -1;
        r->cw.cs = cs;
        chosen = realloc(r->cw.chosen, cap * sizeof *chosen);
        if (!chosen)
            return -1;
        r->cw.chosen = chosen;
        defer = realloc(r->cw.defer, cap * 2 * sizeof *defer);
        if (!defer)
            return -1;
        r->cw.defer = defer;
        r->cw.cap = cap;
    }
    while (scap < cap * 2)
        scap *= 2;
    if (scap > r->cw.scap) {
        bslot *slots = calloc(scap, sizeof *slots);
        if (!slots)
            return -1;
        free(r->cw.slots);
        r->cw.slots = slots;
        r->cw.scap = scap;
        r->cw.gen = 0;
    }
    if (++r->cw.gen == 0) {
        memset(r->cw.slots, 0, r->cw.scap * sizeof *r->cw.slots);
        r->cw.gen = 1;
    }
    return 0;
}

/*
 * Claims up to `want` rows inside the open transaction. *out gets the new
 * messages in the order they were chosen; a key's successors are linked
 * behind their predecessor (key_next, or chain_after for one of an earlier
 * batch, linked after the commit) and flagged `behind`. Rows that cannot be
 * published are dead-lettered here (*ndead; the messages go to *settled).
 * Returns SQLITE_OK or an error.
 */
static int claim(outbox_relay *r, unsigned want, int64_t now, msg ***out, size_t *nout, size_t *ndead,
                 msg **settled, size_t *ndeferred)
{
    claim_ctx x;
    msg **ms = NULL;
    size_t nm = 0, i;
    int rc = SQLITE_NOMEM;

    *out = NULL;
    *nout = 0;
    *ndead = 0;
    *ndeferred = 0;
    memset(&x, 0, sizeof x);
    x.r = r;
    x.now = now;
    x.want = want;
    if (claim_arrays(r, (size_t)want * 9 + 1) != 0) /* expired (want) + waiting (4 want) + new (4 want) */
        goto done;
    x.cap = r->cw.cap;
    x.cs = r->cw.cs;
    x.chosen = r->cw.chosen;
    x.defer = r->cw.defer;
    x.slots = r->cw.slots;
    x.scap = r->cw.scap;
    x.gen = r->cw.gen;
    x.arena = r->cw.arena;

    /* Expired leases first: they are the oldest work. */
    rc = scan_expired(&x);
    if (rc == SQLITE_OK)
        rc = scan_pending(&x);
    if (rc == SQLITE_OK)
        rc = write_deferred(&x);
    if (rc == SQLITE_OK)
        *ndeferred = x.ndefer;
    if (rc != SQLITE_OK || x.nchosen == 0)
        goto done;
    rc = claim_chosen(&x);
    if (rc != SQLITE_OK)
        goto done;

    ms = malloc(x.nchosen * sizeof *ms);
    if (!ms) {
        rc = SQLITE_NOMEM;
        goto done;
    }
    /* In the order chosen, so a predecessor is settled before its successor. */
    for (i = 0; i < x.nchosen; i++) {
        cand *c = &x.cs[x.chosen[i]];
        msg *after = c->after;
        int release = 0, in_batch = 0;
        if (!c->m) {
            c->fate = C_RELEASED; /* changed under us: impossible under the write lock */
            continue;
        }
        if (c->prev >= 0) {
            cand *p = &x.cs[c->prev];
            if (p->fate == C_CHOSEN) {
                after = p->m;
                in_batch = 1;
            } else if (p->fate == C_DEAD) {
                after = p->eff_after; /* a dead row holds nothing back */
                in_batch = p->eff_in_batch;
            } else {
                release = 1;
            }
        }
        c->eff_after = after;
        c->eff_in_batch = in_batch;
        if (c->m->outcome == OUT_DEAD || release) {
            if (release) {
                c->m->outcome = OUT_RELEASE;
                free(c->m->result);
                c->m->result = safe_text("held back: its predecessor was not claimed", 42);
            }
            rc = write_mark(r, c->m, now);
            if (c->m->outcome == OUT_DEAD)
                (*ndead)++;
            c->fate = release ? C_RELEASED : C_DEAD;
            /* Counted and freed by unit_done. */
            c->m->next = *settled;
            *settled = c->m;
            c->m = NULL;
            if (rc != SQLITE_OK)
                goto done;
            continue;
        }
        if (after && !r->s.idempotent) {
            c->m->behind = 1;
            if (in_batch)
                after->key_next = c->m;
            else
                c->m->chain_after = after; /* linked after the commit */
        }
        ms[nm++] = c->m;
    }
    rc = SQLITE_OK;
done:
    if (rc != SQLITE_OK) {
        for (i = 0; i < x.nchosen && x.cs; i++)
            msg_free(x.cs[x.chosen[i]].m);
        free(ms);
        ms = NULL;
        nm = 0;
    }
    r->cw.arena = x.arena;
    arena_reset(&r->cw.arena);
    *out = ms;
    *nout = nm;
    return rc;
}

/* ------------------------------------------------------------------ */
/* sending */

static void on_wait_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    wait_group *g = data;
    outbox_relay *r = g->r;
    char why[128];
    long long acked = -1;
    size_t i;

    (void)conn;
    if (status == 0 && reply && reply->type == REDIS_REPLY_INTEGER)
        acked = reply->integer;
    if (r && acked < (long long)r->s.wait_replicas) {
        if (status != 0)
            snprintf(why, sizeof why, "WAIT: %s", outbox_strerror(status));
        else if (reply && reply->type == REDIS_REPLY_ERROR)
            snprintf(why, sizeof why, "WAIT: %.100s", reply->str);
        else
            snprintf(why, sizeof why, "WAIT: %lld of %u replicas acknowledged", acked, r->s.wait_replicas);
    }
    for (i = 0; i < g->n; i++) {
        msg *m = g->msgs[i];
        if (!m || m->state != MSG_WAITING)
            continue;
        r->awaiting--;
        if (acked >= (long long)r->s.wait_replicas)
            queue_mark(r, m, OUT_PUBLISHED, m->result, strlen(m->result));
        else if (status != 0)
            queue_mark(r, m, OUT_RELEASE, why, strlen(why));
        else
            queue_mark(r, m, OUT_RETRY, why, strlen(why));
    }
    free(g->msgs);
    free(g);
    if (r)
        maybe_finish_stop(r);
}

static void flush_group(outbox_relay *r, wait_group *g)
{
    char timeout[24], n[16];
    const char *argv[3];
    size_t lens[3];
    size_t i;

    if (!g)
        return;
    snprintf(n, sizeof n, "%u", r->s.wait_replicas);
    snprintf(timeout, sizeof timeout, "%llu", (unsigned long long)r->s.wait_timeout_ms);
    argv[0] = "WAIT";
    argv[1] = n;
    argv[2] = timeout;
    for (i = 0; i < 3; i++)
        lens[i] = strlen(argv[i]);
    if (!redis_conn(r) ||
        outbox__redis_command_argv(redis_conn(r), 3, argv, lens, r->s.wait_timeout_ms + r->s.reply_timeout_ms,
                                   on_wait_reply, g) != 0) {
        /* The connection is gone: the XADD callbacks release their messages;
         * nobody waits for this group. */
        for (i = 0; i < g->n; i++)
            if (g->msgs[i])
                g->msgs[i]->group = NULL;
        free(g->msgs);
        free(g);
    }
}

/* A message whose outcome is decided without its group's WAIT leaves the
 * group: it may be marked and freed before the WAIT reply comes. */
static void leave_group(msg *m)
{
    wait_group *g = m->group;
    size_t i;
    if (!g)
        return;
    for (i = 0; i < g->n; i++)
        if (g->msgs[i] == m) {
            g->msgs[i] = NULL;
            break;
        }
    m->group = NULL;
}

static void on_xadd_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    msg *m = data;
    outbox_relay *r = m->r;
    wait_group *grp = NULL;

    (void)conn;
    if (status != 0 || !reply) {
        const char *why = status ? outbox_strerror(status) : "no reply";
        r->awaiting--;
        /* The outcome is unknown: it may be appended, it may not. Retrying
         * risks a duplicate, never a loss. */
        release_chain(r, m, "held back: connection lost");
        leave_group(m);
        queue_mark(r, m, OUT_RELEASE, why, strlen(why));
    } else if (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS) {
        free(m->result);
        m->result = safe_text(reply->str, reply->len);
        if (m->group) {
            m->state = MSG_WAITING; /* counted in awaiting until WAIT answers */
        } else {
            r->awaiting--;
            queue_mark(r, m, OUT_PUBLISHED, reply->str, reply->len);
        }
        /* The next message of the key may go now: this one is appended. */
        if (m->key_next) {
            msg *n = m->key_next;
            m->key_next = NULL;
            if (r->state == R_RUNNING && redis_conn(r)) {
                send_msg(r, n, &grp);
                flush_group(r, grp);
            } else {
                release_chain(r, n, "held back: relay stopping");
                queue_mark(r, n, OUT_RELEASE, "held back: relay stopping", 25);
            }
        }
    } else {
        char buf[256];
        if (reply->type == REDIS_REPLY_ERROR)
            snprintf(buf, sizeof buf, "%.*s", (int)(reply->len < 200 ? reply->len : 200), reply->str);
        else
            snprintf(buf, sizeof buf, "unexpected XADD reply type %d", reply->type);
        r->awaiting--;
        leave_group(m);
        /* A later message of this key must not be appended before this one. */
        release_chain(r, m, "held back: an earlier message of its key failed");
        queue_mark(r, m, OUT_RETRY, buf, strlen(buf));
    }
    maybe_finish_stop(r);
}

static void send_msg(outbox_relay *r, msg *m, wait_group **grp)
{
    int e = outbox__redis_command_raw(redis_conn(r), m->cmd, m->cmdlen, 0, on_xadd_reply, m);
    if (e != 0) {
        release_chain(r, m, "held back: connection lost");
        queue_mark(r, m, OUT_RELEASE, outbox_strerror(e), strlen(outbox_strerror(e)));
        return;
    }
    free(m->cmd);
    m->cmd = NULL;
    m->state = MSG_SENT;
    r->awaiting++;
    if (r->s.wait_replicas) {
        wait_group *g = *grp;
        if (!g) {
            g = calloc(1, sizeof *g);
            if (!g)
                return; /* published without WAIT would break the promise: fall back below */
            g->r = r;
            *grp = g;
        }
        if (g->n == g->cap) {
            size_t nc = g->cap ? g->cap * 2 : 64;
            msg **nm = realloc(g->msgs, nc * sizeof *nm);
            if (!nm)
                return;
            g->msgs = nm;
            g->cap = nc;
        }
        g->msgs[g->n++] = m;
        m->group = g;
    }
}

/* ------------------------------------------------------------------ */
/* idempotent publishing: one script call per stream per batch */

typedef struct idem_call {
    outbox_relay *r;
    size_t n;
    msg *msgs[]; /* in seq order */
} idem_call;

static void load_idem_script(outbox_relay *r);

static void on_idem_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    idem_call *call = data;
    outbox_relay *r = call->r;
    size_t i;
    (void)conn;
    r->awaiting -= call->n;
    if (status != 0 || !reply) {
        const char *why = status ? outbox_strerror(status) : "no reply";
        for (i = 0; i < call->n; i++)
            queue_mark(r, call->msgs[i], OUT_RELEASE, why, strlen(why));
    } else if (reply->type == REDIS_REPLY_ERROR) {
        /* The whole call failed before appending anything (a script error
         * aborts at once; OOM refuses the call). NOSCRIPT is not the
         * messages' fault: load the script again and release them. */
        int noscript = reply->len >= 8 && memcmp(reply->str, "NOSCRIPT", 8) == 0;
        /* Only the first NOSCRIPT reloads: the calls sent before it fail
         * too, but their replies all come before the reload's, while the
         * sha is empty (calls sent meanwhile carry the whole script). */
        if (noscript && r->idem_sha[0] && redis_conn(r))
            load_idem_script(r);
        else if (noscript)
            r->idem_sha[0] = '\0';
        for (i = 0; i < call->n; i++)
            queue_mark(r, call->msgs[i], noscript ? OUT_RELEASE : OUT_RETRY, reply->str, reply->len);
    } else if (reply->type != REDIS_REPLY_ARRAY || reply->elements != call->n) {
        static const char bad[] = "unexpected reply from the publish script";
        for (i = 0; i < call->n; i++)
            queue_mark(r, call->msgs[i], OUT_RETRY, bad, sizeof bad - 1);
    } else {
        for (i = 0; i < call->n; i++) {
            const char *text;
            size_t len;
            msg *m = call->msgs[i];
            switch (outbox__idem_element(reply->element[i], &text, &len)) {
            case OUTBOX_IDEM_DUPLICATE:
                r->duplicates_total++;
                LOG(r, OUTBOX_LOG_INFO, "msg=\"duplicate publish suppressed\" id=%s entry=%.*s", m->id, (int)len,
                    text);
                /* It is in the stream. */
                queue_mark(r, m, OUT_PUBLISHED, text, len);
                break;
            case OUTBOX_IDEM_APPENDED:
                queue_mark(r, m, OUT_PUBLISHED, text, len);
                break;
            default:
                if (len >= 8 && memcmp(text, "HELDBACK", 8) == 0) {
                    r->held_back_total++;
                    queue_mark(r, m, OUT_RELEASE, text, len);
                } else {
                    queue_mark(r, m, OUT_RETRY, text, len);
                }
                break;
            }
        }
    }
    free(call);
    maybe_finish_stop(r);
}

static void send_idem(outbox_relay *r, msg **ms, size_t n)
{
    unsigned char *done = calloc(n ? n : 1, 1);
    outbox__idem_msg *im = malloc((n ? n : 1) * sizeof *im);
    size_t i, j;

    for (i = 0; i < n; i++) {
        idem_call *call;
        size_t cnt = 0;
        char stream[400], *cmd = NULL;
        long len;
        int e;
        if (done && done[i])
            continue;
        call = malloc(sizeof *call + (n - i) * sizeof(msg *));
        if (!call || !done || !im) {
            free(call);
            for (j = i; j < n; j++)
                if (!done || !done[j])
                    queue_mark(r, ms[j], OUT_RELEASE, "out of memory", 13);
            break;
        }
        for (j = i; j < n; j++)
            if (!done[j] && strcmp(ms[j]->topic, ms[i]->topic) == 0) {
                done[j] = 1;
                call->msgs[cnt] = ms[j];
                im[cnt].id = ms[j]->id;
                im[cnt].replay_count = ms[j]->replay_count;
                im[cnt].env = ms[j]->env;
                im[cnt].envlen = ms[j]->envlen;
                cnt++;
            }
        call->r = r;
        call->n = cnt;
        snprintf(stream, sizeof stream, "%s%s", r->stream_prefix, ms[i]->topic);
        len = outbox__idem_format(&cmd, r->idem_sha[0] ? r->idem_sha : NULL, r->stream_prefix, stream,
                                  r->s.idempotent_retention_ms, r->s.maxlen, im, cnt);
        e = len < 0 ? OUTBOX_ENOMEM
                    : outbox__redis_command_raw(redis_conn(r), cmd, (size_t)len, 0, on_idem_reply, call);
        free(cmd);
        if (e != 0) {
            for (j = 0; j < cnt; j++)
                queue_mark(r, call->msgs[j], OUT_RELEASE, outbox_strerror(e), strlen(outbox_strerror(e)));
            free(call);
            continue;
        }
        for (j = 0; j < cnt; j++) {
            call->msgs[j]->state = MSG_SENT;
            free(call->msgs[j]->env);
            call->msgs[j]->env = NULL;
        }
        r->awaiting += cnt;
    }
    free(done);
    free(im);
}

static void on_idem_loaded(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox_relay *r = data;
    (void)conn;
    if (status == 0 && reply && reply->type == REDIS_REPLY_STRING && reply->len == 40)
        memcpy(r->idem_sha, reply->str, 41);
}

static void load_idem_script(outbox_relay *r)
{
    const char *argv[3] = {"SCRIPT", "LOAD", outbox__idem_lua};
    size_t lens[3] = {6, 4, strlen(outbox__idem_lua)};
    r->idem_sha[0] = '\0';
    if (redis_conn(r))
        outbox__redis_command_argv(redis_conn(r), 3, argv, lens, 0, on_idem_loaded, r);
}

/* ------------------------------------------------------------------ */
/* the unit of work */

static void arm_scan(outbox_relay *r, uint64_t delay)
{
    if (r->state != R_RUNNING)
        return;
    if (delay > r->s.scan_interval_ms)
        delay = r->s.scan_interval_ms;
    uv_timer_start(&r->scan_timer, on_scan, delay, 0);
}

/* After a claim that found less than it wanted: sleep until the next row
 * becomes due or the next foreign lease expires, at most scan_interval. */
static void arm_next_due(outbox_relay *r, int64_t now)
{
    int64_t due, lease, next;
    sqlite3_bind_int64(r->q_next_due, 1, now);
    sqlite3_bind_int64(r->q_next_lease, 1, now);
    /* INT64_MAX: none. */
    step_int(r->q_next_due, INT64_MAX, &due);
    step_int(r->q_next_lease, INT64_MAX, &lease);
    next = due < lease ? due : lease;
    if (next == INT64_MAX || next - now > (int64_t)r->s.scan_interval_ms)
        arm_scan(r, r->s.scan_interval_ms);
    else
        arm_scan(r, next > now ? (uint64_t)(next - now) + 1 : 1);
}

static void check_drained(outbox_relay *r, int64_t now)
{
    int rc;
    if (!r->s.drain || r->drained_signalled || r->state != R_RUNNING || r->inflight || r->marks_head)
        return;
    sqlite3_bind_int64(r->q_drain, 1, now);
    rc = sqlite3_step(r->q_drain);
    if (rc == SQLITE_ROW && sqlite3_column_int(r->q_drain, 0) == 0) {
        sqlite3_reset(r->q_drain);
        r->drained_signalled = 1;
        LOG(r, OUTBOX_LOG_INFO, "msg=drained published=%llu dead=%llu", (unsigned long long)r->published_total,
            (unsigned long long)r->dead_total);
        if (r->s.on_drained)
            r->s.on_drained(r, r->s.on_drained_data);
        else
            outbox_relay_stop(r, NULL, NULL);
        return;
    }
    sqlite3_reset(r->q_drain);
}

static void db_busy_retry(outbox_relay *r, int rc, const char *what)
{
    /* Never sleep on the loop thread: try again from a timer. */
    int locked = (rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED;
    /* A lock is held for a transaction's length, usually a few ms: retry
     * every few ms, or a writer committing constantly would push the retries
     * far apart and delay every message by them. Other errors (I/O, disk
     * full) back off further. */
    uint64_t cap = locked ? 8 : 500;
    r->busy_delay_ms = r->busy_delay_ms ? r->busy_delay_ms * 2 : 1;
    if (r->busy_delay_ms > cap)
        r->busy_delay_ms = cap;
    if (locked)
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"database locked, retrying\" during=%s retry_ms=%llu", what,
            (unsigned long long)r->busy_delay_ms);
    else
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"database error, retrying\" during=%s error=\"%s\" retry_ms=%llu", what,
            sqlite3_errstr(rc), (unsigned long long)r->busy_delay_ms);
    uv_timer_start(&r->busy_timer, on_busy_retry, r->busy_delay_ms, 0);
}

static void txn_open(outbox_relay *r, int open)
{
    if (!r->txn_sync_ok)
        return;
    uv_mutex_lock(&r->txn_mutex);
    r->txn_open = open;
    if (!open) {
        __atomic_store_n(&r->yield, 0, __ATOMIC_RELAXED);
        uv_cond_broadcast(&r->txn_cond);
    }
    uv_mutex_unlock(&r->txn_mutex);
}

/*
 * The relay's connection when it meets a lock. Inside a unit (on a worker
 * thread) it waits in naps of 100 us, up to UNIT_BUSY_NS: another
 * connection's commit, even with an fsync, usually ends well within that,
 * and the unit then starts right after it. Retrying from the loop's timer
 * instead (1, 2, 4, 8 ms) let a writer committing every millisecond push
 * each unit back by up to 15 ms, so messages waited that long (latency
 * p99 of 25-60 ms with a synchronous=FULL writer). Anywhere else (the loop
 * thread never waits on a lock) it gives up at once.
 */
#define UNIT_BUSY_NS 20000000u

static int unit_busy(void *arg, int count)
{
    static __thread uint64_t start;
    outbox_relay *r = arg;
    struct timespec nap = {0, 100000};
    uint64_t now;
    if (!__atomic_load_n(&r->in_unit, __ATOMIC_RELAXED))
        return 0;
    now = uv_hrtime();
    if (count == 0)
        start = now;
    if (now - start >= UNIT_BUSY_NS)
        return 0;
    nanosleep(&nap, NULL);
    return 1;
}

/* An attached connection waits for the lock (attach_busy): the unit ends
 * soon, but only after YIELD_AFTER_NS of marks and with a claim of
 * YIELD_CLAIM rows, so that a writer committing every millisecond cannot
 * stop the relay (with 32 rows, at 10k msg/s in-process, it fell behind for
 * good: each unit then also waits for the writer's fsync and a lock gap). */
#define YIELD_AFTER_NS 1000000u
#define YIELD_CLAIM 128

static int should_yield(outbox_relay *r)
{
    return __atomic_load_n(&r->yield, __ATOMIC_RELAXED) != 0;
}

/*
 * One unit of work is one SQLite transaction, run on a libuv worker thread so
 * that the loop keeps turning (Redis replies, sends, timers, /metrics) while
 * it runs: it writes the marks handed to it, then claims the next batch if
 * the window has room. One runs at a time. While it runs, the loop thread
 * does not touch the relay's connection, the in-flight seq set or the key
 * map (it changes them only in unit_done), and the messages handed over are
 * finished ones it no longer changes; the worker logs nothing and counts
 * nothing (unit_done does, from what write_mark recorded).
 */
static void unit_txn(outbox_relay *r)
{
    struct unit *u = &r->unit;
    msg *m;
    size_t i;
    int rc;

    __atomic_store_n(&r->in_unit, 1, __ATOMIC_RELAXED);
    rc = sqlite3_exec(r->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    u->t0 = uv_hrtime(); /* the budget counts from the lock */
    if (rc != SQLITE_OK) {
        u->rc = rc;
        u->what = "begin";
        return;
    }
    txn_open(r, 1);
    for (m = u->marks, i = 0; i < u->nmarks; m = m->next, i++) {
        rc = write_mark(r, m, u->now);
        if (rc != SQLITE_OK) {
            u->what = "mark";
            goto rollback;
        }
        /* Half the budget for marks when a claim follows, so that XADDs
         * keep flowing while marks pile up; the rest go back to the queue
         * (unit_done). */
        if (i + 1 < u->nmarks && !u->stopping && (i & 15) == 15 &&
            uv_hrtime() - u->t0 > (should_yield(r) ? YIELD_AFTER_NS
                                                     : u->want_claim ? TXN_BUDGET_NS / 2 : TXN_BUDGET_NS)) {
            u->nwritten = i + 1;
            break;
        }
    }
    if (u->want_claim && u->nwritten) {
        /* The marks not written stay in the window. */
        uint64_t occupied = u->held + u->rest + (u->nmarks - u->nwritten);
        unsigned room = occupied < r->s.inflight ? (unsigned)(r->s.inflight - occupied) : 0;
        if (u->want > room)
            u->want = room;
        u->want_claim = u->want > 0;
    }
    if (u->want_claim) {
        /* As many rows as the rest of the budget fits, from the cost of a
         * claimed row in recent claims; at least 32. */
        uint64_t spent = uv_hrtime() - u->t0;
        uint64_t fit = spent < TXN_BUDGET_NS ? (TXN_BUDGET_NS - spent) / (r->claim_row_ns ? r->claim_row_ns : 1) : 0;
        if (should_yield(r))
            fit = YIELD_CLAIM; /* an application's writer waits: a bounded claim, so the window keeps moving */
        else if (fit < 32)
            fit = 32;
        if (u->want > fit)
            u->want = (unsigned)fit;
        u->t_claim0 = uv_hrtime();
        rc = claim(r, u->want, u->now, &u->claimed, &u->nclaimed, &u->ndead, &u->settled, &u->ndeferred);
        if (rc != SQLITE_OK) {
            u->what = "claim";
            goto rollback;
        }
    }
    rc = sqlite3_exec(r->db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        u->what = u->nmarks ? "mark" : "claim";
        goto rollback;
    }
    txn_open(r, 0);
    u->rc = SQLITE_OK;
    u->t_end = uv_hrtime();
    if (u->nclaimed + u->ndead >= 32) {
        uint64_t per = (u->t_end - u->t_claim0) / (u->nclaimed + u->ndead);
        r->claim_row_ns = r->claim_row_ns ? (r->claim_row_ns * 3 + per) / 4 : per;
    }
    return;

rollback:
    u->rc = rc;
    sqlite3_exec(r->db, "ROLLBACK", NULL, NULL, NULL);
    txn_open(r, 0);
    for (i = 0; i < u->nclaimed; i++)
        msg_free(u->claimed[i]);
    free(u->claimed);
    u->claimed = NULL;
    u->nclaimed = u->ndead = u->ndeferred = 0;
    while ((m = u->settled) != NULL) {
        u->settled = m->next;
        msg_free(m);
    }
}

static void unit_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    unit_txn(r);
    __atomic_store_n(&r->in_unit, 0, __ATOMIC_RELAXED);
}

/* Puts a detached list of marks (first to its end) back at the head of the
 * queue, ahead of those queued since. */
static void marks_requeue(outbox_relay *r, msg *first)
{
    msg *end = first;
    if (!first)
        return;
    while (end->next)
        end = end->next;
    end->next = r->marks_head;
    if (!r->marks_head)
        r->marks_tail = end;
    r->marks_head = first;
}

/* Where a message claimed behind one of an earlier batch stands now: the
 * worker chained it tentatively; that one may have been answered since. */
static void settle_chain(outbox_relay *r, msg *c)
{
    msg *a = c->chain_after;
    c->chain_after = NULL;
    if (a->state == MSG_HELD || a->state == MSG_SENT) {
        while (a->key_next)
            a = a->key_next;
        a->key_next = c; /* sent once that one is accepted */
        return;
    }
    c->behind = 0;
    if (a->state == MSG_WAITING || (a->state == MSG_DONE && a->outcome == OUT_PUBLISHED))
        return; /* appended already: it may go now */
    /* That one failed or was handed back: this one must not overtake it. */
    release_chain(r, c, "held back: an earlier message of its key failed");
    queue_mark(r, c, OUT_RELEASE, "held back: an earlier message of its key failed", 47);
}

static void unit_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    struct unit *u = &r->unit;
    msg *m, **send;
    size_t i, nsend = 0;
    int pages;
    wait_group *grp = NULL;

    (void)status;
    r->unit_running = 0;
    pages = r->own_wal_pages;
    r->own_wal_pages = 0;
    if (pages)
        maybe_checkpoint(r, pages);
    if (u->rc != SQLITE_OK) {
        /* Nothing was written: the marks go back to the head of the queue. */
        marks_requeue(r, u->marks);
        u->marks = NULL;
        if (r->state == R_STOPPING)
            r->stop_flush_failures++;
        db_busy_retry(r, u->rc, u->what);
        maybe_finish_stop(r);
        return;
    }
    r->busy_delay_ms = 0;
    r->stop_flush_failures = 0;
    if (u->nwritten) {
        /* The budget ran out: the marks not written go back to the queue. */
        msg *last = u->marks;
        for (i = 1; i < u->nwritten; i++)
            last = last->next;
        marks_requeue(r, last->next);
        last->next = NULL;
        u->nmarks = u->nwritten;
    }
    if (u->want_claim && u->nclaimed + u->ndead > 0) {
        /* Claim batch size and the whole transaction's time (marks included). */
        r->claims_total++;
        outbox__hist_observe(&r->h_claim_size, (double)(u->nclaimed + u->ndead));
        outbox__hist_observe(&r->h_claim_secs, (double)(u->t_end - u->t_claim0) / 1e9);
    }
    /* Leave the write lock free for a while before the next transaction:
     * back to back, the relay would hold it nearly all the time while
     * draining, and the application's writers (whose busy handler retries
     * at intervals) and other relays would hardly ever get it. At least
     * 1 ms, or a quarter of this transaction's time. Not after a unit
     * shorter than 1 ms while an application connection is attached: its
     * busy handler wakes the moment a unit ends, so it needs no gap, and the
     * gap (a loop timer, 1-2 ms) was the largest part of an in-process
     * message's latency (docs/BENCHMARKS.md). */
    {
        uint64_t ns = u->t_end - u->t0, ms = ns / 4000000;
        if (!ms && (ns >= 1000000 || __atomic_load_n(&r->attached, __ATOMIC_RELAXED) == 0))
            ms = 1;
        r->lock_free_until = uv_now(r->loop) + ms;
    }

    /* The claimed messages join the window first: a chain may be settled
     * against a message whose mark was just written. */
    send = malloc((u->nclaimed ? u->nclaimed : 1) * sizeof *send);
    for (i = 0; i < u->nclaimed; i++) {
        msg *c = u->claimed[i];
        seqset_add(r, c->seq);
        r->inflight++;
        if (c->took_over)
            LOG(r, OUTBOX_LOG_INFO, "msg=\"took over an expired lease\" id=%s seq=%lld token=%lld", c->id,
                (long long)c->seq, (long long)c->token);
        if (c->chain_after)
            settle_chain(r, c);
        if (c->klen)
            keymap_put(r, c);
    }
    /* Committed: the marked messages leave the window. */
    while ((m = u->marks) != NULL) {
        u->marks = m->next;
        mark_account(r, m);
        r->inflight--;
        msg_retire(r, m);
    }
    if (u->nmarks)
        LOG(r, OUTBOX_LOG_DEBUG, "msg=marked count=%zu", u->nmarks);
    /* Rows dead-lettered (or handed back) by the claim itself. */
    while ((m = u->settled) != NULL) {
        u->settled = m->next;
        mark_account(r, m);
        msg_free(m);
    }
    /* Send every claimed message that is not held behind an earlier one of
     * its key; those go when their predecessor is accepted. */
    for (i = 0; i < u->nclaimed; i++) {
        msg *c = u->claimed[i];
        if (c->state != MSG_HELD || c->behind)
            continue; /* handed back by settle_chain, or chained */
        if (!redis_conn(r)) {
            release_chain(r, c, "held back: connection lost");
            queue_mark(r, c, OUT_RELEASE, "connection lost", 15);
        } else if (send) {
            send[nsend++] = c;
        } else {
            release_chain(r, c, "held back: out of memory");
            queue_mark(r, c, OUT_RELEASE, "out of memory", 13);
        }
    }
    if (r->s.idempotent)
        send_idem(r, send, nsend);
    else
        for (i = 0; i < nsend; i++)
            send_msg(r, send[i], &grp);
    flush_group(r, grp);
    free(send);
    free(u->claimed);
    u->claimed = NULL;

    if (wal_watch_resume(r) || r->dv_pending) {
        /* Another connection may have written its commit while the watch
         * was off (see wal_look). Looked for again and again after a unit
         * that did something, or while other connections commit (one did
         * in the last 2 s): an idle relay keeps its one look per scan. */
        if (r->dv_pending || u->nmarks || u->nclaimed || u->ndead ||
            uv_now(r->loop) - r->foreign_commit_ms < 2000)
            wal_look(r);
        else
            data_version_changed(r);
        r->dv_pending = 0;
    }
    /* Claim again at once after a full claim, or after one that moved held
     * rows out of the way (defer): the next walks reach rows behind them. */
    r->last_claim_full = u->want_claim && ((u->nclaimed + u->ndead) >= u->want || u->ndeferred > 0);
    if (r->last_claim_full || r->marks_head || r->unit_again)
        schedule_work(r);
    else if (r->state == R_RUNNING) {
        arm_next_due(r, u->now);
        check_drained(r, u->now);
    }
    r->unit_again = 0;
    maybe_finish_stop(r);
}

static void do_work(outbox_relay *r)
{
    struct unit *u = &r->unit;
    msg *m, *last = NULL;
    uint64_t held;
    unsigned want = 0;
    int want_claim;

    if (r->unit_running) {
        r->unit_again = 1;
        return;
    }
    if (uv_is_active((uv_handle_t *)&r->busy_timer) || r->state == R_STOPPED || r->state == R_CREATED)
        return;
    /* The marks written below leave the window in this same transaction,
     * so their room can be claimed now; otherwise a window emptied by one
     * batch of marks would wait for the scan timer. */
    held = r->inflight;
    for (m = r->marks_head; m; m = m->next)
        held--;
    want_claim = r->state == R_RUNNING && redis_conn(r) && held < r->s.inflight;
    if (want_claim) {
        want = r->s.inflight - (unsigned)held;
        if (want > r->s.batch)
            want = r->s.batch;
    }
    if (!r->marks_head && !want_claim) {
        maybe_finish_stop(r);
        return;
    }
    memset(u, 0, sizeof *u);
    u->now = outbox_now_ms();
    /* At most MARKS_PER_TXN marks per transaction, so one unit of work stays
     * short; the rest go in the next one. They are detached: replies keep
     * queueing marks while the unit runs. */
    u->marks = r->marks_head;
    for (m = r->marks_head; m && u->nmarks < MARKS_PER_TXN; m = m->next) {
        last = m;
        u->nmarks++;
    }
    if (last) {
        r->marks_head = last->next;
        last->next = NULL;
        if (!r->marks_head)
            r->marks_tail = NULL;
    } else {
        u->marks = NULL;
    }
    /* Marks left in the queue stay in the window: claim only the room left
     * with them (the worker lowers it again if it writes fewer marks). */
    for (m = r->marks_head; m; m = m->next)
        u->rest++;
    u->held = held;
    if (want_claim) {
        uint64_t occupied = held + u->rest;
        want = occupied < r->s.inflight ? (unsigned)(r->s.inflight - occupied) : 0;
        if (want > r->s.batch)
            want = r->s.batch;
        want_claim = want > 0;
    }
    u->want_claim = want_claim;
    u->want = want;
    u->stopping = r->state != R_RUNNING;
    r->unit_work.data = r;
    wal_watch_pause(r);
    if (uv_queue_work(r->loop, &r->unit_work, unit_run, unit_done) != 0) {
        /* Cannot happen with a valid loop; put the marks back and retry. */
        marks_requeue(r, u->marks);
        u->marks = NULL;
        db_busy_retry(r, SQLITE_ERROR, "queue");
        return;
    }
    r->unit_running = 1;
}

static void on_kick(uv_timer_t *t)
{
    do_work(t->data);
}

static void schedule_work(outbox_relay *r)
{
    if (r->state == R_STOPPED || r->state == R_CREATED)
        return;
    if (!uv_is_active((uv_handle_t *)&r->kick_timer) && !uv_is_active((uv_handle_t *)&r->busy_timer)) {
        uint64_t now = uv_now(r->loop);
        uv_timer_start(&r->kick_timer, on_kick, r->lock_free_until > now ? r->lock_free_until - now : 0, 0);
    }
}

static void on_scan(uv_timer_t *t)
{
    schedule_work(t->data);
}

static void on_busy_retry(uv_timer_t *t)
{
    do_work(t->data);
}

/* ------------------------------------------------------------------ */
/* wake-ups and checkpoints */

static void ckpt_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    if (!r->ckpt_db) {
        if (sqlite3_open_v2(r->db_path, &r->ckpt_db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) !=
            SQLITE_OK) {
            sqlite3_close_v2(r->ckpt_db);
            r->ckpt_db = NULL;
            return;
        }
        sqlite3_busy_timeout(r->ckpt_db, 0);
    }
    /* A connection that has not read anything has not opened the WAL yet,
     * and a checkpoint through it silently does nothing (SQLite 3.40
     * returns SQLITE_OK with a log size of -1): read first. */
    sqlite3_exec(r->ckpt_db, "SELECT count(*) FROM sqlite_master", NULL, NULL, NULL);
    /* PASSIVE never waits for readers or writers, but under a steady stream
     * of commits it never catches up with the end of the WAL either, and the
     * WAL is only rewound once a checkpoint did. So when the WAL has grown
     * large, RESTART: it waits (here, off the loop, at most 200 ms) for a
     * moment without a writer, which the relay leaves between transactions,
     * and lets the next writer start the WAL from its beginning again. */
    if (r->ckpt_restart) {
        sqlite3_busy_timeout(r->ckpt_db, 200);
        if (sqlite3_wal_checkpoint_v2(r->ckpt_db, NULL, SQLITE_CHECKPOINT_RESTART, NULL, NULL) == SQLITE_OK) {
            sqlite3_busy_timeout(r->ckpt_db, 0);
            return;
        }
        sqlite3_busy_timeout(r->ckpt_db, 0);
    }
    sqlite3_wal_checkpoint_v2(r->ckpt_db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
}

static void ckpt_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    (void)status;
    r->ckpt_running = 0;
    maybe_finish_stop(r);
}

/* While the relay drains a backlog (its last claim was full), checkpoints
 * start when the WAL holds 8000 pages (32 MiB of 4 KiB pages): a claim and
 * the mark that follows it touch the same pages, and the less often they are
 * copied back, the fewer copies (1000 pages cost about a sixth more CPU per
 * message in a drain). Otherwise from 1000 pages, SQLite's own default: a
 * checkpoint ends with an fsync of the database file, and 32 MiB of it
 * stalled a synchronous=FULL writer's commits (their fsyncs) for 20-30 ms. */
static void maybe_checkpoint(outbox_relay *r, int pages)
{
    if (pages < (r->last_claim_full ? 8000 : 1000) || r->ckpt_running || r->state != R_RUNNING)
        return;
    __atomic_store_n(&r->ckpt_pages, 0, __ATOMIC_RELAXED);
    r->ckpt_restart = pages >= 16000; /* about 64 MiB of WAL with 4 KiB pages */
    r->ckpt_work.data = r;
    if (uv_queue_work(r->loop, &r->ckpt_work, ckpt_run, ckpt_done) == 0)
        r->ckpt_running = 1;
}

/* Runs on the thread that committed (a unit's worker, or the loop for
 * retention): the committer starts the checkpoint afterwards. */
static int own_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    outbox_relay *r = arg;
    (void)db;
    (void)name;
    r->own_wal_pages = pages;
    return SQLITE_OK;
}

/* Runs on the application's thread, right after its commit. */
static int attach_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    outbox_relay *r = arg;
    (void)db;
    (void)name;
    __atomic_store_n(&r->ckpt_pages, pages, __ATOMIC_RELAXED);
    if (__atomic_load_n(&r->wake_ready, __ATOMIC_ACQUIRE)) /* attached before start: nothing to wake yet */
        uv_async_send(&r->wake_async);
    return SQLITE_OK;
}

static void on_wake(uv_async_t *a)
{
    outbox_relay *r = a->data;
    int pages = __atomic_load_n(&r->ckpt_pages, __ATOMIC_RELAXED);
    if (pages)
        maybe_checkpoint(r, pages);
    schedule_work(r);
}

/* Schedules work and returns 1 if another connection committed since the
 * last look. Our own commits do not change data_version. */
static int data_version_changed(outbox_relay *r)
{
    int64_t v = 0;
    if (r->unit_running) {
        /* The connection is the unit's: look when it is done (the re-check
         * timer keeps going meanwhile). */
        r->dv_pending = 1;
        return 0;
    }
    step_int(r->q_data_version, 0, &v);
    if (v == r->data_version)
        return 0;
    r->data_version = v;
    r->foreign_commit_ms = uv_now(r->loop);
    schedule_work(r);
    return 1;
}

/*
 * The relay's own commits write to the WAL too, and each write would wake
 * the loop through the watch (and start the re-checks) for nothing: the
 * watch is off while a unit runs. Commits of others in the meantime are
 * caught by a data_version check when it is back on (wal_watch_resume
 * returns 1), so none is missed.
 */
static void wal_watch_pause(outbox_relay *r)
{
    if (!r->wal_watch_active)
        return;
    uv_fs_event_stop(&r->wal_watch);
    r->wal_watch_active = 0;
}

static int wal_watch_resume(outbox_relay *r)
{
    if (r->wal_watch_active || !r->wal_path || r->state != R_RUNNING)
        return 0;
    if (uv_fs_event_start(&r->wal_watch, on_wal_change, r->wal_path, 0) == 0)
        r->wal_watch_active = 1;
    return 1;
}

static void on_wal_recheck(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    if (r->state != R_RUNNING || data_version_changed(r) || r->wal_rechecks >= 8)
        return;
    r->wal_rechecks++;
    uv_timer_start(&r->wal_timer, on_wal_recheck, 1u << r->wal_rechecks, 0);
}

/*
 * After a change to the WAL file, or after a unit (the watch was off while
 * it ran): has another connection committed? A commit writes its frames to
 * the WAL, syncs them, and only then publishes them in the wal-index, which
 * is what data_version reads: the last event of another connection's commit
 * comes before the commit is visible, and a writer that took the lock right
 * after the unit's COMMIT wrote its frames before the watch was back on (no
 * event at all). Unless data_version moved, look again shortly (1, 2, 4 ...
 * 256 ms); without these looks such a commit waited for the scan timer.
 */
static void wal_look(outbox_relay *r)
{
    if (r->state != R_RUNNING || data_version_changed(r))
        return;
    r->wal_rechecks = 0;
    uv_timer_start(&r->wal_timer, on_wal_recheck, 1, 0);
}

static void on_wal_change(uv_fs_event_t *h, const char *filename, int events, int status)
{
    (void)filename;
    (void)events;
    if (status == 0)
        wal_look(h->data);
}

void outbox_relay_wake(outbox_relay *r)
{
    if (r && __atomic_load_n(&r->wake_ready, __ATOMIC_ACQUIRE))
        uv_async_send(&r->wake_async);
}

/*
 * The attached connection's busy handler, in place of its busy timeout (same
 * total wait). SQLite's own handler sleeps 1, 2, 5, 10, 15, 20, 25 ms ...
 * between tries, so a writer that met the relay's transaction usually slept
 * well past its end, and on the application's loop thread that sleep held up
 * everything, the relay's Redis traffic too. This one wakes the moment the
 * relay's transaction ends; a lock held by anyone else is polled every ms.
 */
static int attach_busy(void *arg, int count)
{
    static __thread uint64_t start;
    outbox_relay *r = arg;
    uint64_t now = uv_hrtime(), left;
    if (count == 0)
        start = now;
    if (now - start >= (uint64_t)r->attach_busy_ms * 1000000u)
        return 0;
    left = (uint64_t)r->attach_busy_ms * 1000000u - (now - start);
    uv_mutex_lock(&r->txn_mutex);
    if (r->txn_open) {
        /* Ask the unit to commit what it has and let go. */
        __atomic_store_n(&r->yield, 1, __ATOMIC_RELAXED);
        uv_cond_timedwait(&r->txn_cond, &r->txn_mutex, left < 5000000u ? left : 5000000u);
        uv_mutex_unlock(&r->txn_mutex);
        return 1;
    }
    uv_mutex_unlock(&r->txn_mutex);
    uv_sleep(1);
    return 1;
}

int outbox_relay_attach(outbox_relay *r, sqlite3 *db)
{
    sqlite3_stmt *st = NULL;
    if (!r || !db)
        return OUTBOX_EINVAL;
    sqlite3_wal_hook(db, attach_wal_hook, r);
    r->attach_busy_ms = 0;
    if (sqlite3_prepare_v2(db, "PRAGMA busy_timeout", -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
        r->attach_busy_ms = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    /* A connection that does not wait for locks keeps not waiting. */
    if (r->attach_busy_ms > 0 && r->txn_sync_ok) {
        sqlite3_busy_handler(db, attach_busy, r);
        __atomic_add_fetch(&r->attached, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

void outbox_relay_detach(sqlite3 *db)
{
    outbox_relay *r;
    if (!db)
        return;
    r = sqlite3_wal_hook(db, NULL, NULL);
    if (r && r->attach_busy_ms > 0 && r->txn_sync_ok) {
        sqlite3_busy_timeout(db, r->attach_busy_ms); /* the timeout it had at attach */
        __atomic_sub_fetch(&r->attached, 1, __ATOMIC_RELAXED);
    }
}

/* ------------------------------------------------------------------ */
/* Redis connection */

/* Connected (on_up): claims may go. */
static void on_redis_up(outbox__rconn *rc, void *data)
{
    outbox_relay *r = data;
    (void)rc;
    r->down_since_wall = 0;
    if (r->s.idempotent)
        load_idem_script(r);
    schedule_work(r);
}

/* The connection was lost: every pending reply callback already ran and
 * released its message; rconn reconnects. */
static void on_redis_down(outbox__rconn *rc, int status, void *data)
{
    outbox_relay *r = data;
    (void)rc;
    r->reconnects++;
    r->down_since_wall = uv_now(r->loop);
    LOG(r, OUTBOX_LOG_WARN, "msg=\"in-flight messages released for retry\" err=%s", outbox_err_name(status));
    maybe_finish_stop(r); /* lost while stopping: nothing more to wait for */
}

/* Closes the connection and stops reconnecting, once; the relay's stop
 * waits for it like for a handle. */
static void close_redis(outbox_relay *r)
{
    if (r->rc_state != RC_STARTED)
        return;
    r->rc_state = RC_CLOSING;
    r->handles_open++;
    outbox__rconn_close(&r->rc, on_conn_closed, r);
}

/* ------------------------------------------------------------------ */
/* create / start / stop / destroy */

static const struct {
    size_t off;
    const char *sql;
} statements[] = {
#define STMT(field, sql) {offsetof(outbox_relay, field), sql}
    /* The claim's walks (see scan_pending): columns as add_cand reads them. */
    STMT(q_new, OUTBOX__SQL_NEW),
    STMT(q_cursor, OUTBOX__SQL_CURSOR),
    STMT(q_cursor_set, OUTBOX__SQL_CURSOR_SET),
    STMT(q_top, "SELECT max(seq) FROM outbox"),
    STMT(q_stray, OUTBOX__SQL_STRAY),
    STMT(q_due, OUTBOX__SQL_DUE),
    STMT(q_expired, "SELECT seq, topic, key, lease_token, available_at, created_at FROM outbox "
                    "WHERE state = 1 AND lease_until <= ?1 ORDER BY lease_until LIMIT ?2"),
    STMT(q_key_prev, OUTBOX__SQL_KEY_PREV),
    STMT(q_defer, "UPDATE outbox SET available_at = ?2 WHERE seq = ?1 AND state = 0 AND available_at < ?2"),
    STMT(q_claim, OUTBOX__SQL_CLAIM),
    STMT(q_published, OUTBOX__SQL_PUBLISHED),
    /* A row that goes back to pending is a waiting row: available_at after created_at. */
    STMT(q_failed, "UPDATE outbox SET state = ?4, available_at = max(?5, created_at + 1), last_error = ?6, lease_owner = NULL, "
                   "lease_until = NULL WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"),
    STMT(q_release, "UPDATE outbox SET state = 0, available_at = max(?4, created_at + 1), attempts = max(attempts - 1, 0), "
                    "lease_owner = NULL, lease_until = NULL "
                    "WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"),
    STMT(q_data_version, "PRAGMA data_version"),
    STMT(q_retention, "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE state = 2 "
                      "AND published_at < ?1 ORDER BY published_at LIMIT ?2)"),
    STMT(q_next_due, "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at > created_at "
                     "AND available_at > ?1"),
    STMT(q_next_lease, "SELECT min(lease_until) FROM outbox WHERE state = 1 AND lease_until > ?1"),
    STMT(q_drain, "SELECT EXISTS(SELECT 1 FROM outbox WHERE seq >= coalesce((SELECT new_from FROM outbox_cursor), 0) "
                  "AND state = 0 AND available_at <= created_at) "
                  "OR EXISTS(SELECT 1 FROM outbox WHERE state = 0 AND available_at > created_at AND available_at <= ?1) "
                  "OR EXISTS(SELECT 1 FROM outbox WHERE state = 1)"),
#undef STMT
};

static char *dupstr(const char *s)
{
    return s ? strdup(s) : NULL;
}

static void free_fields(outbox_relay *r)
{
    size_t i;
    if (r->rc_state == RC_INITIALISED)
        outbox__rconn_discard(&r->rc); /* initialised by a start that failed */
    for (i = 0; i < OUTBOX_ARRAY_LEN(statements); i++)
        sqlite3_finalize(*(sqlite3_stmt **)((char *)r + statements[i].off));
    if (r->db) {
        sqlite3_wal_hook(r->db, NULL, NULL);
        sqlite3_close_v2(r->db);
    }
    sqlite3_close_v2(r->ckpt_db);
    sqlite3_close_v2(r->stats_db);
    if (r->txn_sync_ok) {
        uv_cond_destroy(&r->txn_cond);
        uv_mutex_destroy(&r->txn_mutex);
    }
    sqlite3_close_v2(r->dbstat_db);
    outbox__topics_free(&r->topics);
    free(r->waiting_reqs);
    free(r->waiting_paths);
    free(r->metrics_listen);
    outbox__redis_url_free(&r->url);
    free(r->db_path);
    free(r->wal_path);
    free(r->redis_url_text);
    free(r->worker_id);
    free(r->stream_prefix);
    free(r->seqset);
    free(r->keymap);
    free(r->cw.cs);
    free(r->cw.chosen);
    free(r->cw.defer);
    free(r->cw.slots);
    arena_free(r->cw.arena);
    free(r->envbuf);
    free(r);
}

int outbox_relay_create(outbox_relay **out, uv_loop_t *loop, const outbox_relay_settings *s, char *err,
                        size_t errlen)
{
    outbox_relay *r;
    char host[256], wid[300], msgbuf[512];
    int e, tries;
    size_t i;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if ((e = check_settings(s, err, errlen)) != 0)
        return e;
    r = calloc(1, sizeof *r);
    if (!r)
        return OUTBOX_ENOMEM;
    r->loop = loop;
    r->s = *s;
    if (uv_mutex_init(&r->txn_mutex) == 0) {
        if (uv_cond_init(&r->txn_cond) == 0)
            r->txn_sync_ok = 1;
        else
            uv_mutex_destroy(&r->txn_mutex);
    }
    r->log.fn = s->log;
    r->log.data = s->log_data;
    r->log.min_level = s->log_level;
    e = outbox__redis_url_parse(s->redis_url, &r->url, msgbuf, sizeof msgbuf);
    if (e != 0) {
        if (err && errlen)
            snprintf(err, errlen, "redis: %s", msgbuf);
        free_fields(r);
        return e;
    }
    outbox__redis_url_describe(&r->url, r->url_desc, sizeof r->url_desc);
    if (!s->worker_id) {
        if (gethostname(host, sizeof host) != 0)
            strcpy(host, "localhost");
        host[sizeof host - 1] = '\0';
        snprintf(wid, sizeof wid, "%s:%ld", host, (long)getpid());
    } else {
        outbox__strlcpy(wid, s->worker_id, sizeof wid);
    }
    r->db_path = dupstr(s->db_path);
    r->redis_url_text = dupstr(s->redis_url);
    r->worker_id = dupstr(wid);
    r->stream_prefix = dupstr(s->stream_prefix);
    if (!r->db_path || !r->redis_url_text || !r->worker_id || !r->stream_prefix) {
        free_fields(r);
        return OUTBOX_ENOMEM;
    }
    r->s.db_path = r->db_path;
    r->s.redis_url = r->redis_url_text;
    r->s.worker_id = r->worker_id;
    r->s.stream_prefix = r->stream_prefix;
    if (s->metrics_listen) {
        r->metrics_listen = strdup(s->metrics_listen);
        if (!r->metrics_listen) {
            free_fields(r);
            return OUTBOX_ENOMEM;
        }
        r->s.metrics_listen = r->metrics_listen;
    }
    init_metrics(r);

    /* The relay's connection never waits for a lock on the loop thread
     * (only inside a unit: unit_busy), but reading the schema at start-up
     * can meet one: a writer's, or another
     * connection's WAL recovery after a process crashed mid-commit. That is
     * no reason to refuse to start: retry for a bounded while. */
    for (tries = 0;; tries++) {
        e = outbox_db_open(r->db_path, OUTBOX_OPEN_RELAY, &r->db, err, errlen);
        if (e == 0)
            e = outbox_schema_check(r->db, err, errlen);
        if (e == OUTBOX_ENOSCHEMA) {
            int64_t v = 0;
            /* An older schema is migrated; a database without one is refused,
             * so that a mistyped path does not grow a fresh empty outbox. */
            int ve = outbox__sqlite_int(r->db, "PRAGMA user_version", &v);
            if (ve != 0)
                e = ve;
            else if (v > 0)
                e = outbox_schema_apply(r->db, err, errlen);
        }
        if (e != OUTBOX_EBUSY || tries == 200)
            break;
        sqlite3_close_v2(r->db);
        r->db = NULL;
        sqlite3_sleep(10);
    }
    if (e != 0) {
        free_fields(r);
        return e;
    }
    for (i = 0; i < OUTBOX_ARRAY_LEN(statements); i++) {
        sqlite3_stmt **st = (sqlite3_stmt **)((char *)r + statements[i].off);
        if (sqlite3_prepare_v3(r->db, statements[i].sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL) != SQLITE_OK) {
            if (err && errlen)
                snprintf(err, errlen, "cannot prepare a relay statement: %s", sqlite3_errmsg(r->db));
            free_fields(r);
            return OUTBOX_ESQLITE;
        }
    }
    /* Registering a WAL hook turns off auto-checkpoint on this connection:
     * checkpoints run on a worker thread instead of inside our commits. */
    sqlite3_wal_hook(r->db, own_wal_hook, r);
    sqlite3_busy_handler(r->db, unit_busy, r);
    /* A drain touches more pages than the default 2 MiB cache holds (the
     * due and key indexes, the rows being claimed and those being marked):
     * 16 MiB saved a sixth of the relay's CPU per message here. */
    sqlite3_exec(r->db, "PRAGMA cache_size=-16384", NULL, NULL, NULL);
    *out = r;
    return 0;
}

int outbox_relay_start(outbox_relay *r)
{
    char walpath[4200];
    int e;
    char err[300];
    if (!r || r->state != R_CREATED)
        return OUTBOX_ESTATE;
    /* Binding the metrics port (and memory) are the only things that can
     * fail: first, so a failed start leaves nothing to close. */
    if (r->rc_state == RC_NONE) {
        outbox__redis_options o;
        outbox__redis_options_defaults(&o);
        o.connect_timeout_ms = r->s.connect_timeout_ms;
        o.reply_timeout_ms = r->s.reply_timeout_ms;
        o.client_name = "outbox-relay";
        if (outbox__rconn_init(&r->rc, r->loop, &r->url, &o, &r->log, "relay") != 0)
            return OUTBOX_ENOMEM;
        r->rc_state = RC_INITIALISED;
        r->rc.on_up = on_redis_up;
        r->rc.on_down = on_redis_down;
        r->rc.data = r;
    }
    e = start_ops(r, err, sizeof err);
    if (e != 0) {
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot start\" error=\"%s\"", err);
        return e;
    }
    uv_timer_init(r->loop, &r->kick_timer);
    uv_timer_init(r->loop, &r->scan_timer);
    uv_timer_init(r->loop, &r->busy_timer);
    uv_timer_init(r->loop, &r->shutdown_timer);
    uv_timer_init(r->loop, &r->wal_timer);
    uv_async_init(r->loop, &r->wake_async, on_wake);
    __atomic_store_n(&r->wake_ready, 1, __ATOMIC_RELEASE);
    r->kick_timer.data = r->scan_timer.data = r->busy_timer.data = r;
    r->shutdown_timer.data = r->wake_async.data = r->wal_timer.data = r;
    ((uv_handle_t *)&r->kick_timer)->data = r;
    r->handles_open = 6;
    uv_fs_event_init(r->loop, &r->wal_watch);
    r->wal_watch.data = r;
    r->handles_open++;
    snprintf(walpath, sizeof walpath, "%s-wal", r->db_path);
    if (uv_fs_event_start(&r->wal_watch, on_wal_change, walpath, 0) == 0) {
        r->wal_watch_active = 1;
        r->wal_path = dupstr(walpath);
    } else {
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"cannot watch the WAL file; timer scans only\" path=%s", walpath);
    }
    step_int(r->q_data_version, 0, &r->data_version);
    start_ops_handles(r);
    r->down_since_wall = uv_now(r->loop);
    r->state = R_RUNNING;
    LOG(r, OUTBOX_LOG_INFO, "msg=started worker=%s db=%s redis=%s batch=%u inflight=%u", r->worker_id, r->db_path,
        r->url_desc, r->s.batch, r->s.inflight);
    r->rc_state = RC_STARTED;
    outbox__rconn_start(&r->rc);
    arm_scan(r, 0);
    return 0;
}

/* ------------------------------------------------------------------ */
/* operations: loop stall, retention, database figures, /metrics, /healthz */

static const double latency_bounds[] = {0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
static const double size_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
static const double claim_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1};
static const double stall_bounds[] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};

static void init_metrics(outbox_relay *r)
{
    outbox__topics_init(&r->topics, 1000);
    outbox__hist_init(&r->h_latency, latency_bounds, OUTBOX_ARRAY_LEN(latency_bounds));
    outbox__hist_init(&r->h_claim_size, size_bounds, OUTBOX_ARRAY_LEN(size_bounds));
    outbox__hist_init(&r->h_claim_secs, claim_bounds, OUTBOX_ARRAY_LEN(claim_bounds));
    outbox__hist_init(&r->h_stall, stall_bounds, OUTBOX_ARRAY_LEN(stall_bounds));
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
    if (!r->loop_mark_ns) {
        r->loop_mark_ns = now;
        r->loop_idle_ns = idle;
        return;
    }
    d = now - r->loop_mark_ns - (idle - r->loop_idle_ns);
    r->loop_mark_ns = now;
    r->loop_idle_ns = idle;
    if (d > r->stall_max_ns)
        r->stall_max_ns = d;
    outbox__hist_observe(&r->h_stall, (double)d / 1e9);
}

static void on_retention(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    int rc, n = 0, pages;
    if (r->state != R_RUNNING || !r->q_retention)
        return;
    if (r->unit_running) {
        uv_timer_start(&r->retention_timer, on_retention, 5, 0); /* the connection is the unit's */
        return;
    }
    sqlite3_bind_int64(r->q_retention, 1, outbox_now_ms() - (int64_t)r->s.retention_ms);
    sqlite3_bind_int64(r->q_retention, 2, r->s.retention_batch);
    rc = sqlite3_step(r->q_retention);
    sqlite3_reset(r->q_retention);
    if (rc == SQLITE_DONE) {
        n = sqlite3_changes(r->db);
        r->retention_deleted += (uint64_t)n;
        if (n)
            LOG(r, OUTBOX_LOG_DEBUG, "msg=\"retention deleted published rows\" count=%d", n);
    } else if ((rc & 0xff) != SQLITE_BUSY) {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"retention delete failed\" error=\"%s\"", sqlite3_errmsg(r->db));
    }
    pages = r->own_wal_pages;
    r->own_wal_pages = 0;
    if (pages)
        maybe_checkpoint(r, pages);
    /* A full batch means more are due: continue soon, in small steps, so the
     * application's writers are never held up for long. */
    uv_timer_start(&r->retention_timer, on_retention, n == (int)r->s.retention_batch ? 20 : 10000, 0);
}

/* Runs on a libuv worker thread with its own read-only connection: a count
 * over a large table must never hold up publishing. */
static void dbstat_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    struct dbstat *d = &r->dbstat_tmp;
    sqlite3_stmt *st = NULL;
    int rc;
    memset(d, 0, sizeof *d);
    if (!r->dbstat_db) {
        rc = sqlite3_open_v2(r->db_path, &r->dbstat_db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
        if (rc != SQLITE_OK) {
            snprintf(d->err, sizeof d->err, "cannot open the database: %s",
                     r->dbstat_db ? sqlite3_errmsg(r->dbstat_db) : sqlite3_errstr(rc));
            sqlite3_close_v2(r->dbstat_db);
            r->dbstat_db = NULL;
            return;
        }
        sqlite3_busy_timeout(r->dbstat_db, 1000);
    }
    rc = sqlite3_prepare_v2(r->dbstat_db, "SELECT state, count(*) FROM outbox GROUP BY state", -1, &st, NULL);
    if (rc == SQLITE_OK) {
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            int state = sqlite3_column_int(st, 0);
            if (state >= 0 && state < 4)
                d->by_state[state] = sqlite3_column_int64(st, 1);
        }
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        snprintf(d->err, sizeof d->err, "database query failed: %s", sqlite3_errmsg(r->dbstat_db));
        return;
    }
    st = NULL;
    /* The oldest of the first new row and the first due waiting row. */
    rc = sqlite3_prepare_v2(r->dbstat_db,
                            "WITH h(a, b) AS (SELECT (SELECT available_at FROM outbox WHERE seq >= "
                            "coalesce((SELECT new_from FROM outbox_cursor), 0) AND state = 0 "
                            "AND available_at <= created_at ORDER BY seq LIMIT 1), (SELECT min(available_at) "
                            "FROM outbox WHERE state = 0 AND available_at > created_at AND available_at <= ?1)) "
                            "SELECT min(coalesce(a, b), coalesce(b, a)) FROM h",
                            -1, &st, NULL);
    if (rc == SQLITE_OK) {
        int64_t now = outbox_now_ms();
        sqlite3_bind_int64(st, 1, now);
        if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL &&
            sqlite3_column_int64(st, 0) <= now)
            d->oldest_due_ms = now - sqlite3_column_int64(st, 0);
    }
    sqlite3_finalize(st);
    d->ok = 1;
}

static void answer(outbox_relay *r, outbox__http_req *req, const char *path);

static void dbstat_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    size_t i, n = r->nwaiting;
    (void)status;
    r->dbstat_running = 0;
    r->dbstat = r->dbstat_tmp;
    r->dbstat_at = uv_now(r->loop);
    r->nwaiting = 0;
    for (i = 0; i < n; i++) {
        answer(r, r->waiting_reqs[i], r->waiting_paths[i]);
        free(r->waiting_paths[i]);
    }
    maybe_finish_stop(r);
}

/* A label value in the exposition format: backslash, double quote and
 * newline escaped. A row with an invalid topic (written past the schema's
 * checks) is dead-lettered under its own topic, so any byte can get here. */
static void prom_label_value(outbox__sbuf *b, const char *v)
{
    while (*v) {
        size_t n = strcspn(v, "\\\"\n");
        if (n)
            outbox__sbuf_printf(b, "%.*s", (int)n, v);
        v += n;
        if (*v) {
            outbox__sbuf_printf(b, "\\%c", *v == '\n' ? 'n' : *v);
            v++;
        }
    }
}

/* One per-topic counter family. Topics beyond the table's limit are counted
 * in the shared "_other" entry, which must be shown too or the family's sum
 * would fall short of the total; a real topic of that name gets its sum, so
 * no two series carry the same labels. */
static void topic_family(outbox__sbuf *b, const outbox_relay *r, const char *name, size_t off)
{
    const outbox__topics *t = &r->topics;
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
        prom_label_value(b, ts->topic);
        outbox__sbuf_printf(b, "\"} %llu\n", (unsigned long long)v);
    }
}

static void write_metrics(outbox_relay *r, outbox__sbuf *b)
{
    static const char *const states[] = {"pending", "sending", "published", "dead"};
    size_t i;

    outbox__sbuf_printf(b, "# HELP outbox_messages Outbox rows by state (from the database).\n"
                           "# TYPE outbox_messages gauge\n");
    for (i = 0; i < 4; i++)
        if (r->dbstat.ok)
            outbox__sbuf_printf(b, "outbox_messages{state=\"%s\"} %lld\n", states[i],
                                (long long)r->dbstat.by_state[i]);
    outbox__sbuf_printf(b,
                        "# HELP outbox_oldest_pending_seconds Age of the oldest due pending row.\n"
                        "# TYPE outbox_oldest_pending_seconds gauge\n"
                        "outbox_oldest_pending_seconds %.3f\n",
                        r->dbstat.ok ? (double)r->dbstat.oldest_due_ms / 1000.0 : 0.0);
    outbox__sbuf_printf(b,
                        "# HELP outbox_inflight Messages claimed by this relay and not yet marked.\n"
                        "# TYPE outbox_inflight gauge\noutbox_inflight %llu\n"
                        "# HELP outbox_awaiting_replies Messages sent to Redis awaiting their reply.\n"
                        "# TYPE outbox_awaiting_replies gauge\noutbox_awaiting_replies %llu\n",
                        (unsigned long long)r->inflight, (unsigned long long)r->awaiting);
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
                        "# TYPE outbox_claims_total counter\noutbox_claims_total %llu\n",
                        (unsigned long long)r->retries_total, (unsigned long long)r->fenced_total,
                        (unsigned long long)r->duplicates_total, (unsigned long long)r->reconnects,
                        redis_conn(r) != NULL, (unsigned long long)r->retention_deleted,
                        (unsigned long long)r->claims_total);
    outbox__sbuf_printf(b, "# HELP outbox_publish_latency_seconds From commit (created_at) to Redis accepting it.\n"
                           "# TYPE outbox_publish_latency_seconds histogram\n");
    outbox__prom_hist(b, "outbox_publish_latency_seconds", "", &r->h_latency);
    outbox__sbuf_printf(b, "# HELP outbox_claim_batch_size Rows per claim transaction.\n"
                           "# TYPE outbox_claim_batch_size histogram\n");
    outbox__prom_hist(b, "outbox_claim_batch_size", "", &r->h_claim_size);
    outbox__sbuf_printf(b, "# HELP outbox_claim_duration_seconds Time of a claim transaction (marks included).\n"
                           "# TYPE outbox_claim_duration_seconds histogram\n");
    outbox__prom_hist(b, "outbox_claim_duration_seconds", "", &r->h_claim_secs);
    outbox__sbuf_printf(b, "# HELP outbox_loop_stall_seconds Time the event loop spent per iteration outside poll.\n"
                           "# TYPE outbox_loop_stall_seconds histogram\n");
    outbox__prom_hist(b, "outbox_loop_stall_seconds", "", &r->h_stall);
    outbox__sbuf_printf(b,
                        "# HELP outbox_loop_stall_max_seconds Longest event-loop iteration since start.\n"
                        "# TYPE outbox_loop_stall_max_seconds gauge\noutbox_loop_stall_max_seconds %.6f\n",
                        (double)r->stall_max_ns / 1e9);
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
        /* Room for the longest URL description and database error. */
        char body[sizeof r->url_desc + sizeof r->dbstat.err + 64];
        uint64_t down = r->down_since_wall ? uv_now(r->loop) - r->down_since_wall : 0;
        int n;
        if (!r->dbstat.ok)
            n = snprintf(body, sizeof body, "unhealthy: %s\n", r->dbstat.err[0] ? r->dbstat.err : "database not checked");
        else if (!redis_conn(r) && down >= r->s.health_redis_down_ms)
            n = snprintf(body, sizeof body, "unhealthy: redis unreachable for %llu ms (%s)\n",
                         (unsigned long long)down, r->url_desc);
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
    /* Database figures at most a second old; a refresh runs off the loop. */
    if (r->dbstat_at && uv_now(r->loop) - r->dbstat_at < 1000 && !r->dbstat_running) {
        answer(r, req, path);
        return;
    }
    if (r->nwaiting == r->capwaiting) {
        size_t nc = r->capwaiting ? r->capwaiting * 2 : 8;
        outbox__http_req **nr = realloc(r->waiting_reqs, nc * sizeof *nr);
        char **np;
        if (nr)
            r->waiting_reqs = nr;
        np = nr ? realloc(r->waiting_paths, nc * sizeof *np) : NULL;
        if (!nr || !np) {
            outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
            return;
        }
        r->waiting_paths = np;
        r->capwaiting = nc;
    }
    r->waiting_paths[r->nwaiting] = strdup(path);
    if (!r->waiting_paths[r->nwaiting]) {
        outbox__http_respond(req, 500, "text/plain", "out of memory\n", 14);
        return;
    }
    r->waiting_reqs[r->nwaiting++] = req;
    if (!r->dbstat_running) {
        r->dbstat_work.data = r;
        if (uv_queue_work(r->loop, &r->dbstat_work, dbstat_run, dbstat_done) == 0)
            r->dbstat_running = 1;
    }
}

static void on_http_closed(void *data)
{
    outbox_relay *r = data;
    r->http = NULL;
    if (--r->handles_open == 0)
        finish_stop(r);
}

/* Starts what --metrics-listen and retention need; called by start. */
static int start_ops(outbox_relay *r, char *err, size_t errlen)
{
    if (r->s.metrics_listen) {
        int e = outbox__http_start(&r->http, r->loop, r->s.metrics_listen, on_http, r, &r->log, err, errlen);
        if (e != 0)
            return e;
        LOG(r, OUTBOX_LOG_INFO, "msg=\"serving /metrics and /healthz\" listen=%s", r->s.metrics_listen);
    }
    return 0;
}

static void start_ops_handles(outbox_relay *r)
{
    /* Idle-time accounting for the stall measure; harmless if refused. */
    uv_loop_configure(r->loop, UV_METRICS_IDLE_TIME);
    uv_prepare_init(r->loop, &r->stall_prepare);
    uv_check_init(r->loop, &r->stall_check);
    uv_timer_init(r->loop, &r->retention_timer);
    r->stall_prepare.data = r->stall_check.data = r->retention_timer.data = r;
    uv_prepare_start(&r->stall_prepare, on_stall_prepare);
    uv_check_start(&r->stall_check, on_stall_check);
    /* The stall probes must not keep the loop alive by themselves. */
    uv_unref((uv_handle_t *)&r->stall_prepare);
    uv_unref((uv_handle_t *)&r->stall_check);
    if (r->s.retention_ms)
        uv_timer_start(&r->retention_timer, on_retention, 1000, 0);
    r->handles_open += 3 + (r->http ? 1 : 0);
}

static void close_ops(outbox_relay *r)
{
    uv_close((uv_handle_t *)&r->stall_prepare, on_handle_closed);
    uv_close((uv_handle_t *)&r->stall_check, on_handle_closed);
    uv_close((uv_handle_t *)&r->retention_timer, on_handle_closed);
    if (r->http) {
        outbox__http *h = r->http;
        outbox__http_close(h, on_http_closed, r);
    }
}

static void finish_stop(outbox_relay *r)
{
    void (*cb)(outbox_relay *, void *) = r->stop_cb;
    void *data = r->stop_data;
    r->state = R_STOPPED;
    LOG(r, OUTBOX_LOG_INFO, "msg=stopped published=%llu failed=%llu dead=%llu fenced=%llu",
        (unsigned long long)r->published_total, (unsigned long long)r->failed_total,
        (unsigned long long)r->dead_total, (unsigned long long)r->fenced_total);
    r->in_finish = 1;
    if (cb)
        cb(r, data);
    r->in_finish = 0;
    if (r->destroy_pending)
        free_fields(r);
}

static void on_handle_closed(uv_handle_t *h)
{
    outbox_relay *r = h->data;
    if (--r->handles_open == 0)
        finish_stop(r);
}

static void on_conn_closed(void *data)
{
    outbox_relay *r = data;
    if (--r->handles_open == 0)
        finish_stop(r);
    else
        maybe_finish_stop(r);
}

static void maybe_finish_stop(outbox_relay *r)
{
    msg *m;
    if (r->state != R_STOPPING || r->closing)
        return;
    if (r->awaiting > 0 || r->ckpt_running || r->dbstat_running || r->unit_running)
        return;
    if (r->marks_head) {
        /* Marks still to write: do_work writes them (or its busy retry does).
         * A database that fails 200 units in a row loses only the marks: the
         * rows' leases expire and another relay publishes them again
         * (duplicates, never a loss). */
        if (r->stop_flush_failures <= 200) {
            schedule_work(r);
            return;
        }
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot write the last marks; their rows will be taken over when the "
                                 "leases expire\"");
        while ((m = r->marks_head) != NULL) {
            r->marks_head = m->next;
            r->inflight--;
            msg_retire(r, m);
        }
        r->marks_tail = NULL;
    }
    r->closing = 1;
    close_redis(r);
    uv_close((uv_handle_t *)&r->kick_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->scan_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->busy_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->shutdown_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->wal_timer, on_handle_closed);
    __atomic_store_n(&r->wake_ready, 0, __ATOMIC_RELEASE);
    uv_close((uv_handle_t *)&r->wake_async, on_handle_closed);
    uv_close((uv_handle_t *)&r->wal_watch, on_handle_closed);
    close_ops(r);
}

static void on_shutdown_timeout(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    if (r->awaiting) {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"shutdown timeout: handing back messages without a reply\" count=%llu",
            (unsigned long long)r->awaiting);
        /* Dropping fails every pending reply: each one releases its row. */
        outbox__rconn_reset(&r->rc, "shutdown timeout");
    }
    maybe_finish_stop(r);
}

int outbox_relay_stop(outbox_relay *r, void (*cb)(outbox_relay *r, void *data), void *data)
{
    if (!r || r->state != R_RUNNING)
        return OUTBOX_ESTATE;
    r->state = R_STOPPING;
    r->stop_cb = cb;
    r->stop_data = data;
    LOG(r, OUTBOX_LOG_INFO, "msg=stopping inflight=%llu awaiting_replies=%llu", (unsigned long long)r->inflight,
        (unsigned long long)r->awaiting);
    uv_timer_stop(&r->scan_timer);
    uv_timer_stop(&r->retention_timer);
    if (r->wal_watch_active)
        uv_fs_event_stop(&r->wal_watch);
    uv_timer_stop(&r->wal_timer);
    /* No more reconnects; a live connection stays for the replies awaited. */
    outbox__rconn_hold(&r->rc);
    if (r->awaiting)
        uv_timer_start(&r->shutdown_timer, on_shutdown_timeout, r->s.shutdown_timeout_ms, 0);
    schedule_work(r);
    maybe_finish_stop(r);
    return 0;
}

void outbox_relay_destroy(outbox_relay *r)
{
    if (!r)
        return;
    if (r->state == R_CREATED || (r->state == R_STOPPED && !r->in_finish)) {
        free_fields(r);
        return;
    }
    r->destroy_pending = 1;
    if (r->state == R_RUNNING)
        outbox_relay_stop(r, NULL, NULL);
}

int outbox_relay_stats_get(outbox_relay *r, outbox_relay_stats *st)
{
    sqlite3_stmt *q = NULL;
    int rc, e = 0;
    int64_t now = outbox_now_ms();

    if (!r || !st)
        return OUTBOX_EINVAL;
    memset(st, 0, sizeof *st);
    st->pending = st->sending = st->published = st->dead = -1;
    st->published_total = r->published_total;
    st->failed_total = r->failed_total;
    st->dead_total = r->dead_total;
    st->fenced_total = r->fenced_total;
    st->reconnects = r->reconnects;
    st->inflight = r->inflight;
    st->redis_connected = redis_conn(r) != NULL;
    /* Its own connection: the relay's belongs to the unit of work, which may
     * be running on a worker thread. */
    if (!r->stats_db && sqlite3_open_v2(r->db_path, &r->stats_db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX,
                                        NULL) != SQLITE_OK) {
        sqlite3_close_v2(r->stats_db);
        r->stats_db = NULL;
        return OUTBOX_ESQLITE;
    }
    rc = sqlite3_prepare_v2(r->stats_db, "SELECT state, count(*) FROM outbox GROUP BY state", -1, &q, NULL);
    if (rc == SQLITE_OK) {
        st->pending = st->sending = st->published = st->dead = 0;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            int64_t n = sqlite3_column_int64(q, 1);
            switch (sqlite3_column_int(q, 0)) {
            case ROW_PENDING: st->pending = n; break;
            case ROW_SENDING: st->sending = n; break;
            case ROW_PUBLISHED: st->published = n; break;
            case ROW_DEAD: st->dead = n; break;
            }
        }
    }
    if (rc != SQLITE_DONE) {
        e = outbox__sqlite_code(rc);
        st->pending = st->sending = st->published = st->dead = -1;
    }
    sqlite3_finalize(q);
    q = NULL;
    if (sqlite3_prepare_v2(r->stats_db, "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at <= ?1", -1,
                           &q, NULL) == SQLITE_OK) {
        sqlite3_bind_int64(q, 1, now);
        if (sqlite3_step(q) == SQLITE_ROW && sqlite3_column_type(q, 0) != SQLITE_NULL)
            st->oldest_pending_ms = now - sqlite3_column_int64(q, 0);
    }
    sqlite3_finalize(q);
    return e ? e : 0;
}
