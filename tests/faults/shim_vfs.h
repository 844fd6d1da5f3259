/*
 * shim_vfs.h: a fault-injecting VFS over the default one, for tests.
 */
#ifndef OUTBOX_TESTS_FAULTS_SHIM_VFS_H
#define OUTBOX_TESTS_FAULTS_SHIM_VFS_H

#include <stdatomic.h>

#include <sqlite3.h>

/* The start of a shim's file: the real VFS's file follows the struct (the
 * VFS's szOsFile covers both), and real points to it. A shim of its own may
 * put more after `real` by embedding this first. */
typedef struct shim_file {
    sqlite3_file base;
    sqlite3_file *real;
} shim_file;

/* Fills io with methods that pass every call on to the file's real one
 * (iVersion 3), for a shim to override the ones it changes. */
void shim_io_forward(sqlite3_io_methods *io);

/* Registers the shim as `name` (a static string), over the default VFS of
 * the moment; make_default makes it the default for connections opened
 * afterwards. Once per process; bails on error. */
void shim_register(const char *name, int make_default);

/* Remaining failures (> 0: fail the call and decrement) and the code a
 * failed write returns (SQLITE_IOERR_WRITE unless set). */
extern atomic_long write_fail_left, sync_fail_left;
extern atomic_int write_fail_code;
/* Counters of calls and of the failures injected. */
extern atomic_long writes_failed, syncs_failed, writes_total, syncs_total;
/* Added to every xSync that does not fail, in microseconds (0: none). */
extern atomic_long sync_delay_us;

/* No more failures (the delay stays). */
void faults_off(void);

#endif
