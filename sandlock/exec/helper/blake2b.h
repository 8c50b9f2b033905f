/*
 * BLAKE2b (RFC 7693, https://www.rfc-editor.org/rfc/rfc7693), keyed or not, with any digest
 * size from 1 to 64 bytes: the tag of the compiled-policy cache's entries
 * (sandlock/compile/cache.py _tag: hashlib.blake2b(payload, key=secret, digest_size=32)).
 * Written from the RFC's description; tests/test_native_run.py compares it with
 * hashlib.blake2b on many keys, lengths and digest sizes.
 */
#ifndef SANDLOCK_BLAKE2B_H
#define SANDLOCK_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct blake2b {
    uint8_t block[128]; /* the block being filled */
    uint64_t h[8];      /* chained state */
    uint64_t t[2];      /* bytes compressed so far, 128 bits */
    size_t used;        /* bytes in block */
    size_t outlen;
};

/* RFC 7693 section 2.6: the initialisation vector (SHA-512's). */
static const uint64_t blake2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

/* RFC 7693 section 2.7: the message word schedule; rounds 10 and 11 repeat rows 0 and 1. */
static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static uint64_t blake2b_rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static uint64_t blake2b_load(const uint8_t *p) { /* little-endian, section 2.4 */
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Section 3.1, the mixing function G. */
#define BLAKE2B_G(a, b, c, d, x, y) do {                                      \
        v[a] = v[a] + v[b] + (x); v[d] = blake2b_rotr(v[d] ^ v[a], 32);       \
        v[c] = v[c] + v[d];       v[b] = blake2b_rotr(v[b] ^ v[c], 24);       \
        v[a] = v[a] + v[b] + (y); v[d] = blake2b_rotr(v[d] ^ v[a], 16);       \
        v[c] = v[c] + v[d];       v[b] = blake2b_rotr(v[b] ^ v[c], 63);       \
    } while (0)

/* Section 3.2, the compression function F. */
static void blake2b_compress(struct blake2b *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = blake2b_load(s->block + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = blake2b_sigma[r];
        BLAKE2B_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        BLAKE2B_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        BLAKE2B_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        BLAKE2B_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        BLAKE2B_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        BLAKE2B_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        BLAKE2B_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        BLAKE2B_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void blake2b_update(struct blake2b *s, const void *data, size_t len) {
    const uint8_t *in = data;
    while (len) {
        if (s->used == sizeof s->block) { /* compress a full block only once more follows */
            s->t[0] += s->used;
            if (s->t[0] < s->used)
                s->t[1]++;
            blake2b_compress(s, 0);
            s->used = 0;
        }
        size_t take = sizeof s->block - s->used < len ? sizeof s->block - s->used : len;
        memcpy(s->block + s->used, in, take);
        s->used += take;
        in += take;
        len -= take;
    }
}

/* Section 3.3: parameter block word 0 is 0x0101kknn (key length kk, digest length nn);
 * a key is the first block, padded with zeros. 0 on success, -1 for bad sizes. */
static int blake2b_init(struct blake2b *s, size_t outlen, const void *key, size_t keylen) {
    if (outlen == 0 || outlen > 64 || keylen > 64)
        return -1;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 8; i++)
        s->h[i] = blake2b_iv[i];
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ outlen;
    s->outlen = outlen;
    if (keylen) {
        blake2b_update(s, key, keylen);
        s->used = sizeof s->block;
    }
    return 0;
}

static void blake2b_final(struct blake2b *s, uint8_t *out) {
    s->t[0] += s->used;
    if (s->t[0] < s->used)
        s->t[1]++;
    memset(s->block + s->used, 0, sizeof s->block - s->used);
    blake2b_compress(s, 1);
    for (size_t i = 0; i < s->outlen; i++)
        out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}

static int blake2b(uint8_t *out, size_t outlen, const void *key, size_t keylen, const void *data,
                   size_t len) {
    struct blake2b s;
    if (blake2b_init(&s, outlen, key, keylen) < 0)
        return -1;
    blake2b_update(&s, data, len);
    blake2b_final(&s, out);
    return 0;
}

#endif
