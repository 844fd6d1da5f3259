/*
 * outbox-replay: inspection of the outbox table, and audited manual resends
 * (requeue) and deletions (purge), safe beside a running relay.
 *
 * Everything is plain SQL on the application's database, opened with the
 * library's outbox_db_open() and checked with outbox_schema_check(). The
 * read-only subcommands and every --dry-run use a read-only connection, so
 * they cannot change the file even by mistake. Changes run in short
 * BEGIN IMMEDIATE transactions of --batch rows, walked in seq order with a
 * cursor: the relay and the application get the write lock between batches,
 * and the whole run is one pass over the table whatever the number of
 * batches. Every filter value is a bound parameter.
 */
#include <stdio.h>

#include "replay.h"

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: %s SUBCOMMAND --db PATH [filters] [options]\n"
            "       %s stats --db-dir DIR [--db-glob PATTERN]... [--top N] [--json]\n"
            "       %s --help | --version\n"
            "\n"
            "Inspects the outbox table, resends messages by hand (requeue, audited in the row)\n"
            "and deletes dead ones (purge), safely beside a running relay.\n"
            "\n"
            "Subcommands:\n"
            "  list          Messages matching the filters, in commit (seq) order: id, state,\n"
            "                topic, key, attempts, last error, lease owner and expiry, created\n"
            "                and published times, replay count. Read-only. Exits 0 also when\n"
            "                nothing matches (prints nothing, or [] with --json).\n"
            "  show ID       One message in full: the columns above plus available/replay times,\n"
            "                replay reason, stream id, headers decoded from msgpack to JSON, and\n"
            "                the payload as text if it is valid UTF-8, else as base64 (a field\n"
            "                says which). Read-only. Exit 1 with \"no message with id ID\" if none.\n"
            "                An ID that starts with '-' goes after '--': show --db PATH -- -ID\n"
            "  stats         Counts by state, due and waiting pending rows, the age of the oldest\n"
            "                due pending row, live and expired leases, dead count; with\n"
            "                --by-topic also by topic x state. Read-only; the filters narrow what\n"
            "                is counted. Without filters, or with --state only, every figure comes\n"
            "                from the batch records, the cursor and the indexes: its cost does not\n"
            "                grow with the table. --by-topic, --topic, --key, --since and --until\n"
            "                count the rows themselves, a pass over the whole table in one read\n"
            "                transaction (with --id or --id-prefix only over the matching rows).\n"
            "                With --db-dir DIR instead of --db: every file of DIR (not of its\n"
            "                subdirectories) that matches a --db-glob, each opened read-only and\n"
            "                read from its figures (no pass over any table): a table of the --top\n"
            "                databases with the most pending rows (name: the file name without\n"
            "                .db; pending, due, sending, published, dead, the age of the oldest\n"
            "                due pending row), the totals over all of them, and how many were\n"
            "                read and could not be. A file that cannot be read (not a database,\n"
            "                corrupt, without the outbox schema, unreadable) is named on stderr\n"
            "                with the reason, and the others are still read. No filters.\n"
            "  requeue       Puts the selected messages back to pending, due now: state 0,\n"
            "                available_at now, attempts 0, last_error and lease cleared,\n"
            "                replay_count + 1, replayed_at now, replay_reason = --reason\n"
            "                (required). Without --state it selects dead, published and sending\n"
            "                messages; pending ones only with --state pending (they become due\n"
            "                now with attempts 0). A sending message whose lease has not expired\n"
            "                is skipped and counted unless --force, which takes it and\n"
            "                increments lease_token, so the old holder's late marks (fenced on\n"
            "                owner and token) are refused; sending messages with an expired lease\n"
            "                are taken without --force (also with lease_token + 1).\n"
            "  purge         Deletes dead messages (state 3) matching the filters; never any other.\n"
            "\n"
            "Filters (every filter given must match; repeated --state or --id match any of\n"
            "their values; values are bound SQL parameters):\n"
            "  --state STATE       pending, sending, published or dead (purge: only dead)\n"
            "  --topic T           exact topic\n"
            "  --key K             exact ordering key\n"
            "  --id ID             exact message id (repeatable, up to %d)\n"
            "  --id-prefix P       ids that start with P\n"
            "  --since TIME        created_at >= TIME\n"
            "  --until TIME        created_at < TIME (must be after --since)\n"
            "  TIME is ISO-8601 with a zone, 2026-11-29T10:00:00Z or\n"
            "  2026-11-29T10:00:00.123+02:00; a date, 2026-11-29 (midnight UTC); or unix\n"
            "  milliseconds, 1795946400000 (= 2026-11-29T10:00:00Z).\n"
            "\n"
            "Options:\n"
            "  --db PATH           SQLite database holding the outbox table (required)\n"
            "  --json              machine-readable output on stdout: list prints one JSON array of\n"
            "                      message objects; show, stats, requeue and purge print one JSON\n"
            "                      object (with --dry-run it holds the array \"rows\"). Times are\n"
            "                      ISO-8601 UTC strings plus *_ms unix milliseconds; strings are\n"
            "                      escaped, invalid UTF-8 bytes become U+FFFD.\n"
            "  --limit N           list: show at most N messages, 0 for all (default 100)\n"
            "  --by-topic          stats: the counts by topic x state too (\"by_topic\" in --json);\n"
            "                      reads every row that the filters select\n"
            "  --db-dir DIR        stats: every database of the directory DIR instead of --db (see\n"
            "                      stats above); --json prints one object with \"databases\" (the\n"
            "                      --top ones), \"totals\" and \"failed\" (name and error of each)\n"
            "  --db-glob PATTERN   with --db-dir: the files read, a shell pattern of file names\n"
            "                      (fnmatch; a leading dot only matched by a dot); repeatable, any\n"
            "                      of them matches (default *.db); SQLite's -wal, -shm and -journal\n"
            "                      files are never read\n"
            "  --top N             with --db-dir: the databases shown, 1..%d (default 20)\n"
            "  --reason TEXT       requeue: why (required, 1..%d bytes of UTF-8); stored in\n"
            "                      replay_reason and visible in show\n"
            "  --dry-run           requeue, purge: print exactly the rows that would change and what\n"
            "                      would happen to each, change nothing\n"
            "  --yes               requeue, purge: confirm touching more than --threshold messages\n"
            "  --threshold N       requeue, purge: messages that may be touched without --yes\n"
            "                      (default 100)\n"
            "  --force             requeue: also take sending messages whose lease is live\n"
            "  --batch N           requeue, purge: messages per transaction (BEGIN IMMEDIATE ...\n"
            "                      COMMIT, in seq order), 1..%d (default 500)\n"
            "  --log-format FORMAT messages on stderr as log lines: logfmt, or json for one JSON\n"
            "                      object per line (ts, level, msg); without it they are plain\n"
            "                      \"outbox-replay: ...\" lines\n"
            "  -h, --help          show this help\n"
            "  -V, --version       show the version\n"
            "\n"
            "Beside a live relay: list, show, stats and --dry-run open the database read-only;\n"
            "requeue and purge hold the write lock for one batch at a time (waiting up to 5 s for\n"
            "it), show progress on stderr when it is a terminal, and stop after the current batch\n"
            "on SIGINT or SIGTERM (committed batches stay; run again to continue).\n"
            "\n"
            "Exit status: 0 done; 1 nothing matches (requeue, purge), no such message (show),\n"
            "some database of --db-dir could not be read (stats, the others shown), interrupted,\n"
            "or a runtime error such as a database locked for too long; 2 usage or\n"
            "configuration error: unknown subcommand or option, bad value, missing --db, --db\n"
            "with --db-dir, a --db-dir that is not a directory, a file that is not a SQLite\n"
            "database or has no outbox schema (run 'outbox-relay init'), more than --threshold\n"
            "messages without --yes. Nothing is changed on any error found before the first\n"
            "batch.\n",
            REPLAY_PROG, REPLAY_PROG, REPLAY_PROG, IDS_MAX, TOP_MAX, REASON_MAX, BATCH_MAX);
}

int main(int argc, char **argv)
{
    replay_options o;
    int rc;

    enum replay_args_result parsed = replay_args_parse(&o, argc, argv);
    /* Also for a usage error after --log-format. */
    replay_log = o.log;
    switch (parsed) {
    case REPLAY_ARGS_GO_ON:
        break;
    case REPLAY_ARGS_HELP:
        usage(stdout);
        replay_args_finish(&o);
        return EXIT_OK;
    case REPLAY_ARGS_NO_ARGS:
        usage(stderr);
        replay_args_finish(&o);
        return EXIT_USAGE;
    case REPLAY_ARGS_VERSION:
        printf("%s %s (liboutbox %s)\n", REPLAY_PROG, OUTBOX_VERSION_STRING, outbox_version());
        replay_args_finish(&o);
        return EXIT_OK;
    case REPLAY_ARGS_NOMEM:
        replay_errorf("out of memory");
        replay_args_finish(&o);
        return EXIT_FAIL;
    case REPLAY_ARGS_ERROR:
    default:
        replay_errorf("%s", o.error ? o.error : "out of memory");
        replay_args_finish(&o);
        return EXIT_USAGE;
    }
    switch (o.cmd) {
    case CMD_LIST:
        rc = replay_cmd_list(&o);
        break;
    case CMD_SHOW:
        rc = replay_cmd_show(&o);
        break;
    case CMD_STATS:
        rc = o.db_dir ? replay_cmd_stats_dir(&o) : replay_cmd_stats(&o);
        break;
    case CMD_REQUEUE:
    case CMD_PURGE:
        rc = replay_cmd_change(&o);
        break;
    default:
        rc = EXIT_USAGE;
    }
    replay_args_finish(&o);
    return rc;
}
