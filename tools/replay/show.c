/*
 * outbox-replay show (replay.h): one message in full, for a human or as
 * one JSON object, with its headers decoded from msgpack.
 */
#include <inttypes.h>
#include <stdio.h>

#include <msgpack.h>

#include "json.h"
#include "store/msgpack_check.h"
#include "replay.h"

/* Decodes headers for show. Returns 0 with u holding exactly one object,
 * or -1 with *why (u is then empty). Bounds are checked before msgpack-c
 * allocates anything (see src/store/msgpack_check.h). */
static int decode_headers(const void *data, size_t len, msgpack_unpacked *u, const char **why)
{
    size_t used = 0, off = 0;
    int e = outbox__msgpack_check(data, len, &used);
    msgpack_unpacked_init(u);
    if (e == OUTBOX_ETRUNCATED) {
        *why = "truncated msgpack";
        return -1;
    }
    if (e != 0) {
        *why = "not valid msgpack";
        return -1;
    }
    if (used != len) {
        *why = "trailing bytes after one msgpack object";
        return -1;
    }
    if (msgpack_unpack_next(u, data, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        *why = "not valid msgpack";
        return -1;
    }
    return 0;
}

/* The message as one JSON object, built in b. */
static void show_json(outbox__sbuf *b, sqlite3_stmt *st, int64_t now)
{
    const unsigned char *payload = sqlite3_column_blob(st, C_PAYLOAD);
    size_t plen = (size_t)sqlite3_column_bytes(st, C_PAYLOAD);

    replay_json_row_fields(b, st, now);
    outbox__sbuf_printf(b, ",\"payload_size\":%zu,\"payload_encoding\":\"%s\",\"payload\":", plen,
                        tools_utf8_valid(payload, plen) ? "utf8" : "base64");
    tools_json_text_or_base64(b, payload, plen);
    outbox__sbuf_puts(b, ",\"headers\":");
    if (replay_col_null(st, C_HEADERS)) {
        outbox__sbuf_puts(b, "null");
    } else {
        const void *h = sqlite3_column_blob(st, C_HEADERS);
        size_t hlen = (size_t)sqlite3_column_bytes(st, C_HEADERS);
        msgpack_unpacked u;
        const char *why = NULL;
        if (decode_headers(h, hlen, &u, &why) == 0) {
            tools_json_msgpack(b, &u.data, TOOLS_MSGPACK_TAGGED);
            if (u.data.type != MSGPACK_OBJECT_MAP)
                outbox__sbuf_puts(b, ",\"headers_error\":\"not a msgpack map\"");
        } else {
            outbox__sbuf_puts(b, "null,\"headers_error\":");
            tools_json_cstr(b, why);
            outbox__sbuf_puts(b, ",\"headers_base64\":\"");
            tools_base64(b, h, hlen);
            outbox__sbuf_puts(b, "\"");
        }
        msgpack_unpacked_destroy(&u);
    }
    outbox__sbuf_puts(b, "}\n");
}

static void show_field(const char *label, sqlite3_stmt *st, int i)
{
    size_t n;
    const unsigned char *s = replay_col_text(st, i, &n);
    printf("%-14s ", label);
    if (s)
        replay_print_clean(stdout, s, n, 0);
    else
        fputs("-", stdout);
    putchar('\n');
}

static void show_time(const char *label, sqlite3_stmt *st, int i, int64_t now)
{
    char buf[96], d[32];
    int64_t t = sqlite3_column_int64(st, i);
    printf("%-14s ", label);
    if (replay_col_null(st, i))
        puts("-");
    else
        printf("%s (%s %s)\n", replay_fmt_time(t, buf), replay_fmt_dur(now - t, d), t <= now ? "ago" : "from now");
}

/* The message for a human, on stdout; b carries the parts that the JSON
 * writer makes. Returns 0, or -1 after a message. */
static int show_human(outbox__sbuf *b, sqlite3_stmt *st, int64_t now)
{
    const unsigned char *payload = sqlite3_column_blob(st, C_PAYLOAD);
    size_t plen = (size_t)sqlite3_column_bytes(st, C_PAYLOAD);
    int64_t state = sqlite3_column_int64(st, C_STATE), replays = sqlite3_column_int64(st, C_REPLAY_COUNT);
    char buf[96], d[32];

    show_field("id:", st, C_ID);
    printf("%-14s %" PRId64 "\n", "seq:", (int64_t)sqlite3_column_int64(st, C_SEQ));
    printf("%-14s %s\n", "state:", replay_state_name(state));
    show_field("topic:", st, C_TOPIC);
    show_field("key:", st, C_KEY);
    printf("%-14s %" PRId64 "\n", "attempts:", (int64_t)sqlite3_column_int64(st, C_ATTEMPTS));
    show_field("last error:", st, C_LAST_ERROR);
    printf("%-14s ", "lease:");
    if (state == OUTBOX_STATE_SENDING || !replay_col_null(st, C_LEASE_OWNER)) {
        size_t n;
        const unsigned char *owner = replay_col_text(st, C_LEASE_OWNER, &n);
        int64_t until = sqlite3_column_int64(st, C_LEASE_UNTIL);
        fputs("owner ", stdout);
        if (owner)
            replay_print_clean(stdout, owner, n, 0);
        else
            fputs("-", stdout);
        printf(", token %" PRId64, (int64_t)sqlite3_column_int64(st, C_LEASE_TOKEN));
        if (replay_col_null(st, C_LEASE_UNTIL))
            puts(", no expiry");
        else
            printf(", until %s (%s %s)\n", replay_fmt_time(until, buf), until > now ? "live, expires in" : "expired",
                   replay_fmt_dur(until - now, d));
    } else {
        printf("- (token %" PRId64 ")\n", (int64_t)sqlite3_column_int64(st, C_LEASE_TOKEN));
    }
    show_time("created:", st, C_CREATED, now);
    show_time("available:", st, C_AVAILABLE, now);
    show_time("published:", st, C_PUBLISHED, now);
    if (replay_col_null(st, C_BATCH)) {
        show_field("stream id:", st, C_STREAM_ID);
    } else {
        /* Its state is its batch record's: published (or leased) with the
         * batch, whose record keeps no entry id per message. */
        printf("%-14s - (in the batch of seqs from %" PRId64 ": entry ids are not kept per message)\n", "stream id:",
               (int64_t)sqlite3_column_int64(st, C_BATCH));
    }
    printf("%-14s %" PRId64 "\n", "replays:", replays);
    if (replays > 0 || !replay_col_null(st, C_REPLAYED_AT)) {
        show_time("replayed:", st, C_REPLAYED_AT, now);
        show_field("replay reason:", st, C_REPLAY_REASON);
    }
    printf("%-14s ", "headers:");
    if (replay_col_null(st, C_HEADERS)) {
        puts("-");
    } else {
        const void *h = sqlite3_column_blob(st, C_HEADERS);
        size_t hlen = (size_t)sqlite3_column_bytes(st, C_HEADERS);
        msgpack_unpacked u;
        const char *why = NULL;
        int e;
        if (decode_headers(h, hlen, &u, &why) == 0) {
            tools_json_msgpack(b, &u.data, TOOLS_MSGPACK_TAGGED);
            e = replay_emit(b);
            puts(u.data.type == MSGPACK_OBJECT_MAP ? "" : " (not a msgpack map)");
        } else {
            printf("undecodable (%s), base64 ", why);
            tools_base64(b, h, hlen);
            e = replay_emit(b);
            putchar('\n');
        }
        msgpack_unpacked_destroy(&u);
        if (e != 0)
            return -1;
    }
    if (tools_utf8_valid(payload, plen)) {
        printf("%-14s %zu bytes, utf8 text:\n", "payload:", plen);
        replay_print_clean(stdout, payload, plen, 1);
    } else {
        printf("%-14s %zu bytes, not UTF-8, base64:\n", "payload:", plen);
        tools_base64(b, payload, plen);
        if (replay_emit(b) != 0)
            return -1;
    }
    putchar('\n');
    return 0;
}

int replay_cmd_show(const replay_options *o)
{
    sqlite3 *db;
    sqlite3_stmt *st = NULL;
    outbox__sbuf b = {0};
    int rc = replay_open_db(o, 0, &db);
    if (rc != GO_ON)
        return rc;
    if (sqlite3_prepare_v2(db, "SELECT " ROW_COLS ", payload, headers FROM outbox_messages WHERE id = ?1", -1, &st, NULL) !=
            SQLITE_OK ||
        sqlite3_bind_text(st, 1, o->show_id, -1, SQLITE_STATIC) != SQLITE_OK) {
        rc = replay_db_fail(db, "cannot prepare the query");
        goto done;
    }
    rc = sqlite3_step(st);
    if (rc == SQLITE_DONE) {
        replay_errorf("no message with id %s", o->show_id);
        rc = EXIT_FAIL;
    } else if (rc != SQLITE_ROW) {
        rc = replay_db_fail(db, "cannot read the message");
    } else if (o->json) {
        show_json(&b, st, outbox_now_ms());
        rc = replay_emit(&b) == 0 ? replay_finish_output() : EXIT_FAIL;
    } else {
        rc = show_human(&b, st, outbox_now_ms()) == 0 ? replay_finish_output() : EXIT_FAIL;
    }
done:
    outbox__sbuf_free(&b);
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return rc;
}
