/* libFuzzer target: header validation (msgpack map check + msgpack-c). */
#include <stddef.h>
#include <stdint.h>

#include "outbox/writer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[128];
    outbox_validate_headers(data, size, err, sizeof err);
    outbox_validate_key((const char *)data, size, err, sizeof err);
    return 0;
}
