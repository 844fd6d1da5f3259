/*
 * fake_node.c: see fake_node.h.
 */
#include "fake_node.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "resp_cmd.h"
#include "tap.h"

#define NODES_MAX 4
#define CLIENTS_MAX 32
#define RULES_MAX 32
#define REPLIES_MAX 16

typedef struct rule {
    int node;
    char command[32];
    char *replies[REPLIES_MAX];
    int n, next;
} rule;

typedef struct fclient {
    int fd, node;
    char *buf;
    size_t len, cap;
} fclient;

struct fake_nodes {
    int n;
    int listen_fd[NODES_MAX];
    int port[NODES_MAX];
    int killed[NODES_MAX];
    fclient clients[CLIENTS_MAX];
    rule rules[RULES_MAX];
    int nrules;
    char *log;
    size_t loglen, logcap;
    int wake[2];
    int stopping;
    pthread_mutex_t mu;
    pthread_t thread;
};

static void logf_add(fake_nodes *f, const char *s)
{
    size_t n = strlen(s);
    if (f->loglen + n + 2 > f->logcap) {
        size_t nc = (f->logcap + n + 2) * 2;
        char *nb = realloc(f->log, nc);
        if (!nb)
            bail("out of memory");
        f->log = nb;
        f->logcap = nc;
    }
    if (f->loglen)
        f->log[f->loglen++] = '|';
    memcpy(f->log + f->loglen, s, n);
    f->loglen += n;
    f->log[f->loglen] = '\0';
}

/* Writes template t with %N replaced by node N's port. */
static size_t expand(const fake_nodes *f, const char *t, char *out, size_t cap)
{
    size_t o = 0;
    for (; *t && o + 8 < cap; t++) {
        if (t[0] == '%' && t[1] >= '0' && t[1] < '0' + NODES_MAX) {
            o += (size_t)snprintf(out + o, cap - o, "%d", f->port[t[1] - '0']);
            t++;
        } else {
            out[o++] = *t;
        }
    }
    return o;
}

static size_t make_reply(fake_nodes *f, int node, int argc, const char **argv, const size_t *argvlen, char *out,
                         size_t cap)
{
    char name[32], full[64];
    size_t nlen = argvlen[0] < 31 ? argvlen[0] : 31;
    int i;
    memcpy(name, argv[0], nlen);
    name[nlen] = '\0';
    snprintf(full, sizeof full, "%s %.*s", name, argc > 1 ? (int)(argvlen[1] < 30 ? argvlen[1] : 30) : 0,
             argc > 1 ? argv[1] : "");
    for (i = 0; i < f->nrules; i++) {
        rule *r = &f->rules[i];
        if (r->node == node && (strcasecmp(r->command, name) == 0 || strcasecmp(r->command, full) == 0) &&
            r->n > 0) {
            const char *t = r->replies[r->next < r->n ? r->next : r->n - 1];
            if (r->next < r->n)
                r->next++;
            return expand(f, t, out, cap);
        }
    }
    if (resp_arg_is(argv[0], argvlen[0], "PING"))
        return (size_t)snprintf(out, cap, "+PONG\r\n");
    if (resp_arg_is(argv[0], argvlen[0], "CLUSTER") && argc > 1 && resp_arg_is(argv[1], argvlen[1], "SHARDS"))
        return (size_t)snprintf(out, cap, "-ERR unknown subcommand 'SHARDS'. Try CLUSTER HELP.\r\n");
    if (resp_arg_is(argv[0], argvlen[0], "CLUSTER") && argc > 1 && resp_arg_is(argv[1], argvlen[1], "SLOTS"))
        return expand(f, "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%0\r\n$2\r\nn0\r\n", out, cap);
    return (size_t)snprintf(out, cap, "+OK\r\n");
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

static void client_close(fclient *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->len = 0;
}

static void serve(fake_nodes *f, fclient *c)
{
    char tmp[16384];
    ssize_t n = recv(c->fd, tmp, sizeof tmp, 0);
    if (n <= 0) {
        client_close(c);
        return;
    }
    if (c->len + (size_t)n > c->cap) {
        size_t nc = (c->len + (size_t)n) * 2;
        char *nb = realloc(c->buf, nc);
        if (!nb)
            bail("out of memory");
        c->buf = nb;
        c->cap = nc;
    }
    memcpy(c->buf + c->len, tmp, (size_t)n);
    c->len += (size_t)n;
    for (;;) {
        int argc = 0;
        const char *argv[16];
        size_t argvlen[16];
        char out[8192];
        size_t olen;
        long used = resp_parse_command(c->buf, c->len, 16, &argc, argv, argvlen);
        if (used == 0)
            break;
        if (used < 0) {
            client_close(c);
            return;
        }
        if (!resp_arg_is(argv[0], argvlen[0], "CLIENT") && !resp_arg_is(argv[0], argvlen[0], "PING") &&
            !resp_arg_is(argv[0], argvlen[0], "CLUSTER")) {
            char line[160];
            snprintf(line, sizeof line, "n%d:%.*s%s%.*s", c->node, (int)(argvlen[0] < 20 ? argvlen[0] : 20), argv[0],
                     argc > 1 ? " " : "", argc > 1 ? (int)(argvlen[1] < 40 ? argvlen[1] : 40) : 0,
                     argc > 1 ? argv[1] : "");
            for (char *p = strchr(line, ':') + 1; *p && *p != ' '; p++)
                if (*p >= 'a' && *p <= 'z')
                    *p = (char)(*p - 32);
            logf_add(f, line);
        }
        olen = make_reply(f, c->node, argc, argv, argvlen, out, sizeof out);
        memmove(c->buf, c->buf + used, c->len - (size_t)used);
        c->len -= (size_t)used;
        write_all(c->fd, out, olen);
    }
}

static void *thread_main(void *arg)
{
    fake_nodes *f = arg;
    for (;;) {
        struct pollfd pf[1 + NODES_MAX + CLIENTS_MAX];
        int map[1 + NODES_MAX + CLIENTS_MAX];
        int np = 0, i;
        pthread_mutex_lock(&f->mu);
        if (f->stopping) {
            pthread_mutex_unlock(&f->mu);
            return NULL;
        }
        pf[np].fd = f->wake[0];
        pf[np].events = POLLIN;
        map[np++] = -1;
        for (i = 0; i < f->n; i++)
            if (f->listen_fd[i] >= 0) {
                pf[np].fd = f->listen_fd[i];
                pf[np].events = POLLIN;
                map[np++] = 1000 + i;
            }
        for (i = 0; i < CLIENTS_MAX; i++)
            if (f->clients[i].fd >= 0) {
                pf[np].fd = f->clients[i].fd;
                pf[np].events = POLLIN;
                map[np++] = i;
            }
        pthread_mutex_unlock(&f->mu);
        if (poll(pf, (nfds_t)np, 1000) < 0 && errno != EINTR)
            bail("poll: %s", strerror(errno));
        pthread_mutex_lock(&f->mu);
        for (i = 0; i < np; i++) {
            if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (map[i] == -1) {
                char b[64];
                if (read(f->wake[0], b, sizeof b) < 0) {
                    /* nothing to do: the loop looks at the flags again */
                }
            } else if (map[i] >= 1000) {
                int node = map[i] - 1000, fd, j;
                if (f->listen_fd[node] < 0)
                    continue;
                fd = accept(f->listen_fd[node], NULL, NULL);
                if (fd < 0)
                    continue;
                for (j = 0; j < CLIENTS_MAX && f->clients[j].fd >= 0; j++)
                    ;
                if (j == CLIENTS_MAX) {
                    close(fd);
                    continue;
                }
                f->clients[j].fd = fd;
                f->clients[j].node = node;
                f->clients[j].len = 0;
            } else if (f->clients[map[i]].fd == pf[i].fd) {
                serve(f, &f->clients[map[i]]);
            }
        }
        pthread_mutex_unlock(&f->mu);
    }
}

fake_nodes *fake_nodes_start(int n)
{
    fake_nodes *f = calloc(1, sizeof *f);
    int i;
    if (!f || n < 1 || n > NODES_MAX)
        bail("fake_nodes_start");
    f->n = n;
    for (i = 0; i < CLIENTS_MAX; i++)
        f->clients[i].fd = -1;
    if (pipe(f->wake) != 0)
        bail("pipe: %s", strerror(errno));
    pthread_mutex_init(&f->mu, NULL);
    for (i = 0; i < n; i++) {
        struct sockaddr_in a;
        socklen_t alen = sizeof a;
        int one = 1;
        f->listen_fd[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (f->listen_fd[i] < 0)
            bail("socket: %s", strerror(errno));
        setsockopt(f->listen_fd[i], SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(f->listen_fd[i], (struct sockaddr *)&a, sizeof a) != 0 || listen(f->listen_fd[i], 16) != 0 ||
            getsockname(f->listen_fd[i], (struct sockaddr *)&a, &alen) != 0)
            bail("bind/listen: %s", strerror(errno));
        f->port[i] = ntohs(a.sin_port);
    }
    if (pthread_create(&f->thread, NULL, thread_main, f) != 0)
        bail("pthread_create");
    return f;
}

int fake_nodes_port(const fake_nodes *f, int node)
{
    return f->port[node];
}

static void poke(fake_nodes *f)
{
    if (write(f->wake[1], "x", 1) < 0) {
        /* the thread wakes up within a second anyway */
    }
}

void fake_nodes_rule(fake_nodes *f, int node, const char *command, const char *const *replies)
{
    rule *r;
    pthread_mutex_lock(&f->mu);
    if (f->nrules == RULES_MAX)
        bail("too many rules");
    r = &f->rules[f->nrules++];
    memset(r, 0, sizeof *r);
    r->node = node;
    snprintf(r->command, sizeof r->command, "%s", command);
    for (; replies[r->n] && r->n < REPLIES_MAX; r->n++)
        if (!(r->replies[r->n] = strdup(replies[r->n])))
            bail("out of memory");
    pthread_mutex_unlock(&f->mu);
}

void fake_nodes_kill(fake_nodes *f, int node)
{
    pthread_mutex_lock(&f->mu);
    if (f->listen_fd[node] >= 0)
        close(f->listen_fd[node]);
    f->listen_fd[node] = -1;
    for (int i = 0; i < CLIENTS_MAX; i++)
        if (f->clients[i].fd >= 0 && f->clients[i].node == node)
            client_close(&f->clients[i]);
    pthread_mutex_unlock(&f->mu);
    poke(f);
}

char *fake_nodes_log(fake_nodes *f)
{
    char *s;
    pthread_mutex_lock(&f->mu);
    s = strdup(f->log ? f->log : "");
    pthread_mutex_unlock(&f->mu);
    if (!s)
        bail("out of memory");
    return s;
}

void fake_nodes_reset(fake_nodes *f)
{
    pthread_mutex_lock(&f->mu);
    f->loglen = 0;
    if (f->log)
        f->log[0] = '\0';
    for (int i = 0; i < f->nrules; i++) {
        for (int j = 0; j < f->rules[i].n; j++)
            free(f->rules[i].replies[j]);
    }
    f->nrules = 0;
    pthread_mutex_unlock(&f->mu);
}

int fake_nodes_count(fake_nodes *f, int node, const char *command)
{
    char pat[64];
    int n = 0;
    const char *p;
    pthread_mutex_lock(&f->mu);
    snprintf(pat, sizeof pat, "n%d:%s", node, command);
    for (p = f->log; p && (p = strstr(p, pat)) != NULL; p += strlen(pat))
        if ((p == f->log || p[-1] == '|') && (p[strlen(pat)] == ' ' || p[strlen(pat)] == '|' || !p[strlen(pat)]))
            n++;
    pthread_mutex_unlock(&f->mu);
    return n;
}

void fake_nodes_stop(fake_nodes *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stopping = 1;
    pthread_mutex_unlock(&f->mu);
    poke(f);
    pthread_join(f->thread, NULL);
    for (int i = 0; i < f->n; i++)
        if (f->listen_fd[i] >= 0)
            close(f->listen_fd[i]);
    for (int i = 0; i < CLIENTS_MAX; i++) {
        client_close(&f->clients[i]);
        free(f->clients[i].buf);
    }
    fake_nodes_reset(f);
    free(f->log);
    close(f->wake[0]);
    close(f->wake[1]);
    pthread_mutex_destroy(&f->mu);
    free(f);
}
