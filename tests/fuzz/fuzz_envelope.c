/* libFuzzer target: the envelope decoder on arbitrary bytes. */
#include <stddef.h>
#include <stdint.h>

#include "outbox/envelope.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    outbox_envelope *e = NULL;
    char err[128];
    if (outbox_envelope_decode(data, size, &e, err, sizeof err) == 0) {
        /* Whatever decodes must encode again. */
        unsigned char buf[1 << 16];
        size_t len;
        if (outbox_envelope_max_size(e) <= sizeof buf)
            outbox_envelope_encode(e, buf, sizeof buf, &len);
        outbox_envelope_free(e);
    }
    return 0;
}
