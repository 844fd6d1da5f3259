/*
 * fake_server.h: a misbehaving Redis stand-in for the connection tests.
 *
 * It runs in its own thread with blocking sockets, listens on a Unix socket
 * in a fresh temporary directory, and parses RESP commands. Replies: PING ->
 * +PONG, ECHO x -> bulk x, ARR -> a nested array with an integer and a nil,
 * ERR -> an error reply, anything else (AUTH, SELECT, CLIENT ...) -> +OK.
 */
#ifndef OUTBOX_TESTS_FAKE_SERVER_H
#define OUTBOX_TESTS_FAKE_SERVER_H

typedef enum fake_mode {
    /* Answers every command, writing each reply one byte at a time with a
     * short pause in between, so the client sees every possible split. */
    FAKE_SPLIT,
    /* Once `after` commands arrived, answers the first `good` of them and
     * then sends bytes that are not RESP. */
    FAKE_GARBAGE,
    /* Once `after` commands arrived, answers the first `good`, writes half
     * of the next reply and closes the connection. */
    FAKE_CLOSE_MIDREPLY,
    /* Accepts and reads, never answers. */
    FAKE_SILENT,
    /* Listens but never accepts: the kernel completes the connection, no
     * byte is ever read or written. */
    FAKE_NO_ACCEPT,
    /* Over TCP on 127.0.0.1 (the URL is redis://127.0.0.1:PORT): the first
     * connection answers its first `after` commands and then nothing (its
     * bytes still acknowledged by the kernel, as on a connection whose
     * replies a network lost); every later connection answers everything. */
    FAKE_STALL_FIRST
} fake_mode;

typedef struct fake_server fake_server;

/* Starts the server thread; bails out on failure. */
fake_server *fake_server_start(fake_mode mode, int after, int good);
/* "unix:///tmp/outbox-test-XXXXXX/fake.sock" (FAKE_STALL_FIRST:
 * "redis://127.0.0.1:PORT") */
const char *fake_server_url(const fake_server *fs);
/* Commands received so far (all connections). */
int fake_server_commands(fake_server *fs);
/* Connections accepted so far. */
int fake_server_connections(fake_server *fs);
/* Stops the thread, closes every socket and removes the directory. NULL is
 * a no-op. */
void fake_server_stop(fake_server *fs);

#endif
