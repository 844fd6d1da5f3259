/*
 * outbox-replay's command line: the subcommand, the filters (--state,
 * --topic, --key, --id, --id-prefix, --since, --until) and the other options
 * (stats over a directory of databases: --db-dir, --db-glob, --top),
 * checked and turned into a replay_options.
 *
 * Parsing has no side effects: nothing is opened or printed and the process
 * never exits; a problem comes back as REPLAY_ARGS_ERROR with the message in
 * o->error. The tool (main.c) prints it; the fuzz target
 * (tests/fuzz/fuzz_replay_filters.c) calls the same function on its input.
 */
#ifndef OUTBOX_TOOLS_REPLAY_ARGS_H
#define OUTBOX_TOOLS_REPLAY_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include "outbox.h"

extern const char *const replay_state_names[OUTBOX_STATE_COUNT];
#define STATE_BIT(s) (1u << (s))

typedef enum command { CMD_NONE = -1, CMD_LIST, CMD_SHOW, CMD_STATS, CMD_REQUEUE, CMD_PURGE, CMD_COUNT } command;
extern const char *const replay_command_names[CMD_COUNT];

/* Limits of option values. */
#define LIMIT_MAX 1000000
#define BATCH_MAX 100000
#define THRESHOLD_MAX 1000000000
#define REASON_MAX 1024
/* Stays well below SQLite's limit on host parameters (32766). */
#define IDS_MAX 10000
#define TOP_MAX 1000000

enum optid {
    O_DB,
    O_STATE,
    O_TOPIC,
    O_KEY,
    O_ID,
    O_ID_PREFIX,
    O_SINCE,
    O_UNTIL,
    O_DRY_RUN,
    O_YES,
    O_FORCE,
    O_REASON,
    O_JSON,
    O_LIMIT,
    O_BATCH,
    O_THRESHOLD,
    O_LOG_FORMAT,
    O_BY_TOPIC,
    O_DB_DIR,
    O_DB_GLOB,
    O_TOP,
    O_COUNT
};

/* Every string points into argv, which must outlive the options. */
typedef struct replay_options {
    command cmd;
    const char *db;
    const char *show_id;
    unsigned states; /* STATE_BIT() of every --state; 0 when none was given */
    const char *topic, *key;
    const char *id_prefix;
    /* The smallest string above every id that starts with id_prefix: ids
     * are printable ASCII, so the prefix with its last byte incremented. */
    char id_prefix_end[OUTBOX_ID_MAX + 1];
    const char **ids; /* owned here */
    size_t nids;
    int has_since, has_until;
    int64_t since, until;
    const char *since_arg, *until_arg;
    const char *reason;
    int dry_run, yes, force, json;
    int by_topic; /* stats: the counts by topic x state too (a pass over the rows) */
    /* stats --db-dir: every file of the directory (not its subdirectories)
     * whose name matches one of globs (default "*.db"), instead of --db;
     * the top databases by backlog. */
    const char *db_dir;
    const char **globs; /* owned here; nglobs of them, 0 when --db-glob was not given */
    size_t nglobs;
    int64_t top;        /* --top: the databases shown (default 20) */
    /* --log-format: the sink of the messages on stderr; NULL (not given)
     * for plain "outbox-replay: ..." lines. */
    outbox_log_fn log;
    int64_t limit, batch, threshold;
    int seen[O_COUNT];
    /* After REPLAY_ARGS_ERROR: what was wrong, without the program name;
     * owned here. NULL when even the message could not be allocated. */
    char *error;
} replay_options;

enum replay_args_result {
    REPLAY_ARGS_GO_ON,    /* o is filled and consistent: run the subcommand */
    REPLAY_ARGS_HELP,     /* --help, -h or "help": the usage on stdout, exit 0 */
    REPLAY_ARGS_NO_ARGS,  /* no arguments at all: the usage on stderr, exit 2 */
    REPLAY_ARGS_VERSION,  /* --version or -V */
    REPLAY_ARGS_ERROR,    /* a usage error, described in o->error; exit 2 */
    REPLAY_ARGS_NOMEM,    /* out of memory; exit 1 */
};

/* Fills o (zeroed first) from argv[1..argc-1]. Release it with
 * replay_args_finish() whatever the result. */
enum replay_args_result replay_args_parse(replay_options *o, int argc, char **argv);
void replay_args_finish(replay_options *o);

/* TIME as --since and --until take it (ISO-8601 with a zone, a date, or
 * unix milliseconds) into unix ms. Returns 0, or -1 with *why set. */
int replay_parse_time(const char *s, int64_t *out, const char **why);
/* ISO-8601 UTC with milliseconds: 2026-11-29T10:00:00.123Z. */
const char *replay_fmt_time(int64_t ms, char buf[96]);

#endif
