/*
 * resp_cmd.h: reading RESP commands, for the tests' stand-in servers
 * (fake_server.c, cluster/fake_node.c).
 */
#ifndef OUTBOX_TESTS_RESP_CMD_H
#define OUTBOX_TESTS_RESP_CMD_H

#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Parses one command (an array of 1..64 bulk strings) at the start of buf.
 * Returns its length, 0 if it is not complete yet, -1 if it is not RESP.
 * The first cap arguments go to argv/argvlen (pointing into buf), *argc
 * says how many. */
static inline long resp_parse_command(const char *buf, size_t len, int cap, int *argc, const char **argv,
                                      size_t *argvlen)
{
    const char *p = buf, *end = buf + len, *nl;
    long n, i;
    if (len == 0)
        return 0;
    if (*p != '*')
        return -1;
    if (!(nl = memchr(p, '\n', len)))
        return 0;
    n = strtol(p + 1, NULL, 10);
    if (n < 1 || n > 64)
        return -1;
    p = nl + 1;
    for (i = 0; i < n; i++) {
        long blen;
        if (p >= end)
            return 0;
        if (*p != '$')
            return -1;
        if (!(nl = memchr(p, '\n', (size_t)(end - p))))
            return 0;
        blen = strtol(p + 1, NULL, 10);
        if (blen < 0)
            return -1;
        p = nl + 1;
        if (end - p < blen + 2)
            return 0;
        if (i < cap) {
            argv[i] = p;
            argvlen[i] = (size_t)blen;
        }
        p += blen + 2;
    }
    *argc = n < cap ? (int)n : cap;
    return (long)(p - buf);
}

/* 1 if the argument (len bytes) is s, case-insensitively. */
static inline int resp_arg_is(const char *a, size_t len, const char *s)
{
    return len == strlen(s) && strncasecmp(a, s, len) == 0;
}

#endif
