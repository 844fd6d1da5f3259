/*
 * outbox-replay's messages and its text for humans (replay.h).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "util/util.h"
#include "replay.h"

outbox_log_fn replay_log;

void replay_errorf(const char *fmt, ...)
{
    static const char warning[] = "warning: ";
    char text[OUTBOX__LOG_LINE_MAX], q[OUTBOX__LOG_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    if (!replay_log) {
        fprintf(stderr, "%s: ", REPLAY_PROG);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
    } else {
        int warn;
        vsnprintf(text, sizeof text, fmt, ap);
        warn = !strncmp(text, warning, sizeof warning - 1);
        outbox__logfmt_quote(q, sizeof q, warn ? text + sizeof warning - 1 : text);
        outbox__log(&(outbox__logger){replay_log, NULL, OUTBOX_LOG_DEBUG}, warn ? OUTBOX_LOG_WARN : OUTBOX_LOG_ERROR,
                    "msg=%s", q);
    }
    va_end(ap);
}

int replay_finish_output(void)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        replay_errorf("cannot write the output: %s", strerror(errno));
        return EXIT_FAIL;
    }
    return EXIT_OK;
}

int replay_emit(outbox__sbuf *b)
{
    if (b->oom) {
        replay_errorf("out of memory");
        outbox__sbuf_reset(b);
        return -1;
    }
    if (b->len)
        fwrite(b->p, 1, b->len, stdout);
    outbox__sbuf_reset(b);
    return 0;
}

void replay_print_clean(FILE *f, const unsigned char *s, size_t n, int keep_lines)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp = 0;
        size_t l = outbox__utf8_seq(s + i, n - i, &cp);
        if (l == 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0) || cp == '\\') {
            if (l != 0 && keep_lines && (cp == '\n' || cp == '\t'))
                putc((int)cp, f);
            else if (cp == '\\' && l == 1)
                fputs("\\\\", f);
            else if (l == 0)
                fprintf(f, "\\x%02x", s[i]);
            else
                for (size_t k = 0; k < l; k++)
                    fprintf(f, "\\x%02x", s[i + k]);
            i += l ? l : 1;
            continue;
        }
        fwrite(s + i, 1, l, f);
        i += l;
    }
}

const char *replay_fmt_dur(int64_t ms, char buf[32])
{
    int64_t s;
    if (ms < 0)
        ms = -ms;
    s = ms / 1000;
    if (ms < 1000)
        snprintf(buf, 32, "%" PRId64 "ms", ms);
    else if (s < 60)
        snprintf(buf, 32, "%.1fs", (double)ms / 1000.0);
    else if (s < 3600)
        snprintf(buf, 32, "%" PRId64 "m%02" PRId64 "s", s / 60, s % 60);
    else if (s < 86400)
        snprintf(buf, 32, "%" PRId64 "h%02" PRId64 "m", s / 3600, s % 3600 / 60);
    else
        snprintf(buf, 32, "%" PRId64 "d%02" PRId64 "h", s / 86400, s % 86400 / 3600);
    return buf;
}

const char *replay_plural(int64_t n, const char *one, const char *many)
{
    return n == 1 ? one : many;
}
