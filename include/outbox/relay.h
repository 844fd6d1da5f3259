/*
 * relay.h: the relay, embeddable in an application's own libuv loop.
 *
 * The relay claims committed outbox rows under a lease, publishes each one
 * with XADD to the stream <stream_prefix><topic> over its own non-blocking
 * Redis connection, and marks the rows published (or failed, or dead) in
 * batches. Delivery is at-least-once: a row is marked published only after
 * Redis accepted its XADD, so a crash between the two publishes it again.
 *
 * SIGPIPE: ignore it in the embedding program (signal(SIGPIPE, SIG_IGN)),
 * as in any libuv program: a write to a connection that Redis or the
 * network has just closed raises it, and it would end the process rather
 * than the relay seeing the failed write and reconnecting. outbox-relay
 * and outbox-consume ignore it.
 *
 * Lifecycle (all on the loop thread unless said otherwise):
 *
 *     outbox_relay_settings s;
 *     outbox_relay_defaults(&s);
 *     s.db_path = "app.db";
 *     s.redis_url = "unix:///run/redis.sock";
 *     outbox_relay *r;
 *     if (outbox_relay_create(&r, loop, &s, errbuf, sizeof errbuf) != 0) ...;
 *     outbox_relay_start(r);
 *     ... uv_run(loop) ...
 *     outbox_relay_stop(r, on_stopped, data);   // graceful: see below
 *     ... on_stopped runs once every handle is closed ...
 *     outbox_relay_destroy(r);
 *
 * Nothing the relay does blocks the loop on the network or sleeps on a lock:
 * its SQLite transactions (marks and claims, one at a time) and checkpoints
 * run on libuv worker threads (uv_queue_work). A transaction that meets
 * another connection's lock waits for it there, in short naps, up to 20 ms,
 * and is then retried from a timer; the loop thread never waits on a lock.
 * Each transaction holds the write lock for a few ms at most. Log callbacks and every other
 * callback run on the loop thread.
 *
 * Ordering: messages that share a non-empty key (within one topic) are
 * appended to their stream in commit order, also across retries and crashes
 * (a crash may add a later duplicate of a message already appended). The
 * relay claims a keyed row when every earlier row of its key is published or
 * dead, claimed in the same batch, or its own message still on its way (the
 * new one is chained behind it), and sends a key's messages one after
 * another, each once the previous one was accepted. The cost: one Redis round
 * trip per message of a key (different keys are pipelined), and head-of-line
 * blocking per key while one of its messages is failing (retrying with
 * backoff; the key's pending rows are made due no earlier than the retry when
 * a claim meets them). A dead message stops blocking its key; a row requeued
 * by outbox-replay goes before its key's rows still pending (after those
 * already published). Messages without a key are not held back by anything.
 */
#ifndef OUTBOX_RELAY_H
#define OUTBOX_RELAY_H

#include <sqlite3.h>
#include <uv.h>

#include "outbox/common.h"
#include "outbox/tls.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct outbox_relay outbox_relay;

typedef struct outbox_relay_settings {
    /*
     * Every setting that outbox-relay also takes as an option (--lease-ms
     * for lease_ms, ...) states its default here as "default VALUE", the
     * value outbox_relay_defaults() sets (tests/relay/test_options_doc.c checks
     * them). Each has a range; outbox_relay_create() refuses a value outside
     * it with OUTBOX_EINVAL and a message that names the setting and the
     * range.
     */
    /* Database file with the outbox schema (required; copied). The relay
     * opens its own connection. Default NULL. */
    const char *db_path;
    /* A directory of databases, one outbox each (SQLite file per tenant),
     * published by one group (outbox_relay_group_create; outbox-relay
     * --db-dir), or NULL; default NULL. outbox_relay_create refuses it.
     * Copied. */
    const char *db_dir;
    /* Which files of db_dir are databases: fnmatch patterns separated by
     * commas, matched against the file name (no recursion); default
     * "*.db". Copied. */
    const char *db_glob;
    /* With db_dir (a group): the stream of each message, "%db" replaced by
     * its database's name and "%topic" by its topic, e.g.
     * "tenant:%db:outbox:%topic" for a stream per tenant and topic; "%db"
     * once, "%topic" at the end, no other '%', no braces or spaces (neither
     * can be taken for a Cluster hash tag). Default NULL: stream_prefix +
     * topic, one stream per topic for every database. Copied. */
    const char *stream_template;
    /* A group's databases open at once (a relay with its SQLite
     * connections each), at most; default 1024. The least recently used
     * one that has nothing left to do is closed first when another needs
     * to open. */
    unsigned max_open_dbs;
    /* The database's name, or NULL for none; default NULL. When set (a
     * group names each of its databases so: outbox_relay_group_add), every
     * stream entry carries it as a field "db" and its envelope as a key
     * "db" (proto/envelope.md), and idempotent markers include it (message
     * ids are unique per database). At most 200 bytes, no control bytes,
     * no ':' (it ends the name in dedup keys and markers). Copied. */
    const char *db_name;
    /* redis://[[user]:password@]host[:port][/db], the same with rediss://
     * for TLS, unix:///path[?db=N], or
     * redis-sentinel://[[user]:password@]host[:port][,host[:port]...][/db]#master
     * (rediss-sentinel:// for TLS) (required; copied). Default NULL. */
    const char *redis_url;
    /* Lease owner name; default NULL, which means "<hostname>:<pid>". Copied. */
    const char *worker_id;
    /* Stream name prefix; default "outbox:". Copied. */
    const char *stream_prefix;
    /* Rows claimed per SQLite transaction; default 512. */
    unsigned batch;
    /* Messages claimed but not yet marked, at most; default 8192.
     * Memory is bounded by this window, not by the backlog. */
    unsigned inflight;
    /* Lease length in ms; default 30000. Another relay may take a row over
     * once its lease expired. */
    uint64_t lease_ms;
    /* Fallback scan interval when no wake-up arrives; default 1000 ms. */
    uint64_t scan_interval_ms;
    /* Publish attempts before a row becomes dead; default 10. */
    unsigned max_attempts;
    /* The first retry delay; default 500 ms. Retries back off exponentially
     * from backoff_min_ms to backoff_max_ms, with jitter. */
    uint64_t backoff_min_ms;
    /* The largest retry delay; default 60000 ms. */
    uint64_t backoff_max_ms;
    /* Approximate stream trimming (XADD MAXLEN ~ N); default 0 = off. */
    uint64_t maxlen;
    /* Rows with a larger payload are dead-lettered; default 1048576 bytes
     * (1 MiB, OUTBOX_PAYLOAD_DEFAULT_MAX). */
    size_t max_payload;
    /* Graceful stop: how long to wait for in-flight replies; default 10000 ms. */
    uint64_t shutdown_timeout_ms;
    /* When > 0, a batch is marked published only after WAIT reports this many
     * replicas within wait_timeout_ms. A WAIT that falls short is asked
     * again on the same connection for up to lease_ms/2 (no entry appended
     * twice), then the messages are retried; a new master (Sentinel switch,
     * cluster slot moved) gets them at once. Default 0 = off.
     * It covers a failover only if the promoted replica is among those that
     * acknowledged: with a Sentinel URL the relay warns (once) when the
     * replicas' replica-priority values need a larger count (README,
     * "What a failover can lose"). */
    unsigned wait_replicas;
    /* The WAIT timeout in ms; default 0, which means lease_ms/4, at most
     * 1000 (it follows lease_ms). A value set must be below half of
     * lease_ms. */
    uint64_t wait_timeout_ms;
    /* Redis connect timeout; default 5000 ms. */
    uint64_t connect_timeout_ms;
    /* Redis reply timeout in ms: a connection whose oldest command has
     * waited this long for its reply (counted from when the reply before it
     * came: commands behind a WAIT or a large value on a slow link are not
     * given up while those before them are still answered) is dropped and
     * its messages sent again, so that a stuck connection is given up
     * before the leases of its messages expire. Default 0, which
     * means lease_ms/3, at most 10000 (it follows lease_ms). A value set
     * must be below lease_ms, less wait_timeout_ms with wait_replicas. */
    uint64_t reply_timeout_ms;
    /* Drain mode: call on_drained (or stop by itself if NULL) once nothing is
     * due, nothing is leased, nothing is in flight and no row waits for a
     * retry: a row that failed and waits for its backoff (or was handed
     * back) holds the drain until it is published or dead. Rows the
     * application wrote with a later available_at (delayed messages, never
     * attempted) do not hold it. Default 0.
     * A drain ends at once, failed, when Redis cannot be used as
     * configured, which no retry cures: the credentials refused (WRONGPASS,
     * NOAUTH), an ACL that forbids a command the relay sends (NOPERM on
     * XADD, EVALSHA, EVAL, WAIT, or on SELECT or CLIENT SETNAME when it
     * connects), a plain URL naming a Redis Cluster node, or every sentinel
     * answering that it does not know the master (or refusing the
     * sentinels' credentials). The relay logs why (msg="drain failed: ..."
     * err=ECONFIG, with the rows left) and calls on_drained (or stops);
     * outbox_relay_drain_result() then returns OUTBOX_ECONFIG; the stop
     * hands back every claimed row that was not published (pending again,
     * no attempt counted), so that a later run publishes it.
     * Redis or every sentinel unreachable is not such an error: the drain
     * waits for them (up to drain_timeout_ms). Without drain mode the relay
     * holds publishing instead, says why once (msg="publishing held: ...")
     * and in /healthz, and resumes by itself once Redis accepts it. */
    int drain;
    /* Drain mode: how long the drain may take, in ms from
     * outbox_relay_start; default 0 = no limit. When it expires first, the
     * relay logs how many rows are left (due, waiting for a retry, leased)
     * and calls on_drained (or stops) all the same;
     * outbox_relay_drain_result() then returns OUTBOX_ETIMEDOUT. */
    uint64_t drain_timeout_ms;
    /* Called once on the loop thread when the drain ends (see drain and
     * drain_timeout_ms); it may stop or destroy the relay. */
    void (*on_drained)(outbox_relay *r, void *data);
    void *on_drained_data;
    /* Log sink; default outbox_log_stderr. */
    outbox_log_fn log;
    void *log_data;
    /* The least severe level logged; default OUTBOX_LOG_INFO. */
    outbox_log_level log_level;
    /* The format of outbox-relay's log lines, "logfmt" or "json"; default
     * "logfmt". The relay itself only calls log: outbox-relay sets log to
     * outbox_log_sink(log_format), a program sets log as it likes. */
    const char *log_format;
    /* Idempotent publishing (default 0): each batch goes to its stream
     * through one server-side script call that appends a message only if
     * its publish marker does not exist, so a message published twice within
     * idempotent_retention_ms is appended once. Costs one marker key (about
     * 100 bytes) per message for the retention. */
    int idempotent;
    /* How long publish markers are kept; default 3600000 ms. */
    uint64_t idempotent_retention_ms;
    /* "HOST:PORT" to serve Prometheus /metrics and /healthz on, or NULL for
     * none; default NULL. Copied. */
    const char *metrics_listen;
    /* /healthz answers 503 once Redis has been unreachable this long;
     * default 30000 ms. */
    uint64_t health_redis_down_ms;
    /* Published rows older than this are deleted, oldest first, from a
     * timer, in transactions of at most retention_batch rows and about 1 ms
     * on a libuv worker thread with a database connection of its own (never
     * on the loop); default 86400000 ms (24 h), 0 keeps them forever. Dead
     * rows are never deleted. */
    uint64_t retention_ms;
    /* Rows deleted per retention transaction at most (a transaction also
     * ends after about 1 ms with the write lock); default 1000. */
    unsigned retention_batch;
    /* The user for AUTH to the sentinels, when redis_url is a
     * redis-sentinel:// URL and the sentinels need other credentials than
     * the URL's (those are the data nodes'). Default NULL. Copied. Set with
     * another URL: OUTBOX_EINVAL. */
    const char *sentinel_user;
    /* The sentinels' password (see sentinel_user); default NULL: no AUTH to
     * the sentinels. Copied. */
    const char *sentinel_password;
    /* The metrics endpoint's web configuration file (YAML, the format of
     * Prometheus' exporter-toolkit: tls_server_config for TLS,
     * basic_auth_users for Basic authentication with bcrypt hashes), or NULL
     * for plain HTTP without authentication; default NULL. Read, with the
     * files it names, by outbox_relay_create: a file that cannot be used is
     * an OUTBOX_EINVAL naming the problem. Needs metrics_listen. Not kept
     * after create. */
    const char *metrics_web_config;
    /* TLS for a rediss:// URL: the trust store, a client certificate, the
     * server name, insecure. Each field's default is stated in
     * outbox/tls.h (all NULL and 0: the system's trust store, the URL's host,
     * verification on). The files are read by outbox_relay_create, once; any
     * of these set with a redis:// or unix:// URL is refused there. The
     * strings are not kept after create. */
    outbox_tls_settings tls;
    /* What create does when the database cannot be opened for a reason
     * that can pass by itself: a full disk (SQLITE_FULL, an I/O error such
     * as a -wal or -shm file that cannot be created or grown for want of
     * space) or a lock that outlasts create's wait (SQLITE_BUSY). Default 0:
     * create fails with OUTBOX_EIO or OUTBOX_EBUSY. 1: create succeeds and
     * the relay waits for its database, as it waits for an unreachable
     * Redis: it logs a warning (then a reminder every 30 s), tries the open
     * again on a worker thread after 100 ms, doubling to 5 s, with jitter,
     * serves /metrics (without the database figures) and /healthz (503
     * naming the database and why), and once the open succeeds starts as
     * usual; it connects to Redis only then. outbox_relay_db_waiting() says
     * whether it waits. What someone must fix still fails create: not a
     * database, corrupt, no, a foreign or a newer schema, a missing or
     * read-only file. Such a problem found during the wait (the file could
     * not be read at create) is logged as an error and tried again like the
     * rest. With drain, drain_timeout_ms counts the wait too. outbox-relay
     * sets it (and with --drain exits 1 at once instead of waiting). */
    int wait_for_db;
    /* A group's /metrics: the backlog and oldest pending age of at most
     * this many databases, those with the largest backlog, and of all the
     * others together (db="other"); default 20, 0: only "other". */
    unsigned metrics_db_limit;
} outbox_relay_settings;

/* Fills s with the defaults documented above (db_path, redis_url NULL). */
OUTBOX_API void outbox_relay_defaults(outbox_relay_settings *s);

/*
 * Validates the settings, opens the database (which must hold the outbox
 * schema, migrated to this library's version if older) and prepares the
 * statements. No network activity yet. s is copied. err (may be NULL) names
 * the offending setting or the database problem. Returns 0, OUTBOX_EINVAL
 * (a setting, or a TLS file that cannot be used; err names it),
 * OUTBOX_EURL, OUTBOX_ENOSCHEMA, OUTBOX_ESCHEMANEWER, OUTBOX_EFOREIGN, OUTBOX_ENOTDB, OUTBOX_EIO,
 * OUTBOX_EBUSY, OUTBOX_ESQLITE, OUTBOX_ENOMEM (with wait_for_db, not
 * OUTBOX_EIO or OUTBOX_EBUSY for a full disk or a lock: see there). loop
 * is borrowed and must outlive the relay.
 *
 * Unlike everything the relay does once started, create runs its SQLite work
 * on the calling thread, and it may wait there for a lock: when reading the
 * schema, or migrating an older one, meets a lock, it tries again every
 * 10 ms (sqlite3_sleep), 200 times at most (about 2 s, plus the tries
 * themselves), and then fails with OUTBOX_EBUSY. That happens only while
 * another connection keeps the database from being read (its WAL recovery
 * after a crash, or PRAGMA locking_mode=EXCLUSIVE), or while the schema must
 * be migrated and another connection holds the write lock (its own
 * migration, or an ordinary writer's transaction: the migration waits for
 * its commit). A writer's transaction on a database whose schema is current
 * does not make create wait: in WAL mode a reader never waits for a writer.
 * Call it before the loop runs, or accept that pause.
 */
OUTBOX_API int outbox_relay_create(outbox_relay **out, uv_loop_t *loop, const outbox_relay_settings *s,
                                   char *err, size_t errlen);

/* Connects to Redis (retrying with backoff while it is unreachable) and
 * starts scanning; with wait_for_db and a database create could not open,
 * it first waits for the database (see wait_for_db; /metrics and /healthz
 * are served meanwhile, and outbox_relay_stop works during the wait).
 * Returns 0, OUTBOX_ESTATE if already started, or OUTBOX_EIO /
 * OUTBOX_EINVAL when metrics_listen cannot be bound (the relay then stays
 * unstarted: destroy it). */
OUTBOX_API int outbox_relay_start(outbox_relay *r);

/*
 * Graceful stop: no new claims; waits up to shutdown_timeout_ms for the
 * replies of what is in flight, marks them, hands every other claimed row
 * back (pending, lease cleared, due now) so another relay can take it at
 * once, closes the Redis connection and every handle, then calls cb (may be
 * NULL) on the loop thread. Returns 0, or OUTBOX_ESTATE if already stopping
 * or stopped (cb is then not called).
 */
OUTBOX_API int outbox_relay_stop(outbox_relay *r, void (*cb)(outbox_relay *r, void *data), void *data);

/* Frees the relay. If it is still running it is stopped first and freed
 * when its handles are closed (the loop must keep running for that). NULL
 * is a no-op. */
OUTBOX_API void outbox_relay_destroy(outbox_relay *r);

/* How a drain ended: 0 once it was done, OUTBOX_ETIMEDOUT when
 * drain_timeout_ms expired first (rows were left), OUTBOX_ECONFIG when
 * Redis cannot be used as configured (see drain: rows were left, the log
 * says why), OUTBOX_ESTATE before any of these or without drain
 * mode, OUTBOX_EINVAL for NULL. For on_drained. */
OUTBOX_API int outbox_relay_drain_result(const outbox_relay *r);

/* 1 while the relay waits for its database (wait_for_db), with the
 * reason of the last failed open in why (may be NULL; cut to len,
 * NUL-terminated); 0 once the database is open, or when the relay never
 * waited; OUTBOX_EINVAL for a NULL r. Loop thread. */
OUTBOX_API int outbox_relay_db_waiting(const outbox_relay *r, char *why, size_t len);

/* Wakes the relay to scan now, e.g. right after the application committed
 * messages. Thread-safe; cheap; calls coalesce; a no-op before start. */
OUTBOX_API void outbox_relay_wake(outbox_relay *r);

/*
 * Wakes the relay after every commit on the application's connection db,
 * through sqlite3_wal_hook(). Registering a WAL hook turns SQLite's automatic
 * checkpointing off on db, so the relay takes it over (PASSIVE checkpoints on
 * a worker thread when the WAL passes 1000 pages, 8000 while draining). If db waits for locks
 * (a busy timeout, PRAGMA busy_timeout > 0, or the busy wait outbox_db_open
 * sets, outbox_db_busy_wait), its wait is replaced by a busy handler
 * with the same total wait that wakes the moment the relay's own transaction
 * ends, instead of SQLite's default sleeps of up to 100 ms (on a loop
 * thread, such a sleep holds up everything); while such a connection is
 * attached, the relay also starts its next transaction right after a short
 * one (under 1 ms), without the pause of at least 1 ms it otherwise leaves
 * for other connections' busy handlers. May be called before
 * outbox_relay_start (wake-ups begin with the start).
 *
 * A connection has one WAL hook and one busy handler. A WAL hook installed
 * on db after attach, with sqlite3_wal_hook() or with PRAGMA
 * wal_autocheckpoint=N (which installs SQLite's own checkpointing hook),
 * replaces the relay's: db's commits then no longer wake the relay at once
 * (it notices them as it notices another process's commits, through its
 * watch on the WAL file, or at its next scan). Likewise a busy timeout or
 * busy handler set on db after attach replaces the relay's handler.
 *
 * Call attach and detach from the thread that owns db, and
 * outbox_relay_detach(db) before closing db or destroying the relay. Detach
 * removes the relay's hooks and gives db back what it had at attach: its
 * busy wait (unless a busy timeout was set on db since: that one stays; a
 * busy handler set since is replaced by it) and its auto-checkpoint (PRAGMA
 * wal_autocheckpoint, 1000 pages unless changed; a WAL hook of the
 * application's that db had before attach is not restored). After PRAGMA
 * wal_autocheckpoint=N on db, detach leaves SQLite's hook and N in place. A
 * WAL hook of the application's own installed with sqlite3_wal_hook() after
 * attach is removed by detach (SQLite cannot tell whose hook is installed):
 * install it again after detach. Detach of a connection that is not
 * attached, or NULL, does nothing.
 *
 * attach returns 0 (also when db is attached to r already: nothing
 * changes), OUTBOX_EINVAL (r or db is NULL), OUTBOX_ESTATE (db is attached
 * to another relay: detach it first) or OUTBOX_ENOMEM (nothing changed).
 */
OUTBOX_API int outbox_relay_attach(outbox_relay *r, sqlite3 *db);
OUTBOX_API void outbox_relay_detach(sqlite3 *db);

typedef struct outbox_relay_stats {
    /* Rows by state, from the database (see outbox_relay_stats_get for how
     * fresh). -1 when not known. */
    int64_t pending, sending, published, dead;
    /* Age in ms of the oldest due pending row, 0 if none. */
    int64_t oldest_pending_ms;
    /* This relay since start. */
    uint64_t published_total, failed_total, dead_total, fenced_total, reconnects;
    /* Claimed and not yet marked, now. */
    uint64_t inflight;
    /* 1 while connected to Redis. */
    int redis_connected;
} outbox_relay_stats;

/* Fills st (loop thread). Never queries the database itself: the figures
 * by state and the oldest pending age are the ones /metrics shows, read on
 * a worker thread through a read-only connection of the relay's own (from
 * the batch records, the cursor and the indexes, never a pass over the rows:
 * proto/schema.md, "The figures") and at most about a second old (a call
 * finding them older starts a refresh, which a later call sees). The counters since start and the window are
 * current. Returns 0; OUTBOX_EBUSY before the first refresh finished, or
 * OUTBOX_ESQLITE when the last refresh failed (the database figures are
 * then -1); OUTBOX_EINVAL for a NULL argument. */
OUTBOX_API int outbox_relay_stats_get(outbox_relay *r, outbox_relay_stats *st);

/* One node of a Redis Cluster, as the relay sees it (redis-cluster:// and
 * rediss-cluster:// URLs; see outbox_relay_nodes_get). */
typedef struct outbox_relay_node_stats {
    char node[64];     /* "host:port" ("[v6]:port"), cut to fit, NUL-terminated */
    int connected;     /* 1 while the relay's connection to it is up */
    int master;        /* 1 while it serves slots in the relay's slot map */
    uint64_t moved;    /* MOVED redirections it answered */
    uint64_t ask;      /* ASK redirections it answered */
    uint64_t tryagain; /* TRYAGAIN, CLUSTERDOWN, LOADING or READONLY replies retried */
    uint64_t errors;   /* connections to it that failed or were lost */
} outbox_relay_node_stats;

/* Fills out[0..cap) with the cluster nodes the relay knows (loop thread),
 * *n (may be NULL) with how many there are (more than cap: the rest left
 * out) and *refreshes (may be NULL) with the slot map refreshes done. With
 * a URL that is not a cluster's, *n and *refreshes are 0. Returns 0, or
 * OUTBOX_EINVAL for a NULL r, or a NULL out with cap > 0. */
OUTBOX_API int outbox_relay_nodes_get(outbox_relay *r, outbox_relay_node_stats *out, size_t cap, size_t *n,
                                      uint64_t *refreshes);


/*
 * A group: one relay process for many databases, e.g. a directory of
 * SQLite files, one per tenant (outbox-relay --db-dir). Each database is
 * published exactly as by a relay of its own (leases, fencing, retries,
 * dead letters, retention, checkpoints, idempotent, wait_replicas: the
 * settings given to create apply to each), over one Redis connection layer
 * for all (TLS, Sentinel, Cluster); its stream entries and their envelopes
 * name it (field and key "db": db_name, the file name without its
 * directory and without ".db"), per-key order holds per (database, topic,
 * key), and idempotent markers are per database. Streams stay
 * <stream_prefix><topic>, one per topic for every database.
 *
 * A database has a relay of its own (its SQLite connections, its timers)
 * only while it has work: one with nothing due, leased, in flight or
 * waiting for a retry for 5 s is closed, and costs nothing but its entry.
 * Commits to a closed database are seen through a watch on its directory
 * (inotify: one watch per directory, whatever the number of databases),
 * within milliseconds; a row delayed by the application or waiting for its
 * retry reopens it when it becomes due, a lease that runs out (its holder
 * died) when it does, and so do published rows that
 * retention deletes (a 24th of retention_ms after they come due, between
 * 1 s and 1 h, so that one reopening deletes a span of them; not in drain
 * mode). At most max_open_dbs databases are
 * open at once (the least recently used idle one is closed first; when none
 * is idle, one that ran for a second or more hands its rows back and waits
 * for its turn again), and each open database's in-flight window is
 * inflight divided among the open ones (at least batch): one database's
 * backlog does not hold back the others beyond its share.
 *
 * A database that cannot be opened (corrupt, foreign schema, locked,
 * unreadable) affects only itself: logged once per reason, tried again
 * after 1 s doubling to 60 s; a SQLite file without an outbox table yet is
 * looked at again when it changes. Files that appear in db_dir and match
 * db_glob join the group, files removed leave it (their relay stopped
 * first). A database may also be added and removed by name on a running
 * group (an application that opens its tenants itself). There is no
 * outbox_relay_attach for a group's databases: their commits are seen
 * through the directory watch, which also sees the application's own.
 *
 * Drain mode (drain): every database found at start, and each that appears
 * meanwhile, is drained as outbox_relay_settings.drain describes, then the
 * group's on_drained (outbox_relay_group_on_drained) is called, or the
 * group stops; outbox_relay_group_drain_result names each database that
 * could not be drained. drain_timeout_ms counts for the whole group.
 * With metrics_listen the group serves /metrics (outbox_databases by state,
 * outbox_database_failing for up to 20 failing databases, the publish
 * counters summed over databases, outbox_inflight, outbox_redis_connected)
 * and /healthz (503 only for Redis: unreachable for health_redis_down_ms,
 * or not usable as configured; a failing database is named in the body of
 * a 200), and outbox_database_backlog / outbox_database_oldest_pending_seconds
 * for the metrics_db_limit databases with the largest backlog and for the
 * rest together (db="other"): each database's figures as last seen, those
 * of its relay while it is open (at most about a second old), 0 once it
 * drained; a database never opened yet is not counted.
 * A database is opened (its schema checked, migrated if older, its
 * statements prepared) on a libuv worker thread, never on the loop; a lock
 * met there makes it fail, to be tried again. Loop thread, all of it.
 */
typedef struct outbox_relay_group outbox_relay_group;

/* s: the settings of every database (db_path and db_name must be NULL;
 * db_dir, db_glob, max_open_dbs say which and how many; metrics_listen is
 * the group's). db_dir must be a directory. Returns 0, OUTBOX_EINVAL (err
 * names the setting), OUTBOX_EURL, OUTBOX_ENOMEM. */
OUTBOX_API int outbox_relay_group_create(outbox_relay_group **out, uv_loop_t *loop, const outbox_relay_settings *s,
                                         char *err, size_t errlen);
/* Called once when a drain ends (see drain mode above); it may stop the
 * group. Without it the group stops itself. */
OUTBOX_API void outbox_relay_group_on_drained(outbox_relay_group *g,
                                              void (*cb)(outbox_relay_group *g, void *data), void *data);
/* Adds the database at path under name (unique in the group: it goes into
 * its stream entries), before or after start; its directory is watched.
 * Returns 0, OUTBOX_EINVAL, OUTBOX_EDUPLICATE (that name or that file is in
 * the group), OUTBOX_ESTATE (stopping), OUTBOX_ENOMEM. A file that cannot
 * be opened is not an error here: it fails, and is tried again, as above. */
OUTBOX_API int outbox_relay_group_add(outbox_relay_group *g, const char *name, const char *path, char *err,
                                      size_t errlen);
/* Removes a database: its relay stops (rows in flight awaited up to
 * shutdown_timeout_ms, the rest handed back), then it leaves the group.
 * 0, or OUTBOX_ESTATE when no database has that name. */
OUTBOX_API int outbox_relay_group_remove(outbox_relay_group *g, const char *name);
/* Connects to Redis, watches the directories, and opens the databases that
 * have work. 0, OUTBOX_ESTATE, OUTBOX_EIO (db_dir cannot be watched: the
 * group then stops, destroy it; or metrics_listen cannot be bound),
 * OUTBOX_EINVAL. */
OUTBOX_API int outbox_relay_group_start(outbox_relay_group *g);
/* Stops every database's relay as outbox_relay_stop does, then the
 * connection; cb (may be NULL) once all is closed. 0 or OUTBOX_ESTATE. */
OUTBOX_API int outbox_relay_group_stop(outbox_relay_group *g, void (*cb)(outbox_relay_group *g, void *data),
                                       void *data);
/* Frees the group (stopping it first if it runs; the loop must run for
 * that). NULL is a no-op. */
OUTBOX_API void outbox_relay_group_destroy(outbox_relay_group *g);
/* How a drain ended: 0 every database drained; OUTBOX_EIO some could not be
 * (corrupt, unreadable, ...: named in failed, "name (reason), ...", cut to
 * len); OUTBOX_ETIMEDOUT drain_timeout_ms expired; OUTBOX_ECONFIG Redis
 * cannot be used as configured; OUTBOX_ESTATE before the end. */
OUTBOX_API int outbox_relay_group_drain_result(const outbox_relay_group *g, char *failed, size_t len);

typedef struct outbox_relay_group_stats {
    size_t databases;  /* in the group */
    size_t open;       /* with a relay running now */
    size_t closed;     /* idle (or about to open) */
    size_t failed;     /* could not be opened: retried */
    size_t not_outbox; /* SQLite files without an outbox table (yet) */
    uint64_t published_total, failed_total, dead_total; /* since start, every database */
    uint64_t inflight;  /* claimed and not yet marked, now */
    int redis_connected;
} outbox_relay_group_stats;

/* Fills st (loop thread). 0 or OUTBOX_EINVAL. */
OUTBOX_API int outbox_relay_group_stats_get(const outbox_relay_group *g, outbox_relay_group_stats *st);

enum {
    OUTBOX_GROUP_DB_UNKNOWN = 0, /* no database of that name */
    OUTBOX_GROUP_DB_CLOSED = 1,
    OUTBOX_GROUP_DB_OPEN = 2,
    OUTBOX_GROUP_DB_FAILED = 3,
    OUTBOX_GROUP_DB_NOT_OUTBOX = 4,
};
/* The state of the database called name (OUTBOX_GROUP_DB_*), with the
 * reason of a failure in why (may be NULL): why it cannot be opened, why it
 * is not an outbox, or, for an open one whose transactions fail with an
 * error other than a lock (a full or read-only filesystem, an I/O error;
 * retried), that error; "" otherwise. OUTBOX_EINVAL. */
OUTBOX_API int outbox_relay_group_db_state(const outbox_relay_group *g, const char *name, char *why, size_t len);

#ifdef __cplusplus
}
#endif

#endif
