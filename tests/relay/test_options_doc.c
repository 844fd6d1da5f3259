/*
 * The relay's options are documented where they are written: every option
 * of the settings table (src/relay/settings_table.h) is in `outbox-relay
 * --help`, README.md's option table says the same as --help (the same
 * options, defaults and meanings, backticks aside), and the comment of each
 * field in include/outbox/relay.h (or, for the tls.* fields, in
 * include/outbox/tls.h) states the default that outbox_relay_defaults()
 * sets. A difference fails with the line to write.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "relay/settings_table.h"
#include "tap.h"

#define MAX_ENTRIES 128

/* One option as a document states it. */
typedef struct entry {
    char *left;    /* "--batch N" */
    char *meaning; /* without the default */
    char *def;     /* "512", "(required)", or "" when none is stated */
} entry;

typedef struct doc {
    entry e[MAX_ENTRIES];
    int n;
} doc;

static char *xstrndup(const char *s, size_t n)
{
    char *d = strndup(s, n);
    if (!d)
        bail("out of memory");
    return d;
}

/* s without backticks and with runs of white space as one space, trimmed. */
static char *plain(const char *s, size_t n)
{
    char *d = xstrndup(s, n), *w = d;
    const char *p;
    for (p = d; *p; p++) {
        if (*p == '`')
            continue;
        if (isspace((unsigned char)*p)) {
            if (w > d && w[-1] != ' ')
                *w++ = ' ';
            continue;
        }
        *w++ = *p;
    }
    while (w > d && w[-1] == ' ')
        w--;
    *w = '\0';
    return d;
}

static void doc_free(doc *d)
{
    for (int i = 0; i < d->n; i++) {
        free(d->e[i].left);
        free(d->e[i].meaning);
        free(d->e[i].def);
    }
    d->n = 0;
}

static const entry *doc_find(const doc *d, const char *left)
{
    for (int i = 0; i < d->n; i++)
        if (strcmp(d->e[i].left, left) == 0)
            return &d->e[i];
    return NULL;
}

/* Splits an option's text into meaning and default: it ends with
 * "(default X)" or "(required)". */
static void split_default(entry *e, const char *text)
{
    char *t = plain(text, strlen(text)), *open = strrchr(t, '(');
    size_t n = strlen(t);
    if (open && !strcmp(open, "(required)")) {
        e->def = xstrndup(open, strlen(open));
        *open = '\0';
    } else if (open && !strncmp(open, "(default ", 9) && t[n - 1] == ')') {
        e->def = xstrndup(open + 9, strlen(open) - 10);
        *open = '\0';
    } else {
        e->def = xstrndup("", 0);
    }
    e->meaning = plain(t, strlen(t));
    free(t);
}

/* --help's option lines: "  --name ARG" in 28 columns, then the text from
 * column 31 on, continued on lines indented by 30 spaces. Only options
 * starting with "--" (-h and -V are not in the README's table); the list
 * ends at the first blank line. */
static void parse_help(const char *out, doc *d)
{
    const char *line = strstr(out, "\nOptions"), *next;
    char text[2048] = "";
    entry *cur = NULL;

    for (line = line ? strchr(line + 1, '\n') : NULL; line && line[1] && line[1] != '\n'; line = next) {
        size_t len, used = strlen(text);
        line++;
        next = strchr(line, '\n');
        len = next ? (size_t)(next - line) : strlen(line);
        if (!next)
            next = line + len;
        if (cur && len > 30 && strspn(line, " ") >= 30) {
            snprintf(text + used, sizeof text - used, " %.*s", (int)(len - 30), line + 30);
            continue;
        }
        if (cur)
            split_default(cur, text);
        cur = NULL;
        if (len > 31 && !strncmp(line, "  --", 4) && d->n < MAX_ENTRIES) {
            cur = &d->e[d->n++];
            cur->left = plain(line + 2, 28);
            snprintf(text, sizeof text, "%.*s", (int)(len - 31), line + 31);
        }
    }
    if (cur)
        split_default(cur, text);
}

/* README.md's table under "| option | default | meaning |". */
static void parse_readme(const char *md, doc *d)
{
    const char *line = strstr(md, "\n| option | default | meaning |"), *next;
    if (!line)
        return;
    line = strchr(line + 1, '\n'); /* the separator line */
    for (line = line ? strchr(line + 1, '\n') : NULL; line && line[1] == '|'; line = next) {
        const char *cell[4];
        int k = 0;
        const char *p;
        line++;
        next = strchr(line, '\n');
        if (!next)
            next = line + strlen(line);
        for (p = line; p < next && k < 4; p++)
            if (*p == '|')
                cell[k++] = p;
        if (k < 4 || d->n == MAX_ENTRIES)
            continue;
        {
            const char *end = next;
            while (end > cell[3] && end[-1] != '|')
                end--;
            d->e[d->n].left = plain(cell[0] + 1, (size_t)(cell[1] - cell[0] - 1));
            d->e[d->n].def = plain(cell[1] + 1, (size_t)(cell[2] - cell[1] - 1));
            d->e[d->n].meaning = plain(cell[2] + 1, (size_t)(end - 1 - cell[2] - 1));
            d->n++;
        }
    }
}

static void check_readme(const doc *help, const doc *readme)
{
    int bad = 0;
    for (int i = 0; i < help->n; i++) {
        const entry *h = &help->e[i], *r = doc_find(readme, h->left);
        if (r && !strcmp(r->def, h->def) && !strcmp(r->meaning, h->meaning))
            continue;
        if (!r)
            diag("README.md lacks %s", h->left);
        else if (strcmp(r->def, h->def))
            diag("README.md: %s: default '%s', --help says '%s'", h->left, r->def, h->def);
        else
            diag("README.md: %s: meaning '%s', --help says '%s'", h->left, r->meaning, h->meaning);
        diag("  the row --help calls for: | `%s` | %s | %s |", h->left, h->def, h->meaning);
        bad++;
    }
    for (int i = 0; i < readme->n; i++)
        if (!doc_find(help, readme->e[i].left)) {
            diag("README.md has %s, which --help does not list", readme->e[i].left);
            bad++;
        }
    ok(bad == 0, "README.md's option table says what --help says (%d options, %d differences)", help->n, bad);
}

static void check_help_has_table(const doc *help)
{
    int bad = 0;
    for (size_t i = 0; i < outbox__relay_noptions; i++) {
        const outbox__relay_option *o = &outbox__relay_options[i];
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        if (!doc_find(help, left)) {
            diag("--help lacks %s", left);
            bad++;
        }
    }
    ok(bad == 0 && help->n > 0, "--help lists every option of the settings table (%zu)", outbox__relay_noptions);
}

/* The text of the comment that starts at c (its opening slash), without the leading
 * "*" of its continuation lines; *end is set past it. */
static char *comment_text(const char *c, const char **end)
{
    const char *e = strstr(c + 2, "*" "/");
    char *raw, *w, *t;
    const char *p;
    int line_start = 0;
    if (!e)
        e = c + strlen(c);
    *end = *e ? e + 2 : e;
    raw = w = xstrndup(c + 2, (size_t)(e - c - 2));
    for (p = raw; *p; p++) {
        if (*p == '\n')
            line_start = 1;
        else if (line_start && *p == '*') {
            line_start = 0;
            continue;
        } else if (!isspace((unsigned char)*p))
            line_start = 0;
        *w++ = *p;
    }
    *w = '\0';
    t = plain(raw, strlen(raw));
    free(raw);
    return t;
}

/* The comment that documents field in the struct type (typedef struct type
 * { ... } type;) of header h: the comment right before its declaration, or
 * one after it on the same line. NULL when there is none. */
static char *field_comment(const char *h, const char *type, const char *field)
{
    char open[128], close[128];
    const char *p, *end;
    char *pending = NULL;
    int found = 0;
    snprintf(open, sizeof open, "typedef struct %s {", type);
    snprintf(close, sizeof close, "} %s;", type);
    p = strstr(h, open);
    if (!p || !(end = strstr(p, close)))
        return NULL;
    p = strchr(p, '{') + 1;
    while (p < end) {
        const char *semi, *q, *name;
        size_t nlen;
        p += strspn(p, " \t\n");
        if (p >= end)
            break;
        if (!strncmp(p, "/*", 2)) {
            free(pending);
            pending = comment_text(p, &p);
            continue;
        }
        semi = strchr(p, ';');
        if (!semi || semi > end)
            break;
        /* The declarator: the last identifier before the ';'. */
        for (q = semi; q > p && !(isalnum((unsigned char)q[-1]) || q[-1] == '_'); q--)
            ;
        for (name = q; name > p && (isalnum((unsigned char)name[-1]) || name[-1] == '_'); name--)
            ;
        nlen = (size_t)(q - name);
        found = nlen == strlen(field) && !strncmp(name, field, nlen);
        p = semi + 1;
        /* A comment after it on the same line is its own. */
        q = p + strspn(p, " \t");
        if (!strncmp(q, "/*", 2)) {
            char *own = comment_text(q, &p);
            if (found) {
                free(pending);
                return own;
            }
            free(own);
        }
        if (found)
            return pending;
        free(pending);
        pending = NULL;
    }
    free(pending);
    return NULL;
}

/* "default VALUE" as relay.h must state it for o. */
static void expected_default(const outbox__relay_option *o, const outbox_relay_settings *d, char *buf, size_t len)
{
    static const char *const levels[] = {"OUTBOX_LOG_DEBUG", "OUTBOX_LOG_INFO", "OUTBOX_LOG_WARN",
                                         "OUTBOX_LOG_ERROR"};
    uint64_t v = outbox__relay_option_get(d, o);
    if (o->type == OUTBOX__OPT_STR) {
        const char *s = *(const char *const *)((const char *)d + o->off);
        if (s)
            snprintf(buf, len, "default \"%s\"", s);
        else
            snprintf(buf, len, "default NULL");
    } else if (o->type == OUTBOX__OPT_LEVEL) {
        snprintf(buf, len, "default %s", v < 4 ? levels[v] : "?");
    } else {
        snprintf(buf, len, "default %llu", (unsigned long long)v);
    }
}

/* The comment of o's field: in relay.h, or for a member of a sub-struct
 * (tls.ca_file) in the sub-struct's own header (tls_h), once relay.h
 * documents the member itself (tls). */
static char *option_comment(const char *h, const char *tls_h, const outbox__relay_option *o)
{
    const char *dot = strchr(o->field, '.');
    char outer[64], *c;
    if (!dot)
        return field_comment(h, "outbox_relay_settings", o->field);
    snprintf(outer, sizeof outer, "%.*s", (int)(dot - o->field), o->field);
    if (strcmp(outer, "tls") != 0 || !(c = field_comment(h, "outbox_relay_settings", outer))) {
        diag("relay.h: no comment found for %s (or no header known for it)", outer);
        return NULL;
    }
    free(c);
    return field_comment(tls_h, "outbox_tls_settings", dot + 1);
}

static void check_relay_h(const char *h, const char *tls_h)
{
    outbox_relay_settings d;
    int bad = 0;
    outbox_relay_defaults(&d);
    for (size_t i = 0; i < outbox__relay_noptions; i++) {
        const outbox__relay_option *o = &outbox__relay_options[i];
        char want[160], *c = option_comment(h, tls_h, o);
        const char *at = NULL;
        expected_default(o, &d, want, sizeof want);
        if (c) {
            /* Case aside ("Default 512." opens a sentence), and not a prefix
             * of a longer number. */
            for (char *p = c; *p; p++)
                if (!strncasecmp(p, want, strlen(want)) && !isdigit((unsigned char)p[strlen(want)])) {
                    at = p;
                    break;
                }
        }
        if (!c)
            diag("relay.h: no comment found for %s", o->field);
        else if (!at)
            diag("%s: the comment of %s does not say '%s': %s", strchr(o->field, '.') ? "tls.h" : "relay.h",
                 o->field, want, c);
        if (!c || !at)
            bad++;
        if (c && at && (o->flags & OUTBOX__OPT_ZERO) && o->shown) {
            /* A default derived from another setting: relay.h states the
             * rule as --help does, with the fields' names. */
            char rule[160], *p;
            snprintf(rule, sizeof rule, "%s", o->shown);
            for (p = rule; *p; p++)
                if (*p == '-')
                    *p = '_';
            if (!strstr(c, rule)) {
                diag("relay.h: the comment of %s does not say '%s': %s", o->field, rule, c);
                bad++;
            }
        }
        free(c);
    }
    ok(bad == 0, "relay.h states each setting's default as outbox_relay_defaults() sets it (%d wrong)", bad);
}

int main(void)
{
    const char *src = getenv("OUTBOX_SOURCE_DIR");
    char *relay = th_bin("tools/relay/outbox-relay"), *readme_path, *relay_h_path, *tls_h_path, *tls_h, *md, *h, *out = NULL,
         *err = NULL;
    char *argv[] = {relay, "--help", NULL};
    doc help = {.n = 0}, readme = {.n = 0};
    int rc;

    if (!src)
        bail("OUTBOX_SOURCE_DIR is not set");
    readme_path = th_path(src, "README.md");
    relay_h_path = th_path(src, "include/outbox/relay.h");
    tls_h_path = th_path(src, "include/outbox/tls.h");
    md = th_slurp(readme_path);
    h = th_slurp(relay_h_path);
    tls_h = th_slurp(tls_h_path);
    if (!md || !h || !*h || !tls_h || !*tls_h)
        bail("cannot read %s, %s or %s", readme_path, relay_h_path, tls_h_path);

    rc = th_run(argv, NULL, &out, &err, 20000);
    is_int(rc, 0, "outbox-relay --help exits 0");
    parse_help(out ? out : "", &help);
    parse_readme(md, &readme);
    ok(readme.n > 0, "README.md has an option table (%d rows)", readme.n);
    check_help_has_table(&help);
    check_readme(&help, &readme);
    check_relay_h(h, tls_h);

    doc_free(&help);
    doc_free(&readme);
    free(out);
    free(err);
    free(md);
    free(h);
    free(tls_h);
    free(readme_path);
    free(relay_h_path);
    free(tls_h_path);
    free(relay);
    return tap_done();
}
