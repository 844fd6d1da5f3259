/*
 * tap.h: a minimal TAP producer for the test executables (meson runs them
 * with protocol 'tap'). Each check prints "ok N - ..." or "not ok N - ...";
 * tap_done() prints the plan and returns the exit status.
 */
#ifndef OUTBOX_TESTS_TAP_H
#define OUTBOX_TESTS_TAP_H

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tap_count_;
static int tap_failed_;

static inline int tap_check_(int cond, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int tap_check_(int cond, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    char desc[2048];
    tap_count_++;
    va_start(ap, fmt);
    vsnprintf(desc, sizeof desc, fmt, ap);
    va_end(ap);
    /* One line per check: a description that quotes program output must
     * not break the TAP stream. */
    for (char *p = desc; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    printf("%sok %d - %s\n", cond ? "" : "not ", tap_count_, desc);
    if (!cond) {
        tap_failed_++;
        printf("#   failed at %s:%d\n", file, line);
    }
    fflush(stdout);
    return cond;
}

#define ok(cond, ...) tap_check_(!!(cond), __FILE__, __LINE__, __VA_ARGS__)
#define is_int(got, want, ...)                                                                     \
    do {                                                                                           \
        long long got_ = (long long)(got), want_ = (long long)(want);                             \
        if (!tap_check_(got_ == want_, __FILE__, __LINE__, __VA_ARGS__))                           \
            printf("#   got %lld, want %lld\n", got_, want_);                                      \
    } while (0)
#define is_str(got, want, ...)                                                                     \
    do {                                                                                           \
        const char *got_ = (got), *want_ = (want);                                                 \
        int same_ = (got_ && want_) ? strcmp(got_, want_) == 0 : got_ == want_;                   \
        if (!tap_check_(same_, __FILE__, __LINE__, __VA_ARGS__))                                   \
            printf("#   got '%s', want '%s'\n", got_ ? got_ : "(null)", want_ ? want_ : "(null)"); \
    } while (0)
/* One check that cannot run here, reported as skipped with the reason
 * ("ok N # SKIP no IPv6 loopback"): it counts in the plan, never as a pass
 * of anything. */
static inline void tap_skip_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void tap_skip_(const char *fmt, ...)
{
    va_list ap;
    char why[1024];
    tap_count_++;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    for (char *p = why; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    printf("ok %d # SKIP %s\n", tap_count_, why);
    fflush(stdout);
}
#define skip(...) tap_skip_(__VA_ARGS__)
static inline void tap_diag_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void tap_diag_(const char *fmt, ...)
{
    va_list ap;
    char text[4096], *line, *next;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    /* Every line of a diagnostic is a TAP comment. */
    for (line = text; line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        if (next && !*next)
            next = NULL;
        printf("# %s\n", line);
    }
    fflush(stdout);
}
#define diag(...) tap_diag_(__VA_ARGS__)
/* Stops the test executable at once (setup failure). */
#define bail(...)                                                                                  \
    do {                                                                                           \
        printf("Bail out! ");                                                                      \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        fflush(stdout);                                                                            \
        exit(1);                                                                                   \
    } while (0)
/* Skips the whole executable (exit code 77 is meson's skip). */
#define skip_all(...)                                                                              \
    do {                                                                                           \
        printf("1..0 # SKIP ");                                                                    \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        fflush(stdout);                                                                            \
        exit(0);                                                                                   \
    } while (0)

static inline int tap_done(void)
{
    printf("1..%d\n", tap_count_);
    if (tap_failed_)
        printf("# %d of %d checks failed\n", tap_failed_, tap_count_);
    fflush(stdout);
    return tap_failed_ ? 1 : 0;
}

#endif
