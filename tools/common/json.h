/*
 * json.h: the JSON text that outbox-replay and outbox-consume print, written
 * into an outbox__sbuf (src/util/sbuf.h): strings, base64 and msgpack objects.
 *
 * Every function appends to b; an allocation failure shows as b->oom, which
 * the caller checks once after building its text.
 */
#ifndef OUTBOX_TOOLS_COMMON_JSON_H
#define OUTBOX_TOOLS_COMMON_JSON_H

#include <stddef.h>

#include <msgpack.h>

#include "util/sbuf.h"

/* n bytes of s as a JSON string: quotes, backslashes and control characters
 * escaped, U+2028/U+2029 escaped for JavaScript consumers, and every byte
 * that is not part of valid UTF-8 replaced by U+FFFD, so the output is
 * always valid JSON in valid UTF-8 whatever the input. */
void tools_json_str(outbox__sbuf *b, const void *s, size_t n);
/* A NUL-terminated string as tools_json_str() writes it; null for NULL. */
void tools_json_cstr(outbox__sbuf *b, const char *s);
/* n bytes of s in standard base64 with padding, without quotes. */
void tools_base64(outbox__sbuf *b, const void *s, size_t n);
/* Whether all n bytes of s are valid UTF-8 (see outbox__utf8_prefix()). */
int tools_utf8_valid(const void *s, size_t n);
/* n bytes of s as a JSON string when they are valid UTF-8, else their
 * base64 in quotes. Returns 1 for text, 0 for base64, so that the caller
 * can say which. */
int tools_json_text_or_base64(outbox__sbuf *b, const void *s, size_t n);

/* How a msgpack object becomes JSON where the two have no common form.
 * Both write nil, booleans, integers, arrays and maps as their JSON
 * counterparts, floats with 17 significant digits (non-finite ones as null)
 * and containers nested deeper than 32 levels as null. */
typedef enum tools_msgpack_style {
    /* outbox-replay show: no bytes are lost. A str is a JSON string (invalid
     * UTF-8 as U+FFFD), bin is {"base64": "..."}, ext is
     * {"ext_type": n, "base64": "..."}, and a map key that is not a str
     * becomes its own JSON text as a string (the key 1 becomes "1"). */
    TOOLS_MSGPACK_TAGGED,
    /* outbox-consume: plain values. A str is a JSON string when it is valid
     * UTF-8 and its base64 as a string when not, bin is its base64 as a
     * string, ext is null, and a map key that is not a str becomes "?". */
    TOOLS_MSGPACK_PLAIN,
} tools_msgpack_style;

void tools_json_msgpack(outbox__sbuf *b, const msgpack_object *o, tools_msgpack_style style);

#endif
