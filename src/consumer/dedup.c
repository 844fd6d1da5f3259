/*
 * Consumer-side dedup on Redis: begin (SET NX PX, then GET when the key
 * was there), complete and abandon (Lua compare-and-set through EVALSHA,
 * EVAL when the server does not know the script yet).
 *
 * Every command goes through a target (redis/target.h) by its key,
 * <ns>:{<stream>}:<id> (the id being "<db>:<message id>" for a message that
 * names its database: consumer.h): on a cluster the stream's slot, so the markers are
 * on the node that has the stream, and move with it in a reshard (MOVED and
 * ASK are followed there). Each command waits for the previous one's reply
 * (a redirected command's reply can overtake a later one's), and the
 * scripts are loaded on each node as its connection comes up (a node that
 * lacks them answers NOSCRIPT: EVAL then).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer/dedup.h"
#include "outbox/writer.h"
#include "redis/cluster/target.h"

#define KEY_MAX 1024

static const char complete_lua[] =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "redis.call('SET', KEYS[1], 'D', 'PX', ARGV[2]) return 1 end return 0";
static const char abandon_lua[] =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end return 0";

enum op_kind { OP_BEGIN, OP_COMPLETE, OP_ABANDON };

struct outbox_dedup {
    uv_loop_t *loop;
    outbox__logger log;
    outbox__target *t;      /* a single node, Sentinel or a cluster */
    char *ns, *owner_value; /* owner_value = "P:<owner>" */
    uint64_t lease_ms, retention_ms;
    char sha[2][41];        /* complete, abandon; "" until loaded */
    char errstr[256];
    void (*destroy_cb)(void *);
    void *destroy_data;
    int destroying;
};

typedef struct op {
    outbox_dedup *d;
    enum op_kind kind;
    outbox_dedup_cb cb;
    void *data;
    char key[KEY_MAX];
} op;

void outbox_dedup_defaults(outbox_dedup_settings *s)
{
    memset(s, 0, sizeof *s);
    s->key_namespace = "dedup";
    s->lease_ms = 30000;
    s->retention_ms = 7ull * 24 * 3600 * 1000;
    s->reply_timeout_ms = 5000;
    s->log = outbox_log_stderr;
    s->log_level = OUTBOX_LOG_INFO;
    outbox_tls_defaults(&s->tls);
}

static void set_errstr(outbox_dedup *d, const char *s, size_t len)
{
    size_t n = len < sizeof d->errstr - 1 ? len : sizeof d->errstr - 1;
    memcpy(d->errstr, s, n);
    d->errstr[n] = '\0';
}

/* The status an error reply gives an operation: a node that stopped being
 * the master (Sentinel), or a cluster that could not serve the slot in time
 * (what the cluster layer hands on after its retries), is Redis being
 * unavailable, not the key's problem. */
static int error_status(outbox_dedup *d, const outbox__redis *c, const redisReply *reply)
{
    set_errstr(d, reply->str, reply->len);
    if (outbox__target_lost(d->t, c, reply) || outbox__target_unavailable(d->t, reply))
        return OUTBOX_ECLOSED;
    return OUTBOX_EREDIS;
}

/* Sends a command about key (a cluster: to its slot's node). 0 (cb
 * follows), or an error (no callback). */
static int send_cmd(outbox_dedup *d, const char *key, int argc, const char **argv, const size_t *lens,
                    outbox__redis_reply_cb cb, void *data)
{
    return outbox__target_command_key_argv(d->t, key, argc, argv, lens, 0, cb, data);
}

static void on_script_loaded(outbox__redis *c, int status, redisReply *reply, void *data)
{
    char *sha = data;
    (void)c;
    if (status == 0 && reply && reply->type == REDIS_REPLY_STRING && reply->len == 40)
        memcpy(sha, reply->str, 41);
}

/* Each node (the single node, or each of a cluster's) gets the scripts
 * before anything else is written to it. The SHA1 of a script is the same
 * on every node. */
static void on_node_up(outbox__target *t, void *node, void *data)
{
    outbox_dedup *d = data;
    const char *scripts[2] = {complete_lua, abandon_lua};
    for (int i = 0; i < 2; i++) {
        const char *argv[3] = {"SCRIPT", "LOAD", scripts[i]};
        size_t lens[3] = {6, 4, strlen(scripts[i])};
        outbox__target_command_node(t, node, 3, argv, lens, 0, on_script_loaded, d->sha[i]);
    }
}

int outbox__dedup_create_shared(outbox_dedup **out, uv_loop_t *loop, const outbox_dedup_settings *s,
                                outbox__tls_config *tls, char *err, size_t errlen)
{
    outbox_dedup *d;
    outbox__redis_url url;
    outbox__target_options o;
    outbox__target_hooks hooks = {NULL, NULL, on_node_up, NULL, NULL};
    outbox__tls_config *own_tls = NULL;
    char owner[64];
    int e;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !loop || !s)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!s->redis_url || !s->key_namespace || !*s->key_namespace || strlen(s->key_namespace) > 256 ||
        strpbrk(s->key_namespace, "{} ") || s->lease_ms < 1 || s->retention_ms < 1 || s->reply_timeout_ms < 1 ||
        (s->owner && (!*s->owner || strlen(s->owner) > 200))) {
        if (err && errlen)
            snprintf(err, errlen, "dedup: need a Redis URL, a namespace of 1..256 bytes without braces or "
                                  "spaces, an owner of 1..200 bytes, and non-zero lease, retention and timeout");
        return OUTBOX_EINVAL;
    }
    /* With the owner's TLS configuration, s->tls is not read. */
    e = outbox__target_url_setup(s->redis_url, s->sentinel_user, s->sentinel_password, tls ? NULL : &s->tls, &url,
                                 &own_tls, err, errlen);
    if (e != 0)
        return e;
    d = calloc(1, sizeof *d);
    if (!d) {
        outbox__redis_url_free(&url);
        outbox__tls_config_unref(own_tls);
        return OUTBOX_ENOMEM;
    }
    d->loop = loop;
    d->log.fn = s->log;
    d->log.data = s->log_data;
    d->log.min_level = s->log_level;
    d->lease_ms = s->lease_ms;
    d->retention_ms = s->retention_ms;
    if (!s->owner)
        outbox_uuid7(owner);
    else
        outbox__strlcpy(owner, s->owner, sizeof owner);
    d->ns = strdup(s->key_namespace);
    d->owner_value = malloc(strlen(s->owner ? s->owner : owner) + 3);
    if (!d->ns || !d->owner_value) {
        free(d->ns);
        free(d->owner_value);
        free(d);
        outbox__redis_url_free(&url);
        outbox__tls_config_unref(own_tls);
        return OUTBOX_ENOMEM;
    }
    sprintf(d->owner_value, "P:%s", s->owner ? s->owner : owner);
    outbox__target_options_defaults(&o);
    o.redis.reply_timeout_ms = s->reply_timeout_ms;
    o.redis.client_name = "outbox-dedup";
    o.redis.tls = tls ? tls : own_tls;
    o.log = &d->log;
    o.what = "dedup";
    hooks.data = d;
    e = outbox__target_create(&d->t, loop, &url, &o, &hooks);
    outbox__redis_url_free(&url);
    outbox__tls_config_unref(own_tls); /* the target holds its own reference */
    if (e != 0) {
        free(d->ns);
        free(d->owner_value);
        free(d);
        return e;
    }
    outbox__target_start(d->t);
    *out = d;
    return 0;
}

int outbox_dedup_create(outbox_dedup **out, uv_loop_t *loop, const outbox_dedup_settings *s, char *err,
                        size_t errlen)
{
    return outbox__dedup_create_shared(out, loop, s, NULL, err, errlen);
}

static void dedup_closed(void *data)
{
    outbox_dedup *d = data;
    void (*cb)(void *) = d->destroy_cb;
    void *cbdata = d->destroy_data;
    free(d->ns);
    free(d->owner_value);
    free(d);
    if (cb)
        cb(cbdata);
}

void outbox_dedup_destroy(outbox_dedup *d, void (*cb)(void *data), void *data)
{
    if (!d || d->destroying)
        return;
    d->destroying = 1;
    d->destroy_cb = cb;
    d->destroy_data = data;
    outbox__target_close(d->t, dedup_closed, d);
}

int outbox_dedup_connected(const outbox_dedup *d)
{
    return d && outbox__target_ready(d->t);
}

const char *outbox_dedup_errstr(const outbox_dedup *d)
{
    return d ? d->errstr : "";
}

static int make_op(outbox_dedup *d, enum op_kind kind, const char *stream, const char *id, outbox_dedup_cb cb,
                   void *data, op **out)
{
    op *o;
    int n;
    if (!d || !stream || !*stream || !id || !*id || !cb)
        return OUTBOX_EINVAL;
    if (d->destroying)
        return OUTBOX_ECLOSED;
    if (!outbox__target_ready(d->t))
        return OUTBOX_ECONNECT;
    o = calloc(1, sizeof *o);
    if (!o)
        return OUTBOX_ENOMEM;
    n = snprintf(o->key, sizeof o->key, "%s:{%s}:%s", d->ns, stream, id);
    if (n < 0 || (size_t)n >= sizeof o->key) {
        free(o);
        return OUTBOX_EINVAL;
    }
    o->d = d;
    o->kind = kind;
    o->cb = cb;
    o->data = data;
    *out = o;
    return 0;
}

static void finish(op *o, int status, outbox_dedup_result res)
{
    o->cb(o->d, status, res, o->data);
    free(o);
}

static void on_get(outbox__redis *c, int status, redisReply *reply, void *data)
{
    op *o = data;
    if (status != 0)
        finish(o, status, 0);
    else if (reply->type == REDIS_REPLY_ERROR)
        finish(o, error_status(o->d, c, reply), 0);
    else if (reply->type == REDIS_REPLY_STRING && reply->len == 1 && reply->str[0] == 'D')
        finish(o, 0, OUTBOX_DEDUP_DONE);
    else
        /* Another owner's processing key, or it expired between the two
         * commands: either way, not ours now; try again later. */
        finish(o, 0, OUTBOX_DEDUP_BUSY);
}

static void on_set(outbox__redis *c, int status, redisReply *reply, void *data)
{
    op *o = data;
    const char *argv[2] = {"GET", o->key};
    size_t lens[2] = {3, strlen(o->key)};
    int e;
    if (status != 0) {
        finish(o, status, 0);
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        finish(o, error_status(o->d, c, reply), 0);
        return;
    }
    if (reply->type == REDIS_REPLY_STATUS) {
        finish(o, 0, OUTBOX_DEDUP_FIRST);
        return;
    }
    /* The key was there: whose is it? */
    if ((e = send_cmd(o->d, o->key, 2, argv, lens, on_get, o)) != 0)
        finish(o, e, 0);
}

int outbox_dedup_begin(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb, void *data)
{
    op *o;
    char px[24];
    int e = make_op(d, OP_BEGIN, stream, id, cb, data, &o);
    if (e != 0)
        return e;
    snprintf(px, sizeof px, "%llu", (unsigned long long)d->lease_ms);
    {
        const char *argv[6] = {"SET", o->key, d->owner_value, "NX", "PX", px};
        size_t lens[6] = {3, strlen(o->key), strlen(d->owner_value), 2, 2, strlen(px)};
        e = send_cmd(d, o->key, 6, argv, lens, on_set, o);
        if (e != 0)
            free(o);
    }
    return e;
}

static int send_script(op *o, int use_eval);

static void on_script(outbox__redis *c, int status, redisReply *reply, void *data)
{
    op *o = data;
    if (status != 0) {
        finish(o, status, 0);
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        if (reply->len >= 8 && memcmp(reply->str, "NOSCRIPT", 8) == 0) {
            /* The server lost its scripts (restart, SCRIPT FLUSH), or this
             * node of a cluster never had them (it took over the slot):
             * send the body, which also caches it there. Another node of
             * the cluster may still have them: keep the SHA1 then. */
            if (!outbox__target_routes(o->d->t))
                o->d->sha[o->kind == OP_COMPLETE ? 0 : 1][0] = '\0';
            int e = send_script(o, 1);
            if (e != 0)
                finish(o, e, 0);
            return;
        }
        finish(o, error_status(o->d, c, reply), 0);
        return;
    }
    if (reply->type == REDIS_REPLY_INTEGER && reply->integer == 1)
        finish(o, 0, 0);
    else
        finish(o, OUTBOX_ELEASE, 0);
}

static int send_script(op *o, int use_eval)
{
    outbox_dedup *d = o->d;
    int idx = o->kind == OP_COMPLETE ? 0 : 1;
    const char *body = idx == 0 ? complete_lua : abandon_lua;
    char ret[24];
    const char *argv[6];
    size_t lens[6];
    int argc = 0;

    if (!use_eval && d->sha[idx][0]) {
        argv[argc] = "EVALSHA";
        lens[argc++] = 7;
        argv[argc] = d->sha[idx];
        lens[argc++] = 40;
    } else {
        argv[argc] = "EVAL";
        lens[argc++] = 4;
        argv[argc] = body;
        lens[argc++] = strlen(body);
    }
    argv[argc] = "1";
    lens[argc++] = 1;
    argv[argc] = o->key;
    lens[argc++] = strlen(o->key);
    argv[argc] = d->owner_value;
    lens[argc++] = strlen(d->owner_value);
    if (idx == 0) {
        snprintf(ret, sizeof ret, "%llu", (unsigned long long)d->retention_ms);
        argv[argc] = ret;
        lens[argc++] = strlen(ret);
    }
    return send_cmd(d, o->key, argc, argv, lens, on_script, o);
}

static int script_op(outbox_dedup *d, enum op_kind kind, const char *stream, const char *id, outbox_dedup_cb cb,
                     void *data)
{
    op *o;
    int e = make_op(d, kind, stream, id, cb, data, &o);
    if (e != 0)
        return e;
    e = send_script(o, 0);
    if (e != 0)
        free(o);
    return e;
}

int outbox_dedup_complete(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb, void *data)
{
    return script_op(d, OP_COMPLETE, stream, id, cb, data);
}

int outbox_dedup_abandon(outbox_dedup *d, const char *stream, const char *id, outbox_dedup_cb cb, void *data)
{
    return script_op(d, OP_ABANDON, stream, id, cb, data);
}
