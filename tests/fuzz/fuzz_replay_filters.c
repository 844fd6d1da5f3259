/* libFuzzer target: outbox-replay's command line (tools/replay/args.c): the
 * subcommand, the filters (--state, --topic, --key, --id, --id-prefix,
 * --since, --until with ISO-8601 times or unix ms), the numbers (--batch,
 * --threshold, --limit, --top) and stats over a directory (--db-dir,
 * --db-glob).
 *
 * The input is NUL-separated arguments after the program name. An error must
 * come with a message; an accepted command line must be consistent (what
 * the SQL built from it relies on); and every time the parser accepts must
 * come back unchanged through the tool's own formatting. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"

/* 0000-01-01T00:00:00Z and 10000-01-01T00:00:00Z in unix ms: the years
 * that replay_fmt_time() writes with four digits. */
#define ISO_MIN (-62167219200000LL)
#define ISO_END 253402300800000LL

static void check(int ok)
{
    if (!ok)
        __builtin_trap();
}

static void check_time(const char *s)
{
    int64_t t, back;
    const char *why;
    char buf[96];
    if (replay_parse_time(s, &t, &why) != 0) {
        check(why != NULL && *why);
        return;
    }
    if (t >= ISO_MIN && t < ISO_END) {
        check(replay_parse_time(replay_fmt_time(t, buf), &back, &why) == 0);
        check(back == t);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *args = malloc(size + 1), **argv = calloc(size + 3, sizeof *argv);
    replay_options o;
    int argc = 1;

    if (!args || !argv)
        goto out;
    memcpy(args, data, size);
    args[size] = '\0';
    argv[0] = "outbox-replay";
    for (size_t i = 0; size && i <= size;) {
        argv[argc++] = args + i;
        i += strlen(args + i) + 1;
    }
    for (int i = 1; i < argc; i++)
        check_time(argv[i]);

    switch (replay_args_parse(&o, argc, argv)) {
    case REPLAY_ARGS_GO_ON:
        check(o.error == NULL);
        check(o.cmd > CMD_NONE && o.cmd < CMD_COUNT);
        /* One database or, for stats only, one directory of them. */
        check(!!(o.db && *o.db) != !!(o.db_dir && *o.db_dir));
        check(!o.db_dir || o.cmd == CMD_STATS);
        check(!o.db_dir || (!o.states && !o.nids && !o.topic && !o.key && !o.id_prefix && !o.has_since &&
                            !o.has_until && !o.by_topic));
        check(o.db_dir || !o.nglobs);
        check(o.nglobs < (size_t)argc);
        for (size_t i = 0; i < o.nglobs; i++)
            check(*o.globs[i] && !strchr(o.globs[i], '/'));
        check(o.top >= 1 && o.top <= TOP_MAX);
        check(o.cmd != CMD_SHOW || o.show_id);
        check(o.cmd != CMD_REQUEUE || o.reason);
        check(o.cmd != CMD_PURGE || (o.states & ~STATE_BIT(OUTBOX_STATE_DEAD)) == 0);
        check(o.states < STATE_BIT(OUTBOX_STATE_COUNT));
        check(o.nids <= IDS_MAX && o.nids < (size_t)argc);
        check(!o.has_since || !o.has_until || o.since < o.until);
        check(o.batch >= 1 && o.batch <= BATCH_MAX);
        check(o.threshold >= 0 && o.threshold <= THRESHOLD_MAX);
        check(o.limit >= 0 && o.limit <= LIMIT_MAX);
        if (o.id_prefix) {
            /* Every id with the prefix sorts in [prefix, prefix_end). */
            check(strlen(o.id_prefix_end) == strlen(o.id_prefix));
            check(strcmp(o.id_prefix, o.id_prefix_end) < 0);
        }
        break;
    case REPLAY_ARGS_ERROR:
        check(o.error != NULL && *o.error);
        break;
    case REPLAY_ARGS_HELP:
    case REPLAY_ARGS_VERSION:
    case REPLAY_ARGS_NO_ARGS:
    case REPLAY_ARGS_NOMEM:
        break;
    default:
        check(0);
    }
    replay_args_finish(&o);
out:
    free(args);
    free(argv);
    return 0;
}
