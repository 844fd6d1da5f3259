/*
 * Allocation failures injected into the library: malloc, calloc, realloc,
 * strdup and strndup are wrapped at link time (-Wl,--wrap=...), so every
 * allocation made by liboutbox's own code can be made to fail. Each
 * scenario runs again and again with the 1st, 2nd, 3rd, ... allocation
 * failing until it runs clean; every run must end in an error or a success,
 * never a crash, and must leave no allocation of ours behind.
 */
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "harness.h"
#include "outbox.h"
#include "redis/redis.h"
#include "tap.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t m);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t m);
void *__wrap_realloc(void *p, size_t n);
void __wrap_free(void *p);
char *__wrap_strdup(const char *s);
char *__wrap_strndup(const char *s, size_t n);

#include <stdint.h>

static long fail_at = -1; /* the allocation number to fail, -1 = none */
static long count;        /* allocations attempted in this run */
static long injected;     /* 1 once this run's failure was injected */

/* Allocations of ours are remembered in a pointer set (open addressing,
 * tombstones), so frees of memory allocated elsewhere (sqlite3, hiredis,
 * libuv, libc) pass through, and the live count shows leaks. */
#define SET_CAP (1u << 18)
static void **set;
static long live;
#define TOMB ((void *)1)

static size_t slot_of(void *p)
{
    return (size_t)(((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull >> 46) & (SET_CAP - 1);
}

static void set_add(void *p)
{
    size_t i;
    if (!set)
        set = __real_calloc(SET_CAP, sizeof *set);
    for (i = slot_of(p); set[i] && set[i] != TOMB; i = (i + 1) & (SET_CAP - 1))
        ;
    set[i] = p;
    live++;
}

static int set_del(void *p)
{
    if (!set)
        return 0;
    for (size_t i = slot_of(p); set[i]; i = (i + 1) & (SET_CAP - 1))
        if (set[i] == p) {
            set[i] = TOMB;
            live--;
            return 1;
        }
    return 0;
}

static int should_fail(void)
{
    count++;
    if (fail_at >= 0 && count == fail_at) {
        injected = 1;
        return 1;
    }
    return 0;
}

void *__wrap_malloc(size_t n)
{
    void *p;
    if (should_fail())
        return NULL;
    p = __real_malloc(n ? n : 1);
    if (p)
        set_add(p);
    return p;
}

void *__wrap_calloc(size_t n, size_t m)
{
    void *p;
    if (should_fail())
        return NULL;
    p = __real_calloc(n ? n : 1, m ? m : 1);
    if (p)
        set_add(p);
    return p;
}

void __wrap_free(void *p)
{
    if (!p)
        return;
    set_del(p);
    __real_free(p);
}

void *__wrap_realloc(void *p, size_t n)
{
    void *np;
    if (should_fail())
        return NULL;
    np = __real_realloc(p, n ? n : 1);
    if (np) {
        if (p)
            set_del(p);
        set_add(np);
    }
    return np;
}

char *__wrap_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = __wrap_malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

char *__wrap_strndup(const char *s, size_t n)
{
    size_t l = strnlen(s, n);
    char *d = __wrap_malloc(l + 1);
    if (d) {
        memcpy(d, s, l);
        d[l] = '\0';
    }
    return d;
}

static char *dir, *wdb_path, *inbox_path;

/* ---- scenarios: each returns 0 on success, an error code otherwise ---- */

static int sc_writer(void)
{
    static int n;
    char *p = wdb_path, id[OUTBOX_ID_MAX + 1], name[32];
    unsigned char hdrs[] = {0x81, 0xa1, 'a', 0x01};
    sqlite3 *db = NULL;
    outbox_writer *w = NULL;
    outbox_writer_settings s;
    int e;

    outbox_writer_defaults(&s);
    s.log = NULL;
    e = outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, NULL, 0);
    if (e == 0)
        e = outbox_schema_apply(db, NULL, 0);
    if (e == 0)
        e = outbox_writer_create(&w, db, &s);
    for (int i = 0; e == 0 && i < 3; i++) {
        outbox_message m = {.topic = "t", .key = "k", .payload = "x", .payload_len = 1, .headers = hdrs,
                            .headers_len = sizeof hdrs};
        snprintf(name, sizeof name, "id-%d-%d", n, i);
        m.id = i == 0 ? NULL : name;
        e = outbox_enqueue(w, &m, id);
    }
    n++;
    outbox_writer_destroy(w);
    sqlite3_close_v2(db);
    return e;
}

static int sc_envelope(void)
{
    unsigned char hdrs[] = {0x81, 0xa1, 'a', 0x01}, buf[512];
    outbox_envelope in = {.id = "id", .topic = "t", .key = "k", .payload = "xyz", .payload_len = 3,
                          .headers = hdrs, .headers_len = sizeof hdrs, .created_at = 5},
                    *out = NULL;
    size_t len;
    int e = outbox_envelope_encode(&in, buf, sizeof buf, &len);
    if (e == 0)
        e = outbox_envelope_decode(buf, len, &out, NULL, 0);
    if (e == 0 && (strcmp(out->id, "id") || out->payload_len != 3))
        e = OUTBOX_EMALFORMED;
    outbox_envelope_free(out);
    return e;
}

static int sc_trace(void)
{
    unsigned char hdrs[] = {0x81, 0xa1, 'a', 0x01};
    void *out = NULL;
    size_t len;
    int e = outbox_headers_trace(hdrs, sizeof hdrs, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                 "rojo=00f067aa0ba902b7", &out, &len, NULL, 0);
    if (e == 0 && outbox_validate_headers(out, len, NULL, 0) != 0)
        e = OUTBOX_EMALFORMED;
    if (e != 0 && out)
        e = OUTBOX_ESTATE; /* a failure must return nothing */
    free(out);
    return e;
}

static int sc_url(void)
{
    outbox__redis_url u, c;
    char err[128];
    int e = outbox__redis_url_parse("redis://alice:p%40ss@localhost:6380/3", &u, err, sizeof err);
    if (e == 0) {
        e = outbox__redis_url_copy(&c, &u);
        if (e == 0)
            outbox__redis_url_free(&c);
        outbox__redis_url_free(&u);
    }
    return e;
}

static int sc_relay(void)
{
    uv_loop_t loop;
    outbox_relay *r = NULL;
    outbox_relay_settings s;
    char *p = wdb_path, err[256];
    int e;
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = p;
    s.redis_url = "unix:///nonexistent/redis.sock";
    s.log = NULL;
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        e = OUTBOX_ESTATE;
    return e;
}

static int noop_handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    (void)c;
    (void)dv;
    (void)data;
    return 0;
}

static int sc_consumer(void)
{
    uv_loop_t loop;
    outbox_consumer *c = NULL;
    outbox_consumer_settings s;
    char *p = inbox_path, err[256];
    int e;
    uv_loop_init(&loop);
    outbox_consumer_defaults(&s);
    s.redis_url = "unix:///nonexistent/redis.sock";
    s.stream = "outbox:t";
    s.group = "g";
    s.dedup = OUTBOX_DEDUP_SQLITE;
    s.inbox_db_path = p;
    s.handler = noop_handler;
    s.log = NULL;
    e = outbox_consumer_create(&c, &loop, &s, err, sizeof err);
    outbox_consumer_destroy(c);
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        e = OUTBOX_ESTATE;
    return e;
}

typedef struct scenario {
    const char *name;
    int (*fn)(void);
} scenario;

int main(void)
{
    static const scenario scs[] = {
        {"writer", sc_writer},     {"envelope", sc_envelope}, {"headers trace", sc_trace}, {"redis url", sc_url},
        {"relay create/destroy", sc_relay}, {"consumer create/destroy", sc_consumer},
    };
    dir = th_tmpdir();
    wdb_path = th_path(dir, "w.db");
    inbox_path = th_path(dir, "inbox.db");
    for (size_t k = 0; k < sizeof scs / sizeof scs[0]; k++) {
        long runs = 0, errors = 0, leaks = 0, base;
        int clean = 0;
        /* A clean run first: it must succeed. */
        fail_at = -1;
        count = 0;
        base = live;
        is_int(scs[k].fn(), 0, "%s: succeeds without injected failures (%ld allocations)", scs[k].name, count);
        is_int(live - base, 0, "%s: and frees what it allocates", scs[k].name);
        for (long at = 1; at < 100000 && !clean; at++) {
            int e;
            fail_at = at;
            count = 0;
            injected = 0;
            base = live;
            e = scs[k].fn();
            runs++;
            if (!injected)
                clean = 1;
            else if (e != 0)
                errors++;
            if (live != base) {
                if (leaks++ < 3)
                    diag("%s: failing allocation %ld leaves %ld allocations behind (result %s)", scs[k].name, at,
                         live - base, outbox_err_name(e));
            }
        }
        fail_at = -1;
        ok(clean, "%s: %ld runs, each allocation failed once; %ld of them reported an error", scs[k].name, runs - 1,
           errors);
        is_int(leaks, 0, "%s: no run leaked", scs[k].name);
    }
    th_rmtree(dir);
    free(dir);
    free(wdb_path);
    free(inbox_path);
    return tap_done();
}
