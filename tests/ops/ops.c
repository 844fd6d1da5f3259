/*
 * ops.c: see ops.h.
 */
#include "ops.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

/* ---- HTTP ---------------------------------------------------------------- */

int ot_http_raw(int port, const char *req, size_t len, char **resp, int timeout_ms)
{
    struct sockaddr_in a;
    int fd, status = -1;
    char *buf = NULL;
    size_t blen = 0, cap = 0, sent = 0;
    int64_t deadline = th_now_ms() + timeout_ms;
    struct pollfd p;

    /* A server closing on us must fail a send, not kill the test. */
    signal(SIGPIPE, SIG_IGN);
    if (resp)
        *resp = NULL;
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    while (sent < len) {
        ssize_t n = send(fd, req + sent, len - sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break; /* the server may answer and close before reading it all */
        }
        sent += (size_t)n;
    }
    for (;;) {
        int64_t left = deadline - th_now_ms();
        ssize_t n;
        if (left <= 0)
            goto out;
        p.fd = fd;
        p.events = POLLIN;
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        if (blen + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            buf = realloc(buf, cap);
            if (!buf)
                bail("out of memory");
        }
        n = recv(fd, buf + blen, 4096, 0);
        if (n > 0) {
            blen += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        break; /* EOF, or a reset after the reply */
    }
    if (!buf) {
        buf = malloc(1);
        if (!buf)
            bail("out of memory");
    }
    buf[blen] = '\0';
    status = 0;
    if (blen >= 12 && strncmp(buf, "HTTP/1.1 ", 9) == 0)
        status = atoi(buf + 9);
out:
    close(fd);
    if (resp && status >= 0 && buf)
        *resp = buf;
    else
        free(buf);
    return status;
}

int ot_connect(int port, const char *from, int nonblock)
{
    struct sockaddr_in a, src;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
    if (fd < 0)
        bail("socket: %s", strerror(errno));
    memset(&src, 0, sizeof src);
    src.sin_family = AF_INET;
    if (inet_pton(AF_INET, from, &src.sin_addr) != 1)
        bail("not an IPv4 address: %s", from);
    if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0)
        bail("bind %s: %s", from, strerror(errno));
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && !(nonblock && errno == EINPROGRESS))
        bail("connect 127.0.0.1:%d from %s: %s", port, from, strerror(errno));
    return fd;
}

int ot_http_get(int port, const char *path, char **body)
{
    char req[512], *resp = NULL;
    int st;
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: ops-test\r\n\r\n", path);
    st = ot_http_raw(port, req, strlen(req), &resp, 5000 * th_slow());
    if (body) {
        const char *b = resp ? ot_http_body(resp) : NULL;
        *body = strdup(b ? b : "");
    }
    free(resp);
    return st;
}

const char *ot_http_body(const char *resp)
{
    const char *p = strstr(resp, "\r\n\r\n");
    return p ? p + 4 : NULL;
}

char *ot_http_header(const char *resp, const char *name)
{
    const char *end = strstr(resp, "\r\n\r\n"), *p = strstr(resp, "\r\n");
    size_t nl = strlen(name);
    while (p && end && p < end) {
        p += 2;
        if (strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1, *e = strstr(v, "\r\n");
            while (*v == ' ')
                v++;
            char *d;
            if (!e)
                return NULL;
            if (!(d = strndup(v, (size_t)(e - v))))
                bail("out of memory");
            return d;
        }
        p = strstr(p, "\r\n");
    }
    return NULL;
}

/* ---- Prometheus text ----------------------------------------------------- */

static int name_start(int c)
{
    return isalpha(c) || c == '_' || c == ':';
}

static int name_char(int c)
{
    return isalnum(c) || c == '_' || c == ':';
}

/* Parses one sample line; *series_end is where "name{labels}" ends. */
static const char *sample_line(const char *l, size_t len, size_t *series_end, double *v)
{
    size_t i = 0;
    char num[64], *end;
    if (!len || !name_start((unsigned char)l[0]))
        return "metric name";
    while (i < len && name_char((unsigned char)l[i]))
        i++;
    if (i < len && l[i] == '{') {
        i++;
        for (;;) {
            if (i < len && l[i] == '}') {
                i++;
                break;
            }
            if (i >= len || !name_start((unsigned char)l[i]))
                return "label name";
            while (i < len && name_char((unsigned char)l[i]))
                i++;
            if (i + 1 >= len || l[i] != '=' || l[i + 1] != '"')
                return "label =\"";
            i += 2;
            while (i < len && l[i] != '"') {
                if (l[i] == '\\') {
                    if (i + 1 >= len || !strchr("\\\"n", l[i + 1]))
                        return "label escape";
                    i++;
                }
                i++;
            }
            if (i >= len)
                return "unterminated label value";
            i++;
            if (i < len && l[i] == ',')
                i++;
            else if (i < len && l[i] != '}')
                return "label separator";
        }
    }
    *series_end = i;
    if (i >= len || l[i] != ' ')
        return "space before the value";
    i++;
    if (len - i == 0 || len - i >= sizeof num)
        return "value";
    memcpy(num, l + i, len - i);
    num[len - i] = '\0';
    if (!strcmp(num, "+Inf") || !strcmp(num, "-Inf") || !strcmp(num, "NaN")) {
        *v = 0;
        return NULL;
    }
    errno = 0;
    *v = strtod(num, &end);
    if (*end || errno)
        return "value is not a number";
    return NULL;
}

int ot_prom_check(const char *text, const char **why)
{
    const char *p = text;
    int line = 0;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p), se;
        double v;
        line++;
        if (!nl) {
            *why = "last line without a newline";
            return line;
        }
        if (len && p[0] != '#') {
            const char *w = sample_line(p, len, &se, &v);
            if (w) {
                *why = w;
                return line;
            }
        } else if (len > 7 && strncmp(p, "# TYPE ", 7) == 0) {
            const char *t = memchr(p + 7, ' ', len - 7);
            if (!t || !(strncmp(t + 1, "counter", 7) == 0 || strncmp(t + 1, "gauge", 5) == 0 ||
                        strncmp(t + 1, "histogram", 9) == 0 || strncmp(t + 1, "summary", 7) == 0 ||
                        strncmp(t + 1, "untyped", 7) == 0)) {
                *why = "TYPE line";
                return line;
            }
        }
        p = nl + 1;
    }
    return 0;
}

int ot_prom_get(const char *text, const char *series, double *v)
{
    const char *p = text;
    size_t sl = strlen(series);
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p), se;
        double x;
        if (len && p[0] != '#' && !sample_line(p, len, &se, &x) && se == sl && memcmp(p, series, sl) == 0) {
            *v = x;
            return 1;
        }
        if (!nl)
            break;
        p = nl + 1;
    }
    return 0;
}

double ot_prom_val(const char *text, const char *series)
{
    double v;
    return text && ot_prom_get(text, series, &v) ? v : -1;
}

double ot_prom_sum(const char *text, const char *name, int *n)
{
    const char *p = text ? text : "";
    size_t nlen = strlen(name);
    double sum = 0;
    int count = 0;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p), se;
        double x;
        if (len > nlen && p[0] != '#' && memcmp(p, name, nlen) == 0 && (p[nlen] == '{' || p[nlen] == ' ') &&
            !sample_line(p, len, &se, &x)) {
            sum += x;
            count++;
        }
        if (!nl)
            break;
        p = nl + 1;
    }
    if (n)
        *n = count;
    return sum;
}

/* ---- holding a drain ---------------------------------------------------- */

void ot_redis_pause(redisContext *c, int ms)
{
    redisReply *r = ms ? th_cmd(c, "CLIENT PAUSE %d WRITE", ms) : th_cmd(c, "CLIENT UNPAUSE");
    if (r->type != REDIS_REPLY_STATUS)
        bail("CLIENT %s: %s", ms ? "PAUSE" : "UNPAUSE", r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
    freeReplyObject(r);
}

int ot_wait_gauges(int port, int want_sent, int64_t deadline)
{
    for (;;) {
        char *body = NULL;
        double awaiting = -1, inflight = -1;
        if (ot_http_get(port, "/metrics", &body) == 200) {
            awaiting = ot_prom_val(body, "outbox_awaiting_replies");
            inflight = ot_prom_val(body, "outbox_inflight");
        }
        free(body);
        if (want_sent ? awaiting > 0 : awaiting == 0 && inflight > 0)
            return 1;
        if (th_now_ms() > deadline) {
            diag("outbox_awaiting_replies %g, outbox_inflight %g: %s", awaiting, inflight,
                 want_sent ? "no XADD waits in Redis" : "no claimed row has its reply");
            return 0;
        }
        th_sleep_ms(1);
    }
}
