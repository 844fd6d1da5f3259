/*
 * tls.c: OpenSSL client and server sessions over memory BIOs (see tls.h).
 *
 * The read BIO holds ciphertext that libuv delivered and OpenSSL has not
 * consumed yet; it is set to report "retry" when empty, so SSL_read and
 * SSL_do_handshake answer SSL_ERROR_WANT_READ instead of EOF and the
 * connection simply waits for the next read callback. The write BIO
 * collects every record OpenSSL produces (handshake messages, application
 * data, alerts) until the connection takes it for uv_write. A memory BIO
 * grows to the largest burst and keeps that capacity, and OpenSSL keeps its
 * record buffers (SSL_MODE_RELEASE_BUFFERS is not set), so steady traffic
 * allocates nothing.
 *
 * Renegotiation is refused (SSL_OP_NO_RENEGOTIATION): a server cannot make
 * SSL_write wait for input. A write that still cannot proceed keeps its
 * plaintext with the caller and is tried again after the next input
 * (SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER, since that buffer may move).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "util/util.h"
#include "tls/tls.h"
#include "util/array.h"

/* The longest server name, with its NUL. */
#define NAME_CAP 256

struct outbox__tls_config {
    atomic_int refs;
    SSL_CTX *ctx;
    char *server_name; /* NULL: the URL's host */
    int insecure;
    int server; /* made by outbox__tls_server_config_create */
};

struct outbox__tls {
    outbox__tls_config *cfg;
    SSL *ssl;
    BIO *rbio, *wbio; /* owned by ssl */
    size_t received;
    int cert_requested;
    char first[48]; /* the start of what the server sent, for "answered in plaintext" */
    char name[NAME_CAP]; /* the name verified, for messages */
    char errstr[512];
};

void outbox_tls_defaults(outbox_tls_settings *s)
{
    if (s)
        memset(s, 0, sizeof *s);
}

int outbox__tls_settings_given(const outbox_tls_settings *s)
{
    return s && (s->ca_file || s->ca_dir || s->cert_file || s->key_file || s->server_name || s->insecure);
}

/* OpenSSL's reason for the most recent error in this thread's queue, which
 * is then cleared. */
static const char *ossl_reason(char *buf, size_t len)
{
    unsigned long e = ERR_peek_last_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    if (r)
        snprintf(buf, len, "%s", r);
    else if (e)
        ERR_error_string_n(e, buf, len);
    else
        snprintf(buf, len, "unknown error");
    ERR_clear_error();
    return buf;
}

/* A key file with a passphrase would make OpenSSL prompt on the terminal:
 * refuse instead. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return -1;
}

/* The server sent a CertificateRequest and no certificate is configured
 * (OpenSSL only asks this callback then). Answering with none lets servers
 * for which a client certificate is optional go on. */
static int on_cert_request(SSL *ssl, X509 **x509, EVP_PKEY **pkey)
{
    outbox__tls *t = SSL_get_app_data(ssl);
    (void)x509;
    (void)pkey;
    if (t)
        t->cert_requested = 1;
    return 0;
}

/* Checks that path names a readable regular file (or a directory when dir),
 * so that the message can say which and why. */
static int check_path(const char *what, const char *path, int dir, char *err, size_t errlen)
{
    struct stat st;
    FILE *f;
    if (!*path)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: empty path", what);
    if (stat(path, &st) != 0)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s '%s': %s", what, path, strerror(errno));
    if (dir) {
        if (!S_ISDIR(st.st_mode))
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s '%s': not a directory", what, path);
        return 0;
    }
    if (S_ISDIR(st.st_mode))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s '%s': is a directory", what, path);
    if (!(f = fopen(path, "r")))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s '%s': %s", what, path, strerror(errno));
    fclose(f);
    return 0;
}

static int load_trust(SSL_CTX *ctx, const outbox_tls_settings *s, char *err, size_t errlen)
{
    char why[256];
    int rc;
    if (!s->ca_file && !s->ca_dir) {
        if (SSL_CTX_set_default_verify_paths(ctx) != 1)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "cannot load the system's trust store: %s",
                                ossl_reason(why, sizeof why));
        return 0;
    }
    if (s->ca_file) {
        if ((rc = check_path("CA file", s->ca_file, 0, err, errlen)))
            return rc;
        if (SSL_CTX_load_verify_file(ctx, s->ca_file) != 1)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "CA file '%s' holds no usable PEM certificate (%s)",
                                s->ca_file, ossl_reason(why, sizeof why));
    }
    if (s->ca_dir) {
        if ((rc = check_path("CA directory", s->ca_dir, 1, err, errlen)))
            return rc;
        if (SSL_CTX_load_verify_dir(ctx, s->ca_dir) != 1)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "CA directory '%s' cannot be used (%s)", s->ca_dir,
                                ossl_reason(why, sizeof why));
    }
    return 0;
}

static int load_cert_and_key(SSL_CTX *ctx, const outbox_tls_settings *s, char *err, size_t errlen)
{
    char why[256];
    EVP_PKEY *key;
    FILE *f;
    int rc;
    if (!s->cert_file && !s->key_file)
        return 0;
    if (!s->cert_file || !s->key_file)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s given without %s: a client certificate needs both",
                            s->cert_file ? "certificate file" : "key file",
                            s->cert_file ? "a key file" : "a certificate file");
    if ((rc = check_path("certificate file", s->cert_file, 0, err, errlen)) ||
        (rc = check_path("key file", s->key_file, 0, err, errlen)))
        return rc;
    if (SSL_CTX_use_certificate_chain_file(ctx, s->cert_file) != 1)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "certificate file '%s' holds no usable PEM certificate (%s)",
                            s->cert_file, ossl_reason(why, sizeof why));
    /* The key is read here rather than by SSL_CTX_use_PrivateKey_file so
     * that "not a key" and "not this certificate's key" get their own
     * messages. */
    if (!(f = fopen(s->key_file, "r")))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "key file '%s': %s", s->key_file, strerror(errno));
    key = PEM_read_PrivateKey(f, NULL, no_passphrase, NULL);
    fclose(f);
    if (!key) {
        int reason = ERR_GET_REASON(ERR_peek_last_error());
        if (reason == PEM_R_BAD_PASSWORD_READ || reason == PEM_R_PROBLEMS_GETTING_PASSWORD) {
            ERR_clear_error();
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "key file '%s' is encrypted: a passphrase cannot be entered (decrypt it with "
                                "`openssl pkey`)",
                                s->key_file);
        }
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "key file '%s' holds no usable PEM private key (%s)",
                            s->key_file, ossl_reason(why, sizeof why));
    }
    rc = SSL_CTX_use_PrivateKey(ctx, key) == 1 && SSL_CTX_check_private_key(ctx) == 1;
    EVP_PKEY_free(key);
    if (!rc)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "key file '%s' does not match certificate file '%s' (%s)",
                            s->key_file, s->cert_file, ossl_reason(why, sizeof why));
    return 0;
}

int outbox__tls_config_create(outbox__tls_config **out, const outbox_tls_settings *s, char *err, size_t errlen)
{
    outbox_tls_settings defaults;
    outbox__tls_config *c;
    int rc;

    if (err && errlen)
        err[0] = '\0';
    if (!out)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!s) {
        outbox_tls_defaults(&defaults);
        s = &defaults;
    }
    if (s->server_name && (!*s->server_name || strlen(s->server_name) >= NAME_CAP))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "TLS server name: need 1..255 bytes");
    if (!(c = calloc(1, sizeof *c)))
        return OUTBOX_ENOMEM;
    atomic_init(&c->refs, 1);
    c->insecure = s->insecure != 0;
    if ((s->server_name && !(c->server_name = strdup(s->server_name))) ||
        !(c->ctx = SSL_CTX_new(TLS_client_method()))) {
        outbox__tls_config_unref(c);
        ERR_clear_error();
        return outbox__errf(err, errlen, OUTBOX_ENOMEM, "out of memory");
    }
    SSL_CTX_set_min_proto_version(c->ctx, TLS1_2_VERSION);
    SSL_CTX_set_options(c->ctx, SSL_OP_NO_RENEGOTIATION);
    SSL_CTX_set_mode(c->ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_default_passwd_cb(c->ctx, no_passphrase);
    SSL_CTX_set_client_cert_cb(c->ctx, on_cert_request);
    SSL_CTX_set_verify(c->ctx, c->insecure ? SSL_VERIFY_NONE : SSL_VERIFY_PEER, NULL);
    /* Even an insecure configuration loads the files it was given: a bad
     * file is a mistake worth reporting either way. */
    if ((rc = load_trust(c->ctx, s, err, errlen)) || (rc = load_cert_and_key(c->ctx, s, err, errlen))) {
        outbox__tls_config_unref(c);
        return rc;
    }
    *out = c;
    return 0;
}

/* RequestClientCert and RequireAnyClientCert ask for a certificate and take
 * whatever comes: a chain that does not verify is not a failure there. */
static int accept_any_cert(int ok, X509_STORE_CTX *x)
{
    (void)ok;
    (void)x;
    return 1;
}

static int load_client_cas(SSL_CTX *ctx, const char *file, char *err, size_t errlen)
{
    STACK_OF(X509_NAME) *names;
    char why[256];
    int rc;
    if ((rc = check_path("client CA file", file, 0, err, errlen)))
        return rc;
    /* The names go into the CertificateRequest, so that a client with
     * several certificates picks one these CAs signed. */
    if (SSL_CTX_load_verify_file(ctx, file) != 1 || !(names = SSL_load_client_CA_file(file)))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "client CA file '%s' holds no usable PEM certificate (%s)",
                            file, ossl_reason(why, sizeof why));
    SSL_CTX_set_client_CA_list(ctx, names);
    return 0;
}

int outbox__tls_server_config_create(outbox__tls_config **out, const outbox__tls_server_settings *s, char *err,
                                     size_t errlen)
{
    static const unsigned char sid_ctx[] = "outbox-http";
    outbox_tls_settings files;
    outbox__tls_config *c;
    int rc, mode = SSL_VERIFY_NONE;

    if (err && errlen)
        err[0] = '\0';
    if (!out || !s || !s->cert_file || !s->key_file)
        return OUTBOX_EINVAL;
    *out = NULL;
    if (!(c = calloc(1, sizeof *c)))
        return OUTBOX_ENOMEM;
    atomic_init(&c->refs, 1);
    c->server = 1;
    if (!(c->ctx = SSL_CTX_new(TLS_server_method()))) {
        outbox__tls_config_unref(c);
        ERR_clear_error();
        return outbox__errf(err, errlen, OUTBOX_ENOMEM, "out of memory");
    }
    SSL_CTX_set_min_proto_version(c->ctx, s->min_version == 13 ? TLS1_3_VERSION : TLS1_2_VERSION);
    SSL_CTX_set_max_proto_version(c->ctx, s->max_version == 12 ? TLS1_2_VERSION : TLS1_3_VERSION);
    /* A client may not renegotiate: each renegotiation is a handshake's CPU
     * on the loop thread at the client's will. */
    SSL_CTX_set_options(c->ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_mode(c->ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_default_passwd_cb(c->ctx, no_passphrase);
    /* Without a session id context OpenSSL refuses to resume a session in
     * which a client certificate was verified. */
    SSL_CTX_set_session_id_context(c->ctx, sid_ctx, sizeof sid_ctx - 1);
    outbox_tls_defaults(&files);
    files.cert_file = s->cert_file;
    files.key_file = s->key_file;
    if ((rc = load_cert_and_key(c->ctx, &files, err, errlen)) ||
        (s->client_ca_file && (rc = load_client_cas(c->ctx, s->client_ca_file, err, errlen)))) {
        outbox__tls_config_unref(c);
        return rc;
    }
    switch (s->client_auth) {
    case OUTBOX__TLS_NO_CLIENT_CERT:
        break;
    case OUTBOX__TLS_REQUEST_CLIENT_CERT:
        mode = SSL_VERIFY_PEER;
        break;
    case OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT:
        mode = SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT;
        break;
    case OUTBOX__TLS_VERIFY_CLIENT_CERT_IF_GIVEN:
        mode = SSL_VERIFY_PEER;
        break;
    case OUTBOX__TLS_REQUIRE_AND_VERIFY_CLIENT_CERT:
        mode = SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT;
        break;
    }
    SSL_CTX_set_verify(c->ctx, mode,
                       s->client_auth == OUTBOX__TLS_REQUEST_CLIENT_CERT ||
                               s->client_auth == OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT
                           ? accept_any_cert
                           : NULL);
    *out = c;
    return 0;
}

outbox__tls_config *outbox__tls_config_ref(outbox__tls_config *c)
{
    if (c)
        atomic_fetch_add(&c->refs, 1);
    return c;
}

void outbox__tls_config_unref(outbox__tls_config *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    SSL_CTX_free(c->ctx);
    free(c->server_name);
    free(c);
}

int outbox__tls_config_insecure(const outbox__tls_config *c)
{
    return c && c->insecure;
}

int outbox__tls_config_for_url(int tls, const outbox_tls_settings *s, outbox__tls_config **out, char *err,
                               size_t errlen)
{
    *out = NULL;
    if (!tls) {
        if (outbox__tls_settings_given(s))
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "TLS settings given but the Redis URL is not rediss:// or rediss-sentinel:// "
                                "(TLS is only used with those)");
        return 0;
    }
    return outbox__tls_config_create(out, s, err, errlen);
}

/* ---- sessions ------------------------------------------------------------ */

static int is_ip(const char *name)
{
    unsigned char a[16];
    return inet_pton(AF_INET, name, a) == 1 || inet_pton(AF_INET6, name, a) == 1;
}

/* A session of cfg with its memory BIOs; name is what messages call the
 * peer. NULL when out of memory. */
static outbox__tls *session_new(outbox__tls_config *cfg, const char *name)
{
    outbox__tls *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->cfg = outbox__tls_config_ref(cfg);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ssl = SSL_new(cfg->ctx);
    t->rbio = BIO_new(BIO_s_mem());
    t->wbio = BIO_new(BIO_s_mem());
    if (!t->ssl || !t->rbio || !t->wbio) {
        BIO_free(t->rbio);
        BIO_free(t->wbio);
        t->rbio = t->wbio = NULL;
        outbox__tls_destroy(t);
        ERR_clear_error();
        return NULL;
    }
    BIO_set_mem_eof_return(t->rbio, -1);
    SSL_set_bio(t->ssl, t->rbio, t->wbio);
    SSL_set_app_data(t->ssl, t);
    return t;
}

int outbox__tls_accept(outbox__tls **out, outbox__tls_config *cfg)
{
    *out = NULL;
    if (!cfg || !cfg->server)
        return OUTBOX_EINVAL;
    if (!(*out = session_new(cfg, "the client")))
        return OUTBOX_ENOMEM;
    SSL_set_accept_state((*out)->ssl);
    return 0;
}

void outbox__tls_close_notify(outbox__tls *t)
{
    /* 0 means "sent, the peer's has not come": all a server that closes
     * next needs. */
    SSL_shutdown(t->ssl);
    ERR_clear_error();
}

int outbox__tls_create(outbox__tls **out, outbox__tls_config *cfg, const char *host)
{
    const char *name = cfg && cfg->server_name ? cfg->server_name : host;
    outbox__tls *t;
    int ok;

    *out = NULL;
    if (!cfg || cfg->server || !name || !*name || strlen(name) >= sizeof t->name)
        return OUTBOX_EINVAL;
    if (!(t = session_new(cfg, name)))
        return OUTBOX_ENOMEM;
    SSL_set_connect_state(t->ssl);
    if (is_ip(name)) {
        /* RFC 6066: SNI carries host names only. */
        ok = cfg->insecure || X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(t->ssl), name) == 1;
    } else {
        X509_VERIFY_PARAM_set_hostflags(SSL_get0_param(t->ssl), X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
        ok = SSL_set_tlsext_host_name(t->ssl, name) == 1 &&
             (cfg->insecure || X509_VERIFY_PARAM_set1_host(SSL_get0_param(t->ssl), name, 0) == 1);
    }
    if (!ok) {
        outbox__tls_destroy(t);
        ERR_clear_error();
        return OUTBOX_EINVAL;
    }
    *out = t;
    return 0;
}

void outbox__tls_destroy(outbox__tls *t)
{
    if (!t)
        return;
    SSL_free(t->ssl); /* frees the BIOs */
    outbox__tls_config_unref(t->cfg);
    free(t);
}

int outbox__tls_feed(outbox__tls *t, const char *data, size_t len)
{
    if (t->received < sizeof t->first - 1) {
        size_t n = len < sizeof t->first - 1 - t->received ? len : sizeof t->first - 1 - t->received, i;
        for (i = 0; i < n; i++) {
            unsigned char ch = (unsigned char)data[i];
            t->first[t->received + i] = ch >= 0x20 && ch < 0x7f ? (char)ch : '.';
        }
    }
    t->received += len;
    while (len > 0) {
        int chunk = len > INT_MAX ? INT_MAX : (int)len;
        int w = BIO_write(t->rbio, data, chunk);
        if (w <= 0) {
            ERR_clear_error();
            return OUTBOX_ENOMEM;
        }
        data += w;
        len -= (size_t)w;
    }
    return 0;
}

/* A peer that answers a ClientHello with a RESP reply is a Redis port
 * without TLS. */
static int looks_like_resp(const outbox__tls *t)
{
    return t->received > 0 && strchr("+-:$*", t->first[0]) != NULL;
}

static const char *verify_hint(long v)
{
    switch (v) {
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
    case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
        return " (unknown CA: the server's certificate is not signed by a trusted CA)";
    case X509_V_ERR_HOSTNAME_MISMATCH:
    case X509_V_ERR_IP_ADDRESS_MISMATCH:
        return " (the certificate is not for the name or address connected to)";
    default:
        return "";
    }
}

/* Sets errstr for a failed handshake, read or write; returns OUTBOX_ETLS. */
static int describe_failure(outbox__tls *t, int ssl_error)
{
    char why[256];
    long v = SSL_get_verify_result(t->ssl);
    unsigned long e = ERR_peek_last_error();
    if (v != X509_V_OK && !t->cfg->insecure) {
        snprintf(t->errstr, sizeof t->errstr, "TLS: certificate verification failed for '%s': %s%s", t->name,
                 X509_verify_cert_error_string(v), verify_hint(v));
        ERR_clear_error();
    } else if (t->cert_requested && (ERR_GET_REASON(e) == SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED ||
                                     ERR_GET_REASON(e) == SSL_R_SSLV3_ALERT_HANDSHAKE_FAILURE ||
                                     ERR_GET_REASON(e) == SSL_R_TLSV1_ALERT_ACCESS_DENIED || e == 0)) {
        snprintf(t->errstr, sizeof t->errstr,
                 "TLS: the server asked for a client certificate and none is configured (set a certificate "
                 "and key file)");
        ERR_clear_error();
    } else if (t->cfg->server && !SSL_is_init_finished(t->ssl) && t->received > 0 && t->first[0] >= 'A' &&
               t->first[0] <= 'Z') {
        snprintf(t->errstr, sizeof t->errstr, "TLS handshake: the client spoke plaintext ('%s'): use https://",
                 t->first);
        ERR_clear_error();
    } else if (!t->cfg->server && !SSL_is_init_finished(t->ssl) && looks_like_resp(t)) {
        snprintf(t->errstr, sizeof t->errstr,
                 "TLS handshake: the server answered in plaintext ('%s'): not a TLS port? (use redis:// for "
                 "one without TLS)",
                 t->first);
        ERR_clear_error();
    } else if (ssl_error == SSL_ERROR_SSL) {
        snprintf(t->errstr, sizeof t->errstr, "TLS%s: %s", SSL_is_init_finished(t->ssl) ? "" : " handshake",
                 ossl_reason(why, sizeof why));
    } else {
        snprintf(t->errstr, sizeof t->errstr, "TLS%s: unexpected error %d", SSL_is_init_finished(t->ssl) ? "" : " handshake",
                 ssl_error);
        ERR_clear_error();
    }
    return OUTBOX_ETLS;
}

int outbox__tls_handshake(outbox__tls *t)
{
    int rc, e;
    ERR_clear_error();
    rc = SSL_do_handshake(t->ssl);
    if (rc == 1)
        return 0;
    e = SSL_get_error(t->ssl, rc);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return OUTBOX__TLS_WANT;
    return describe_failure(t, e);
}

int outbox__tls_read(outbox__tls *t, char *buf, size_t cap, size_t *n)
{
    size_t got = 0;
    int e;
    *n = 0;
    ERR_clear_error();
    if (SSL_read_ex(t->ssl, buf, cap, &got) == 1) {
        *n = got;
        return 0;
    }
    e = SSL_get_error(t->ssl, 0);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return OUTBOX__TLS_WANT;
    if (e == SSL_ERROR_ZERO_RETURN)
        return OUTBOX__TLS_EOF;
    return describe_failure(t, e);
}

int outbox__tls_encrypt(outbox__tls *t, const char *data, size_t len, size_t *used)
{
    size_t w = 0;
    int e;
    *used = 0;
    if (len == 0)
        return 0;
    ERR_clear_error();
    if (SSL_write_ex(t->ssl, data, len, &w) == 1) {
        *used = w;
        return 0;
    }
    e = SSL_get_error(t->ssl, 0);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return 0;
    return describe_failure(t, e);
}

size_t outbox__tls_pending(const outbox__tls *t)
{
    return BIO_ctrl_pending(t->wbio);
}

int outbox__tls_take(outbox__tls *t, char **buf, size_t *len, size_t *cap)
{
    size_t pending;
    while ((pending = BIO_ctrl_pending(t->wbio)) > 0) {
        int chunk = pending > INT_MAX ? INT_MAX : (int)pending, r;
        if (OUTBOX__GROW(*buf, cap, *len, (size_t)chunk, 4096) != 0)
            return OUTBOX_ENOMEM;
        r = BIO_read(t->wbio, *buf + *len, chunk);
        if (r <= 0)
            break;
        *len += (size_t)r;
    }
    return 0;
}

size_t outbox__tls_received(const outbox__tls *t)
{
    return t->received;
}

size_t outbox__tls_buffered(const outbox__tls *t)
{
    /* OpenSSL moves a partial record from the BIO into its own buffer. */
    return BIO_ctrl_pending(t->rbio) + (size_t)SSL_has_pending(t->ssl);
}

int outbox__tls_cert_requested(const outbox__tls *t)
{
    return t->cert_requested;
}

const char *outbox__tls_errstr(const outbox__tls *t)
{
    return t ? t->errstr : "";
}
