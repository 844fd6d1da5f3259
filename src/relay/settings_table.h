/*
 * settings_table.h: the relay's settings that outbox-relay takes as options,
 * each written once, as one row of a table (not installed; the tools and
 * tests include it as "relay/settings_table.h").
 *
 * From the table come outbox_relay_defaults(), the range checks of
 * outbox__relay_check_settings() (the checks between settings stay code),
 * and in outbox-relay (tools/relay/config.c) the parsing of flags,
 * environment variables and the INI file and the option list of --help.
 * README.md's option table and the defaults stated in outbox/relay.h are
 * checked against it (tests/relay/test_options_doc.c).
 *
 * OUTBOX__RELAY_SETTINGS(X) calls
 *     X(name, type, field, flags, def, min, max, arg, shown, help)
 * once per option:
 *   name   the option: flag --NAME, environment variable OUTBOX_<NAME>
 *          (upper case, '-' as '_'), key NAME in the --config file
 *   type   STR, UINT, U64, SIZE, FLAG or LEVEL: the C type of the field
 *          (const char *, unsigned, uint64_t, size_t, int 0/1,
 *          outbox_log_level)
 *   field  the member of outbox_relay_settings (a member of a member, like
 *          tls.ca_file, is documented in the sub-struct's header)
 *   flags  0, OUTBOX__OPT_REQUIRED (no default: must be given) or
 *          OUTBOX__OPT_ZERO (0 is accepted too, outside min..max: the help
 *          says what it means)
 *   def    the default value, as outbox_relay_defaults() sets it
 *   min, max  the range of a number (both 0 for strings and flags)
 *   arg    the value's name in --help (NULL for a flag)
 *   shown  the default as --help and README.md show it when it is not the
 *          value itself (a derived default, a NULL string), else NULL
 *   help   what the option does, one sentence without a final period and
 *          without the default (--help appends "(default X)")
 *
 * A new option is one row here plus its field in outbox/relay.h (with its
 * default stated there) and its row in README.md.
 */
#ifndef OUTBOX_SRC_RELAY_SETTINGS_TABLE_H
#define OUTBOX_SRC_RELAY_SETTINGS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "outbox/relay.h"
#include "outbox/writer.h"
#include "util/settings.h"

#define OUTBOX__STR_(x) #x
#define OUTBOX__STR(x) OUTBOX__STR_(x)

/* Defaults that follow lease_ms while the field is 0 (not set): a third of
 * the lease for the reply timeout, a quarter for WAIT's, so that together
 * they stay below the lease whatever it is, and a connection stuck on a
 * reply (or on WAIT) is given up before its messages' leases expire. Only
 * values set explicitly can contradict the lease; those are refused. */
#define OUTBOX__REPLY_TIMEOUT_MAX_MS 10000
#define OUTBOX__REPLY_TIMEOUT_LEASE_DIV 3
#define OUTBOX__WAIT_TIMEOUT_MAX_MS 1000
#define OUTBOX__WAIT_TIMEOUT_LEASE_DIV 4
#define OUTBOX__REPLY_TIMEOUT_SHOWN                                                                                   \
    "lease-ms/" OUTBOX__STR(OUTBOX__REPLY_TIMEOUT_LEASE_DIV) ", at most " OUTBOX__STR(OUTBOX__REPLY_TIMEOUT_MAX_MS)
#define OUTBOX__WAIT_TIMEOUT_SHOWN                                                                                    \
    "lease-ms/" OUTBOX__STR(OUTBOX__WAIT_TIMEOUT_LEASE_DIV) ", at most " OUTBOX__STR(OUTBOX__WAIT_TIMEOUT_MAX_MS)

#define OUTBOX__RELAY_SETTINGS(X)                                                                                     \
    X("db", STR, db_path, OUTBOX__OPT_REQUIRED, NULL, 0, 0, "PATH", NULL,                                             \
      "SQLite database holding the outbox table (or --db-dir)")                                                                    \
    X("db-dir", STR, db_dir, 0, NULL, 0, 0, "DIR", "none",                                                            \
      "instead of --db: publish every database in DIR matching --db-glob, one process for all, found as they "      \
      "appear (a directory watch)")                                                                                  \
    X("db-glob", STR, db_glob, 0, "*.db", 0, 0, "PATTERN", NULL,                                                      \
      "with --db-dir: which file names are databases, fnmatch patterns separated by commas (the option may be "     \
      "given more than once)")                                                                                       \
    X("stream-template", STR, stream_template, 0, NULL, 0, 0, "TEMPLATE", "prefix + topic",                          \
      "with --db-dir: each message's stream, %db and %topic replaced (%topic at the end), e.g. "                    \
      "tenant:%db:outbox:%topic for a stream per tenant")                                                            \
    X("max-open-dbs", UINT, max_open_dbs, 0, 1024, 1, 1000000, "N", NULL,                                             \
      "with --db-dir: databases open at once at most, the least recently used idle one closed first")               \
    X("metrics-db-limit", UINT, metrics_db_limit, 0, 20, 0, 100000, "N", NULL,                                       \
      "with --db-dir: /metrics names the backlog and oldest pending age of this many databases with the largest "   \
      "backlog, and of the others together as db=\"other\"")                                                        \
    X("redis", STR, redis_url, OUTBOX__OPT_REQUIRED, NULL, 0, 0, "URL", NULL,                                         \
      "redis:// or rediss:// (TLS) [[user]:password@]host[:port][/db], unix:///path/to/sock[?db=N], "               \
      "redis-sentinel:// or rediss-sentinel:// [[user]:password@]host[:port][,host[:port]...][/db]#master, or "     \
      "redis-cluster:// or rediss-cluster:// [[user]:password@]host[:port][,host[:port]...] (a Redis Cluster's "    \
      "seed nodes)")                                                                                                 \
    X("sentinel-user", STR, sentinel_user, 0, NULL, 0, 0, "USER", "none",                                            \
      "redis-sentinel:// only: the user for AUTH to the sentinels (the URL's credentials are the data nodes')")      \
    X("sentinel-password", STR, sentinel_password, 0, NULL, 0, 0, "PASSWORD", "none",                                \
      "redis-sentinel:// only: the password for AUTH to the sentinels")                                             \
    X("batch", UINT, batch, 0, 512, 1, 100000, "N", NULL, "rows claimed per SQLite transaction")                     \
    X("inflight", UINT, inflight, 0, 8192, 1, 1000000, "N", NULL,                                                     \
      "messages claimed and not yet marked, at most: memory is bounded by this, not by the backlog")                 \
    X("lease-ms", U64, lease_ms, 0, 30000, 1000, 86400000, "MS", NULL,                                                \
      "lease of a claimed row; expired leases are taken over by any relay")                                          \
    X("scan-interval-ms", U64, scan_interval_ms, 0, 1000, 1, 3600000, "MS", NULL,                                     \
      "fallback scan when no wake-up arrives")                                                                       \
    X("max-attempts", UINT, max_attempts, 0, 10, 1, 1000000, "N", NULL,                                               \
      "failed publish attempts before a row becomes dead")                                                           \
    X("backoff-min-ms", U64, backoff_min_ms, 0, 500, 1, 86400000, "MS", NULL,                                         \
      "first retry delay; doubles per attempt, with jitter")                                                         \
    X("backoff-max-ms", U64, backoff_max_ms, 0, 60000, 1, 86400000, "MS", NULL, "largest retry delay")               \
    X("stream-prefix", STR, stream_prefix, 0, "outbox:", 0, 0, "STR", NULL, "stream name is prefix + topic")          \
    X("maxlen", U64, maxlen, 0, 0, 0, UINT64_MAX / 2, "N", NULL, "trim each stream with XADD MAXLEN ~ N; 0 = off")   \
    X("max-payload", SIZE, max_payload, 0, OUTBOX_PAYLOAD_DEFAULT_MAX, 1, OUTBOX_PAYLOAD_HARD_MAX, "BYTES", NULL,     \
      "rows with a larger payload are dead-lettered")                                                                \
    X("worker-id", STR, worker_id, 0, NULL, 0, 0, "ID", "HOSTNAME:PID", "lease owner name")                           \
    X("shutdown-timeout-ms", U64, shutdown_timeout_ms, 0, 10000, 0, 3600000, "MS", NULL,                              \
      "on SIGTERM, how long to wait for in-flight replies")                                                          \
    X("wait-replicas", UINT, wait_replicas, 0, 0, 0, 100, "N", NULL,                                                  \
      "mark published only after WAIT N succeeds; 0 = off")                                                          \
    X("wait-timeout-ms", U64, wait_timeout_ms, OUTBOX__OPT_ZERO, 0, 1, 86400000, "MS", OUTBOX__WAIT_TIMEOUT_SHOWN,   \
      "the WAIT timeout; when given, below half of --lease-ms")                                                      \
    X("connect-timeout-ms", U64, connect_timeout_ms, 0, 5000, 1, 3600000, "MS", NULL,                                 \
      "Redis connect + handshake timeout")                                                                           \
    X("reply-timeout-ms", U64, reply_timeout_ms, OUTBOX__OPT_ZERO, 0, 1, 3600000, "MS", OUTBOX__REPLY_TIMEOUT_SHOWN, \
      "a connection whose oldest command waited this long for its reply (counted from the reply before it) is "     \
      "dropped (its messages sent again); when given, below --lease-ms "                                              \
      "(less the WAIT timeout with --wait-replicas)")                                                                \
    X("log-level", LEVEL, log_level, 0, OUTBOX_LOG_INFO, OUTBOX_LOG_DEBUG, OUTBOX_LOG_ERROR, "LEVEL", NULL,          \
      "debug, info, warn or error")                                                                                  \
    X("log-format", STR, log_format, 0, "logfmt", 0, 0, "FORMAT", NULL,                                              \
      "logfmt, or json for one JSON object per line with the same fields (ts, level, msg, ...)")                     \
    X("drain", FLAG, drain, 0, 0, 0, 0, NULL, NULL,                                                                   \
      "exit 0 once nothing is due, nothing is leased, nothing is in flight and no row waits for a retry (rows "      \
      "delayed by the application, never attempted, do not count); exit 2 at once when Redis cannot be used as "     \
      "configured (credentials refused, an ACL forbidding XADD, a cluster node behind a plain URL, a master no "     \
      "sentinel knows), the rows left pending")                                                                      \
    X("drain-timeout-ms", U64, drain_timeout_ms, OUTBOX__OPT_ZERO, 0, 1, 2592000000ull, "MS", NULL,                   \
      "with --drain: stop after this long even if rows are left, log how many and exit 1; 0 = no limit")             \
    X("idempotent", FLAG, idempotent, 0, 0, 0, 0, NULL, NULL,                                                         \
      "publish through a server-side script that appends each message once per retention")                           \
    X("idempotent-retention-ms", U64, idempotent_retention_ms, 0, 3600000, 1000, 2592000000ull, "MS", NULL,           \
      "how long publish markers are kept")                                                                           \
    X("metrics-listen", STR, metrics_listen, 0, NULL, 0, 0, "HOST:PORT", "off",                                       \
      "serve Prometheus /metrics and /healthz (e.g. 127.0.0.1:9464)")                                                \
    X("metrics-web-config", STR, metrics_web_config, 0, NULL, 0, 0, "FILE", "none",                                   \
      "with --metrics-listen: TLS and basic auth for the endpoint, a web configuration file as Prometheus "          \
      "exporters take (tls_server_config, basic_auth_users with bcrypt hashes)")                                     \
    X("health-redis-down-ms", U64, health_redis_down_ms, 0, 30000, 1, 86400000, "MS", NULL,                           \
      "/healthz answers 503 once Redis has been unreachable this long")                                              \
    X("retention-ms", U64, retention_ms, OUTBOX__OPT_ZERO, 86400000, 1000, 3650ull * 86400000, "MS", NULL,            \
      "delete published rows older than this (never dead rows); 0 keeps them")                                       \
    X("retention-batch", UINT, retention_batch, 0, 1000, 1, 100000, "N", NULL,                                        \
      "rows deleted per retention transaction at most (it also ends after about 1 ms)")                                                                      \
    X("tls-ca-file", STR, tls.ca_file, 0, NULL, 0, 0, "FILE", "the system's trust store",                            \
      "rediss:// only: PEM file of the certificate authorities that verify the server")                            \
    X("tls-ca-dir", STR, tls.ca_dir, 0, NULL, 0, 0, "DIR", "the system's trust store",                               \
      "rediss:// only: directory of CA certificates named by subject hash (openssl rehash); may be combined with "   \
      "--tls-ca-file")                                                                                               \
    X("tls-cert-file", STR, tls.cert_file, 0, NULL, 0, 0, "FILE", "none",                                            \
      "rediss:// only: client certificate (PEM) for servers that require one (mutual TLS); needs --tls-key-file")   \
    X("tls-key-file", STR, tls.key_file, 0, NULL, 0, 0, "FILE", "none",                                              \
      "rediss:// only: the private key of --tls-cert-file (PEM, not encrypted)")                                   \
    X("tls-server-name", STR, tls.server_name, 0, NULL, 0, 0, "NAME", "the URL's host",                              \
      "rediss:// only: the name sent as SNI and verified against the server's certificate")                        \
    X("tls-insecure", FLAG, tls.insecure, 0, 0, 0, 0, NULL, NULL,                                                     \
      "rediss:// only: verify nothing (any certificate, any name); logged as a warning at every connect")

/* One row of the table, as data (util/settings.h; settings.c expands the
 * table into outbox__relay_options). */
typedef outbox__option outbox__relay_option;

extern const outbox__relay_option outbox__relay_options[];
extern const size_t outbox__relay_noptions;

/* The row named name (an option name without dashes), or NULL. */
const outbox__relay_option *outbox__relay_option_find(const char *name);

/* A number, flag or log level field of s as a number (0 for a string). */
uint64_t outbox__relay_option_get(const outbox_relay_settings *s, const outbox__relay_option *o);
/* Sets a number, flag or log level field of s; v must be in range. */
void outbox__relay_option_set(outbox_relay_settings *s, const outbox__relay_option *o, uint64_t v);
/* 1 when v is in o's range (min..max, or 0 with OUTBOX__OPT_ZERO). */
int outbox__relay_option_in_range(const outbox__relay_option *o, uint64_t v);
/* o's range as messages show it: "1..100000", or "1000..86400000, or 0". */
void outbox__relay_option_range(const outbox__relay_option *o, char *buf, size_t len);

/* The name of the first TLS option (a tls.* field) that s sets, or NULL:
 * they apply to rediss:// URLs only. */
const char *outbox__relay_tls_option_given(const outbox_relay_settings *s);

/* The reply and WAIT timeouts in effect: the field, or while it is 0 the
 * default derived from lease_ms. */
uint64_t outbox__relay_reply_timeout(const outbox_relay_settings *s);
uint64_t outbox__relay_wait_timeout(const outbox_relay_settings *s);

#endif
