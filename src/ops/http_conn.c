/*
 * http_conn.c: one connection of the HTTP server (http_int.h): its bytes,
 * through TLS when configured, the request head as they come, and the
 * answer.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "ops/http_int.h"

static const char *reason(int status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
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

/* ---- parsing -------------------------------------------------------------- */

static int on_url(http_parser *p, const char *at, size_t len)
{
    http_parse *x = p->data;
    outbox__http_head *h = x->h;
    if (h->path_too_long || h->path_len + len > OUTBOX_HTTP_PATH_MAX) {
        h->path_too_long = 1;
        return 0;
    }
    memcpy(h->path + h->path_len, at, len);
    h->path_len += len;
    h->path[h->path_len] = '\0';
    return 0;
}

/* A header's name and value may come in pieces (the parser is fed as bytes
 * arrive): a name's first piece follows a value (or nothing), a value's
 * first piece follows its name. */
static int on_header_field(http_parser *p, const char *at, size_t len)
{
    http_parse *x = p->data;
    if (!x->in_field) {
        x->in_field = 1;
        x->field_len = 0;
        x->field_over = 0;
    }
    if (x->field_over || x->field_len + len > sizeof x->field) {
        x->field_over = 1;
        return 0;
    }
    memcpy(x->field + x->field_len, at, len);
    x->field_len += len;
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    http_parse *x = p->data;
    outbox__http_head *h = x->h;
    if (x->in_field) {
        x->in_field = 0;
        x->value_is_auth = !x->field_over && x->field_len == 13 && strncasecmp(x->field, "authorization", 13) == 0;
        if (x->value_is_auth)
            h->auth_count++;
    }
    if (!x->value_is_auth || h->auth_count > 1)
        return 0;
    if (h->auth_len + len > OUTBOX_HTTP_AUTH_MAX) {
        h->auth_too_long = 1;
        return 0;
    }
    memcpy(h->auth + h->auth_len, at, len);
    h->auth_len += len;
    h->auth[h->auth_len] = '\0';
    return 0;
}

static int on_headers_complete(http_parser *p)
{
    http_parse *x = p->data;
    x->complete = 1;
    return 2; /* stop: no body is read */
}

static const http_parser_settings parser_settings = {
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
};

static void parse_begin(http_parse *x, outbox__http_head *h)
{
    memset(x, 0, sizeof *x);
    memset(h, 0, sizeof *h);
    http_parser_init(&x->p, HTTP_REQUEST);
    x->p.data = x;
    x->h = h;
}

/* Feeds the next bytes; returns what outbox__http_parse_head() returns,
 * except that 431 for the length is the caller's (it counts the bytes). */
static int parse_more(http_parse *x, const char *buf, size_t len)
{
    outbox__http_head *h = x->h;
    enum http_errno e;
    char *q;
    if (x->complete)
        return 0;
    http_parser_execute(&x->p, &parser_settings, buf, len);
    e = HTTP_PARSER_ERRNO(&x->p);
    if (!x->complete) {
        if (e == HPE_HEADER_OVERFLOW)
            return 431;
        if (e != HPE_OK) {
            h->error = http_errno_name(e);
            return 400;
        }
        return 0;
    }
    h->method_get = x->p.method == HTTP_GET;
    h->method_head = x->p.method == HTTP_HEAD;
    if (!h->method_get && !h->method_head)
        return 405;
    if (h->path_too_long)
        return 414;
    if ((x->p.flags & F_CHUNKED) || (x->p.content_length > 0 && x->p.content_length != ULLONG_MAX))
        return 413;
    if (h->auth_too_long)
        return 431;
    if (h->auth_count > 1) {
        h->error = "more than one Authorization header";
        return 400;
    }
    /* The query string plays no part in routing. */
    q = strchr(h->path, '?');
    if (q)
        *q = '\0';
    return 200;
}

int outbox__http_parse_head(const char *buf, size_t len, outbox__http_head *out)
{
    http_parse x;
    int status;
    parse_begin(&x, out);
    status = parse_more(&x, buf, len);
    if (status == 0 && len >= OUTBOX__HTTP_HEAD_MAX)
        return 431;
    return status;
}

/* ---- writing -------------------------------------------------------------- */

/* One write and its bytes, in one allocation. */
typedef struct wreq {
    uv_write_t w;
    struct outbox__http_req *c;
    int last; /* the answer's end: the connection closes once it is out */
    size_t len;
    char data[];
} wreq;

static void on_written(uv_write_t *w, int status)
{
    wreq *q = (wreq *)w;
    struct outbox__http_req *c = q->c;
    int last = q->last;
    free(q);
    c->writes--;
    if (status != 0 || last)
        outbox__http_conn_close(c);
}

static wreq *wreq_new(struct outbox__http_req *c, size_t len)
{
    wreq *q = malloc(sizeof *q + len);
    if (!q) {
        outbox__http_conn_close(c);
        return NULL;
    }
    q->c = c;
    q->last = 0;
    q->len = len;
    return q;
}

static void wreq_send(wreq *q)
{
    struct outbox__http_req *c = q->c;
    uv_buf_t b = uv_buf_init(q->data, (unsigned)q->len);
    c->writes++;
    if (uv_write(&q->w, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0) {
        c->writes--;
        free(q);
        outbox__http_conn_close(c);
    }
}

/* Sends the ciphertext the TLS session has waiting (handshake messages,
 * records, alerts); last as in wreq. */
static void flush_tls(struct outbox__http_req *c, int last)
{
    char *buf = NULL;
    size_t len = 0, cap = 0;
    wreq *q;
    if (c->closing || (outbox__tls_pending(c->tls) == 0 && !last))
        return;
    if (outbox__tls_take(c->tls, &buf, &len, &cap) != 0) {
        free(buf);
        outbox__http_conn_close(c);
        return;
    }
    if (len == 0) {
        free(buf);
        outbox__http_conn_close(c);
        return;
    }
    if ((q = wreq_new(c, len)) != NULL) {
        memcpy(q->data, buf, len);
        q->last = last;
        wreq_send(q);
    }
    free(buf);
}

void outbox__http_conn_send(struct outbox__http_req *c, int status, const char *extra, const char *ctype,
                            const char *body, size_t len)
{
    char head[512];
    size_t blen = c->head_only ? 0 : len;
    int n;
    wreq *q;
    if (c->closing || c->responded)
        return;
    if (c->srv->web && c->srv->web->tls && !c->tls) {
        outbox__http_conn_close(c); /* nothing to answer in yet */
        return;
    }
    c->responded = 1;
    outbox__http_conn_phase(c, CONN_WRITING);
    uv_read_stop((uv_stream_t *)&c->tcp);
    n = snprintf(head, sizeof head,
                 "HTTP/1.1 %d %s\r\n%sContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n"
                 "Cache-Control: no-store\r\n\r\n",
                 status, reason(status), extra ? extra : "", ctype, len);
    if (n < 0 || (size_t)n >= sizeof head) {
        outbox__http_conn_close(c);
        return;
    }
    if (c->tls) {
        size_t used;
        if (outbox__tls_encrypt(c->tls, head, (size_t)n, &used) != 0 || used != (size_t)n ||
            (blen && (outbox__tls_encrypt(c->tls, body, blen, &used) != 0 || used != blen))) {
            outbox__http_conn_close(c);
            return;
        }
        outbox__tls_close_notify(c->tls);
        flush_tls(c, 1);
        return;
    }
    if (!(q = wreq_new(c, (size_t)n + blen)))
        return;
    memcpy(q->data, head, (size_t)n);
    if (blen)
        memcpy(q->data + n, body, blen);
    q->last = 1;
    wreq_send(q);
}

void outbox__http_conn_error(struct outbox__http_req *c, int status, const char *msg)
{
    char body[200];
    const char *extra = NULL;
    int n = snprintf(body, sizeof body, "%d %s: %s\n", status, reason(status), msg);
    if (n < 0)
        n = 0;
    else if ((size_t)n >= sizeof body)
        n = (int)sizeof body - 1;
    /* 405 must say what is allowed, 401 how to authenticate. */
    if (status == 405)
        extra = "Allow: GET, HEAD\r\n";
    else if (status == 401)
        extra = "WWW-Authenticate: Basic realm=\"outbox\", charset=\"UTF-8\"\r\n";
    outbox__http_conn_send(c, status, extra, "text/plain; charset=utf-8", body, (size_t)n);
}

void outbox__http_respond(outbox__http_req *c, int status, const char *content_type, const char *body, size_t len)
{
    if (!c || c->phase != CONN_HANDLER)
        return;
    if (c->closing) {
        c->phase = CONN_WRITING;
        outbox__http_conn_free_if_done(c);
        return;
    }
    outbox__http_conn_send(c, status, NULL, content_type, body, len);
}

void outbox__http_conn_dispatch(struct outbox__http_req *c)
{
    outbox__http_conn_phase(c, CONN_HANDLER);
    c->srv->handler(c->srv->data, c, c->req.path);
}

/* ---- reading -------------------------------------------------------------- */

/* The plaintext of the head, as it comes. */
static void head_bytes(struct outbox__http_req *c, const char *p, size_t n)
{
    size_t take = n;
    int status;
    if (take > OUTBOX__HTTP_HEAD_MAX - c->head_len)
        take = OUTBOX__HTTP_HEAD_MAX - c->head_len;
    c->head_len += take;
    status = parse_more(&c->parse, p, take);
    if (status == 0 && c->head_len >= OUTBOX__HTTP_HEAD_MAX)
        status = 431;
    if (status == 0)
        return;
    c->head_only = c->req.method_head;
    switch (status) {
    case 200:
        if (c->srv->web && c->srv->web->nusers)
            outbox__http_auth_request(c);
        else
            outbox__http_conn_dispatch(c);
        break;
    case 405:
        outbox__http_conn_error(c, 405, "only GET and HEAD");
        break;
    case 413:
        outbox__http_conn_error(c, 413, "no request body accepted");
        break;
    case 414:
        outbox__http_conn_error(c, 414, "request target too long");
        break;
    case 431:
        outbox__http_conn_error(c, 431, c->req.auth_too_long ? "Authorization header larger than 1 KiB"
                                                             : "request head larger than 8 KiB");
        break;
    default:
        outbox__http_conn_error(c, 400, c->req.error ? c->req.error : "malformed request");
        break;
    }
}

static void conn_eof(struct outbox__http_req *c, ssize_t err)
{
    /* A client may half-close once its request is sent (nc -N, some
     * health checkers): the answer still goes out, and its deadline still
     * bounds the connection. */
    if (err == UV_EOF && c->phase > CONN_HEAD && !c->closing) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        return;
    }
    outbox__http_conn_close(c);
}

/* The largest first record taken: a TLS record's payload is at most 16 KiB
 * (RFC 8446, 5.1), a hello far less. */
#define HELLO_MAX (16384 + 5)

/* Gathers the client's first TLS record (its hello) before any TLS state
 * exists: a crowd of connections that never complete one costs a small
 * buffer each, not a TLS session, and what is not a TLS handshake at all
 * (plaintext HTTP to the TLS port) is closed at its first bytes. Returns
 * the bytes of p taken; the hello is complete once hello_len is
 * hello_need. */
static size_t hello_bytes(struct outbox__http_req *c, const char *p, size_t n)
{
    size_t take;
    if (!c->hello) {
        if (!(c->hello = malloc(5)))
            goto fail;
        c->hello_need = 5;
    }
    take = c->hello_need - c->hello_len < n ? c->hello_need - c->hello_len : n;
    memcpy(c->hello + c->hello_len, p, take);
    c->hello_len += take;
    if (c->hello_need == 5 && c->hello_len == 5) {
        /* A handshake record of version 3.x, with a plausible length. */
        size_t len = (size_t)c->hello[3] << 8 | c->hello[4];
        unsigned char *grown;
        if (c->hello[0] != 0x16 || c->hello[1] != 3 || len == 0 || len + 5 > HELLO_MAX) {
            outbox__log(c->srv->log, OUTBOX_LOG_DEBUG,
                        "msg=\"metrics endpoint: not a TLS handshake on the TLS port (plaintext?)\"");
            outbox__http_conn_close(c);
            return n;
        }
        if (!(grown = realloc(c->hello, len + 5)))
            goto fail;
        c->hello = grown;
        c->hello_need = len + 5;
        return take + (take < n ? hello_bytes(c, p + take, n - take) : 0);
    }
    return take;
fail:
    outbox__http_conn_close(c);
    return n;
}

static void conn_bytes(struct outbox__http_req *c, const char *p, size_t n)
{
    int rc;
    /* Nothing after the head is read: one request per connection. */
    if (c->closing || c->phase > CONN_HEAD || n == 0)
        return;
    if (c->phase == CONN_IDLE)
        outbox__http_conn_phase(c, CONN_HEAD);
    if (!c->srv->web || !c->srv->web->tls) {
        head_bytes(c, p, n);
        return;
    }
    if (!c->tls) {
        size_t used = hello_bytes(c, p, n);
        if (c->closing || c->hello_len < c->hello_need || c->hello_need <= 5)
            return;
        if (outbox__tls_accept(&c->tls, c->srv->web->tls) != 0 ||
            outbox__tls_feed(c->tls, (const char *)c->hello, c->hello_len) != 0) {
            outbox__http_conn_close(c);
            return;
        }
        free(c->hello);
        c->hello = NULL;
        p += used;
        n -= used;
    }
    if (n && outbox__tls_feed(c->tls, p, n) != 0) {
        outbox__http_conn_close(c);
        return;
    }
    if (!c->tls_up) {
        rc = outbox__tls_handshake(c->tls);
        if (outbox__tls_pending(c->tls) > 0)
            c->tls_answered = 1;
        flush_tls(c, 0);
        if (rc == OUTBOX__TLS_WANT)
            return;
        if (rc != 0) {
            /* Plaintext to the TLS port, no acceptable certificate, a
             * protocol error: nothing to answer in. */
            outbox__log(c->srv->log, OUTBOX_LOG_DEBUG, "msg=\"metrics endpoint: TLS handshake failed\" error=\"%s\"",
                        outbox__tls_errstr(c->tls));
            outbox__http_conn_close(c);
            return;
        }
        c->tls_up = 1;
    }
    while (!c->closing && c->phase <= CONN_HEAD) {
        char plain[4096];
        size_t got;
        rc = outbox__tls_read(c->tls, plain, sizeof plain, &got);
        if (rc == 0) {
            head_bytes(c, plain, got);
            continue;
        }
        if (rc == OUTBOX__TLS_WANT)
            flush_tls(c, 0);
        else
            conn_eof(c, rc == OUTBOX__TLS_EOF ? UV_EOF : UV_EPROTO);
        return;
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct outbox__http_req *c = h->data;
    (void)suggested;
    /* One slab per server (servers on loops of other threads have their
     * own): reads are processed at once and never kept. */
    *buf = uv_buf_init(c->srv->slab, sizeof c->srv->slab);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    struct outbox__http_req *c = s->data;
    if (n < 0)
        conn_eof(c, n);
    else
        conn_bytes(c, buf->base, (size_t)n);
}

/* What came with the connection is read at once rather than at the next
 * poll: a probe that sent its request with the handshake is answered in
 * the turn that accepted it, and a half-sent request has shown what it is
 * (a connection that may be closed for a newcomer) before the next one is
 * accepted. */
static void read_now(struct outbox__http_req *c)
{
    uv_os_fd_t fd;
    char buf[4096];
    int i;
    if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) != 0)
        return;
    for (i = 0; i < 4 && !c->closing && c->phase <= CONN_HEAD; i++) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) {
            conn_bytes(c, buf, (size_t)n);
            if ((size_t)n < sizeof buf)
                break;
            continue;
        }
        if (n == 0)
            conn_eof(c, UV_EOF);
        else if (errno == EINTR)
            continue;
        else if (errno != EAGAIN && errno != EWOULDBLOCK)
            outbox__http_conn_close(c);
        break;
    }
}

void outbox__http_conn_start(struct outbox__http_req *c)
{
    parse_begin(&c->parse, &c->req);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
        outbox__http_conn_close(c);
        return;
    }
    read_now(c);
}
