-- The consumer inbox (SQLite dedup mode of the consumer-group helper).
--
-- Lives in the consumer's own database. The helper creates it if missing
-- (CREATE ... IF NOT EXISTS; it does not touch PRAGMA user_version there) and
-- inserts one row per applied message in the same transaction as the
-- message's effect: a redelivered message fails the UNIQUE constraint and is
-- skipped, so each effect is applied exactly once, with no window.
-- Rows older than the inbox retention (default 7 days) are deleted in small
-- batches; a message redelivered after that would be applied again.

-- Message ids are unique per database: a message that names its database
-- (the entry's `db` field, proto/envelope.md) is recorded as
-- '<db>:<message id>', one that does not as its plain id, so that the same
-- id from two databases is two messages. The table is the same either way:
-- one created before databases were named keeps working unchanged.

CREATE TABLE IF NOT EXISTS outbox_inbox (
    message_id  TEXT    NOT NULL,   -- the entry's `id` field, or '<db>:<id>' with its `db` field
    stream      TEXT    NOT NULL,   -- the stream it was read from
    entry_id    TEXT    NOT NULL,   -- the Redis stream entry id, for tracing
    received_at INTEGER NOT NULL,   -- unix ms when it was applied
    UNIQUE (message_id, stream)
);

CREATE INDEX IF NOT EXISTS outbox_inbox_received ON outbox_inbox(received_at);
