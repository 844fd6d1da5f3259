/*
 * array.h: growing an array by doubling its capacity (internal), for the
 * library and the tools.
 *
 * The caller keeps the array's pointer, how many elements it holds and its
 * capacity in elements (a NULL pointer with capacity 0 is an empty array).
 * Before appending `more` elements to `len` ones it calls
 *
 *     if (OUTBOX__GROW(arr, &cap, len, more, first) != 0)
 *         return OUTBOX_ENOMEM;
 *
 * which does nothing when len + more elements fit, and otherwise reallocs
 * the array to a capacity of `first` (an empty array) or of cap doubled, as
 * many times as len + more needs. Doubling keeps appends amortised
 * constant time; `first` is the caller's because a good first size depends
 * on what the array holds (8 cluster nodes, 4096 bytes of text).
 *
 * Every size is checked: a capacity whose doubling or whose byte size would
 * not fit in a size_t is refused with OUTBOX_ENOMEM, as is a failed realloc.
 * On failure the pointer and the capacity are left as they were, so the
 * elements are still there and still the caller's to free.
 *
 * OUTBOX__GROW takes the element size from the array's type. The function
 * under it takes the address of the caller's pointer as void * and reads
 * and writes it with memcpy, which assumes what every platform the project
 * builds on provides: all object pointers have one representation.
 */
#ifndef OUTBOX_SRC_ARRAY_H
#define OUTBOX_SRC_ARRAY_H

#include <stddef.h>

/* arrp: the address of the array pointer (T **); cap: its capacity in
 * elements; room is made for len + more elements of size bytes; first: the
 * capacity of an empty array's first allocation (0 counts as 1). Returns 0
 * or OUTBOX_ENOMEM. */
int outbox__grow(void *arrp, size_t *cap, size_t len, size_t more, size_t size, size_t first);

/* arr: an lvalue of pointer type (not void *); cap: a size_t *. */
#define OUTBOX__GROW(arr, cap, len, more, first) \
    outbox__grow(&(arr), (cap), (len), (more), sizeof *(arr), (first))

#endif
