/*
 * tls.h: TLS over memory BIOs for the project's libuv Redis connection and
 * the metrics endpoint's server side (internal).
 *
 * OpenSSL never touches the socket. The connection (redis.c) reads
 * ciphertext with libuv and hands it to outbox__tls_feed(); outbox__tls_read()
 * returns the plaintext. outbox__tls_encrypt() turns plaintext into
 * ciphertext that outbox__tls_take() moves into the caller's write buffer for
 * uv_write. Nothing blocks, nothing runs on another thread, and no second
 * event loop exists: every call returns at once with what it could do.
 *
 * Two objects:
 * - outbox__tls_config: the SSL_CTX built from one outbox_tls_settings (trust
 *   store, client certificate and key, TLS 1.2 at least), reference counted
 *   so that every connection attempt of a reconnecting client shares it;
 *   or, for a server, the SSL_CTX of its certificate, key and client CAs.
 * - outbox__tls: one TLS session on one connection, with its two memory
 *   BIOs. Its buffers (OpenSSL's record buffers and the BIOs' memory) are
 *   allocated once and reused: a session in steady state allocates nothing
 *   per message.
 */
#ifndef OUTBOX_SRC_TLS_H
#define OUTBOX_SRC_TLS_H

#include <stddef.h>

#include "outbox/tls.h"

typedef struct outbox__tls_config outbox__tls_config;
typedef struct outbox__tls outbox__tls;

/*
 * Builds a configuration; s NULL means the defaults (system trust store,
 * verification on). Reads and checks every file now. Returns 0, or
 * OUTBOX_EINVAL with err naming the setting and file ("CA file
 * '/etc/x.pem': No such file or directory", "key file 'k.pem' does not match
 * certificate file 'c.pem'"), or OUTBOX_ENOMEM. *out holds one reference.
 */
int outbox__tls_config_create(outbox__tls_config **out, const outbox_tls_settings *s, char *err, size_t errlen);
/* Takes another reference; returns c. NULL is a no-op. */
outbox__tls_config *outbox__tls_config_ref(outbox__tls_config *c);
/* Drops a reference; the last one frees. NULL is a no-op. */
void outbox__tls_config_unref(outbox__tls_config *c);
/* 1 when the configuration verifies nothing (settings.insecure). */
int outbox__tls_config_insecure(const outbox__tls_config *c);

/* How a server asks for client certificates (the values of Prometheus'
 * exporter-toolkit client_auth_type, which follow Go's tls.ClientAuthType). */
typedef enum outbox__tls_client_auth {
    OUTBOX__TLS_NO_CLIENT_CERT,                /* none asked for */
    OUTBOX__TLS_REQUEST_CLIENT_CERT,           /* asked for; neither required nor verified */
    OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT,       /* required, not verified */
    OUTBOX__TLS_VERIFY_CLIENT_CERT_IF_GIVEN,   /* verified against the client CAs when given */
    OUTBOX__TLS_REQUIRE_AND_VERIFY_CLIENT_CERT /* required and verified */
} outbox__tls_client_auth;

/* A server's settings (the metrics endpoint's tls_server_config). */
typedef struct outbox__tls_server_settings {
    const char *cert_file, *key_file; /* required: PEM, the key not encrypted */
    const char *client_ca_file;       /* PEM CAs that verify client certificates; NULL: none */
    outbox__tls_client_auth client_auth;
    int min_version, max_version; /* 12 (TLS 1.2) or 13 (TLS 1.3); 0: 12 and 13 */
} outbox__tls_server_settings;

/*
 * Builds a server configuration: reads and checks the certificate, its key
 * and the client CAs now. Returns 0, OUTBOX_EINVAL with err naming the file
 * and the problem (as outbox__tls_config_create), or OUTBOX_ENOMEM. *out
 * holds one reference; sessions are made with outbox__tls_accept.
 */
int outbox__tls_server_config_create(outbox__tls_config **out, const outbox__tls_server_settings *s, char *err,
                                     size_t errlen);

/* 1 when s gives any TLS setting (a file, a name or insecure). */
int outbox__tls_settings_given(const outbox_tls_settings *s);

/*
 * What the owners of connections (consumer, dedup) do with their settings:
 * for a TLS URL (tls 1) builds the configuration into *out; for another URL
 * refuses settings that would not apply (OUTBOX_EINVAL, "TLS settings given
 * but the URL is not rediss://") and leaves *out NULL. err as above.
 */
int outbox__tls_config_for_url(int tls, const outbox_tls_settings *s, outbox__tls_config **out, char *err,
                               size_t errlen);

/* Status of the session calls below, besides 0. */
enum {
    OUTBOX__TLS_WANT = 1, /* needs more input from the peer first */
    OUTBOX__TLS_EOF = 2   /* the peer closed the TLS session (close_notify) */
};

/*
 * Creates a client session for host (the URL's host; the configuration's
 * server_name wins if set), already in connect state. Returns 0,
 * OUTBOX_ENOMEM or OUTBOX_EINVAL (an unusable name).
 */
int outbox__tls_create(outbox__tls **out, outbox__tls_config *cfg, const char *host);
/* Creates a server session of a configuration made by
 * outbox__tls_server_config_create, waiting for the client's hello.
 * Returns 0, OUTBOX_ENOMEM or OUTBOX_EINVAL (not a server configuration). */
int outbox__tls_accept(outbox__tls **out, outbox__tls_config *cfg);
/* NULL is a no-op. */
void outbox__tls_destroy(outbox__tls *t);
/* Queues a close_notify alert for outbox__tls_take: a server that closes
 * after its answer says so, so that the client can tell the end of the
 * answer from a connection cut short. */
void outbox__tls_close_notify(outbox__tls *t);

/* Appends ciphertext read from the socket. 0 or OUTBOX_ENOMEM. */
int outbox__tls_feed(outbox__tls *t, const char *data, size_t len);

/*
 * Advances the handshake with what was fed. Returns 0 once it is complete
 * (the server verified), OUTBOX__TLS_WANT while it needs more input, or
 * OUTBOX_ETLS with outbox__tls_errstr() saying why (the verify result:
 * "certificate verification failed: certificate has expired"). Output it
 * produced waits in the session for outbox__tls_take().
 */
int outbox__tls_handshake(outbox__tls *t);

/* Decrypts into buf. Returns 0 with *n > 0 bytes, OUTBOX__TLS_WANT (nothing
 * more until more input), OUTBOX__TLS_EOF, or OUTBOX_ETLS. */
int outbox__tls_read(outbox__tls *t, char *buf, size_t cap, size_t *n);

/* Encrypts up to len bytes of plaintext; *used says how many were taken (all
 * of them, unless the session needs input first). 0 or OUTBOX_ETLS. */
int outbox__tls_encrypt(outbox__tls *t, const char *data, size_t len, size_t *used);

/* Ciphertext waiting to go to the socket. */
size_t outbox__tls_pending(const outbox__tls *t);
/* Appends all pending ciphertext to *buf (length *len, capacity *cap),
 * growing it with realloc when needed. 0 or OUTBOX_ENOMEM. */
int outbox__tls_take(outbox__tls *t, char **buf, size_t *len, size_t *cap);

/* Bytes received from the peer so far, and received but not yet decrypted
 * (a part of a record), for diagnostics. */
size_t outbox__tls_received(const outbox__tls *t);
size_t outbox__tls_buffered(const outbox__tls *t);
/* 1 once the server asked for a client certificate that is not configured. */
int outbox__tls_cert_requested(const outbox__tls *t);
/* The last error's detail, "" if none. */
const char *outbox__tls_errstr(const outbox__tls *t);

#endif
