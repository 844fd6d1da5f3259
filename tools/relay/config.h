/*
 * outbox-relay's options: command-line flags, OUTBOX_* environment variables
 * and an INI file (--config) turned into outbox_relay_settings.
 *
 * Parsing has no side effects: nothing is started or printed and the process
 * never exits; a problem comes back as RELAY_CONFIG_ERROR with the message
 * in c->error. The daemon (main.c) prints it; the fuzz target
 * (tests/fuzz/fuzz_relay_config.c) calls the same functions on its input.
 */
#ifndef OUTBOX_TOOLS_RELAY_CONFIG_H
#define OUTBOX_TOOLS_RELAY_CONFIG_H

#include <stdio.h>

#include "outbox.h"

/* Strings a relay_config can own (values of string options, each setting
 * counted every time it is given). */
#define RELAY_CONFIG_OWNED_MAX 32

typedef struct relay_config {
    outbox_relay_settings s;
    /* --config, pointing into argv (not owned); NULL when not given. */
    const char *config_path;
    /* Strings given on the command line, in the environment or in the file;
     * owned here so that the settings can point at them. */
    char *owned[RELAY_CONFIG_OWNED_MAX];
    int nowned;
    /* --db-glob flags applied so far: the second and later add patterns. */
    int db_glob_flags;
    /* After RELAY_CONFIG_ERROR: what was wrong, without the program name
     * (e.g. "--batch: 0 is out of range 1..100000"); owned here. NULL when
     * even the message could not be allocated. */
    char *error;
} relay_config;

enum {
    RELAY_CONFIG_ERROR = -1,
    RELAY_CONFIG_OK = 0,
    RELAY_CONFIG_HELP = 1,    /* -h or --help: print relay_config_usage() */
    RELAY_CONFIG_VERSION = 2, /* -V or --version */
};

/* Looks up an environment variable; NULL when it is not set. */
typedef const char *relay_config_getenv_fn(const char *name, void *data);

/* Fills c with outbox_relay_defaults() and nothing else set. */
void relay_config_init(relay_config *c);
/* Frees what c owns (the strings the settings point at, the error). */
void relay_config_finish(relay_config *c);

/* Everything outbox-relay [run] does with its options, in its order: flags
 * are checked (and --config found) first, then the file, the environment
 * (getenv_fn, or getenv() when NULL) and the flags are applied, each
 * overriding the one before, and --db and --redis must be set. argv[first..]
 * are the options; argv must outlive c. Returns RELAY_CONFIG_OK, _HELP,
 * _VERSION (before anything is applied) or _ERROR. */
int relay_config_parse(relay_config *c, int argc, char **argv, int first, relay_config_getenv_fn *getenv_fn,
                       void *env_data);

/* The steps of relay_config_parse(), for the fuzz target. With apply == 0
 * the flags are only checked and --config is recorded; with apply == 1 their
 * values are set. */
int relay_config_flags(relay_config *c, int argc, char **argv, int first, int apply);
/* Applies an INI file already opened; path names it in messages. */
int relay_config_ini(relay_config *c, FILE *f, const char *path);
int relay_config_env(relay_config *c, relay_config_getenv_fn *getenv_fn, void *env_data);
/* --db and --redis are set. */
int relay_config_require(relay_config *c);

/* The option list of outbox-relay's --help. */
void relay_config_usage(FILE *f, const char *prog);

#endif
