/*
 * ct.c: see ct.h.
 */
#include "ct.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

char *ct_envelope(const char *id, const char *topic, const void *payload, size_t payload_len, size_t *len)
{
    return ct_envelope_db(id, topic, NULL, payload, payload_len, len);
}

char *ct_envelope_db(const char *id, const char *topic, const char *db, const void *payload, size_t payload_len,
                     size_t *len)
{
    outbox_envelope e;
    size_t cap;
    char *buf;
    memset(&e, 0, sizeof e);
    e.version = OUTBOX_ENVELOPE_VERSION;
    e.id = id;
    e.topic = topic;
    e.payload = payload;
    e.payload_len = payload_len;
    e.created_at = outbox_now_ms();
    e.db = db;
    cap = outbox_envelope_max_size(&e);
    buf = malloc(cap);
    if (!buf)
        bail("out of memory");
    if (outbox_envelope_encode(&e, buf, cap, len) != 0)
        bail("outbox_envelope_encode failed for %s", id);
    return buf;
}

static void take_eid(redisReply *r, char *eid, const char *what)
{
    if (r->type != REDIS_REPLY_STRING)
        bail("%s: XADD answered type %d %s", what, r->type, r->type == REDIS_REPLY_ERROR ? r->str : "");
    if (eid)
        snprintf(eid, 48, "%s", r->str);
}

void ct_xadd_msg(redisContext *c, const char *stream, const char *id, const char *topic, const void *payload,
                 size_t payload_len, char *eid)
{
    ct_xadd_db_msg(c, stream, NULL, NULL, id, topic, payload, payload_len, eid);
}

void ct_xadd_db_msg(redisContext *c, const char *stream, const char *field_db, const char *env_db, const char *id,
                    const char *topic, const void *payload, size_t payload_len, char *eid)
{
    size_t len;
    char *env = ct_envelope_db(id, topic, env_db, payload, payload_len, &len);
    redisReply *r = field_db ? th_cmd(c, "XADD %s * id %s db %s envelope %b", stream, id, field_db, env, len)
                             : th_cmd(c, "XADD %s * id %s envelope %b", stream, id, env, len);
    take_eid(r, eid, id);
    freeReplyObject(r);
    free(env);
}

void ct_xadd_fields(redisContext *c, const char *stream, char *eid, int nfields, ...)
{
    const char *argv[64];
    size_t lens[64];
    int n = 0;
    va_list ap;
    redisReply *r;
    if (nfields > 30)
        bail("ct_xadd_fields: too many fields");
    argv[n] = "XADD";
    lens[n++] = 4;
    argv[n] = stream;
    lens[n++] = strlen(stream);
    argv[n] = "*";
    lens[n++] = 1;
    va_start(ap, nfields);
    for (int i = 0; i < nfields; i++) {
        argv[n] = va_arg(ap, const char *);
        lens[n] = strlen(argv[n]);
        n++;
        argv[n] = va_arg(ap, const char *);
        lens[n++] = va_arg(ap, size_t);
    }
    va_end(ap);
    r = redisCommandArgv(c, n, argv, lens);
    if (!r)
        bail("XADD: %s", c->errstr);
    take_eid(r, eid, "ct_xadd_fields");
    freeReplyObject(r);
}

void ct_group_create(redisContext *c, const char *stream, const char *group)
{
    redisReply *r = th_cmd(c, "XGROUP CREATE %s %s 0 MKSTREAM", stream, group);
    if (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "BUSYGROUP", 9) != 0)
        bail("XGROUP CREATE %s %s: %s", stream, group, r->str);
    freeReplyObject(r);
}

long long ct_pending(redisContext *c, const char *stream, const char *group)
{
    redisReply *r = th_cmd(c, "XPENDING %s %s", stream, group);
    long long n = -1;
    if (r->type == REDIS_REPLY_ARRAY && r->elements >= 1 && r->element[0]->type == REDIS_REPLY_INTEGER)
        n = r->element[0]->integer;
    freeReplyObject(r);
    return n;
}

long long ct_pending_for(redisContext *c, const char *stream, const char *group, const char *consumer)
{
    redisReply *r = th_cmd(c, "XPENDING %s %s - + 100000 %s", stream, group, consumer);
    long long n = -1;
    if (r->type == REDIS_REPLY_ARRAY)
        n = (long long)r->elements;
    freeReplyObject(r);
    return n;
}

int ct_read_as(redisContext *c, const char *stream, const char *group, const char *consumer, int count)
{
    redisReply *r = th_cmd(c, "XREADGROUP GROUP %s %s COUNT %d STREAMS %s >", group, consumer, count, stream);
    int n = 0;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 1 && r->element[0]->type == REDIS_REPLY_ARRAY &&
        r->element[0]->elements == 2 && r->element[0]->element[1]->type == REDIS_REPLY_ARRAY)
        n = (int)r->element[0]->element[1]->elements;
    else if (r->type == REDIS_REPLY_ERROR)
        bail("XREADGROUP: %s", r->str);
    freeReplyObject(r);
    return n;
}

char *ct_get(redisContext *c, const char *key)
{
    redisReply *r = th_cmd(c, "GET %s", key);
    char *s = NULL;
    if (r->type == REDIS_REPLY_STRING)
        s = strdup(r->str);
    else if (r->type == REDIS_REPLY_ERROR)
        s = strdup(r->str);
    freeReplyObject(r);
    return s;
}

long long ct_int(redisContext *c, const char *fmt, ...)
{
    va_list ap;
    redisReply *r;
    long long n;
    va_start(ap, fmt);
    r = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (!r)
        bail("redis: %s", c->errstr);
    if (r->type != REDIS_REPLY_INTEGER)
        bail("%s: expected an integer reply, got type %d %s", fmt, r->type,
             r->type == REDIS_REPLY_ERROR ? r->str : "");
    n = r->integer;
    freeReplyObject(r);
    return n;
}

int ct_line_count(const char *s, const char *line)
{
    size_t ll = strlen(line);
    int n = 0;
    while (*s) {
        const char *nl = strchr(s, '\n');
        size_t len = nl ? (size_t)(nl - s) : strlen(s);
        if (len == ll && memcmp(s, line, ll) == 0)
            n++;
        s += len + (nl ? 1 : 0);
    }
    return n;
}

const char *ct_consume_bin(void)
{
    static char *bin;
    if (!bin)
        bin = th_bin("tools/consume/outbox-consume");
    return bin;
}

static char **consume_argv(const char *const args[])
{
    size_t n = 0;
    char **argv;
    while (args[n])
        n++;
    argv = calloc(n + 2, sizeof *argv);
    if (!argv)
        bail("out of memory");
    argv[0] = (char *)ct_consume_bin();
    for (size_t i = 0; i < n; i++)
        argv[i + 1] = (char *)args[i];
    return argv;
}

int ct_consume_run(const char *const args[], char *const env_add[], char **out, char **err, int timeout_ms)
{
    char **argv = consume_argv(args);
    int st = th_run(argv, env_add, out, err, timeout_ms);
    free(argv);
    return st;
}

pid_t ct_consume_spawn(const char *const args[], char *const env_add[], const char *out_path, const char *err_path)
{
    char **argv = consume_argv(args);
    pid_t pid = th_spawn(argv, env_add, out_path, err_path);
    free(argv);
    return pid;
}

/* ---- driving a uv loop ---------------------------------------------------- */

static void ticker_tick(uv_timer_t *t)
{
    (void)t;
}

static void ticker_closed(uv_handle_t *h)
{
    free(h);
}

static uv_timer_t *ticker_start(uv_loop_t *loop)
{
    uv_timer_t *t = malloc(sizeof *t);
    if (!t)
        bail("out of memory");
    uv_timer_init(loop, t);
    uv_timer_start(t, ticker_tick, 5, 5);
    return t;
}

static void ticker_stop(uv_loop_t *loop, uv_timer_t *t)
{
    uv_close((uv_handle_t *)t, ticker_closed);
    uv_run(loop, UV_RUN_NOWAIT);
}

int ct_run_until(uv_loop_t *loop, volatile int *flag, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    uv_timer_t *t = ticker_start(loop);
    while (!*flag && th_now_ms() < deadline)
        uv_run(loop, UV_RUN_ONCE);
    ticker_stop(loop, t);
    return *flag;
}

void ct_run_for(uv_loop_t *loop, int ms)
{
    int never = 0;
    ct_run_until(loop, &never, ms);
}

int ct_run_until_cond(uv_loop_t *loop, int (*cond)(void *arg), void *arg, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    uv_timer_t *t = ticker_start(loop);
    int ok_ = 0;
    while (!(ok_ = cond(arg)) && th_now_ms() < deadline)
        uv_run(loop, UV_RUN_ONCE);
    ticker_stop(loop, t);
    return ok_;
}

static void walk_open(uv_handle_t *h, void *arg)
{
    (void)arg;
    diag("handle still open: %s (active %d, closing %d)", uv_handle_type_name(uv_handle_get_type(h)),
         uv_is_active(h), uv_is_closing(h));
}

int ct_loop_finish(uv_loop_t *loop, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int e;
    while (uv_run(loop, UV_RUN_NOWAIT) != 0 && th_now_ms() < deadline)
        th_sleep_ms(1);
    e = uv_loop_close(loop);
    if (e != 0)
        uv_walk(loop, walk_open, NULL);
    return e;
}
