<?php
/*
 * An order service that announces each order through the transactional outbox
 * (PDO + pdo_sqlite).
 *
 * The order row and its outbox message are written in ONE transaction: both
 * commit or neither does. `outbox-relay`, running beside this service,
 * publishes committed messages to the Redis stream `outbox:orders`.
 *
 *   outbox-relay init --db shop.db               # creates the outbox table (once)
 *   php order_service.php --db shop.db --orders 10 [--fail-every 3]
 *
 * Prints the id of every committed message on stdout, one per line, and
 * "rolled-back <id> <reason>" on stderr for every order that was rolled back.
 */
declare(strict_types=1);

final class PaymentDeclined extends RuntimeException {}

/** A UUIDv7: 48 bits of Unix milliseconds, version 7, then random bits. */
function uuid7(): string
{
    $ms = (int) floor(microtime(true) * 1000);
    $bytes = substr(pack('J', $ms), 2) . random_bytes(10);   // 6 + 10 bytes
    $bytes[6] = chr((ord($bytes[6]) & 0x0f) | 0x70);        // version 7
    $bytes[8] = chr((ord($bytes[8]) & 0x3f) | 0x80);        // variant 10
    return vsprintf('%s%s-%s-%s-%s-%s%s%s', str_split(bin2hex($bytes), 4));
}

/**
 * The optional `headers` column holds one msgpack map with string keys (or
 * NULL). PHP has no msgpack in its standard build, so encode the small
 * string => string map by hand: fixmap/map16 of fixstr/str8/str16/str32.
 */
function msgpack_str(string $s): string
{
    $n = strlen($s);
    if ($n < 32) return chr(0xa0 | $n) . $s;
    if ($n < 0x100) return "\xd9" . chr($n) . $s;
    if ($n < 0x10000) return "\xda" . pack('n', $n) . $s;
    return "\xdb" . pack('N', $n) . $s;
}

function msgpack_str_map(array $map): string
{
    $n = count($map);
    $out = $n < 16 ? chr(0x80 | $n) : "\xde" . pack('n', $n);
    foreach ($map as $k => $v) {
        $out .= msgpack_str((string) $k) . msgpack_str((string) $v);
    }
    return $out;
}

function open_db(string $path): PDO
{
    $pdo = new PDO('sqlite:' . $path, null, null, [
        PDO::ATTR_ERRMODE => PDO::ERRMODE_EXCEPTION,
        PDO::ATTR_TIMEOUT => 10,          // busy timeout: the relay holds the write lock briefly
    ]);
    // Durable commits: with WAL and synchronous=NORMAL a power cut can undo a
    // commit whose message the relay already published (proto/schema.md).
    $pdo->exec('PRAGMA synchronous=FULL');
    if ((int) $pdo->query('PRAGMA user_version')->fetchColumn() < 1) {
        fwrite(STDERR, "$path: no outbox table; run `outbox-relay init --db $path` first\n");
        exit(2);
    }
    // The business table is ours; the outbox table belongs to outbox-relay.
    $pdo->exec('CREATE TABLE IF NOT EXISTS orders('
        . 'id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount_cents INTEGER NOT NULL)');
    return $pdo;
}

function place_order(PDO $pdo, string $messageId, string $customer, int $amountCents, bool $decline): void
{
    $pdo->beginTransaction();
    try {
        $pdo->prepare('INSERT INTO orders(customer, amount_cents) VALUES (?, ?)')
            ->execute([$customer, $amountCents]);
        $orderId = (int) $pdo->lastInsertId();

        $payload = json_encode(
            ['order_id' => $orderId, 'customer' => $customer, 'amount_cents' => $amountCents],
            JSON_UNESCAPED_UNICODE | JSON_THROW_ON_ERROR
        );
        // topic -> stream outbox:orders; key -> this customer's messages are
        // published in commit order. created_at/available_at take their defaults.
        $stmt = $pdo->prepare('INSERT INTO outbox(id, topic, key, payload, headers) VALUES (?, ?, ?, ?, ?)');
        $stmt->bindValue(1, $messageId);
        $stmt->bindValue(2, 'orders');
        $stmt->bindValue(3, "customer-$customer");
        $stmt->bindValue(4, $payload, PDO::PARAM_LOB);   // a BLOB: published byte for byte
        $stmt->bindValue(5, msgpack_str_map([            // or null for no headers
            'content-type' => 'application/json',
            'source' => 'php-order-service',
        ]), PDO::PARAM_LOB);
        $stmt->execute();

        if ($decline) {
            throw new PaymentDeclined("payment declined for order $orderId");
        }
        $pdo->commit();                 // the order and its message, together
    } catch (Throwable $e) {
        $pdo->rollBack();               // neither the order nor its message exists
        throw $e;
    }
}

$opts = getopt('', ['db:', 'orders:', 'fail-every:', 'help']);
if (isset($opts['help']) || !isset($opts['db'])) {
    fwrite(STDERR, "usage: php order_service.php --db PATH [--orders N] [--fail-every K]\n");
    exit(isset($opts['help']) ? 0 : 2);
}
$orders = (int) ($opts['orders'] ?? 1);
$failEvery = (int) ($opts['fail-every'] ?? 0);

$pdo = open_db($opts['db']);
$customers = ['ada', 'zoë', 'björn', '李雷'];       // UTF-8 travels byte for byte
for ($n = 1; $n <= $orders; $n++) {
    $messageId = uuid7();
    try {
        place_order($pdo, $messageId, $customers[$n % count($customers)], 100 * $n + 99,
            $failEvery > 0 && $n % $failEvery === 0);
    } catch (PaymentDeclined $e) {
        fwrite(STDERR, "rolled-back $messageId {$e->getMessage()}\n");
        continue;
    }
    echo $messageId, "\n";
}
