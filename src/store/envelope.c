/*
 * The msgpack envelope of a stream entry (proto/envelope.md), encoded and
 * decoded with msgpack-c.
 */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"
#include "store/msgpack_check.h"
#include "outbox/envelope.h"

static size_t key_length(const outbox_envelope *e)
{
    if (!e->key)
        return 0;
    return e->key_len ? e->key_len : strlen(e->key);
}

size_t outbox_envelope_max_size(const outbox_envelope *e)
{
    /* map header + 8 short keys (<= 11 bytes each) + 6 string/bin headers
     * (<= 5 bytes each) + int64 + the bodies. */
    return 1 + 8 * 11 + 6 * 5 + 9 + 1 + (e->id ? strlen(e->id) : 0) + (e->topic ? strlen(e->topic) : 0) +
           key_length(e) + e->payload_len + (e->headers ? e->headers_len : 1) + (e->db ? strlen(e->db) : 0);
}

/*
 * The encoder writes the bytes by hand, in one pass, exactly as msgpack-c's
 * packer would (the smallest header of each string, bin and integer; keys
 * as fixstr): no callback per field, and the size is known beforehand, so
 * the relay writes the envelope straight into its XADD command.
 */

/* The keys with their fixstr headers, in the order written; the seven of
 * KEYS_LEN always, db only with a database's name. */
#define K_V "\xa1v"
#define K_ID "\xa2id"
#define K_TOPIC "\xa5topic"
#define K_KEY "\xa3key"
#define K_PAYLOAD "\xa7payload"
#define K_HEADERS "\xa7headers"
#define K_CREATED "\xaa" "created_at"
#define K_DB "\xa2" "db"
#define KEYS_LEN (sizeof K_V + sizeof K_ID + sizeof K_TOPIC + sizeof K_KEY + sizeof K_PAYLOAD + sizeof K_HEADERS + \
                  sizeof K_CREATED - 7)

static size_t str_header_size(size_t n)
{
    return n < 32 ? 1 : n < 256 ? 2 : n < 65536 ? 3 : 5;
}

static size_t bin_header_size(size_t n)
{
    return n < 256 ? 2 : n < 65536 ? 3 : 5;
}

static size_t int_size(int64_t d)
{
    if (d < -(1LL << 5))
        return d < -(1LL << 31) ? 9 : d < -(1LL << 15) ? 5 : d < -(1LL << 7) ? 3 : 2;
    if (d < (1 << 7))
        return 1;
    return d < (1LL << 8) ? 2 : d < (1LL << 16) ? 3 : d < (1LL << 32) ? 5 : 9;
}

static unsigned char *put_be(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--)
        *p++ = (unsigned char)(v >> (8 * i));
    return p;
}

static unsigned char *put_raw(unsigned char *p, const void *s, size_t n)
{
    if (n)
        memcpy(p, s, n);
    return p + n;
}

/* A header of a str (base 0xa0 / 0xd9) or a bin (0xc4): the smallest. */
static unsigned char *put_str_header(unsigned char *p, size_t n)
{
    if (n < 32) {
        *p++ = (unsigned char)(0xa0 | n);
        return p;
    }
    if (n < 256) {
        *p++ = 0xd9;
        return put_be(p, n, 1);
    }
    if (n < 65536) {
        *p++ = 0xda;
        return put_be(p, n, 2);
    }
    *p++ = 0xdb;
    return put_be(p, n, 4);
}

static unsigned char *put_bin_header(unsigned char *p, size_t n)
{
    if (n < 256) {
        *p++ = 0xc4;
        return put_be(p, n, 1);
    }
    if (n < 65536) {
        *p++ = 0xc5;
        return put_be(p, n, 2);
    }
    *p++ = 0xc6;
    return put_be(p, n, 4);
}

static unsigned char *put_int(unsigned char *p, int64_t d)
{
    static const unsigned char neg[] = {0, 0, 0xd0, 0xd1, 0, 0xd2, 0, 0, 0, 0xd3};
    static const unsigned char pos[] = {0, 0, 0xcc, 0xcd, 0, 0xce, 0, 0, 0, 0xcf};
    size_t n = int_size(d);
    if (n == 1) {
        *p++ = (unsigned char)(d & 0xff); /* positive or negative fixint */
        return p;
    }
    *p++ = d < 0 ? neg[n] : pos[n];
    return put_be(p, (uint64_t)d, (int)n - 1);
}

/* The parts of e the size and the writer share. */
typedef struct env_parts {
    size_t idl, tl, kl, dbl;
    int64_t version;
} env_parts;

static void parts_of(const outbox_envelope *e, env_parts *x)
{
    x->idl = strlen(e->id);
    x->tl = strlen(e->topic);
    x->kl = key_length(e);
    x->dbl = e->db ? strlen(e->db) : 0;
    x->version = e->version ? e->version : OUTBOX_ENVELOPE_VERSION;
}

static size_t parts_size(const outbox_envelope *e, const env_parts *x)
{
    return 1 + KEYS_LEN + int_size(x->version) + str_header_size(x->idl) + x->idl + str_header_size(x->tl) + x->tl +
           (x->kl ? str_header_size(x->kl) + x->kl : 1) + bin_header_size(e->payload_len) + e->payload_len +
           (e->headers ? e->headers_len : 1) + int_size(e->created_at) +
           (e->db ? sizeof K_DB - 1 + str_header_size(x->dbl) + x->dbl : 0);
}

size_t outbox__envelope_size(const outbox_envelope *e)
{
    env_parts x;
    parts_of(e, &x);
    return parts_size(e, &x);
}

static unsigned char *parts_put(const outbox_envelope *e, const env_parts *x, unsigned char *p)
{
    *p++ = e->db ? 0x88 : 0x87; /* fixmap of 7, or 8 with db */
    p = put_raw(p, K_V, sizeof K_V - 1);
    p = put_int(p, x->version);
    p = put_raw(p, K_ID, sizeof K_ID - 1);
    p = put_str_header(p, x->idl);
    p = put_raw(p, e->id, x->idl);
    p = put_raw(p, K_TOPIC, sizeof K_TOPIC - 1);
    p = put_str_header(p, x->tl);
    p = put_raw(p, e->topic, x->tl);
    p = put_raw(p, K_KEY, sizeof K_KEY - 1);
    if (x->kl) {
        p = put_str_header(p, x->kl);
        p = put_raw(p, e->key, x->kl);
    } else {
        *p++ = 0xc0;
    }
    p = put_raw(p, K_PAYLOAD, sizeof K_PAYLOAD - 1);
    p = put_bin_header(p, e->payload_len);
    p = put_raw(p, e->payload, e->payload_len);
    p = put_raw(p, K_HEADERS, sizeof K_HEADERS - 1);
    if (e->headers)
        p = put_raw(p, e->headers, e->headers_len);
    else
        *p++ = 0xc0;
    p = put_raw(p, K_CREATED, sizeof K_CREATED - 1);
    p = put_int(p, e->created_at);
    if (e->db) {
        p = put_raw(p, K_DB, sizeof K_DB - 1);
        p = put_str_header(p, x->dbl);
        p = put_raw(p, e->db, x->dbl);
    }
    return p;
}

char *outbox__envelope_put(const outbox_envelope *e, char *out)
{
    env_parts x;
    parts_of(e, &x);
    return (char *)parts_put(e, &x, (unsigned char *)out);
}

int outbox_envelope_encode(const outbox_envelope *e, void *buf, size_t cap, size_t *len)
{
    env_parts x;

    if (!e || !buf || !len || !e->id || !e->topic || (!e->payload && e->payload_len) ||
        (!e->headers && e->headers_len))
        return OUTBOX_EINVAL;
    if (cap < outbox_envelope_max_size(e))
        return OUTBOX_ERANGE;
    parts_of(e, &x);
    *len = (size_t)(parts_put(e, &x, buf) - (unsigned char *)buf);
    return 0;
}

static int key_is(const msgpack_object *k, const char *name)
{
    size_t n = strlen(name);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, name, n) == 0;
}

static int get_int(const msgpack_object *o, int64_t *v)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > INT64_MAX)
            return 0;
        *v = (int64_t)o->via.u64;
        return 1;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
        return 1;
    }
    return 0;
}

int outbox_envelope_decode(const void *data, size_t len, outbox_envelope **out, char *err, size_t errlen)
{
    const msgpack_object *ov = NULL, *oid = NULL, *otopic = NULL, *okey = NULL, *opay = NULL, *ohdr = NULL,
                         *ocreated = NULL, *odb = NULL;
    msgpack_unpacked u;
    msgpack_sbuffer hbuf;
    outbox_envelope *e = NULL;
    int64_t version = 0, created = 0;
    size_t used = 0, need;
    char *p;
    int rc;
    uint32_t i;

    if (!out)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!data && len)
        return OUTBOX_EINVAL;
    if (len == 0)
        return outbox__errf(err, errlen, OUTBOX_ETRUNCATED, "envelope is empty");
    rc = outbox__msgpack_check(data, len, &used);
    if (rc == OUTBOX_ETRUNCATED)
        return outbox__errf(err, errlen, rc, "envelope is truncated (%zu bytes)", len);
    if (rc != 0)
        return outbox__errf(err, errlen, rc, "envelope is not valid msgpack");
    if (used != len)
        return outbox__errf(err, errlen, OUTBOX_EMALFORMED, "envelope has %zu trailing bytes", len - used);

    msgpack_unpacked_init(&u);
    msgpack_sbuffer_init(&hbuf);
    used = 0;
    rc = msgpack_unpack_next(&u, data, len, &used);
    if (rc == MSGPACK_UNPACK_NOMEM_ERROR) {
        rc = OUTBOX_ENOMEM;
        goto done;
    }
    if (rc != MSGPACK_UNPACK_SUCCESS) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "envelope is not valid msgpack");
        goto done;
    }
    if (u.data.type != MSGPACK_OBJECT_MAP) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "envelope is not a msgpack map");
        goto done;
    }
    for (i = 0; i < u.data.via.map.size; i++) {
        const msgpack_object *k = &u.data.via.map.ptr[i].key, *v = &u.data.via.map.ptr[i].val;
        if (key_is(k, "v"))
            ov = v;
        else if (key_is(k, "id"))
            oid = v;
        else if (key_is(k, "topic"))
            otopic = v;
        else if (key_is(k, "key"))
            okey = v;
        else if (key_is(k, "payload"))
            opay = v;
        else if (key_is(k, "headers"))
            ohdr = v;
        else if (key_is(k, "created_at"))
            ocreated = v;
        else if (key_is(k, "db"))
            odb = v;
        /* Unknown keys are ignored: later minor versions may add fields. */
    }
    if (!ov || !get_int(ov, &version)) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "field 'v' %s", ov ? "is not an integer" : "missing");
        goto done;
    }
    if (version != OUTBOX_ENVELOPE_VERSION) {
        rc = outbox__errf(err, errlen, OUTBOX_EVERSION, "envelope version %lld, this library reads %d",
                          (long long)version, OUTBOX_ENVELOPE_VERSION);
        goto done;
    }
#define REQUIRE(o, name, cond, what)                                                                                   \
    if (!(o) || !(cond)) {                                                                                             \
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "field '%s' %s", name, (o) ? what : "missing");              \
        goto done;                                                                                                     \
    }
    REQUIRE(oid, "id", oid->type == MSGPACK_OBJECT_STR && oid->via.str.size > 0, "is not a non-empty string");
    REQUIRE(otopic, "topic", otopic->type == MSGPACK_OBJECT_STR && otopic->via.str.size > 0,
            "is not a non-empty string");
    REQUIRE(opay, "payload", opay->type == MSGPACK_OBJECT_BIN || opay->type == MSGPACK_OBJECT_STR,
            "is not bin or str");
    REQUIRE(ocreated, "created_at", get_int(ocreated, &created), "is not an integer");
#undef REQUIRE
    if (okey && okey->type != MSGPACK_OBJECT_NIL && okey->type != MSGPACK_OBJECT_STR) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "field 'key' is not a string or nil");
        goto done;
    }
    if (okey && okey->type == MSGPACK_OBJECT_NIL)
        okey = NULL;
    if (odb && odb->type != MSGPACK_OBJECT_NIL && odb->type != MSGPACK_OBJECT_STR) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "field 'db' is not a string or nil");
        goto done;
    }
    if (odb && odb->type == MSGPACK_OBJECT_NIL)
        odb = NULL;
    if (ohdr && ohdr->type != MSGPACK_OBJECT_NIL && ohdr->type != MSGPACK_OBJECT_MAP) {
        rc = outbox__errf(err, errlen, OUTBOX_EMALFORMED, "field 'headers' is not a map or nil");
        goto done;
    }
    if (ohdr && ohdr->type == MSGPACK_OBJECT_MAP) {
        msgpack_packer pk;
        msgpack_packer_init(&pk, &hbuf, msgpack_sbuffer_write);
        if (msgpack_pack_object(&pk, *ohdr) != 0) {
            rc = OUTBOX_ENOMEM;
            goto done;
        }
    }

    /* One block: the struct, then id, topic, key, db (each NUL-terminated),
     * payload, headers. */
    need = sizeof *e + oid->via.str.size + 1 + otopic->via.str.size + 1 + (okey ? okey->via.str.size + 1 : 0) +
           (opay->type == MSGPACK_OBJECT_BIN ? opay->via.bin.size : opay->via.str.size) + hbuf.size + 1 +
           (odb ? odb->via.str.size + 1 : 0);
    e = calloc(1, need);
    if (!e) {
        rc = OUTBOX_ENOMEM;
        goto done;
    }
    p = (char *)(e + 1);
    e->version = (int)version;
    e->created_at = created;
    memcpy(p, oid->via.str.ptr, oid->via.str.size);
    e->id = p;
    p += oid->via.str.size + 1;
    memcpy(p, otopic->via.str.ptr, otopic->via.str.size);
    e->topic = p;
    p += otopic->via.str.size + 1;
    if (okey) {
        memcpy(p, okey->via.str.ptr, okey->via.str.size);
        e->key = p;
        e->key_len = okey->via.str.size;
        p += okey->via.str.size + 1;
    }
    if (odb) {
        memcpy(p, odb->via.str.ptr, odb->via.str.size);
        e->db = p;
        p += odb->via.str.size + 1;
    }
    if (opay->type == MSGPACK_OBJECT_BIN) {
        e->payload_len = opay->via.bin.size;
        if (e->payload_len)
            memcpy(p, opay->via.bin.ptr, e->payload_len);
    } else {
        e->payload_len = opay->via.str.size;
        if (e->payload_len)
            memcpy(p, opay->via.str.ptr, e->payload_len);
    }
    e->payload = p;
    p += e->payload_len;
    if (hbuf.size) {
        memcpy(p, hbuf.data, hbuf.size);
        e->headers = p;
        e->headers_len = hbuf.size;
    }
    *out = e;
    e = NULL;
    rc = 0;
done:
    free(e);
    msgpack_sbuffer_destroy(&hbuf);
    msgpack_unpacked_destroy(&u);
    return rc;
}

void outbox_envelope_free(outbox_envelope *e)
{
    free(e);
}
