/*
 * cluster_env_int.h: what the three files of the cluster environment share
 * (cluster_env.h says which holds what). Not for the tests themselves.
 */
#ifndef OUTBOX_TESTS_CLUSTER_ENV_INT_H
#define OUTBOX_TESTS_CLUSTER_ENV_INT_H

#include "cluster_env.h"

/* cluster_query.c */

/* One command on node i; the reply (the caller frees it), or NULL when the
 * node is not running or does not answer. */
redisReply *ce__node_cmd(const ce_env *e, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* ce__node_cmd for a command that must answer +OK; 0, or -1 with a
 * diagnostic. */
int ce__node_ok(const ce_env *e, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* How every running node sees node i: 1 if each has it with flags that
 * contain want and none that contain "fail" (with its link connected
 * unless it is the node itself). */
int ce__everyone_sees(const ce_env *e, int i, const char *want);

/* cluster_env.c */

/* Runs redis-cli with the given --cluster arguments (NULL-terminated, at
 * most 32), with --tls on a TLS cluster and -a when the cluster has a
 * password; 0 on exit status 0, else -1 with the output as diagnostics. */
int ce__run_cli(const ce_env *e, const char *const *args);
/* The address redis-cli is given for node i (its TLS port under TLS), in
 * buf (at least 32 bytes); returns buf. */
char *ce__cli_addr(const ce_env *e, int i, char *buf);

#endif
