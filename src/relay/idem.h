/*
 * idem.h: idempotent publishing (internal), the relay's --idempotent mode.
 *
 * One server-side script call per stream per batch appends the batch's
 * messages in order, each only if its publish marker does not exist yet,
 * and sets the marker (value: the entry id) for `retention` ms. A message
 * published twice within the retention (the crash window between XADD and
 * the row's mark) is appended once; the second call returns the original
 * entry id. After the first failing XADD of a call, the rest of the call is
 * held back, so a later message can never be appended before an earlier one.
 *
 * Key layout: <prefix>idem:{<stream>}:<message id>[:r<replay count>]. The
 * stream name is the hash tag, so the stream and its markers share a Redis
 * Cluster slot. Where braces in the prefix or the topic would make that key
 * hash elsewhere ("{eu}orders" hashes "eu"), the marker starts with a tag of
 * the stream's slot instead: {<the stream's hashed part>}<prefix>idem:
 * <stream>:<id>..., or, when that part holds a '}', {<a short tag found for
 * the slot>}... (outbox__idem_marker). A message resent with outbox-replay
 * has a new replay count, so the resend is published again.
 *
 * Redis 8.6 and later have XADD ... IDMP for the same purpose. The publish
 * path is chosen in one place (the relay's send_idem()), where a native
 * path for servers that offer it can be added; this version always uses the
 * script, which is what Redis 7 (Debian's) supports.
 */
#ifndef OUTBOX_SRC_IDEM_H
#define OUTBOX_SRC_IDEM_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

extern const char outbox__idem_lua[];

typedef struct outbox__idem_msg {
    const char *id;
    int64_t replay_count;
    const char *env;
    size_t envlen;
} outbox__idem_msg;

/* The marker key of a message (malloc'd; NULL without memory): always in
 * the slot of stream. */
char *outbox__idem_marker(const char *prefix, const char *stream, const char *id, int64_t replay_count);

/* Formats one EVALSHA (sha non-NULL) or EVAL call for n messages of one
 * stream into *cmd (malloc'd, free()). Returns its length or -1. */
long outbox__idem_format(char **cmd, const char *sha, const char *prefix, const char *stream, const char *db,
                         uint64_t retention_ms, uint64_t maxlen, const outbox__idem_msg *msgs, size_t n);

/* One message's result from the script's reply array. */
typedef enum outbox__idem_result {
    OUTBOX_IDEM_APPENDED, /* newly appended; entry id in *entry */
    OUTBOX_IDEM_DUPLICATE, /* already appended before; original entry id in *entry */
    OUTBOX_IDEM_ERROR     /* an error (or held back): text in *entry */
} outbox__idem_result;

/* Interprets element i of a script reply. *entry points into the reply. */
outbox__idem_result outbox__idem_element(const redisReply *el, const char **entry, size_t *len);

#endif
