/*
 * outbox: a transactional outbox relay from SQLite to Redis Streams.
 *
 * common.h: version, error codes and logging shared by every part of the
 * library. Every public function that can fail returns 0 on success or one of
 * the negative OUTBOX_E* codes below; outbox_strerror() turns a code into a
 * message and outbox_err_name() into its symbolic name. A function that
 * returns an error never calls the callback it was given.
 */
#ifndef OUTBOX_COMMON_H
#define OUTBOX_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "outbox/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(OUTBOX_BUILDING) && defined(__GNUC__)
#define OUTBOX_API __attribute__((visibility("default")))
#else
#define OUTBOX_API
#endif

/* OUTBOX_VERSION_MAJOR, _MINOR, _PATCH and _STRING (e.g. "1.2.3") come from
 * outbox/version.h, which meson generates from the project's version. */

/* The outbox table schema version this library creates and understands
 * (stored in PRAGMA user_version, see proto/schema.md). */
#define OUTBOX_SCHEMA_VERSION 7

/*
 * Error codes. XX(name, message). Values are negative and stable: scripts
 * and other languages may rely on them.
 */
#define OUTBOX_ERRNO_MAP(XX)                                                   \
    XX(EINVAL, -1, "invalid argument")                                         \
    XX(ENOMEM, -2, "out of memory")                                            \
    XX(EDUPLICATE, -3, "a message with this id already exists")                \
    XX(ETOPIC, -4, "invalid topic")                                            \
    XX(EID, -5, "invalid message id")                                          \
    XX(EKEY, -6, "invalid ordering key")                                       \
    XX(ETOOBIG, -7, "payload larger than the configured limit")               \
    XX(EHEADERS, -8, "headers are not a msgpack map")                          \
    XX(ESQLITE, -9, "SQLite error")                                            \
    XX(EBUSY, -10, "database is locked")                                       \
    XX(ENOTDB, -11, "file is not a SQLite database")                           \
    XX(ENOSCHEMA, -12, "database has no outbox schema")                        \
    XX(ESCHEMANEWER, -13, "outbox schema is newer than this library")          \
    XX(EFOREIGN, -14, "table 'outbox' exists but is not an outbox table")      \
    XX(ETRUNCATED, -15, "truncated input")                                     \
    XX(EMALFORMED, -16, "malformed input")                                     \
    XX(EVERSION, -17, "unsupported envelope version")                          \
    XX(EURL, -18, "invalid Redis URL")                                         \
    XX(ECONNECT, -19, "cannot connect to Redis")                               \
    XX(ETIMEDOUT, -20, "timed out")                                            \
    XX(ECLOSED, -21, "connection closed")                                      \
    XX(EPROTO, -22, "Redis protocol error")                                    \
    XX(EREDIS, -23, "Redis answered with an error")                            \
    XX(EAUTH, -24, "Redis authentication failed")                              \
    XX(ESTATE, -25, "operation not allowed in the current state")              \
    XX(ECANCELED, -26, "operation canceled")                                   \
    XX(EIO, -27, "I/O error")                                                  \
    XX(ERANGE, -28, "value out of range")                                      \
    XX(ELEASE, -29, "lease lost: this owner no longer holds it")             \
    XX(ETLS, -30, "TLS failure")                                               \
    XX(ECONFIG, -31, "Redis cannot be used as configured")

typedef enum outbox_errno {
#define OUTBOX_ERRNO_ENUM(name, val, msg) OUTBOX_##name = (val),
    OUTBOX_ERRNO_MAP(OUTBOX_ERRNO_ENUM)
#undef OUTBOX_ERRNO_ENUM
    OUTBOX_ERRNO_MIN_ = -31
} outbox_errno;

/* A static message for an error code; "unknown error" for anything else.
 * Never returns NULL. */
OUTBOX_API const char *outbox_strerror(int err);

/* The symbolic name of an error code without the prefix ("EDUPLICATE"), or
 * "UNKNOWN". Never returns NULL. */
OUTBOX_API const char *outbox_err_name(int err);

/* The library's version as a string, e.g. "0.1.0". */
OUTBOX_API const char *outbox_version(void);

/* Log levels, in increasing severity. */
typedef enum outbox_log_level {
    OUTBOX_LOG_DEBUG = 0,
    OUTBOX_LOG_INFO = 1,
    OUTBOX_LOG_WARN = 2,
    OUTBOX_LOG_ERROR = 3
} outbox_log_level;

/*
 * A log sink. `msg` is one logfmt fragment without a trailing newline, e.g.
 * `msg="claim failed" err=EBUSY`; the sink adds time and level as it likes.
 * The string is only valid during the call. Called on the thread that
 * produced the event (the loop thread for the relay).
 */
typedef void (*outbox_log_fn)(void *data, outbox_log_level level, const char *msg);

/* The default sink: `ts=... level=... <msg>` lines on stderr. data is
 * ignored. */
OUTBOX_API void outbox_log_stderr(void *data, outbox_log_level level, const char *msg);

/* The same lines as JSON objects, one per line on stderr, for log pipelines
 * that want JSON: {"ts":"2026-12-01T10:00:00.123Z","level":"warn","msg":...}
 * with every key=value of msg after ts and level, in order, each value a
 * JSON string (logfmt's quoting undone). Every line is valid JSON in UTF-8
 * whatever msg holds: bytes that are not UTF-8 become U+FFFD, a line longer
 * than 8 KiB is cut. data is ignored. */
OUTBOX_API void outbox_log_json(void *data, outbox_log_level level, const char *msg);

/* The stderr sink for a format name as the tools' --log-format takes it:
 * outbox_log_stderr for "logfmt", outbox_log_json for "json", NULL for
 * anything else (including NULL). */
OUTBOX_API outbox_log_fn outbox_log_sink(const char *format);

/* The current wall-clock time in unix milliseconds, as stored in the outbox
 * table's created_at/available_at columns. */
OUTBOX_API int64_t outbox_now_ms(void);

#ifdef __cplusplus
}
#endif

#endif /* OUTBOX_COMMON_H */
