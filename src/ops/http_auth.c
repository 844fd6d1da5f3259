/*
 * http_auth.c: Basic authentication for the HTTP server (http_int.h).
 *
 * A bcrypt check costs tens to hundreds of milliseconds of CPU (about
 * 50-250 ms at cost 10), so it never runs on the loop thread: it is a libuv
 * work request, and only one runs at a time, so that a client sending
 * wrong passwords occupies at most one of the thread pool's threads (the
 * relay's own database work runs there too). At most QUEUE_MAX requests
 * wait for a check (the one being checked included); more are answered
 * 503. Each result, success or
 * failure, is kept in a cache of OUTBOX__HTTP_AUTH_CACHE entries keyed by
 * an HMAC-SHA256 of the whole Authorization value under a key drawn at
 * start, so that a scrape every few seconds costs one check, not one per
 * scrape, and a password sent again and again is checked once. Requests
 * waiting with the value being checked are all answered by that one check.
 * An unknown user's password is checked against a decoy hash of the users'
 * largest cost (web_config.h), so that timing does not tell which users
 * exist.
 */
#include <crypt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "ops/http_int.h"

#define QUEUE_MAX 16

typedef struct http_auth_job {
    uv_work_t work;
    outbox__http *h;
    unsigned char key[32];
    const char *hash; /* the user's (the web configuration outlives the job), or the decoy */
    int known, ok;
    char pass[OUTBOX_HTTP_AUTH_MAX];
    struct crypt_data cd;
} http_auth_job;

void outbox__http_auth_init(outbox__http *h)
{
    if (RAND_bytes(h->auth.hmac_key, sizeof h->auth.hmac_key) != 1) {
        /* Still unpredictable enough for a cache key's HMAC. */
        for (size_t i = 0; i < sizeof h->auth.hmac_key; i += 8) {
            uint64_t r = outbox__rand64();
            memcpy(h->auth.hmac_key + i, &r, 8);
        }
    }
}

int outbox__http_auth_busy(const outbox__http *h)
{
    return h->auth.running != NULL;
}

static http_auth_entry *cache_find(http_auth *a, const unsigned char *key)
{
    for (size_t i = 0; i < OUTBOX__HTTP_AUTH_CACHE; i++)
        if (a->cache[i].used && memcmp(a->cache[i].key, key, 32) == 0) {
            a->cache[i].stamp = ++a->clock;
            return &a->cache[i];
        }
    return NULL;
}

static void cache_put(http_auth *a, const unsigned char *key, int ok)
{
    http_auth_entry *e = &a->cache[0];
    for (size_t i = 0; i < OUTBOX__HTTP_AUTH_CACHE; i++) {
        if (!a->cache[i].used) {
            e = &a->cache[i];
            break;
        }
        if (a->cache[i].stamp < e->stamp)
            e = &a->cache[i];
    }
    memcpy(e->key, key, 32);
    e->used = 1;
    e->ok = ok;
    e->stamp = ++a->clock;
}

static int b64val(unsigned char ch)
{
    if (ch >= 'A' && ch <= 'Z')
        return ch - 'A';
    if (ch >= 'a' && ch <= 'z')
        return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9')
        return ch - '0' + 52;
    if (ch == '+')
        return 62;
    if (ch == '/')
        return 63;
    return -1;
}

/* Standard base64, the padding optional. Returns the length, or -1. */
static long b64_decode(const char *in, size_t n, char *out, size_t cap)
{
    unsigned acc = 0;
    int bits = 0;
    size_t len = 0, i;
    while (n > 0 && in[n - 1] == '=')
        n--;
    for (i = 0; i < n; i++) {
        int v = b64val((unsigned char)in[i]);
        if (v < 0)
            return -1;
        acc = (acc << 6) | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            if (len == cap)
                return -1;
            out[len++] = (char)((acc >> bits) & 0xff);
        }
    }
    return (long)len;
}

/* "Basic <base64 of user:password>" (RFC 7617): the user and the password,
 * or 0 when the value is not that. */
static int basic_credentials(const outbox__http_head *hd, char *buf, size_t cap, const char **user, size_t *ulen,
                             const char **pass)
{
    const char *v = hd->auth, *colon;
    long n;
    if (strncasecmp(v, "Basic ", 6) != 0)
        return 0;
    v += 6;
    while (*v == ' ')
        v++;
    n = b64_decode(v, strcspn(v, " \t"), buf, cap - 1);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    if (strlen(buf) != (size_t)n || !(colon = strchr(buf, ':')))
        return 0;
    *user = buf;
    *ulen = (size_t)(colon - buf);
    *pass = colon + 1;
    return 1;
}

static void dequeue(http_auth *a, struct outbox__http_req *c)
{
    struct outbox__http_req **pp, *prev = NULL;
    for (pp = &a->queue; *pp; prev = *pp, pp = &(*pp)->auth_next)
        if (*pp == c) {
            *pp = c->auth_next;
            if (a->queue_tail == c)
                a->queue_tail = prev;
            c->auth_next = NULL;
            a->queued--;
            return;
        }
}

void outbox__http_auth_forget(struct outbox__http_req *c)
{
    dequeue(&c->srv->auth, c);
}

static void denied(struct outbox__http_req *c, const char *why)
{
    outbox__http *h = c->srv;
    h->auth.failed_since_warn++;
    if (outbox__http_warn_due(h, &h->auth.last_warn_ms)) {
        outbox__log(h->log, OUTBOX_LOG_WARN,
                    "msg=\"metrics endpoint: authentication failed\" reason=\"%s\" failures=%u", why,
                    h->auth.failed_since_warn);
        h->auth.failed_since_warn = 0;
    }
    outbox__http_conn_error(c, 401, why);
}

static void resolve(struct outbox__http_req *c, int ok)
{
    if (ok)
        outbox__http_conn_dispatch(c);
    else
        denied(c, "wrong user name or password");
}

static void job_run(uv_work_t *w)
{
    http_auth_job *j = w->data;
    /* crypt_rn rather than crypt_r: the same hashing, NULL on failure
     * instead of a "*" string, and not intercepted by AddressSanitizer,
     * whose crypt_r wrapper finds no libxcrypt function behind it. */
    const char *r = crypt_rn(j->pass, j->hash, &j->cd, (int)sizeof j->cd);
    size_t n = strlen(j->hash);
    j->ok = j->known && r && r[0] != '*' && strlen(r) == n && CRYPTO_memcmp(r, j->hash, n) == 0;
    OPENSSL_cleanse(j->pass, sizeof j->pass);
    OPENSSL_cleanse(&j->cd, sizeof j->cd);
}

static void pump(outbox__http *h);

static void job_done(uv_work_t *w, int status)
{
    http_auth_job *j = w->data;
    outbox__http *h = j->h;
    http_auth *a = &h->auth;
    struct outbox__http_req *c, *next;
    a->running = NULL;
    if (status == 0)
        cache_put(a, j->key, j->ok);
    for (c = a->queue; c; c = next) {
        next = c->auth_next;
        if (memcmp(c->auth_key, j->key, 32) != 0)
            continue;
        dequeue(a, c);
        if (status == 0)
            resolve(c, j->ok);
        else
            outbox__http_conn_error(c, 503, "the password check could not run");
    }
    free(j);
    if (h->closing)
        outbox__http_srv_maybe_free(h);
    else
        pump(h);
}

/* Starts the next check if none runs; answers from the cache the requests
 * that a finished check decided meanwhile. */
static void pump(outbox__http *h)
{
    http_auth *a = &h->auth;
    while (!a->running && a->queue) {
        struct outbox__http_req *c = a->queue;
        const outbox__web_user *u;
        http_auth_entry *e = cache_find(a, c->auth_key);
        http_auth_job *j;
        const char *user, *pass;
        size_t ulen;
        if (e) {
            dequeue(a, c);
            resolve(c, e->ok);
            continue;
        }
        if (!(j = calloc(1, sizeof *j))) {
            dequeue(a, c);
            outbox__http_conn_error(c, 503, "out of memory");
            continue;
        }
        /* The value was checked to be Basic credentials when it came. */
        if (!basic_credentials(&c->req, j->pass, sizeof j->pass, &user, &ulen, &pass)) {
            free(j);
            dequeue(a, c);
            denied(c, "malformed Basic credentials");
            continue;
        }
        u = outbox__web_config_user(h->web, user, ulen);
        /* Only the password goes to the worker thread. */
        memmove(j->pass, pass, strlen(pass) + 1);
        j->h = h;
        j->known = u != NULL;
        j->hash = u ? u->hash : h->web->decoy;
        memcpy(j->key, c->auth_key, 32);
        j->work.data = j;
        if (uv_queue_work(h->loop, &j->work, job_run, job_done) != 0) {
            OPENSSL_cleanse(j->pass, sizeof j->pass);
            free(j);
            dequeue(a, c);
            outbox__http_conn_error(c, 503, "the password check could not start");
            continue;
        }
        a->running = j;
    }
}

void outbox__http_auth_request(struct outbox__http_req *c)
{
    outbox__http *h = c->srv;
    http_auth *a = &h->auth;
    http_auth_entry *e;
    char buf[OUTBOX_HTTP_AUTH_MAX];
    const char *user, *pass;
    size_t ulen;
    unsigned int mdlen = 0;

    if (!c->req.auth_count) {
        outbox__http_conn_error(c, 401, "authentication required");
        return;
    }
    if (!basic_credentials(&c->req, buf, sizeof buf, &user, &ulen, &pass)) {
        OPENSSL_cleanse(buf, sizeof buf);
        denied(c, "malformed Basic credentials");
        return;
    }
    OPENSSL_cleanse(buf, sizeof buf);
    if (!HMAC(EVP_sha256(), a->hmac_key, sizeof a->hmac_key, (const unsigned char *)c->req.auth, c->req.auth_len,
              c->auth_key, &mdlen) ||
        mdlen != 32) {
        outbox__http_conn_error(c, 500, "cannot check the credentials");
        return;
    }
    if ((e = cache_find(a, c->auth_key)) != NULL) {
        resolve(c, e->ok);
        return;
    }
    if (a->queued >= QUEUE_MAX) {
        outbox__http_conn_error(c, 503, "too many password checks waiting; try again");
        return;
    }
    outbox__http_conn_phase(c, CONN_AUTH);
    c->auth_next = NULL;
    if (a->queue_tail)
        a->queue_tail->auth_next = c;
    else
        a->queue = c;
    a->queue_tail = c;
    a->queued++;
    pump(h);
}
