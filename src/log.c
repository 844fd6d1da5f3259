#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void outbox_log_stderr(void *data, outbox_log_level level, const char *msg)
{
    struct timespec ts;
    struct tm tm;
    char when[32];
    (void)data;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    if ((unsigned)level > OUTBOX_LOG_ERROR)
        level = OUTBOX_LOG_ERROR;
    /* One fprintf per line so that concurrent writers do not interleave. */
    fprintf(stderr, "ts=%s.%03ldZ level=%s %s\n", when, ts.tv_nsec / 1000000L, level_names[level], msg);
}

void outbox__log(const outbox__logger *lg, outbox_log_level level, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    if (!lg || !lg->fn || level < lg->min_level)
        return;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    lg->fn(lg->data, level, line);
}

void outbox__logfmt_quote(char *buf, size_t len, const char *value)
{
    size_t o = 0;
    int needs = value[0] == '\0';
    const unsigned char *p;
    if (len == 0)
        return;
    for (p = (const unsigned char *)value; *p; p++)
        if (*p <= ' ' || *p == '"' || *p == '=' || *p == '\\' || *p == 0x7f)
            needs = 1;
    if (!needs) {
        outbox__strlcpy(buf, value, len);
        return;
    }
#define PUT(c)                                                                                     \
    do {                                                                                           \
        if (o + 1 < len)                                                                           \
            buf[o++] = (char)(c);                                                                  \
    } while (0)
    PUT('"');
    for (p = (const unsigned char *)value; *p && o + 6 < len; p++) {
        if (*p == '"' || *p == '\\') {
            PUT('\\');
            PUT(*p);
        } else if (*p == '\n') {
            PUT('\\');
            PUT('n');
        } else if (*p < ' ' || *p == 0x7f) {
            static const char hex[] = "0123456789abcdef";
            PUT('\\');
            PUT('x');
            PUT(hex[*p >> 4]);
            PUT(hex[*p & 15]);
        } else {
            PUT(*p);
        }
    }
    PUT('"');
#undef PUT
    buf[o] = '\0';
}

size_t outbox__strlcpy(char *dst, const char *src, size_t len)
{
    size_t n = strlen(src);
    if (len) {
        size_t c = n < len - 1 ? n : len - 1;
        memcpy(dst, src, c);
        dst[c] = '\0';
    }
    return n;
}
