/* Error codes: every code has a distinct name and message; unknown codes
 * are reported as such, never NULL. */
#include <string.h>

#include "outbox.h"
#include "tap.h"

int main(void)
{
    static const int codes[] = {
#define XX(name, val, msg) OUTBOX_##name,
        OUTBOX_ERRNO_MAP(XX)
#undef XX
    };
    size_t n = sizeof codes / sizeof codes[0], i, j;
    int distinct = 1;

    for (i = 0; i < n; i++) {
        ok(codes[i] < 0, "code %s is negative", outbox_err_name(codes[i]));
        ok(strcmp(outbox_strerror(codes[i]), "unknown error") != 0, "code %d has a message: %s", codes[i],
           outbox_strerror(codes[i]));
        for (j = 0; j < i; j++)
            if (codes[i] == codes[j] || strcmp(outbox_err_name(codes[i]), outbox_err_name(codes[j])) == 0)
                distinct = 0;
    }
    ok(distinct, "codes and names are distinct");
    is_str(outbox_err_name(OUTBOX_EDUPLICATE), "EDUPLICATE", "name without prefix");
    is_str(outbox_strerror(0), "success", "0 is success");
    is_str(outbox_strerror(-9999), "unknown error", "unknown code");
    is_str(outbox_err_name(12345), "UNKNOWN", "unknown name");
    is_str(outbox_err_name(OUTBOX_ETLS), "ETLS", "TLS failure has its name");
    is_str(outbox_strerror(OUTBOX_ETLS), "TLS failure", "  and its message");
    is_int(OUTBOX_ERRNO_MIN_, codes[n - 1], "OUTBOX_ERRNO_MIN_ is the last code");
    for (i = 1; i < n; i++)
        if (codes[i] != codes[i - 1] - 1)
            break;
    is_int(i, n, "the map is ordered and has no gaps");
    is_str(outbox_version(), OUTBOX_VERSION_STRING, "version string");
    ok(outbox_now_ms() > 1600000000000LL, "now_ms is unix milliseconds");
    return tap_done();
}
