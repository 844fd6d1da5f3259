/*
 * Consumer-side dedup on Redis: begin (SET NX PX, then GET when the key
 * was there), complete and abandon (Lua compare-and-set through EVALSHA,
 * EVAL when the server does not know the script yet).
 *
 * With a Cluster URL every command goes through the cluster layer
 * (cluster.h) by its key, <ns>:{<stream>}:<id>: the stream's slot, so the
 * markers are on the node that has the stream, and move with it in a
 * reshard (MOVED and ASK are followed there). Each command waits for the
 * previous one's reply (a redirected command's reply can overtake a later
 * one's), and the scripts are loaded on each node as its connection comes
 * up (a node that lacks them answers NOSCRIPT: EVAL then).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redis/cluster/cluster.h"
#include "consumer/dedup.h"
#include "outbox/writer.h"
#include "redis/rconn.h"

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
    outbox__rconn rc;       /* a single node or Sentinel URL */
    outbox__cluster *cl;    /* a Cluster URL (then rc is unused) */
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

static int starts_with(const redisReply *reply, const char *word)
{
    size_t n = strlen(word);
    return reply->len >= n && memcmp(reply->str, word, n) == 0;
}

/* The status an error reply gives an operation: a node that stopped being
 * the master (Sentinel), or a cluster that could not serve the slot in time
 * (what the cluster layer hands on after its retries: CLUSTERDOWN, TRYAGAIN,
 * LOADING, READONLY, a redirect loop), is Redis being unavailable, not the
 * key's problem. */
static int error_status(outbox_dedup *d, const outbox__redis *c, const redisReply *reply)
{
    set_errstr(d, reply->str, reply->len);
    if (outbox__rconn_redirect_error(&d->rc, c, reply))
        return OUTBOX_ECLOSED;
    if (d->cl && (starts_with(reply, "CLUSTERDOWN") || starts_with(reply, "TRYAGAIN") ||
                  starts_with(reply, "LOADING") || starts_with(reply, "READONLY") || starts_with(reply, "MOVED") ||
                  starts_with(reply, "ASK") || starts_with(reply, "redirect loop") ||
                  starts_with(reply, "malformed")))
        return OUTBOX_ECLOSED;
    return OUTBOX_EREDIS;
}

static int dedup_ready(const outbox_dedup *d)
{
    return d->cl ? outbox__cluster_ready(d->cl) : outbox__rconn_get(&d->rc) != NULL;
}

/* Sends a command about key: through the cluster layer by the key's slot,
 * or on the connection. 0 (cb follows), or an error (no callback). */
static int send_cmd(outbox_dedup *d, const char *key, int argc, const char **argv, const size_t *lens,
                    outbox__redis_reply_cb cb, void *data)
{
    outbox__redis *c;
    if (d->cl)
        return outbox__cluster_command_argv(d->cl, key, strlen(key), argc, argv, lens, 0, cb, data, NULL);
    if (!(c = outbox__rconn_get(&d->rc)))
        return OUTBOX_ECONNECT;
    return outbox__redis_command_argv(c, argc, argv, lens, 0, cb, data);
}

static void on_script_loaded(outbox__redis *c, int status, redisReply *reply, void *data)
{
    char *sha = data;
    (void)c;
    if (status == 0 && reply && reply->type == REDIS_REPLY_STRING && reply->len == 40)
        memcpy(sha, reply->str, 41);
}

static void load_scripts(outbox_dedup *d)
{
    outbox__redis *c = outbox__rconn_get(&d->rc);
    const char *scripts[2] = {complete_lua, abandon_lua};
    for (int i = 0; c && i < 2; i++) {
        const char *argv[3] = {"SCRIPT", "LOAD", scripts[i]};
        size_t lens[3] = {6, 4, strlen(scripts[i])};
        outbox__redis_command_argv(c, 3, argv, lens, 0, on_script_loaded, d->sha[i]);
    }
}

static void on_up(outbox__rconn *rc, void *data)
{
    (void)rc;
    load_scripts(data);
}

/* Cluster: each node gets the scripts before anything else is written to
 * it. The SHA1 of a script is the same on every node. */
static void on_node_up(outbox__cluster *cl, outbox__cluster_node *n, outbox__redis *conn, void *data)
{
    outbox_dedup *d = data;
    const char *scripts[2] = {complete_lua, abandon_lua};
    (void)conn;
    for (int i = 0; i < 2; i++) {
        const char *argv[3] = {"SCRIPT", "LOAD", scripts[i]};
        size_t lens[3] = {6, 4, strlen(scripts[i])};
        outbox__cluster_node_command_argv(cl, n, 3, argv, lens, 0, on_script_loaded, d->sha[i]);
    }
}

int outbox__dedup_create_shared(outbox_dedup **out, uv_loop_t *loop, const outbox_dedup_settings *s,
                                outbox__tls_config *tls, char *err, size_t errlen)
{
    outbox_dedup *d;
    outbox__redis_url url;
    outbox__redis_options o;
    outbox__tls_config *own_tls = NULL;
    char owner[64], msg[600];
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
    e = outbox__sentinel_url_parse(s->redis_url, s->sentinel_user, s->sentinel_password, &url, msg, sizeof msg);
    if (e != 0) {
        if (err && errlen)
            snprintf(err, errlen, "redis: %s", msg);
        return e;
    }
    if (!tls && (e = outbox__tls_config_for_url(url.tls, &s->tls, &own_tls, msg, sizeof msg)) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "tls: %s", msg);
        outbox__redis_url_free(&url);
        return e;
    }
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
    outbox__redis_options_defaults(&o);
    o.reply_timeout_ms = s->reply_timeout_ms;
    o.client_name = "outbox-dedup";
    o.tls = tls ? tls : own_tls;
    if (url.cluster) {
        outbox__cluster_options co;
        outbox__cluster_hooks hooks = {NULL, NULL, on_node_up, d};
        outbox__cluster_options_defaults(&co);
        co.redis = o;
        e = outbox__cluster_create(&d->cl, loop, &url, &co, &d->log, "dedup", &hooks);
    } else {
        e = outbox__rconn_init(&d->rc, loop, &url, &o, &d->log, "dedup");
    }
    outbox__redis_url_free(&url);
    outbox__tls_config_unref(own_tls); /* the rconn or the cluster holds its own reference */
    if (e != 0) {
        free(d->ns);
        free(d->owner_value);
        free(d);
        return e;
    }
    if (d->cl) {
        outbox__cluster_start(d->cl);
    } else {
        d->rc.on_up = on_up;
        d->rc.data = d;
        outbox__rconn_start(&d->rc);
    }
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
    if (d->cl)
        outbox__cluster_close(d->cl, dedup_closed, d);
    else
        outbox__rconn_close(&d->rc, dedup_closed, d);
}

int outbox_dedup_connected(const outbox_dedup *d)
{
    return d && dedup_ready(d);
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
    if (!dedup_ready(d))
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
            if (!o->d->cl)
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
