/* libFuzzer target: outbox-relay's option parsing (tools/relay/config.c).
 *
 * The input is an INI config file, then optionally two NUL bytes and
 * NUL-separated arguments; an argument of the form OUTBOX_NAME=VALUE is an
 * environment variable, any other a command-line argument. They go through
 * the daemon's own steps (flags checked, file, environment, flags applied,
 * --db and --redis required), the file read from memory instead of from
 * --config's path. Every error must come with a message, and a success must
 * leave settings the daemon can use. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

typedef struct env {
    char **vars;
    int n;
} env;

/* Like getenv(): the first NAME=VALUE entry for name. */
static const char *env_get(const char *name, void *data)
{
    env *e = data;
    size_t n = strlen(name);
    for (int i = 0; i < e->n; i++)
        if (!strncmp(e->vars[i], name, n) && e->vars[i][n] == '=')
            return e->vars[i] + n + 1;
    return NULL;
}

static void check(int ok)
{
    if (!ok)
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *split = memmem(data, size, "\0\0", 2);
    size_t ini_len = split ? (size_t)(split - data) : size;
    size_t rest = split ? size - ini_len - 2 : 0;
    char *ini = malloc(ini_len + 1), *args = malloc(rest + 1), **argv = calloc(rest + 2, sizeof *argv);
    char **vars = calloc(rest + 1, sizeof *vars);
    env e = {vars, 0};
    relay_config c;
    int argc = 1, rc;

    if (!ini || !args || !argv || !vars)
        goto out;
    memcpy(ini, data, ini_len);
    ini[ini_len] = '\0';
    if (rest)
        memcpy(args, split + 2, rest);
    args[rest] = '\0';
    argv[0] = "outbox-relay";
    for (size_t i = 0; split && i <= rest;) {
        char *a = args + i;
        size_t n = strlen(a);
        if (!strncmp(a, "OUTBOX_", 7) && strchr(a, '='))
            vars[e.n++] = a;
        else
            argv[argc++] = a;
        i += n + 1;
    }

    relay_config_init(&c);
    rc = relay_config_flags(&c, argc, argv, 1, 0);
    if (rc == RELAY_CONFIG_OK && ini_len > 0) {
        /* fmemopen() of an exact-size copy: an over-read shows under ASan. */
        FILE *f = fmemopen(ini, ini_len, "r");
        if (f) {
            rc = relay_config_ini(&c, f, "fuzz.ini");
            fclose(f);
        }
    }
    if (rc == RELAY_CONFIG_OK)
        rc = relay_config_env(&c, env_get, &e);
    if (rc == RELAY_CONFIG_OK)
        rc = relay_config_flags(&c, argc, argv, 1, 1);
    if (rc == RELAY_CONFIG_OK)
        rc = relay_config_require(&c);

    check(rc == RELAY_CONFIG_OK || rc == RELAY_CONFIG_ERROR || rc == RELAY_CONFIG_HELP ||
          rc == RELAY_CONFIG_VERSION);
    check(c.nowned >= 0 && c.nowned <= RELAY_CONFIG_OWNED_MAX);
    if (rc == RELAY_CONFIG_ERROR) {
        check(c.error != NULL && c.error[0] != '\0');
    } else if (rc == RELAY_CONFIG_OK) {
        check(c.error == NULL);
        check(c.s.db_path && *c.s.db_path && c.s.redis_url && *c.s.redis_url);
        check(c.s.batch >= 1 && c.s.batch <= 100000);
        check(c.s.inflight >= 1 && c.s.lease_ms >= 1000 && c.s.max_attempts >= 1);
        check(c.s.max_payload >= 1 && c.s.max_payload <= OUTBOX_PAYLOAD_HARD_MAX);
        check(c.s.drain == 0 || c.s.drain == 1);
        check(c.s.log_level == OUTBOX_LOG_DEBUG || c.s.log_level == OUTBOX_LOG_INFO ||
              c.s.log_level == OUTBOX_LOG_WARN || c.s.log_level == OUTBOX_LOG_ERROR);
    }
    relay_config_finish(&c);
out:
    free(ini);
    free(args);
    free(argv);
    free(vars);
    return 0;
}
