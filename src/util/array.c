/*
 * array.c: outbox__grow (see array.h), the one place where the library's and
 * the tools' growable arrays choose a new capacity and check its size.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outbox/common.h"
#include "util/array.h"

int outbox__grow(void *arrp, size_t *cap, size_t len, size_t more, size_t size, size_t first)
{
    size_t need, ncap;
    void *p, *np;
    if (more > SIZE_MAX - len)
        return OUTBOX_ENOMEM;
    need = len + more;
    if (need <= *cap)
        return 0;
    ncap = *cap ? *cap : first ? first : 1;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2)
            return OUTBOX_ENOMEM;
        ncap *= 2;
    }
    if (size && ncap > SIZE_MAX / size)
        return OUTBOX_ENOMEM;
    memcpy(&p, arrp, sizeof p);
    np = realloc(p, ncap * size);
    if (!np)
        return OUTBOX_ENOMEM;
    memcpy(arrp, &np, sizeof np);
    *cap = ncap;
    return 0;
}
