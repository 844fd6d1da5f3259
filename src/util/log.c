#include <stdio.h>
#include <string.h>
#include <time.h>

#include "util/util.h"

static const char *const level_names[] = {"debug", "info", "warn", "error"};

/* The time of a line, as both formats write it: 2026-12-01T10:00:00.123Z. */
static void timestamp(char when[40])
{
    struct timespec ts;
    struct tm tm;
    char sec[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(sec, sizeof sec, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(when, 40, "%.24s.%03dZ", sec, (int)(ts.tv_nsec / 1000000L) % 1000);
}

static const char *level_name(outbox_log_level level)
{
    return level_names[(unsigned)level > OUTBOX_LOG_ERROR ? OUTBOX_LOG_ERROR : level];
}

void outbox_log_stderr(void *data, outbox_log_level level, const char *msg)
{
    char when[40];
    (void)data;
    timestamp(when);
    /* One fprintf per line so that concurrent writers do not interleave. */
    fprintf(stderr, "ts=%s level=%s %s\n", when, level_name(level), msg);
}

/* ---- JSON lines ------------------------------------------------------------ */

/* A JSON line being built in a fixed buffer: logging allocates nothing. Text
 * that does not fit is cut, never the closing characters, so the line stays
 * one valid JSON object. */
enum { JSON_CLOSING = 8 };
typedef struct json_line {
    char *p;
    size_t len, cap;
    int full; /* something was cut: nothing but closing characters follows */
} json_line;

/* Appends n bytes when they fit with reserve bytes to spare; closing
 * characters pass reserve 0, everything else JSON_CLOSING, which keeps room
 * for them. */
static void json_raw(json_line *j, const char *s, size_t n, size_t reserve)
{
    if (reserve && (j->full || j->len + n + reserve > j->cap)) {
        j->full = 1;
        return;
    }
    if (j->len + n > j->cap)
        return;
    memcpy(j->p + j->len, s, n);
    j->len += n;
}

/* The code point of the UTF-8 sequence at s (n bytes), its length; 0 if it
 * is not a valid, shortest sequence (util.h). */
size_t outbox__utf8_seq(const unsigned char *s, size_t n, uint32_t *cp)
{
    uint32_t c;
    size_t len, i;
    if (n == 0)
        return 0;
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] >= 0xc2 && s[0] <= 0xdf) {
        len = 2;
        c = s[0] & 0x1f;
    } else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        len = 3;
        c = s[0] & 0x0f;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        len = 4;
        c = s[0] & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && c < 0x800) || (len == 4 && (c < 0x10000 || c > 0x10ffff)) || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}


/* n bytes of s as the inside of a JSON string: quotes, backslashes and
 * control characters escaped, bytes that are not UTF-8 as U+FFFD. A
 * character that does not fit whole is dropped with everything after it. */
static void json_chars(json_line *j, const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        size_t l = outbox__utf8_seq(s + i, n - i, &cp);
        char esc[8];
        if (l == 0) {
            json_raw(j, "\\ufffd", 6, JSON_CLOSING);
            i++;
        } else if (cp == '"' || cp == '\\') {
            esc[0] = '\\';
            esc[1] = (char)cp;
            json_raw(j, esc, 2, JSON_CLOSING);
            i++;
        } else if (cp == '\n') {
            json_raw(j, "\\n", 2, JSON_CLOSING);
            i++;
        } else if (cp < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)cp);
            json_raw(j, esc, 6, JSON_CLOSING);
            i++;
        } else {
            json_raw(j, (const char *)s + i, l, JSON_CLOSING);
            i += l;
        }
        if (j->full)
            return;
    }
}

/* "key":"value", after a comma unless it is the first. The key goes whole
 * or the field not at all; the value may be cut. */
static void json_field(json_line *j, const char *key, size_t klen, const char *value, size_t vlen)
{
    if (j->full || j->len + 2 + 6 * klen + 3 + 2 * JSON_CLOSING > j->cap) {
        j->full = 1;
        return;
    }
    json_raw(j, j->len > 1 ? ",\"" : "\"", j->len > 1 ? 2 : 1, JSON_CLOSING);
    json_chars(j, (const unsigned char *)key, klen);
    json_raw(j, "\":\"", 3, JSON_CLOSING);
    json_chars(j, (const unsigned char *)value, vlen);
    json_raw(j, "\"", 1, 0);
}

static int is_key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
}

/* Whether the '"' at q closes a quoted value: it ends the fragment, or the
 * next field (`key=`) follows it. The library quotes its values with
 * outbox__logfmt_quote(), but a few messages put raw text (a SQLite or
 * Redis error) between quotes; a quote inside such text is taken as part of
 * the value. */
static int closes_value(const char *q)
{
    const char *k = q + 1, *key;
    if (*k == '\0')
        return 1;
    if (*k != ' ')
        return 0;
    k += strspn(k, " ");
    if (*k == '\0')
        return 1;
    for (key = k; is_key_char(*k); k++)
        ;
    return k > key && *k == '=';
}

/* Decodes the quoted value that starts after the '"' at *pp into out (at
 * most cap bytes kept): \" \\ \n \t \r and \xNN escapes as
 * outbox__logfmt_quote() writes them. Moves *pp past the closing quote. */
static size_t unquote(const char **pp, char *out, size_t cap)
{
    const char *p = *pp;
    size_t n = 0;
    static const char hex[] = "0123456789abcdef";
    while (*p && !(*p == '"' && closes_value(p))) {
        char c = *p++;
        if (c == '\\' && *p) {
            const char *h1 = p[0] == 'x' && p[1] ? strchr(hex, p[1] | 0x20) : NULL;
            const char *h2 = h1 && p[2] ? strchr(hex, p[2] | 0x20) : NULL;
            c = *p++;
            if (c == 'n')
                c = '\n';
            else if (c == 't')
                c = '\t';
            else if (c == 'r')
                c = '\r';
            else if (c == 'x' && h1 && h2) {
                c = (char)((h1 - hex) << 4 | (h2 - hex));
                p += 2;
            } else if (c != '"' && c != '\\') {
                p--;
                c = '\\';
            }
        }
        if (n < cap)
            out[n++] = c;
    }
    *pp = *p ? p + 1 : p;
    return n;
}

size_t outbox__log_json_format(char *out, size_t cap, const char *ts, outbox_log_level level, const char *msg)
{
    json_line j = {out, 0, 0, 0};
    char value[OUTBOX__LOG_LINE_MAX];
    const char *p = msg ? msg : "";
    if (cap < 2 * JSON_CLOSING)
        return 0;
    j.cap = cap - 1; /* room for the NUL */
    json_raw(&j, "{", 1, JSON_CLOSING);
    json_field(&j, "ts", 2, ts, strlen(ts));
    json_field(&j, "level", 5, level_name(level), strlen(level_name(level)));
    for (;;) {
        const char *key;
        size_t klen, vlen;
        p += strspn(p, " ");
        if (!*p)
            break;
        key = p;
        while (*p && *p != ' ' && *p != '=')
            p++;
        klen = (size_t)(p - key);
        if (*p != '=') {
            /* A word without a value: a logfmt flag. */
            json_field(&j, key, klen, "true", 4);
            continue;
        }
        p++;
        if (*p == '"') {
            p++;
            vlen = unquote(&p, value, sizeof value);
        } else {
            vlen = strcspn(p, " ");
            memcpy(value, p, vlen < sizeof value ? vlen : sizeof value);
            p += vlen;
            vlen = vlen < sizeof value ? vlen : sizeof value;
        }
        json_field(&j, key, klen, value, vlen);
    }
    json_raw(&j, "}\n", 2, 0);
    out[j.len] = '\0';
    return j.len;
}

void outbox_log_json(void *data, outbox_log_level level, const char *msg)
{
    char when[40], line[8 * OUTBOX__LOG_LINE_MAX];
    size_t n;
    (void)data;
    timestamp(when);
    n = outbox__log_json_format(line, sizeof line, when, level, msg);
    /* One write per line, as for logfmt. */
    fwrite(line, 1, n, stderr);
}

outbox_log_fn outbox_log_sink(const char *format)
{
    if (format && !strcmp(format, "logfmt"))
        return outbox_log_stderr;
    if (format && !strcmp(format, "json"))
        return outbox_log_json;
    return NULL;
}

void outbox__log(const outbox__logger *lg, outbox_log_level level, const char *fmt, ...)
{
    char line[OUTBOX__LOG_LINE_MAX];
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
