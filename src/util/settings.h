/*
 * settings.h: the rows of a settings table (internal): one row per setting
 * of a settings struct, written once as an X-macro row (the relay's
 * relay/settings_table.h, the consumer's consumer/settings_table.h) and
 * expanded into an array of outbox__option, from which come the defaults,
 * the range checks and, for the relay, outbox-relay's options and --help.
 */
#ifndef OUTBOX_SRC_UTIL_SETTINGS_H
#define OUTBOX_SRC_UTIL_SETTINGS_H

#include <stddef.h>
#include <stdint.h>

/* The C type of a field (a table's type column). */
enum outbox__opt_type {
    OUTBOX__OPT_STR,   /* const char *, NULL when not set */
    OUTBOX__OPT_UINT,  /* unsigned */
    OUTBOX__OPT_U64,   /* uint64_t */
    OUTBOX__OPT_SIZE,  /* size_t */
    OUTBOX__OPT_FLAG,  /* int, 0 or 1 */
    OUTBOX__OPT_LEVEL, /* outbox_log_level */
};

/* A table's flags column. */
enum {
    OUTBOX__OPT_REQUIRED = 1, /* no default: must be given */
    OUTBOX__OPT_ZERO = 2,     /* 0 is accepted besides min..max */
};

/* One row of a table, as data. */
typedef struct outbox__option {
    const char *name;
    enum outbox__opt_type type;
    const char *field; /* the member's name, for the documentation checks */
    size_t off;        /* offsetof(the settings struct, field) */
    unsigned flags;
    /* A number's range; a string's length in bytes when it is given (both
     * 0: any). */
    uint64_t min, max;
    const char *arg, *shown, *help;
} outbox__option;

/* A number, flag or log level field of the settings at s as a number (0
 * for a string). */
uint64_t outbox__option_get(const void *s, const outbox__option *o);
/* Sets a number, flag or log level field; v must be in range. */
void outbox__option_set(void *s, const outbox__option *o, uint64_t v);
/* 1 when v is in o's range (min..max, or 0 with OUTBOX__OPT_ZERO). */
int outbox__option_in_range(const outbox__option *o, uint64_t v);
/* o's range as messages show it: "1..100000", or "1000..86400000, or 0". */
void outbox__option_range(const outbox__option *o, char *buf, size_t len);
/* Every setting of the table (n rows) within its range, the required
 * strings given, every string given within its length: 0, or OUTBOX_EINVAL
 * with err naming the setting ("batch: 0 is out of range 1..10000",
 * "stream: required, not given", "group: 300 bytes, need 1..200"). */
int outbox__option_check(const void *s, const outbox__option *opts, size_t n, char *err, size_t errlen);

#endif
