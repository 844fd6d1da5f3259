/*
 * error.c: the library's error codes as text (outbox_strerror,
 * outbox_err_name, both from the one table OUTBOX_ERRNO_MAP in
 * outbox/common.h), outbox__errf for the messages that go with them, and
 * the version string and wall clock every part of the library reads.
 */
#include <sys/time.h>
#include <time.h>

#include <stdio.h>

#include "util/util.h"
#include "outbox/common.h"

int outbox__errf(char *err, size_t errlen, int code, const char *fmt, ...)
{
    va_list ap;
    if (err && errlen) {
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

const char *outbox_strerror(int err)
{
    switch (err) {
    case 0:
        return "success";
#define XX(name, val, msg)                                                                         \
    case OUTBOX_##name:                                                                            \
        return msg;
        OUTBOX_ERRNO_MAP(XX)
#undef XX
    }
    return "unknown error";
}

const char *outbox_err_name(int err)
{
    switch (err) {
    case 0:
        return "OK";
#define XX(name, val, msg)                                                                         \
    case OUTBOX_##name:                                                                            \
        return #name;
        OUTBOX_ERRNO_MAP(XX)
#undef XX
    }
    return "UNKNOWN";
}

const char *outbox_version(void)
{
    return OUTBOX_VERSION_STRING;
}

int64_t outbox_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
