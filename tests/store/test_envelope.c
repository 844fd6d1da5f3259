/* The envelope contract: round trips (with and without the database's
 * name), and every kind of bad input gives a specific error without
 * crashing or reading past the buffer (each decode gets an exact-size heap
 * copy, so ASan/valgrind see any over-read). */
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "outbox.h"
#include "tap.h"

static int decode_copy(const void *data, size_t len, outbox_envelope **out, char *err, size_t errlen)
{
    /* Zeroed, because with len 0 the one byte is never written: the decoder
     * must not read it, and GCC would warn that it is uninitialized. */
    void *copy = calloc(1, len ? len : 1);
    int e;
    if (!copy)
        bail("out of memory");
    memcpy(copy, data, len);
    e = outbox_envelope_decode(copy, len, out, err, errlen);
    free(copy);
    return e;
}

static size_t encode(const outbox_envelope *e, unsigned char **out)
{
    size_t cap = outbox_envelope_max_size(e), len = 0;
    *out = malloc(cap);
    if (outbox_envelope_encode(e, *out, cap, &len) != 0)
        bail("encode failed");
    return len;
}

/* Packs a map from alternating key/value writers. */
typedef struct packed {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} packed;

static void pk_init(packed *p, size_t n)
{
    msgpack_sbuffer_init(&p->sb);
    msgpack_packer_init(&p->pk, &p->sb, msgpack_sbuffer_write);
    msgpack_pack_map(&p->pk, n);
}

static void pk_str(packed *p, const char *s)
{
    msgpack_pack_str(&p->pk, strlen(s));
    msgpack_pack_str_body(&p->pk, s, strlen(s));
}

static void test_round_trip(void)
{
    unsigned char hdr[] = {0x82, 0xa2, 't', 'r', 0xa3, 'a', 'b', 'c', 0xa1, 'n', 0x05};
    outbox_envelope in, *out = NULL;
    unsigned char *buf;
    size_t len;
    char err[128];
    static char big[300000];

    memset(&in, 0, sizeof in);
    in.id = "01890a5d-ac96-774b-bcce-b302099a8057";
    in.topic = "orders";
    in.key = "customer-42";
    in.payload = "{\"x\":1}";
    in.payload_len = 7;
    in.headers = hdr;
    in.headers_len = sizeof hdr;
    in.created_at = 1700000000123LL;
    len = encode(&in, &buf);
    is_int(decode_copy(buf, len, &out, err, sizeof err), 0, "round trip decodes");
    is_int(out->version, 1, "version 1");
    is_str(out->id, in.id, "id");
    is_str(out->topic, "orders", "topic");
    is_str(out->key, "customer-42", "key");
    is_int(out->key_len, 11, "key_len");
    ok(out->payload_len == 7 && memcmp(out->payload, in.payload, 7) == 0, "payload");
    ok(out->headers_len == sizeof hdr && memcmp(out->headers, hdr, sizeof hdr) == 0, "headers byte for byte");
    is_int(out->created_at, 1700000000123LL, "created_at");
    ok(out->db == NULL, "no db: db NULL");
    outbox_envelope_free(out);

    /* The exact key names of the contract. */
    {
        msgpack_unpacked u;
        size_t off = 0;
        int keys = 0;
        msgpack_unpacked_init(&u);
        ok(msgpack_unpack_next(&u, (const char *)buf, len, &off) == MSGPACK_UNPACK_SUCCESS, "plain msgpack-c reads it");
        ok(u.data.type == MSGPACK_OBJECT_MAP && u.data.via.map.size == 7, "a map of 7 fields");
        for (uint32_t i = 0; i < u.data.via.map.size; i++) {
            msgpack_object k = u.data.via.map.ptr[i].key;
            static const char *names[] = {"v", "id", "topic", "key", "payload", "headers", "created_at"};
            if (k.type == MSGPACK_OBJECT_STR && k.via.str.size == strlen(names[i]) &&
                memcmp(k.via.str.ptr, names[i], k.via.str.size) == 0)
                keys++;
        }
        is_int(keys, 7, "fields v, id, topic, key, payload, headers, created_at in that order");
        ok(u.data.via.map.ptr[4].val.type == MSGPACK_OBJECT_BIN, "payload is bin");
        msgpack_unpacked_destroy(&u);
    }
    free(buf);

    /* No key, no headers, empty payload. */
    in.key = NULL;
    in.headers = NULL;
    in.headers_len = 0;
    in.payload = NULL;
    in.payload_len = 0;
    len = encode(&in, &buf);
    is_int(decode_copy(buf, len, &out, err, sizeof err), 0, "minimal envelope decodes");
    ok(out->key == NULL && out->headers == NULL && out->payload_len == 0, "nil key, nil headers, empty payload");
    outbox_envelope_free(out);
    free(buf);

    /* A large payload (bin32). */
    memset(big, 'z', sizeof big);
    in.payload = big;
    in.payload_len = sizeof big;
    len = encode(&in, &buf);
    is_int(decode_copy(buf, len, &out, err, sizeof err), 0, "300 KB payload decodes");
    ok(out->payload_len == sizeof big && memcmp(out->payload, big, sizeof big) == 0, "and matches");
    outbox_envelope_free(out);

    /* Every truncation is ETRUNCATED (spot-check the small prefixes and a
     * spread of the large ones). */
    {
        int all = 1;
        for (size_t cut = 0; cut < len; cut += (cut < 200 ? 1 : 997)) {
            int e = decode_copy(buf, cut, &out, err, sizeof err);
            if (e != OUTBOX_ETRUNCATED) {
                diag("cut %zu gave %s", cut, outbox_err_name(e));
                all = 0;
            }
        }
        ok(all, "every truncated prefix gives ETRUNCATED");
    }
    free(buf);

    /* Encode errors. */
    {
        unsigned char small[8];
        in.payload = "x";
        in.payload_len = 1;
        is_int(outbox_envelope_encode(&in, small, sizeof small, &len), OUTBOX_ERANGE, "small buffer: ERANGE");
        in.id = NULL;
        is_int(outbox_envelope_encode(&in, small, sizeof small, &len), OUTBOX_EINVAL, "NULL id: EINVAL");
    }
}

static void test_malformed(void)
{
    outbox_envelope *out = NULL;
    char err[128];
    packed p;
    int e;

    e = decode_copy("", 0, &out, err, sizeof err);
    is_int(e, OUTBOX_ETRUNCATED, "empty input");
    e = decode_copy("\x93\x01\x02\x03", 4, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "an array, not a map: %s", err);
    e = decode_copy("\x80\xc0", 2, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "trailing bytes: %s", err);
    e = decode_copy("\xc1", 1, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "reserved byte 0xc1");
    e = decode_copy("\xdf\xff\xff\xff\xff", 5, &out, err, sizeof err);
    ok(e == OUTBOX_ETRUNCATED || e == OUTBOX_EMALFORMED, "map32 of 4 billion entries in 5 bytes: %s",
       outbox_err_name(e));
    e = decode_copy("\xdb\xff\xff\xff\xf0" "abc", 8, &out, err, sizeof err);
    is_int(e, OUTBOX_ETRUNCATED, "str32 claiming 4 GB");
    {
        /* 100 nested arrays. */
        unsigned char deep[101];
        memset(deep, 0x91, 100);
        deep[100] = 0x01;
        e = decode_copy(deep, sizeof deep, &out, err, sizeof err);
        is_int(e, OUTBOX_EMALFORMED, "nesting deeper than 64");
    }

    /* Missing fields and wrong types. */
    pk_init(&p, 0);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "empty map");
    ok(strstr(err, "'v'") != NULL, "names the field: %s", err);
    msgpack_sbuffer_destroy(&p.sb);

    pk_init(&p, 5);
    pk_str(&p, "v");
    msgpack_pack_int(&p.pk, 1);
    pk_str(&p, "id");
    pk_str(&p, "m1");
    pk_str(&p, "topic");
    pk_str(&p, "t");
    pk_str(&p, "created_at");
    msgpack_pack_int(&p.pk, 5);
    pk_str(&p, "extra");
    pk_str(&p, "ignored");
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "payload missing");
    ok(strstr(err, "payload") != NULL, "names it: %s", err);
    msgpack_sbuffer_destroy(&p.sb);

    pk_init(&p, 6);
    pk_str(&p, "v");
    msgpack_pack_int(&p.pk, 1);
    pk_str(&p, "id");
    msgpack_pack_int(&p.pk, 7);
    pk_str(&p, "topic");
    pk_str(&p, "t");
    pk_str(&p, "payload");
    msgpack_pack_bin(&p.pk, 0);
    pk_str(&p, "created_at");
    msgpack_pack_int(&p.pk, 5);
    pk_str(&p, "future_field");
    msgpack_pack_array(&p.pk, 0);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "id of the wrong type: %s", err);
    msgpack_sbuffer_destroy(&p.sb);

    pk_init(&p, 6);
    pk_str(&p, "v");
    msgpack_pack_int(&p.pk, 2);
    pk_str(&p, "id");
    pk_str(&p, "m1");
    pk_str(&p, "topic");
    pk_str(&p, "t");
    pk_str(&p, "payload");
    msgpack_pack_bin(&p.pk, 0);
    pk_str(&p, "created_at");
    msgpack_pack_int(&p.pk, 5);
    pk_str(&p, "headers");
    msgpack_pack_nil(&p.pk);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EVERSION, "version 2: EVERSION (%s)", err);
    msgpack_sbuffer_destroy(&p.sb);

    /* Unknown fields are ignored; headers must be a map. */
    pk_init(&p, 7);
    pk_str(&p, "v");
    msgpack_pack_int(&p.pk, 1);
    pk_str(&p, "id");
    pk_str(&p, "m1");
    pk_str(&p, "topic");
    pk_str(&p, "t");
    pk_str(&p, "payload");
    pk_str(&p, "text payload");
    pk_str(&p, "created_at");
    msgpack_pack_int(&p.pk, 5);
    pk_str(&p, "trace");
    msgpack_pack_map(&p.pk, 0);
    pk_str(&p, "headers");
    msgpack_pack_map(&p.pk, 0);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, 0, "unknown field ignored, str payload accepted");
    if (out)
        ok(out->payload_len == 12 && out->headers_len == 1, "payload and empty headers map");
    outbox_envelope_free(out);
    out = NULL;
    msgpack_sbuffer_destroy(&p.sb);

    pk_init(&p, 6);
    pk_str(&p, "v");
    msgpack_pack_int(&p.pk, 1);
    pk_str(&p, "id");
    pk_str(&p, "m1");
    pk_str(&p, "topic");
    pk_str(&p, "t");
    pk_str(&p, "payload");
    msgpack_pack_bin(&p.pk, 0);
    pk_str(&p, "created_at");
    msgpack_pack_int(&p.pk, 5);
    pk_str(&p, "headers");
    pk_str(&p, "not a map");
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "headers that are a string: %s", err);
    msgpack_sbuffer_destroy(&p.sb);

    is_int(outbox_envelope_decode("x", 1, NULL, NULL, 0), OUTBOX_EINVAL, "NULL out: EINVAL");
    outbox_envelope_free(NULL);
}

/* The map of an envelope with db (str, nil, or an int) as its eighth key. */
static void pk_with_db(packed *p, int db_type)
{
    pk_init(p, 6);
    pk_str(p, "v");
    msgpack_pack_int(&p->pk, 1);
    pk_str(p, "id");
    pk_str(p, "m1");
    pk_str(p, "topic");
    pk_str(p, "t");
    pk_str(p, "payload");
    msgpack_pack_bin(&p->pk, 0);
    pk_str(p, "created_at");
    msgpack_pack_int(&p->pk, 5);
    pk_str(p, "db");
    if (db_type == MSGPACK_OBJECT_STR)
        pk_str(p, "tenant-7");
    else if (db_type == MSGPACK_OBJECT_NIL)
        msgpack_pack_nil(&p->pk);
    else if (db_type == MSGPACK_OBJECT_BIN)
        msgpack_pack_bin(&p->pk, 0);
    else
        msgpack_pack_int(&p->pk, 7);
}

/* The database's name: the eighth key, after created_at, when set. */
static void test_db(void)
{
    static const size_t db_lens[] = {0, 1, 31, 32, 200, 255, 256, 65535, 65536};
    static char big[65537];
    outbox_envelope in, *out = NULL;
    unsigned char *buf;
    size_t len, plain_len;
    char err[128];
    packed p;
    int e;

    memset(&in, 0, sizeof in);
    in.id = "m-42";
    in.topic = "orders";
    in.key = "customer-42";
    in.payload = "{}";
    in.payload_len = 2;
    in.created_at = 1700000000123LL;
    plain_len = encode(&in, &buf);
    free(buf);
    in.db = "tenant-a";
    len = encode(&in, &buf);
    is_int(len, plain_len + 3 + 9, "db adds its key and its string: 12 bytes for \"tenant-a\"");
    is_int(decode_copy(buf, len, &out, err, sizeof err), 0, "an envelope with db decodes");
    if (out) {
        is_str(out->db, "tenant-a", "db round trip");
        is_str(out->id, "m-42", "and the id");
        is_str(out->key, "customer-42", "and the key");
        ok(out->payload_len == 2 && memcmp(out->payload, "{}", 2) == 0, "and the payload");
        is_int(out->created_at, 1700000000123LL, "and created_at");
    }
    outbox_envelope_free(out);
    out = NULL;
    {
        msgpack_unpacked u;
        size_t off = 0;
        msgpack_unpacked_init(&u);
        ok(msgpack_unpack_next(&u, (const char *)buf, len, &off) == MSGPACK_UNPACK_SUCCESS &&
               u.data.type == MSGPACK_OBJECT_MAP && u.data.via.map.size == 8,
           "a map of 8 fields with db");
        if (u.data.type == MSGPACK_OBJECT_MAP && u.data.via.map.size == 8) {
            msgpack_object k = u.data.via.map.ptr[7].key, v = u.data.via.map.ptr[7].val;
            ok(k.type == MSGPACK_OBJECT_STR && k.via.str.size == 2 && memcmp(k.via.str.ptr, "db", 2) == 0 &&
                   v.type == MSGPACK_OBJECT_STR && v.via.str.size == 8 && memcmp(v.via.str.ptr, "tenant-a", 8) == 0,
               "db last, after created_at, as a str");
        }
        msgpack_unpacked_destroy(&u);
    }
    free(buf);

    /* The bound holds at every length of the name's str header. */
    memset(big, 'd', sizeof big - 1);
    for (size_t i = 0; i < sizeof db_lens / sizeof db_lens[0]; i++) {
        size_t cap;
        big[db_lens[i]] = '\0';
        in.db = big;
        cap = outbox_envelope_max_size(&in);
        buf = malloc(cap);
        e = outbox_envelope_encode(&in, buf, cap, &len);
        ok(e == 0 && len <= cap, "db of %zu bytes: encodes within outbox_envelope_max_size (%zu <= %zu)", db_lens[i],
           len, cap);
        if (e == 0 && decode_copy(buf, len, &out, err, sizeof err) == 0) {
            ok(out->db && strlen(out->db) == db_lens[i] && memcmp(out->db, big, db_lens[i]) == 0,
               "db of %zu bytes: decodes to the same name", db_lens[i]);
            outbox_envelope_free(out);
            out = NULL;
        } else {
            ok(0, "db of %zu bytes: decodes (%s)", db_lens[i], err);
        }
        free(buf);
        big[db_lens[i]] = 'd';
    }

    /* db nil or absent: none; of any other type: refused, named. */
    pk_with_db(&p, MSGPACK_OBJECT_NIL);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, 0, "db nil decodes");
    ok(out && out->db == NULL, "db nil: db NULL");
    outbox_envelope_free(out);
    out = NULL;
    msgpack_sbuffer_destroy(&p.sb);
    pk_with_db(&p, MSGPACK_OBJECT_STR);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, 0, "db str in a hand-packed map decodes");
    is_str(out ? out->db : NULL, "tenant-7", "its name");
    outbox_envelope_free(out);
    out = NULL;
    msgpack_sbuffer_destroy(&p.sb);
    pk_with_db(&p, MSGPACK_OBJECT_POSITIVE_INTEGER);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "db of the wrong type (an int): EMALFORMED");
    is_str(err, "field 'db' is not a string or nil", "the error says so");
    ok(out == NULL, "and nothing is returned");
    msgpack_sbuffer_destroy(&p.sb);
    pk_with_db(&p, MSGPACK_OBJECT_BIN);
    e = decode_copy(p.sb.data, p.sb.size, &out, err, sizeof err);
    is_int(e, OUTBOX_EMALFORMED, "db as bin: EMALFORMED (%s)", err);
    msgpack_sbuffer_destroy(&p.sb);
}

/* Random corruption of a valid envelope: any result but a crash or leak. */
static void test_mutations(void)
{
    outbox_envelope in, *out;
    unsigned char *buf, *m;
    size_t len;
    unsigned seed = 12345;
    int decoded = 0, refused = 0;
    char err[128];

    memset(&in, 0, sizeof in);
    in.id = "id-1";
    in.topic = "t";
    in.key = "k";
    in.payload = "payload bytes";
    in.payload_len = 13;
    in.created_at = 42;
    len = encode(&in, &buf);
    m = malloc(len);
    for (int i = 0; i < 20000; i++) {
        memcpy(m, buf, len);
        for (int k = 0; k < 1 + i % 4; k++) {
            seed = seed * 1103515245u + 12345u;
            m[(seed >> 8) % len] = (unsigned char)(seed >> 16);
        }
        seed = seed * 1103515245u + 12345u;
        out = NULL;
        if (decode_copy(m, len - (seed >> 8) % 3, &out, err, sizeof err) == 0)
            decoded++;
        else
            refused++;
        outbox_envelope_free(out);
    }
    ok(decoded + refused == 20000, "20,000 mutated envelopes: %d decoded, %d refused, no crash", decoded, refused);
    free(m);
    free(buf);
}

int main(void)
{
    test_round_trip();
    test_malformed();
    test_db();
    test_mutations();
    return tap_done();
}
