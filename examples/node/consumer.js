#!/usr/bin/env node
// A Node.js consumer of an outbox stream (proto/envelope.md) that applies
// each message at most once, with the Redis SET NX dedup contract of
// proto/dedup.md. It uses the same keys, values and Lua scripts as the C
// consumer (outbox-consume, liboutbox), so Node and C consumers can share one
// consumer group: whoever gets a message first applies it, the others skip it.
//
//   npm ci
//   node consumer.js --redis redis://127.0.0.1:6379 --stream outbox:orders \
//                    --group billing [--consumer NAME] [--drain]
//   node consumer.js --redis rediss://localhost:6380 --tls-ca-file ca.crt \
//                    [--tls-cert-file client.crt --tls-key-file client.key] ...
//
// TLS takes the options of outbox-consume, passed to ioredis as its `tls`
// option (Node's tls.connect): --tls-ca-file is `ca`, --tls-cert-file and
// --tls-key-file are `cert` and `key`, --tls-server-name is `servername`
// (the name verified and sent as SNI; default the URL's host) and
// --tls-insecure is `rejectUnauthorized: false`. Node has no CA directory
// option: without --tls-ca-file its own CA list is used.
//
// The "effect" here prints each newly applied message as one JSON line on
// stdout: {id, db, topic, key, payload (UTF-8 text), created_at}; db is the
// message's database when the relay names it (one relay over many
// databases, whose message ids are unique per database only), else null. Replace
// handle() with your own; throw from it to leave the message for a retry.
'use strict';

const crypto = require('node:crypto');
const os = require('node:os');
const { parseArgs } = require('node:util');
const Redis = require('ioredis');
const { ReplyError } = Redis; // an error answer from the server (not a lost connection)
const { decode } = require('@msgpack/msgpack');

// ---------------------------------------------------------------------------
// The effect: one JSON line per message. It resolves once the line is written,
// so a message counts as applied only when its output really left the process.

const utf8 = new TextDecoder('utf-8');

function handle(msg) {
  const line = JSON.stringify({
    id: msg.id,
    db: msg.db,
    topic: msg.topic,
    key: msg.key,
    payload: utf8.decode(msg.payload),
    created_at: msg.createdAt,
  }) + '\n';
  return new Promise((resolve, reject) =>
    process.stdout.write(line, (err) => (err ? reject(err) : resolve())));
}

// ---------------------------------------------------------------------------
// Envelope (proto/envelope.md): a msgpack map v/id/topic/key/payload/headers/
// created_at, and db when the relay names the message's database (then the
// entry has a db field too, the same). Unknown keys are ignored; an unknown
// version is refused.

function decodeEnvelope(idField, dbField, raw) {
  if (!idField || !raw) throw new Error('entry lacks the id or envelope field');
  const env = decode(raw); // throws on malformed msgpack and on trailing bytes
  if (env === null || typeof env !== 'object' || Array.isArray(env) || env instanceof Uint8Array) {
    throw new Error('envelope is not a msgpack map');
  }
  if (env.v !== 1) throw new Error(`envelope version ${env.v}, this consumer reads 1`);
  const { id, topic, key, payload, headers, created_at: createdAt, db } = env;
  if (typeof id !== 'string' || id === '') throw new Error("field 'id' is not a non-empty string");
  if (id !== idField) throw new Error("entry id field differs from the envelope's id");
  if (typeof topic !== 'string' || topic === '') throw new Error("field 'topic' is not a non-empty string");
  if (!(payload instanceof Uint8Array) && typeof payload !== 'string') {
    throw new Error("field 'payload' is not bin or str");
  }
  if (!Number.isInteger(createdAt) && typeof createdAt !== 'bigint') {
    throw new Error("field 'created_at' is not an integer");
  }
  if (key != null && typeof key !== 'string') throw new Error("field 'key' is not a string or nil");
  if (headers != null && (typeof headers !== 'object' || Array.isArray(headers) || headers instanceof Uint8Array)) {
    throw new Error("field 'headers' is not a map or nil");
  }
  if (db != null && typeof db !== 'string') throw new Error("field 'db' is not a string or nil");
  if ((db ?? null) !== dbField) throw new Error("entry db field differs from the envelope's db");
  return {
    id,
    db: db ?? null,
    topic,
    key: key ?? null,
    payload: typeof payload === 'string' ? Buffer.from(payload, 'utf8') : payload,
    headers: headers ?? null,
    createdAt: Number(createdAt),
  };
}

// ---------------------------------------------------------------------------
// Dedup (proto/dedup.md). Key <namespace>:{<stream>}:<message id>, or
// <namespace>:{<stream>}:<db>:<message id> for a message that names its
// database (dedupId below); value
// P:<owner> while applying (expires after the lease), D once applied (expires
// after the retention). The script bodies are byte for byte those of the C
// module, so they have the same SHA1 and share Redis's script cache.

const COMPLETE_LUA =
  "if redis.call('GET', KEYS[1]) == ARGV[1] then " +
  "redis.call('SET', KEYS[1], 'D', 'PX', ARGV[2]) return 1 end return 0";
const ABANDON_LUA =
  "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end return 0";
const sha1 = (s) => crypto.createHash('sha1').update(s).digest('hex');

class RedisDedup {
  constructor(redis, { namespace, leaseMs, retentionMs }) {
    this.redis = redis;
    this.namespace = namespace;
    this.leaseMs = leaseMs;
    this.retentionMs = retentionMs;
    this.owner = `P:${crypto.randomUUID()}`; // unique per consumer process
  }

  key(stream, id) {
    return `${this.namespace}:{${stream}}:${id}`;
  }

  // 'FIRST': apply, then complete() or abandon(). 'DONE': already applied,
  // acknowledge. 'BUSY': someone is applying it now, retry later.
  async begin(stream, id) {
    const key = this.key(stream, id);
    const [[setErr, set], [getErr, value]] = await this.redis
      .pipeline()
      .set(key, this.owner, 'PX', this.leaseMs, 'NX')
      .get(key)
      .exec();
    if (setErr || getErr) throw setErr || getErr; // never assume FIRST on an error
    if (set === 'OK') return 'FIRST';
    return value === 'D' ? 'DONE' : 'BUSY';
  }

  // true, or false when the lease expired before completion (the effect may
  // then have been applied twice: raise the lease).
  async complete(stream, id) {
    return (await this.script(COMPLETE_LUA, this.key(stream, id), this.owner, this.retentionMs)) === 1;
  }

  async abandon(stream, id) {
    return (await this.script(ABANDON_LUA, this.key(stream, id), this.owner)) === 1;
  }

  // EVALSHA; on NOSCRIPT (restarted or flushed server) EVAL, which caches it.
  async script(body, key, ...args) {
    try {
      return await this.redis.evalsha(sha1(body), 1, key, ...args);
    } catch (err) {
      if (!String(err.message).startsWith('NOSCRIPT')) throw err;
      return this.redis.eval(body, 1, key, ...args);
    }
  }
}

// ---------------------------------------------------------------------------
// The consumer loop (proto/dedup.md, "The consumer loop").

function log(level, msg, fields = {}) {
  const kv = Object.entries(fields)
    .map(([k, v]) => ` ${k}=${typeof v === 'number' ? v : JSON.stringify(String(v))}`)
    .join('');
  process.stderr.write(`level=${level} msg=${JSON.stringify(msg)}${kv}\n`);
}

// Message ids are unique per database: a message that names its database
// is deduplicated as <db>:<id>, one that does not (or an empty name, which
// no relay writes) as its id, the keys of messages published before.
const dedupId = (msg) => (msg.db ? `${msg.db}:${msg.id}` : msg.id);

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// [f1, v1, f2, v2, ...] (Buffers) -> first value of each field.
function fieldMap(fields) {
  const map = {};
  for (let i = 0; fields && i + 1 < fields.length; i += 2) {
    const name = fields[i].toString();
    if (!(name in map)) map[name] = fields[i + 1];
  }
  return map;
}

class Consumer {
  constructor(redis, dedup, opts) {
    Object.assign(this, { redis, dedup, opts });
    this.stream = opts.stream;
    this.group = opts.group;
    this.name = opts.consumer;
    this.stats = { applied: 0, duplicates: 0, busy: 0, failed: 0, dead: 0 };
    // Our pending entries whose handler did not run (BUSY, Redis unreachable):
    // retried without counting a delivery, as the C consumer does, so that an
    // entry is not dead-lettered while another consumer is still applying it.
    this.rechecks = new Map(); // entry id -> { fields, deliveries, since }
  }

  recheckLater(entryId, fields, deliveries) {
    this.rechecks.set(entryId, { fields, deliveries, since: Date.now() });
  }

  async ensureGroup() {
    try {
      // From the start of the stream: every message is processed, also
      // those published before the group existed.
      await this.redis.xgroup('CREATE', this.stream, this.group, '0', 'MKSTREAM');
    } catch (err) {
      if (!String(err.message).startsWith('BUSYGROUP')) throw err;
    }
  }

  ack(entryId) {
    return this.redis.xack(this.stream, this.group, entryId);
  }

  // Copies an entry we cannot or must not process to <stream>:dead, with
  // the fields the C consumer writes, then acknowledges it.
  async deadLetter(entryId, fields, deliveries, reason) {
    const f = fieldMap(fields);
    log('error', 'dead-lettered', { entry: entryId, deliveries, reason });
    try {
      await this.redis.xadd(`${this.stream}:dead`, '*',
        'id', f.id ?? '', ...(f.db !== undefined ? ['db', f.db] : []), 'envelope', f.envelope ?? '',
        'source_entry', entryId, 'group', this.group, 'deliveries', String(deliveries), 'reason', reason);
    } catch (err) {
      this.recheckLater(entryId, fields, deliveries);
      throw err;
    }
    await this.ack(entryId);
    this.stats.dead++;
  }

  // One delivered entry: decode, begin, apply, complete + XACK. Anything
  // that is not acknowledged stays pending in the group and is retried.
  async processEntry(entryId, fields, deliveries) {
    const f = fieldMap(fields);
    let msg;
    try {
      msg = decodeEnvelope(f.id && f.id.toString(), f.db === undefined ? null : f.db.toString(), f.envelope);
    } catch (err) {
      return this.deadLetter(entryId, fields, deliveries, `malformed entry: ${err.message}`);
    }
    if (deliveries > this.opts.maxDeliveries) {
      return this.deadLetter(entryId, fields, deliveries,
        `delivered ${deliveries} times, more than max_deliveries ${this.opts.maxDeliveries}`);
    }
    let state;
    try {
      state = await this.dedup.begin(this.stream, dedupId(msg));
    } catch (err) {
      // An error answer about this message's key (WRONGTYPE) counts towards
      // max deliveries; Redis being unreachable does not.
      if (!(err instanceof ReplyError)) this.recheckLater(entryId, fields, deliveries);
      throw err;
    }
    if (state === 'DONE') {
      this.stats.duplicates++;
      return this.ack(entryId);
    }
    if (state === 'BUSY') {
      this.stats.busy++; // another consumer is applying it: look again later
      this.recheckLater(entryId, fields, deliveries);
      return undefined;
    }
    try {
      await handle(msg);
    } catch (err) {
      this.stats.failed++;
      log('warn', 'handler failed; entry left pending for retry', { id: msg.id, entry: entryId, error: err.message });
      await this.dedup.abandon(this.stream, dedupId(msg));
      return undefined;
    }
    this.stats.applied++;
    // The effect happened: acknowledge it whatever complete() says, as the C
    // consumer does (a redelivery of this entry would only apply it again).
    try {
      if (!(await this.dedup.complete(this.stream, dedupId(msg)))) {
        log('warn', 'dedup lease expired before complete: the effect may be applied twice; raise the lease',
          { id: msg.id });
      }
    } catch (err) {
      log('warn', 'dedup complete failed: a duplicate may apply the effect again after the lease',
        { id: msg.id, error: err.message });
    }
    return this.ack(entryId);
  }

  // New entries for this group. Returns how many were delivered.
  async readNew(blockMs) {
    const reply = await this.redis.xreadgroupBuffer('GROUP', this.group, this.name,
      'COUNT', this.opts.batch, 'BLOCK', blockMs, 'STREAMS', this.stream, '>');
    let n = 0;
    for (const [, entries] of reply ?? []) {
      for (const [id, fields] of entries) {
        n++;
        await this.processEntry(id.toString(), fields, 1);
      }
    }
    return n;
  }

  // Pending entries idle for at least minIdle ms (only ours when `mine`):
  // XCLAIM them to us, which counts a delivery, and process them again.
  // Ours: retries after a failure. Anyone's: entries of a consumer that
  // crashed or hangs. Rechecks (see above) are claimed with JUSTID, which
  // only confirms that they are still pending, without counting.
  async retryPending(minIdle, mine) {
    const args = [this.stream, this.group, 'IDLE', minIdle, '-', '+', this.opts.batch];
    const pending = await this.redis.xpending(...args, ...(mine ? [this.name] : []));
    if (mine && pending.length < this.opts.batch) {
      // Forget rechecks that left our pending list (taken over by another
      // consumer after a long outage): all of ours idle that long are listed.
      const listed = new Set(pending.map(([id]) => id));
      for (const [id, r] of this.rechecks) {
        if (!listed.has(id) && Date.now() - r.since > 2 * minIdle) this.rechecks.delete(id);
      }
    }
    const counts = new Map();
    const rechecks = [];
    for (const [id, consumer, , count] of pending) {
      if (consumer === this.name && this.rechecks.has(id)) rechecks.push(id);
      else counts.set(id, count);
    }
    if (rechecks.length > 0) {
      const still = new Set(await this.redis.xclaim(this.stream, this.group, this.name, minIdle,
        ...rechecks, 'JUSTID'));
      for (const id of rechecks) {
        const { fields, deliveries } = this.rechecks.get(id);
        this.rechecks.delete(id); // acknowledged by someone else when not `still` pending
        if (still.has(id)) await this.processEntry(id, fields, deliveries);
      }
    }
    if (counts.size === 0) return;
    const claimed = await this.redis.xclaimBuffer(this.stream, this.group, this.name, minIdle, ...counts.keys());
    for (const [id, fields] of claimed) {
      const entryId = id.toString();
      this.rechecks.delete(entryId);
      await this.processEntry(entryId, fields, (counts.get(entryId) ?? 0) + 1);
    }
  }

  async ownPendingCount() {
    return (await this.redis.xpending(this.stream, this.group, '-', '+', 1, this.name)).length;
  }

  async run(shouldStop) {
    await this.ensureGroup();
    let lastTakeover = Date.now();
    while (!shouldStop()) {
      try {
        await this.retryPending(this.opts.retryMs, true);
        if (Date.now() - lastTakeover >= this.opts.claimIntervalMs) {
          lastTakeover = Date.now();
          await this.retryPending(this.opts.minIdleMs, false);
        }
        // Draining only needs to know whether anything is left.
        const got = await this.readNew(this.opts.drain ? 100 : this.opts.blockMs);
        if (this.opts.drain && got === 0 && (await this.ownPendingCount()) === 0) {
          log('info', 'drained', this.stats);
          return;
        }
      } catch (err) {
        if (String(err.message).startsWith('NOGROUP')) {
          await this.ensureGroup(); // stream or group deleted: start again
        } else {
          // Redis unreachable or a command failed: nothing was acknowledged
          // that was not applied; pending entries are retried.
          log('warn', 'redis error; retrying', { error: err.message });
          await sleep(1000);
        }
      }
    }
    log('info', 'consumer stopped', this.stats);
  }
}

// ---------------------------------------------------------------------------

const USAGE = `Usage: node consumer.js --redis URL --stream S --group G [--consumer NAME] [--drain] [options]

  --redis URL                redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or unix:///path[?db=N]
  --stream S                 stream to read, e.g. outbox:orders
  --group G                  consumer group (created at the start of the stream if missing)
  --consumer NAME            consumer name (default HOSTNAME:PID)
  --namespace NS             dedup key namespace (default dedup:GROUP, as outbox-consume)
  --dedup-lease-ms MS        processing lease of a dedup key (default 30000)
  --dedup-retention-ms MS    how long done markers are kept (default 604800000, 7 days)
  --batch N                  XREADGROUP COUNT (default 100)
  --block-ms MS              XREADGROUP BLOCK (default 2000)
  --retry-ms MS              retry a failed or busy message after (default 1000)
  --min-idle-ms MS           take over other consumers' entries pending this long (default 60000)
  --claim-interval-ms MS     how often to look for them (default 5000)
  --max-deliveries N         then the entry goes to S:dead (default 5)
  --drain                    exit once nothing is new and nothing is pending for this consumer
  --tls-ca-file FILE         rediss:// only: PEM file of the CAs that verify the server (default Node's CA list)
  --tls-cert-file FILE       rediss:// only: client certificate (PEM) for mutual TLS; needs --tls-key-file
  --tls-key-file FILE        rediss:// only: its private key (PEM, not encrypted)
  --tls-server-name NAME     rediss:// only: the name sent as SNI and verified (default the URL's host)
  --tls-insecure             rediss:// only: verify nothing; logged as a warning at every connect
`;

function parseOptions(argv) {
  const numeric = {
    'dedup-lease-ms': 30000, 'dedup-retention-ms': 7 * 24 * 3600 * 1000, batch: 100, 'block-ms': 2000,
    'retry-ms': 1000, 'min-idle-ms': 60000, 'claim-interval-ms': 5000, 'max-deliveries': 5,
  };
  const options = {
    redis: { type: 'string' }, stream: { type: 'string' }, group: { type: 'string' },
    consumer: { type: 'string' }, namespace: { type: 'string' },
    drain: { type: 'boolean' }, help: { type: 'boolean', short: 'h' },
    'tls-ca-file': { type: 'string' }, 'tls-cert-file': { type: 'string' }, 'tls-key-file': { type: 'string' },
    'tls-server-name': { type: 'string' }, 'tls-insecure': { type: 'boolean' },
  };
  for (const name of Object.keys(numeric)) options[name] = { type: 'string' };
  const { values } = parseArgs({ args: argv, options, strict: true });
  if (values.help) {
    process.stdout.write(USAGE);
    process.exit(0);
  }
  if (!values.redis || !values.stream || !values.group) throw new Error('--redis, --stream and --group are required');
  const camel = (s) => s.replace(/-(.)/g, (_, c) => c.toUpperCase());
  const opts = {
    redis: values.redis,
    stream: values.stream,
    group: values.group,
    consumer: values.consumer ?? `${os.hostname()}:${process.pid}`,
    namespace: values.namespace ?? `dedup:${values.group}`,
    drain: Boolean(values.drain),
    tls: tlsOptions(values),
  };
  if (opts.tls && !values.redis.startsWith('rediss://')) {
    throw new Error(`--${opts.tls.given}: given but the Redis URL is not rediss:// (TLS is only used with rediss://)`);
  }
  // As in the C module: the stream must stay the key's only hash tag.
  const nsBytes = Buffer.byteLength(opts.namespace);
  if (nsBytes < 1 || nsBytes > 256 || /[{} ]/.test(opts.namespace)) {
    throw new Error('--namespace: the dedup key namespace (default dedup:<group>) must be 1..256 bytes without braces or spaces');
  }
  for (const [name, dflt] of Object.entries(numeric)) {
    const v = values[name] === undefined ? dflt : Number(values[name]);
    if (!Number.isSafeInteger(v) || v < 1) throw new Error(`--${name}: '${values[name]}' is not a positive whole number`);
    opts[camel(name)] = v;
  }
  return opts;
}

// The --tls-* options as Node's tls.connect options, read now so that a
// missing file stops the start (as in outbox-consume); null when none given.
function tlsOptions(values) {
  const names = ['tls-ca-file', 'tls-cert-file', 'tls-key-file', 'tls-server-name', 'tls-insecure'];
  const given = names.find((n) => values[n] !== undefined);
  if (!given) return null;
  if ((values['tls-cert-file'] === undefined) !== (values['tls-key-file'] === undefined)) {
    throw new Error('--tls-cert-file and --tls-key-file: a client certificate needs both');
  }
  const read = (name) => {
    try {
      return values[name] === undefined ? undefined : require('node:fs').readFileSync(values[name]);
    } catch (err) {
      throw new Error(`--${name}: cannot read '${values[name]}': ${err.message}`);
    }
  };
  const tls = { given, ca: read('tls-ca-file'), cert: read('tls-cert-file'), key: read('tls-key-file') };
  if (values['tls-server-name'] !== undefined) tls.servername = values['tls-server-name'];
  if (values['tls-insecure']) tls.rejectUnauthorized = false;
  return tls;
}

// ioredis takes redis:// and rediss:// URLs as they are (tls holds the
// rediss:// settings); unix:///path?db=N becomes {path, db}.
function connect(url, tls) {
  const options = { connectionName: 'outbox-consumer-node' };
  if (tls) {
    const { given, ...settings } = tls;
    options.tls = Object.fromEntries(Object.entries(settings).filter(([, v]) => v !== undefined));
  }
  if (url.startsWith('unix://')) {
    const u = new URL(url);
    return new Redis({ ...options, path: decodeURIComponent(u.pathname), db: Number(u.searchParams.get('db') ?? 0) });
  }
  return new Redis(url, options);
}

async function main() {
  let opts;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`consumer.js: ${err.message}\n${USAGE}`);
    return 2;
  }
  const redis = connect(opts.redis, opts.tls);
  if (opts.tls?.rejectUnauthorized === false) {
    redis.on('connect', () => log('warn', "TLS without verification: the server's certificate and name are not checked"));
  }
  redis.on('error', (err) => log('warn', 'redis connection error', { error: err.message }));
  const dedup = new RedisDedup(redis, {
    namespace: opts.namespace, leaseMs: opts.dedupLeaseMs, retentionMs: opts.dedupRetentionMs,
  });
  const consumer = new Consumer(redis, dedup, opts);

  // First signal: finish the current entry and stop. Second: exit at once.
  let stop = false;
  const onSignal = () => {
    if (stop) process.exit(1);
    stop = true;
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);

  log('info', 'consumer started', { stream: opts.stream, group: opts.group, consumer: opts.consumer });
  try {
    await consumer.run(() => stop);
  } finally {
    await redis.quit().catch(() => redis.disconnect());
  }
  return 0;
}

main().then(
  (code) => { process.exitCode = code; },
  (err) => { log('error', 'fatal', { error: err.message }); process.exitCode = 1; },
);
