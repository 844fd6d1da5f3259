/*
 * str.c: the string helpers of str.h. They live here, below every module,
 * because the logger, the writer, the schema code and the tools all use
 * them: kept in the writer and the logger, where they were first needed,
 * they made the logger, the writer and the schema code call each other in
 * a circle.
 */
#include <string.h>

#include "util/str.h"

size_t outbox__strlcpy(char *dst, const char *src, size_t len)
{
    size_t n = strlen(src);
    if (len) {
        size_t c = n < len - 1 ? n : len - 1;
        memcpy(dst, src, c);
        dst[c] = '\0';
    }
    return n;
}

size_t outbox__utf8_seq(const unsigned char *s, size_t n, uint32_t *cp)
{
    uint32_t c;
    size_t len, i;
    if (n == 0)
        return 0;
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] >= 0xc2 && s[0] <= 0xdf) {
        len = 2;
        c = s[0] & 0x1f;
    } else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        len = 3;
        c = s[0] & 0x0f;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        len = 4;
        c = s[0] & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && c < 0x800) || (len == 4 && (c < 0x10000 || c > 0x10ffff)) || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}

size_t outbox__utf8_prefix(const unsigned char *s, size_t len)
{
    size_t i = 0, l;
    uint32_t cp;
    while (i < len) {
        l = outbox__utf8_seq(s + i, len - i, &cp);
        if (l == 0)
            return i;
        i += l;
    }
    return len;
}
