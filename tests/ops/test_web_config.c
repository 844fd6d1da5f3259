/*
 * The metrics endpoint's web configuration file (src/web_config.h): what
 * exporter-toolkit's format allows is taken, everything else is refused with
 * the key and line named; files are read by load, relative names from the
 * file's directory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tap.h"
#include "tls_certs.h"
#include "ops/web_config.h"

#define HASH "$2b$10$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiRi"

/* Parses text; returns the error text ("" when it parsed). */
static const char *parse(const char *text, outbox__web_config **out)
{
    static char err[512];
    outbox__web_config *w = NULL;
    int e;
    err[0] = '\0';
    e = outbox__web_config_parse(&w, text, strlen(text), "web.yml", "/etc/outbox", err, sizeof err);
    if (e == 0 && err[0])
        snprintf(err, sizeof err, "(parsed, yet an error text)");
    if (e != 0 && !err[0])
        snprintf(err, sizeof err, "(code %d without a text)", e);
    if (out)
        *out = w;
    else
        outbox__web_config_free(w);
    return err;
}

static void refused(const char *text, const char *want)
{
    const char *got = parse(text, NULL);
    ok(strstr(got, want) != NULL, "refused: %s (%s)", want, got);
}

static void accepted(void)
{
    outbox__web_config *w = NULL;
    const char *e;

    is_str(parse("", &w), "", "an empty file: plain HTTP, no users");
    ok(w && !w->tls && w->nusers == 0, "(nothing configured)");
    outbox__web_config_free(w);
    is_str(parse("# nothing\ntls_server_config:\nbasic_auth_users: ~\n", &w), "", "null sections");
    ok(w && w->nusers == 0, "(no users)");
    outbox__web_config_free(w);
    is_str(parse("tls_server_config: {}\n", NULL), "", "an empty tls_server_config: no TLS, as exporter-toolkit");

    e = parse("basic_auth_users:\n  alice: " HASH "\n"
              "  bob: '$2y$12$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiRi'\n"
              "  carol: \"$2a$04$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiRi\"\n",
              &w);
    is_str(e, "", "three users, $2b$, $2y$ and $2a$ hashes, plain and quoted");
    ok(w && w->nusers == 3, "(3 users)");
    ok(w && outbox__web_config_user(w, "bob", 3) && !outbox__web_config_user(w, "bo", 2) &&
           !outbox__web_config_user(w, "dave", 4),
       "users are found by their exact name");
    ok(w && !strncmp(w->decoy, "$2y$12$", 7) && strlen(w->decoy) == 29,
       "the decoy for unknown users has the largest cost (%s)", w ? w->decoy : "");
    outbox__web_config_free(w);

    is_str(parse("tls_server_config:\n  cert_file: a.crt\n  key_file: /k/a.key\n  client_ca_file: ca.crt\n"
                 "  client_auth_type: RequireAndVerifyClientCert\n  min_version: TLS13\n  max_version: TLS13\n",
                 &w),
           "", "every supported TLS key");
    ok(w && w->client_auth == OUTBOX__TLS_REQUIRE_AND_VERIFY_CLIENT_CERT, "(RequireAndVerifyClientCert)");
    outbox__web_config_free(w);
    is_str(parse("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireClientCert\n", &w), "",
           "exporter-toolkit's older name RequireClientCert");
    ok(w && w->client_auth == OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT, "(for RequireAnyClientCert)");
    outbox__web_config_free(w);
}

static void refusals(void)
{
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  foo: 1\n",
            "web.yml: line 4: unknown key 'foo' in tls_server_config");
    refused("basic_auth_user:\n  a: b\n", "web.yml: line 1: unknown key 'basic_auth_user' (tls_server_config or "
                                          "basic_auth_users)");
    refused("http_server_config:\n  http2: true\n", "line 1: 'http_server_config' is not supported here");
    refused("rate_limit:\n  burst: 2\n", "'rate_limit' is not supported here");
    refused("tls_server_config:\n  cert: |\n    -----BEGIN CERTIFICATE-----\n",
            "line 2: tls_server_config: 'cert' is not supported here");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_allowed_sans: [x]\n",
            "'client_allowed_sans' is not supported here");
    refused("tls_server_config:\n  cert_file: a\n  cert_file: b\n  key_file: c\n", "line 3: tls_server_config: "
                                                                                   "duplicate key 'cert_file'");
    refused("basic_auth_users:\n  a: " HASH "\nbasic_auth_users:\n  b: " HASH "\n",
            "line 3: the top level: duplicate key 'basic_auth_users'");
    refused("tls_server_config:\n  key_file: b\n", "tls_server_config: missing cert_file");
    refused("tls_server_config:\n  cert_file: a\n", "tls_server_config: missing key_file");
    refused("tls_server_config:\n  cert_file: ''\n  key_file: b\n", "cert_file: empty file name");
    refused("tls_server_config:\n  cert_file: [a, b]\n  key_file: b\n", "cert_file: expected a string, not a list");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_ca_file: ca\n",
            "client_ca_file given, but client_auth_type (default NoClientCert) does not verify");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_ca_file: ca\n  client_auth_type: "
            "RequestClientCert\n",
            "client_ca_file given, but client_auth_type is set to one that does not verify");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: VerifyClientCertIfGiven\n",
            "client_auth_type VerifyClientCertIfGiven needs client_ca_file");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: requireandverifyclientcert\n",
            "client_auth_type: unknown value 'requireandverifyclientcert'");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: TLS10\n",
            "min_version: TLS10 is not supported: TLS12 is the oldest version served");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  max_version: TLS1.3\n",
            "max_version: unknown TLS version 'TLS1.3' (TLS12 or TLS13)");
    refused("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: TLS13\n  max_version: TLS12\n",
            "min_version is above max_version");
    refused("basic_auth_users:\n  alice: password\n", "line 2: basic_auth_users: user 'alice': not a bcrypt hash");
    refused("basic_auth_users:\n  alice: $2b$03$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiRi\n",
            "user 'alice': not a bcrypt hash");
    refused("basic_auth_users:\n  alice: $2x$10$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiRi\n",
            "user 'alice': not a bcrypt hash");
    refused("basic_auth_users:\n  alice: $2b$10$MHCu9W0G1LEYiS9Vtwc1dOqHdYCDxFL7EsaHDI6XyzNjh0BXJUiR\n",
            "user 'alice': not a bcrypt hash");
    refused("basic_auth_users:\n  'al:ice': " HASH "\n", "user name 'al:ice': must be non-empty and without ':'");
    refused("basic_auth_users:\n  '': " HASH "\n", "user name '': must be non-empty");
    refused("basic_auth_users:\n  alice: {a: b}\n", "basic_auth_users: expected a string, not a mapping");
    refused("basic_auth_users: [alice]\n", "line 1: basic_auth_users: expected a mapping");
    refused("- tls_server_config\n", "line 1: expected a mapping (tls_server_config:, basic_auth_users:) at the top");
    refused("just text\n", "expected a mapping");
    refused("tls_server_config: [\n", "web.yml: line 2: not valid YAML");
    refused("a: b\n\tc: d\n", "not valid YAML");
    refused("basic_auth_users:\n  a: " HASH "\n---\nbasic_auth_users:\n", "more than one YAML document");
    refused("? [a]\n: b\n", "the top level: expected a string, not a list");
    /* An alias to its own mapping: no recursion follows it. */
    refused("basic_auth_users: &a\n  x: *a\n", "line 1: basic_auth_users: expected a string, not a mapping");
    {
        /* 1,001 users. */
        size_t cap = 100000, n = 0;
        char *t = malloc(cap);
        if (!t)
            bail("out of memory");
        n += (size_t)snprintf(t + n, cap - n, "basic_auth_users:\n");
        for (int i = 0; i <= 1000; i++)
            n += (size_t)snprintf(t + n, cap - n, "  u%d: x\n", i);
        refused(t, "basic_auth_users: 1001 users, at most 1000");
        free(t);
    }
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s: %s", path, strerror(errno));
}

/* Loading: the files are read, relative names from the file's directory. */
static void loading(void)
{
    tls_certs *c = tls_certs_make();
    char *dir = th_tmpdir(), *path = th_path(dir, "web.yml"), text[1024], err[512];
    outbox__web_config *w = NULL;
    int e;

    /* tls_certs' directory holds the certificates: a file there with
     * relative names. */
    {
        const char *crt = tls_cert(c, "server.crt");
        char *cdir = strdup(crt), *slash = strrchr(cdir, '/'), *rel;
        *slash = '\0';
        rel = th_path(cdir, "web.yml");
        write_text(rel, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: "
                        "ca.crt\n  client_auth_type: VerifyClientCertIfGiven\n");
        err[0] = '\0';
        e = outbox__web_config_load(&w, rel, err, sizeof err);
        is_int(e, 0, "relative names are read from the file's directory (%s)", err);
        ok(w && w->tls, "(a TLS configuration)");
        outbox__web_config_free(w);
        w = NULL;
        free(rel);
        free(cdir);
    }
    snprintf(text, sizeof text, "tls_server_config:\n  cert_file: %s\n  key_file: %s\n", tls_cert(c, "server.crt"),
             tls_cert(c, "client.key"));
    write_text(path, text);
    e = outbox__web_config_load(&w, path, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "tls_server_config: key file") &&
           strstr(err, "does not match certificate file"),
       "a key of another certificate (%s)", err);
    snprintf(text, sizeof text, "tls_server_config:\n  cert_file: %s\n  key_file: %s\n", tls_cert(c, "client.crt"),
             tls_cert(c, "enc.key"));
    write_text(path, text);
    e = outbox__web_config_load(&w, path, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "is encrypted"), "an encrypted key (%s)", err);
    snprintf(text, sizeof text,
             "tls_server_config:\n  cert_file: %s\n  key_file: %s\n  client_ca_file: %s\n  client_auth_type: "
             "RequireAndVerifyClientCert\n",
             tls_cert(c, "server.crt"), tls_cert(c, "server.key"), tls_cert(c, "garbage.pem"));
    write_text(path, text);
    e = outbox__web_config_load(&w, path, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "client CA file") && strstr(err, "holds no usable PEM certificate"),
       "a client CA file that is not PEM (%s)", err);
    snprintf(text, sizeof text, "tls_server_config:\n  cert_file: %s\n  key_file: %s\n", tls_cert(c, "garbage.pem"),
             tls_cert(c, "server.key"));
    write_text(path, text);
    e = outbox__web_config_load(&w, path, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "certificate file") && strstr(err, "holds no usable PEM certificate"),
       "a certificate file that is not PEM (%s)", err);
    e = outbox__web_config_load(&w, dir, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, dir), "a directory (%s)", err);
    e = outbox__web_config_load(&w, "/no/such.yml", err, sizeof err);
    ok(e == OUTBOX_EINVAL && !strcmp(err, "/no/such.yml: No such file or directory"), "a missing file (%s)", err);
    ok(w == NULL, "nothing is returned for a refused file");
    free(path);
    th_rmtree(dir);
    free(dir);
    tls_certs_free(c);
}

int main(void)
{
    accepted();
    refusals();
    loading();
    return tap_done();
}
