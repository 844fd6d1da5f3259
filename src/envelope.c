/*
 * The msgpack envelope of a stream entry (proto/envelope.md), encoded and
 * decoded with msgpack-c.
 */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "msgpack_check.h"
#include "outbox/envelope.h"

typedef struct fixed_buf {
    char *p;
    size_t cap, len;
} fixed_buf;

static int fixed_write(void *data, const char *buf, size_t len)
{
    fixed_buf *b = data;
    if (b->cap - b->len < len)
        return -1;
    memcpy(b->p + b->len, buf, len);
    b->len += len;
    return 0;
}

static size_t key_length(const outbox_envelope *e)
{
    if (!e->key)
        return 0;
    return e->key_len ? e->key_len : strlen(e->key);
}

size_t outbox_envelope_max_size(const outbox_envelope *e)
{
    /* map header + 7 short keys (<= 11 bytes each) + 5 string/bin headers
     * (<= 5 bytes each) + int64 + the bodies. */
    return 1 + 7 * 11 + 5 * 5 + 9 + 1 + (e->id ? strlen(e->id) : 0) + (e->topic ? strlen(e->topic) : 0) +
           key_length(e) + e->payload_len + (e->headers ? e->headers_len : 1);
}

static void pack_key(msgpack_packer *pk, const char *k)
{
    size_t n = strlen(k);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, k, n);
}

static void pack_str(msgpack_packer *pk, const char *s, size_t n)
{
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

int outbox_envelope_encode(const outbox_envelope *e, void *buf, size_t cap, size_t *len)
{
    fixed_buf b = {buf, cap, 0};
    msgpack_packer pk;
    size_t klen;

    if (!e || !buf || !len || !e->id || !e->topic || (!e->payload && e->payload_len) ||
        (!e->headers && e->headers_len))
        return OUTBOX_EINVAL;
    if (cap < outbox_envelope_max_size(e))
        return OUTBOX_ERANGE;
    klen = key_length(e);
    msgpack_packer_init(&pk, &b, fixed_write);
    msgpack_pack_map(&pk, 7);
    pack_key(&pk, "v");
    msgpack_pack_int(&pk, e->version ? e->version : OUTBOX_ENVELOPE_VERSION);
    pack_key(&pk, "id");
    pack_str(&pk, e->id, strlen(e->id));
    pack_key(&pk, "topic");
    pack_str(&pk, e->topic, strlen(e->topic));
    pack_key(&pk, "key");
    if (klen)
        pack_str(&pk, e->key, klen);
    else
        msgpack_pack_nil(&pk);
    pack_key(&pk, "payload");
    msgpack_pack_bin(&pk, e->payload_len);
    msgpack_pack_bin_body(&pk, e->payload_len ? e->payload : "", e->payload_len);
    pack_key(&pk, "headers");
    if (e->headers)
        fixed_write(&b, e->headers, e->headers_len);
    else
        msgpack_pack_nil(&pk);
    pack_key(&pk, "created_at");
    msgpack_pack_int64(&pk, e->created_at);
    *len = b.len;
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
                         *ocreated = NULL;
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

    /* One block: the struct, then id, topic, key (each NUL-terminated),
     * payload, headers. */
    need = sizeof *e + oid->via.str.size + 1 + otopic->via.str.size + 1 + (okey ? okey->via.str.size + 1 : 0) +
           (opay->type == MSGPACK_OBJECT_BIN ? opay->via.bin.size : opay->via.str.size) + hbuf.size + 1;
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
