/*
 * writer.h: writing outbox messages inside the application's transaction.
 *
 * The writer is the heart of the pattern: the application calls
 * outbox_enqueue() on its own connection, inside its own open transaction,
 * between its business writes and its COMMIT. The message becomes visible to
 * the relay exactly when that transaction commits, and vanishes with it if it
 * rolls back. The writer never begins, commits or rolls back anything; outside
 * a transaction an enqueue is a single autocommit INSERT.
 *
 *     sqlite3_exec(db, "BEGIN IMMEDIATE", 0, 0, 0);
 *     ... business INSERT/UPDATE ...
 *     outbox_message m = { .topic = "orders", .key = order_id,
 *                          .payload = json, .payload_len = json_len };
 *     char id[OUTBOX_ID_MAX + 1];
 *     if (outbox_enqueue(w, &m, id) != 0) { ROLLBACK or handle; }
 *     sqlite3_exec(db, "COMMIT", 0, 0, 0);
 *
 * Threads: a writer belongs to its sqlite3 connection; use it wherever (and
 * only where) you may use that connection. Different connections may have
 * writers on different threads. The id generator is thread-safe.
 */
#ifndef OUTBOX_WRITER_H
#define OUTBOX_WRITER_H

#include <sqlite3.h>

#include "outbox/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the contract (proto/schema.md). */
#define OUTBOX_ID_MAX 128      /* bytes of a message id */
#define OUTBOX_TOPIC_MAX 128   /* bytes of a topic */
#define OUTBOX_KEY_MAX 512     /* bytes of an ordering key */
#define OUTBOX_PAYLOAD_DEFAULT_MAX (1024 * 1024)
#define OUTBOX_PAYLOAD_HARD_MAX (64 * 1024 * 1024)

typedef struct outbox_writer outbox_writer;

typedef struct outbox_writer_settings {
    /* Largest payload accepted, in bytes. Default OUTBOX_PAYLOAD_DEFAULT_MAX
     * (1 MiB); at most OUTBOX_PAYLOAD_HARD_MAX. The relay has its own limit
     * (same default) and dead-letters larger rows written by plain SQL. */
    size_t max_payload;
    /* When non-zero (default 1), outbox_writer_create() warns through `log`
     * if the connection's commits are not durable (synchronous below FULL). */
    int warn_not_durable;
    /* Log sink; default outbox_log_stderr. NULL silences the writer. */
    outbox_log_fn log;
    void *log_data;
} outbox_writer_settings;

/* Fills s with the defaults documented above. */
OUTBOX_API void outbox_writer_defaults(outbox_writer_settings *s);

/*
 * Creates a writer on db (borrowed: it must outlive the writer). Prepares the
 * cached INSERT statement, so the outbox schema must exist. s may be NULL for
 * the defaults; it is copied. Returns 0, OUTBOX_EINVAL (bad settings),
 * OUTBOX_ENOSCHEMA (no outbox table), OUTBOX_ENOMEM, OUTBOX_ESQLITE.
 */
OUTBOX_API int outbox_writer_create(outbox_writer **out, sqlite3 *db, const outbox_writer_settings *s);

/* Finalizes the statement and frees the writer. NULL is a no-op. */
OUTBOX_API void outbox_writer_destroy(outbox_writer *w);

/* One message. All pointers are borrowed for the duration of the call. */
typedef struct outbox_message {
    /* The stable message id (1..128 printable ASCII, no spaces), or NULL to
     * generate a time-ordered UUIDv7. */
    const char *id;
    /* 1..128 bytes of A-Z a-z 0-9 . _ - : / ; the stream is <prefix><topic>. */
    const char *topic;
    /* Ordering key (1..512 bytes, NUL-terminated) or NULL / "" for none:
     * messages sharing a key reach their stream in commit order. */
    const char *key;
    /* The payload: any bytes, payload_len of them (NULL only when 0). */
    const void *payload;
    size_t payload_len;
    /* Optional headers: a msgpack map with string keys, headers_len bytes,
     * or NULL. */
    const void *headers;
    size_t headers_len;
    /* Unix ms before which the relay must not publish; 0 for now. */
    int64_t available_at;
} outbox_message;

/*
 * Trace context (W3C Trace Context, proto/envelope.md): the recommended
 * header names that carry a trace from the writer to the consumer, which
 * outbox-consume passes on as TRACEPARENT and TRACESTATE.
 */
#define OUTBOX_HEADER_TRACEPARENT "traceparent"
#define OUTBOX_HEADER_TRACESTATE "tracestate"
/* A traceparent is exactly this long: 00-<32 hex>-<16 hex>-<2 hex>. */
#define OUTBOX_TRACEPARENT_LEN 55
/* The longest tracestate accepted, as W3C Trace Context bounds it. */
#define OUTBOX_TRACESTATE_MAX 512

/* 0 when traceparent (or tracestate, not NULL) is one as
 * outbox_headers_trace() requires, else OUTBOX_EINVAL with the reason in err
 * (may be NULL). Consumers use them to ignore a bad trace context. */
OUTBOX_API int outbox_validate_traceparent(const char *traceparent, char *err, size_t errlen);
OUTBOX_API int outbox_validate_tracestate(const char *tracestate, char *err, size_t errlen);

/*
 * Puts trace context into a headers map for outbox_message.headers: a copy
 * of headers (headers_len bytes, or NULL for none) with "traceparent" set to
 * traceparent and, when tracestate is neither NULL nor "", "tracestate" set
 * to it; entries of headers with those keys are replaced, every other entry
 * is kept as it is. The new map is malloc'ed into *out (*out_len bytes);
 * the caller frees it with free() after the enqueue. headers, traceparent
 * and tracestate are borrowed for the call. err (may be NULL) receives the
 * reason of a failure. Returns 0 or:
 *   OUTBOX_EINVAL    out or out_len is NULL; traceparent is NULL or not
 *                    version-traceid-parentid-flags: 55 characters, two
 *                    hex digits of a version other than ff, 32 of a trace
 *                    id and 16 of a parent id (neither all zeros) and 2 of
 *                    flags, lowercase hex separated by '-'; tracestate is
 *                    longer than OUTBOX_TRACESTATE_MAX or has a byte
 *                    outside printable ASCII;
 *   OUTBOX_EHEADERS  headers are not a msgpack map with string keys (as
 *                    outbox_validate_headers() checks);
 *   OUTBOX_ENOMEM.
 * On failure *out is NULL.
 */
OUTBOX_API int outbox_headers_trace(const void *headers, size_t headers_len, const char *traceparent,
                                    const char *tracestate, void **out, size_t *out_len, char *err, size_t errlen);

/*
 * Inserts one message with the cached statement. id_out (may be NULL)
 * receives the id used, NUL-terminated, in a buffer of OUTBOX_ID_MAX + 1
 * bytes. On any error the statement fails alone: the caller's transaction and
 * everything it wrote stay intact, to commit or roll back as it decides.
 * Returns 0 or:
 *   OUTBOX_EINVAL      w or m is NULL, or payload NULL with a length;
 *   OUTBOX_EID         the given id is empty, too long or has a byte outside
 *                      '!'..'~';
 *   OUTBOX_ETOPIC      topic NULL, empty, too long or with another character;
 *   OUTBOX_EKEY        key longer than OUTBOX_KEY_MAX or not valid UTF-8;
 *   OUTBOX_ETOOBIG     payload_len above the writer's max_payload;
 *   OUTBOX_EHEADERS    headers are not exactly one msgpack map with string keys;
 *   OUTBOX_EDUPLICATE  a message with this id exists already;
 *   OUTBOX_ENOSCHEMA   the outbox table is gone;
 *   OUTBOX_EBUSY       the database is locked (outside a transaction, or a
 *                      deferred transaction that could not get the write lock);
 *   OUTBOX_ESQLITE     any other SQLite error.
 * outbox_writer_errmsg() then says exactly what was wrong.
 */
OUTBOX_API int outbox_enqueue(outbox_writer *w, const outbox_message *m, char *id_out);

/* The detail of the writer's last error ("topic 'a b' has ' ' at byte 1"),
 * "" after a success. Valid until the next call on w. */
OUTBOX_API const char *outbox_writer_errmsg(const outbox_writer *w);

/* Validation alone, as outbox_enqueue does it (for tools and other writers).
 * err may be NULL. Each returns 0 or the code outbox_enqueue would. */
OUTBOX_API int outbox_validate_id(const char *id, char *err, size_t errlen);
OUTBOX_API int outbox_validate_topic(const char *topic, char *err, size_t errlen);
OUTBOX_API int outbox_validate_key(const char *key, size_t len, char *err, size_t errlen);
OUTBOX_API int outbox_validate_headers(const void *headers, size_t len, char *err, size_t errlen);

/* Writes a new UUIDv7 (time-ordered, 36 characters plus NUL) into buf.
 * Thread-safe; ids from one process are strictly increasing. */
OUTBOX_API void outbox_uuid7(char buf[37]);

#ifdef __cplusplus
}
#endif

#endif
