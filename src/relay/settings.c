/*
 * settings.c: the relay's settings (settings_table.h), their defaults and
 * their checks.
 */
#include <stdio.h>
#include <string.h>

#include "relay_int.h"
#include "settings_table.h"

#define ROW(name, type, field, flags, def, min, max, arg, shown, help)                                                \
    {name, OUTBOX__OPT_##type, #field, offsetof(outbox_relay_settings, field), flags, min, max, arg, shown, help},
const outbox__relay_option outbox__relay_options[] = {OUTBOX__RELAY_SETTINGS(ROW)};
#undef ROW
const size_t outbox__relay_noptions = OUTBOX_ARRAY_LEN(outbox__relay_options);

const outbox__relay_option *outbox__relay_option_find(const char *name)
{
    size_t i;
    for (i = 0; i < outbox__relay_noptions; i++)
        if (strcmp(outbox__relay_options[i].name, name) == 0)
            return &outbox__relay_options[i];
    return NULL;
}

uint64_t outbox__relay_option_get(const outbox_relay_settings *s, const outbox__relay_option *o)
{
    return outbox__option_get(s, o);
}

void outbox__relay_option_set(outbox_relay_settings *s, const outbox__relay_option *o, uint64_t v)
{
    outbox__option_set(s, o, v);
}

int outbox__relay_option_in_range(const outbox__relay_option *o, uint64_t v)
{
    return outbox__option_in_range(o, v);
}

void outbox__relay_option_range(const outbox__relay_option *o, char *buf, size_t len)
{
    outbox__option_range(o, buf, len);
}

const char *outbox__relay_tls_option_given(const outbox_relay_settings *s)
{
    size_t i;
    for (i = 0; i < outbox__relay_noptions; i++) {
        const outbox__relay_option *o = &outbox__relay_options[i];
        if (strncmp(o->field, "tls.", 4) != 0)
            continue;
        if (o->type == OUTBOX__OPT_STR ? *(const char *const *)((const char *)s + o->off) != NULL
                                       : outbox__relay_option_get(s, o) != 0)
            return o->name;
    }
    return NULL;
}

void outbox_relay_defaults(outbox_relay_settings *s)
{
    memset(s, 0, sizeof *s);
#define DEFAULT(name, type, field, flags, def, ...) s->field = def;
    OUTBOX__RELAY_SETTINGS(DEFAULT)
#undef DEFAULT
    s->log = outbox_log_stderr;
}

static uint64_t derived(uint64_t set, uint64_t lease_ms, uint64_t div, uint64_t max)
{
    if (set)
        return set;
    return lease_ms / div < max ? lease_ms / div : max;
}

uint64_t outbox__relay_reply_timeout(const outbox_relay_settings *s)
{
    return derived(s->reply_timeout_ms, s->lease_ms, OUTBOX__REPLY_TIMEOUT_LEASE_DIV, OUTBOX__REPLY_TIMEOUT_MAX_MS);
}

uint64_t outbox__relay_wait_timeout(const outbox_relay_settings *s)
{
    return derived(s->wait_timeout_ms, s->lease_ms, OUTBOX__WAIT_TIMEOUT_LEASE_DIV, OUTBOX__WAIT_TIMEOUT_MAX_MS);
}

void outbox__relay_settings_resolve(outbox_relay_settings *s)
{
    s->reply_timeout_ms = outbox__relay_reply_timeout(s);
    s->wait_timeout_ms = outbox__relay_wait_timeout(s);
}

int outbox__relay_check_settings(const outbox_relay_settings *s, char *err, size_t errlen)
{
    int e = outbox__option_check(s, outbox__relay_options, outbox__relay_noptions, err, errlen);
    uint64_t wait = outbox__relay_wait_timeout(s);
    if (e != 0)
        return e;
    if (s->backoff_min_ms > s->backoff_max_ms)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "backoff-min-ms/backoff-max-ms: need min (%llu) <= max (%llu)",
                            (unsigned long long)s->backoff_min_ms, (unsigned long long)s->backoff_max_ms);
    if (!s->stream_prefix || strlen(s->stream_prefix) > 128 || strpbrk(s->stream_prefix, "{} \t\r\n"))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "stream-prefix: must be at most 128 bytes without braces or spaces");
    /* Only a timeout set explicitly can contradict the lease (see
     * settings_table.h). WAIT is only sent with wait_replicas; without it
     * its timeout does not delay a reply. */
    if (s->wait_replicas && s->wait_timeout_ms && s->wait_timeout_ms >= s->lease_ms / 2)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "wait-timeout-ms %llu must be below half of lease-ms %llu",
                            (unsigned long long)s->wait_timeout_ms, (unsigned long long)s->lease_ms);
    if (s->reply_timeout_ms && s->reply_timeout_ms + (s->wait_replicas ? wait : 0) >= s->lease_ms) {
        char plus[64] = "";
        if (s->wait_replicas)
            snprintf(plus, sizeof plus, " plus wait-timeout-ms %llu", (unsigned long long)wait);
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "reply-timeout-ms %llu%s must be below lease-ms %llu, so that a stuck connection is "
                            "given up before its leases expire",
                            (unsigned long long)s->reply_timeout_ms, plus, (unsigned long long)s->lease_ms);
    }
    if (s->worker_id && (!*s->worker_id || strlen(s->worker_id) > 200))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "worker-id: must be 1..200 bytes");
    if (s->db_name) {
        const unsigned char *c = (const unsigned char *)s->db_name;
        if (!*c || strlen(s->db_name) > 200)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "db_name: must be 1..200 bytes");
        for (; *c; c++)
            if (*c < 0x20 || *c == 0x7f)
                return outbox__errf(err, errlen, OUTBOX_EINVAL, "db_name: control bytes are not allowed");
        if (strchr(s->db_name, ':'))
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "db_name: ':' is not allowed (it ends the name in dedup keys and markers)");
    }
    if (s->stream_template) {
        const char *t = s->stream_template, *db = strstr(t, "%db"), *tp = strstr(t, "%topic");
        size_t n = strlen(t), pct = 0;
        for (const char *p = t; *p; p++)
            pct += *p == '%';
        if (!s->db_dir)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "stream-template: needs db-dir (it names databases)");
        if (!db || !tp || strstr(db + 1, "%db") || tp != t + n - 6 || db > tp || pct != 2 || n > 120 ||
            strpbrk(t, "{} \t\r\n"))
            return outbox__errf(err, errlen, OUTBOX_EINVAL,
                                "stream-template: '%s' must hold %%db once and end with %%topic, with no other '%%', "
                                "no braces or spaces, at most 120 bytes",
                                t);
    }
    if (s->idempotent && s->wait_replicas)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "idempotent and wait-replicas cannot be combined in this version");
    if (s->metrics_web_config && !s->metrics_listen)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "metrics-web-config: given without metrics-listen (it configures that endpoint)");
    if (s->metrics_listen) {
        struct sockaddr_storage ss;
        char why[200];
        if (outbox__http_parse_listen(s->metrics_listen, &ss, why, sizeof why) != 0)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "metrics-listen: %s", why);
    }
    return 0;
}
