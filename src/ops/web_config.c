/*
 * web_config.c: the metrics endpoint's web configuration file, parsed with
 * libyaml's document loader (see web_config.h for what is accepted).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "util/util.h"
#include "ops/web_config.h"

/* Far more than a web configuration needs; a bound on what a mistaken path
 * (a log file, a disk image) makes us read and parse. */
#define FILE_MAX (1024 * 1024)
/* A mapping's keys are checked against each other for duplicates. */
#define USERS_MAX 1000

/* What the file says, before its files are read. */
struct raw {
    char *cert_file, *key_file, *client_ca_file; /* relative names joined to the file's directory */
    int tls_keys;                                 /* any key of tls_server_config given */
    int auth_given, min_version, max_version;
    outbox__tls_client_auth client_auth;
};

typedef struct pctx {
    yaml_document_t *doc;
    const char *name, *dir;
    char *err;
    size_t errlen;
} pctx;

static const struct {
    const char *name;
    outbox__tls_client_auth v;
} auth_types[] = {
    {"NoClientCert", OUTBOX__TLS_NO_CLIENT_CERT},
    {"RequestClientCert", OUTBOX__TLS_REQUEST_CLIENT_CERT},
    {"RequireAnyClientCert", OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT},
    /* exporter-toolkit keeps this older name for RequireAnyClientCert. */
    {"RequireClientCert", OUTBOX__TLS_REQUIRE_ANY_CLIENT_CERT},
    {"VerifyClientCertIfGiven", OUTBOX__TLS_VERIFY_CLIENT_CERT_IF_GIVEN},
    {"RequireAndVerifyClientCert", OUTBOX__TLS_REQUIRE_AND_VERIFY_CLIENT_CERT},
};

/* exporter-toolkit's keys that this endpoint does not implement: refused by
 * name, so that a file relying on one does not silently do less. */
static const char *const unsupported_top[] = {"http_server_config", "rate_limit"};
static const char *const unsupported_tls[] = {"cert",         "key",
                                              "client_ca",    "cipher_suites",
                                              "curve_preferences", "prefer_server_cipher_suites",
                                              "client_allowed_sans"};

static int fail(pctx *p, const yaml_node_t *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(pctx *p, const yaml_node_t *n, const char *fmt, ...)
{
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n)
        return outbox__errf(p->err, p->errlen, OUTBOX_EINVAL, "%s: line %lu: %s", p->name,
                            (unsigned long)n->start_mark.line + 1, msg);
    return outbox__errf(p->err, p->errlen, OUTBOX_EINVAL, "%s: %s", p->name, msg);
}

static int is_null(const yaml_node_t *n)
{
    const char *v = (const char *)n->data.scalar.value;
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return 0;
    return !*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL");
}

/* A key or value that must be a string: its text, or NULL after fail(). */
static const char *scalar(pctx *p, const yaml_node_t *n, const char *what)
{
    if (n->type != YAML_SCALAR_NODE) {
        fail(p, n, "%s: expected a string, not a %s", what, n->type == YAML_MAPPING_NODE ? "mapping" : "list");
        return NULL;
    }
    if (strlen((const char *)n->data.scalar.value) != n->data.scalar.length) {
        fail(p, n, "%s: a NUL byte in the value", what);
        return NULL;
    }
    return (const char *)n->data.scalar.value;
}

static int in_list(const char *s, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(s, list[i]))
            return 1;
    return 0;
}

/* The mapping's pairs, each key a string that no earlier key repeats.
 * Calls each(p, key, value, data) in order; returns its first error. */
static int each_pair(pctx *p, const yaml_node_t *map, const char *where, size_t max,
                     int (*each)(pctx *, const char *, yaml_node_t *, yaml_node_t *, void *), void *data)
{
    const yaml_node_pair_t *a, *b;
    size_t n = (size_t)(map->data.mapping.pairs.top - map->data.mapping.pairs.start);
    if (n > max)
        return fail(p, map, "%s: %zu entries, at most %zu", where, n, max);
    for (a = map->data.mapping.pairs.start; a < map->data.mapping.pairs.top; a++) {
        yaml_node_t *k = yaml_document_get_node(p->doc, a->key), *v = yaml_document_get_node(p->doc, a->value);
        const char *ks;
        int e;
        if (!k || !v)
            return fail(p, map, "%s: a malformed entry", where);
        if (!(ks = scalar(p, k, where)))
            return OUTBOX_EINVAL;
        for (b = map->data.mapping.pairs.start; b < a; b++) {
            yaml_node_t *k2 = yaml_document_get_node(p->doc, b->key);
            if (k2 && k2->type == YAML_SCALAR_NODE && !strcmp((const char *)k2->data.scalar.value, ks))
                return fail(p, k, "%s: duplicate key '%s'", where, ks);
        }
        if ((e = each(p, ks, k, v, data)) != 0)
            return e;
    }
    return 0;
}

/* A file name, relative ones taken from the configuration's directory. */
static int file_value(pctx *p, const char *key, yaml_node_t *v, char **out)
{
    const char *s = scalar(p, v, key);
    size_t n;
    if (!s)
        return OUTBOX_EINVAL;
    if (!*s)
        return fail(p, v, "tls_server_config: %s: empty file name", key);
    n = strlen(s) + (p->dir ? strlen(p->dir) : 0) + 2;
    if (!(*out = malloc(n)))
        return OUTBOX_ENOMEM;
    if (s[0] != '/' && p->dir && *p->dir)
        snprintf(*out, n, "%s/%s", p->dir, s);
    else
        snprintf(*out, n, "%s", s);
    return 0;
}

static int version_value(pctx *p, const char *key, yaml_node_t *v, int *out)
{
    const char *s = scalar(p, v, key);
    if (!s)
        return OUTBOX_EINVAL;
    if (!strcmp(s, "TLS12") || !strcmp(s, "TLS13")) {
        *out = s[4] - '0' + 10;
        return 0;
    }
    if (!strcmp(s, "TLS10") || !strcmp(s, "TLS11"))
        return fail(p, v, "tls_server_config: %s: %s is not supported: TLS12 is the oldest version served", key, s);
    return fail(p, v, "tls_server_config: %s: unknown TLS version '%s' (TLS12 or TLS13)", key, s);
}

static int tls_pair(pctx *p, const char *key, yaml_node_t *k, yaml_node_t *v, void *data)
{
    struct raw *r = data;
    r->tls_keys = 1;
    if (!strcmp(key, "cert_file"))
        return file_value(p, key, v, &r->cert_file);
    if (!strcmp(key, "key_file"))
        return file_value(p, key, v, &r->key_file);
    if (!strcmp(key, "client_ca_file"))
        return file_value(p, key, v, &r->client_ca_file);
    if (!strcmp(key, "min_version"))
        return version_value(p, key, v, &r->min_version);
    if (!strcmp(key, "max_version"))
        return version_value(p, key, v, &r->max_version);
    if (!strcmp(key, "client_auth_type")) {
        const char *s = scalar(p, v, key);
        if (!s)
            return OUTBOX_EINVAL;
        for (size_t i = 0; i < OUTBOX_ARRAY_LEN(auth_types); i++)
            if (!strcmp(s, auth_types[i].name)) {
                r->client_auth = auth_types[i].v;
                r->auth_given = 1;
                return 0;
            }
        return fail(p, v,
                    "tls_server_config: client_auth_type: unknown value '%s' (NoClientCert, RequestClientCert, "
                    "RequireAnyClientCert, VerifyClientCertIfGiven or RequireAndVerifyClientCert)",
                    s);
    }
    if (in_list(key, unsupported_tls, OUTBOX_ARRAY_LEN(unsupported_tls)))
        return fail(p, k,
                    "tls_server_config: '%s' is not supported here (supported: cert_file, key_file, client_ca_file, "
                    "client_auth_type, min_version, max_version)",
                    key);
    return fail(p, k, "unknown key '%s' in tls_server_config", key);
}

/* $2a$, $2b$ or $2y$, a two-digit cost 04..31, then 22 characters of salt
 * and 31 of hash in bcrypt's base64 alphabet. */
static int is_bcrypt(const char *h)
{
    static const char alphabet[] = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    int cost;
    if (strlen(h) != 60 || strncmp(h, "$2", 2) != 0 || !strchr("aby", h[2]) || h[2] == '\0' || h[3] != '$' ||
        h[4] < '0' || h[4] > '3' || h[5] < '0' || h[5] > '9' || h[6] != '$')
        return 0;
    cost = (h[4] - '0') * 10 + (h[5] - '0');
    return cost >= 4 && cost <= 31 && strspn(h + 7, alphabet) == 53;
}

static int user_pair(pctx *p, const char *key, yaml_node_t *k, yaml_node_t *v, void *data)
{
    outbox__web_config *w = data;
    outbox__web_user *u = &w->users[w->nusers];
    const char *hash;
    if (!*key || strchr(key, ':'))
        return fail(p, k, "basic_auth_users: user name '%s': must be non-empty and without ':'", key);
    if (!(hash = scalar(p, v, "basic_auth_users")))
        return OUTBOX_EINVAL;
    if (!is_bcrypt(hash))
        return fail(p, v,
                    "basic_auth_users: user '%s': not a bcrypt hash ($2a$, $2b$ or $2y$, a cost of 04 to 31, "
                    "then 53 characters; e.g. from `htpasswd -nBC 10 \"\" | tr -d ':\\n'`)",
                    key);
    if (!(u->name = strdup(key)) || !(u->hash = strdup(hash))) {
        free(u->name);
        u->name = NULL;
        return OUTBOX_ENOMEM;
    }
    u->name_len = strlen(key);
    w->nusers++;
    /* The decoy takes the largest cost: an unknown user never answers
     * sooner than a known one. */
    if (!w->decoy[0] || strncmp(hash + 4, w->decoy + 4, 2) > 0)
        snprintf(w->decoy, sizeof w->decoy, "%.29s", hash);
    return 0;
}

static int top_pair(pctx *p, const char *key, yaml_node_t *k, yaml_node_t *v, void *data)
{
    void **both = data;
    int tls = !strcmp(key, "tls_server_config");
    if (tls || !strcmp(key, "basic_auth_users")) {
        if (is_null(v))
            return 0;
        if (v->type != YAML_MAPPING_NODE)
            return fail(p, v, "%s: expected a mapping of keys to values", key);
        if (tls)
            return each_pair(p, v, key, 64, tls_pair, both[1]);
        outbox__web_config *w = both[0];
        size_t n = (size_t)(v->data.mapping.pairs.top - v->data.mapping.pairs.start);
        if (n > USERS_MAX)
            return fail(p, v, "basic_auth_users: %zu users, at most %d", n, USERS_MAX);
        if (n && !(w->users = calloc(n, sizeof *w->users)))
            return OUTBOX_ENOMEM;
        return each_pair(p, v, key, USERS_MAX, user_pair, w);
    }
    if (in_list(key, unsupported_top, OUTBOX_ARRAY_LEN(unsupported_top)))
        return fail(p, k, "'%s' is not supported here (supported: tls_server_config, basic_auth_users)", key);
    return fail(p, k, "unknown key '%s' (tls_server_config or basic_auth_users)", key);
}

/* The checks between keys, as exporter-toolkit makes them. */
static int check_raw(pctx *p, const struct raw *r)
{
    int verifies = r->client_auth == OUTBOX__TLS_VERIFY_CLIENT_CERT_IF_GIVEN ||
                   r->client_auth == OUTBOX__TLS_REQUIRE_AND_VERIFY_CLIENT_CERT;
    if (!r->tls_keys)
        return 0;
    if (!r->cert_file)
        return fail(p, NULL, "tls_server_config: missing cert_file");
    if (!r->key_file)
        return fail(p, NULL, "tls_server_config: missing key_file");
    if (r->client_ca_file && !verifies)
        return fail(p, NULL,
                    "tls_server_config: client_ca_file given, but client_auth_type %s does not verify client "
                    "certificates (VerifyClientCertIfGiven or RequireAndVerifyClientCert)",
                    r->auth_given ? "is set to one that" : "(default NoClientCert)");
    if (verifies && !r->client_ca_file)
        return fail(p, NULL, "tls_server_config: client_auth_type %s needs client_ca_file (the CAs to verify with)",
                    r->client_auth == OUTBOX__TLS_VERIFY_CLIENT_CERT_IF_GIVEN ? "VerifyClientCertIfGiven"
                                                                             : "RequireAndVerifyClientCert");
    if ((r->min_version ? r->min_version : 12) > (r->max_version ? r->max_version : 13))
        return fail(p, NULL, "tls_server_config: min_version is above max_version");
    return 0;
}

static void raw_free(struct raw *r)
{
    free(r->cert_file);
    free(r->key_file);
    free(r->client_ca_file);
}

static int parse_into(outbox__web_config *w, struct raw *r, const char *text, size_t len, pctx *p)
{
    yaml_parser_t parser;
    yaml_document_t doc, more;
    yaml_node_t *root;
    void *both[2] = {w, r};
    int e = 0;

    if (!yaml_parser_initialize(&parser))
        return OUTBOX_ENOMEM;
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        e = outbox__errf(p->err, p->errlen, OUTBOX_EINVAL, "%s: line %lu: not valid YAML: %s%s%s", p->name,
                         (unsigned long)parser.problem_mark.line + 1, parser.problem ? parser.problem : "error",
                         parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        return e;
    }
    p->doc = &doc;
    root = yaml_document_get_root_node(&doc);
    if (root && !is_null(root)) {
        if (root->type != YAML_MAPPING_NODE)
            e = fail(p, root, "expected a mapping (tls_server_config:, basic_auth_users:) at the top");
        else
            e = each_pair(p, root, "the top level", 16, top_pair, both);
    }
    yaml_document_delete(&doc);
    if (e == 0) {
        /* exporter-toolkit reads one document; a second is a mistake. */
        if (!yaml_parser_load(&parser, &more)) {
            e = outbox__errf(p->err, p->errlen, OUTBOX_EINVAL, "%s: line %lu: not valid YAML: %s", p->name,
                             (unsigned long)parser.problem_mark.line + 1, parser.problem ? parser.problem : "error");
        } else {
            if (yaml_document_get_root_node(&more))
                e = outbox__errf(p->err, p->errlen, OUTBOX_EINVAL, "%s: more than one YAML document", p->name);
            yaml_document_delete(&more);
        }
    }
    yaml_parser_delete(&parser);
    if (e == 0)
        e = check_raw(p, r);
    if (e == 0 && r->auth_given)
        w->client_auth = r->client_auth;
    return e;
}

int outbox__web_config_parse(outbox__web_config **out, const char *text, size_t len, const char *name,
                             const char *dir, char *err, size_t errlen)
{
    pctx p = {NULL, name, dir, err, errlen};
    struct raw r = {0};
    outbox__web_config *w;
    int e;
    *out = NULL;
    if (!(w = calloc(1, sizeof *w)))
        return OUTBOX_ENOMEM;
    e = parse_into(w, &r, text, len, &p);
    raw_free(&r);
    if (e != 0) {
        outbox__web_config_free(w);
        return e;
    }
    *out = w;
    return 0;
}

/* The whole file, NUL-terminated, at most FILE_MAX bytes. */
static int read_file(const char *path, char **text, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    size_t n = 0, cap = 4096;
    char *buf;
    if (!f)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: %s", path, strerror(errno));
    if (!(buf = malloc(cap))) {
        fclose(f);
        return OUTBOX_ENOMEM;
    }
    for (;;) {
        size_t got;
        if (cap - n < 2) {
            char *nb = cap > FILE_MAX ? NULL : realloc(buf, cap * 2);
            if (!nb) {
                int big = cap > FILE_MAX;
                free(buf);
                fclose(f);
                return big ? outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: larger than %d bytes: not a web "
                                          "configuration", path, FILE_MAX)
                           : OUTBOX_ENOMEM;
            }
            buf = nb;
            cap *= 2;
        }
        got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        int e = errno;
        free(buf);
        fclose(f);
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "%s: %s", path, strerror(e));
    }
    fclose(f);
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;
}

int outbox__web_config_load(outbox__web_config **out, const char *path, char *err, size_t errlen)
{
    outbox__tls_server_settings ts = {0};
    struct raw r = {0};
    outbox__web_config *w = NULL;
    char *text = NULL, *dir = NULL, *slash, why[512];
    size_t len = 0;
    pctx p = {NULL, path, NULL, err, errlen};
    int e;

    *out = NULL;
    if ((e = read_file(path, &text, &len, err, errlen)) != 0)
        return e;
    if (!(dir = strdup(path)) || !(w = calloc(1, sizeof *w))) {
        e = OUTBOX_ENOMEM;
        goto done;
    }
    slash = strrchr(dir, '/');
    if (slash)
        slash[slash == dir ? 1 : 0] = '\0';
    p.dir = slash ? dir : NULL;
    if ((e = parse_into(w, &r, text, len, &p)) != 0)
        goto done;
    if (r.tls_keys) {
        ts.cert_file = r.cert_file;
        ts.key_file = r.key_file;
        ts.client_ca_file = r.client_ca_file;
        ts.client_auth = r.client_auth;
        ts.min_version = r.min_version;
        ts.max_version = r.max_version;
        if ((e = outbox__tls_server_config_create(&w->tls, &ts, why, sizeof why)) != 0) {
            e = outbox__errf(err, errlen, e, "%s: tls_server_config: %s", path, why[0] ? why : outbox_strerror(e));
            goto done;
        }
    }
done:
    raw_free(&r);
    free(text);
    free(dir);
    if (e != 0) {
        outbox__web_config_free(w);
        return e;
    }
    *out = w;
    return 0;
}

void outbox__web_config_free(outbox__web_config *w)
{
    if (!w)
        return;
    outbox__tls_config_unref(w->tls);
    for (size_t i = 0; i < w->nusers; i++) {
        free(w->users[i].name);
        free(w->users[i].hash);
    }
    free(w->users);
    free(w);
}

const outbox__web_user *outbox__web_config_user(const outbox__web_config *w, const char *name, size_t len)
{
    for (size_t i = 0; w && i < w->nusers; i++)
        if (w->users[i].name_len == len && memcmp(w->users[i].name, name, len) == 0)
            return &w->users[i];
    return NULL;
}
