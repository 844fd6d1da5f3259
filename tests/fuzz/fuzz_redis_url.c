/* libFuzzer target: the Redis URL parser. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "redis/redis.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1), err[256], desc[512];
    outbox__redis_url u, copy;
    if (!s)
        return 0;
    memcpy(s, data, size);
    s[size] = '\0';
    if (outbox__redis_url_parse(s, &u, err, sizeof err) == 0) {
        outbox__redis_url_describe(&u, desc, sizeof desc);
        if (outbox__redis_url_copy(&copy, &u) == 0)
            outbox__redis_url_free(&copy);
        outbox__redis_url_free(&u);
    }
    free(s);
    return 0;
}
