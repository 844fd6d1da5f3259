/*
 * test_redis_url.c: the Redis URL parser, copy and describe.
 */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "redis/redis.h"
#include "redis/sentinel.h"
#include "tap.h"

typedef struct accept_case {
    const char *url;
    const char *host, *path, *user, *password;
    int port, db;
} accept_case;

static const accept_case accepted[] = {
    /* TCP: host forms and defaults */
    {"redis://localhost", "localhost", NULL, NULL, NULL, 6379, 0},
    {"redis://localhost/", "localhost", NULL, NULL, NULL, 6379, 0},
    {"redis://localhost:6380", "localhost", NULL, NULL, NULL, 6380, 0},
    {"redis://127.0.0.1:1/0", "127.0.0.1", NULL, NULL, NULL, 1, 0},
    {"redis://10.1.2.3:65535/15", "10.1.2.3", NULL, NULL, NULL, 65535, 15},
    {"redis://my-host_1.example.com/7", "my-host_1.example.com", NULL, NULL, NULL, 6379, 7},
    {"redis://[::1]", "::1", NULL, NULL, NULL, 6379, 0},
    {"redis://[::1]:7000/2", "::1", NULL, NULL, NULL, 7000, 2},
    {"redis://[2001:db8::8a2e:370:7334]:6379", "2001:db8::8a2e:370:7334", NULL, NULL, NULL, 6379, 0},
    {"redis://[::ffff:192.0.2.1]/1", "::ffff:192.0.2.1", NULL, NULL, NULL, 6379, 1},
    {"REDIS://Host:6379/3", "Host", NULL, NULL, NULL, 6379, 3},
    /* databases: above 15 is for the server to refuse, the URL allows any int */
    {"redis://h/16", "h", NULL, NULL, NULL, 6379, 16},
    {"redis://h/2147483647", "h", NULL, NULL, NULL, 6379, 2147483647},
    {"redis://h/007", "h", NULL, NULL, NULL, 6379, 7},
    /* credentials */
    {"redis://:s3cret@h", "h", NULL, NULL, "s3cret", 6379, 0},
    {"redis://alice:pw@h:6390/4", "h", NULL, "alice", "pw", 6390, 4},
    {"redis://s3cret@h", "h", NULL, NULL, "s3cret", 6379, 0}, /* redis-cli reading */
    {"redis://alice:@h", "h", NULL, "alice", "", 6379, 0},
    {"redis://:@h", "h", NULL, NULL, NULL, 6379, 0},
    {"redis://@h", "h", NULL, NULL, NULL, 6379, 0},
    {"redis://:p%40ss%3Aword@h", "h", NULL, NULL, "p@ss:word", 6379, 0},
    {"redis://a%3Ab:c%25d@h", "h", NULL, "a:b", "c%d", 6379, 0},
    {"redis://u:pa:ss@h", "h", NULL, "u", "pa:ss", 6379, 0},
    {"redis://:p@ss@h/2", "h", NULL, NULL, "p@ss", 6379, 2}, /* the last '@' ends the userinfo */
    {"redis://:a/b?c@h", "h", NULL, NULL, "a/b?c", 6379, 0},
    {"redis://alice:pw@[::1]:6380/3", "::1", NULL, "alice", "pw", 6380, 3},
    /* TLS: the same grammar as redis:// (tls is expected for every rediss:// case) */
    {"rediss://localhost", "localhost", NULL, NULL, NULL, 6379, 0},
    {"rediss://127.0.0.1:6380/2", "127.0.0.1", NULL, NULL, NULL, 6380, 2},
    {"REDISS://Host", "Host", NULL, NULL, NULL, 6379, 0},
    {"rediss://alice:p%40w@redis.example.com:6390/4", "redis.example.com", NULL, "alice", "p@w", 6390, 4},
    {"rediss://:s3cret@[::1]:7000", "::1", NULL, NULL, "s3cret", 7000, 0},
    {"rediss://h/", "h", NULL, NULL, NULL, 6379, 0},
    /* Unix sockets */
    {"unix:///tmp/redis.sock", NULL, "/tmp/redis.sock", NULL, NULL, 0, 0},
    {"unix:///tmp/redis.sock?db=3", NULL, "/tmp/redis.sock", NULL, NULL, 0, 3},
    {"redis+unix:///var/run/r.sock?db=1", NULL, "/var/run/r.sock", NULL, NULL, 0, 1},
    {"UNIX:///s", NULL, "/s", NULL, NULL, 0, 0},
    {"unix:///s?password=p%40w", NULL, "/s", NULL, "p@w", 0, 0},
    {"unix:///s?user=alice&password=pw&db=2", NULL, "/s", "alice", "pw", 0, 2},
    {"unix:///s?db=2&db=5", NULL, "/s", NULL, NULL, 0, 5}, /* the last one wins */
    {"unix:///s?", NULL, "/s", NULL, NULL, 0, 0},
    {"unix:///s?&db=1&", NULL, "/s", NULL, NULL, 0, 1},
    {"unix:///a/b@c:d", NULL, "/a/b@c:d", NULL, NULL, 0, 0},
};

typedef struct reject_case {
    const char *url;
    const char *message;
} reject_case;

static const reject_case rejected[] = {
    {"", "empty URL"},
    {"localhost:6379", "missing scheme in 'localhost:6379', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"http://localhost", "bad scheme 'http', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"redis:/localhost", "missing scheme in 'redis:/localhost', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"://h", "bad scheme '', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    /* TLS URLs: the TCP grammar's errors, and no TLS over a Unix socket */
    {"redis+tls://h", "bad scheme 'redis+tls', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"redisss://h", "bad scheme 'redisss', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"tls://h", "bad scheme 'tls', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"rediss:/h", "missing scheme in 'rediss:/h', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"rediss://", "empty host"},
    {"rediss://:6379", "empty host"},
    {"rediss://h:0", "port 0 out of range 1..65535"},
    {"rediss://h:65536", "port 65536 out of range 1..65535"},
    {"rediss://h:tls", "port 'tls' is not a number"},
    {"rediss://h/x", "database 'x' is not a number"},
    {"rediss://[::1", "unterminated '[' in IPv6 address"},
    {"rediss://:p%zz@h", "bad percent-encoding in password"},
    {"rediss+unix:///tmp/r.sock", "TLS over a unix socket (rediss+unix://) is not supported, expected unix://"},
    /* host */
    {"redis://", "empty host"},
    {"redis://:6379", "empty host"},
    {"redis:///0", "empty host"},
    {"redis://u:p@", "empty host"},
    {"redis://u:p@:6379/1", "empty host"},
    {"redis://[]:6379", "empty host"},
    {"redis://[::1", "unterminated '[' in IPv6 address"},
    {"redis://[::1:6379/0", "unterminated '[' in IPv6 address"},
    {"redis://[not-v6]", "invalid IPv6 address 'not-v6'"},
    {"redis://[1.2.3.4]", "invalid IPv6 address '1.2.3.4'"},
    {"redis://[::1]x", "unexpected 'x' after host"},
    {"redis://ho st", "invalid character ' ' in host"},
    {"redis://host!", "invalid character '!' in host"},
    {"redis://host?db=1", "unexpected '?db=1' after host"},
    {"redis://host#frag", "unexpected '#frag' after host"},
    /* port */
    {"redis://h:", "port '' is not a number"},
    {"redis://h:/1", "port '' is not a number"},
    {"redis://h:abc", "port 'abc' is not a number"},
    {"redis://h:-1", "port '-1' is not a number"},
    {"redis://h:+80", "port '+80' is not a number"},
    {"redis://h:63 79", "port '63 79' is not a number"},
    {"redis://h:6379x", "port '6379x' is not a number"},
    {"redis://h:6379?db=1", "port '6379?db=1' is not a number"},
    {"redis://h:0", "port 0 out of range 1..65535"},
    {"redis://h:65536", "port 65536 out of range 1..65535"},
    {"redis://h:99999", "port 99999 out of range 1..65535"},
    {"redis://h:99999999999999999999999", "port 99999999999999999999999 out of range 1..65535"},
    /* database */
    {"redis://h/x", "database 'x' is not a number"},
    {"redis://h/1x", "database '1x' is not a number"},
    {"redis://h/1/2", "database '1/2' is not a number"},
    {"redis://h/ 1", "database ' 1' is not a number"},
    {"redis://h/+1", "database '+1' is not a number"},
    {"redis://h/-", "database '-' is not a number"},
    {"redis://h/-1", "database -1 out of range 0..2147483647"},
    {"redis://h/2147483648", "database 2147483648 out of range 0..2147483647"},
    {"redis://h/99999999999999999999", "database 99999999999999999999 out of range 0..2147483647"},
    {"redis://h/0?x", "database '0?x' is not a number"},
    {"redis://h:6379/0#f", "database '0#f' is not a number"},
    /* percent-encoding */
    {"redis://:p%4@h", "bad percent-encoding in password"},
    {"redis://:p%@h", "bad percent-encoding in password"},
    {"redis://:p%zz@h", "bad percent-encoding in password"},
    {"redis://:p%00@h", "%00 (NUL byte) in password"},
    {"redis://a%g1:p@h", "bad percent-encoding in user name"},
    /* Unix sockets */
    {"unix://", "empty unix socket path"},
    {"unix://?db=1", "empty unix socket path"},
    {"redis+unix://", "empty unix socket path"},
    {"unix://tmp/redis.sock", "unix socket path 'tmp/redis.sock' is not absolute"},
    {"unix://./redis.sock", "unix socket path './redis.sock' is not absolute"},
    {"unix://:pw@/tmp/s", "unix socket path ':pw@/tmp/s' is not absolute"},
    {"unix:///s?db=x", "database 'x' is not a number"},
    {"unix:///s?db=-3", "database -3 out of range 0..2147483647"},
    {"unix:///s?db=", "database '' is not a number"},
    {"unix:///s?db", "query parameter 'db' has no value"},
    {"unix:///s?timeout=5", "unknown query parameter 'timeout'"},
    {"unix:///s?password=%zz", "bad percent-encoding in password"},
};

/* Sentinel URLs: the sentinels as "host:port,...", the master, and the data
 * nodes' credentials and db. */
typedef struct sentinel_case {
    const char *url;
    const char *sentinels, *master, *user, *password;
    int db;
} sentinel_case;

static const sentinel_case sentinel_accepted[] = {
    {"redis-sentinel://h#mymaster", "h:26379", "mymaster", NULL, NULL, 0},
    {"redis-sentinel://h:5000#m", "h:5000", "m", NULL, NULL, 0},
    {"redis-sentinel://a:1,b:2,c#m", "a:1,b:2,c:26379", "m", NULL, NULL, 0},
    {"redis-sentinel://127.0.0.1:26379,127.0.0.1:26380/3#mymaster", "127.0.0.1:26379,127.0.0.1:26380", "mymaster",
     NULL, NULL, 3},
    {"redis-sentinel://[::1]:26379,[::1]#m", "::1:26379,::1:26379", "m", NULL, NULL, 0},
    {"redis-sentinel://:s3cret@h1,h2#m", "h1:26379,h2:26379", "m", NULL, "s3cret", 0},
    {"redis-sentinel://alice:p%40ss@h/2#m", "h:26379", "m", "alice", "p@ss", 2},
    {"redis-sentinel://:p#w@h#m", "h:26379", "m", NULL, "p#w", 0}, /* the last '@' ends the userinfo */
    {"redis-sentinel://h/#m", "h:26379", "m", NULL, NULL, 0},
    {"redis-sentinel://h#my%2Dmaster", "h:26379", "my-master", NULL, NULL, 0},
    {"REDIS-SENTINEL://H#M", "H:26379", "M", NULL, NULL, 0},
};

static const reject_case sentinel_rejected[] = {
    {"redis-sentinel://h", "missing master name: expected redis-sentinel://host:26379[,host...]#master-name"},
    {"redis-sentinel://h#", "missing master name: expected redis-sentinel://host:26379[,host...]#master-name"},
    {"redis-sentinel://u:p@h/0", "missing master name: expected redis-sentinel://host:26379[,host...]#master-name"},
    {"redis-sentinel://#m", "empty sentinel list"},
    {"redis-sentinel://u:p@#m", "empty sentinel list"},
    {"redis-sentinel:///1#m", "empty sentinel list"},
    {"redis-sentinel://a,,b#m", "empty host in the sentinel list"},
    {"redis-sentinel://a,#m", "empty host in the sentinel list"},
    {"redis-sentinel://,a#m", "empty host in the sentinel list"},
    {"redis-sentinel://h:0#m", "port 0 out of range 1..65535"},
    {"redis-sentinel://a:1,h:99999#m", "port 99999 out of range 1..65535"},
    {"redis-sentinel://h:x#m", "port 'x' is not a number"},
    {"redis-sentinel://h:#m", "port '' is not a number"},
    {"redis-sentinel://h/x#m", "database 'x' is not a number"},
    {"redis-sentinel://h/-1#m", "database -1 out of range 0..2147483647"},
    {"redis-sentinel://h!#m", "invalid character '!' in host"},
    {"redis-sentinel://[::1#m", "unterminated '[' in IPv6 address"},
    {"redis-sentinel://h?x=1#m", "unexpected '?x=1' after host"},
    {"redis-sentinel://h#my master", "invalid character in master name 'my master'"},
    {"redis-sentinel://h#m%zz", "bad percent-encoding in master name"},
    {"redis-sentinel://:p%zz@h#m", "bad percent-encoding in password"},
    {"rediss-sentinel://h", "missing master name: expected rediss-sentinel://host:26379[,host...]#master-name"},
    {"redis-sentinels://h#m", "bad scheme 'redis-sentinels', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    {"sentinel://h#m", "bad scheme 'sentinel', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
};

static void check_rejected(const reject_case *c);
static void describe(const char *url, const char *want);

static void check_sentinel_accepted(const sentinel_case *c)
{
    outbox__redis_url u, copy;
    char err[256], list[512] = "";
    int rc = outbox__redis_url_parse(c->url, &u, err, sizeof err);
    is_int(rc, 0, "accept %s", c->url);
    if (rc != 0) {
        diag("error: %s", err);
        return;
    }
    ok(u.sentinel != NULL && !u.host && !u.path, "  a sentinel list, no node yet");
    if (!u.sentinel) {
        outbox__redis_url_free(&u);
        return;
    }
    for (size_t i = 0; i < u.sentinel->n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s:%d", i ? "," : "", u.sentinel->hosts[i],
                 u.sentinel->ports[i]);
    is_str(list, c->sentinels, "  sentinels");
    is_str(u.sentinel->master, c->master, "  master name");
    is_str(u.user, c->user, "  data nodes' user");
    is_str(u.password, c->password, "  data nodes' password");
    is_int(u.db, c->db, "  db");
    ok(!u.sentinel->user && !u.sentinel->password && !u.tls, "  no sentinel credentials, no TLS");
    is_int(outbox__redis_url_copy(&copy, &u), 0, "  copy");
    ok(copy.sentinel && copy.sentinel != u.sentinel && copy.sentinel->n == u.sentinel->n &&
           strcmp(copy.sentinel->master, u.sentinel->master) == 0 &&
           copy.sentinel->ports[copy.sentinel->n - 1] == u.sentinel->ports[u.sentinel->n - 1],
       "  the copy is deep");
    outbox__redis_url_free(&copy);
    outbox__redis_url_free(&u);
}

static void test_sentinel_tls(void)
{
    outbox__redis_url u;
    char err[256];
    is_int(outbox__redis_url_parse("rediss-sentinel://:pw@a,b:5/1#m", &u, err, sizeof err), 0, "accept rediss-sentinel://");
    ok(u.tls && u.sentinel && u.sentinel->n == 2 && u.sentinel->ports[1] == 5, "  TLS, two sentinels");
    is_str(u.password, "pw", "  data nodes' password");
    outbox__redis_url_free(&u);
    describe("rediss-sentinel://a#m", "rediss-sentinel://a:26379/0#m");
}

static void test_sentinel_describe(void)
{
    describe("redis-sentinel://a:1,b#m", "redis-sentinel://a:1,b:26379/0#m");
    describe("redis-sentinel://alice:topsecret@[::1]:5,h/3#mymaster", "redis-sentinel://alice:***@[::1]:5,h:26379/3#mymaster");
}

static void test_sentinel_credentials(void)
{
    outbox__redis_url u;
    char err[256];
    is_int(outbox__sentinel_url_parse("redis-sentinel://h#m", "sam", "pw", &u, err, sizeof err), 0,
           "sentinel credentials with a Sentinel URL");
    is_str(u.sentinel->user, "sam", "  sentinel user");
    is_str(u.sentinel->password, "pw", "  sentinel password");
    ok(!u.user && !u.password, "  the data nodes' stay unset");
    outbox__redis_url_free(&u);
    is_int(outbox__sentinel_url_parse("redis://h", NULL, "pw", &u, err, sizeof err), OUTBOX_EINVAL,
           "sentinel password with a redis:// URL");
    is_str(err, "sentinel_password needs a redis-sentinel:// URL", "  message");
    is_int(outbox__sentinel_url_parse("unix:///s", "sam", NULL, &u, err, sizeof err), OUTBOX_EINVAL,
           "sentinel user with a unix:// URL");
    is_str(err, "sentinel_user needs a redis-sentinel:// URL", "  message");
    is_int(outbox__sentinel_url_parse("redis://h", NULL, NULL, &u, err, sizeof err), 0, "no sentinel credentials: any URL");
    outbox__redis_url_free(&u);
}

static void check_accepted(const accept_case *c)
{
    outbox__redis_url u;
    char err[256];
    int rc;
    memset(err, 'x', sizeof err);
    rc = outbox__redis_url_parse(c->url, &u, err, sizeof err);
    is_int(rc, 0, "accept %s", c->url);
    if (rc != 0) {
        diag("error: %s", err);
        return;
    }
    is_str(err, "", "  no error message");
    is_str(u.host, c->host, "  host");
    is_str(u.path, c->path, "  path");
    is_str(u.user, c->user, "  user");
    is_str(u.password, c->password, "  password");
    is_int(u.port, c->port, "  port");
    is_int(u.db, c->db, "  db");
    is_int(u.tls, strncasecmp(c->url, "rediss://", 9) == 0, "  tls");
    outbox__redis_url_free(&u);
}

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    size_t i;
    for (i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static void check_rejected(const reject_case *c)
{
    outbox__redis_url u;
    char err[256];
    memset(&u, 0x5a, sizeof u);
    is_int(outbox__redis_url_parse(c->url, &u, err, sizeof err), OUTBOX_EURL, "reject '%s'", c->url);
    is_str(err, c->message, "  message");
    ok(all_zero(&u, sizeof u), "  result left zeroed");
}

static void test_error_buffer(void)
{
    outbox__redis_url u;
    char small[8];
    is_int(outbox__redis_url_parse("http://x", &u, small, sizeof small), OUTBOX_EURL, "short error buffer");
    is_str(small, "bad sch", "  message truncated and NUL-terminated");
    is_int(outbox__redis_url_parse("http://x", &u, NULL, 0), OUTBOX_EURL, "no error buffer");
    is_int(outbox__redis_url_parse(NULL, &u, small, sizeof small), OUTBOX_EURL, "NULL URL");
    is_int(outbox__redis_url_parse("redis://h", NULL, small, sizeof small), OUTBOX_EINVAL, "NULL out");
}

static void test_unix_path_length(void)
{
    char url[300], err[128];
    outbox__redis_url u;
    /* sun_path holds 108 bytes with the NUL: 107 characters fit. */
    memset(url, 0, sizeof url);
    strcpy(url, "unix://");
    memset(url + 7, 'a', 107);
    url[7] = '/';
    is_int(outbox__redis_url_parse(url, &u, err, sizeof err), 0, "unix path of 107 bytes");
    is_int(strlen(u.path), 107, "  kept whole");
    outbox__redis_url_free(&u);
    url[7 + 107] = 'a';
    is_int(outbox__redis_url_parse(url, &u, err, sizeof err), OUTBOX_EURL, "unix path of 108 bytes");
    is_str(err, "unix socket path too long (108 bytes, at most 107)", "  message");
}

static void describe(const char *url, const char *want)
{
    outbox__redis_url u;
    char buf[256], err[128];
    if (outbox__redis_url_parse(url, &u, err, sizeof err) != 0) {
        ok(0, "describe %s: parse failed: %s", url, err);
        return;
    }
    outbox__redis_url_describe(&u, buf, sizeof buf);
    is_str(buf, want, "describe %s", url);
    ok(!u.password || !strstr(buf, u.password) || !*u.password, "  password not shown");
    outbox__redis_url_free(&u);
}

static void test_describe(void)
{
    char small[12], untouched[sizeof small];
    outbox__redis_url u;
    describe("redis://h", "redis://h:6379/0");
    describe("redis://alice:topsecret@h:6380/2", "redis://alice:***@h:6380/2");
    describe("redis://:topsecret@10.0.0.1", "redis://:***@10.0.0.1:6379/0");
    describe("redis://:p%40ss@h", "redis://:***@h:6379/0");
    describe("redis://[::1]:7000/1", "redis://[::1]:7000/1");
    describe("rediss://alice:topsecret@h:6380/2", "rediss://alice:***@h:6380/2");
    describe("rediss://[::1]", "rediss://[::1]:6379/0");
    describe("unix:///tmp/r.sock", "unix:///tmp/r.sock?db=0");
    describe("unix:///tmp/r.sock?db=4&password=topsecret", "unix:///tmp/r.sock?db=4&password=***");
    describe("unix:///tmp/r.sock?user=bob&password=topsecret", "unix:///tmp/r.sock?db=0&user=bob&password=***");

    outbox__redis_url_parse("redis://:topsecret@somewhere.example.com", &u, NULL, 0);
    outbox__redis_url_describe(&u, small, sizeof small);
    is_str(small, "redis://:**", "describe truncates to the buffer");
    memset(small, '#', sizeof small);
    memcpy(untouched, small, sizeof small);
    outbox__redis_url_describe(&u, small, 0);
    ok(memcmp(small, untouched, sizeof small) == 0, "describe into a zero-length buffer writes nothing");
    outbox__redis_url_free(&u);
    outbox__redis_url_describe(NULL, small, sizeof small);
    is_str(small, "(none)", "describe NULL");
}

static void test_copy_free(void)
{
    outbox__redis_url a, b;
    outbox__redis_url_parse("redis://alice:pw@h:6390/4", &a, NULL, 0);
    is_int(outbox__redis_url_copy(&b, &a), 0, "copy");
    ok(b.host != a.host && b.user != a.user && b.password != a.password, "  deep");
    is_str(b.host, "h", "  host");
    is_str(b.user, "alice", "  user");
    is_str(b.password, "pw", "  password");
    ok(b.path == NULL, "  path NULL");
    is_int(b.port, 6390, "  port");
    is_int(b.db, 4, "  db");
    outbox__redis_url_free(&a);
    ok(all_zero(&a, sizeof a), "free zeroes the struct");
    outbox__redis_url_free(&a); /* twice is fine */
    outbox__redis_url_free(NULL);
    ok(all_zero(&a, sizeof a) && outbox__redis_url_copy(&a, &b) == 0 && strcmp(a.host, "h") == 0,
       "free(NULL) and double free of a zeroed struct are no-ops: it stays zeroed and can be copied into");
    outbox__redis_url_free(&a);
    outbox__redis_url_free(&b);

    outbox__redis_url_parse("unix:///x/y?db=2", &a, NULL, 0);
    is_int(outbox__redis_url_copy(&b, &a), 0, "copy unix");
    is_str(b.path, "/x/y", "  path");
    ok(b.host == NULL && b.user == NULL && b.password == NULL, "  others NULL");
    outbox__redis_url_free(&a);
    outbox__redis_url_free(&b);

    outbox__redis_url_parse("rediss://h:6390", &a, NULL, 0);
    is_int(outbox__redis_url_copy(&b, &a), 0, "copy rediss");
    is_int(b.tls, 1, "  tls kept");
    is_int(b.port, 6390, "  port");
    outbox__redis_url_free(&a);
    outbox__redis_url_free(&b);
}

/* The WAIT count that covers a failover, from the replicas' priorities
 * (outbox__sentinel_wait_needed): one acknowledgement from the group
 * Sentinel promotes first, so n - group + 1. */
typedef struct wait_case {
    int prio[4];
    size_t n;
    unsigned need;
    size_t best;
} wait_case;

static const wait_case wait_cases[] = {
    {{100}, 1, 1, 1},
    {{100, 100}, 2, 1, 2},           /* equal: the most advanced is promoted */
    {{100, 200}, 2, 2, 1},           /* the preferred one may lag the other */
    {{200, 100, 100}, 3, 2, 2},
    {{100, 0}, 2, 2, 1},             /* a priority-0 replica acknowledges, never promoted */
    {{0, 0}, 2, 0, 0},               /* no failover at all */
    {{10, 20, 30, 40}, 4, 4, 1},
    {{0}, 0, 0, 0},
};

static void test_wait_needed(void)
{
    for (size_t i = 0; i < sizeof wait_cases / sizeof wait_cases[0]; i++) {
        const wait_case *c = &wait_cases[i];
        size_t best = 99;
        unsigned need = outbox__sentinel_wait_needed(c->prio, c->n, &best);
        is_int((long long)need, (long long)c->need, "wait needed for %zu replicas (%d %d ...): %u", c->n, c->prio[0],
               c->prio[1], c->need);
        is_int((long long)best, (long long)c->best, "  first in line: %zu", c->best);
    }
}

int main(void)
{
    size_t i;
    for (i = 0; i < sizeof accepted / sizeof accepted[0]; i++)
        check_accepted(&accepted[i]);
    for (i = 0; i < sizeof rejected / sizeof rejected[0]; i++)
        check_rejected(&rejected[i]);
    test_error_buffer();
    test_unix_path_length();
    test_describe();
    test_copy_free();
    for (i = 0; i < sizeof sentinel_accepted / sizeof sentinel_accepted[0]; i++)
        check_sentinel_accepted(&sentinel_accepted[i]);
    for (i = 0; i < sizeof sentinel_rejected / sizeof sentinel_rejected[0]; i++)
        check_rejected(&sentinel_rejected[i]);
    test_sentinel_describe();
    test_sentinel_tls();
    test_sentinel_credentials();
    test_wait_needed();
    return tap_done();
}
