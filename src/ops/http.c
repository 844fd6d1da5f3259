/*
 * A small HTTP/1.1 server for /metrics and /healthz (see http.h).
 */
#include <arpa/inet.h>
#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/http.h"

#define HEAD_MAX 8192
#define MAX_CONNS 64
#define IDLE_TIMEOUT_MS 10000

struct outbox__http {
    uv_loop_t *loop;
    uv_tcp_t listener;
    outbox__http_handler handler;
    void *data;
    const outbox__logger *log;
    struct outbox__http_req *conns;
    int nconns, closing, handles;
    void (*close_cb)(void *);
    void *close_data;
};

/* One connection, one request. */
struct outbox__http_req {
    outbox__http *srv;
    struct outbox__http_req *next, *prev;
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wr;
    char head[HEAD_MAX];
    size_t head_len;
    outbox__http_head req;
    int head_done, waiting, responded, closing, handles, head_only;
    char *out;
};

static const char *reason(int status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
    }
}

static void srv_handle_gone(outbox__http *h)
{
    if (--h->handles == 0 && h->closing) {
        void (*cb)(void *) = h->close_cb;
        void *d = h->close_data;
        free(h);
        if (cb)
            cb(d);
    }
}

static void conn_free_if_done(struct outbox__http_req *c)
{
    outbox__http *h = c->srv;
    if (c->handles > 0 || c->waiting)
        return;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->nconns--;
    free(c->out);
    free(c);
    srv_handle_gone(h);
}

static void conn_handle_closed(uv_handle_t *hd)
{
    struct outbox__http_req *c = hd->data;
    c->handles--;
    conn_free_if_done(c);
}

static void conn_close(struct outbox__http_req *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

static void on_written(uv_write_t *w, int status)
{
    struct outbox__http_req *c = w->data;
    (void)status;
    conn_close(c);
}

static void send_response(struct outbox__http_req *c, int status, const char *ctype, const char *body, size_t len)
{
    char head[256];
    int n;
    uv_buf_t b;
    if (c->closing || c->responded)
        return;
    c->responded = 1;
    n = snprintf(head, sizeof head,
                 "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n"
                 "Cache-Control: no-store\r\n\r\n",
                 status, reason(status), ctype, len);
    c->out = malloc((size_t)n + (c->head_only ? 0 : len));
    if (!c->out) {
        conn_close(c);
        return;
    }
    memcpy(c->out, head, (size_t)n);
    if (!c->head_only && len)
        memcpy(c->out + n, body, len);
    b = uv_buf_init(c->out, (unsigned)n + (unsigned)(c->head_only ? 0 : len));
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->wr.data = c;
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0)
        conn_close(c);
}

static void send_error(struct outbox__http_req *c, int status, const char *msg)
{
    char body[160];
    int n = snprintf(body, sizeof body, "%d %s: %s\n", status, reason(status), msg);
    if (status == 405 && !c->closing && !c->responded) {
        /* 405 must say what is allowed. */
        char head[256];
        uv_buf_t b;
        int hn;
        c->responded = 1;
        hn = snprintf(head, sizeof head,
                      "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Type: text/plain\r\n"
                      "Content-Length: %d\r\nConnection: close\r\n\r\n",
                      n);
        c->out = malloc((size_t)hn + (size_t)n);
        if (!c->out) {
            conn_close(c);
            return;
        }
        memcpy(c->out, head, (size_t)hn);
        memcpy(c->out + hn, body, (size_t)n);
        b = uv_buf_init(c->out, (unsigned)(hn + n));
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->wr.data = c;
        if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0)
            conn_close(c);
        return;
    }
    send_response(c, status, "text/plain; charset=utf-8", body, (size_t)n);
}

void outbox__http_respond(outbox__http_req *c, int status, const char *content_type, const char *body, size_t len)
{
    if (!c || !c->waiting)
        return;
    c->waiting = 0;
    if (c->closing) {
        conn_free_if_done(c);
        return;
    }
    send_response(c, status, content_type, body, len);
}

typedef struct parse_ctx {
    outbox__http_head *h;
    int complete;
} parse_ctx;

static int on_url(http_parser *p, const char *at, size_t len)
{
    parse_ctx *x = p->data;
    outbox__http_head *h = x->h;
    if (h->path_len + len > OUTBOX_HTTP_PATH_MAX) {
        h->path_too_long = 1;
        return 0;
    }
    memcpy(h->path + h->path_len, at, len);
    h->path_len += len;
    h->path[h->path_len] = '\0';
    return 0;
}

static int on_headers_complete(http_parser *p)
{
    parse_ctx *x = p->data;
    x->complete = 1;
    return 2; /* stop: no body is read */
}

static const http_parser_settings parser_settings = {
    .on_url = on_url,
    .on_headers_complete = on_headers_complete,
};

int outbox__http_parse_head(const char *buf, size_t len, outbox__http_head *out)
{
    http_parser p;
    parse_ctx x = {out, 0};
    char *q;
    enum http_errno e;

    memset(out, 0, sizeof *out);
    http_parser_init(&p, HTTP_REQUEST);
    p.data = &x;
    http_parser_execute(&p, &parser_settings, buf, len);
    e = HTTP_PARSER_ERRNO(&p);
    if (!x.complete) {
        if (e == HPE_HEADER_OVERFLOW)
            return 431;
        if (e != HPE_OK) {
            out->error = http_errno_name(e);
            return 400;
        }
        return len >= HEAD_MAX ? 431 : 0;
    }
    out->method_get = p.method == HTTP_GET;
    out->method_head = p.method == HTTP_HEAD;
    if (!out->method_get && !out->method_head)
        return 405;
    if (out->path_too_long)
        return 414;
    if ((p.flags & F_CHUNKED) || (p.content_length > 0 && p.content_length != ULLONG_MAX))
        return 413;
    /* The query string plays no part in routing. */
    q = strchr(out->path, '?');
    if (q)
        *q = '\0';
    return 200;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    static char slab[4096];
    (void)h;
    (void)suggested;
    /* One static slab: reads are parsed synchronously and never kept. */
    *buf = uv_buf_init(slab, sizeof slab);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    struct outbox__http_req *c = s->data;
    size_t take;
    int status;
    if (n < 0) {
        /* A client may half-close once its request is sent (nc -N, some
         * health checkers): the answer still goes out, and the idle timer
         * still bounds the connection. */
        if (n == UV_EOF && c->head_done && !c->closing) {
            uv_read_stop(s);
            return;
        }
        conn_close(c);
        return;
    }
    if (n == 0 || c->head_done || c->responded)
        return;
    take = (size_t)n;
    if (take > HEAD_MAX - c->head_len)
        take = HEAD_MAX - c->head_len;
    memcpy(c->head + c->head_len, buf->base, take);
    c->head_len += take;
    if (take < (size_t)n && c->head_len == HEAD_MAX) {
        send_error(c, 431, "request head larger than 8 KiB");
        return;
    }
    status = outbox__http_parse_head(c->head, c->head_len, &c->req);
    if (status == 0)
        return;
    c->head_done = 1;
    c->head_only = c->req.method_head;
    switch (status) {
    case 200:
        c->waiting = 1;
        c->srv->handler(c->srv->data, c, c->req.path);
        break;
    case 405:
        send_error(c, 405, "only GET and HEAD");
        break;
    case 413:
        send_error(c, 413, "no request body accepted");
        break;
    case 414:
        send_error(c, 414, "request target too long");
        break;
    case 431:
        send_error(c, 431, "request head larger than 8 KiB");
        break;
    default:
        send_error(c, 400, c->req.error ? c->req.error : "malformed request");
        break;
    }
}

static void on_idle(uv_timer_t *t)
{
    struct outbox__http_req *c = t->data;
    if (c->waiting)
        return; /* our own answer is late, not the client */
    if (!c->responded && c->head_len > 0)
        send_error(c, 408, "request not complete in time");
    else
        conn_close(c);
}

static void on_conn(uv_stream_t *l, int status)
{
    outbox__http *h = l->data;
    struct outbox__http_req *c;
    if (status != 0 || h->closing)
        return;
    c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->srv = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->handles = 2;
    h->handles++;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->nconns++;
    if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0 || h->nconns > MAX_CONNS) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_idle, IDLE_TIMEOUT_MS, 0);
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

int outbox__http_parse_listen(const char *listen, struct sockaddr_storage *ss, char *err, size_t errlen)
{
    char host[256];
    const char *colon;
    long port;
    size_t hl;

    memset(ss, 0, sizeof *ss);
    if (!listen || !*listen) {
        snprintf(err, errlen, "empty listen address (want HOST:PORT)");
        return OUTBOX_EINVAL;
    }
    colon = strrchr(listen, ':');
    if (!colon) {
        snprintf(err, errlen, "'%s' has no port (want HOST:PORT, e.g. 127.0.0.1:9464)", listen);
        return OUTBOX_EINVAL;
    }
    /* Digits only: strtol alone would take " 80", "+80" or "0x50". */
    port = strspn(colon + 1, "0123456789") == strlen(colon + 1) ? strtol(colon + 1, NULL, 10) : -1;
    if (!colon[1] || port < 1 || port > 65535) {
        snprintf(err, errlen, "'%s': port must be 1..65535", listen);
        return OUTBOX_EINVAL;
    }
    hl = (size_t)(colon - listen);
    if (hl >= sizeof host) {
        snprintf(err, errlen, "host part too long");
        return OUTBOX_EINVAL;
    }
    memcpy(host, listen, hl);
    host[hl] = '\0';
    if (hl == 0)
        strcpy(host, "0.0.0.0");
    if (host[0] == '[') {
        size_t n = strlen(host);
        if (n < 3 || host[n - 1] != ']') {
            snprintf(err, errlen, "'%s': unterminated [IPv6] address", listen);
            return OUTBOX_EINVAL;
        }
        host[n - 1] = '\0';
        if (uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss) != 0) {
            snprintf(err, errlen, "'%s': not an IPv6 address", listen);
            return OUTBOX_EINVAL;
        }
        return 0;
    }
    if (!strcmp(host, "localhost"))
        strcpy(host, "127.0.0.1");
    if (uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss) != 0) {
        snprintf(err, errlen, "'%s': host must be an IP address (or localhost)", listen);
        return OUTBOX_EINVAL;
    }
    return 0;
}

static void listener_closed(uv_handle_t *hd);

int outbox__http_start(outbox__http **out, uv_loop_t *loop, const char *listen, outbox__http_handler handler,
                       void *data, const outbox__logger *log, char *err, size_t errlen)
{
    struct sockaddr_storage ss;
    outbox__http *h;
    int e;

    *out = NULL;
    e = outbox__http_parse_listen(listen, &ss, err, errlen);
    if (e != 0)
        return e;
    h = calloc(1, sizeof *h);
    if (!h)
        return OUTBOX_ENOMEM;
    h->loop = loop;
    h->handler = handler;
    h->data = data;
    h->log = log;
    uv_tcp_init(loop, &h->listener);
    h->listener.data = h;
    h->handles = 1;
    e = uv_tcp_bind(&h->listener, (const struct sockaddr *)&ss, 0);
    if (e == 0)
        e = uv_listen((uv_stream_t *)&h->listener, 64, on_conn);
    if (e != 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", listen, uv_strerror(e));
        /* The handle's memory must outlive its close callback, which frees h. */
        h->closing = 1;
        uv_close((uv_handle_t *)&h->listener, listener_closed);
        return OUTBOX_EIO;
    }
    *out = h;
    return 0;
}

static void listener_closed(uv_handle_t *hd)
{
    srv_handle_gone(hd->data);
}

void outbox__http_close(outbox__http *h, void (*cb)(void *data), void *data)
{
    struct outbox__http_req *c;
    if (!h || h->closing)
        return;
    h->closing = 1;
    h->close_cb = cb;
    h->close_data = data;
    for (c = h->conns; c; c = c->next)
        conn_close(c);
    uv_close((uv_handle_t *)&h->listener, listener_closed);
}
