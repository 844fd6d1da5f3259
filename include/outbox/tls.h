/*
 * tls.h: TLS settings for the Redis connections of the library (rediss://
 * URLs).
 *
 * A `rediss://` URL connects with TLS (OpenSSL 3, at least TLS 1.2) and
 * verifies the server by default: the certificate chain against the trust
 * store, and the host name or IP address the client connects to (the URL's
 * host, or server_name) against the certificate's subject alternative names.
 * A `redis://` or `unix://` URL with any of these settings given is refused
 * (OUTBOX_EINVAL): TLS settings that would silently not apply are a
 * configuration mistake.
 *
 * The files are read once, when the object that uses the settings is created
 * (outbox_relay_create, outbox_consumer_create, outbox_dedup_create): an
 * unreadable or malformed file, a certificate without its key or a key that
 * does not match its certificate is an OUTBOX_EINVAL from create, with the
 * file named in the error text. Create copies what it keeps of the strings;
 * the caller keeps ownership.
 */
#ifndef OUTBOX_TLS_H
#define OUTBOX_TLS_H

#include "outbox/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct outbox_tls_settings {
    /* PEM file of the certificate authorities to trust. Default NULL. When
     * neither ca_file nor ca_dir is given, the system's trust store
     * (OpenSSL's default paths, /etc/ssl/certs on Debian) is used. */
    const char *ca_file;
    /* Directory of trusted CA certificates named by subject hash (as made by
     * `openssl rehash` / c_rehash). Default NULL; may be combined with
     * ca_file. */
    const char *ca_dir;
    /* Client certificate (PEM; the chain may follow it in the file) for
     * servers that require one (mutual TLS, `tls-auth-clients yes`).
     * Default NULL: no client certificate. Needs key_file. */
    const char *cert_file;
    /* The private key of cert_file (PEM, not encrypted: a passphrase cannot
     * be entered). Default NULL. Needs cert_file. */
    const char *key_file;
    /* The name sent as SNI and verified against the server's certificate.
     * Default NULL: the URL's host. An IP address is verified against the
     * certificate's IP address entries and sent without SNI. */
    const char *server_name;
    /* 1: no verification at all (any certificate, any name). Default 0.
     * Logged as a warning at every connect; for tests and emergencies. */
    int insecure;
} outbox_tls_settings;

/* Fills s with the defaults above (all NULL, insecure 0). */
OUTBOX_API void outbox_tls_defaults(outbox_tls_settings *s);

#ifdef __cplusplus
}
#endif

#endif /* OUTBOX_TLS_H */
