/*
 * sbuf.c: the growable string buffer of sbuf.h. An allocation failure is
 * remembered in the buffer instead of returned from every append, so that
 * code building a long text (the /metrics page, the tools' JSON) checks once
 * at the end.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/sbuf.h"
#include "util/array.h"

/* Makes room for extra more bytes plus the terminating NUL. Returns 0, or -1
 * with oom set. */
static int reserve(outbox__sbuf *b, size_t extra)
{
    if (b->oom)
        return -1;
    if (OUTBOX__GROW(b->p, &b->cap, b->len + 1, extra, 4096) != 0) {
        b->oom = 1;
        return -1;
    }
    return 0;
}

void outbox__sbuf_printf(outbox__sbuf *b, const char *fmt, ...)
{
    va_list ap;
    int n;
    if (b->oom)
        return;
    for (;;) {
        size_t room = b->cap - b->len;
        va_start(ap, fmt);
        n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        if (reserve(b, (size_t)n) != 0)
            return;
    }
}

void outbox__sbuf_put(outbox__sbuf *b, const void *s, size_t n)
{
    if (reserve(b, n) != 0)
        return;
    /* s may be NULL when n is 0 (an empty blob from SQLite). */
    if (n)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void outbox__sbuf_puts(outbox__sbuf *b, const char *s)
{
    outbox__sbuf_put(b, s, strlen(s));
}

void outbox__sbuf_reset(outbox__sbuf *b)
{
    b->len = 0;
    b->oom = 0;
    if (b->p)
        b->p[0] = '\0';
}

void outbox__sbuf_free(outbox__sbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}
