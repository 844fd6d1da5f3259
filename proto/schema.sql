-- The outbox table, schema version 5 (PRAGMA user_version = 5).
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

-- New pending rows (state 0, available_at not after created_at, never
-- claimed) are found by walking the table itself in seq order from
-- outbox_cursor.new_from: a plain INSERT writes to no index but the id's.

-- Rows claimed before that are pending again with available_at not after
-- created_at. Only a change by hand makes one (the relay and outbox-replay
-- make such rows wait); the walk of new rows may have passed them, so every
-- claim first turns them into waiting rows due at once. An INSERT
-- (lease_token 0) never writes to it.
CREATE INDEX outbox_stray ON outbox(seq) WHERE state = 0 AND available_at <= created_at AND lease_token > 0;

-- Pending rows made to wait (retried, released, requeued, held back by
-- their key, or written with a later available_at), by the time they become
-- due. Once claimed, a row is never new again: the relay and outbox-replay
-- always set available_at after created_at.
CREATE INDEX outbox_due ON outbox(available_at) WHERE state = 0 AND available_at > created_at;

-- Leased rows by expiry, for takeover of expired leases.
CREATE INDEX outbox_leased ON outbox(lease_until) WHERE state = 1;

-- Per-key order: the keyed rows that can hold back a later row of their key
-- out of commit order (leased, or made to wait). New rows are not in it, so
-- a writer's INSERT never writes to it (its entries would be spread over the
-- whole index); the claim knows a key's new rows from its walk of the table.
CREATE INDEX outbox_key ON outbox(topic, key, seq) WHERE key IS NOT NULL AND (state = 1 OR (state = 0 AND available_at > created_at));

-- Published rows by age, for retention.
CREATE INDEX outbox_published ON outbox(published_at) WHERE state = 2;

-- Dead rows, for inspection and replay.
CREATE INDEX outbox_dead ON outbox(seq) WHERE state = 3;

-- Relay-owned: where the claims' walk of new rows starts. No new row has a
-- seq below new_from: a claim moves it past every new row it saw (each one
-- claimed or made to wait) and no row becomes new again. A new row's seq is
-- one more than the largest in the table, so when a delete takes away the
-- rows at the end, the trigger moves new_from back to stay within reach.
CREATE TABLE outbox_cursor (
    one      INTEGER PRIMARY KEY CONSTRAINT one_row CHECK (one = 1),
    new_from INTEGER NOT NULL
);
INSERT INTO outbox_cursor(one, new_from) VALUES (1, 1);

CREATE TRIGGER outbox_cursor_after_delete AFTER DELETE ON outbox
WHEN old.seq >= (SELECT new_from FROM outbox_cursor) - 1
BEGIN
    UPDATE outbox_cursor SET new_from = (SELECT coalesce(max(seq), 0) + 1 FROM outbox)
    WHERE new_from > (SELECT coalesce(max(seq), 0) + 1 FROM outbox);
END;

-- A waiting row whose available_at is moved back to or before its
-- created_at (a delayed message sent at once by an UPDATE) is new again,
-- maybe below the cursor: the cursor goes back to it. The relay's own
-- updates of available_at always set it after created_at.
CREATE TRIGGER outbox_cursor_after_update AFTER UPDATE OF available_at, created_at ON outbox
WHEN new.state = 0 AND new.available_at <= new.created_at AND new.seq < (SELECT new_from FROM outbox_cursor)
BEGIN
    UPDATE outbox_cursor SET new_from = new.seq WHERE new_from > new.seq;
END;
