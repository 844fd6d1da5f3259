/*
 * outbox-consume: effectively-once processing of an outbox stream from any
 * language. Reads with a consumer group, deduplicates on the message id
 * (Redis SET NX by default) and either prints each message as a JSON line or
 * runs a command per message with the payload on stdin. A message that
 * names its database (proto/envelope.md) is deduplicated per database and
 * hands its database on (the JSON line's db, OUTBOX_DB).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <msgpack.h>
#include <uv.h>

#include "util/util.h"
#include "json.h"
#include "metrics.h"
#include "outbox.h"

static const char *prog = "outbox-consume";

typedef struct tool {
    uv_loop_t loop;
    uv_signal_t sigterm, sigint;
    outbox_consumer *c;
    consume_metrics *metrics; /* --metrics-listen, else NULL */
    outbox__logger log; /* the consumer's sink, for the tool's own lines */
    const char *exec_cmd;
    uint64_t exec_timeout_ms;
    int print;
    int signals;
    int failed_fatal;
    int exit_code; /* 2 when the metrics port cannot be bound */
} tool;

/* ------------------------------------------------------------------ */
/* JSON output */

/* Bytes as a JSON string when they are UTF-8, else base64 (say which). */
static void json_bytes(outbox__sbuf *b, const char *name, const void *p, size_t n)
{
    int text;
    outbox__sbuf_printf(b, "\"%s\":", name);
    text = tools_json_text_or_base64(b, p, n);
    outbox__sbuf_printf(b, ",\"%s_encoding\":\"%s\"", name, text ? "utf-8" : "base64");
}

static void json_headers(outbox__sbuf *b, const outbox_envelope *m)
{
    msgpack_unpacked u;
    size_t off = 0;
    if (!m->headers) {
        outbox__sbuf_puts(b, "null");
        return;
    }
    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, m->headers, m->headers_len, &off) == MSGPACK_UNPACK_SUCCESS)
        tools_json_msgpack(b, &u.data, TOOLS_MSGPACK_PLAIN);
    else
        outbox__sbuf_puts(b, "null");
    msgpack_unpacked_destroy(&u);
}

/* The W3C trace context of a message: its "traceparent" header when that is
 * valid, and then its "tracestate" header if any and valid (the rules of
 * outbox_headers_trace()); "" for what is absent. A trace context that is
 * not valid is ignored, as W3C Trace Context asks. */
typedef struct trace_ctx {
    char parent[OUTBOX_TRACEPARENT_LEN + 1];
    char state[OUTBOX_TRACESTATE_MAX + 1];
} trace_ctx;

static void header_str(const msgpack_object_map *map, const char *name, char *out, size_t cap)
{
    out[0] = '\0';
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key, *v = &map->ptr[i].val;
        if (k->type != MSGPACK_OBJECT_STR || k->via.str.size != strlen(name) ||
            memcmp(k->via.str.ptr, name, k->via.str.size) != 0)
            continue;
        if (v->type == MSGPACK_OBJECT_STR && v->via.str.size < cap && !memchr(v->via.str.ptr, '\0', v->via.str.size)) {
            memcpy(out, v->via.str.ptr, v->via.str.size);
            out[v->via.str.size] = '\0';
        }
        return;
    }
}

static void trace_context(const outbox_envelope *m, trace_ctx *t)
{
    msgpack_unpacked u;
    size_t off = 0;
    t->parent[0] = t->state[0] = '\0';
    if (!m->headers)
        return;
    msgpack_unpacked_init(&u);
    if (msgpack_unpack_next(&u, m->headers, m->headers_len, &off) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        header_str(&u.data.via.map, OUTBOX_HEADER_TRACEPARENT, t->parent, sizeof t->parent);
        header_str(&u.data.via.map, OUTBOX_HEADER_TRACESTATE, t->state, sizeof t->state);
    }
    msgpack_unpacked_destroy(&u);
    if (outbox_validate_traceparent(t->parent, NULL, 0) != 0)
        t->parent[0] = t->state[0] = '\0';
    if (outbox_validate_tracestate(t->state, NULL, 0) != 0)
        t->state[0] = '\0';
}

static void json_line(outbox__sbuf *b, const outbox_delivery *dv)
{
    const outbox_envelope *m = dv->msg;
    trace_ctx trace;
    outbox__sbuf_puts(b, "{\"id\":");
    tools_json_cstr(b, m->id);
    outbox__sbuf_puts(b, ",\"db\":");
    tools_json_cstr(b, m->db);
    outbox__sbuf_puts(b, ",\"topic\":");
    tools_json_cstr(b, m->topic);
    outbox__sbuf_puts(b, ",\"key\":");
    if (m->key)
        tools_json_str(b, m->key, m->key_len);
    else
        outbox__sbuf_puts(b, "null");
    outbox__sbuf_puts(b, ",");
    json_bytes(b, "payload", m->payload, m->payload_len);
    outbox__sbuf_puts(b, ",\"headers\":");
    json_headers(b, m);
    trace_context(m, &trace);
    outbox__sbuf_puts(b, ",\"traceparent\":");
    tools_json_cstr(b, trace.parent[0] ? trace.parent : NULL);
    outbox__sbuf_puts(b, ",\"tracestate\":");
    tools_json_cstr(b, trace.state[0] ? trace.state : NULL);
    outbox__sbuf_printf(b, ",\"created_at\":%lld,\"stream\":", (long long)m->created_at);
    tools_json_cstr(b, dv->stream);
    outbox__sbuf_puts(b, ",\"entry_id\":");
    tools_json_cstr(b, dv->entry_id);
    outbox__sbuf_printf(b, ",\"deliveries\":%llu}\n", (unsigned long long)dv->deliveries);
}

/* The buffers only fail to grow when memory is exhausted, where this tool
 * cannot do anything useful. */
static void exit_if_oom(const outbox__sbuf *b)
{
    if (b->oom) {
        fprintf(stderr, "%s: out of memory\n", prog);
        exit(1);
    }
}

/* ------------------------------------------------------------------ */
/* handlers */

static int print_handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    outbox__sbuf b = {0};
    int ok;
    (void)data;
    json_line(&b, dv);
    exit_if_oom(&b);
    ok = fwrite(b.p, 1, b.len, stdout) == b.len && fflush(stdout) == 0;
    outbox__sbuf_free(&b);
    outbox_consumer_done(c, dv, ok ? 0 : -1);
    return 0;
}

typedef struct job {
    uv_process_t proc;
    uv_pipe_t in;
    uv_write_t wr;
    uv_timer_t timer;
    outbox_consumer *c;
    const outbox_delivery *dv;
    const outbox__logger *log;
    int open_handles;
    int64_t exit_status;
    int term_signal, timed_out, spawned;
    char *envbuf[16];
} job;

static void job_handle_closed(uv_handle_t *h)
{
    job *j = h->data;
    if (--j->open_handles > 0)
        return;
    outbox_consumer_done(j->c, j->dv, j->spawned && !j->timed_out && j->term_signal == 0 && j->exit_status == 0 ? 0 : 1);
    for (int i = 0; j->envbuf[i]; i++)
        free(j->envbuf[i]);
    free(j);
}

static void job_exited(uv_process_t *p, int64_t status, int sig)
{
    job *j = p->data;
    j->exit_status = status;
    j->term_signal = sig;
    if (status != 0 || sig != 0)
        outbox__log(j->log, OUTBOX_LOG_WARN, "msg=\"command failed; message left pending for retry\" id=%s exit=%lld "
                    "signal=%d", j->dv->msg->id, (long long)status, sig);
    uv_close((uv_handle_t *)&j->proc, job_handle_closed);
    uv_close((uv_handle_t *)&j->timer, job_handle_closed);
    if (!uv_is_closing((uv_handle_t *)&j->in))
        uv_close((uv_handle_t *)&j->in, job_handle_closed);
}

static void job_timeout(uv_timer_t *t)
{
    job *j = t->data;
    j->timed_out = 1;
    outbox__log(j->log, OUTBOX_LOG_WARN, "msg=\"command timed out; killing it\" id=%s", j->dv->msg->id);
    uv_process_kill(&j->proc, SIGKILL);
}

static void job_written(uv_write_t *w, int status)
{
    job *j = w->data;
    (void)status; /* a command that does not read its stdin is fine */
    if (!uv_is_closing((uv_handle_t *)&j->in))
        uv_close((uv_handle_t *)&j->in, job_handle_closed);
}

static char *env_pair(const char *k, const char *v, size_t vlen)
{
    size_t kl = strlen(k);
    char *s = malloc(kl + vlen + 2);
    if (!s)
        return NULL;
    memcpy(s, k, kl);
    s[kl] = '=';
    memcpy(s + kl + 1, v, vlen);
    s[kl + 1 + vlen] = '\0';
    /* Environment values cannot hold NUL bytes: cut at the first one. */
    return s;
}

static int exec_handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    tool *t = data;
    job *j = calloc(1, sizeof *j);
    uv_process_options_t o;
    uv_stdio_container_t stdio[3];
    char *args[4] = {"/bin/sh", "-c", (char *)t->exec_cmd, NULL};
    char num[32], num2[32];
    char **env;
    size_t nenv = 0, k = 0;
    extern char **environ;
    uv_buf_t buf;
    outbox__sbuf hb = {0};
    trace_ctx trace;
    int e;

    if (!j) {
        outbox_consumer_done(c, dv, 1);
        return 0;
    }
    j->c = c;
    j->dv = dv;
    j->log = &t->log;
    snprintf(num, sizeof num, "%lld", (long long)dv->msg->created_at);
    snprintf(num2, sizeof num2, "%llu", (unsigned long long)dv->deliveries);
    json_headers(&hb, dv->msg);
    exit_if_oom(&hb);
    j->envbuf[k++] = env_pair("OUTBOX_ID", dv->msg->id, strlen(dv->msg->id));
    j->envbuf[k++] = env_pair("OUTBOX_DB", dv->msg->db ? dv->msg->db : "", dv->msg->db ? strlen(dv->msg->db) : 0);
    j->envbuf[k++] = env_pair("OUTBOX_TOPIC", dv->msg->topic, strlen(dv->msg->topic));
    j->envbuf[k++] = env_pair("OUTBOX_KEY", dv->msg->key ? dv->msg->key : "", dv->msg->key ? dv->msg->key_len : 0);
    j->envbuf[k++] = env_pair("OUTBOX_STREAM", dv->stream, strlen(dv->stream));
    j->envbuf[k++] = env_pair("OUTBOX_ENTRY_ID", dv->entry_id, strlen(dv->entry_id));
    j->envbuf[k++] = env_pair("OUTBOX_CREATED_AT", num, strlen(num));
    j->envbuf[k++] = env_pair("OUTBOX_DELIVERIES", num2, strlen(num2));
    j->envbuf[k++] = env_pair("OUTBOX_HEADERS", hb.p, hb.len);
    outbox__sbuf_free(&hb);
    trace_context(dv->msg, &trace);
    if (trace.parent[0])
        j->envbuf[k++] = env_pair("TRACEPARENT", trace.parent, strlen(trace.parent));
    if (trace.state[0])
        j->envbuf[k++] = env_pair("TRACESTATE", trace.state, strlen(trace.state));
    for (char **p = environ; *p; p++)
        nenv++;
    env = calloc(nenv + k + 1, sizeof *env);
    if (!env) {
        outbox_consumer_done(c, dv, 1);
        for (size_t i = 0; i < k; i++)
            free(j->envbuf[i]);
        free(j);
        return 0;
    }
    nenv = 0;
    /* The message's own variables only: none inherited from our environment,
     * not even a trace context of the process that started us. */
    for (char **p = environ; *p; p++)
        if (strncmp(*p, "OUTBOX_", 7) != 0 && strncmp(*p, "TRACEPARENT=", 12) != 0 &&
            strncmp(*p, "TRACESTATE=", 11) != 0)
            env[nenv++] = *p;
    for (size_t i = 0; i < k; i++)
        if (j->envbuf[i])
            env[nenv++] = j->envbuf[i];

    uv_pipe_init(&t->loop, &j->in, 0);
    uv_timer_init(&t->loop, &j->timer);
    j->in.data = j->timer.data = j->proc.data = j->wr.data = j;
    j->open_handles = 2;
    memset(&o, 0, sizeof o);
    stdio[0].flags = UV_CREATE_PIPE | UV_READABLE_PIPE;
    stdio[0].data.stream = (uv_stream_t *)&j->in;
    /* The command's output goes to our stderr: stdout carries nothing else. */
    stdio[1].flags = UV_INHERIT_FD;
    stdio[1].data.fd = 2;
    stdio[2].flags = UV_INHERIT_FD;
    stdio[2].data.fd = 2;
    o.file = "/bin/sh";
    o.args = args;
    o.env = env;
    o.stdio = stdio;
    o.stdio_count = 3;
    o.exit_cb = job_exited;
    e = uv_spawn(&t->loop, &j->proc, &o);
    free(env);
    if (e != 0) {
        outbox__log(&t->log, OUTBOX_LOG_ERROR, "msg=\"cannot run the command\" error=\"%s\"", uv_strerror(e));
        uv_close((uv_handle_t *)&j->proc, NULL);
        uv_close((uv_handle_t *)&j->in, job_handle_closed);
        uv_close((uv_handle_t *)&j->timer, job_handle_closed);
        return 0;
    }
    j->spawned = 1;
    j->open_handles = 3;
    uv_timer_start(&j->timer, job_timeout, t->exec_timeout_ms, 0);
    buf = uv_buf_init((char *)dv->msg->payload, (unsigned)dv->msg->payload_len);
    if (uv_write(&j->wr, (uv_stream_t *)&j->in, &buf, 1, job_written) != 0)
        uv_close((uv_handle_t *)&j->in, job_handle_closed);
    return 0;
}

/* ------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: %s --redis URL --stream S --group G [--consumer NAME] (--print | --exec CMD) [options]\n"
            "\n"
            "Reads stream S with consumer group G (created at the start of the stream if\n"
            "missing), deduplicates on each message's id, and for every new message either\n"
            "prints it as one JSON line on stdout (--print) or runs CMD with /bin/sh -c,\n"
            "the payload on stdin and the envelope in environment variables (--exec):\n"
            "OUTBOX_ID, OUTBOX_DB, OUTBOX_TOPIC, OUTBOX_KEY, OUTBOX_STREAM, OUTBOX_ENTRY_ID,\n"
            "OUTBOX_CREATED_AT, OUTBOX_DELIVERIES, OUTBOX_HEADERS (JSON), and TRACEPARENT\n"
            "and TRACESTATE when the headers traceparent and tracestate carry a valid W3C\n"
            "trace context. OUTBOX_DB is the message's database when the relay names it\n"
            "(a relay over many databases; message ids are unique per database, and the\n"
            "dedup is per database), else empty, as OUTBOX_KEY for a message without key.\n"
            "Exit status 0 of CMD is success: the message is marked done and acknowledged;\n"
            "anything else leaves it pending and it is retried. JSON lines have id, db,\n"
            "topic, key, payload (UTF-8 text, or base64 with payload_encoding \"base64\"),\n"
            "headers, traceparent and tracestate (db, key and the last three null when\n"
            "absent), created_at, stream, entry_id, deliveries.\n"
            "\n"
            "Options:\n"
            "  --redis URL               redis:// or rediss:// (TLS) [[user]:password@]host[:port][/db],\n"
            "                            unix:///path[?db=N], or redis-sentinel:// or rediss-sentinel://\n"
            "                            [[user]:password@]host[:port][,host[:port]...][/db]#master,\n"
            "                            or redis-cluster:// or rediss-cluster:// (Redis Cluster)\n"
            "                            [[user]:password@]host[:port][,host[:port]...] (seed nodes;\n"
            "                            the stream is read from the master of its slot, followed when\n"
            "                            the slot moves)\n"
            "  --stream S                stream to read, e.g. outbox:orders (required)\n"
            "  --group G                 consumer group (required)\n"
            "  --consumer NAME           consumer name (default HOSTNAME:PID)\n"
            "  --print                   print each message as a JSON line\n"
            "  --exec CMD                run CMD per message\n"
            "  --exec-timeout-ms MS      kill CMD after this long: a failure (default 60000)\n"
            "  --dedup MODE              redis (SET NX, default) or none (at-least-once)\n"
            "  --namespace NS            dedup key namespace (default dedup:GROUP)\n"
            "  --dedup-lease-ms MS       processing lease of a dedup key (default 30000)\n"
            "  --dedup-retention-ms MS   how long done markers are kept (default 604800000, 7 days)\n"
            "  --batch N                 XREADGROUP COUNT (default 100)\n"
            "  --max-inflight N          messages processed at once (default 100; 1 keeps order)\n"
            "  --block-ms MS             XREADGROUP BLOCK (default 2000)\n"
            "  --min-idle-ms MS          take over entries pending this long (XAUTOCLAIM; default 60000)\n"
            "  --claim-interval-ms MS    how often to look for them (default 5000)\n"
            "  --max-deliveries N        then the entry goes to S:dead (default 5)\n"
            "  --retry-ms MS             retry a failed message after (default 1000)\n"
            "  --drain                   exit 0 once nothing is new and nothing is pending for this consumer\n"
            "  --metrics-listen HOST:PORT\n"
            "                            serve Prometheus /metrics and /healthz (e.g. 127.0.0.1:9465;\n"
            "                            default off): applied, duplicates, failures, dead letters,\n"
            "                            the group's pending entries and lag\n"
            "  --metrics-web-config FILE\n"
            "                            with --metrics-listen: TLS and basic auth for the endpoint, a\n"
            "                            web configuration file as Prometheus exporters take\n"
            "                            (tls_server_config, basic_auth_users; default none)\n"
            "  --health-redis-down-ms MS\n"
            "                            /healthz answers 503 once Redis has not answered this long\n"
            "                            (default 30000)\n"
            "  --log-level LEVEL         debug, info, warn, error (default info)\n"
            "  --log-format FORMAT       logfmt, or json for one JSON object per line (default logfmt)\n"
            "  --sentinel-user USER      redis-sentinel:// only: the user for AUTH to the sentinels\n"
            "                            (the URL's credentials are the data nodes'; default none)\n"
            "  --sentinel-password PASSWORD\n"
            "                            redis-sentinel:// only: the sentinels' password (default none)\n"
            "  --tls-ca-file FILE        rediss:// only: PEM file of the CAs that verify the server\n"
            "                            (default the system's trust store)\n"
            "  --tls-ca-dir DIR          rediss:// only: directory of CA certificates by subject hash\n"
            "                            (openssl rehash; default the system's trust store)\n"
            "  --tls-cert-file FILE      rediss:// only: client certificate (PEM) for mutual TLS;\n"
            "                            needs --tls-key-file (default none)\n"
            "  --tls-key-file FILE       rediss:// only: its private key (PEM, not encrypted)\n"
            "  --tls-server-name NAME    rediss:// only: the name sent as SNI and verified\n"
            "                            (default the URL's host)\n"
            "  --tls-insecure            rediss:// only: verify nothing; logged as a warning at every connect\n"
            "  -h, --help, -V, --version\n"
            "\n"
            "SIGTERM/SIGINT stop gracefully (running commands finish); a second signal exits at once.\n"
            "Exit status: 0 clean stop or drained, 1 fatal error, 2 usage error. Logs go to stderr.\n",
            prog);
}

static int parse_u64(const char *opt, const char *v, uint64_t min, uint64_t max, uint64_t *out)
{
    char *end;
    unsigned long long x;
    errno = 0;
    if (!v || !*v || *v == '-' || *v == '+' || *v == ' ') {
        fprintf(stderr, "%s: %s: '%s' is not a non-negative whole number\n", prog, opt, v ? v : "");
        return -1;
    }
    x = strtoull(v, &end, 10);
    if (*end) {
        fprintf(stderr, "%s: %s: '%s' is not a non-negative whole number\n", prog, opt, v);
        return -1;
    }
    if (errno == ERANGE || x < min || x > max) {
        fprintf(stderr, "%s: %s: %s is out of range %llu..%llu\n", prog, opt, v, (unsigned long long)min,
                (unsigned long long)max);
        return -1;
    }
    *out = x;
    return 0;
}

static void on_stopped(outbox_consumer *c, void *data)
{
    tool *t = data;
    (void)c;
    uv_close((uv_handle_t *)&t->sigterm, NULL);
    uv_close((uv_handle_t *)&t->sigint, NULL);
    consume_metrics_close(t->metrics, NULL, NULL);
    t->metrics = NULL;
}

static void on_drained(outbox_consumer *c, void *data)
{
    outbox_consumer_stop(c, on_stopped, data);
}

static void on_signal(uv_signal_t *h, int signum)
{
    tool *t = h->data;
    if (++t->signals > 1) {
        outbox__log(&t->log, OUTBOX_LOG_WARN, "msg=\"second signal: exiting at once\" signal=%d", signum);
        _exit(1);
    }
    outbox_consumer_stop(t->c, on_stopped, t);
}

int main(int argc, char **argv)
{
    outbox_consumer_settings s;
    const char *tls_opt = NULL; /* the first --tls-* option given, for messages */
    const char *metrics_listen = NULL, *metrics_web = NULL;
    uint64_t health_down_ms = 30000;
    tool t;
    char err[512];
    int e;
    uint64_t v;

    memset(&t, 0, sizeof t);
    t.exec_timeout_ms = 60000;
    outbox_consumer_defaults(&s);
    s.data = &t;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE                                                                                 \
    do {                                                                                           \
        if (!val) {                                                                                \
            fprintf(stderr, "%s: %s needs a value\n", prog, a);                                    \
            return 2;                                                                              \
        }                                                                                          \
        i++;                                                                                       \
    } while (0)
#define TLS_STR(name, field)                                                                       \
    else if (!strcmp(a, name)) {                                                                   \
        NEED_VALUE;                                                                                \
        if (!*val) {                                                                               \
            fprintf(stderr, "%s: %s: empty value\n", prog, a);                                     \
            return 2;                                                                              \
        }                                                                                          \
        field = val;                                                                               \
        tls_opt = tls_opt ? tls_opt : name;                                                        \
    }
#define U64(name, min, max, field, type)                                                           \
    else if (!strcmp(a, name)) {                                                                   \
        NEED_VALUE;                                                                                \
        if (parse_u64(a, val, min, max, &v) != 0)                                                  \
            return 2;                                                                              \
        field = (type)v;                                                                           \
    }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
            printf("outbox-consume %s\n", outbox_version());
            return 0;
        } else if (!strcmp(a, "--redis")) {
            NEED_VALUE;
            s.redis_url = val;
        } else if (!strcmp(a, "--stream")) {
            NEED_VALUE;
            s.stream = val;
        } else if (!strcmp(a, "--group")) {
            NEED_VALUE;
            s.group = val;
        } else if (!strcmp(a, "--consumer")) {
            NEED_VALUE;
            s.consumer = val;
        } else if (!strcmp(a, "--namespace")) {
            NEED_VALUE;
            s.key_namespace = val;
        } else if (!strcmp(a, "--print")) {
            t.print = 1;
        } else if (!strcmp(a, "--exec")) {
            NEED_VALUE;
            t.exec_cmd = val;
        } else if (!strcmp(a, "--drain")) {
            s.drain = 1;
        } else if (!strcmp(a, "--tls-insecure")) {
            s.tls.insecure = 1;
            tls_opt = tls_opt ? tls_opt : a;
        } else if (!strcmp(a, "--dedup")) {
            NEED_VALUE;
            if (!strcmp(val, "redis"))
                s.dedup = OUTBOX_DEDUP_REDIS;
            else if (!strcmp(val, "none"))
                s.dedup = OUTBOX_DEDUP_NONE;
            else {
                fprintf(stderr, "%s: --dedup: unknown mode '%s' (redis, none)\n", prog, val);
                return 2;
            }
        } else if (!strcmp(a, "--log-level")) {
            NEED_VALUE;
            if (!strcmp(val, "debug"))
                s.log_level = OUTBOX_LOG_DEBUG;
            else if (!strcmp(val, "info"))
                s.log_level = OUTBOX_LOG_INFO;
            else if (!strcmp(val, "warn"))
                s.log_level = OUTBOX_LOG_WARN;
            else if (!strcmp(val, "error"))
                s.log_level = OUTBOX_LOG_ERROR;
            else {
                fprintf(stderr, "%s: --log-level: unknown log level '%s' (debug, info, warn, error)\n", prog, val);
                return 2;
            }
        } else if (!strcmp(a, "--log-format")) {
            NEED_VALUE;
            s.log = outbox_log_sink(val);
            if (!s.log) {
                fprintf(stderr, "%s: --log-format: unknown log format '%s' (logfmt, json)\n", prog, val);
                return 2;
            }
        }
        else if (!strcmp(a, "--sentinel-user") || !strcmp(a, "--sentinel-password")) {
            NEED_VALUE;
            if (!*val) {
                fprintf(stderr, "%s: %s: empty value\n", prog, a);
                return 2;
            }
            if (a[11] == 'u')
                s.sentinel_user = val;
            else
                s.sentinel_password = val;
        }
        else if (!strcmp(a, "--metrics-listen") || !strcmp(a, "--metrics-web-config")) {
            NEED_VALUE;
            if (!*val) {
                fprintf(stderr, "%s: %s: empty value\n", prog, a);
                return 2;
            }
            if (a[10] == 'l')
                metrics_listen = val;
            else
                metrics_web = val;
        }
        TLS_STR("--tls-ca-file", s.tls.ca_file)
        TLS_STR("--tls-ca-dir", s.tls.ca_dir)
        TLS_STR("--tls-cert-file", s.tls.cert_file)
        TLS_STR("--tls-key-file", s.tls.key_file)
        TLS_STR("--tls-server-name", s.tls.server_name)
        U64("--exec-timeout-ms", 1, 86400000, t.exec_timeout_ms, uint64_t)
        U64("--dedup-lease-ms", 1, 86400000, s.dedup_lease_ms, uint64_t)
        U64("--dedup-retention-ms", 1, 365ull * 86400000, s.dedup_retention_ms, uint64_t)
        U64("--batch", 1, 10000, s.batch, unsigned)
        U64("--max-inflight", 1, 100000, s.max_inflight, unsigned)
        U64("--block-ms", 1, 3600000, s.block_ms, uint64_t)
        U64("--min-idle-ms", 1, 86400000, s.min_idle_ms, uint64_t)
        U64("--claim-interval-ms", 1, 3600000, s.claim_interval_ms, uint64_t)
        U64("--max-deliveries", 1, 1000000, s.max_deliveries, unsigned)
        U64("--retry-ms", 1, 3600000, s.retry_ms, uint64_t)
        U64("--health-redis-down-ms", 1, 86400000, health_down_ms, uint64_t)
        else {
            fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, a);
            return 2;
        }
#undef U64
#undef TLS_STR
#undef NEED_VALUE
    }
    if (!s.redis_url || !s.stream || !s.group) {
        fprintf(stderr, "%s: --redis, --stream and --group are required\n", prog);
        return 2;
    }
    /* The library refuses these too; here the message can name the option. */
    if (tls_opt && strncasecmp(s.redis_url, "rediss://", 9) != 0 && strncasecmp(s.redis_url, "rediss-sentinel://", 18) != 0 &&
        strncasecmp(s.redis_url, "rediss-cluster://", 17) != 0) {
        fprintf(stderr,
                "%s: %s: given but the Redis URL is not rediss://, rediss-sentinel:// or rediss-cluster:// (TLS is only "
                "used with those)\n",
                prog, tls_opt);
        return 2;
    }
    if (t.print == !!t.exec_cmd) {
        fprintf(stderr, "%s: give exactly one of --print and --exec CMD\n", prog);
        return 2;
    }
    t.log.fn = s.log;
    t.log.min_level = s.log_level;
    s.handler = t.print ? print_handler : exec_handler;
    s.on_drained = on_drained;
    if (uv_loop_init(&t.loop) != 0)
        return 1;
    /* The web configuration is read before anything connects: a file that
     * cannot be used is a usage error. */
    if ((metrics_listen || metrics_web) &&
        (e = consume_metrics_create(&t.metrics, &t.loop, metrics_listen, metrics_web, s.stream, s.group,
                                    health_down_ms, &t.log, err, sizeof err)) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err[0] ? err : outbox_strerror(e));
        uv_loop_close(&t.loop);
        return e == OUTBOX_ENOMEM ? 1 : 2;
    }
    e = outbox_consumer_create(&t.c, &t.loop, &s, err, sizeof err);
    if (e != 0) {
        char q[600];
        outbox__logfmt_quote(q, sizeof q, err[0] ? err : outbox_strerror(e));
        outbox__log(&t.log, OUTBOX_LOG_ERROR, "msg=\"cannot create the consumer\" error=%s err=%s", q,
                    outbox_err_name(e));
        consume_metrics_close(t.metrics, NULL, NULL);
        uv_loop_close(&t.loop);
        return e == OUTBOX_ENOMEM ? 1 : 2;
    }
    signal(SIGPIPE, SIG_IGN);
    uv_signal_init(&t.loop, &t.sigterm);
    uv_signal_init(&t.loop, &t.sigint);
    t.sigterm.data = t.sigint.data = &t;
    uv_signal_start(&t.sigterm, on_signal, SIGTERM);
    uv_signal_start(&t.sigint, on_signal, SIGINT);
    if (outbox_consumer_start(t.c) != 0) {
        outbox__log(&t.log, OUTBOX_LOG_ERROR, "msg=\"cannot start\"");
        return 1;
    }
    /* After the consumer's start: the group's figures need it running. */
    if (t.metrics && (e = consume_metrics_start(t.metrics, t.c, err, sizeof err)) != 0) {
        char q[600];
        outbox__logfmt_quote(q, sizeof q, err[0] ? err : outbox_strerror(e));
        outbox__log(&t.log, OUTBOX_LOG_ERROR, "msg=\"cannot serve metrics\" error=%s err=%s", q, outbox_err_name(e));
        t.exit_code = 2;
        outbox_consumer_stop(t.c, on_stopped, &t);
    }
    uv_run(&t.loop, UV_RUN_DEFAULT);
    outbox_consumer_destroy(t.c);
    uv_run(&t.loop, UV_RUN_DEFAULT);
    uv_loop_close(&t.loop);
    return t.exit_code;
}
