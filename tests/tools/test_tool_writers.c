/* The growable string buffer (src/util/sbuf.h) and the JSON writer that
 * outbox-replay and outbox-consume share (tools/common/json.h): escapes,
 * invalid UTF-8, base64 padding, and msgpack in both styles. */
#include <string.h>

#include <msgpack.h>

#include "json.h"
#include "util/sbuf.h"
#include "tap.h"

static char *json(const void *s, size_t n)
{
    static outbox__sbuf b;
    outbox__sbuf_reset(&b);
    tools_json_str(&b, s, n);
    return b.oom ? "(oom)" : b.p;
}

static char *b64(const char *s)
{
    static outbox__sbuf b;
    outbox__sbuf_reset(&b);
    tools_base64(&b, s, strlen(s));
    return b.oom ? "(oom)" : b.p ? b.p : "";
}

static void test_sbuf(void)
{
    outbox__sbuf b = {0};
    char big[10000];
    outbox__sbuf_reset(&b);
    ok(b.p == NULL && b.len == 0, "reset of a zeroed buffer leaves it empty");
    outbox__sbuf_put(&b, "a\0b", 3);
    is_int((int)b.len, 3, "put keeps NUL bytes");
    ok(memcmp(b.p, "a\0b", 4) == 0, "and NUL-terminates");
    outbox__sbuf_puts(&b, "cd");
    outbox__sbuf_printf(&b, "-%d-", 42);
    ok(b.len == 9 && memcmp(b.p, "a\0bcd-42-", 10) == 0, "puts and printf append");
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    outbox__sbuf_puts(&b, big);
    outbox__sbuf_printf(&b, "%s", big);
    ok(b.len == 9 + 2 * (sizeof big - 1) && !b.oom && b.p[b.len] == '\0', "grows past its first allocation");
    outbox__sbuf_reset(&b);
    ok(b.len == 0 && b.p && b.p[0] == '\0' && b.cap > 0, "reset empties it and keeps the memory");
    b.oom = 1;
    outbox__sbuf_puts(&b, "lost");
    is_int((int)b.len, 0, "after oom, appends are dropped");
    outbox__sbuf_free(&b);
    ok(b.p == NULL && b.len == 0 && b.cap == 0 && !b.oom, "free leaves it zeroed");
}

static void test_strings(void)
{
    outbox__sbuf b = {0};
    is_str(json("", 0), "\"\"", "empty string");
    is_str(json("a\"b\\c", 5), "\"a\\\"b\\\\c\"", "quote and backslash");
    is_str(json("\n\r\t\b\f", 5), "\"\\n\\r\\t\\b\\f\"", "short escapes");
    is_str(json("\x01\x1f\x7f", 3), "\"\\u0001\\u001f\\u007f\"", "other control characters as \\u00XX");
    is_str(json("a\0b", 3), "\"a\\u0000b\"", "a NUL byte");
    is_str(json("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9), "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"",
           "valid UTF-8 as is");
    is_str(json("\xe2\x80\xa8\xe2\x80\xa9", 6), "\"\\u2028\\u2029\"", "U+2028 and U+2029 escaped");
    is_str(json("a\xff" "b\xc3", 4), "\"a\\ufffdb\\ufffd\"", "invalid and truncated UTF-8 as U+FFFD");
    is_str(json("\xc0\xaf\xed\xa0\x80", 5), "\"\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\"",
           "overlong forms and surrogates as U+FFFD per byte");
    tools_json_cstr(&b, NULL);
    outbox__sbuf_puts(&b, " ");
    tools_json_cstr(&b, "x");
    is_str(b.p, "null \"x\"", "cstr: NULL is null");
    ok(tools_utf8_valid("\xc3\xa9", 2) && !tools_utf8_valid("\xc3", 1), "utf8_valid");
    outbox__sbuf_reset(&b);
    ok(tools_json_text_or_base64(&b, "h\xc3\xa9", 3) == 1, "text_or_base64: UTF-8 is text");
    ok(tools_json_text_or_base64(&b, "\xff\x00", 2) == 0, "text_or_base64: other bytes are base64");
    ok(tools_json_text_or_base64(&b, NULL, 0) == 1, "text_or_base64: nothing (a NULL empty blob) is text");
    is_str(b.p, "\"h\xc3\xa9\"\"/wA=\"\"\"", "text_or_base64: the string, then the quoted base64");
    outbox__sbuf_free(&b);
}

static void test_base64(void)
{
    /* RFC 4648, section 10. */
    is_str(b64(""), "", "base64 of nothing");
    is_str(b64("f"), "Zg==", "base64 f");
    is_str(b64("fo"), "Zm8=", "base64 fo");
    is_str(b64("foo"), "Zm9v", "base64 foo");
    is_str(b64("foob"), "Zm9vYg==", "base64 foob");
    is_str(b64("fooba"), "Zm9vYmE=", "base64 fooba");
    is_str(b64("foobar"), "Zm9vYmFy", "base64 foobar");
    is_str(b64("\xff\xfe\xfd"), "//79", "base64 of high bytes");
}

/* {"s":"abc","bin":bin ff0080,"ext":ext 5 "A",1:-5,[1,2]:true,"f":1.5,"nan":NaN,"bad":str ff fe,
 *  "arr":[nil,false,{"x":-200}],str c3 28:1} */
static const unsigned char headers[] = {
    0x8a, 0xa1, 's',  0xa3, 'a',  'b',  'c',  0xa3, 'b',  'i',  'n',  0xc4, 0x03, 0xff, 0x00, 0x80, 0xa3, 'e',
    'x',  't',  0xd4, 0x05, 'A',  0x01, 0xfb, 0x92, 0x01, 0x02, 0xc3, 0xa1, 'f',  0xcb, 0x3f, 0xf8, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0xa3, 'n',  'a',  'n',  0xcb, 0x7f, 0xf8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xa3,
    'b',  'a',  'd',  0xa2, 0xff, 0xfe, 0xa3, 'a',  'r',  'r',  0x93, 0xc0, 0xc2, 0x81, 0xa1, 'x',  0xd1, 0xff,
    0x38, 0xa2, 0xc3, 0x28, 0x01};

static void test_msgpack(void)
{
    msgpack_unpacked u;
    outbox__sbuf b = {0};
    size_t off = 0;
    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, (const char *)headers, sizeof headers, &off) != MSGPACK_UNPACK_SUCCESS ||
        off != sizeof headers)
        bail("the test's msgpack does not decode");
    tools_json_msgpack(&b, &u.data, TOOLS_MSGPACK_TAGGED);
    is_str(b.p,
           "{\"s\":\"abc\",\"bin\":{\"base64\":\"/wCA\"},\"ext\":{\"ext_type\":5,\"base64\":\"QQ==\"},\"1\":-5,"
           "\"[1,2]\":true,\"f\":1.5,\"nan\":null,\"bad\":\"\\ufffd\\ufffd\",\"arr\":[null,false,{\"x\":-200}],"
           "\"\\ufffd(\":1}",
           "tagged: bin and ext tagged, other keys as their JSON text");
    outbox__sbuf_reset(&b);
    tools_json_msgpack(&b, &u.data, TOOLS_MSGPACK_PLAIN);
    is_str(b.p,
           "{\"s\":\"abc\",\"bin\":\"/wCA\",\"ext\":null,\"?\":-5,\"?\":true,\"f\":1.5,\"nan\":null,"
           "\"bad\":\"//4=\",\"arr\":[null,false,{\"x\":-200}],\"\\ufffd(\":1}",
           "plain: bin and invalid str as base64, ext null, other keys \"?\"");
    msgpack_unpacked_destroy(&u);
    outbox__sbuf_free(&b);
}

int main(void)
{
    test_sbuf();
    test_strings();
    test_base64();
    test_msgpack();
    return tap_done();
}
