/*
 * settings.c: reading, writing and checking the fields that a settings
 * table's rows name (settings.h).
 */
#include <stdio.h>
#include <string.h>

#include "outbox/common.h"
#include "util/settings.h"
#include "util/util.h"

uint64_t outbox__option_get(const void *s, const outbox__option *o)
{
    const void *f = (const char *)s + o->off;
    switch (o->type) {
    case OUTBOX__OPT_UINT:
        return *(const unsigned *)f;
    case OUTBOX__OPT_U64:
        return *(const uint64_t *)f;
    case OUTBOX__OPT_SIZE:
        return *(const size_t *)f;
    case OUTBOX__OPT_FLAG:
        return (uint64_t)*(const int *)f;
    case OUTBOX__OPT_LEVEL:
        return (uint64_t)*(const outbox_log_level *)f;
    case OUTBOX__OPT_STR:
        break;
    }
    return 0;
}

void outbox__option_set(void *s, const outbox__option *o, uint64_t v)
{
    void *f = (char *)s + o->off;
    switch (o->type) {
    case OUTBOX__OPT_UINT:
        *(unsigned *)f = (unsigned)v;
        break;
    case OUTBOX__OPT_U64:
        *(uint64_t *)f = v;
        break;
    case OUTBOX__OPT_SIZE:
        *(size_t *)f = (size_t)v;
        break;
    case OUTBOX__OPT_FLAG:
        *(int *)f = v != 0;
        break;
    case OUTBOX__OPT_LEVEL:
        *(outbox_log_level *)f = (outbox_log_level)v;
        break;
    case OUTBOX__OPT_STR:
        break;
    }
}

int outbox__option_in_range(const outbox__option *o, uint64_t v)
{
    if (o->type == OUTBOX__OPT_FLAG)
        return 1; /* any int: not 0 is on */
    return (v >= o->min && v <= o->max) || (v == 0 && (o->flags & OUTBOX__OPT_ZERO));
}

void outbox__option_range(const outbox__option *o, char *buf, size_t len)
{
    snprintf(buf, len, "%llu..%llu%s", (unsigned long long)o->min, (unsigned long long)o->max,
             o->flags & OUTBOX__OPT_ZERO ? ", or 0" : "");
}

int outbox__option_check(const void *s, const outbox__option *opts, size_t n, char *err, size_t errlen)
{
    char range[64];
    for (size_t i = 0; i < n; i++) {
        const outbox__option *o = &opts[i];
        uint64_t v;
        if (o->type == OUTBOX__OPT_STR) {
            const char *str = *(const char *const *)((const char *)s + o->off);
            if ((o->flags & OUTBOX__OPT_REQUIRED) && (!str || !*str))
                return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: required, not given", o->name);
            if (str && (o->min || o->max) && (strlen(str) < o->min || strlen(str) > o->max))
                return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: %zu bytes, need %llu..%llu", o->name,
                                    strlen(str), (unsigned long long)o->min, (unsigned long long)o->max);
            continue;
        }
        v = outbox__option_get(s, o);
        if (outbox__option_in_range(o, v))
            continue;
        outbox__option_range(o, range, sizeof range);
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: %llu is out of range %s", o->name,
                            (unsigned long long)v, range);
    }
    return 0;
}
