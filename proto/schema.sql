-- The outbox table, schema version 7 (PRAGMA user_version = 7).
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

    -- Relay-owned from here on. A row claimed in a batch keeps these as the
    -- INSERT left them (state 0, lease_token 0): its state is its batch's
    -- (outbox_batch). Read every row's state from outbox_messages.
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

-- Relay-owned: one record per batch of new rows claimed together, the
-- rows of seqs lo..hi that still have no state of their own (state 0,
-- available_at not after created_at, lease_token 0: as written). Claims
-- serialize on the write lock and walk new rows in seq order, so ranges are
-- disjoint. state 1: leased to owner under token until lease_until; a
-- takeover of an expired lease writes a new owner and token + 1. state 2:
-- published (every row of it that has no state of its own) at
-- published_at. attempts: the claims of the batch. A row that fails, is
-- handed back, dead-lettered or held back leaves the batch: it gets a state
-- of its own (and lease_token = the batch's token), written row by row.
CREATE TABLE outbox_batch (
    lo           INTEGER PRIMARY KEY,
    hi           INTEGER NOT NULL CONSTRAINT batch_range CHECK (hi >= lo),
    state        INTEGER NOT NULL CONSTRAINT batch_state_is_1_or_2 CHECK (state = 1 OR state = 2),
    owner        TEXT,
    token        INTEGER NOT NULL CONSTRAINT batch_token_positive CHECK (token > 0),
    lease_until  INTEGER,
    attempts     INTEGER NOT NULL DEFAULT 1,
    published_at INTEGER
);

-- Leased batches by expiry (takeover, the key order of other relays'
-- batches, drain); published batches by age (retention).
CREATE INDEX outbox_batch_leased ON outbox_batch(lease_until) WHERE state = 1;
CREATE INDEX outbox_batch_published ON outbox_batch(published_at) WHERE state = 2;

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

-- Batch records above the new end of the table go too (and a range that
-- reached past it ends there): the seqs they named come back for new rows.
CREATE TRIGGER outbox_cursor_after_delete AFTER DELETE ON outbox
WHEN old.seq >= (SELECT new_from FROM outbox_cursor) - 1
BEGIN
    UPDATE outbox_cursor SET new_from = (SELECT coalesce(max(seq), 0) + 1 FROM outbox)
    WHERE new_from > (SELECT coalesce(max(seq), 0) + 1 FROM outbox);
    DELETE FROM outbox_batch WHERE lo > (SELECT coalesce(max(seq), 0) FROM outbox);
    UPDATE outbox_batch SET hi = (SELECT coalesce(max(seq), 0) FROM outbox)
    WHERE hi > (SELECT coalesce(max(seq), 0) FROM outbox);
END;

-- A waiting row whose available_at is moved back to or before its
-- created_at by an UPDATE (a delayed message sent at once) must be sent at
-- once: it becomes a waiting row due now (available_at just after
-- created_at) instead of a new row again, whose seq the cursor (and maybe a
-- batch's range) has passed. The relay's own updates of available_at always
-- set it after created_at.
CREATE TRIGGER outbox_cursor_after_update AFTER UPDATE OF available_at, created_at ON outbox
WHEN new.state = 0 AND new.available_at <= new.created_at AND new.seq < (SELECT new_from FROM outbox_cursor)
BEGIN
    UPDATE outbox SET available_at = new.created_at + 1 WHERE seq = new.seq;
END;

-- Relay-owned: the seqs that have no row although they lie in a batch's
-- range or at or after the cursor (rows deleted there: by hand, by
-- outbox-replay purge, rows published on their own deleted by retention).
-- The figures (rows by state, for /metrics and outbox-replay stats) count
-- the rows of a range as its length less its holes and less its rows with a
-- state of their own (each found through its partial index), so that they
-- never walk the rows themselves: a count of a seq range walks every row of
-- it. A seq kept here that has a row again (the rows at the end of the
-- table were deleted and their seqs given to new rows) is not a hole.
CREATE TABLE outbox_gone (
    seq INTEGER PRIMARY KEY
);

-- Relay-owned: how many seqs the ranges of the published batches hold
-- together (their rows as written, their holes and the rows that left
-- them), kept by the triggers on outbox_batch, so that the figures need not
-- read every published batch's record. Without its row, the figures add up
-- the records instead.
CREATE TABLE outbox_tally (
    one       INTEGER PRIMARY KEY CONSTRAINT one_row CHECK (one = 1),
    published INTEGER NOT NULL
);
INSERT INTO outbox_tally(one, published) VALUES (1, 0);

-- A deleted row's seq becomes a hole when a batch's range or the cursor's
-- part of the table holds it. Retention deletes a published batch's record
-- before its rows, which then lie in no range: it writes nothing here. An
-- INSERT fires no trigger.
CREATE TRIGGER outbox_gone_after_delete AFTER DELETE ON outbox
WHEN old.seq >= coalesce((SELECT new_from FROM outbox_cursor), 0)
  OR old.seq <= (SELECT hi FROM outbox_batch WHERE lo <= old.seq ORDER BY lo DESC LIMIT 1)
BEGIN
    INSERT OR IGNORE INTO outbox_gone(seq) VALUES (old.seq);
END;

-- The published ranges' total follows every change of a batch record; a
-- record that goes takes its holes with it.
CREATE TRIGGER outbox_batch_after_insert AFTER INSERT ON outbox_batch
WHEN new.state = 2
BEGIN
    UPDATE outbox_tally SET published = published + new.hi - new.lo + 1;
END;

CREATE TRIGGER outbox_batch_after_update AFTER UPDATE OF lo, hi, state ON outbox_batch
WHEN old.state = 2 OR new.state = 2
BEGIN
    UPDATE outbox_tally SET published = published
        - CASE WHEN old.state = 2 THEN old.hi - old.lo + 1 ELSE 0 END
        + CASE WHEN new.state = 2 THEN new.hi - new.lo + 1 ELSE 0 END;
END;

CREATE TRIGGER outbox_batch_after_delete AFTER DELETE ON outbox_batch
BEGIN
    UPDATE outbox_tally SET published = published - (old.hi - old.lo + 1) WHERE old.state = 2;
    DELETE FROM outbox_gone WHERE seq BETWEEN old.lo AND old.hi;
END;

-- Every row's state as derived from the table and the batch records: a
-- row's own state when it has one (state, available_at or lease_token moved
-- from what the INSERT wrote), else its batch's (leased: 1 sending,
-- published: 2), else pending. batch names the batch record (its lo) of a
-- row whose state is its batch's. stream_id is kept for rows published on
-- their own; a row published in a batch has its batch's published_at and no
-- stream_id. The batch is found through its primary key (the greatest lo
-- not above seq), never by a scan of the batches.
CREATE VIEW outbox_messages AS
SELECT o.seq AS seq, o.id AS id, o.topic AS topic, o.key AS key, o.payload AS payload, o.headers AS headers,
       o.created_at AS created_at, o.available_at AS available_at,
       CASE WHEN b.lo IS NULL THEN o.state ELSE b.state END AS state,
       o.attempts + coalesce(b.attempts, 0) AS attempts,
       CASE WHEN b.lo IS NULL THEN o.lease_owner WHEN b.state = 1 THEN b.owner END AS lease_owner,
       CASE WHEN b.lo IS NULL THEN o.lease_token ELSE b.token END AS lease_token,
       CASE WHEN b.lo IS NULL THEN o.lease_until WHEN b.state = 1 THEN b.lease_until END AS lease_until,
       o.last_error AS last_error,
       CASE WHEN b.lo IS NULL THEN o.published_at ELSE b.published_at END AS published_at,
       o.stream_id AS stream_id, o.replay_count AS replay_count, o.replayed_at AS replayed_at,
       o.replay_reason AS replay_reason, b.lo AS batch
FROM outbox o LEFT JOIN outbox_batch b
  ON o.state = 0 AND o.available_at <= o.created_at AND o.lease_token = 0
 AND b.lo = (SELECT max(x.lo) FROM outbox_batch x WHERE x.lo <= o.seq) AND b.hi >= o.seq;
