/*
 * slot.h: Redis Cluster hash slots (internal).
 *
 * The key's slot is CRC16 (XMODEM: polynomial 0x1021, initial value 0, no
 * reflection) of the key modulo 16384, as the Redis Cluster specification
 * defines it, with hash tags: if the key has a '{' and, after it, a '}' with
 * at least one byte between them, only the bytes between the first '{' and
 * the first '}' after it are hashed ("{user1000}.following" and
 * "{user1000}.followers" share a slot; "foo{}{bar}" hashes the whole key;
 * "foo{{bar}}zap" hashes "{bar"). Pure functions, any thread.
 */
#ifndef OUTBOX_SRC_SLOT_H
#define OUTBOX_SRC_SLOT_H

#include <stddef.h>
#include <stdint.h>

#define OUTBOX__SLOTS 16384

/* CRC16-XMODEM of len bytes ("123456789" gives 0x31C3). */
uint16_t outbox__crc16(const char *buf, size_t len);
/* The hash slot of a key, 0..16383, hash tags applied. */
unsigned outbox__key_slot(const char *key, size_t len);
/* The part of key that is hashed: *off and *n (the whole key when it has no
 * usable hash tag). */
void outbox__key_hashed_part(const char *key, size_t len, size_t *off, size_t *n);

#endif
