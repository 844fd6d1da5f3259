#include "json.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#include "util/str.h"

/* Deeper containers are written as null. msgpack-c's unpacker refuses
 * deeper nesting than this anyway (MSGPACK_EMBED_STACK_SIZE), so it only
 * bounds the recursion for objects built some other way. */
#define MSGPACK_DEPTH_MAX 32

int tools_utf8_valid(const void *s, size_t n)
{
    return outbox__utf8_prefix(s, n) == n;
}

void tools_json_str(outbox__sbuf *b, const void *data, size_t n)
{
    const unsigned char *s = data;
    size_t i = 0, run = 0;
    outbox__sbuf_put(b, "\"", 1);
    while (i < n) {
        const char *esc = NULL;
        char hex[8];
        uint32_t cp;
        size_t l = 1;
        unsigned char c = s[i];
        if (c < 0x80) {
            switch (c) {
            case '"':
                esc = "\\\"";
                break;
            case '\\':
                esc = "\\\\";
                break;
            case '\n':
                esc = "\\n";
                break;
            case '\r':
                esc = "\\r";
                break;
            case '\t':
                esc = "\\t";
                break;
            case '\b':
                esc = "\\b";
                break;
            case '\f':
                esc = "\\f";
                break;
            default:
                if (c < 0x20 || c == 0x7f) {
                    snprintf(hex, sizeof hex, "\\u%04x", c);
                    esc = hex;
                }
            }
        } else {
            l = outbox__utf8_seq(s + i, n - i, &cp);
            if (l == 0) {
                esc = "\\ufffd";
                l = 1;
            } else if (cp == 0x2028 || cp == 0x2029) {
                snprintf(hex, sizeof hex, "\\u%04" PRIx32, cp);
                esc = hex;
            }
        }
        if (esc) {
            /* Bytes that need no escape go out in one run before it. */
            if (run)
                outbox__sbuf_put(b, s + i - run, run);
            outbox__sbuf_puts(b, esc);
            run = 0;
        } else {
            run += l;
        }
        i += l;
    }
    if (run)
        outbox__sbuf_put(b, s + i - run, run);
    outbox__sbuf_put(b, "\"", 1);
}

void tools_json_cstr(outbox__sbuf *b, const char *s)
{
    if (s)
        tools_json_str(b, s, strlen(s));
    else
        outbox__sbuf_puts(b, "null");
}

static void msgpack_json(outbox__sbuf *b, const msgpack_object *o, tools_msgpack_style style, int depth);

static void quoted_base64(outbox__sbuf *b, const void *s, size_t n)
{
    outbox__sbuf_put(b, "\"", 1);
    tools_base64(b, s, n);
    outbox__sbuf_put(b, "\"", 1);
}

int tools_json_text_or_base64(outbox__sbuf *b, const void *s, size_t n)
{
    if (tools_utf8_valid(s, n)) {
        tools_json_str(b, s, n);
        return 1;
    }
    quoted_base64(b, s, n);
    return 0;
}

void tools_base64(outbox__sbuf *b, const void *data, size_t n)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const unsigned char *s = data;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        char q[4] = {tab[v >> 18 & 63], tab[v >> 12 & 63], i + 1 < n ? tab[v >> 6 & 63] : '=',
                     i + 2 < n ? tab[v & 63] : '='};
        outbox__sbuf_put(b, q, 4);
    }
}


static void map_key(outbox__sbuf *b, const msgpack_object *k, tools_msgpack_style style, int depth)
{
    outbox__sbuf text = {0};
    if (k->type == MSGPACK_OBJECT_STR) {
        tools_json_str(b, k->via.str.ptr, k->via.str.size);
        return;
    }
    if (style == TOOLS_MSGPACK_PLAIN) {
        outbox__sbuf_puts(b, "\"?\"");
        return;
    }
    /* JSON keys are strings: another key type becomes its JSON text. */
    msgpack_json(&text, k, style, depth);
    if (text.oom)
        b->oom = 1;
    else
        tools_json_str(b, text.p, text.len);
    outbox__sbuf_free(&text);
}

static void msgpack_json(outbox__sbuf *b, const msgpack_object *o, tools_msgpack_style style, int depth)
{
    uint32_t i;
    if (depth > MSGPACK_DEPTH_MAX) {
        outbox__sbuf_puts(b, "null");
        return;
    }
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        outbox__sbuf_puts(b, "null");
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        outbox__sbuf_puts(b, o->via.boolean ? "true" : "false");
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        outbox__sbuf_printf(b, "%" PRIu64, o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        outbox__sbuf_printf(b, "%" PRId64, o->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (isfinite(o->via.f64))
            outbox__sbuf_printf(b, "%.17g", o->via.f64);
        else
            outbox__sbuf_puts(b, "null");
        break;
    case MSGPACK_OBJECT_STR:
        if (style == TOOLS_MSGPACK_PLAIN)
            tools_json_text_or_base64(b, o->via.str.ptr, o->via.str.size);
        else
            tools_json_str(b, o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        if (style == TOOLS_MSGPACK_PLAIN) {
            quoted_base64(b, o->via.bin.ptr, o->via.bin.size);
            break;
        }
        outbox__sbuf_puts(b, "{\"base64\":");
        quoted_base64(b, o->via.bin.ptr, o->via.bin.size);
        outbox__sbuf_puts(b, "}");
        break;
    case MSGPACK_OBJECT_EXT:
        if (style == TOOLS_MSGPACK_PLAIN) {
            outbox__sbuf_puts(b, "null");
            break;
        }
        outbox__sbuf_printf(b, "{\"ext_type\":%d,\"base64\":", (int)o->via.ext.type);
        quoted_base64(b, o->via.ext.ptr, o->via.ext.size);
        outbox__sbuf_puts(b, "}");
        break;
    case MSGPACK_OBJECT_ARRAY:
        outbox__sbuf_puts(b, "[");
        for (i = 0; i < o->via.array.size; i++) {
            if (i)
                outbox__sbuf_puts(b, ",");
            msgpack_json(b, &o->via.array.ptr[i], style, depth + 1);
        }
        outbox__sbuf_puts(b, "]");
        break;
    case MSGPACK_OBJECT_MAP:
        outbox__sbuf_puts(b, "{");
        for (i = 0; i < o->via.map.size; i++) {
            if (i)
                outbox__sbuf_puts(b, ",");
            map_key(b, &o->via.map.ptr[i].key, style, depth + 1);
            outbox__sbuf_puts(b, ":");
            msgpack_json(b, &o->via.map.ptr[i].val, style, depth + 1);
        }
        outbox__sbuf_puts(b, "}");
        break;
    default:
        outbox__sbuf_puts(b, "null");
    }
}

void tools_json_msgpack(outbox__sbuf *b, const msgpack_object *o, tools_msgpack_style style)
{
    msgpack_json(b, o, style, 0);
}
