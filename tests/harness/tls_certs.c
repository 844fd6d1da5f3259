/*
 * tls_certs.c: see tls_certs.h.
 */
#include "tls_certs.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "tap.h"

#define MAX_FILES 24

struct tls_certs {
    char *dir;
    int n;
    char *names[MAX_FILES];
    char *paths[MAX_FILES];
};

const char *tls_cert(tls_certs *c, const char *name)
{
    int i;
    for (i = 0; i < c->n; i++)
        if (strcmp(c->names[i], name) == 0)
            return c->paths[i];
    if (c->n == MAX_FILES)
        bail("tls_cert: too many names");
    c->names[c->n] = strdup(name);
    c->paths[c->n] = th_path(c->dir, name);
    if (!c->names[c->n])
        bail("out of memory");
    return c->paths[c->n++];
}

/* Runs `openssl` with the NULL-terminated arguments; bails with its stderr
 * on failure. */
static void run_openssl(const char *first, ...)
{
    char *argv[40], *err = NULL;
    va_list ap;
    int n = 0, st;
    argv[n++] = "openssl";
    argv[n++] = (char *)first;
    va_start(ap, first);
    while (n < 39 && (argv[n] = va_arg(ap, char *)) != NULL)
        n++;
    va_end(ap);
    argv[n] = NULL;
    st = th_run(argv, NULL, NULL, &err, 30000);
    if (st != 0) {
        th_diag_tail("openssl", err, 20);
        bail("openssl %s failed with status %d (is the openssl command installed?)", first, st);
    }
    free(err);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s: %s", path, strerror(errno));
}

/* A key and a certificate for subject CN=cn with the given SAN line, signed
 * by the test CA, valid for `days` (negative: expired). */
static void make_leaf(tls_certs *c, const char *name, const char *cn, const char *san, const char *days)
{
    char key[64], csr[64], crt[64], ext[64], subj[128], text[256];
    snprintf(key, sizeof key, "%s.key", name);
    snprintf(csr, sizeof csr, "%s.csr", name);
    snprintf(crt, sizeof crt, "%s.crt", name);
    snprintf(ext, sizeof ext, "%s.ext", name);
    snprintf(subj, sizeof subj, "/CN=%s", cn);
    snprintf(text, sizeof text, "%s%s\n", san ? "subjectAltName=" : "basicConstraints=CA:FALSE", san ? san : "");
    write_file(tls_cert(c, ext), text);
    run_openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                tls_cert(c, key), "-out", tls_cert(c, csr), "-subj", subj, NULL);
    run_openssl("x509", "-req", "-in", tls_cert(c, csr), "-CA", tls_cert(c, "ca.crt"), "-CAkey",
                tls_cert(c, "ca.key"), "-CAcreateserial", "-CAserial", tls_cert(c, "ca.srl"), "-out",
                tls_cert(c, crt), "-days", days, "-extfile", tls_cert(c, ext), NULL);
}

tls_certs *tls_certs_make(void)
{
    tls_certs *c = calloc(1, sizeof *c);
    if (!c)
        bail("out of memory");
    c->dir = th_tmpdir();
    run_openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                tls_cert(c, "ca.key"), "-out", tls_cert(c, "ca.crt"), "-days", "30", "-subj", "/CN=outbox test CA",
                NULL);
    run_openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                tls_cert(c, "rogue-ca.key"), "-out", tls_cert(c, "rogue-ca.crt"), "-days", "30", "-subj",
                "/CN=outbox rogue CA", NULL);
    make_leaf(c, "server", "localhost", "DNS:localhost,IP:127.0.0.1", "30");
    make_leaf(c, "client", "outbox-client", NULL, "30");
    make_leaf(c, "expired", "localhost", "DNS:localhost,IP:127.0.0.1", "-1");
    make_leaf(c, "other", "other.example", "DNS:other.example,IP:10.9.9.9", "30");
    run_openssl("pkey", "-in", tls_cert(c, "client.key"), "-out", tls_cert(c, "enc.key"), "-aes256", "-passout",
                "pass:secret", NULL);
    write_file(tls_cert(c, "garbage.pem"), "this is not a certificate\n");
    return c;
}

void tls_certs_free(tls_certs *c)
{
    int i;
    if (!c)
        return;
    for (i = 0; i < c->n; i++) {
        free(c->names[i]);
        free(c->paths[i]);
    }
    th_rmtree(c->dir);
    free(c->dir);
    free(c);
}

int tls_redis_start(th_redis *r, tls_certs *c, const char *cert, const char *key, int auth_clients, int with_tcp,
                    const char *extra)
{
    int attempt;
    for (attempt = 0; attempt < 3; attempt++) {
        char conf[512];
        int port = th_free_port();
        if (port <= 0)
            return -1;
        /* "bind" again: without a plaintext port the harness writes none, and
         * the TLS port must stay on the loopback interface. */
        snprintf(conf, sizeof conf,
                 "bind 127.0.0.1\ntls-port %d\ntls-cert-file %s\ntls-key-file %s\ntls-ca-cert-file %s\n"
                 "tls-auth-clients %s\n%s",
                 port, tls_cert(c, cert), tls_cert(c, key), tls_cert(c, "ca.crt"), auth_clients ? "yes" : "no",
                 extra ? extra : "");
        if (th_redis_start(r, with_tcp, conf) == 0)
            return port;
    }
    return -1;
}

/* ---- the misbehaving peer ------------------------------------------------ */

struct tls_fake {
    tls_fake_mode mode;
    int after;
    int port;
    int listen_fd;
    int wake[2];
    atomic_int client_fd;
    SSL_CTX *ctx;
    pthread_t thread;
};

/* Waits until fd is readable or the peer is told to stop. Returns 1 when
 * readable. */
static int wait_readable(tls_fake *f, int fd)
{
    struct pollfd p[2] = {{fd, POLLIN, 0}, {f->wake[0], POLLIN, 0}};
    while (poll(p, 2, -1) < 0)
        if (errno != EINTR)
            return 0;
    return !p[1].revents && p[0].revents;
}

static void reset_close(int fd)
{
    struct linger l = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

/* A TLS server that answers +OK to `after` commands and then sends half of
 * the next reply's record before a reset. Commands are counted by their
 * '*' headers: the tests send no '*' inside arguments. */
static void serve_tls(tls_fake *f, int fd)
{
    SSL *ssl = SSL_new(f->ctx);
    int seen = 0, answered = 0;
    char buf[16384];
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) != 1)
        goto out;
    for (;;) {
        int n, i;
        if (!SSL_pending(ssl) && !wait_readable(f, fd))
            goto out;
        n = SSL_read(ssl, buf, sizeof buf);
        if (n <= 0)
            goto out;
        for (i = 0; i < n; i++)
            seen += buf[i] == '*';
        while (answered < seen && answered < f->after) {
            SSL_write(ssl, "+OK\r\n", 5);
            answered++;
        }
        if (seen > f->after) {
            /* Encrypt a reply into memory and send half of its record. */
            static char reply[1200];
            BIO *mem = BIO_new(BIO_s_mem());
            char *data;
            long len;
            memcpy(reply, "$1000\r\n", 7);
            memset(reply + 7, 'x', 1000);
            memcpy(reply + 1007, "\r\n", 2);
            BIO_up_ref(mem);
            SSL_set0_wbio(ssl, mem);
            SSL_write(ssl, reply, 1009);
            len = BIO_get_mem_data(mem, &data);
            if (send(fd, data, (size_t)len / 2, MSG_NOSIGNAL) < 0)
                diag("tls fake: send: %s", strerror(errno));
            BIO_free(mem);
            usleep(50000);
            break;
        }
    }
out:
    SSL_free(ssl);
    ERR_clear_error();
}

static void *fake_main(void *arg)
{
    tls_fake *f = arg;
    for (;;) {
        char buf[4096];
        int fd;
        if (!wait_readable(f, f->listen_fd))
            return NULL;
        fd = accept(f->listen_fd, NULL, NULL);
        if (fd < 0)
            continue;
        atomic_store(&f->client_fd, fd);
        if (f->mode == TLS_FAKE_RESET_RECORD) {
            serve_tls(f, fd);
        } else if (wait_readable(f, fd) && read(fd, buf, sizeof buf) > 0) {
            if (f->mode == TLS_FAKE_STALL) {
                /* A handshake record header announcing 200 bytes, and 10 of them. */
                static const char part[] = "\x16\x03\x03\x00\xc8\x02\x00\x00\xc4\x03\x03\x00\x00\x00\x00";
                if (send(fd, part, sizeof part - 1, MSG_NOSIGNAL) < 0)
                    diag("tls fake: send: %s", strerror(errno));
            }
            /* then nothing, until the client goes or the test stops us */
            while (wait_readable(f, fd) && read(fd, buf, sizeof buf) > 0)
                ;
        }
        atomic_store(&f->client_fd, -1);
        reset_close(fd);
    }
}

tls_fake *tls_fake_start(tls_certs *c, tls_fake_mode mode, int after)
{
    tls_fake *f = calloc(1, sizeof *f);
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    if (!f)
        bail("out of memory");
    f->mode = mode;
    f->after = after;
    atomic_init(&f->client_fd, -1);
    if (mode == TLS_FAKE_RESET_RECORD) {
        f->ctx = SSL_CTX_new(TLS_server_method());
        if (!f->ctx || SSL_CTX_use_certificate_chain_file(f->ctx, tls_cert(c, "server.crt")) != 1 ||
            SSL_CTX_use_PrivateKey_file(f->ctx, tls_cert(c, "server.key"), SSL_FILETYPE_PEM) != 1)
            bail("tls fake: cannot load the server certificate");
    }
    f->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (f->listen_fd < 0 || bind(f->listen_fd, (struct sockaddr *)&a, sizeof a) < 0 ||
        listen(f->listen_fd, 8) < 0 || getsockname(f->listen_fd, (struct sockaddr *)&a, &alen) < 0)
        bail("tls fake: listen: %s", strerror(errno));
    f->port = ntohs(a.sin_port);
    if (pipe(f->wake) < 0 || pthread_create(&f->thread, NULL, fake_main, f) != 0)
        bail("tls fake: thread");
    return f;
}

int tls_fake_port(const tls_fake *f)
{
    return f->port;
}

void tls_fake_stop(tls_fake *f)
{
    int fd;
    if (!f)
        return;
    if (write(f->wake[1], "x", 1) < 0)
        diag("tls fake: cannot wake the thread");
    /* A blocking SSL_accept/SSL_read returns once its socket is shut. */
    fd = atomic_load(&f->client_fd);
    if (fd >= 0)
        shutdown(fd, SHUT_RDWR);
    pthread_join(f->thread, NULL);
    close(f->listen_fd);
    close(f->wake[0]);
    close(f->wake[1]);
    SSL_CTX_free(f->ctx);
    free(f);
}
