/*
 * UUIDv7 (RFC 9562): 48 bits of unix milliseconds, then a 12-bit counter
 * (method 1: seeded at random each new millisecond, incremented within one)
 * and 62 random bits. Ids from one process strictly increase, also when the
 * wall clock steps back (the last timestamp is kept until time catches up).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

#include "outbox/writer.h"

static pthread_mutex_t uuid_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t uuid_last_ms;
static uint32_t uuid_counter;
/* Random bytes fetched 4 KiB at a time: one getrandom() per id was a
 * measurable share of an enqueue. Consumed under uuid_lock. */
static unsigned char uuid_pool[4096];
static size_t uuid_pool_left;
static pthread_once_t uuid_once = PTHREAD_ONCE_INIT;

/* A forked child must not hand out its parent's remaining bytes. */
static void uuid_atfork_child(void)
{
    uuid_pool_left = 0;
}

static void uuid_init(void)
{
    pthread_atfork(NULL, NULL, uuid_atfork_child);
}

static void fill_random(void *buf, size_t len)
{
    unsigned char *p = buf;
    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n <= 0)
            continue; /* EINTR; getrandom does not fail otherwise once seeded */
        p += n;
        len -= (size_t)n;
    }
}

void outbox_uuid7(char buf[37])
{
    unsigned char b[16];
    uint64_t ms;
    uint32_t counter;
    static const char hex[] = "0123456789abcdef";
    int i, o = 0;

    pthread_once(&uuid_once, uuid_init);
    pthread_mutex_lock(&uuid_lock);
    if (uuid_pool_left < sizeof b) {
        fill_random(uuid_pool, sizeof uuid_pool);
        uuid_pool_left = sizeof uuid_pool;
    }
    memcpy(b, uuid_pool + sizeof uuid_pool - uuid_pool_left, sizeof b);
    uuid_pool_left -= sizeof b;
    ms = (uint64_t)outbox_now_ms();
    if (ms > uuid_last_ms) {
        uuid_last_ms = ms;
        /* Seed with the high bit clear so that the counter has room to grow. */
        uuid_counter = ((uint32_t)b[6] << 8 | b[7]) & 0x7ff;
    } else if (++uuid_counter > 0xfff) {
        uuid_last_ms++;
        uuid_counter = ((uint32_t)b[6] << 8 | b[7]) & 0x7ff;
    }
    ms = uuid_last_ms;
    counter = uuid_counter;
    pthread_mutex_unlock(&uuid_lock);

    for (i = 0; i < 6; i++)
        b[i] = (unsigned char)(ms >> (40 - 8 * i));
    b[6] = (unsigned char)(0x70 | (counter >> 8));
    b[7] = (unsigned char)(counter & 0xff);
    b[8] = (unsigned char)(0x80 | (b[8] & 0x3f));
    for (i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            buf[o++] = '-';
        buf[o++] = hex[b[i] >> 4];
        buf[o++] = hex[b[i] & 15];
    }
    buf[o] = '\0';
}
