/*
 * outbox-relay's options (config.h): the rows of the relay's settings table
 * (src/relay/settings_table.h), applied from flags, the environment and an
 * INI file, and listed by --help. Messages name the source of a value: the
 * flag, the environment variable or the file and key.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "relay/settings_table.h"

typedef outbox__relay_option opt;

/* Log levels by value, as options name them. */
static const char *const level_names[] = {"debug", "info", "warn", "error"};

/* The default of o as --help shows it. */
static void default_text(const opt *o, const outbox_relay_settings *d, char *buf, size_t len)
{
    uint64_t v = outbox__relay_option_get(d, o);
    if (o->shown)
        snprintf(buf, len, "%s", o->shown);
    else if (o->type == OUTBOX__OPT_STR)
        snprintf(buf, len, "%s", *(const char *const *)((const char *)d + o->off));
    else if (o->type == OUTBOX__OPT_FLAG)
        snprintf(buf, len, "%s", v ? "on" : "off");
    else if (o->type == OUTBOX__OPT_LEVEL)
        snprintf(buf, len, "%s", level_names[v]);
    else
        snprintf(buf, len, "%llu", (unsigned long long)v);
}

/* One option line of --help: the flag, then its text and its default
 * (never split) wrapped at 79 columns, continuation lines indented under
 * the text. */
static void usage_line(FILE *f, const char *left, const char *text, const char *tail)
{
    enum { INDENT = 30, WIDTH = 79 };
    const char *p = text;
    int col = fprintf(f, "  %-28s", left);
    while (*p || tail) {
        size_t n = *p ? strcspn(p, " ") : strlen(tail);
        if (col + 1 + (int)n > WIDTH && col > INDENT) {
            fprintf(f, "\n%*s", INDENT, "");
            col = INDENT;
        }
        if (*p) {
            col += fprintf(f, " %.*s", (int)n, p);
            p += n;
            p += strspn(p, " ");
        } else {
            col += fprintf(f, " %s", tail);
            tail = NULL;
        }
    }
    fputc('\n', f);
}

void relay_config_usage(FILE *f, const char *prog)
{
    outbox_relay_settings d;
    size_t i;
    outbox_relay_defaults(&d);
    fprintf(f,
            "Usage: %s [run] --db PATH --redis URL [options]\n"
            "       %s init --db PATH\n"
            "       %s --help | --version\n"
            "\n"
            "Publishes the committed rows of the outbox table in PATH to Redis Streams\n"
            "(stream PREFIX+topic, one XADD per message, at least once), marking each row\n"
            "published once Redis accepted it. 'init' creates or migrates the outbox schema.\n"
            "\n"
            "Options (each also as environment variable OUTBOX_<NAME>, e.g. OUTBOX_LEASE_MS,\n"
            "and as key NAME in the --config file; flags win over the environment, which\n"
            "wins over the file):\n",
            prog, prog, prog);
    for (i = 0; i < outbox__relay_noptions; i++) {
        const opt *o = &outbox__relay_options[i];
        char left[64], def[64], tail[80];
        snprintf(left, sizeof left, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        default_text(o, &d, def, sizeof def);
        if (o->flags & OUTBOX__OPT_REQUIRED)
            snprintf(tail, sizeof tail, "(required)");
        else
            snprintf(tail, sizeof tail, "(default %s)", def);
        usage_line(f, left, o->help, tail);
    }
    usage_line(f, "--config FILE", "INI file of NAME = VALUE lines (optionally under [relay])", "(default none)");
    usage_line(f, "-h, --help", "show this help", NULL);
    usage_line(f, "-V, --version", "show the version", NULL);
    fprintf(f, "\n"
               "Signals: SIGTERM or SIGINT stop gracefully (in-flight replies are awaited up to\n"
               "--shutdown-timeout-ms, unfinished rows are handed back); a second one exits at once.\n"
               "A database that cannot be opened because the disk is full or it is locked is\n"
               "waited for like an unreachable Redis: tried again after 100 ms doubling to 5 s,\n"
               "/healthz answering 503 meanwhile; --drain exits 1 instead.\n"
               "Exit status: 0 clean stop or drained, 1 fatal runtime error or --drain-timeout-ms\n"
               "expired, 2 usage or configuration error (also a --drain that Redis refuses as\n"
               "configured). Logs go to stderr (--log-format).\n");
}

static int fail(relay_config *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(relay_config *c, const char *fmt, ...)
{
    va_list ap;
    free(c->error);
    c->error = NULL;
    va_start(ap, fmt);
    if (vasprintf(&c->error, fmt, ap) < 0)
        c->error = NULL;
    va_end(ap);
    return RELAY_CONFIG_ERROR;
}

/* Sets one option from text; on error the message is "<source>: <problem>". */
static int set_opt(relay_config *c, const opt *o, const char *value, const char *source)
{
    char *end, range[64];
    unsigned long long v;
    size_t i;

    switch (o->type) {
    case OUTBOX__OPT_STR:
        if (!*value)
            return fail(c, "%s: empty value", source);
        if (o->off == offsetof(outbox_relay_settings, log_format) && !outbox_log_sink(value))
            return fail(c, "%s: unknown log format '%s' (logfmt, json)", source, value);
        if (c->nowned == RELAY_CONFIG_OWNED_MAX)
            return fail(c, "%s: too many options", source);
        if (o->off == offsetof(outbox_relay_settings, db_glob) && source[0] == '-' && c->db_glob_flags++ > 0) {
            /* --db-glob given again: one more pattern, not another value. */
            if (asprintf(&c->owned[c->nowned], "%s,%s", c->s.db_glob, value) < 0)
                c->owned[c->nowned] = NULL;
        } else {
            c->owned[c->nowned] = strdup(value);
        }
        if (!c->owned[c->nowned])
            return fail(c, "%s: out of memory", source);
        *(const char **)((char *)&c->s + o->off) = c->owned[c->nowned++];
        return 0;
    case OUTBOX__OPT_FLAG:
        if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "on"))
            outbox__relay_option_set(&c->s, o, 1);
        else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "off"))
            outbox__relay_option_set(&c->s, o, 0);
        else
            return fail(c, "%s: '%s' is not a boolean (true/false, 1/0, yes/no, on/off)", source, value);
        return 0;
    case OUTBOX__OPT_LEVEL:
        for (i = 0; i < sizeof level_names / sizeof level_names[0]; i++)
            if (!strcmp(value, level_names[i]) || (i == OUTBOX_LOG_WARN && !strcmp(value, "warning"))) {
                outbox__relay_option_set(&c->s, o, i);
                return 0;
            }
        return fail(c, "%s: unknown log level '%s' (debug, info, warn, error)", source, value);
    default:
        break;
    }
    errno = 0;
    if (!*value || *value == '-' || *value == '+' || *value == ' ')
        return fail(c, "%s: '%s' is not a non-negative whole number", source, value);
    v = strtoull(value, &end, 10);
    if (*end != '\0')
        return fail(c, "%s: '%s' is not a non-negative whole number", source, value);
    if (errno == ERANGE || !outbox__relay_option_in_range(o, v)) {
        outbox__relay_option_range(o, range, sizeof range);
        return fail(c, "%s: %s is out of range %s", source, value, range);
    }
    outbox__relay_option_set(&c->s, o, v);
    return 0;
}

typedef struct ini_ctx {
    relay_config *c;
    const char *path;
    int failed;
} ini_ctx;

static int on_ini(void *user, const char *section, const char *name, const char *value)
{
    ini_ctx *x = user;
    const opt *o;
    char source[512];
    if (x->failed)
        return 0;
    snprintf(source, sizeof source, "config file %s: %s", x->path, name);
    if (*section && strcmp(section, "relay") != 0) {
        fail(x->c, "config file %s: unknown section [%s] (only [relay])", x->path, section);
        x->failed = 1;
        return 0;
    }
    o = outbox__relay_option_find(name);
    if (!o) {
        fail(x->c, "config file %s: unknown key '%s'", x->path, name);
        x->failed = 1;
        return 0;
    }
    if (set_opt(x->c, o, value, source) != 0) {
        x->failed = 1;
        return 0;
    }
    return 1;
}

int relay_config_ini(relay_config *c, FILE *f, const char *path)
{
    ini_ctx x = {c, path, 0};
    int rc = ini_parse_file(f, on_ini, &x);
    if (x.failed)
        return RELAY_CONFIG_ERROR;
    if (rc > 0)
        return fail(c, "config file %s line %d: not a NAME = VALUE line", path, rc);
    if (rc < 0)
        return fail(c, "config file %s: cannot read it", path);
    return RELAY_CONFIG_OK;
}

static int load_file(relay_config *c)
{
    FILE *f = fopen(c->config_path, "r");
    int rc;
    if (!f)
        return fail(c, "--config: cannot open '%s': %s", c->config_path, strerror(errno));
    rc = relay_config_ini(c, f, c->config_path);
    fclose(f);
    return rc;
}

/* The environment variable of o: OUTBOX_ and its name in upper case, '-'
 * as '_'. */
static void env_name(const opt *o, char *buf, size_t len)
{
    size_t n;
    snprintf(buf, len, "OUTBOX_%s", o->name);
    for (n = 7; n < len && buf[n]; n++)
        buf[n] = buf[n] == '-' ? '_' : (char)toupper((unsigned char)buf[n]);
}

static const char *env_lookup(const char *name, void *data)
{
    (void)data;
    return getenv(name);
}

int relay_config_env(relay_config *c, relay_config_getenv_fn *getenv_fn, void *env_data)
{
    size_t i;
    if (!getenv_fn)
        getenv_fn = env_lookup;
    for (i = 0; i < outbox__relay_noptions; i++) {
        const opt *o = &outbox__relay_options[i];
        char name[64], source[96];
        const char *v;
        env_name(o, name, sizeof name);
        v = getenv_fn(name, env_data);
        if (!v)
            continue;
        snprintf(source, sizeof source, "environment variable %s", name);
        if (set_opt(c, o, v, source) != 0)
            return RELAY_CONFIG_ERROR;
    }
    return RELAY_CONFIG_OK;
}

int relay_config_flags(relay_config *c, int argc, char **argv, int first, int apply)
{
    int i;
    for (i = first; i < argc; i++) {
        const char *a = argv[i], *name, *value = NULL, *eq;
        char namebuf[64], source[96];
        const opt *o;
        if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            return RELAY_CONFIG_HELP;
        if (!strcmp(a, "-V") || !strcmp(a, "--version"))
            return RELAY_CONFIG_VERSION;
        if (strncmp(a, "--", 2) != 0 || !a[2])
            return fail(c, "unexpected argument '%s' (see --help)", a);
        name = a + 2;
        eq = strchr(name, '=');
        if (eq) {
            size_t n = (size_t)(eq - name);
            if (n >= sizeof namebuf)
                return fail(c, "unknown option '%s' (see --help)", a);
            memcpy(namebuf, name, n);
            namebuf[n] = '\0';
            name = namebuf;
            value = eq + 1;
        }
        if (!strcmp(name, "config")) {
            if (!value) {
                if (i + 1 >= argc)
                    return fail(c, "--config needs a value");
                value = argv[++i];
            }
            c->config_path = value;
            continue;
        }
        o = outbox__relay_option_find(name);
        if (!o)
            return fail(c, "unknown option '--%s' (see --help)", name);
        if (o->type == OUTBOX__OPT_FLAG && !value) {
            value = "1";
        } else if (!value) {
            if (i + 1 >= argc)
                return fail(c, "--%s needs a value", o->name);
            value = argv[++i];
        }
        snprintf(source, sizeof source, "--%s", o->name);
        if (apply && set_opt(c, o, value, source) != 0)
            return RELAY_CONFIG_ERROR;
    }
    return RELAY_CONFIG_OK;
}

int relay_config_require(relay_config *c)
{
    size_t i;
    if (c->s.db_path && c->s.db_dir)
        return fail(c, "--db and --db-dir cannot be combined (one database, or a directory of them)");
    for (i = 0; i < outbox__relay_noptions; i++) {
        const opt *o = &outbox__relay_options[i];
        char env[64];
        if (!(o->flags & OUTBOX__OPT_REQUIRED) || *(const char *const *)((const char *)&c->s + o->off))
            continue;
        if (o->off == offsetof(outbox_relay_settings, db_path) && c->s.db_dir)
            continue; /* --db-dir instead */
        env_name(o, env, sizeof env);
        return fail(c, "--%s %s is required (or %s, or %s in the config file)", o->name, o->arg, env, o->name);
    }
    return RELAY_CONFIG_OK;
}

int relay_config_parse(relay_config *c, int argc, char **argv, int first, relay_config_getenv_fn *getenv_fn,
                       void *env_data)
{
    int rc = relay_config_flags(c, argc, argv, first, 0);
    if (rc != RELAY_CONFIG_OK)
        return rc;
    if ((c->config_path && load_file(c) != 0) || relay_config_env(c, getenv_fn, env_data) != 0 ||
        relay_config_flags(c, argc, argv, first, 1) != 0)
        return RELAY_CONFIG_ERROR;
    c->s.log = outbox_log_sink(c->s.log_format);
    return relay_config_require(c);
}

void relay_config_init(relay_config *c)
{
    memset(c, 0, sizeof *c);
    outbox_relay_defaults(&c->s);
}

void relay_config_finish(relay_config *c)
{
    for (int i = 0; i < c->nowned; i++)
        free(c->owned[i]);
    c->nowned = 0;
    free(c->error);
    c->error = NULL;
}
