/*
 * consumer.h: the consumer side. At-least-once delivery becomes
 * effectively-once here, by deduplicating on the stable message id.
 *
 * Two dedup modes:
 *  - Redis (SET NX), for effects outside any database (an email, an HTTP
 *    call): outbox_dedup below, in two phases so that a consumer that dies
 *    half way gets the message again instead of losing it. Each message's
 *    effect is applied at most once per `retention`.
 *  - SQLite inbox, for effects that are writes to the consumer's own SQLite
 *    database: the message id is inserted into an inbox table in the same
 *    transaction as the effect, so there is no window at all
 *    (proto/inbox.sql). OUTBOX_DEDUP_SQLITE in the consumer-group helper.
 * Message ids are unique per database: a relay over many databases names
 * each message's database (proto/envelope.md), and both modes then key the
 * message on "<db>:<id>", so the same id from two databases is two
 * messages.
 *
 * All calls run on the loop thread. A function that returns an error calls
 * no callback; every accepted call gets its callback exactly once.
 *
 * SIGPIPE: as in any libuv program, ignore it (signal(SIGPIPE, SIG_IGN))
 * before starting a consumer or a relay: a write to a connection that Redis
 * (or the network) has just closed raises it, and it would end the process
 * instead of the failed write being seen and the connection made again.
 *
 * Redis URLs: redis://, rediss://, unix://, redis-sentinel://,
 * rediss-sentinel:// and, for a Redis Cluster, redis-cluster:// and
 * rediss-cluster:// (seed nodes). On a cluster every command goes to the
 * master of its key's slot, following MOVED and ASK: the stream, its group
 * and its dedup keys share the stream's slot and move together in a
 * reshard or failover, and the consumer follows them (README.md, "On a
 * Redis Cluster").
 */
#ifndef OUTBOX_CONSUMER_H
#define OUTBOX_CONSUMER_H

#include <sqlite3.h>
#include <uv.h>

#include "outbox/common.h"
#include "outbox/envelope.h"
#include "outbox/tls.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ */
/* Dedup on Redis
 *
 * Key layout: <namespace>:{<stream>}:<message id>, and for a message that
 * names its database (outbox_envelope.db) <namespace>:{<stream>}:<db>:<message
 * id>, since message ids are unique per database only (proto/dedup.md). The
 * stream name is the hash tag, so a stream and all its dedup keys live in
 * one Redis Cluster slot. Values: "P:<owner>" while an owner applies the effect (expires after
 * `lease_ms`), "D" once done (expires after `retention_ms`).
 */

typedef struct outbox_dedup outbox_dedup;

typedef enum outbox_dedup_result {
    OUTBOX_DEDUP_FIRST = 1, /* you own it now: apply the effect, then complete (or abandon) */
    OUTBOX_DEDUP_DONE = 2,  /* already applied: skip it and acknowledge */
    OUTBOX_DEDUP_BUSY = 3   /* another owner is applying it right now: retry later */
} outbox_dedup_result;

typedef struct outbox_dedup_settings {
    const char *redis_url;  /* required (any form above); copied */
    const char *key_namespace; /* default "dedup"; copied */
    const char *owner;      /* default: a fresh UUIDv7 per dedup object; copied */
    uint64_t lease_ms;      /* processing lease; default 30000 */
    uint64_t retention_ms;  /* how long a DONE marker is kept; default 7 days */
    uint64_t reply_timeout_ms; /* default 5000 */
    outbox_log_fn log;      /* default outbox_log_stderr */
    void *log_data;
    outbox_log_level log_level; /* default OUTBOX_LOG_INFO */
    outbox_tls_settings tls; /* for a rediss:// URL; default outbox_tls_defaults() (see tls.h) */
    /* A redis-sentinel:// URL's sentinels' own credentials (the URL's are
     * the data nodes'); default NULL; copied. With another URL:
     * OUTBOX_EINVAL. */
    const char *sentinel_user;
    const char *sentinel_password;
} outbox_dedup_settings;

OUTBOX_API void outbox_dedup_defaults(outbox_dedup_settings *s);

/* Creates the dedup object and starts connecting (reconnecting with backoff
 * whenever the connection is lost). Returns 0, OUTBOX_EINVAL (also for a bad
 * TLS file or TLS settings with a URL that is not rediss://), OUTBOX_EURL
 * (err says why), OUTBOX_ENOMEM. */
OUTBOX_API int outbox_dedup_create(outbox_dedup **out, uv_loop_t *loop, const outbox_dedup_settings *s, char *err,
                                   size_t errlen);

/* Closes the connection (pending callbacks get OUTBOX_ECLOSED) and frees the
 * object once its handles are closed; cb (may be NULL) runs then. Safe from
 * inside a dedup callback. NULL is a no-op. */
OUTBOX_API void outbox_dedup_destroy(outbox_dedup *d, void (*cb)(void *data), void *data);

/* 1 while connected to Redis. */
OUTBOX_API int outbox_dedup_connected(const outbox_dedup *d);

/*
 * status 0 with result for begin; status 0 and result 0 for complete and
 * abandon; otherwise a negative code and result 0:
 *   OUTBOX_ELEASE    complete/abandon: this owner no longer holds the key (the
 *                    lease expired; someone else may own it now);
 *   OUTBOX_EREDIS    Redis answered an error (e.g. WRONGTYPE), see errstr;
 *   OUTBOX_ECLOSED, OUTBOX_ETIMEDOUT, OUTBOX_ECONNECT: Redis unreachable.
 * A caller that could not reach Redis must not assume FIRST.
 */
typedef void (*outbox_dedup_cb)(outbox_dedup *d, int status, outbox_dedup_result result, void *data);

/* stream and id are copied. id is the message id, or "<db>:<message id>"
 * for a message that names its database (msg->db not NULL nor empty), as
 * the consumer-group helper passes it. Returns 0, OUTBOX_EINVAL (empty or
 * too long stream or id), OUTBOX_ECONNECT (not connected right now),
 * OUTBOX_ENOMEM. */
OUTBOX_API int outbox_dedup_begin(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb,
                                  void *data);
/* Atomically turns this owner's processing key into a DONE marker kept for
 * retention_ms (a Lua compare-and-set through EVALSHA). */
OUTBOX_API int outbox_dedup_complete(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb,
                                     void *data);
/* Atomically deletes this owner's processing key, so a redelivery can apply
 * the effect. */
OUTBOX_API int outbox_dedup_abandon(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb,
                                    void *data);

/* The detail of the last error ("WRONGTYPE Operation against a key ..."). */
OUTBOX_API const char *outbox_dedup_errstr(const outbox_dedup *d);

/* ------------------------------------------------------------------ */
/* Consumer-group helper
 *
 * Reads a stream with XREADGROUP ... BLOCK in batches (creating the group
 * with MKSTREAM if missing), decodes each envelope and runs:
 *   begin -> handler -> complete -> XACK          (Redis dedup)
 *   BEGIN; INSERT inbox; handler; COMMIT -> XACK  (SQLite inbox)
 * A handler failure abandons (or rolls back) and leaves the entry pending;
 * entries pending longer than min_idle_ms (also a dead consumer's) are taken
 * over with XAUTOCLAIM and retried. An entry delivered more than
 * max_deliveries times is copied to <stream>:dead with the reason and
 * acknowledged, so one poison message cannot block a group.
 */

typedef struct outbox_consumer outbox_consumer;

/* One delivered message; valid until outbox_consumer_done() for it.
 *
 * msg->db is the name of the database the message comes from when the
 * relay names it (a relay over a directory of databases, one per tenant),
 * else NULL. Ids are unique per database, so (msg->db, msg->id) names a
 * message; the dedup keys and inbox rows are keyed on both. The entry's db
 * field and the envelope's db agree: an entry whose two differ (or that has
 * only one of them) is malformed, as is one whose id field differs from its
 * envelope's id, and goes to <stream>:dead without reaching the handler. */
typedef struct outbox_delivery {
    const char *stream;
    const char *entry_id;          /* the stream entry id, e.g. "1700000000000-0" */
    const outbox_envelope *msg;    /* the decoded envelope; msg->db: the message's database, or NULL */
    uint64_t deliveries;           /* how often the group delivered it (1 = first time) */
    sqlite3 *db;                   /* SQLite inbox mode: the open transaction's connection */
} outbox_delivery;

typedef enum outbox_dedup_mode {
    OUTBOX_DEDUP_NONE = 0,  /* at-least-once: the handler must be idempotent itself */
    OUTBOX_DEDUP_REDIS = 1, /* SET NX dedup (default) */
    OUTBOX_DEDUP_SQLITE = 2 /* inbox table in the consumer's own SQLite database */
} outbox_dedup_mode;

/*
 * The handler. Redis and no-dedup modes: apply the effect, then call
 * outbox_consumer_done(c, dv, status) exactly once, now or later (the
 * handler may complete asynchronously); status 0 is success. SQLite inbox
 * mode: the handler runs inside an open transaction on dv->db and must do
 * its writes synchronously; its return value is the status (0 commits,
 * anything else rolls back) and it must not call outbox_consumer_done().
 */
typedef int (*outbox_consumer_handler)(outbox_consumer *c, const outbox_delivery *dv, void *data);

typedef struct outbox_consumer_settings {
    const char *redis_url;   /* required (any form above); copied */
    const char *stream;      /* required: the full stream name, e.g. "outbox:orders"; copied */
    const char *group;       /* required; copied */
    const char *consumer;    /* default "<hostname>:<pid>"; copied */
    outbox_dedup_mode dedup; /* default OUTBOX_DEDUP_REDIS */
    const char *inbox_db_path; /* SQLite mode: the consumer's database (inbox table created if missing); copied */
    const char *key_namespace; /* Redis dedup namespace; default "dedup:<group>", so
                                * that each group applies every message once */
    uint64_t dedup_lease_ms;   /* default 30000 */
    uint64_t dedup_retention_ms; /* Redis DONE markers; default 7 days */
    uint64_t inbox_retention_ms; /* SQLite inbox rows; default 7 days */
    unsigned batch;          /* XREADGROUP COUNT; default 100 */
    unsigned max_inflight;   /* handlers running at once, at most; default 100 */
    uint64_t block_ms;       /* XREADGROUP BLOCK; default 2000 */
    uint64_t min_idle_ms;    /* XAUTOCLAIM idle time; default 60000 */
    uint64_t claim_interval_ms; /* how often to look for idle entries; default 5000 */
    unsigned max_deliveries; /* then to <stream>:dead; default 5 */
    uint64_t retry_ms;       /* after a failure or BUSY, retry this entry after; default 1000 */
    int drain;               /* call on_drained once nothing new and nothing pending for this
                              * consumer (reads then block at most 100 ms) */
    void (*on_drained)(outbox_consumer *c, void *data);
    outbox_consumer_handler handler; /* required */
    void *data;              /* passed to handler and on_drained */
    outbox_log_fn log;       /* default outbox_log_stderr */
    void *log_data;
    outbox_log_level log_level;
    outbox_tls_settings tls; /* for a rediss:// URL, used by both connections and the dedup
                              * module; default outbox_tls_defaults() (see tls.h) */
    /* As in outbox_dedup_settings; also used by the dedup module. */
    const char *sentinel_user;
    const char *sentinel_password;
} outbox_consumer_settings;

OUTBOX_API void outbox_consumer_defaults(outbox_consumer_settings *s);

/* Validates the settings, reads the TLS files (rediss://) and opens the
 * inbox database in SQLite mode. No network activity yet. Returns 0,
 * OUTBOX_EINVAL (err names the setting or the TLS file), OUTBOX_EURL, SQLite
 * open errors, OUTBOX_ENOMEM. */
OUTBOX_API int outbox_consumer_create(outbox_consumer **out, uv_loop_t *loop, const outbox_consumer_settings *s,
                                      char *err, size_t errlen);
/* Connects, creates the group if needed, starts reading. OUTBOX_ESTATE if
 * already started. */
OUTBOX_API int outbox_consumer_start(outbox_consumer *c);
/* Redis and no-dedup modes: reports the handler's outcome for dv. */
OUTBOX_API void outbox_consumer_done(outbox_consumer *c, const outbox_delivery *dv, int status);
/* Graceful stop: no new reads; in-flight handlers finish (and are completed
 * and acknowledged), then every handle closes and cb runs. OUTBOX_ESTATE if
 * not running. */
OUTBOX_API int outbox_consumer_stop(outbox_consumer *c, void (*cb)(outbox_consumer *c, void *data), void *data);
/* Frees a stopped (or never started) consumer; a running one is stopped first
 * and freed once closed. NULL is a no-op. */
OUTBOX_API void outbox_consumer_destroy(outbox_consumer *c);

typedef struct outbox_consumer_stats {
    uint64_t delivered, applied, duplicates, failed, busy, dead_lettered, claimed, acked;
    uint64_t inflight;
} outbox_consumer_stats;
OUTBOX_API void outbox_consumer_stats_get(const outbox_consumer *c, outbox_consumer_stats *st);

/* The consumer group's figures as Redis keeps them (XINFO GROUPS of the
 * stream). */
typedef struct outbox_consumer_group_info {
    int64_t pending; /* entries delivered to the group and not acknowledged */
    int64_t lag;     /* entries of the stream not yet delivered to the group; -1 when Redis cannot say
                      * (before Redis 7.0, or after entries were deleted from the stream) */
} outbox_consumer_group_info;

/* status 0 with gi, or a negative code and gi NULL: OUTBOX_EREDIS (Redis
 * answered an error, or the group is not in its answer: not created yet),
 * OUTBOX_ECLOSED, OUTBOX_ETIMEDOUT, OUTBOX_ECONNECT (Redis unreachable). */
typedef void (*outbox_consumer_group_info_cb)(outbox_consumer *c, int status, const outbox_consumer_group_info *gi,
                                              void *data);

/* Asks Redis for the group's figures on the command connection (never on
 * the blocked read's); cb runs once, on the loop thread, later. Returns 0,
 * or (cb not called) OUTBOX_ESTATE when the consumer is not running,
 * OUTBOX_ECONNECT when not connected right now, OUTBOX_ENOMEM. */
OUTBOX_API int outbox_consumer_group_info_get(outbox_consumer *c, outbox_consumer_group_info_cb cb, void *data);

#ifdef __cplusplus
}
#endif

#endif
