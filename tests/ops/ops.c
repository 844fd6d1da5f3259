/*
 * ops.c: see ops.h.
 */
#include "ops.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

/* ---- clean-up at exit ---------------------------------------------------- */

#define MAX_KIDS 64
#define MAX_DIRS 16
static pid_t kids[MAX_KIDS];
static char *dirs[MAX_DIRS];
static int cleanup_installed;

static void cleanup_at_exit(void)
{
    int i;
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] > 0) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
            kids[i] = 0;
        }
    for (i = 0; i < MAX_DIRS; i++) {
        th_rmtree(dirs[i]);
        free(dirs[i]);
        dirs[i] = NULL;
    }
}

static void install_cleanup(void)
{
    if (!cleanup_installed) {
        atexit(cleanup_at_exit);
        /* A server closing on us must fail a send, not kill the test. */
        signal(SIGPIPE, SIG_IGN);
        cleanup_installed = 1;
    }
}

static void track(pid_t pid)
{
    int i;
    install_cleanup();
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] == 0) {
            kids[i] = pid;
            return;
        }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    bail("too many child processes");
}

static void untrack(pid_t pid)
{
    int i;
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] == pid)
            kids[i] = 0;
}

char *ot_tmpdir(void)
{
    char *d = th_tmpdir();
    int i;
    install_cleanup();
    for (i = 0; i < MAX_DIRS && dirs[i]; i++)
        ;
    if (i == MAX_DIRS || !(dirs[i] = strdup(d)))
        bail("too many temp dirs");
    return d;
}

void ot_rmdir(char *dir)
{
    int i;
    if (!dir)
        return;
    th_rmtree(dir);
    for (i = 0; i < MAX_DIRS; i++)
        if (dirs[i] && strcmp(dirs[i], dir) == 0) {
            free(dirs[i]);
            dirs[i] = NULL;
        }
    free(dir);
}

/* ---- SQLite -------------------------------------------------------------- */

int64_t ot_unix_ms(void)
{
    return outbox_now_ms();
}

int ot_slow(void)
{
    const char *v = getenv("OUTBOX_UNDER_VALGRIND");
    return v && *v && strcmp(v, "0") != 0 ? 10 : 1;
}

char *ot_make_db(const char *dir, const char *name)
{
    char *path = th_path(dir, name), err[512];
    sqlite3 *db = NULL;
    int e = outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    if (e == 0)
        e = outbox_schema_apply(db, err, sizeof err);
    if (e != 0)
        bail("cannot create %s: %s (%s)", path, err, outbox_err_name(e));
    sqlite3_close_v2(db);
    return path;
}

sqlite3 *ot_open(const char *path)
{
    char err[512];
    sqlite3 *db = NULL;
    int e = outbox_db_open(path, 0, &db, err, sizeof err);
    if (e != 0)
        bail("cannot open %s: %s (%s)", path, err, outbox_err_name(e));
    sqlite3_busy_timeout(db, 5000);
    return db;
}

void ot_insert(sqlite3 *db, const char *prefix, int first, int n, const char *topic)
{
    sqlite3_stmt *st = NULL;
    int i;
    th_sql_exec(db, "BEGIN IMMEDIATE");
    if (sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, payload) VALUES (?1, ?2, ?3)", -1, &st, NULL) !=
        SQLITE_OK)
        bail("prepare insert: %s", sqlite3_errmsg(db));
    for (i = first; i < first + n; i++) {
        char id[64], payload[96];
        snprintf(id, sizeof id, "%s-%06d", prefix, i);
        snprintf(payload, sizeof payload, "{\"message\":\"%s\"}", id);
        sqlite3_bind_text(st, 1, id, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, topic, -1, SQLITE_STATIC);
        sqlite3_bind_blob(st, 3, payload, (int)strlen(payload), SQLITE_TRANSIENT);
        if (sqlite3_step(st) != SQLITE_DONE)
            bail("insert %s: %s", id, sqlite3_errmsg(db));
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    th_sql_exec(db, "COMMIT");
}

/* ---- streams ------------------------------------------------------------- */

static char *dup_bytes(const char *p, size_t n)
{
    char *d = malloc(n + 1);
    if (!d)
        bail("out of memory");
    memcpy(d, p, n);
    d[n] = '\0';
    return d;
}

ot_stream ot_stream_read(redisContext *c, const char *stream)
{
    ot_stream s = {NULL, NULL, 0};
    size_t cap = 0;
    char start[64] = "-";
    for (;;) {
        redisReply *r = th_cmd(c, "XRANGE %s %s + COUNT 1000", stream, start);
        size_t i;
        if (r->type == REDIS_REPLY_ERROR)
            bail("XRANGE %s: %s", stream, r->str);
        if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
            freeReplyObject(r);
            break;
        }
        for (i = 0; i < r->elements; i++) {
            redisReply *e = r->element[i], *f = e->element[1];
            size_t k;
            if (s.n == cap) {
                cap = cap ? cap * 2 : 1024;
                s.ids = realloc(s.ids, cap * sizeof *s.ids);
                s.eids = realloc(s.eids, cap * sizeof *s.eids);
                if (!s.ids || !s.eids)
                    bail("out of memory");
            }
            s.eids[s.n] = dup_bytes(e->element[0]->str, e->element[0]->len);
            s.ids[s.n] = NULL;
            for (k = 0; k + 1 < f->elements; k += 2)
                if (f->element[k]->len == 2 && memcmp(f->element[k]->str, "id", 2) == 0)
                    s.ids[s.n] = dup_bytes(f->element[k + 1]->str, f->element[k + 1]->len);
            if (!s.ids[s.n])
                s.ids[s.n] = dup_bytes("", 0);
            s.n++;
        }
        /* Exclusive start after the last entry read. */
        snprintf(start, sizeof start, "(%s", s.eids[s.n - 1]);
        freeReplyObject(r);
    }
    return s;
}

void ot_stream_free(ot_stream *s)
{
    for (size_t i = 0; i < s->n; i++) {
        free(s->ids[i]);
        free(s->eids[i]);
    }
    free(s->ids);
    free(s->eids);
    memset(s, 0, sizeof *s);
}

/* ---- the daemon ---------------------------------------------------------- */

pid_t ot_relay_spawn(const char *log, const char *db, const char *url, ...)
{
    va_list ap;
    char **argv;
    pid_t pid;
    va_start(ap, url);
    argv = th_relay_argv(db, url, ap);
    va_end(ap);
    install_cleanup();
    pid = th_spawn(argv, NULL, log, log);
    if (pid < 0)
        bail("cannot start %s", argv[0]);
    th_argv_free(argv);
    track(pid);
    return pid;
}

int ot_relay_run(int timeout_ms, char **err, const char *db, const char *url, ...)
{
    va_list ap;
    int rc;
    va_start(ap, url);
    rc = th_relay_runv(timeout_ms, err, db, url, ap);
    va_end(ap);
    return rc;
}

int ot_stop(pid_t pid, int sig, int timeout_ms)
{
    int rc;
    kill(pid, sig);
    rc = th_wait(pid, timeout_ms);
    if (rc == -2) {
        kill(pid, SIGKILL);
        th_wait(pid, -1);
    }
    untrack(pid);
    return rc;
}

/* ---- HTTP ---------------------------------------------------------------- */

int ot_http_raw(int port, const char *req, size_t len, char **resp, int timeout_ms)
{
    struct sockaddr_in a;
    int fd, status = -1;
    char *buf = NULL;
    size_t blen = 0, cap = 0, sent = 0;
    int64_t deadline = th_now_ms() + timeout_ms;
    struct pollfd p;

    install_cleanup();
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

int ot_http_get(int port, const char *path, char **body)
{
    char req[512], *resp = NULL;
    int st;
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: ops-test\r\n\r\n", path);
    st = ot_http_raw(port, req, strlen(req), &resp, 5000);
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
            return e ? dup_bytes(v, (size_t)(e - v)) : NULL;
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
    const char *p = text;
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

/* ---- text ---------------------------------------------------------------- */

int ot_count(const char *text, const char *needle)
{
    int n = 0;
    size_t len = strlen(needle);
    const char *p = text;
    while ((p = strstr(p, needle)) != NULL) {
        n++;
        p += len;
    }
    return n;
}

void ot_diag_tail(const char *what, const char *text, int max_lines)
{
    const char *p = text + strlen(text);
    int lines = 0;
    while (p > text) {
        p--;
        if (*p == '\n' && p[1] && ++lines > max_lines) {
            p++;
            break;
        }
    }
    while (*p) {
        const char *nl = strchr(p, '\n');
        int n = nl ? (int)(nl - p) : (int)strlen(p);
        diag("%s: %.*s", what, n, p);
        p += n + (nl ? 1 : 0);
    }
}
