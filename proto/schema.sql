-- The outbox table, schema version 4 (PRAGMA user_version = 4).
--
-- This file is the contract for writers in any language and is compiled into
-- the library verbatim: outbox-relay init (or outbox_schema_apply()) runs it.
-- Do not apply it by hand; see proto/schema.md for the rules.
--
-- Writer-facing columns: id, topic, key, payload, headers, created_at,
-- available_at. A plain INSERT INTO outbox(id, topic, payload) VALUES (...)
-- is a complete message. Every other column belongs to the relay.

CREATE TABLE outbox (
    -- Commit order. Writers never set it; SQLite assigns it under the write
    -- lock, so it increases in commit order.
    seq           INTEGER PRIMARY KEY,
    -- The stable message id: 1..128 printable ASCII characters, no spaces.
    id            TEXT    NOT NULL UNIQUE
                  CONSTRAINT id_is_1_to_128_printable_ascii CHECK (typeof(id) = 'text' AND length(id) BETWEEN 1 AND 128
                         AND id NOT GLOB '*[^!-~]*'),
    -- The stream is <prefix><topic>: 1..128 characters of A-Z a-z 0-9 . _ - : /
    topic         TEXT    NOT NULL
                  CONSTRAINT topic_is_1_to_128_of_A_Za_z0_9_dot_underscore_dash_colon_slash CHECK (typeof(topic) = 'text' AND length(topic) BETWEEN 1 AND 128
                         AND topic NOT GLOB '*[^A-Za-z0-9._:/-]*'),
    -- Optional ordering key (1..512 bytes of text); NULL means unordered.
    key           TEXT
                  CONSTRAINT key_is_null_or_1_to_512_bytes_of_text CHECK (key IS NULL OR (typeof(key) = 'text'
                         AND length(CAST(key AS BLOB)) BETWEEN 1 AND 512)),
    payload       BLOB    NOT NULL,
    -- Optional msgpack map with string keys.
    headers       BLOB
                  CONSTRAINT headers_is_null_or_a_blob CHECK (headers IS NULL OR typeof(headers) = 'blob'),
    -- Unix milliseconds.
    created_at    INTEGER NOT NULL
                  DEFAULT (CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)),
    available_at  INTEGER NOT NULL
                  DEFAULT (CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)),

    -- Relay-owned from here on.
    -- 0 pending, 1 sending (leased), 2 published, 3 dead.
    state         INTEGER NOT NULL DEFAULT 0 CONSTRAINT state_is_0_to_3 CHECK (state = 0 OR state = 1 OR state = 2 OR state = 3),
    attempts      INTEGER NOT NULL DEFAULT 0,
    lease_owner   TEXT,
    -- Fencing token: incremented by every claim; marks name the token they
    -- claimed with and change nothing when it moved on.
    lease_token   INTEGER NOT NULL DEFAULT 0,
    lease_until   INTEGER,
    last_error    TEXT,
    published_at  INTEGER,
    stream_id     TEXT,
    replay_count  INTEGER NOT NULL DEFAULT 0,
    replayed_at   INTEGER,
    replay_reason TEXT
);

-- New pending rows in commit order: rows that wait for nothing but their
-- turn (available_at not after created_at, never claimed). A claim walks the
-- head of this index, so its cost does not depend on the backlog, and it
-- meets a key's new rows in commit order. New rows land at its end.
CREATE INDEX outbox_new ON outbox(seq) WHERE state = 0 AND available_at <= created_at;

-- Pending rows made to wait (retried, released, requeued, or written with a
-- later available_at), by the time they become due. Once claimed, a row
-- never goes back to outbox_new: the relay and outbox-replay always set
-- available_at after created_at.
CREATE INDEX outbox_due ON outbox(available_at) WHERE state = 0 AND available_at > created_at;

-- Leased rows by expiry, for takeover of expired leases.
CREATE INDEX outbox_leased ON outbox(lease_until) WHERE state = 1;

-- Per-key order: the keyed rows that can hold back a later row of their key
-- out of commit order (leased, or made to wait). New rows are not in it, so
-- a writer's INSERT never writes to it (its entries would be spread over the
-- whole index); the claim knows a key's new rows from its walk of outbox_new.
CREATE INDEX outbox_key ON outbox(topic, key, seq) WHERE key IS NOT NULL AND (state = 1 OR (state = 0 AND available_at > created_at));

-- Published rows by age, for retention.
CREATE INDEX outbox_published ON outbox(published_at) WHERE state = 2;

-- Dead rows, for inspection and replay.
CREATE INDEX outbox_dead ON outbox(seq) WHERE state = 3;
