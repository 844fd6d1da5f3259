/*
 * settings.c: the consumer-group helper's settings (settings_table.h), their
 * defaults and their checks.
 */
#include <stddef.h>
#include <string.h>

#include "consumer/settings_table.h"
#include "util/util.h"

#define ROW(name, type, field, flags, def, min, max, help)                                                            \
    {name, OUTBOX__OPT_##type, #field, offsetof(outbox_consumer_settings, field), flags, min, max, NULL, NULL, help},
const outbox__option outbox__consumer_options[] = {OUTBOX__CONSUMER_SETTINGS(ROW)};
#undef ROW
const size_t outbox__consumer_noptions = OUTBOX_ARRAY_LEN(outbox__consumer_options);

void outbox_consumer_defaults(outbox_consumer_settings *s)
{
    memset(s, 0, sizeof *s);
#define DEFAULT(name, type, field, flags, def, ...) s->field = def;
    OUTBOX__CONSUMER_SETTINGS(DEFAULT)
#undef DEFAULT
    s->dedup = OUTBOX_DEDUP_REDIS;
    s->log = outbox_log_stderr;
    outbox_tls_defaults(&s->tls);
}

int outbox__consumer_check_settings(const outbox_consumer_settings *s, char *err, size_t errlen)
{
    int e = outbox__option_check(s, outbox__consumer_options, outbox__consumer_noptions, err, errlen);
    if (e != 0)
        return e;
    if (s->dedup != OUTBOX_DEDUP_NONE && s->dedup != OUTBOX_DEDUP_REDIS && s->dedup != OUTBOX_DEDUP_SQLITE)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "dedup: unknown mode");
    if (s->dedup == OUTBOX_DEDUP_REDIS) {
        /* Checked here, not first when start() creates the dedup module:
         * the default namespace is "dedup:<group>". */
        const char *ns = s->key_namespace ? s->key_namespace : s->group;
        size_t nslen = strlen(ns) + (s->key_namespace ? 0 : 6);
        if (!*ns || nslen > 256 || strpbrk(ns, "{} "))
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "namespace: the dedup key namespace (default dedup:<group>) must be 1..256 bytes "
                                "without braces or spaces");
    }
    if (s->dedup == OUTBOX_DEDUP_SQLITE && (!s->inbox_db_path || !*s->inbox_db_path))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "inbox: the SQLite dedup mode needs an inbox database path");
    if (!s->handler)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "handler: required");
    return 0;
}
