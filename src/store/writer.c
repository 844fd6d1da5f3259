/*
 * The writer: validated INSERTs into the outbox inside the caller's
 * transaction, with one cached statement.
 */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"
#include "store/msgpack_check.h"
#include "outbox/schema.h"
#include "outbox/writer.h"
#include "store/sqlite_util.h"

struct outbox_writer {
    sqlite3 *db;
    sqlite3_stmt *insert;
    outbox_writer_settings s;
    char errmsg[256];
};

static const char insert_sql[] =
    "INSERT INTO outbox(id, topic, key, payload, headers, created_at, available_at) "
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

/* A printable rendering of one byte for messages. */
static const char *byte_name(unsigned char c, char buf[8])
{
    if (c > ' ' && c < 0x7f)
        snprintf(buf, 8, "'%c'", c);
    else
        snprintf(buf, 8, "0x%02x", c);
    return buf;
}

/* Nonzero if some byte of s is outside '!'..'~'. */
static unsigned id_bad_bytes(const unsigned char *s, size_t n)
{
    unsigned bad = 0;
    size_t i;
    for (i = 0; i < n; i++)
        bad |= (unsigned char)(s[i] - '!') > '~' - '!';
    return bad;
}

int outbox_validate_id(const char *id, char *err, size_t errlen)
{
    size_t i, n;
    char b[8];
    if (!id || !*id)
        return outbox__errf(err, errlen, OUTBOX_EID, "message id is empty");
    n = strlen(id);
    if (n > OUTBOX_ID_MAX)
        return outbox__errf(err, errlen, OUTBOX_EID, "message id is %zu bytes, the limit is %d", n, OUTBOX_ID_MAX);
    /* First a pass without an early exit, which the compiler turns into
     * vector code: the relay checks every row it claims, and the loop
     * below, byte by byte, was 2 % of its work per message. */
    if (!id_bad_bytes((const unsigned char *)id, n))
        return 0;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        if (c < '!' || c > '~')
            return outbox__errf(err, errlen, OUTBOX_EID,
                                "message id has %s at byte %zu (allowed: printable ASCII without spaces)",
                                byte_name(c, b), i);
    }
    return 0;
}

static int topic_char_ok(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == ':' || c == '/';
}

int outbox_validate_topic(const char *topic, char *err, size_t errlen)
{
    size_t i, n;
    char b[8];
    if (!topic || !*topic)
        return outbox__errf(err, errlen, OUTBOX_ETOPIC, "topic is empty");
    n = strlen(topic);
    if (n > OUTBOX_TOPIC_MAX)
        return outbox__errf(err, errlen, OUTBOX_ETOPIC, "topic is %zu bytes, the limit is %d", n, OUTBOX_TOPIC_MAX);
    for (i = 0; i < n; i++)
        if (!topic_char_ok((unsigned char)topic[i]))
            return outbox__errf(err, errlen, OUTBOX_ETOPIC, "topic has %s at byte %zu (allowed: A-Z a-z 0-9 . _ - : /)",
                                byte_name((unsigned char)topic[i], b), i);
    return 0;
}

int outbox_validate_key(const char *key, size_t len, char *err, size_t errlen)
{
    size_t bad;
    if (!key || len == 0)
        return 0;
    if (len > OUTBOX_KEY_MAX)
        return outbox__errf(err, errlen, OUTBOX_EKEY, "key is %zu bytes, the limit is %d", len, OUTBOX_KEY_MAX);
    if (memchr(key, '\0', len))
        return outbox__errf(err, errlen, OUTBOX_EKEY, "key contains a NUL byte");
    bad = outbox__utf8_prefix((const unsigned char *)key, len);
    if (bad != len)
        return outbox__errf(err, errlen, OUTBOX_EKEY, "key is not valid UTF-8 at byte %zu", bad);
    return 0;
}

int outbox_validate_headers(const void *headers, size_t len, char *err, size_t errlen)
{
    msgpack_unpacked u;
    size_t off = 0;
    int rc, e = 0;
    uint32_t i;

    if (!headers)
        return len ? outbox__errf(err, errlen, OUTBOX_EINVAL, "headers pointer is NULL with a length of %zu", len) : 0;
    if (len == 0)
        return outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are empty (pass NULL for no headers)");
    /* Bounds first: msgpack-c would allocate declared container sizes. */
    rc = outbox__msgpack_check(headers, len, &off);
    if (rc == OUTBOX_ETRUNCATED)
        return outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are truncated msgpack (%zu bytes)", len);
    if (rc != 0)
        return outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are not valid msgpack");
    off = 0;
    msgpack_unpacked_init(&u);
    rc = msgpack_unpack_next(&u, headers, len, &off);
    if (rc == MSGPACK_UNPACK_CONTINUE)
        e = outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are truncated msgpack (%zu bytes)", len);
    else if (rc == MSGPACK_UNPACK_NOMEM_ERROR)
        e = outbox__errf(err, errlen, OUTBOX_ENOMEM, "out of memory decoding headers");
    else if (rc != MSGPACK_UNPACK_SUCCESS)
        e = outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are not valid msgpack");
    else if (u.data.type != MSGPACK_OBJECT_MAP)
        e = outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers are msgpack but not a map (type %d)", (int)u.data.type);
    else if (off != len)
        e = outbox__errf(err, errlen, OUTBOX_EHEADERS, "headers have %zu trailing bytes after the map", len - off);
    else
        for (i = 0; i < u.data.via.map.size; i++)
            if (u.data.via.map.ptr[i].key.type != MSGPACK_OBJECT_STR) {
                e = outbox__errf(err, errlen, OUTBOX_EHEADERS, "header key %u is not a string", i);
                break;
            }
    msgpack_unpacked_destroy(&u);
    return e;
}

/* ---- trace context -------------------------------------------------------- */

/* n lowercase hex digits at s, not all zeros when nonzero is set. */
static int lower_hex(const char *s, size_t n, int nonzero)
{
    int any = 0;
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
        any |= s[i] != '0';
    }
    return any || !nonzero;
}

int outbox_validate_traceparent(const char *tp, char *err, size_t errlen)
{
    size_t n;
    if (!tp)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "traceparent is NULL");
    n = strlen(tp);
    if (n != OUTBOX_TRACEPARENT_LEN)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "traceparent is %zu characters, not %d (version-traceid-parentid-flags)", n,
                            OUTBOX_TRACEPARENT_LEN);
    if (tp[2] != '-' || tp[35] != '-' || tp[52] != '-')
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "traceparent '%s' is not version-traceid-parentid-flags (2, 32, 16 and 2 hex digits "
                            "separated by '-')",
                            tp);
    if (!lower_hex(tp, 2, 0) || !strncmp(tp, "ff", 2))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "traceparent '%s': the version is not 2 lowercase hex "
                            "digits other than ff", tp);
    if (!lower_hex(tp + 3, 32, 1))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "traceparent '%s': the trace id is not 32 lowercase hex "
                            "digits, not all zeros", tp);
    if (!lower_hex(tp + 36, 16, 1))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "traceparent '%s': the parent id is not 16 lowercase hex "
                            "digits, not all zeros", tp);
    if (!lower_hex(tp + 53, 2, 0))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "traceparent '%s': the flags are not 2 lowercase hex digits",
                            tp);
    return 0;
}

int outbox_validate_tracestate(const char *ts, char *err, size_t errlen)
{
    size_t n = strlen(ts);
    if (n > OUTBOX_TRACESTATE_MAX)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "tracestate is %zu bytes, the limit is %d", n,
                            OUTBOX_TRACESTATE_MAX);
    for (size_t i = 0; i < n; i++)
        if (ts[i] < ' ' || ts[i] > '~')
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "tracestate has a byte outside printable ASCII at %zu",
                                i);
    return 0;
}

static int is_trace_key(const msgpack_object *k)
{
    static const char *const names[] = {OUTBOX_HEADER_TRACEPARENT, OUTBOX_HEADER_TRACESTATE};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(names); i++)
        if (k->via.str.size == strlen(names[i]) && !memcmp(k->via.str.ptr, names[i], k->via.str.size))
            return 1;
    return 0;
}

static int pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    return msgpack_pack_str(pk, n) || msgpack_pack_str_body(pk, s, n);
}

int outbox_headers_trace(const void *headers, size_t headers_len, const char *traceparent, const char *tracestate,
                         void **out, size_t *out_len, char *err, size_t errlen)
{
    msgpack_unpacked u;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    const msgpack_object_map *map = NULL;
    int has_state = tracestate && *tracestate, e, failed = 0;
    size_t off = 0, kept = 0, i;

    if (!out || !out_len)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "out and out_len must not be NULL");
    *out = NULL;
    *out_len = 0;
    if ((e = outbox_validate_traceparent(traceparent, err, errlen)) != 0 ||
        (has_state && (e = outbox_validate_tracestate(tracestate, err, errlen)) != 0))
        return e;
    if ((headers || headers_len) && (e = outbox_validate_headers(headers, headers_len, err, errlen)) != 0)
        return e;
    msgpack_unpacked_init(&u);
    if (headers) {
        if (msgpack_unpack_next(&u, headers, headers_len, &off) != MSGPACK_UNPACK_SUCCESS) {
            msgpack_unpacked_destroy(&u);
            return outbox__errf(err, errlen, OUTBOX_ENOMEM, "out of memory decoding headers");
        }
        map = &u.data.via.map;
        for (i = 0; i < map->size; i++)
            kept += !is_trace_key(&map->ptr[i].key);
    }
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    failed |= msgpack_pack_map(&pk, kept + 1 + (size_t)has_state);
    for (i = 0; map && i < map->size && !failed; i++)
        if (!is_trace_key(&map->ptr[i].key))
            failed |= msgpack_pack_object(&pk, map->ptr[i].key) || msgpack_pack_object(&pk, map->ptr[i].val);
    failed |= pack_str(&pk, OUTBOX_HEADER_TRACEPARENT) || pack_str(&pk, traceparent);
    if (has_state)
        failed |= pack_str(&pk, OUTBOX_HEADER_TRACESTATE) || pack_str(&pk, tracestate);
    msgpack_unpacked_destroy(&u);
    if (failed) {
        msgpack_sbuffer_destroy(&sb);
        return outbox__errf(err, errlen, OUTBOX_ENOMEM, "out of memory building the headers");
    }
    *out_len = sb.size;
    *out = msgpack_sbuffer_release(&sb);
    /* The buffer grows in steps of 8 KiB; a headers map is much smaller. */
    {
        void *fit = realloc(*out, *out_len);
        if (fit)
            *out = fit;
    }
    return 0;
}

void outbox_writer_defaults(outbox_writer_settings *s)
{
    memset(s, 0, sizeof *s);
    s->max_payload = OUTBOX_PAYLOAD_DEFAULT_MAX;
    s->warn_not_durable = 1;
    s->log = outbox_log_stderr;
}

int outbox_writer_create(outbox_writer **out, sqlite3 *db, const outbox_writer_settings *s)
{
    outbox_writer *w;
    int rc;

    if (!out)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!db)
        return OUTBOX_EINVAL;
    if (s && (s->max_payload == 0 || s->max_payload > OUTBOX_PAYLOAD_HARD_MAX))
        return OUTBOX_EINVAL;
    w = calloc(1, sizeof *w);
    if (!w)
        return OUTBOX_ENOMEM;
    if (s)
        w->s = *s;
    else
        outbox_writer_defaults(&w->s);
    w->db = db;
    rc = sqlite3_prepare_v3(db, insert_sql, -1, SQLITE_PREPARE_PERSISTENT, &w->insert, NULL);
    if (rc != SQLITE_OK) {
        int e = strstr(sqlite3_errmsg(db), "no such table") ? OUTBOX_ENOSCHEMA : outbox__sqlite_code(rc);
        free(w);
        return e ? e : OUTBOX_ESQLITE;
    }
    if (w->s.warn_not_durable && w->s.log && outbox_db_is_durable(db) == 0) {
        outbox__logger lg = {w->s.log, w->s.log_data, OUTBOX_LOG_DEBUG};
        outbox__log(&lg, OUTBOX_LOG_WARN,
                    "msg=\"writer connection is not durable: PRAGMA synchronous is below FULL, so a power "
                    "cut can undo a commit whose message was already published; open it with "
                    "outbox_db_open() or set PRAGMA synchronous=FULL\"");
    }
    *out = w;
    return 0;
}

void outbox_writer_destroy(outbox_writer *w)
{
    if (!w)
        return;
    sqlite3_finalize(w->insert);
    free(w);
}

const char *outbox_writer_errmsg(const outbox_writer *w)
{
    return w ? w->errmsg : "";
}

int outbox_enqueue(outbox_writer *w, const outbox_message *m, char *id_out)
{
    char genid[37];
    const char *id;
    size_t key_len;
    int rc, e;
    int64_t now;

    if (!w)
        return OUTBOX_EINVAL;
    w->errmsg[0] = '\0';
    if (!m)
        return outbox__errf(w->errmsg, sizeof w->errmsg, OUTBOX_EINVAL, "message is NULL");
    if (!m->payload && m->payload_len)
        return outbox__errf(w->errmsg, sizeof w->errmsg, OUTBOX_EINVAL, "payload is NULL with a length of %zu",
                            m->payload_len);
    if ((e = outbox_validate_topic(m->topic, w->errmsg, sizeof w->errmsg)) != 0)
        return e;
    key_len = m->key ? strlen(m->key) : 0;
    if ((e = outbox_validate_key(m->key, key_len, w->errmsg, sizeof w->errmsg)) != 0)
        return e;
    if (m->payload_len > w->s.max_payload)
        return outbox__errf(w->errmsg, sizeof w->errmsg, OUTBOX_ETOOBIG, "payload is %zu bytes, the limit is %zu",
                            m->payload_len, w->s.max_payload);
    if (m->headers || m->headers_len)
        if ((e = outbox_validate_headers(m->headers, m->headers_len, w->errmsg, sizeof w->errmsg)) != 0)
            return e;
    if (m->id) {
        if ((e = outbox_validate_id(m->id, w->errmsg, sizeof w->errmsg)) != 0)
            return e;
        id = m->id;
    } else {
        outbox_uuid7(genid);
        id = genid;
    }

    now = outbox_now_ms();
    sqlite3_bind_text(w->insert, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(w->insert, 2, m->topic, -1, SQLITE_STATIC);
    if (key_len)
        sqlite3_bind_text(w->insert, 3, m->key, (int)key_len, SQLITE_STATIC);
    else
        sqlite3_bind_null(w->insert, 3);
    /* A zero-length blob, not NULL: payload is NOT NULL. */
    sqlite3_bind_blob(w->insert, 4, m->payload_len ? m->payload : "", (int)m->payload_len, SQLITE_STATIC);
    if (m->headers)
        sqlite3_bind_blob(w->insert, 5, m->headers, (int)m->headers_len, SQLITE_STATIC);
    else
        sqlite3_bind_null(w->insert, 5);
    sqlite3_bind_int64(w->insert, 6, now);
    sqlite3_bind_int64(w->insert, 7, m->available_at > 0 ? m->available_at : now);

    rc = sqlite3_step(w->insert);
    if (rc == SQLITE_DONE) {
        e = 0;
        if (id_out)
            memcpy(id_out, id, strlen(id) + 1);
    } else {
        int xrc = sqlite3_extended_errcode(w->db);
        if (xrc == SQLITE_CONSTRAINT_UNIQUE || xrc == SQLITE_CONSTRAINT_PRIMARYKEY) {
            e = outbox__errf(w->errmsg, sizeof w->errmsg, OUTBOX_EDUPLICATE, "a message with id '%s' already exists",
                             id);
        } else if ((xrc & 0xff) == SQLITE_CONSTRAINT) {
            e = outbox__errf(w->errmsg, sizeof w->errmsg, OUTBOX_ESQLITE, "outbox constraint failed: %s",
                             sqlite3_errmsg(w->db));
        } else {
            if (strstr(sqlite3_errmsg(w->db), "no such table"))
                e = OUTBOX_ENOSCHEMA;
            else if ((e = outbox__sqlite_code(rc)) == 0)
                e = OUTBOX_ESQLITE;
            outbox__errf(w->errmsg, sizeof w->errmsg, e, "insert failed: %s", sqlite3_errmsg(w->db));
        }
    }
    sqlite3_reset(w->insert);
    /* Drop references to the caller's buffers. */
    sqlite3_clear_bindings(w->insert);
    return e;
}
