/*
 * sbuf.h: a growable string buffer (internal), for the library's text
 * (the Prometheus exposition) and for the tools, which link the static
 * archive.
 *
 * A zeroed outbox__sbuf is empty and ready. Appending grows it as needed and
 * keeps p NUL-terminated once anything was appended (p stays NULL until
 * then). When an allocation fails the buffer sets oom and ignores every
 * later append, so a caller builds the whole text and checks oom once at
 * the end; what is in p is then incomplete and must not be used.
 */
#ifndef OUTBOX_SRC_SBUF_H
#define OUTBOX_SRC_SBUF_H

#include <stddef.h>

typedef struct outbox__sbuf {
    char *p;
    size_t len, cap;
    int oom;
} outbox__sbuf;

void outbox__sbuf_printf(outbox__sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends n bytes of s, which may hold NUL bytes. */
void outbox__sbuf_put(outbox__sbuf *b, const void *s, size_t n);
void outbox__sbuf_puts(outbox__sbuf *b, const char *s);
/* Empties the buffer and clears oom, keeping the memory for reuse. */
void outbox__sbuf_reset(outbox__sbuf *b);
/* Frees the memory and leaves the buffer zeroed (empty and ready again). */
void outbox__sbuf_free(outbox__sbuf *b);

#endif
