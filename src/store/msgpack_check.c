/*
 * msgpack_check.c: a walk over msgpack bytes that checks every declared
 * length against the bytes that remain, before msgpack-c is given them (why:
 * see msgpack_check.h). It allocates nothing and needs no recursion: an
 * explicit stack of bounded depth holds the elements still to be read.
 */
#include <stdint.h>

#include "store/msgpack_check.h"
#include "outbox/common.h"

#define MAX_DEPTH 64

static uint64_t be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Pending element counts per nesting level: an explicit stack keeps the walk
 * iterative and its depth bounded. */
int outbox__msgpack_check(const void *data, size_t len, size_t *used)
{
    const unsigned char *p = data;
    size_t off = 0;
    uint64_t stack[MAX_DEPTH + 1];
    int depth = 0;

    stack[0] = 1;
    while (depth >= 0) {
        unsigned char t;
        uint64_t body = 0, children = 0;
        int hdr;

        if (stack[depth] == 0) {
            depth--;
            continue;
        }
        stack[depth]--;
        if (off >= len)
            return OUTBOX_ETRUNCATED;
        t = p[off];
        hdr = 1;
        if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) {
            /* fixint, nil, bool */
        } else if (t >= 0x80 && t <= 0x8f) {
            children = 2u * (t & 0x0f);
        } else if (t >= 0x90 && t <= 0x9f) {
            children = t & 0x0f;
        } else if (t >= 0xa0 && t <= 0xbf) {
            body = t & 0x1f;
        } else {
            int lenbytes = 0, fixed = -1;
            switch (t) {
            case 0xc4: case 0xd9: lenbytes = 1; break;               /* bin8, str8 */
            case 0xc5: case 0xda: lenbytes = 2; break;               /* bin16, str16 */
            case 0xc6: case 0xdb: lenbytes = 4; break;               /* bin32, str32 */
            case 0xc7: lenbytes = 1; fixed = 1; break;               /* ext8 (+type) */
            case 0xc8: lenbytes = 2; fixed = 1; break;
            case 0xc9: lenbytes = 4; fixed = 1; break;
            case 0xca: case 0xce: case 0xd2: body = 4; break;
            case 0xcb: case 0xcf: case 0xd3: body = 8; break;
            case 0xcc: case 0xd0: body = 1; break;
            case 0xcd: case 0xd1: body = 2; break;
            case 0xd4: body = 2; break;                               /* fixext1 */
            case 0xd5: body = 3; break;
            case 0xd6: body = 5; break;
            case 0xd7: body = 9; break;
            case 0xd8: body = 17; break;
            case 0xdc: lenbytes = 2; fixed = -2; break;               /* array16 */
            case 0xdd: lenbytes = 4; fixed = -2; break;               /* array32 */
            case 0xde: lenbytes = 2; fixed = -3; break;               /* map16 */
            case 0xdf: lenbytes = 4; fixed = -3; break;               /* map32 */
            default:
                return OUTBOX_EMALFORMED;                             /* 0xc1 */
            }
            if (lenbytes) {
                uint64_t n;
                if (len - off - 1 < (size_t)lenbytes)
                    return OUTBOX_ETRUNCATED;
                n = be(p + off + 1, lenbytes);
                hdr += lenbytes;
                if (fixed == -2)
                    children = n;
                else if (fixed == -3)
                    children = 2 * n;
                else
                    body = n + (fixed == 1 ? 1 : 0);
            }
        }
        if (len - off < (size_t)hdr || len - off - (size_t)hdr < body)
            return OUTBOX_ETRUNCATED;
        off += (size_t)hdr + (size_t)body;
        if (children) {
            /* Every element takes at least one byte. */
            if (children > len - off)
                return (children > UINT32_MAX * 2ull) ? OUTBOX_EMALFORMED : OUTBOX_ETRUNCATED;
            if (depth == MAX_DEPTH)
                return OUTBOX_EMALFORMED;
            stack[++depth] = children;
        }
    }
    *used = off;
    return 0;
}
