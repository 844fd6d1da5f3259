/*
 * redis_url.c: parsing and printing Redis URLs (see redis.h for the grammar).
 *
 * The parser is strict on purpose: a typo in a deployment's URL should fail
 * at start-up with a message naming the bad part, not connect somewhere else.
 */
#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/un.h>

#include "redis/redis.h"

#define DB_MAX 2147483647L

/* A parse in progress: the result being built and where errors go. */
typedef struct url_parser {
    outbox__redis_url u;
    char *err;
    size_t errlen;
    int status; /* OUTBOX_EURL or OUTBOX_ENOMEM once something failed */
} url_parser;

static void fail(url_parser *p, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(url_parser *p, int status, const char *fmt, ...)
{
    va_list ap;
    if (p->status)
        return;
    p->status = status;
    if (p->err && p->errlen > 0) {
        va_start(ap, fmt);
        vsnprintf(p->err, p->errlen, fmt, ap);
        va_end(ap);
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decodes s[0..len) into a new string; what names the part in error
 * messages. Returns NULL after calling fail(). */
static char *decode(url_parser *p, const char *s, size_t len, const char *what)
{
    char *out = malloc(len + 1);
    size_t i, n = 0;
    if (!out) {
        fail(p, OUTBOX_ENOMEM, "out of memory");
        return NULL;
    }
    for (i = 0; i < len; i++) {
        if (s[i] != '%') {
            out[n++] = s[i];
            continue;
        }
        if (len - i < 3 || hexval(s[i + 1]) < 0 || hexval(s[i + 2]) < 0) {
            fail(p, OUTBOX_EURL, "bad percent-encoding in %s", what);
            free(out);
            return NULL;
        }
        out[n] = (char)(hexval(s[i + 1]) * 16 + hexval(s[i + 2]));
        if (out[n] == '\0') {
            fail(p, OUTBOX_EURL, "%%00 (NUL byte) in %s", what);
            free(out);
            return NULL;
        }
        n++;
        i += 2;
    }
    out[n] = '\0';
    return out;
}

/* Parses an unsigned decimal s[0..len) no larger than max. Returns 0, -1 if
 * it is not a number (empty, sign, other characters), -2 if too large. */
static int parse_uint(const char *s, size_t len, long max, long *val)
{
    long v = 0;
    size_t i;
    int big = 0;
    if (len == 0)
        return -1;
    for (i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        if (!big) {
            v = v * 10 + (s[i] - '0');
            if (v > max)
                big = 1;
        }
    }
    if (big)
        return -2;
    *val = v;
    return 0;
}

static void parse_port(url_parser *p, const char *s, size_t len)
{
    long v = 0;
    int rc = parse_uint(s, len, 65535, &v);
    if (rc == -1)
        fail(p, OUTBOX_EURL, "port '%.*s' is not a number", (int)len, s);
    else if (rc == -2 || v == 0)
        fail(p, OUTBOX_EURL, "port %.*s out of range 1..65535", (int)len, s);
    else
        p->u.port = (int)v;
}

static void parse_db(url_parser *p, const char *s, size_t len)
{
    long v = 0;
    int rc = parse_uint(s, len, DB_MAX, &v);
    if (rc == -1 && len > 1 && s[0] == '-' && parse_uint(s + 1, len - 1, DB_MAX, &v) != -1)
        rc = -2; /* a negative number: say "out of range" rather than "not a number" */
    if (rc == -1)
        fail(p, OUTBOX_EURL, "database '%.*s' is not a number", (int)len, s);
    else if (rc == -2)
        fail(p, OUTBOX_EURL, "database %.*s out of range 0..2147483647", (int)len, s);
    else
        p->u.db = (int)v;
}

static int is_host_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '.' || c == '_';
}

/* Userinfo "[user][:password]" (percent-encoded). Without a ':' the whole
 * userinfo is the password, as redis-cli reads it. Empty parts mean "not
 * given", except that a user with an empty password keeps "" so that AUTH
 * user "" is still sent. */
static void parse_userinfo(url_parser *p, const char *s, size_t len)
{
    const char *colon = memchr(s, ':', len);
    const char *pw = s;
    size_t pwlen = len;
    if (colon) {
        size_t ulen = (size_t)(colon - s);
        if (ulen > 0 && !(p->u.user = decode(p, s, ulen, "user name")))
            return;
        pw = colon + 1;
        pwlen = len - ulen - 1;
    }
    if (pwlen > 0 || p->u.user) {
        if (!(p->u.password = decode(p, pw, pwlen, "password")))
            return;
    }
}

static void parse_tcp(url_parser *p, const char *s)
{
    const char *at = strrchr(s, '@');
    const char *h, *end;
    size_t hlen;

    p->u.port = 6379;
    /* The last '@' ends the userinfo: host, port and db cannot contain one,
     * so a password with an unencoded '@' or '/' still parses. */
    if (at) {
        parse_userinfo(p, s, (size_t)(at - s));
        if (p->status)
            return;
        s = at + 1;
    }

    if (*s == '[') {
        char tmp[INET6_ADDRSTRLEN + 1];
        struct in6_addr a6;
        h = s + 1;
        end = strchr(h, ']');
        if (!end) {
            fail(p, OUTBOX_EURL, "unterminated '[' in IPv6 address");
            return;
        }
        hlen = (size_t)(end - h);
        if (hlen == 0) {
            fail(p, OUTBOX_EURL, "empty host");
            return;
        }
        if (hlen >= sizeof tmp) {
            fail(p, OUTBOX_EURL, "invalid IPv6 address '%.*s'", (int)hlen, h);
            return;
        }
        memcpy(tmp, h, hlen);
        tmp[hlen] = '\0';
        if (inet_pton(AF_INET6, tmp, &a6) != 1) {
            fail(p, OUTBOX_EURL, "invalid IPv6 address '%s'", tmp);
            return;
        }
        s = end + 1;
    } else {
        h = s;
        while (is_host_char(*s))
            s++;
        hlen = (size_t)(s - h);
        if (hlen == 0 && (*s == '\0' || *s == ':' || *s == '/')) {
            fail(p, OUTBOX_EURL, "empty host");
            return;
        }
    }
    if (*s != '\0' && *s != ':' && *s != '/') {
        if (*s == '?' || *s == '#' || *s == ']' || h[hlen] == ']')
            fail(p, OUTBOX_EURL, "unexpected '%s' after host", s);
        else
            fail(p, OUTBOX_EURL, "invalid character '%c' in host", *s);
        return;
    }
    if (!(p->u.host = strndup(h, hlen))) {
        fail(p, OUTBOX_ENOMEM, "out of memory");
        return;
    }

    if (*s == ':') {
        const char *port = ++s;
        while (*s && *s != '/')
            s++;
        parse_port(p, port, (size_t)(s - port));
        if (p->status)
            return;
    }
    if (*s == '/') {
        s++;
        if (*s) /* "redis://host/" means database 0 */
            parse_db(p, s, strlen(s));
    }
}

static void parse_query(url_parser *p, const char *q)
{
    while (*q && !p->status) {
        const char *amp = strchr(q, '&');
        size_t len = amp ? (size_t)(amp - q) : strlen(q);
        const char *eq = memchr(q, '=', len);
        if (len > 0) {
            size_t klen = eq ? (size_t)(eq - q) : len;
            const char *v = eq ? eq + 1 : NULL;
            size_t vlen = eq ? len - klen - 1 : 0;
            if (!eq) {
                fail(p, OUTBOX_EURL, "query parameter '%.*s' has no value", (int)len, q);
            } else if (klen == 2 && memcmp(q, "db", 2) == 0) {
                parse_db(p, v, vlen);
            } else if (klen == 8 && memcmp(q, "password", 8) == 0) {
                free(p->u.password);
                p->u.password = decode(p, v, vlen, "password");
            } else if (klen == 4 && memcmp(q, "user", 4) == 0) {
                free(p->u.user);
                p->u.user = NULL;
                if (vlen > 0)
                    p->u.user = decode(p, v, vlen, "user name");
            } else {
                fail(p, OUTBOX_EURL, "unknown query parameter '%.*s'", (int)klen, q);
            }
        }
        if (!amp)
            break;
        q = amp + 1;
    }
}

static void parse_unix(url_parser *p, const char *s)
{
    const char *q = strchr(s, '?');
    size_t len = q ? (size_t)(q - s) : strlen(s);
    struct sockaddr_un sa;

    if (len == 0) {
        fail(p, OUTBOX_EURL, "empty unix socket path");
        return;
    }
    if (s[0] != '/') {
        fail(p, OUTBOX_EURL, "unix socket path '%.*s' is not absolute", (int)len, s);
        return;
    }
    if (len >= sizeof sa.sun_path) {
        fail(p, OUTBOX_EURL, "unix socket path too long (%zu bytes, at most %zu)", len,
             sizeof sa.sun_path - 1);
        return;
    }
    if (!(p->u.path = strndup(s, len))) {
        fail(p, OUTBOX_ENOMEM, "out of memory");
        return;
    }
    if (q)
        parse_query(p, q + 1);
}

/* ---- Sentinel URLs ------------------------------------------------------- */

static int dup_or_null(char **dst, const char *src);

#define SENTINEL_PORT 26379
#define SENTINELS_MAX 64

/* A host list (the sentinels, or a cluster's seed nodes): copies n hosts and
 * ports into fresh arrays; *dn counts the hosts copied, so that the owner's
 * free works on a partial copy. 0 or OUTBOX_ENOMEM. */
static int copy_hosts(char ***dh, int **dp, size_t *dn, char *const *sh, const int *sp, size_t n)
{
    if (!(*dh = calloc(n, sizeof **dh)) || !(*dp = calloc(n, sizeof **dp)))
        return OUTBOX_ENOMEM;
    for (*dn = 0; *dn < n; (*dn)++) {
        (*dp)[*dn] = sp[*dn];
        if (!((*dh)[*dn] = strdup(sh[*dn])))
            return OUTBOX_ENOMEM;
    }
    return 0;
}

static void free_hosts(char **hosts, int *ports, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(hosts[i]);
    free(hosts);
    free(ports);
}

/* Appends "host:port,..." (IPv6 addresses bracketed) to buf. */
static void describe_hosts(char *buf, size_t len, char *const *hosts, const int *ports, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int v6 = strchr(hosts[i], ':') != NULL;
        size_t used = strlen(buf);
        snprintf(buf + used, len - used, "%s%s%s%s:%d", i ? "," : "", v6 ? "[" : "", hosts[i], v6 ? "]" : "",
                 ports[i]);
    }
}

static void sentinels_free(outbox__redis_sentinels *s)
{
    if (!s)
        return;
    free_hosts(s->hosts, s->ports, s->n);
    free(s->master);
    free(s->user);
    free(s->password);
    free(s);
}

/* One "host[:port]" of a sentinel or cluster seed list, through the
 * redis:// host parser; dflt is the port when none is given (a sentinel's
 * default port is 26379). `what` names the list in messages. */
static void parse_list_host(url_parser *p, char **hosts, int *ports, size_t *n, int dflt, const char *what,
                            const char *item, size_t len)
{
    url_parser one;
    char buf[300];
    const char *port_sep;
    if (len == 0) {
        fail(p, OUTBOX_EURL, "empty host in the %s list", what);
        return;
    }
    if (len >= sizeof buf) {
        fail(p, OUTBOX_EURL, "%s address '%.40s...' too long", what, item);
        return;
    }
    memcpy(buf, item, len);
    buf[len] = '\0';
    if (strchr(buf, '@')) {
        fail(p, OUTBOX_EURL, "invalid character '@' in %s '%s'", what, buf);
        return;
    }
    memset(&one, 0, sizeof one);
    one.err = p->err;
    one.errlen = p->errlen;
    parse_tcp(&one, buf);
    if (one.status) {
        p->status = one.status;
        outbox__redis_url_free(&one.u);
        return;
    }
    port_sep = buf[0] == '[' ? strstr(buf, "]:") : strchr(buf, ':');
    hosts[*n] = one.u.host;
    ports[*n] = port_sep ? one.u.port : dflt;
    (*n)++;
    one.u.host = NULL;
    outbox__redis_url_free(&one.u);
}

static void parse_sentinel_host(url_parser *p, outbox__redis_sentinels *s, const char *item, size_t len)
{
    parse_list_host(p, s->hosts, s->ports, &s->n, SENTINEL_PORT, "sentinel", item, len);
}

/* "[userinfo@]host[:port][,host[:port]...][/db]#master". The userinfo and
 * the db are the data nodes'; the master name is percent-decoded. */
static void parse_sentinel(url_parser *p, const char *s, int tls)
{
    const char *at = strrchr(s, '@'), *hash, *list, *slash, *end, *item;
    outbox__redis_sentinels *st;

    hash = strchr(at ? at : s, '#');
    if (!hash || !hash[1]) {
        fail(p, OUTBOX_EURL, "missing master name: expected %s://host:26379[,host...]#master-name",
             tls ? "rediss-sentinel" : "redis-sentinel");
        return;
    }
    if (!(st = p->u.sentinel = calloc(1, sizeof *st)) || !(st->hosts = calloc(SENTINELS_MAX, sizeof *st->hosts)) ||
        !(st->ports = calloc(SENTINELS_MAX, sizeof *st->ports))) {
        fail(p, OUTBOX_ENOMEM, "out of memory");
        return;
    }
    p->u.tls = tls;
    if (!(st->master = decode(p, hash + 1, strlen(hash + 1), "master name")))
        return;
    for (const char *c = st->master; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f) {
            fail(p, OUTBOX_EURL, "invalid character in master name '%s'", st->master);
            return;
        }
    if (at) {
        parse_userinfo(p, s, (size_t)(at - s));
        if (p->status)
            return;
    }
    list = at ? at + 1 : s;
    slash = memchr(list, '/', (size_t)(hash - list));
    end = slash ? slash : hash;
    if (end == list) {
        fail(p, OUTBOX_EURL, "empty sentinel list");
        return;
    }
    for (item = list; item <= end && !p->status;) {
        const char *comma = memchr(item, ',', (size_t)(end - item));
        const char *stop = comma ? comma : end;
        if (st->n == SENTINELS_MAX) {
            fail(p, OUTBOX_EURL, "more than %d sentinels", SENTINELS_MAX);
            return;
        }
        parse_sentinel_host(p, st, item, (size_t)(stop - item));
        if (!comma)
            break;
        item = comma + 1;
    }
    if (!p->status && slash && slash + 1 < hash)
        parse_db(p, slash + 1, (size_t)(hash - slash - 1));
}

/* ---- Cluster URLs -------------------------------------------------------- */

#define CLUSTER_SEEDS_MAX 64

static void seeds_free(outbox__redis_seeds *s)
{
    if (!s)
        return;
    free_hosts(s->hosts, s->ports, s->n);
    free(s);
}

/* "[userinfo@]host[:port][,host[:port]...][/0]": the seed nodes (default
 * port 6379); the userinfo applies to every node. A cluster has only
 * database 0. */
static void parse_cluster(url_parser *p, const char *s, int tls)
{
    const char *scheme = tls ? "rediss-cluster" : "redis-cluster";
    const char *at = strrchr(s, '@'), *list, *slash, *end, *item, *bad;
    outbox__redis_seeds *c;

    if (!(c = p->u.cluster = calloc(1, sizeof *c)) || !(c->hosts = calloc(CLUSTER_SEEDS_MAX, sizeof *c->hosts)) ||
        !(c->ports = calloc(CLUSTER_SEEDS_MAX, sizeof *c->ports))) {
        fail(p, OUTBOX_ENOMEM, "out of memory");
        return;
    }
    p->u.tls = tls;
    if (at) {
        parse_userinfo(p, s, (size_t)(at - s));
        if (p->status)
            return;
    }
    list = at ? at + 1 : s;
    if ((bad = strpbrk(list, "?#")) != NULL) {
        fail(p, OUTBOX_EURL, "unexpected '%s' in %s:// URL: expected %s://host:port[,host:port...]", bad, scheme,
             scheme);
        return;
    }
    slash = strchr(list, '/');
    end = slash ? slash : list + strlen(list);
    if (end == list) {
        fail(p, OUTBOX_EURL, "empty seed node list: expected %s://host:port[,host:port...]", scheme);
        return;
    }
    for (item = list; item <= end && !p->status;) {
        const char *comma = memchr(item, ',', (size_t)(end - item));
        const char *stop = comma ? comma : end;
        if (c->n == CLUSTER_SEEDS_MAX) {
            fail(p, OUTBOX_EURL, "more than %d seed nodes", CLUSTER_SEEDS_MAX);
            return;
        }
        parse_list_host(p, c->hosts, c->ports, &c->n, 6379, "seed node", item, (size_t)(stop - item));
        if (!comma)
            break;
        item = comma + 1;
    }
    if (!p->status && slash && slash[1]) {
        parse_db(p, slash + 1, strlen(slash + 1));
        if (!p->status && p->u.db != 0)
            fail(p, OUTBOX_EURL, "database %d with %s://: a Redis Cluster has only database 0", p->u.db, scheme);
    }
}

static int copy_seeds(outbox__redis_seeds **dst, const outbox__redis_seeds *src)
{
    outbox__redis_seeds *c;
    *dst = NULL;
    if (!src)
        return 0;
    if (!(c = calloc(1, sizeof *c)) || copy_hosts(&c->hosts, &c->ports, &c->n, src->hosts, src->ports, src->n)) {
        seeds_free(c);
        return OUTBOX_ENOMEM;
    }
    *dst = c;
    return 0;
}

static void describe_cluster(const outbox__redis_url *u, char *buf, size_t len)
{
    const outbox__redis_seeds *s = u->cluster;
    int auth = u->user || u->password;
    snprintf(buf, len, "%s://%s%s%s", u->tls ? "rediss-cluster" : "redis-cluster", u->user ? u->user : "",
             u->password ? ":***" : "", auth ? "@" : "");
    describe_hosts(buf, len, s->hosts, s->ports, s->n);
}

static int copy_sentinels(outbox__redis_sentinels **dst, const outbox__redis_sentinels *src)
{
    outbox__redis_sentinels *c;
    *dst = NULL;
    if (!src)
        return 0;
    if (!(c = calloc(1, sizeof *c)) || copy_hosts(&c->hosts, &c->ports, &c->n, src->hosts, src->ports, src->n) ||
        dup_or_null(&c->master, src->master) || dup_or_null(&c->user, src->user) ||
        dup_or_null(&c->password, src->password)) {
        sentinels_free(c);
        return OUTBOX_ENOMEM;
    }
    *dst = c;
    return 0;
}

static void describe_sentinels(const outbox__redis_url *u, char *buf, size_t len)
{
    const outbox__redis_sentinels *s = u->sentinel;
    size_t used;
    int auth = u->user || u->password;
    snprintf(buf, len, "%s://%s%s%s", u->tls ? "rediss-sentinel" : "redis-sentinel", u->user ? u->user : "",
             u->password ? ":***" : "", auth ? "@" : "");
    describe_hosts(buf, len, s->hosts, s->ports, s->n);
    used = strlen(buf);
    snprintf(buf + used, len - used, "/%d#%s", u->db, s->master);
}

int outbox__redis_url_parse(const char *url, outbox__redis_url *out, char *err, size_t errlen)
{
    url_parser p;
    const char *sep;
    size_t slen;

    memset(&p, 0, sizeof p);
    p.err = err;
    p.errlen = errlen;
    if (err && errlen > 0)
        err[0] = '\0';
    if (!out)
        return OUTBOX_EINVAL;
    memset(out, 0, sizeof *out);

    if (!url || !*url) {
        fail(&p, OUTBOX_EURL, "empty URL");
        return p.status;
    }
    sep = strstr(url, "://");
    if (!sep) {
        fail(&p, OUTBOX_EURL, "missing scheme in '%s', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://", url);
        return p.status;
    }
    slen = (size_t)(sep - url);
    if (slen == 5 && strncasecmp(url, "redis", 5) == 0) {
        parse_tcp(&p, sep + 3);
    } else if (slen == 6 && strncasecmp(url, "rediss", 6) == 0) {
        p.u.tls = 1;
        parse_tcp(&p, sep + 3);
    } else if ((slen == 4 && strncasecmp(url, "unix", 4) == 0) ||
               (slen == 10 && strncasecmp(url, "redis+unix", 10) == 0)) {
        parse_unix(&p, sep + 3);
    } else if (slen == 14 && strncasecmp(url, "redis-sentinel", 14) == 0) {
        parse_sentinel(&p, sep + 3, 0);
    } else if (slen == 15 && strncasecmp(url, "rediss-sentinel", 15) == 0) {
        parse_sentinel(&p, sep + 3, 1);
    } else if (slen == 13 && strncasecmp(url, "redis-cluster", 13) == 0) {
        parse_cluster(&p, sep + 3, 0);
    } else if (slen == 14 && strncasecmp(url, "rediss-cluster", 14) == 0) {
        parse_cluster(&p, sep + 3, 1);
    } else if ((slen == 11 && strncasecmp(url, "rediss+unix", 11) == 0)) {
        fail(&p, OUTBOX_EURL, "TLS over a unix socket (rediss+unix://) is not supported, expected unix://");
    } else {
        fail(&p, OUTBOX_EURL, "bad scheme '%.*s', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://", (int)slen, url);
    }

    if (p.status) {
        outbox__redis_url_free(&p.u);
        return p.status;
    }
    *out = p.u;
    return 0;
}

static int dup_or_null(char **dst, const char *src)
{
    *dst = NULL;
    if (src && !(*dst = strdup(src)))
        return OUTBOX_ENOMEM;
    return 0;
}

int outbox__redis_url_copy(outbox__redis_url *dst, const outbox__redis_url *src)
{
    outbox__redis_url c;
    if (!dst || !src)
        return OUTBOX_EINVAL;
    memset(&c, 0, sizeof c);
    c.port = src->port;
    c.db = src->db;
    c.tls = src->tls;
    if (dup_or_null(&c.host, src->host) || dup_or_null(&c.path, src->path) ||
        dup_or_null(&c.user, src->user) || dup_or_null(&c.password, src->password) ||
        copy_sentinels(&c.sentinel, src->sentinel) || copy_seeds(&c.cluster, src->cluster)) {
        outbox__redis_url_free(&c);
        memset(dst, 0, sizeof *dst);
        return OUTBOX_ENOMEM;
    }
    *dst = c;
    return 0;
}

void outbox__redis_url_free(outbox__redis_url *u)
{
    if (!u)
        return;
    free(u->host);
    free(u->path);
    free(u->user);
    free(u->password);
    sentinels_free(u->sentinel);
    seeds_free(u->cluster);
    memset(u, 0, sizeof *u);
}

void outbox__redis_url_describe(const outbox__redis_url *u, char *buf, size_t len)
{
    if (!buf || len == 0)
        return;
    if (!u) {
        snprintf(buf, len, "(none)");
        return;
    }
    if (u->sentinel) {
        describe_sentinels(u, buf, len);
        return;
    }
    if (u->cluster) {
        describe_cluster(u, buf, len);
        return;
    }
    if (u->path) {
        snprintf(buf, len, "unix://%s?db=%d%s%s%s", u->path, u->db, u->user ? "&user=" : "",
                 u->user ? u->user : "", u->password ? "&password=***" : "");
        return;
    }
    {
        const char *host = u->host ? u->host : "";
        int v6 = strchr(host, ':') != NULL;
        int auth = u->user || u->password;
        snprintf(buf, len, "%s://%s%s%s%s%s%s:%d/%d", u->tls ? "rediss" : "redis", u->user ? u->user : "",
                 u->password ? ":***" : "", auth ? "@" : "", v6 ? "[" : "", host, v6 ? "]" : "",
                 u->port, u->db);
    }
}
