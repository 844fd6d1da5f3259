/*
 * test_trace.c: W3C trace context from the writer to the consumer.
 * outbox_headers_trace() refuses a bad traceparent or tracestate (EINVAL,
 * with the reason) and bad headers (EHEADERS), and merges a good one into
 * the headers, keeping the other entries and replacing old trace entries.
 * End to end: messages enqueued with it, published by outbox-relay --drain,
 * reach outbox-consume --exec as TRACEPARENT and TRACESTATE (equal to what
 * was written; absent for a message without trace context, or with a
 * traceparent that is not valid, even when the consumer's own environment
 * has them) and --print as traceparent and tracestate.
 */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sqlite3.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define TP "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
#define TS "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"

static void refused(const char *tp, const char *ts, const char *why, const char *what)
{
    void *out = (void *)1;
    size_t len = 1;
    char err[256] = "";
    int e = outbox_headers_trace(NULL, 0, tp, ts, &out, &len, err, sizeof err);
    is_int(e, OUTBOX_EINVAL, "%s: refused with OUTBOX_EINVAL", what);
    ok(strstr(err, why) != NULL, "%s: the message says '%s': %s", what, why, err);
    ok(out == NULL && len == 0, "%s: nothing returned", what);
}

static void check_refusals(void)
{
    char err[256];
    void *out;
    size_t len;
    refused(NULL, NULL, "NULL", "no traceparent");
    refused("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", NULL, "not 55", "too short");
    refused(TP "0", NULL, "not 55", "too long");
    refused("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", NULL, "trace id", "upper case hex");
    refused("00-00000000000000000000000000000000-00f067aa0ba902b7-01", NULL, "trace id", "all-zero trace id");
    refused("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", NULL, "parent id", "all-zero parent id");
    refused("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", NULL, "version", "version ff");
    refused("00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", NULL, "version-traceid-parentid-flags",
            "wrong separator");
    refused("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g", NULL, "flags", "bad flags");
    refused(TP, "a=b\nc=d", "printable ASCII", "tracestate with a newline");
    {
        char big[OUTBOX_TRACESTATE_MAX + 2];
        memset(big, 'a', sizeof big - 1);
        big[sizeof big - 1] = '\0';
        refused(TP, big, "limit", "tracestate too long");
    }
    is_int(outbox_validate_traceparent(TP, NULL, 0), 0, "outbox_validate_traceparent accepts a good one");
    is_int(outbox_headers_trace("\x91\x01", 2, TP, NULL, &out, &len, err, sizeof err), OUTBOX_EHEADERS,
           "headers that are not a map: OUTBOX_EHEADERS (%s)", err);
    is_int(outbox_headers_trace(NULL, 0, TP, NULL, NULL, &len, err, sizeof err), OUTBOX_EINVAL,
           "a NULL out pointer: OUTBOX_EINVAL");
}

/* The value of key in a msgpack map, as a malloc'd string ("" when absent,
 * "?" when not a string); *count gets the number of entries. */
static char *map_get(const void *map, size_t len, const char *key, size_t *count)
{
    msgpack_unpacked u;
    size_t off = 0;
    char *v = strdup("");
    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, map, len, &off) != MSGPACK_UNPACK_SUCCESS || u.data.type != MSGPACK_OBJECT_MAP)
        bail("not a msgpack map");
    *count = u.data.via.map.size;
    for (uint32_t i = 0; i < u.data.via.map.size; i++) {
        const msgpack_object *k = &u.data.via.map.ptr[i].key, *o = &u.data.via.map.ptr[i].val;
        if (k->via.str.size != strlen(key) || memcmp(k->via.str.ptr, key, k->via.str.size))
            continue;
        free(v);
        v = o->type == MSGPACK_OBJECT_STR ? strndup(o->via.str.ptr, o->via.str.size)
            : o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? strdup("int")
                                                         : strdup("?");
    }
    msgpack_unpacked_destroy(&u);
    return v;
}

/* A map {"app": 7, "traceparent": "old"} in msgpack. */
static void old_headers(msgpack_sbuffer *sb)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 2);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "app", 3);
    msgpack_pack_int(&pk, 7);
    msgpack_pack_str(&pk, 11);
    msgpack_pack_str_body(&pk, "traceparent", 11);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "old", 3);
}

static void check_merge(void)
{
    msgpack_sbuffer sb;
    void *out;
    size_t len, n;
    char err[256], *v;
    old_headers(&sb);
    is_int(outbox_headers_trace(sb.data, sb.size, TP, TS, &out, &len, err, sizeof err), 0, "merged into headers");
    is_int(outbox_validate_headers(out, len, NULL, 0), 0, "the result is a valid headers map");
    v = map_get(out, len, "traceparent", &n);
    is_str(v, TP, "traceparent replaced");
    free(v);
    v = map_get(out, len, "tracestate", &n);
    is_str(v, TS, "tracestate added");
    free(v);
    v = map_get(out, len, "app", &n);
    is_str(v, "int", "the other entry kept");
    free(v);
    is_int(n, 3, "three entries: app, traceparent, tracestate");
    free(out);
    msgpack_sbuffer_destroy(&sb);
}

static void enqueue(outbox_writer *w, const char *id, const char *tp, const char *ts)
{
    outbox_message m = {.id = id, .topic = "orders", .payload = "{}", .payload_len = 2};
    void *h = NULL;
    size_t hlen = 0;
    char err[256];
    if (tp && outbox_headers_trace(NULL, 0, tp, ts, &h, &hlen, err, sizeof err) != 0)
        bail("outbox_headers_trace: %s", err);
    m.headers = h;
    m.headers_len = hlen;
    if (outbox_enqueue(w, &m, NULL) != 0)
        bail("enqueue %s: %s", id, outbox_writer_errmsg(w));
    free(h);
}

int main(void)
{
    th_redis srv;
    char *dir, *db, *relay, *envout, *out = NULL, *err = NULL, *exec_cmd, *got;
    sqlite3 *h;
    outbox_writer *w;
    char errbuf[256];
    int code;

    check_refusals();
    check_merge();

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();
    db = th_path(dir, "app.db");
    envout = th_path(dir, "env.txt");
    relay = th_bin("tools/relay/outbox-relay");
    if (outbox_db_open(db, OUTBOX_OPEN_CREATE, &h, errbuf, sizeof errbuf) != 0 ||
        outbox_schema_apply(h, errbuf, sizeof errbuf) != 0 || outbox_writer_create(&w, h, NULL) != 0)
        bail("database: %s", errbuf);
    enqueue(w, "traced", TP, TS);
    enqueue(w, "parent-only", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", NULL);
    enqueue(w, "untraced", NULL, NULL);
    {
        /* Another writer's headers with a traceparent that is not valid
         * (upper case): the consumer ignores it, and its tracestate. */
        msgpack_sbuffer sb;
        msgpack_packer pk;
        outbox_message m = {.id = "bad-trace", .topic = "orders", .payload = "{}", .payload_len = 2};
        static const char bad[] = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 2);
        msgpack_pack_str(&pk, 11);
        msgpack_pack_str_body(&pk, "traceparent", 11);
        msgpack_pack_str(&pk, sizeof bad - 1);
        msgpack_pack_str_body(&pk, bad, sizeof bad - 1);
        msgpack_pack_str(&pk, 10);
        msgpack_pack_str_body(&pk, "tracestate", 10);
        msgpack_pack_str(&pk, 3);
        msgpack_pack_str_body(&pk, "a=b", 3);
        m.headers = sb.data;
        m.headers_len = sb.size;
        if (outbox_enqueue(w, &m, NULL) != 0)
            bail("enqueue: %s", outbox_writer_errmsg(w));
        msgpack_sbuffer_destroy(&sb);
    }
    outbox_writer_destroy(w);
    sqlite3_close_v2(h);

    {
        char *argv[] = {relay, "--db", db, "--redis", srv.url, "--drain", NULL};
        code = th_run(argv, NULL, NULL, &err, 30000 * th_slow());
        is_int(code, 0, "outbox-relay --drain published the four messages");
        if (code != 0)
            th_diag_tail("relay", err, INT_MAX);
        free(err);
    }

    if (asprintf(&exec_cmd, "printf '%%s|%%s|%%s\\n' \"$OUTBOX_ID\" \"${TRACEPARENT-unset}\" "
                            "\"${TRACESTATE-unset}\" >>'%s'",
                 envout) < 0)
        bail("out of memory");
    {
        const char *args[] = {"--redis", srv.url, "--stream", "outbox:orders", "--group", "exec",
                              "--exec", exec_cmd, "--max-inflight", "1", "--drain", NULL};
        /* The consumer's own trace context must not leak to the commands. */
        char *env[] = {"TRACEPARENT=00-11111111111111111111111111111111-2222222222222222-01",
                       "TRACESTATE=leaked=1", NULL};
        code = ct_consume_run(args, env, NULL, &err, 30000 * th_slow());
        is_int(code, 0, "outbox-consume --exec --drain exited 0");
        if (code != 0)
            th_diag_tail("consume", err, INT_MAX);
        free(err);
    }
    got = th_slurp(envout);
    is_str(got,
           "traced|" TP "|" TS "\n"
           "parent-only|00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00|unset\n"
           "untraced|unset|unset\n"
           "bad-trace|unset|unset\n",
           "--exec: TRACEPARENT and TRACESTATE as written, unset without a valid trace context");
    free(got);

    {
        const char *args[] = {"--redis", srv.url, "--stream", "outbox:orders", "--group", "print",
                              "--print", "--drain", NULL};
        code = ct_consume_run(args, NULL, &out, &err, 30000 * th_slow());
        is_int(code, 0, "outbox-consume --print --drain exited 0");
        ok(strstr(out, "\"id\":\"traced\"") &&
               strstr(out, "\"traceparent\":\"" TP "\",\"tracestate\":\"" TS "\""),
           "--print: traceparent and tracestate of the traced message");
        ok(strstr(out, "\"traceparent\":null,\"tracestate\":null"), "--print: null for the untraced one");
        if (code != 0)
            th_diag_tail("consume", err, INT_MAX);
        free(out);
        free(err);
    }

    free(exec_cmd);
    free(relay);
    free(envout);
    free(db);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
