/*
 * msgpack_check.h: a bounds-checked walk over msgpack data (internal).
 *
 * msgpack-c allocates a container's elements before it reads them, so a
 * declared map of 2^32 entries in a few bytes of input could make it attempt
 * a huge allocation. Input from outside (headers, stream entries) is walked
 * with this first: every declared length must fit in the bytes that remain.
 */
#ifndef OUTBOX_SRC_MSGPACK_CHECK_H
#define OUTBOX_SRC_MSGPACK_CHECK_H

#include <stddef.h>

/* Walks exactly one object starting at data. Returns 0 and sets *used,
 * OUTBOX_ETRUNCATED if the data ends inside it, or OUTBOX_EMALFORMED for a
 * reserved type byte, nesting deeper than 64, or a container that declares
 * more elements than bytes remain. */
int outbox__msgpack_check(const void *data, size_t len, size_t *used);

#endif
