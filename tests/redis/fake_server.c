/*
 * fake_server.c: see fake_server.h. A thread with blocking sockets and
 * poll(); a self-pipe wakes it up to stop.
 */
#include "fake_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "resp_cmd.h"
#include "tap.h"

#define MAX_CLIENTS 8
#define MAX_ARGS 16
#define SPLIT_PAUSE_US 300

typedef struct client {
    int fd;
    char *buf;
    size_t len, cap;
    int received; /* commands received on this connection */
    int first;    /* the server's first connection */
    int done;     /* misbehaved already: ignore further input */
    /* replies held back until `after` commands arrived */
    char *held;
    size_t held_len;
    int held_count;
    size_t held_ends[64]; /* end offset of each held reply */
} client;

struct fake_server {
    fake_mode mode;
    int after, good;
    char *dir;
    char sock[256];
    char url[300];
    int listen_fd;
    int wake[2];
    pthread_t thread;
    atomic_int commands;
    atomic_int connections;
    client clients[MAX_CLIENTS];
};

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

static void write_split(int fd, const char *p, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        write_all(fd, p + i, 1);
        usleep(SPLIT_PAUSE_US);
    }
}

/* The reply to one command, written into out (returns its length). */
static size_t make_reply(int argc, const char **argv, const size_t *argvlen, char *out, size_t cap)
{
    if (resp_arg_is(argv[0], argvlen[0], "PING"))
        return (size_t)snprintf(out, cap, "+PONG\r\n");
    if (resp_arg_is(argv[0], argvlen[0], "ECHO") && argc == 2 && argvlen[1] < cap - 32)
        return (size_t)snprintf(out, cap, "$%zu\r\n%.*s\r\n", argvlen[1], (int)argvlen[1], argv[1]);
    if (resp_arg_is(argv[0], argvlen[0], "ARR"))
        return (size_t)snprintf(out, cap, "*3\r\n$1\r\na\r\n:42\r\n*2\r\n$-1\r\n+in\r\n");
    if (resp_arg_is(argv[0], argvlen[0], "ERR"))
        return (size_t)snprintf(out, cap, "-ERR fake failure\r\n");
    return (size_t)snprintf(out, cap, "+OK\r\n");
}

static void hold(client *c, const char *r, size_t n)
{
    char *nb = realloc(c->held, c->held_len + n);
    if (!nb)
        bail("out of memory");
    c->held = nb;
    memcpy(c->held + c->held_len, r, n);
    c->held_len += n;
    if (c->held_count < 64)
        c->held_ends[c->held_count++] = c->held_len;
}

static void drop_client(client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->buf);
    free(c->held);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

/* Misbehaves once enough commands were held back. */
static void trigger(fake_server *fs, client *c)
{
    int good = fs->good < c->held_count ? fs->good : c->held_count;
    size_t good_end = good > 0 ? c->held_ends[good - 1] : 0;
    write_all(c->fd, c->held, good_end);
    c->done = 1;
    if (fs->mode == FAKE_GARBAGE) {
        static const char garbage[] = "?this is not RESP\r\n";
        write_all(c->fd, garbage, sizeof garbage - 1);
    } else if (fs->mode == FAKE_CLOSE_MIDREPLY) {
        static const char half[] = "$10\r\nabc";
        write_all(c->fd, half, sizeof half - 1);
        drop_client(c);
    }
}

static void handle_input(fake_server *fs, client *c)
{
    for (;;) {
        int argc = 0;
        const char *argv[MAX_ARGS];
        size_t argvlen[MAX_ARGS];
        char reply[512];
        size_t rlen;
        long used = resp_parse_command(c->buf, c->len, MAX_ARGS, &argc, argv, argvlen);
        if (used == 0)
            return;
        if (used < 0) {
            drop_client(c);
            return;
        }
        atomic_fetch_add(&fs->commands, 1);
        c->received++;
        rlen = make_reply(argc, argv, argvlen, reply, sizeof reply);
        memmove(c->buf, c->buf + used, c->len - (size_t)used);
        c->len -= (size_t)used;
        if (c->done)
            continue;
        switch (fs->mode) {
        case FAKE_SPLIT:
            write_split(c->fd, reply, rlen);
            break;
        case FAKE_STALL_FIRST:
            if (!c->first || c->received <= fs->after)
                write_all(c->fd, reply, rlen);
            break;
        case FAKE_GARBAGE:
        case FAKE_CLOSE_MIDREPLY:
            hold(c, reply, rlen);
            if (c->received >= fs->after) {
                trigger(fs, c);
                if (c->fd < 0)
                    return;
            }
            break;
        default:
            break;
        }
    }
}

static void *server_main(void *arg)
{
    fake_server *fs = arg;
    for (;;) {
        struct pollfd pfd[MAX_CLIENTS + 2];
        int idx[MAX_CLIENTS + 2];
        int n = 0, i;
        pfd[n].fd = fs->wake[0];
        pfd[n].events = POLLIN;
        idx[n++] = -1;
        if (fs->mode != FAKE_NO_ACCEPT) {
            pfd[n].fd = fs->listen_fd;
            pfd[n].events = POLLIN;
            idx[n++] = -2;
        }
        for (i = 0; i < MAX_CLIENTS; i++) {
            if (fs->clients[i].fd >= 0) {
                pfd[n].fd = fs->clients[i].fd;
                pfd[n].events = POLLIN;
                idx[n++] = i;
            }
        }
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfd[0].revents)
            break;
        for (i = 1; i < n; i++) {
            if (!pfd[i].revents)
                continue;
            if (idx[i] == -2) {
                int fd = accept4(fs->listen_fd, NULL, NULL, SOCK_CLOEXEC), k;
                if (fd < 0)
                    continue;
                for (k = 0; k < MAX_CLIENTS && fs->clients[k].fd >= 0; k++)
                    ;
                if (k == MAX_CLIENTS) {
                    close(fd);
                    continue;
                }
                fs->clients[k].fd = fd;
                fs->clients[k].first = atomic_fetch_add(&fs->connections, 1) == 0;
            } else {
                client *c = &fs->clients[idx[i]];
                char buf[16384];
                ssize_t r = read(c->fd, buf, sizeof buf);
                if (r <= 0) {
                    if (r < 0 && errno == EINTR)
                        continue;
                    drop_client(c);
                    continue;
                }
                if (c->len + (size_t)r > c->cap) {
                    size_t cap = c->cap ? c->cap * 2 : 65536;
                    while (cap < c->len + (size_t)r)
                        cap *= 2;
                    c->buf = realloc(c->buf, cap);
                    if (!c->buf)
                        bail("out of memory");
                    c->cap = cap;
                }
                memcpy(c->buf + c->len, buf, (size_t)r);
                c->len += (size_t)r;
                handle_input(fs, c);
            }
        }
    }
    return NULL;
}

fake_server *fake_server_start(fake_mode mode, int after, int good)
{
    fake_server *fs = calloc(1, sizeof *fs);
    struct sockaddr_un sa;
    int i;
    if (!fs)
        bail("out of memory");
    fs->mode = mode;
    fs->after = after > 0 ? after : 1;
    fs->good = good;
    for (i = 0; i < MAX_CLIENTS; i++)
        fs->clients[i].fd = -1;
    fs->dir = th_tmpdir();
    snprintf(fs->sock, sizeof fs->sock, "%s/fake.sock", fs->dir);
    snprintf(fs->url, sizeof fs->url, "unix://%s", fs->sock);

    if (mode == FAKE_STALL_FIRST) {
        struct sockaddr_in in;
        socklen_t len = sizeof in;
        memset(&in, 0, sizeof in);
        in.sin_family = AF_INET;
        in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        fs->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fs->listen_fd < 0 || bind(fs->listen_fd, (struct sockaddr *)&in, sizeof in) < 0 ||
            listen(fs->listen_fd, 16) < 0 || getsockname(fs->listen_fd, (struct sockaddr *)&in, &len) < 0)
            bail("fake server TCP listen: %s", strerror(errno));
        snprintf(fs->url, sizeof fs->url, "redis://127.0.0.1:%d", ntohs(in.sin_port));
    } else {
        fs->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fs->listen_fd < 0)
            bail("fake server socket: %s", strerror(errno));
        memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        if (strlen(fs->sock) >= sizeof sa.sun_path)
            bail("fake server: socket path too long");
        strcpy(sa.sun_path, fs->sock);
        if (bind(fs->listen_fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fs->listen_fd, 16) < 0)
            bail("fake server bind/listen %s: %s", fs->sock, strerror(errno));
    }
    if (pipe2(fs->wake, O_CLOEXEC) < 0)
        bail("fake server pipe: %s", strerror(errno));
    if (pthread_create(&fs->thread, NULL, server_main, fs) != 0)
        bail("fake server thread");
    return fs;
}

const char *fake_server_url(const fake_server *fs)
{
    return fs->url;
}

int fake_server_commands(fake_server *fs)
{
    return atomic_load(&fs->commands);
}

int fake_server_connections(fake_server *fs)
{
    return atomic_load(&fs->connections);
}

void fake_server_stop(fake_server *fs)
{
    int i;
    if (!fs)
        return;
    if (write(fs->wake[1], "x", 1) < 0)
        diag("fake server: cannot wake the thread");
    pthread_join(fs->thread, NULL);
    for (i = 0; i < MAX_CLIENTS; i++)
        if (fs->clients[i].fd >= 0)
            drop_client(&fs->clients[i]);
    close(fs->listen_fd);
    close(fs->wake[0]);
    close(fs->wake[1]);
    th_rmtree(fs->dir);
    free(fs->dir);
    free(fs);
}
