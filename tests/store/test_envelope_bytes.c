/* The envelope's bytes: outbox_envelope_encode writes exactly what
 * msgpack-c's packer writes for the same map (proto/envelope.md's wire
 * format, as the encoder wrote it with msgpack-c), at every boundary of
 * the str, bin and integer encodings, with and without the database's name
 * (the eighth key, db, after created_at). */
#include <msgpack.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outbox.h"
#include "tap.h"

/* The reference: the map packed field by field with msgpack-c. */
static void pack_str(msgpack_packer *pk, const char *s, size_t n)
{
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void reference(const outbox_envelope *e, msgpack_sbuffer *sb)
{
    msgpack_packer pk;
    size_t klen = e->key ? (e->key_len ? e->key_len : strlen(e->key)) : 0;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, e->db ? 8 : 7);
    pack_str(&pk, "v", 1);
    msgpack_pack_int(&pk, e->version ? e->version : OUTBOX_ENVELOPE_VERSION);
    pack_str(&pk, "id", 2);
    pack_str(&pk, e->id, strlen(e->id));
    pack_str(&pk, "topic", 5);
    pack_str(&pk, e->topic, strlen(e->topic));
    pack_str(&pk, "key", 3);
    if (klen)
        pack_str(&pk, e->key, klen);
    else
        msgpack_pack_nil(&pk);
    pack_str(&pk, "payload", 7);
    msgpack_pack_bin(&pk, e->payload_len);
    msgpack_pack_bin_body(&pk, e->payload_len ? e->payload : "", e->payload_len);
    pack_str(&pk, "headers", 7);
    if (e->headers)
        msgpack_sbuffer_write(sb, e->headers, e->headers_len);
    else
        msgpack_pack_nil(&pk);
    pack_str(&pk, "created_at", 10);
    msgpack_pack_int64(&pk, e->created_at);
    if (e->db) {
        pack_str(&pk, "db", 2);
        pack_str(&pk, e->db, strlen(e->db));
    }
}

static const size_t lens[] = {1, 31, 32, 255, 256, 65535, 65536};
static const int64_t ints[] = {0,           1,           127,         128,         255,        256,
                               65535,       65536,       4294967295LL, 4294967296LL, INT64_MAX, 1700000000000LL,
                               -1,          -32,         -33,         -128,        -129,       -32768,
                               -32769,      INT32_MIN,   INT32_MIN - 1LL, INT64_MIN};
static const int versions[] = {0, 1, 127, 128, 65536, -1, -40, -200, -40000, INT32_MIN};
/* The database's name: none, empty, or each length of lens (-1: none). */
static const long db_lens[] = {-1, 0, 1, 31, 32, 255, 256, 65535, 65536};
#define NDB (sizeof db_lens / sizeof db_lens[0])

int main(void)
{
    static char big[70000], buf[400000];
    size_t nl = sizeof lens / sizeof lens[0], i, k, p, c;
    long checked = 0, bad = 0, over = 0, with_db = 0;
    char *dbs[NDB];
    int db_seen[NDB] = {0}, all_seen = 1;

    for (i = 0; i < sizeof big; i++)
        big[i] = (char)('a' + i % 26);
    for (i = 0; i < NDB; i++)
        dbs[i] = db_lens[i] < 0 ? NULL : strndup(big + 3, (size_t)db_lens[i]);
    for (i = 0; i < nl; i++)              /* id */
        for (k = 0; k < nl + 1; k++)      /* key: none, or each length */
            for (p = 0; p < nl + 1; p++) { /* payload: empty, or each length */
                char *id = strndup(big, lens[i]), *topic = strndup(big + 1, lens[(i + k) % nl]);
                for (c = 0; c < sizeof ints / sizeof ints[0]; c++) {
                    outbox_envelope e;
                    msgpack_sbuffer sb;
                    size_t len = 0;
                    memset(&e, 0, sizeof e);
                    e.version = versions[(i + k + p + c) % (sizeof versions / sizeof versions[0])];
                    e.id = id;
                    e.topic = topic;
                    e.key = k ? big + 2 : (c % 2 ? "" : NULL);
                    e.key_len = k ? lens[k - 1] : 0;
                    e.payload = p ? big : NULL;
                    e.payload_len = p ? lens[p - 1] : 0;
                    if (c % 3 == 1) {
                        e.headers = "\x81\xa1x\x01";
                        e.headers_len = 4;
                    }
                    e.created_at = ints[c];
                    e.db = dbs[(i + 2 * k + p + c) % NDB];
                    db_seen[(i + 2 * k + p + c) % NDB] = 1;
                    with_db += e.db != NULL;
                    msgpack_sbuffer_init(&sb);
                    reference(&e, &sb);
                    if (outbox_envelope_encode(&e, buf, sizeof buf, &len) != 0 || len != sb.size ||
                        memcmp(buf, sb.data, len) != 0) {
                        if (bad++ < 5)
                            diag("differs: id %zu, key %zu, payload %zu, db %ld bytes, created_at %lld, v %d",
                                 lens[i], e.key_len, e.payload_len, e.db ? (long)strlen(e.db) : -1L,
                                 (long long)e.created_at, e.version);
                    }
                    if (len > outbox_envelope_max_size(&e) && over++ < 5)
                        diag("over the bound: %zu bytes, outbox_envelope_max_size %zu", len,
                             outbox_envelope_max_size(&e));
                    checked++;
                    msgpack_sbuffer_destroy(&sb);
                }
                free(id);
                free(topic);
            }
    is_int(bad, 0, "%ld envelopes (%ld with a db): the same bytes as msgpack-c's packer", checked, with_db);
    is_int(over, 0, "outbox_envelope_max_size bounds every one of them");
    for (i = 0; i < NDB; i++) {
        all_seen &= db_seen[i];
        free(dbs[i]);
    }
    ok(all_seen && with_db < checked, "without a db, and with one of each length from 0 to 65536 bytes");
    return tap_done();
}
