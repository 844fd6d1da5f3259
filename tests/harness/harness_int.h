/*
 * harness_int.h: what the harness's files share that the tests do not use.
 */
#ifndef OUTBOX_TESTS_HARNESS_INT_H
#define OUTBOX_TESTS_HARNESS_INT_H

#include <sys/types.h>

/*
 * Forks and execs argv with stdin from /dev/null and stdout/stderr on the
 * given descriptors (-1: inherit); with die_with_parent the child gets
 * SIGTERM when the test process dies. Returns the pid or -1 (exec failed;
 * the reason is printed as a TAP comment).
 */
pid_t th__spawn_fds(char *const argv[], char *const env_add[], int out_fd, int err_fd, int die_with_parent);
/* Records a child for the clean-up at exit (see harness_proc.c); th_wait
 * forgets it when it reaps it. Bails when too many are running. */
void th__track_pid(pid_t pid);

#endif
