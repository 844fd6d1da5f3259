/*
 * envelope.h: the stream entry and its msgpack envelope (proto/envelope.md).
 *
 * Each Redis Stream entry the relay writes has two fields, in this order:
 *   id        the message id as a plain string (readable without msgpack);
 *   envelope  a msgpack map: {"v": 1, "id": str, "topic": str,
 *             "key": str|nil, "payload": bin, "headers": map|nil,
 *             "created_at": int (unix ms)}.
 * A relay over many databases (outbox_relay_group, outbox-relay --db-dir)
 * names the message's database too: a field "db" between the two, and a
 * key "db" (str) last in the envelope.
 * Decoders ignore keys they do not know; "v" changes only on a breaking
 * change.
 */
#ifndef OUTBOX_ENVELOPE_H
#define OUTBOX_ENVELOPE_H

#include "outbox/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define OUTBOX_ENVELOPE_VERSION 1

typedef struct outbox_envelope {
    int version;            /* OUTBOX_ENVELOPE_VERSION when encoding */
    const char *id;         /* NUL-terminated */
    const char *topic;      /* NUL-terminated */
    const char *key;        /* NUL-terminated, or NULL for none */
    size_t key_len;         /* bytes of key (decoding sets it; encoding uses strlen when 0) */
    const void *payload;    /* payload_len bytes */
    size_t payload_len;
    const void *headers;    /* a msgpack map, headers_len bytes, or NULL */
    size_t headers_len;
    int64_t created_at;     /* unix ms */
    const char *db;         /* the database's name (NUL-terminated), or NULL: not encoded */
} outbox_envelope;

/* An upper bound of the encoded size of e. */
OUTBOX_API size_t outbox_envelope_max_size(const outbox_envelope *e);

/*
 * Encodes e into buf (cap bytes); *len receives the size used. headers, if
 * any, are copied verbatim (validate them first: outbox_validate_headers()).
 * Returns 0, OUTBOX_EINVAL (NULL id/topic, payload NULL with a length),
 * OUTBOX_ERANGE (cap too small: use outbox_envelope_max_size()).
 */
OUTBOX_API int outbox_envelope_encode(const outbox_envelope *e, void *buf, size_t cap, size_t *len);

/*
 * Decodes one envelope from exactly len bytes of data (never reads past
 * them). On success *out is one allocation holding the struct and copies of
 * every field; free it with outbox_envelope_free(). Returns 0 or:
 *   OUTBOX_ETRUNCATED  the data ends inside the map;
 *   OUTBOX_EMALFORMED  not a msgpack map, trailing bytes, a required field
 *                      (v, id, topic, payload, created_at) missing or of the
 *                      wrong type, key or db not a string or nil, or headers
 *                      not a map or nil;
 *   OUTBOX_EVERSION    v is not a version this library reads;
 *   OUTBOX_ENOMEM.
 * err (may be NULL) gets the detail, e.g. "field 'payload' missing".
 */
OUTBOX_API int outbox_envelope_decode(const void *data, size_t len, outbox_envelope **out, char *err,
                                      size_t errlen);

/* NULL is a no-op. */
OUTBOX_API void outbox_envelope_free(outbox_envelope *e);

#ifdef __cplusplus
}
#endif

#endif
