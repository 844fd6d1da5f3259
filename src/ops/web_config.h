/*
 * web_config.h: the metrics endpoint's web configuration file (internal),
 * in the format of Prometheus' exporter-toolkit (`--web.config.file` of the
 * exporters), so that a file written for an exporter works here:
 *
 *   tls_server_config:
 *     cert_file: server.crt          # required with any TLS key
 *     key_file: server.key           # required with any TLS key
 *     client_ca_file: ca.crt         # optional: CAs of client certificates
 *     client_auth_type: RequireAndVerifyClientCert   # default NoClientCert
 *     min_version: TLS12             # TLS12 (default) or TLS13
 *     max_version: TLS13             # TLS12 or TLS13 (default)
 *   basic_auth_users:
 *     prometheus: $2b$10$...         # user: bcrypt hash
 *
 * What is accepted, exactly: one YAML document (libyaml) whose top level is
 * a mapping, empty or null; its keys tls_server_config and basic_auth_users,
 * each a mapping or null; scalar values. Relative file names are taken from
 * the configuration file's directory, as exporter-toolkit does. Every other
 * key is an error naming it and its line: exporter-toolkit's other keys
 * (http_server_config, rate_limit; cert, key, client_ca, cipher_suites,
 * curve_preferences, prefer_server_cipher_suites, client_allowed_sans) as
 * "not supported here", any other as unknown. So are a duplicate key, a
 * sequence or a mapping where a scalar belongs, a second document, and the
 * checks exporter-toolkit makes: client_ca_file without a client_auth_type
 * that uses it, a client_auth_type that verifies without client_ca_file,
 * TLS keys without cert_file or key_file, min_version above max_version, a
 * hash that is not bcrypt ($2a$, $2b$ or $2y$, cost 04..31, 53 characters),
 * a user name that is empty or holds ':' (Basic authentication splits the
 * user from the password at the first ':').
 *
 * The file and the certificates it names are read once, by
 * outbox__web_config_load; a change takes effect at the next start.
 */
#ifndef OUTBOX_SRC_WEB_CONFIG_H
#define OUTBOX_SRC_WEB_CONFIG_H

#include <stddef.h>

#include "tls/tls.h"

typedef struct outbox__web_user {
    char *name, *hash;
    size_t name_len;
} outbox__web_user;

typedef struct outbox__web_config {
    /* The server's TLS configuration; NULL: plain HTTP. */
    outbox__tls_config *tls;
    outbox__tls_client_auth client_auth;
    /* basic_auth_users; none: no authentication. */
    outbox__web_user *users;
    size_t nusers;
    /* A bcrypt setting of the users' largest cost, which an unknown user's
     * password is hashed with, so that the answer takes as long as for a
     * known user (no user names learned from timing). */
    char decoy[64];
} outbox__web_config;

/*
 * Reads path and the files it names. Returns 0 with *out set, or
 * OUTBOX_EINVAL with err saying what and where ("web.yml: line 4: unknown
 * key 'cert' in tls_server_config"), or OUTBOX_ENOMEM.
 */
int outbox__web_config_load(outbox__web_config **out, const char *path, char *err, size_t errlen);

/*
 * The same from text (len bytes) without reading any file (the TLS
 * configuration stays NULL): name is what messages call the file, dir the
 * directory relative names are taken from. For the fuzzer and the tests.
 */
int outbox__web_config_parse(outbox__web_config **out, const char *text, size_t len, const char *name,
                             const char *dir, char *err, size_t errlen);

/* NULL is a no-op. */
void outbox__web_config_free(outbox__web_config *w);

/* The user named name (len bytes), or NULL. */
const outbox__web_user *outbox__web_config_user(const outbox__web_config *w, const char *name, size_t len);

#endif
