/*
 * backoff.c: exponential backoff with jitter, for the relay's retries and
 * the Redis connection's reconnects.
 */
#include <unistd.h>

#include <uv.h>

#include "util/util.h"

uint64_t outbox__rand64(void)
{
    /* Seeded per thread from the clock and the pid: processes that lost
     * Redis together must not come back in step, and rand() is never
     * seeded here, so it would give every process the same sequence. */
    static __thread uint64_t x;
    if (x == 0)
        x = (uv_hrtime() * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)getpid() << 20) ^ 1;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

uint64_t outbox__backoff_ms(uint64_t min_ms, uint64_t max_ms, int64_t attempt)
{
    uint64_t d = min_ms;
    for (int64_t i = 1; i < attempt && d < max_ms; i++)
        d *= 2;
    if (d > max_ms)
        d = max_ms;
    return d / 2 + outbox__rand64() % (d / 2 + 1);
}
