/* libFuzzer target: the metrics endpoint's request head parser. */
#include <stdint.h>
#include <string.h>

#include "ops/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    outbox__http_head h;
    /* The server never hands it more than 8 KiB. */
    if (size > 8192)
        size = 8192;
    int status = outbox__http_parse_head((const char *)data, size, &h);
    if (status == 200 && strlen(h.path) > OUTBOX_HTTP_PATH_MAX)
        __builtin_trap();
    /* The Authorization value is kept whole or flagged, never cut short. */
    if (h.auth_len > OUTBOX_HTTP_AUTH_MAX || (status == 200 && h.auth_count == 1 && strlen(h.auth) != h.auth_len &&
                                              !memchr(h.auth, '\0', h.auth_len)))
        __builtin_trap();
    return 0;
}
