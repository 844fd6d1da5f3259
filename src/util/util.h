/*
 * util.h: helpers shared by the library's modules (not installed). The
 * string helpers are declared in str.h, which this header includes, so that
 * a module that logs has them too.
 */
#ifndef OUTBOX_SRC_UTIL_H
#define OUTBOX_SRC_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "outbox/common.h"
#include "util/str.h"

#define OUTBOX_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* A log target: a sink, its data and the least severe level it wants. */
typedef struct outbox__logger {
    outbox_log_fn fn;
    void *data;
    outbox_log_level min_level;
} outbox__logger;

/* The longest fragment outbox__log() formats; longer ones are cut. */
#define OUTBOX__LOG_LINE_MAX 1024

/* Formats a logfmt fragment and hands it to the sink if level is enabled.
 * A NULL logger or sink drops the line. */
void outbox__log(const outbox__logger *lg, outbox_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One JSON line (with its newline, NUL-terminated) for a logfmt fragment,
 * written into out (cap bytes with the NUL, at least 16) and its length
 * returned (0 when cap is smaller): ts and
 * level, then every key=value of msg in order, each value a JSON string.
 * Quoted values are decoded as outbox__logfmt_quote() encodes them; a word
 * without '=' becomes "word":"true". Whatever msg holds (raw quotes, bytes
 * that are not UTF-8, more than fits), the line is one valid JSON object:
 * text that does not fit is cut. outbox_log_json() writes these lines. */
size_t outbox__log_json_format(char *out, size_t cap, const char *ts, outbox_log_level level, const char *msg);

/* Appends `value` to buf as a logfmt value: bare when it has no spaces,
 * quotes, '=' or control characters, otherwise quoted with \" \\ \n escapes
 * and other control bytes as \xNN. Always NUL-terminates (truncates). */
void outbox__logfmt_quote(char *buf, size_t len, const char *value);

/* The exact size of e's envelope, and the envelope written at out (that many
 * bytes; returns their end): outbox_envelope_encode without its checks and
 * bound, for a caller that lays out a buffer of its own (envelope.c). */
struct outbox_envelope;
size_t outbox__envelope_size(const struct outbox_envelope *e);
char *outbox__envelope_put(const struct outbox_envelope *e, char *out);

/* Formats a message into err (when err is not NULL and errlen > 0) and
 * returns code: `return outbox__errf(err, errlen, OUTBOX_EINVAL, ...)`. */
int outbox__errf(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* A pseudo-random number from a per-thread xorshift generator seeded from
 * the clock and the pid; not for anything secret. */
uint64_t outbox__rand64(void);

/* Exponential backoff with jitter: attempt 1 waits about min_ms, each
 * further attempt doubles it, capped at max_ms; the wait is drawn from
 * [d/2, d]. attempt < 1 counts as 1. */
uint64_t outbox__backoff_ms(uint64_t min_ms, uint64_t max_ms, int64_t attempt);

#endif
