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
#include "redis.h"
#include "sqlite_util.h"

enum { ROW_PENDING = 0, ROW_SENDING = 1, ROW_PUBLISHED = 2, ROW_DEAD = 3 };

/* Marks written per transaction at most (see do_work). */
#define MARKS_PER_TXN 512

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

typedef struct msg {
    struct msg *next;     /* mark queue */
    struct msg *key_next; /* the next message of its key, held back behind this one */
    struct outbox_relay *r;
    wait_group *group;
    int64_t seq, token, attempts, created_at, replay_count;
    char *id, *topic;
    char *env; /* idempotent mode: the envelope, sent with its stream's batch */
    size_t envlen;
    char *cmd; /* formatted XADD, until sent */
    size_t cmdlen;
    enum msg_state state;
    enum outcome outcome;
    int behind; /* held behind an earlier message of its key in the same batch */
    char *result; /* stream entry id (published) or error text (failed); malloc'd */
} msg;

struct wait_group {
    struct outbox_relay *r;
    size_t n, cap;
    msg **msgs; /* NULL for a message that left the group */
};

enum relay_state { R_CREATED, R_RUNNING, R_STOPPING, R_STOPPED };
enum conn_state { C_DOWN, C_CONNECTING, C_UP };

struct outbox_relay {
    uv_loop_t *loop;
    outbox_relay_settings s;
    outbox__logger log;
    char *db_path, *redis_url_text, *worker_id, *stream_prefix, *metrics_listen;
    outbox__redis_url url;
    char url_desc[300];

    sqlite3 *db;
    sqlite3_stmt *q_due, *q_expired, *q_key_prev, *q_key_head, *q_claim, *q_published, *q_failed, *q_release, *q_dead,
        *q_data_version, *q_next_due, *q_next_lease, *q_drain, *q_retention;
    int64_t data_version;

    enum relay_state state;
    enum conn_state conn_state;
    outbox__redis *conn;
    unsigned reconnect_failures;
    uint64_t reconnect_delay_ms;
    uint64_t down_since_ms, last_down_log_ms;

    /* Handles. */
    uv_timer_t kick_timer;      /* zero-delay: run do_work on the next loop turn */
    uv_timer_t scan_timer;      /* fallback scan and next-due wake-up */
    uv_timer_t busy_timer;      /* database locked: retry */
    uv_timer_t reconnect_timer;
    uv_timer_t shutdown_timer;
    uv_async_t wake_async;
    uv_fs_event_t wal_watch;
    int wal_watch_active;
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

    /* In-flight seqs, to tell our own leases from expired ones. */
    int64_t *seqset;
    size_t seqset_cap, seqset_len, seqset_tombs;

    /* Envelope scratch buffer. */
    char *envbuf;
    size_t envcap;

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
    unsigned stop_flush_tries;
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

static void schedule_work(outbox_relay *r);
static void connect_redis(outbox_relay *r);
static void maybe_finish_stop(outbox_relay *r);
static void send_msg(outbox_relay *r, msg *m, wait_group **grp);
static void on_scan(uv_timer_t *t);
static void on_handle_closed(uv_handle_t *h);
static void finish_stop(outbox_relay *r);
static void init_metrics(outbox_relay *r);
static int start_ops(outbox_relay *r, char *err, size_t errlen);
static void start_ops_handles(outbox_relay *r);
static void close_ops(outbox_relay *r);
static void on_busy_retry(uv_timer_t *t);
static void on_reconnect_timer(uv_timer_t *t);

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

static int bad_setting(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad_setting(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (err && errlen) {
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return OUTBOX_EINVAL;
}

static int check_settings(const outbox_relay_settings *s, char *err, size_t errlen)
{
    if (!s->db_path || !*s->db_path)
        return bad_setting(err, errlen, "db: no database path given");
    if (!s->redis_url || !*s->redis_url)
        return bad_setting(err, errlen, "redis: no Redis URL given");
    if (s->batch < 1 || s->batch > 100000)
        return bad_setting(err, errlen, "batch: %u is out of range 1..100000", s->batch);
    if (s->inflight < 1 || s->inflight > 1000000)
        return bad_setting(err, errlen, "inflight: %u is out of range 1..1000000", s->inflight);
    if (s->lease_ms < 1000 || s->lease_ms > 86400000ull)
        return bad_setting(err, errlen, "lease-ms: %llu is out of range 1000..86400000",
                           (unsigned long long)s->lease_ms);
    if (s->scan_interval_ms < 1 || s->scan_interval_ms > 3600000ull)
        return bad_setting(err, errlen, "scan-interval-ms: %llu is out of range 1..3600000",
                           (unsigned long long)s->scan_interval_ms);
    if (s->max_attempts < 1 || s->max_attempts > 1000000)
        return bad_setting(err, errlen, "max-attempts: %u is out of range 1..1000000", s->max_attempts);
    if (s->backoff_min_ms < 1 || s->backoff_min_ms > s->backoff_max_ms || s->backoff_max_ms > 86400000ull)
        return bad_setting(err, errlen,
                           "backoff-min-ms/backoff-max-ms: need 1 <= min (%llu) <= max (%llu) <= 86400000",
                           (unsigned long long)s->backoff_min_ms, (unsigned long long)s->backoff_max_ms);
    if (!s->stream_prefix || strlen(s->stream_prefix) > 128 || strpbrk(s->stream_prefix, "{} \t\r\n"))
        return bad_setting(err, errlen, "stream-prefix: must be at most 128 bytes without braces or spaces");
    if (s->max_payload < 1 || s->max_payload > OUTBOX_PAYLOAD_HARD_MAX)
        return bad_setting(err, errlen, "max-payload: %zu is out of range 1..%d", s->max_payload,
                           OUTBOX_PAYLOAD_HARD_MAX);
    if (s->shutdown_timeout_ms > 3600000ull)
        return bad_setting(err, errlen, "shutdown-timeout-ms: %llu is out of range 0..3600000",
                           (unsigned long long)s->shutdown_timeout_ms);
    if (s->wait_replicas > 100)
        return bad_setting(err, errlen, "wait-replicas: %u is out of range 0..100", s->wait_replicas);
    if (s->wait_replicas && (s->wait_timeout_ms < 1 || s->wait_timeout_ms >= s->lease_ms / 2))
        return bad_setting(err, errlen, "wait-timeout-ms: %llu must be at least 1 and below half of lease-ms",
                           (unsigned long long)s->wait_timeout_ms);
    /* WAIT is only sent with wait_replicas; without it its timeout does not
     * delay a reply. */
    if (s->reply_timeout_ms < 1 ||
        s->reply_timeout_ms + (s->wait_replicas ? s->wait_timeout_ms : 0) >= s->lease_ms)
        return bad_setting(err, errlen,
                           "reply timeout %llu ms (plus wait-timeout-ms) must be below lease-ms %llu, so that "
                           "a stuck connection is given up before its leases expire",
                           (unsigned long long)s->reply_timeout_ms, (unsigned long long)s->lease_ms);
    if (s->connect_timeout_ms < 1)
        return bad_setting(err, errlen, "connect timeout must be at least 1 ms");
    if (s->worker_id && (!*s->worker_id || strlen(s->worker_id) > 200))
        return bad_setting(err, errlen, "worker-id: must be 1..200 bytes");
    if ((unsigned)s->log_level > OUTBOX_LOG_ERROR)
        return bad_setting(err, errlen, "log-level: unknown level %d", (int)s->log_level);
    if (s->idempotent && (s->idempotent_retention_ms < 1000 || s->idempotent_retention_ms > 30ull * 86400000))
        return bad_setting(err, errlen, "idempotent-retention-ms: %llu is out of range 1000..2592000000",
                           (unsigned long long)s->idempotent_retention_ms);
    if (s->idempotent && s->wait_replicas)
        return bad_setting(err, errlen, "idempotent and wait-replicas cannot be combined in this version");
    if (s->metrics_listen) {
        struct sockaddr_storage ss;
        char why[200];
        if (outbox__http_parse_listen(s->metrics_listen, &ss, why, sizeof why) != 0)
            return bad_setting(err, errlen, "metrics-listen: %s", why);
    }
    if (s->health_redis_down_ms < 1)
        return bad_setting(err, errlen, "health-redis-down-ms: must be at least 1");
    if (s->retention_ms && s->retention_ms < 1000)
        return bad_setting(err, errlen, "retention-ms: %llu is below 1000 (0 keeps published rows)",
                           (unsigned long long)s->retention_ms);
    if (s->retention_batch < 1 || s->retention_batch > 100000)
        return bad_setting(err, errlen, "retention-batch: %u is out of range 1..100000", s->retention_batch);
    return 0;
}

/* ------------------------------------------------------------------ */
/* small helpers */

static uint64_t mono_ms(const outbox_relay *r)
{
    return uv_now(r->loop);
}

static uint64_t rand64(void)
{
    static uint64_t x;
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
    if (sqlite3_changes(r->db) == 0) {
        r->fenced_total++;
        LOG(r, OUTBOX_LOG_WARN,
            "msg=\"mark refused: lease taken over by another relay\" id=%s seq=%lld token=%lld mark=%s", m->id,
            (long long)m->seq, (long long)m->token, what);
        return SQLITE_OK;
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
    return SQLITE_OK;
}

/* ------------------------------------------------------------------ */
/* claim */

typedef struct cand {
    int64_t seq, created_at, attempts_before, state;
    const char *id, *topic, *key;
    const void *payload, *headers;
    size_t plen, hlen, klen;
    char *block;
} cand;

static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Appends the current row of st (columns seq, id, topic, key, payload,
 * headers, created_at, attempts) as a candidate in the given row state. */
static int collect_row(sqlite3_stmt *st, int64_t state, cand **arr, size_t *n, size_t *cap)
{
    cand c;
    size_t idl, tl;
    char *p;
    memset(&c, 0, sizeof c);
    c.seq = sqlite3_column_int64(st, 0);
    idl = (size_t)sqlite3_column_bytes(st, 1);
    tl = (size_t)sqlite3_column_bytes(st, 2);
    c.klen = sqlite3_column_type(st, 3) == SQLITE_NULL ? 0 : (size_t)sqlite3_column_bytes(st, 3);
    c.plen = (size_t)sqlite3_column_bytes(st, 4);
    c.hlen = sqlite3_column_type(st, 5) == SQLITE_NULL ? 0 : (size_t)sqlite3_column_bytes(st, 5);
    c.block = malloc(idl + tl + c.klen + c.plen + c.hlen + 3);
    if (!c.block)
        return SQLITE_NOMEM;
    p = c.block;
    memcpy(p, sqlite3_column_text(st, 1), idl);
    p[idl] = 0;
    c.id = p;
    p += idl + 1;
    memcpy(p, sqlite3_column_text(st, 2), tl);
    p[tl] = 0;
    c.topic = p;
    p += tl + 1;
    if (c.klen) {
        memcpy(p, sqlite3_column_text(st, 3), c.klen);
        p[c.klen] = 0;
        c.key = p;
        p += c.klen + 1;
    }
    if (c.plen)
        memcpy(p, sqlite3_column_blob(st, 4), c.plen);
    c.payload = p;
    p += c.plen;
    if (c.hlen) {
        memcpy(p, sqlite3_column_blob(st, 5), c.hlen);
        c.headers = p;
    }
    c.created_at = sqlite3_column_int64(st, 6);
    c.attempts_before = sqlite3_column_int64(st, 7);
    c.state = state;
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        cand *na = realloc(*arr, nc * sizeof *na);
        if (!na) {
            free(c.block);
            return SQLITE_NOMEM;
        }
        *arr = na;
        *cap = nc;
    }
    (*arr)[(*n)++] = c;
    return SQLITE_OK;
}

static int collect(sqlite3_stmt *st, cand **arr, size_t *n, size_t *cap, const outbox_relay *r, int takeover)
{
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (takeover && seqset_has(r, sqlite3_column_int64(st, 0)))
            continue; /* our own, still in flight */
        rc = collect_row(st, takeover ? ROW_SENDING : ROW_PENDING, arr, n, cap);
        if (rc != SQLITE_OK)
            return rc;
    }
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* Batch-local map from (topic, key) to the last message of that key claimed
 * in this batch. */
typedef struct keyslot {
    const cand *c;
    msg *last;
} keyslot;

static uint64_t key_hash(const cand *c)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p;
    for (p = (const unsigned char *)c->topic; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
    for (size_t i = 0; i < c->klen; i++)
        h = (h ^ (unsigned char)c->key[i]) * 1099511628211ull;
    return h;
}

static keyslot *key_find(keyslot *tab, size_t cap, const cand *c)
{
    size_t i = (size_t)key_hash(c) & (cap - 1);
    while (tab[i].c) {
        const cand *o = tab[i].c;
        if (o->klen == c->klen && strcmp(o->topic, c->topic) == 0 && memcmp(o->key, c->key, c->klen) == 0)
            return &tab[i];
        i = (i + 1) & (cap - 1);
    }
    return &tab[i];
}

static int build_command(outbox_relay *r, msg *m, const cand *c)
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

/*
 * A keyed row is claimed only with or after every earlier unfinished row of
 * its key, and those can lie outside the candidate window: a head retried
 * with backoff becomes due after its released successors and after the
 * key's older rows that were never claimed. A window made only of such
 * held-back rows would claim nothing, ever, for any topic. So for each key
 * whose earliest candidate is held back, the key's first unfinished rows are
 * added from the key index as long as they can be claimed now, up to `want`
 * rows in all. *cs must be sorted by seq; the added rows are appended.
 */
static int add_key_heads(outbox_relay *r, unsigned want, int64_t now, cand **cs, size_t *n, size_t *cap)
{
    size_t orig = *n, nfirst = 0, added = 0, tcap = 16, i;
    keyslot *seen;
    cand *first;
    int rc = SQLITE_OK;

    while (tcap < orig * 2)
        tcap *= 2;
    seen = calloc(tcap, sizeof *seen);
    first = malloc(orig * sizeof *first);
    if (!seen || !first) {
        free(seen);
        free(first);
        return SQLITE_NOMEM;
    }
    /* The earliest candidate of each key, copied: *cs may move below (the
     * strings stay put in their blocks). */
    for (i = 0; i < orig; i++) {
        keyslot *ks;
        if (!(*cs)[i].klen)
            continue;
        ks = key_find(seen, tcap, &(*cs)[i]);
        if (!ks->c) {
            first[nfirst] = (*cs)[i];
            ks->c = &first[nfirst++];
        }
    }
    for (i = 0; i < nfirst && added < want && rc == SQLITE_OK; i++) {
        const cand *c = &first[i];
        sqlite3_bind_text(r->q_key_prev, 1, c->topic, -1, SQLITE_STATIC);
        sqlite3_bind_text(r->q_key_prev, 2, c->key, (int)c->klen, SQLITE_STATIC);
        sqlite3_bind_int64(r->q_key_prev, 3, c->seq);
        rc = sqlite3_step(r->q_key_prev);
        sqlite3_reset(r->q_key_prev);
        if (rc != SQLITE_ROW) {
            if (rc == SQLITE_DONE)
                rc = SQLITE_OK; /* nothing before it: not held back */
            continue;
        }
        sqlite3_bind_text(r->q_key_head, 1, c->topic, -1, SQLITE_STATIC);
        sqlite3_bind_text(r->q_key_head, 2, c->key, (int)c->klen, SQLITE_STATIC);
        sqlite3_bind_int64(r->q_key_head, 3, c->seq);
        sqlite3_bind_int64(r->q_key_head, 4, (int64_t)(want - added));
        while ((rc = sqlite3_step(r->q_key_head)) == SQLITE_ROW) {
            sqlite3_stmt *st = r->q_key_head;
            int64_t seq = sqlite3_column_int64(st, 0);
            int pending = sqlite3_column_int(st, 8) == ROW_PENDING;
            int ready = pending ? sqlite3_column_int64(st, 9) <= now
                                : sqlite3_column_type(st, 10) != SQLITE_NULL && sqlite3_column_int64(st, 10) <= now &&
                                      !seqset_has(r, seq);
            if (!ready)
                break; /* it holds back the rest of its key */
            rc = collect_row(st, pending ? ROW_PENDING : ROW_SENDING, cs, n, cap);
            if (rc != SQLITE_OK)
                break;
            added++;
        }
        sqlite3_reset(r->q_key_head);
        if (rc == SQLITE_ROW || rc == SQLITE_DONE)
            rc = SQLITE_OK;
    }
    free(seen);
    free(first);
    return rc;
}

/* Checks a row written by plain SQL against what the relay can publish;
 * returns NULL or a reason to dead-letter it. */
static const char *row_problem(const outbox_relay *r, const cand *c, char *buf, size_t len)
{
    if (c->plen > r->s.max_payload) {
        snprintf(buf, len, "payload is %zu bytes, the relay's limit is %zu", c->plen, r->s.max_payload);
        return buf;
    }
    if (outbox_validate_topic(c->topic, buf, len) != 0)
        return buf;
    if (outbox_validate_id(c->id, buf, len) != 0)
        return buf;
    if (c->klen && outbox_validate_key(c->key, c->klen, buf, len) != 0)
        return buf;
    if (c->hlen && outbox_validate_headers(c->headers, c->hlen, buf, len) != 0)
        return buf;
    return NULL;
}

/*
 * Claims up to `want` rows inside the open transaction and appends the new
 * messages to *out (in seq order, key successors linked behind their
 * predecessor and left MSG_HELD). Returns SQLITE_OK or an error code.
 */
static int claim(outbox_relay *r, unsigned want, int64_t now, msg ***out, size_t *nout, size_t *ndead)
{
    cand *cs = NULL;
    size_t n = 0, cap = 0, i, kcap = 16;
    keyslot *keys = NULL;
    msg **ms = NULL;
    size_t nm = 0;
    int rc;

    *ndead = 0;
    /* Expired leases first: they are the oldest work. */
    sqlite3_bind_int64(r->q_expired, 1, now);
    sqlite3_bind_int64(r->q_expired, 2, want);
    rc = collect(r->q_expired, &cs, &n, &cap, r, 1);
    sqlite3_reset(r->q_expired);
    if (rc != SQLITE_OK)
        goto done;
    /* Look further than `want` so that rows held back by their key do not
     * starve the rest. */
    sqlite3_bind_int64(r->q_due, 1, now);
    sqlite3_bind_int64(r->q_due, 2, (int64_t)want * 4);
    rc = collect(r->q_due, &cs, &n, &cap, r, 0);
    sqlite3_reset(r->q_due);
    if (rc != SQLITE_OK || n == 0)
        goto done;
    qsort(cs, n, sizeof *cs, cand_cmp);
    i = n;
    rc = add_key_heads(r, want, now, &cs, &n, &cap);
    if (rc != SQLITE_OK)
        goto done;
    if (n > i)
        qsort(cs, n, sizeof *cs, cand_cmp);

    while (kcap < n * 2)
        kcap *= 2;
    keys = calloc(kcap, sizeof *keys);
    ms = malloc(n * sizeof *ms);
    if (!keys || !ms) {
        rc = SQLITE_NOMEM;
        goto done;
    }

    for (i = 0; i < n && nm < want; i++) {
        cand *c = &cs[i];
        keyslot *ks = NULL;
        char why[256];
        const char *problem;
        msg *m;
        size_t idl;

        if (c->klen) {
            int64_t prev = 0;
            ks = key_find(keys, kcap, c);
            sqlite3_bind_text(r->q_key_prev, 1, c->topic, -1, SQLITE_STATIC);
            sqlite3_bind_text(r->q_key_prev, 2, c->key, (int)c->klen, SQLITE_STATIC);
            sqlite3_bind_int64(r->q_key_prev, 3, c->seq);
            rc = sqlite3_step(r->q_key_prev);
            if (rc == SQLITE_ROW)
                prev = sqlite3_column_int64(r->q_key_prev, 0);
            sqlite3_reset(r->q_key_prev);
            if (rc != SQLITE_ROW && rc != SQLITE_DONE)
                goto done;
            rc = SQLITE_OK;
            /* An earlier unfinished row of this key that is not the last one
             * claimed in this batch holds this row back. */
            if (prev && !(ks->c && ks->last && ks->last->seq == prev))
                continue;
        }

        problem = row_problem(r, c, why, sizeof why);
        /* The claim itself: new owner, a new fencing token, the lease. */
        sqlite3_bind_text(r->q_claim, 1, r->worker_id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(r->q_claim, 2, now + (int64_t)r->s.lease_ms);
        sqlite3_bind_int64(r->q_claim, 3, c->seq);
        sqlite3_bind_int64(r->q_claim, 4, c->state);
        rc = sqlite3_step(r->q_claim);
        if (rc != SQLITE_ROW) {
            sqlite3_reset(r->q_claim);
            if (rc == SQLITE_DONE) {
                rc = SQLITE_OK;
                continue; /* changed under us: impossible under the write lock, harmless */
            }
            goto done;
        }
        idl = strlen(c->id);
        m = calloc(1, sizeof *m + idl + 1 + strlen(c->topic) + 1);
        if (!m) {
            sqlite3_reset(r->q_claim);
            rc = SQLITE_NOMEM;
            goto done;
        }
        m->r = r;
        m->seq = c->seq;
        m->token = sqlite3_column_int64(r->q_claim, 0);
        m->attempts = sqlite3_column_int64(r->q_claim, 1);
        m->replay_count = sqlite3_column_int64(r->q_claim, 2);
        sqlite3_reset(r->q_claim);
        m->created_at = c->created_at;
        m->id = (char *)(m + 1);
        memcpy(m->id, c->id, idl + 1);
        m->topic = m->id + idl + 1;
        strcpy(m->topic, c->topic);
        m->state = MSG_HELD;
        if (c->state == ROW_SENDING)
            LOG(r, OUTBOX_LOG_INFO, "msg=\"took over an expired lease\" id=%s seq=%lld token=%lld", m->id,
                (long long)m->seq, (long long)m->token);
        if (problem) {
            /* Never publishable: dead now, in this same transaction. */
            m->outcome = OUT_DEAD;
            m->result = safe_text(problem, strlen(problem));
            rc = write_mark(r, m, now);
            msg_free(m);
            (*ndead)++;
            if (rc != SQLITE_OK)
                goto done;
            continue;
        }
        if (build_command(r, m, c) != 0) {
            msg_free(m);
            rc = SQLITE_NOMEM;
            goto done;
        }
        if (ks) {
            /* In idempotent mode the script appends a stream's batch in
             * order and stops at the first failure: no chain needed. */
            if (ks->c && ks->last && !r->s.idempotent) {
                ks->last->key_next = m; /* held behind its predecessor */
                m->behind = 1;
            }
            ks->c = c;
            ks->last = m;
        }
        ms[nm++] = m;
    }
    rc = SQLITE_OK;
done:
    if (rc != SQLITE_OK) {
        for (i = 0; i < nm; i++)
            msg_free(ms[i]);
        free(ms);
        ms = NULL;
        nm = 0;
    }
    for (i = 0; i < n; i++)
        free(cs[i].block);
    free(cs);
    free(keys);
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
    if (r->conn_state != C_UP ||
        outbox__redis_command_argv(r->conn, 3, argv, lens, r->s.wait_timeout_ms + r->s.reply_timeout_ms,
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
            if (r->state == R_RUNNING && r->conn_state == C_UP) {
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
    int e = outbox__redis_command_raw(r->conn, m->cmd, m->cmdlen, 0, on_xadd_reply, m);
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
        if (noscript && r->idem_sha[0] && r->conn_state == C_UP)
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
                    : outbox__redis_command_raw(r->conn, cmd, (size_t)len, 0, on_idem_reply, call);
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
    if (r->conn)
        outbox__redis_command_argv(r->conn, 3, argv, lens, 0, on_idem_loaded, r);
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

static int64_t query_min(sqlite3_stmt *st, int64_t now, int *found)
{
    int64_t v = 0;
    *found = 0;
    sqlite3_bind_int64(st, 1, now);
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        v = sqlite3_column_int64(st, 0);
        *found = 1;
    }
    sqlite3_reset(st);
    return v;
}

/* After a claim that found less than it wanted: sleep until the next row
 * becomes due or the next foreign lease expires, at most scan_interval. */
static void arm_next_due(outbox_relay *r, int64_t now)
{
    int f1, f2;
    int64_t due = query_min(r->q_next_due, now, &f1);
    int64_t lease = query_min(r->q_next_lease, now, &f2);
    int64_t next = INT64_MAX;
    if (f1)
        next = due;
    if (f2 && lease < next)
        next = lease;
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
    /* Locked by a writer: never sleep on the loop thread; try again soon,
     * backing off up to half a second while it lasts. */
    r->busy_delay_ms = r->busy_delay_ms ? r->busy_delay_ms * 2 : 2;
    if (r->busy_delay_ms > 500)
        r->busy_delay_ms = 500;
    if ((rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED)
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"database locked, retrying\" during=%s retry_ms=%llu", what,
            (unsigned long long)r->busy_delay_ms);
    else
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"database error, retrying\" during=%s error=\"%s\" retry_ms=%llu", what,
            sqlite3_errstr(rc), (unsigned long long)r->busy_delay_ms);
    uv_timer_start(&r->busy_timer, on_busy_retry, r->busy_delay_ms, 0);
}

static void do_work(outbox_relay *r)
{
    int64_t now = outbox_now_ms();
    int rc, want_claim;
    unsigned want = 0;
    msg **claimed = NULL, *marks, *m;
    size_t nclaimed = 0, ndead = 0, i, nmarks = 0, nclaimed_sent = 0;
    uint64_t claim_t0 = 0, txn_t0;
    uint64_t held;
    wait_group *grp = NULL;

    if (uv_is_active((uv_handle_t *)&r->busy_timer) || r->state == R_STOPPED || r->state == R_CREATED)
        return;
    /* The marks written below leave the window in this same transaction,
     * so their room can be claimed now; otherwise a window emptied by one
     * batch of marks would wait for the scan timer. */
    held = r->inflight;
    for (m = r->marks_head; m; m = m->next)
        held--;
    want_claim = r->state == R_RUNNING && r->conn_state == C_UP && held < r->s.inflight;
    if (want_claim) {
        want = r->s.inflight - (unsigned)held;
        if (want > r->s.batch)
            want = r->s.batch;
    }
    if (!r->marks_head && !want_claim) {
        maybe_finish_stop(r);
        return;
    }

    txn_t0 = uv_hrtime();
    rc = sqlite3_exec(r->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        db_busy_retry(r, rc, "begin");
        return;
    }
    /* At most MARKS_PER_TXN marks per transaction, so one unit of work
     * stays short; the rest go in the next one, on the next loop turn. */
    for (m = r->marks_head; m && nmarks < MARKS_PER_TXN; m = m->next) {
        rc = write_mark(r, m, now);
        if (rc != SQLITE_OK)
            goto rollback;
        nmarks++;
    }
    if (nmarks == MARKS_PER_TXN && m)
        want_claim = 0; /* marks first: they free the window */
    if (want_claim) {
        claim_t0 = uv_hrtime();
        rc = claim(r, want, now, &claimed, &nclaimed, &ndead);
        if (rc != SQLITE_OK)
            goto rollback;
    }
    rc = sqlite3_exec(r->db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        goto rollback;
    if (want_claim && nclaimed + ndead > 0) {
        /* Claim batch size and the whole transaction's time (marks included). */
        r->claims_total++;
        outbox__hist_observe(&r->h_claim_size, (double)(nclaimed + ndead));
        outbox__hist_observe(&r->h_claim_secs, (double)(uv_hrtime() - claim_t0) / 1e9);
    }
    r->busy_delay_ms = 0;
    /* Leave the write lock free for a while before the next transaction:
     * back to back, the relay would hold it nearly all the time while
     * draining, and the application's writers (whose busy handler retries
     * at intervals) and other relays would hardly ever get it. At least
     * 1 ms, or a quarter of this transaction's time. */
    {
        uint64_t ms = (uv_hrtime() - txn_t0) / 4000000;
        r->lock_free_until = uv_now(r->loop) + (ms ? ms : 1);
    }

    /* Committed: the marked messages leave the window. */
    marks = r->marks_head;
    for (i = 0; i < nmarks; i++) {
        m = marks->next;
        seqset_del(r, marks->seq);
        r->inflight--;
        msg_free(marks);
        marks = m;
    }
    r->marks_head = marks;
    if (!marks)
        r->marks_tail = NULL;
    else
        schedule_work(r);
    for (i = 0; i < nclaimed; i++) {
        seqset_add(r, claimed[i]->seq);
        r->inflight++;
    }
    /* Send every claimed message that is not held behind an earlier one of
     * its key; those go when their predecessor is accepted. */
    if (r->s.idempotent && r->conn_state == C_UP) {
        send_idem(r, claimed, nclaimed);
        nclaimed_sent = nclaimed;
    }
    for (i = nclaimed_sent; i < nclaimed; i++) {
        if (claimed[i]->behind)
            continue;
        if (r->conn_state == C_UP) {
            send_msg(r, claimed[i], &grp);
        } else {
            release_chain(r, claimed[i], "held back: connection lost");
            queue_mark(r, claimed[i], OUT_RELEASE, "connection lost", 15);
        }
    }
    flush_group(r, grp);
    free(claimed);

    if (nmarks)
        LOG(r, OUTBOX_LOG_DEBUG, "msg=marked count=%zu", nmarks);
    r->last_claim_full = want_claim && (nclaimed + ndead) >= want;
    if (r->last_claim_full)
        schedule_work(r);
    else if (r->state == R_RUNNING) {
        arm_next_due(r, now);
        check_drained(r, now);
    }
    maybe_finish_stop(r);
    return;

rollback:
    sqlite3_exec(r->db, "ROLLBACK", NULL, NULL, NULL);
    for (i = 0; i < nclaimed; i++)
        msg_free(claimed[i]);
    free(claimed);
    db_busy_retry(r, rc, nmarks || !want_claim ? "mark" : "claim");
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

static void maybe_checkpoint(outbox_relay *r, int pages)
{
    if (pages < 1000 || r->ckpt_running || r->state != R_RUNNING)
        return;
    __atomic_store_n(&r->ckpt_pages, 0, __ATOMIC_RELAXED);
    r->ckpt_restart = pages >= 16000; /* about 64 MiB of WAL with 4 KiB pages */
    r->ckpt_work.data = r;
    if (uv_queue_work(r->loop, &r->ckpt_work, ckpt_run, ckpt_done) == 0)
        r->ckpt_running = 1;
}

static int own_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    (void)db;
    (void)name;
    maybe_checkpoint(arg, pages);
    return SQLITE_OK;
}

/* Runs on the application's thread, right after its commit. */
static int attach_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    outbox_relay *r = arg;
    (void)db;
    (void)name;
    __atomic_store_n(&r->ckpt_pages, pages, __ATOMIC_RELAXED);
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
    sqlite3_reset(r->q_data_version);
    if (sqlite3_step(r->q_data_version) == SQLITE_ROW)
        v = sqlite3_column_int64(r->q_data_version, 0);
    sqlite3_reset(r->q_data_version);
    if (v == r->data_version)
        return 0;
    r->data_version = v;
    schedule_work(r);
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

static void on_wal_change(uv_fs_event_t *h, const char *filename, int events, int status)
{
    outbox_relay *r = h->data;
    (void)filename;
    (void)events;
    if (status != 0 || data_version_changed(r))
        return;
    /* A commit writes its frames to the WAL, syncs them, and only then
     * publishes them in the wal-index, which is what data_version reads: the
     * last event of another connection's commit comes before the commit is
     * visible. Look again shortly (1, 2, 4 ... 256 ms). */
    r->wal_rechecks = 0;
    uv_timer_start(&r->wal_timer, on_wal_recheck, 1, 0);
}

void outbox_relay_wake(outbox_relay *r)
{
    if (r)
        uv_async_send(&r->wake_async);
}

int outbox_relay_attach(outbox_relay *r, sqlite3 *db)
{
    if (!r || !db)
        return OUTBOX_EINVAL;
    sqlite3_wal_hook(db, attach_wal_hook, r);
    return 0;
}

void outbox_relay_detach(sqlite3 *db)
{
    if (db)
        sqlite3_wal_hook(db, NULL, NULL);
}

/* ------------------------------------------------------------------ */
/* Redis connection */

static void on_conn_closed(void *data);

static void drop_conn(outbox_relay *r)
{
    outbox__redis *c = r->conn;
    r->conn = NULL;
    r->conn_state = C_DOWN;
    if (!r->down_since_wall)
        r->down_since_wall = uv_now(r->loop);
    if (c) {
        r->handles_open++;
        outbox__redis_close(c, on_conn_closed, r);
    }
}

static void schedule_reconnect(outbox_relay *r, int status, const char *detail)
{
    uint64_t now = mono_ms(r);
    drop_conn(r);
    if (r->state != R_RUNNING) {
        maybe_finish_stop(r);
        return;
    }
    r->reconnect_failures++;
    if (r->reconnect_failures == 1) {
        r->down_since_ms = now;
        r->last_down_log_ms = now;
        LOG(r, OUTBOX_LOG_WARN, "msg=\"redis unreachable, retrying with backoff\" redis=%s err=%s detail=\"%s\"",
            r->url_desc, outbox_err_name(status), detail);
    } else if (now - r->last_down_log_ms >= 30000) {
        r->last_down_log_ms = now;
        LOG(r, OUTBOX_LOG_WARN, "msg=\"redis still unreachable\" redis=%s for_ms=%llu attempts=%u detail=\"%s\"",
            r->url_desc, (unsigned long long)(now - r->down_since_ms), r->reconnect_failures, detail);
    }
    r->reconnect_delay_ms = r->reconnect_delay_ms ? r->reconnect_delay_ms * 2 : 100;
    if (r->reconnect_delay_ms > 5000)
        r->reconnect_delay_ms = 5000;
    uv_timer_start(&r->reconnect_timer, on_reconnect_timer, r->reconnect_delay_ms / 2 + rand64() % (r->reconnect_delay_ms / 2 + 1),
                   0);
}

static void on_connected(outbox__redis *c, int status, void *data)
{
    outbox_relay *r = data;
    if (c != r->conn)
        return;
    if (status != 0) {
        char detail[256];
        outbox__strlcpy(detail, outbox__redis_errstr(c), sizeof detail);
        for (char *p = detail; *p; p++)
            if (*p == '"')
                *p = '\'';
        schedule_reconnect(r, status, detail);
        return;
    }
    r->conn_state = C_UP;
    r->down_since_wall = 0;
    if (r->s.idempotent)
        load_idem_script(r);
    if (r->reconnect_failures)
        LOG(r, OUTBOX_LOG_INFO, "msg=\"redis reachable again\" redis=%s after_ms=%llu attempts=%u", r->url_desc,
            (unsigned long long)(mono_ms(r) - r->down_since_ms), r->reconnect_failures);
    else
        LOG(r, OUTBOX_LOG_INFO, "msg=\"connected to redis\" redis=%s", r->url_desc);
    r->reconnect_failures = 0;
    r->reconnect_delay_ms = 0;
    schedule_work(r);
}

static void on_disconnected(outbox__redis *c, int status, void *data)
{
    outbox_relay *r = data;
    char detail[256];
    if (c != r->conn)
        return;
    outbox__strlcpy(detail, outbox__redis_errstr(c), sizeof detail);
    for (char *p = detail; *p; p++)
        if (*p == '"')
            *p = '\'';
    r->reconnects++;
    LOG(r, OUTBOX_LOG_WARN, "msg=\"redis connection lost; in-flight messages released for retry\" err=%s detail=\"%s\"",
        outbox_err_name(status), detail);
    /* Every pending reply callback already ran and released its message. */
    r->reconnect_failures = 0;
    schedule_reconnect(r, status, detail);
    /* A first retry without waiting the whole backoff. */
    r->reconnect_failures = 1;
}

static void connect_redis(outbox_relay *r)
{
    outbox__redis_options o;
    int e;
    if (r->state != R_RUNNING || r->conn)
        return;
    outbox__redis_options_defaults(&o);
    o.connect_timeout_ms = r->s.connect_timeout_ms;
    o.reply_timeout_ms = r->s.reply_timeout_ms;
    o.client_name = "outbox-relay";
    e = outbox__redis_create(&r->conn, r->loop, &r->url, &o, r);
    if (e == 0) {
        r->conn_state = C_CONNECTING;
        e = outbox__redis_connect(r->conn, on_connected, on_disconnected);
    }
    if (e != 0)
        schedule_reconnect(r, e, outbox_strerror(e));
}

static void on_reconnect_timer(uv_timer_t *t)
{
    connect_redis(t->data);
}

/* ------------------------------------------------------------------ */
/* create / start / stop / destroy */

static const struct {
    size_t off;
    const char *sql;
} statements[] = {
#define STMT(field, sql) {offsetof(outbox_relay, field), sql}
    STMT(q_due, "SELECT seq, id, topic, key, payload, headers, created_at, attempts FROM outbox "
                "WHERE state = 0 AND available_at <= ?1 ORDER BY available_at, seq LIMIT ?2"),
    STMT(q_expired, "SELECT seq, id, topic, key, payload, headers, created_at, attempts FROM outbox "
                    "WHERE state = 1 AND lease_until <= ?1 ORDER BY lease_until LIMIT ?2"),
    STMT(q_key_prev, "SELECT seq FROM outbox WHERE topic = ?1 AND key = ?2 AND key IS NOT NULL AND state < 2 "
                     "AND seq < ?3 ORDER BY seq DESC LIMIT 1"),
    STMT(q_key_head, "SELECT seq, id, topic, key, payload, headers, created_at, attempts, state, available_at, "
                     "lease_until FROM outbox WHERE topic = ?1 AND key = ?2 AND key IS NOT NULL AND state < 2 "
                     "AND seq < ?3 ORDER BY seq LIMIT ?4"),
    STMT(q_claim, "UPDATE outbox SET state = 1, lease_owner = ?1, lease_token = lease_token + 1, "
                  "lease_until = ?2, attempts = attempts + 1 WHERE seq = ?3 AND state = ?4 "
                  "RETURNING lease_token, attempts, replay_count"),
    STMT(q_published, "UPDATE outbox SET state = 2, published_at = ?4, stream_id = ?5, lease_owner = NULL, "
                      "lease_until = NULL, last_error = NULL "
                      "WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"),
    STMT(q_failed, "UPDATE outbox SET state = ?4, available_at = ?5, last_error = ?6, lease_owner = NULL, "
                   "lease_until = NULL WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"),
    STMT(q_release, "UPDATE outbox SET state = 0, available_at = ?4, attempts = max(attempts - 1, 0), "
                    "lease_owner = NULL, lease_until = NULL "
                    "WHERE seq = ?1 AND state = 1 AND lease_owner = ?2 AND lease_token = ?3"),
    STMT(q_data_version, "PRAGMA data_version"),
    STMT(q_retention, "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE state = 2 "
                      "AND published_at < ?1 ORDER BY published_at LIMIT ?2)"),
    STMT(q_next_due, "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at > ?1"),
    STMT(q_next_lease, "SELECT min(lease_until) FROM outbox WHERE state = 1 AND lease_until > ?1"),
    STMT(q_drain, "SELECT EXISTS(SELECT 1 FROM outbox WHERE state = 0 AND available_at <= ?1) "
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
    for (i = 0; i < OUTBOX_ARRAY_LEN(statements); i++)
        sqlite3_finalize(*(sqlite3_stmt **)((char *)r + statements[i].off));
    if (r->db) {
        sqlite3_wal_hook(r->db, NULL, NULL);
        sqlite3_close_v2(r->db);
    }
    sqlite3_close_v2(r->ckpt_db);
    sqlite3_close_v2(r->dbstat_db);
    outbox__topics_free(&r->topics);
    free(r->waiting_reqs);
    free(r->waiting_paths);
    free(r->metrics_listen);
    outbox__redis_url_free(&r->url);
    free(r->db_path);
    free(r->redis_url_text);
    free(r->worker_id);
    free(r->stream_prefix);
    free(r->seqset);
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

    /* The relay's connection never waits for a lock (busy_timeout 0), but
     * reading the schema at start-up can meet one: a writer's, or another
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
    /* Binding the metrics port is the one thing that can fail: first, so a
     * failed start leaves nothing to close. */
    e = start_ops(r, err, sizeof err);
    if (e != 0) {
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot start\" error=\"%s\"", err);
        return e;
    }
    uv_timer_init(r->loop, &r->kick_timer);
    uv_timer_init(r->loop, &r->scan_timer);
    uv_timer_init(r->loop, &r->busy_timer);
    uv_timer_init(r->loop, &r->reconnect_timer);
    uv_timer_init(r->loop, &r->shutdown_timer);
    uv_timer_init(r->loop, &r->wal_timer);
    uv_async_init(r->loop, &r->wake_async, on_wake);
    r->kick_timer.data = r->scan_timer.data = r->busy_timer.data = r->reconnect_timer.data = r;
    r->shutdown_timer.data = r->wake_async.data = r->wal_timer.data = r;
    ((uv_handle_t *)&r->kick_timer)->data = r;
    r->handles_open = 7;
    uv_fs_event_init(r->loop, &r->wal_watch);
    r->wal_watch.data = r;
    r->handles_open++;
    snprintf(walpath, sizeof walpath, "%s-wal", r->db_path);
    if (uv_fs_event_start(&r->wal_watch, on_wal_change, walpath, 0) == 0)
        r->wal_watch_active = 1;
    else
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"cannot watch the WAL file; timer scans only\" path=%s", walpath);
    sqlite3_step(r->q_data_version);
    r->data_version = sqlite3_column_int64(r->q_data_version, 0);
    sqlite3_reset(r->q_data_version);
    start_ops_handles(r);
    r->down_since_wall = uv_now(r->loop);
    r->state = R_RUNNING;
    LOG(r, OUTBOX_LOG_INFO, "msg=started worker=%s db=%s redis=%s batch=%u inflight=%u", r->worker_id, r->db_path,
        r->url_desc, r->s.batch, r->s.inflight);
    connect_redis(r);
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
    int rc, n = 0;
    if (r->state != R_RUNNING || !r->q_retention)
        return;
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
    rc = sqlite3_prepare_v2(r->dbstat_db, "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at <= ?1",
                            -1, &st, NULL);
    if (rc == SQLITE_OK) {
        int64_t now = outbox_now_ms();
        sqlite3_bind_int64(st, 1, now);
        if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL)
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
                        r->conn_state == C_UP, (unsigned long long)r->retention_deleted,
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
        else if (r->conn_state != C_UP && down >= r->s.health_redis_down_ms)
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
    if (r->awaiting > 0 || r->ckpt_running || r->dbstat_running)
        return;
    if (r->marks_head) {
        /* Marks still to write: do_work writes them (or its busy retry does).
         * A database that keeps failing for the whole stop budget loses only
         * the marks: the rows' leases expire and another relay publishes
         * them again (duplicates, never a loss). */
        if (++r->stop_flush_tries <= 200) {
            schedule_work(r);
            return;
        }
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"cannot write the last marks; their rows will be taken over when the "
                                 "leases expire\"");
        while ((m = r->marks_head) != NULL) {
            r->marks_head = m->next;
            r->inflight--;
            msg_free(m);
        }
        r->marks_tail = NULL;
    }
    r->closing = 1;
    drop_conn(r);
    uv_close((uv_handle_t *)&r->kick_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->scan_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->busy_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->reconnect_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->shutdown_timer, on_handle_closed);
    uv_close((uv_handle_t *)&r->wal_timer, on_handle_closed);
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
        /* Closing fails every pending reply: each one releases its row. */
        drop_conn(r);
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
    uv_timer_stop(&r->reconnect_timer);
    if (r->wal_watch_active)
        uv_fs_event_stop(&r->wal_watch);
    uv_timer_stop(&r->wal_timer);
    if (r->conn_state != C_UP)
        drop_conn(r);
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
    st->redis_connected = r->conn_state == C_UP;
    rc = sqlite3_prepare_v2(r->db, "SELECT state, count(*) FROM outbox GROUP BY state", -1, &q, NULL);
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
    if (sqlite3_prepare_v2(r->db, "SELECT min(available_at) FROM outbox WHERE state = 0 AND available_at <= ?1", -1,
                           &q, NULL) == SQLITE_OK) {
        sqlite3_bind_int64(q, 1, now);
        if (sqlite3_step(q) == SQLITE_ROW && sqlite3_column_type(q, 0) != SQLITE_NULL)
            st->oldest_pending_ms = now - sqlite3_column_int64(q, 0);
    }
    sqlite3_finalize(q);
    return e ? e : 0;
}
