/*
 * tls_certs.h: what the TLS tests share: certificates made at test time with
 * the `openssl` command, redis-server with a TLS port (harness.h's server,
 * started with TLS configuration lines), and a misbehaving TLS peer on a
 * loopback port.
 *
 * Setup failures bail out; nothing here prints TAP results.
 */
#ifndef OUTBOX_TESTS_TLS_CERTS_H
#define OUTBOX_TESTS_TLS_CERTS_H

#include "harness.h"

/*
 * A fresh directory with (all PEM, EC P-256 keys, not encrypted):
 *   ca.crt ca.key          the test CA
 *   server.crt server.key  for DNS:localhost and IP:127.0.0.1, by the CA
 *   client.crt client.key  a client certificate, by the CA
 *   expired.crt expired.key for localhost / 127.0.0.1, expired yesterday
 *   other.crt other.key    only for DNS:other.example and IP:10.9.9.9
 *   rogue-ca.crt           another CA that signed none of these
 *   enc.key                client.key encrypted with a passphrase
 *   garbage.pem            a file that is not PEM
 * tls_cert() gives a file's path (malloc'd once, valid until tls_certs_free).
 */
typedef struct tls_certs tls_certs;
tls_certs *tls_certs_make(void);
const char *tls_cert(tls_certs *c, const char *name);
void tls_certs_free(tls_certs *c);

/* redis-server (th_redis) with a TLS port on 127.0.0.1 serving cert/key (file
 * names in c), trusting c's CA for client certificates, tls-auth-clients yes
 * or no, a plaintext loopback port too when with_tcp, its Unix socket
 * (plaintext; harness.h's client uses it) and the config lines in extra (may
 * be NULL). Retries with another port if one was taken. Returns the TLS
 * port, or -1. */
int tls_redis_start(th_redis *r, tls_certs *c, const char *cert, const char *key, int auth_clients, int with_tcp,
                    const char *extra);

typedef enum tls_fake_mode {
    TLS_FAKE_SILENT,       /* accepts, reads the ClientHello, never answers */
    TLS_FAKE_STALL,        /* answers the ClientHello with the start of a record, then nothing */
    TLS_FAKE_RESET_RECORD  /* a real TLS server (server.crt) answering +OK until `after` commands,
                            * then half a reply record and a TCP reset */
} tls_fake_mode;

typedef struct tls_fake tls_fake;
/* Starts the peer's thread on a free 127.0.0.1 port. */
tls_fake *tls_fake_start(tls_certs *c, tls_fake_mode mode, int after);
int tls_fake_port(const tls_fake *f);
/* Stops the thread and closes its sockets. NULL is a no-op. */
void tls_fake_stop(tls_fake *f);

#endif
