/*
 * str.h: string helpers (internal) for the library and the tools: a bounded
 * copy, and the UTF-8 checks that the writer's key validation, the JSON log
 * lines and the tools' JSON writers all apply by the same rules.
 */
#ifndef OUTBOX_SRC_STR_H
#define OUTBOX_SRC_STR_H

#include <stddef.h>
#include <stdint.h>

/* Copies at most len-1 bytes and NUL-terminates; returns src's length. */
size_t outbox__strlcpy(char *dst, const char *src, size_t len);

/* The length of the longest valid UTF-8 prefix of s (len when all of it is
 * valid): overlong forms, surrogates and code points above U+10FFFF are
 * invalid. */
size_t outbox__utf8_prefix(const unsigned char *s, size_t len);
/* The length (1..4) of the valid UTF-8 sequence at the start of s (n bytes),
 * with its code point in *cp; 0 if the bytes there are not valid UTF-8 (by
 * the rules above) or n is 0. */
size_t outbox__utf8_seq(const unsigned char *s, size_t n, uint32_t *cp);

#endif
