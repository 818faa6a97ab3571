/* AES-GCM (NIST SP 800-38D) with 96-bit nonces and 128-bit tags, on x86-64 CPUs with AVX2, VAES
 * and VPCLMULQDQ: AES rounds on two blocks per 256-bit register, GHASH with carry-less multiplies
 * on two blocks per register. HBONE's record layer (proxy/tls_records.py) seals and opens every
 * byte it carries with it; proxy/aes_gcm.py picks it when the CPU has these instructions and
 * `cryptography`'s AESGCM otherwise, which this type matches method for method (encrypt,
 * decrypt, encrypt_into, decrypt_into; InvalidTag from cryptography.exceptions).
 *
 * Why: the OpenSSL inside `cryptography` has a VAES path for AVX-512 CPUs only; on AVX2 CPUs with
 * VAES (AMD Zen 3, Intel Alder Lake and later) it runs one block per AES instruction, at about
 * twice BoringSSL's cost per record (bench/README.md, issue 11, sessions 20 and 21).
 *
 * How (written from the GCM and AES specifications; every function is checked against
 * `cryptography`'s AESGCM in tests/unit/test_aes_gcm.py):
 * - Counter mode: the counter block is nonce || 32-bit big-endian counter; data starts at 2
 *   (1 is the tag's mask). Counter blocks are kept byte-reversed, where the counter is the low
 *   32-bit lane and a lane add is GCM's inc32 (it wraps without touching the nonce).
 * - GHASH: a block is loaded byte-reversed, so coefficient x^j of GCM's field element a(x) is
 *   bit 127 - j of the register: the register, as a polynomial in t, is A(t) = t^127 a(1/t).
 *   Field products mod g(x) = x^128 + x^7 + x^2 + x + 1 become products mod the reciprocal
 *   g*(t) = t^128 + t^127 + t^126 + t^121 + 1, and the register of a b is A B / t^127. A
 *   Montgomery reduction divides by t^128 (it adds the multiple of g* that clears the low 128
 *   bits, 64 at a time, each one carry-less multiply by 0xC200000000000000), so the hash key's
 *   powers are kept times t (a left shift, g* folded back in when a bit leaves the top: the
 *   constant 0xC2000000000000000000000000000001), and reduce(A (H t)) is exactly a h.
 * - Sixteen blocks are hashed per step with the key's powers h^16 ... h^1 and one reduction
 *   (GHASH is linear, so the products are summed unreduced), three carry-less multiplies per
 *   block (Karatsuba).
 * - Opening checks the tag before it decrypts: a record that fails leaves `buf` untouched.
 * Buffers may be the same memory (in place) but must not otherwise overlap. AES-NI and carry-less
 * multiplies take the same time whatever the data; the tag is compared without an early exit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,aes,pclmul,vaes,vpclmulqdq,ssse3,sse4.1")))

#define BLOCK 16
#define NONCE_BYTES 12
#define TAG_BYTES 16
#define HASH_POWERS 16
/* SP 800-38D 5.2.1.1: at most 2^32 - 2 blocks of data per nonce. */
#define MAX_DATA_BYTES (((int64_t)1 << 36) - 32)

typedef struct {
    PyObject_HEAD
    int rounds;                            /* 10 (AES-128) or 14 (AES-256) */
    uint8_t round_keys[15][BLOCK];
    /* powers[i] = h^(i+1) times t, byte-reversed (see the top of the file) */
    uint8_t powers[HASH_POWERS][BLOCK];
} AesGcm;

static PyObject *invalid_tag; /* cryptography.exceptions.InvalidTag */

/* AES -------------------------------------------------------------------------------------- */

TARGET static inline __m128i expand_step(__m128i key, __m128i assist) {
    /* w[i] = w[i-N] ^ ... ^ temp: each word of the next round key is the xor of the words
     * before it in the previous one and the assisted word. */
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    return _mm_xor_si128(key, assist);
}

#define ASSIST_ROT(k, rcon) _mm_shuffle_epi32(_mm_aeskeygenassist_si128((k), (rcon)), 0xff)
#define ASSIST_SUB(k) _mm_shuffle_epi32(_mm_aeskeygenassist_si128((k), 0), 0xaa)

/* FIPS-197 5.2. AES-128 (Nk = 4): round key i from round key i - 1, with RotWord, SubWord and
 * rcon. AES-256 (Nk = 8): round keys i and i + 1 from the two before them, the first with
 * RotWord, SubWord and rcon, the second with SubWord only. (aeskeygenassist takes rcon as an
 * immediate, so the schedules are written out rather than looped.) */
#define NEXT_128(i, rcon) (k = expand_step(k, ASSIST_ROT(k, rcon)), rk[i] = k)
#define NEXT_256(i, rcon) \
    (a = expand_step(a, ASSIST_ROT(b, rcon)), rk[i] = a, b = expand_step(b, ASSIST_SUB(a)), rk[(i) + 1] = b)

TARGET static void expand_key_128(const uint8_t *key, __m128i rk[11]) {
    __m128i k = _mm_loadu_si128((const __m128i *)key);
    rk[0] = k;
    NEXT_128(1, 0x01), NEXT_128(2, 0x02), NEXT_128(3, 0x04), NEXT_128(4, 0x08), NEXT_128(5, 0x10);
    NEXT_128(6, 0x20), NEXT_128(7, 0x40), NEXT_128(8, 0x80), NEXT_128(9, 0x1b), NEXT_128(10, 0x36);
}

TARGET static void expand_key_256(const uint8_t *key, __m128i rk[15]) {
    __m128i a = _mm_loadu_si128((const __m128i *)key);
    __m128i b = _mm_loadu_si128((const __m128i *)(key + 16));
    rk[0] = a;
    rk[1] = b;
    NEXT_256(2, 0x01), NEXT_256(4, 0x02), NEXT_256(6, 0x04), NEXT_256(8, 0x08);
    NEXT_256(10, 0x10), NEXT_256(12, 0x20);
    a = expand_step(a, ASSIST_ROT(b, 0x40));
    rk[14] = a;
}

TARGET static inline __m128i rk128(const AesGcm *self, int i) {
    return _mm_loadu_si128((const __m128i *)self->round_keys[i]);
}

TARGET static inline __m128i encrypt_block(const AesGcm *self, __m128i x) {
    x = _mm_xor_si128(x, rk128(self, 0));
    for (int i = 1; i < self->rounds; i++)
        x = _mm_aesenc_si128(x, rk128(self, i));
    return _mm_aesenclast_si128(x, rk128(self, self->rounds));
}

/* GHASH ------------------------------------------------------------------------------------ */

TARGET static inline __m128i byte_reverse_mask(void) {
    return _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The 256-bit carry-less product's three parts are summed unreduced: lo (low halves), mid
 * (cross terms), hi (high halves). */
typedef struct {
    __m128i lo, mid, hi;
} Product;

TARGET static inline void product_add(Product *p, __m128i a, __m128i b) {
    p->lo = _mm_xor_si128(p->lo, _mm_clmulepi64_si128(a, b, 0x00));
    p->hi = _mm_xor_si128(p->hi, _mm_clmulepi64_si128(a, b, 0x11));
    p->mid = _mm_xor_si128(p->mid, _mm_clmulepi64_si128(a, b, 0x01));
    p->mid = _mm_xor_si128(p->mid, _mm_clmulepi64_si128(a, b, 0x10));
}

/* Montgomery reduction of a 256-bit product by g*(t): (P + q g*) / t^128 for the q that clears
 * the low 128 bits, taken 64 bits at a time. With P = hi:lo and lo = L1:L0, adding L0 g* clears
 * L0 and adds L0 * 0xC2.. (shifted 64) and L0 (shifted 128); then the same for the new L1. */
TARGET static inline __m128i reduce(Product p) {
    const __m128i poly = _mm_set_epi64x(0, (long long)0xC200000000000000ULL);
    __m128i lo = _mm_xor_si128(p.lo, _mm_slli_si128(p.mid, 8));
    __m128i hi = _mm_xor_si128(p.hi, _mm_srli_si128(p.mid, 8));
    __m128i t1 = _mm_clmulepi64_si128(lo, poly, 0x00);           /* L0 * C */
    __m128i m = _mm_xor_si128(lo, _mm_shuffle_epi32(t1, 0x4e));  /* L1 ^ T1.lo : L0 ^ T1.hi */
    __m128i t2 = _mm_clmulepi64_si128(m, poly, 0x01);            /* (L1 ^ T1.lo) * C */
    return _mm_xor_si128(_mm_xor_si128(hi, t2), m);
}

TARGET static inline __m128i multiply(__m128i a, __m128i b) {
    Product p = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    product_add(&p, a, b);
    return reduce(p);
}

TARGET static inline __m128i power(const AesGcm *self, int exponent) {
    return _mm_loadu_si128((const __m128i *)self->powers[exponent - 1]);
}

/* Hash `n` bytes into `y` (byte-reversed state), the last block zero-padded. */
TARGET static __m128i ghash(const AesGcm *self, __m128i y, const uint8_t *data, size_t n) {
    const __m128i rev = byte_reverse_mask();
    const __m256i rev2 = _mm256_broadcastsi128_si256(rev);
    if (n >= HASH_POWERS * BLOCK) {
        /* Keys for one step, two per register: block 2j takes h^(16-2j), block 2j+1 h^(15-2j).
         * Karatsuba: the cross terms of a b are (a.lo ^ a.hi)(b.lo ^ b.hi) ^ lo ^ hi, one
         * carry-less multiply instead of two, so each key's halves are also kept xored. */
        __m256i keys[HASH_POWERS / 2], folded[HASH_POWERS / 2];
        for (int j = 0; j < HASH_POWERS / 2; j++) {
            keys[j] = _mm256_set_m128i(power(self, HASH_POWERS - 1 - 2 * j), power(self, HASH_POWERS - 2 * j));
            folded[j] = _mm256_xor_si256(keys[j], _mm256_shuffle_epi32(keys[j], 0x4e));
        }
        while (n >= HASH_POWERS * BLOCK) {
            __m256i lo = _mm256_setzero_si256(), mid = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < HASH_POWERS / 2; j++) {
                __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(data + 32 * j)), rev2);
                if (j == 0)
                    x = _mm256_xor_si256(x, _mm256_zextsi128_si256(y));
                lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(x, keys[j], 0x00));
                hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(x, keys[j], 0x11));
                __m256i x_folded = _mm256_xor_si256(x, _mm256_shuffle_epi32(x, 0x4e));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(x_folded, folded[j], 0x00));
            }
            mid = _mm256_xor_si256(mid, _mm256_xor_si256(lo, hi));
            Product p = {
                _mm_xor_si128(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)),
                _mm_xor_si128(_mm256_castsi256_si128(mid), _mm256_extracti128_si256(mid, 1)),
                _mm_xor_si128(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)),
            };
            y = reduce(p);
            data += HASH_POWERS * BLOCK;
            n -= HASH_POWERS * BLOCK;
        }
    }
    /* What is left: up to 15 whole blocks, summed with their powers, and a last partial one. */
    size_t blocks = (n + BLOCK - 1) / BLOCK;
    if (blocks) {
        Product p = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
        for (size_t i = 0; i < blocks; i++) {
            __m128i x;
            if (n - i * BLOCK >= BLOCK) {
                x = _mm_loadu_si128((const __m128i *)(data + i * BLOCK));
            } else {
                uint8_t last[BLOCK] = {0};
                memcpy(last, data + i * BLOCK, n - i * BLOCK);
                x = _mm_loadu_si128((const __m128i *)last);
            }
            x = _mm_shuffle_epi8(x, rev);
            if (i == 0)
                x = _mm_xor_si128(x, y);
            product_add(&p, x, power(self, (int)(blocks - i)));
        }
        y = reduce(p);
    }
    return y;
}

/* Counter mode ----------------------------------------------------------------------------- */

#define ROUNDS8(op)                                                                 \
    do {                                                                            \
        for (int r_ = 1; r_ < rounds; r_++) {                                       \
            const __m256i k_ = _mm256_broadcastsi128_si256(rk128(self, r_));        \
            _Pragma("GCC unroll 8") for (int b_ = 0; b_ < 8; b_++)                  \
                op[b_] = _mm256_aesenc_epi128(op[b_], k_);                          \
        }                                                                           \
        const __m256i k_ = _mm256_broadcastsi128_si256(rk128(self, rounds));        \
        _Pragma("GCC unroll 8") for (int b_ = 0; b_ < 8; b_++)                      \
            op[b_] = _mm256_aesenclast_epi128(op[b_], k_);                          \
    } while (0)

/* out = in xor the key stream from counter block `counter` (byte-reversed, see the top). */
TARGET static void ctr(const AesGcm *self, __m128i counter, const uint8_t *in, uint8_t *out, size_t n) {
    const int rounds = self->rounds;
    const __m256i rev2 = _mm256_broadcastsi128_si256(byte_reverse_mask());
    const __m256i k0 = _mm256_broadcastsi128_si256(rk128(self, 0));
    /* Two counters per register: lanes hold counter c and c + 1. */
    __m256i pair = _mm256_add_epi32(_mm256_broadcastsi128_si256(counter), _mm256_set_epi32(0, 0, 0, 1, 0, 0, 0, 0));
    const __m256i two = _mm256_set_epi32(0, 0, 0, 2, 0, 0, 0, 2);
    while (n >= 16 * BLOCK) {
        __m256i s[8];
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            s[b] = _mm256_xor_si256(_mm256_shuffle_epi8(pair, rev2), k0);
            pair = _mm256_add_epi32(pair, two);
        }
        ROUNDS8(s);
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(in + 32 * b));
            _mm256_storeu_si256((__m256i *)(out + 32 * b), _mm256_xor_si256(x, s[b]));
        }
        in += 16 * BLOCK;
        out += 16 * BLOCK;
        n -= 16 * BLOCK;
    }
    if (!n)
        return;
    /* Up to 15 blocks and a partial one: one more round of eight registers, used in part. */
    __m256i s[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        s[b] = _mm256_xor_si256(_mm256_shuffle_epi8(pair, rev2), k0);
        pair = _mm256_add_epi32(pair, two);
    }
    ROUNDS8(s);
    uint8_t stream[16 * BLOCK];
    for (int b = 0; b < 8; b++)
        _mm256_storeu_si256((__m256i *)(stream + 32 * b), s[b]);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(in + i));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_xor_si256(x, _mm256_loadu_si256((const __m256i *)(stream + i))));
    }
    for (; i < n; i++)
        out[i] = in[i] ^ stream[i];
    volatile uint8_t *wipe = stream;
    for (i = 0; i < sizeof stream; i++)
        wipe[i] = 0;
}

/* GCM -------------------------------------------------------------------------------------- */

/* J0 byte-reversed: the nonce, then counter 1 in the low lane. */
TARGET static inline __m128i first_counter(const uint8_t *nonce) {
    uint8_t j0[BLOCK];
    memcpy(j0, nonce, NONCE_BYTES);
    j0[12] = 0, j0[13] = 0, j0[14] = 0, j0[15] = 1;
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)j0), byte_reverse_mask());
}

TARGET static void tag(const AesGcm *self, __m128i j0, const uint8_t *ad, size_t ad_n, const uint8_t *ct,
                       size_t ct_n, uint8_t out[TAG_BYTES]) {
    __m128i y = _mm_setzero_si128();
    y = ghash(self, y, ad, ad_n);
    y = ghash(self, y, ct, ct_n);
    /* The lengths block (bit lengths, big-endian), byte-reversed: ciphertext low, data high. */
    const __m128i lengths = _mm_set_epi64x((long long)((uint64_t)ad_n * 8), (long long)((uint64_t)ct_n * 8));
    y = multiply(_mm_xor_si128(y, lengths), power(self, 1));
    __m128i mask = encrypt_block(self, _mm_shuffle_epi8(j0, byte_reverse_mask()));
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(_mm_shuffle_epi8(y, byte_reverse_mask()), mask));
}

TARGET static void seal(const AesGcm *self, const uint8_t *nonce, const uint8_t *ad, size_t ad_n,
                        const uint8_t *in, size_t n, uint8_t *out) {
    __m128i j0 = first_counter(nonce);
    ctr(self, _mm_add_epi32(j0, _mm_set_epi32(0, 0, 0, 1)), in, out, n);
    tag(self, j0, ad, ad_n, out, n, out + n);
}

/* 0 when the tag is right and `out` holds the plaintext; -1 (nothing written) when it is not. */
TARGET static int open_(const AesGcm *self, const uint8_t *nonce, const uint8_t *ad, size_t ad_n,
                        const uint8_t *in, size_t n, uint8_t *out) {
    __m128i j0 = first_counter(nonce);
    uint8_t expected[TAG_BYTES];
    tag(self, j0, ad, ad_n, in, n, expected);
    uint8_t diff = 0;
    for (int i = 0; i < TAG_BYTES; i++)
        diff |= (uint8_t)(expected[i] ^ in[n + i]);
    if (diff)
        return -1;
    ctr(self, _mm_add_epi32(j0, _mm_set_epi32(0, 0, 0, 1)), in, out, n);
    return 0;
}

TARGET static void set_key(AesGcm *self, const uint8_t *key, Py_ssize_t key_n) {
    __m128i rk[15];
    if (key_n == 16) {
        expand_key_128(key, rk);
        self->rounds = 10;
    } else {
        expand_key_256(key, rk);
        self->rounds = 14;
    }
    for (int i = 0; i <= self->rounds; i++)
        _mm_storeu_si128((__m128i *)self->round_keys[i], rk[i]);
    /* h = E_K(0), byte-reversed, times t (mod g*); then its powers, each times t:
     * reduce((A t) (B t)) = (A B / t^127) t, the register of a b, times t. */
    __m128i h = _mm_shuffle_epi8(encrypt_block(self, _mm_setzero_si128()), byte_reverse_mask());
    /* h t: shift the 128-bit value left one bit; a bit leaving the top folds g* back in. */
    __m128i carry = _mm_srli_epi64(h, 63);                       /* each half's top bit */
    __m128i shifted = _mm_or_si128(_mm_slli_epi64(h, 1), _mm_slli_si128(carry, 8));
    __m128i top = _mm_shuffle_epi32(_mm_sub_epi64(_mm_setzero_si128(), _mm_srli_si128(carry, 8)), 0x44);
    const __m128i fold = _mm_set_epi64x((long long)0xC200000000000000ULL, 1);
    __m128i ht = _mm_xor_si128(shifted, _mm_and_si128(top, fold));
    __m128i p = ht;
    _mm_storeu_si128((__m128i *)self->powers[0], ht);
    for (int i = 1; i < HASH_POWERS; i++) {
        p = multiply(p, ht);
        _mm_storeu_si128((__m128i *)self->powers[i], p);
    }
    volatile uint8_t *wipe = (volatile uint8_t *)rk;
    for (size_t i = 0; i < sizeof rk; i++)
        wipe[i] = 0;
}

/* Python type ------------------------------------------------------------------------------ */

/* Asked once, at import (PyInit__aes_gcm_vaes): every key's set-up reads the answer. */
static int cpu_ok;

static int cpu_has_instructions(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul") &&
           __builtin_cpu_supports("vaes") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("sse4.1");
}

static PyObject *AesGcm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"key", NULL};
    Py_buffer key;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*:AesGcm", keywords, &key))
        return NULL;
    if (!cpu_ok) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX2, VAES or VPCLMULQDQ: use cryptography's AESGCM");
        return NULL;
    }
    if (key.len != 16 && key.len != 32) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "AESGCM key must be 128 or 256 bits (16 or 32 bytes)");
        return NULL;
    }
    AesGcm *self = (AesGcm *)type->tp_alloc(type, 0);
    if (self)
        set_key(self, key.buf, key.len);
    PyBuffer_Release(&key);
    return (PyObject *)self;
}

static void AesGcm_dealloc(AesGcm *self) {
    volatile uint8_t *wipe = (volatile uint8_t *)self->round_keys;
    for (size_t i = 0; i < sizeof self->round_keys; i++)
        wipe[i] = 0;
    wipe = (volatile uint8_t *)self->powers;
    for (size_t i = 0; i < sizeof self->powers; i++)
        wipe[i] = 0;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The nonce, data and associated data of every method; `ad` is empty for None. */
typedef struct {
    Py_buffer nonce, data, ad;
} Inputs;

static void release(Inputs *in) {
    PyBuffer_Release(&in->nonce);
    PyBuffer_Release(&in->data);
    if (in->ad.obj)
        PyBuffer_Release(&in->ad);
}

static int parse(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Inputs *in) {
    memset(in, 0, sizeof *in);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    if (PyObject_GetBuffer(args[0], &in->nonce, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(args[1], &in->data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&in->nonce);
        return -1;
    }
    if (args[2] != Py_None && PyObject_GetBuffer(args[2], &in->ad, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&in->nonce);
        PyBuffer_Release(&in->data);
        return -1;
    }
    if (in->nonce.len != NONCE_BYTES) {
        PyErr_SetString(PyExc_ValueError, "Nonce must be 12 bytes (TLS 1.3 and HBONE use 96-bit nonces)");
    } else if (in->data.len > MAX_DATA_BYTES || in->ad.len > MAX_DATA_BYTES) {
        PyErr_SetString(PyExc_OverflowError, "Data or associated data too long: GCM takes at most 2^36 - 32 bytes");
    } else {
        return 0;
    }
    release(in);
    return -1;
}

/* Data to open holds at least a tag: shorter cannot be authentic (InvalidTag, as cryptography). */
static int sealed_inputs(Inputs *in) {
    if (in->data.len >= TAG_BYTES)
        return 0;
    release(in);
    PyErr_SetNone(invalid_tag);
    return -1;
}

static int writable(PyObject *obj, Py_buffer *out, Py_ssize_t want) {
    if (PyObject_GetBuffer(obj, out, PyBUF_WRITABLE) < 0)
        return -1;
    if (out->len != want) {
        PyErr_Format(PyExc_ValueError, "buffer must be %zd bytes", want);
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

static PyObject *AesGcm_encrypt_into(AesGcm *self, PyObject *const *args, Py_ssize_t nargs) {
    Inputs in;
    Py_buffer out;
    if (parse("encrypt_into", args, nargs, 4, &in) < 0)
        return NULL;
    if (writable(args[3], &out, in.data.len + TAG_BYTES) < 0) {
        release(&in);
        return NULL;
    }
    Py_ssize_t n = in.data.len + TAG_BYTES;
    seal(self, in.nonce.buf, in.ad.buf, (size_t)in.ad.len, in.data.buf, (size_t)in.data.len, out.buf);
    PyBuffer_Release(&out);
    release(&in);
    return PyLong_FromSsize_t(n);
}

static PyObject *AesGcm_decrypt_into(AesGcm *self, PyObject *const *args, Py_ssize_t nargs) {
    Inputs in;
    Py_buffer out;
    if (parse("decrypt_into", args, nargs, 4, &in) < 0 || sealed_inputs(&in) < 0)
        return NULL;
    Py_ssize_t n = in.data.len - TAG_BYTES;
    if (writable(args[3], &out, n) < 0) {
        release(&in);
        return NULL;
    }
    int ok = open_(self, in.nonce.buf, in.ad.buf, (size_t)in.ad.len, in.data.buf, (size_t)n, out.buf);
    PyBuffer_Release(&out);
    release(&in);
    if (ok < 0) {
        PyErr_SetNone(invalid_tag);
        return NULL;
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *AesGcm_encrypt(AesGcm *self, PyObject *const *args, Py_ssize_t nargs) {
    Inputs in;
    if (parse("encrypt", args, nargs, 3, &in) < 0)
        return NULL;
    PyObject *result = PyBytes_FromStringAndSize(NULL, in.data.len + TAG_BYTES);
    if (result)
        seal(self, in.nonce.buf, in.ad.buf, (size_t)in.ad.len, in.data.buf, (size_t)in.data.len,
             (uint8_t *)PyBytes_AS_STRING(result));
    release(&in);
    return result;
}

static PyObject *AesGcm_decrypt(AesGcm *self, PyObject *const *args, Py_ssize_t nargs) {
    Inputs in;
    if (parse("decrypt", args, nargs, 3, &in) < 0 || sealed_inputs(&in) < 0)
        return NULL;
    Py_ssize_t n = in.data.len - TAG_BYTES;
    PyObject *result = PyBytes_FromStringAndSize(NULL, n);
    if (result && open_(self, in.nonce.buf, in.ad.buf, (size_t)in.ad.len, in.data.buf, (size_t)n,
                        (uint8_t *)PyBytes_AS_STRING(result)) < 0) {
        Py_CLEAR(result);
        PyErr_SetNone(invalid_tag);
    }
    release(&in);
    return result;
}

static PyMethodDef AesGcm_methods[] = {
    {"encrypt_into", (PyCFunction)(void (*)(void))AesGcm_encrypt_into, METH_FASTCALL,
     "encrypt_into(nonce, data, associated_data, buf) -> int: ciphertext and tag into buf (len(data) + 16 bytes)"},
    {"decrypt_into", (PyCFunction)(void (*)(void))AesGcm_decrypt_into, METH_FASTCALL,
     "decrypt_into(nonce, data, associated_data, buf) -> int: plaintext into buf (len(data) - 16 bytes); "
     "InvalidTag, with buf untouched, when the tag is wrong"},
    {"encrypt", (PyCFunction)(void (*)(void))AesGcm_encrypt, METH_FASTCALL,
     "encrypt(nonce, data, associated_data) -> bytes: ciphertext then tag"},
    {"decrypt", (PyCFunction)(void (*)(void))AesGcm_decrypt, METH_FASTCALL,
     "decrypt(nonce, data, associated_data) -> bytes: the plaintext, or InvalidTag"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AesGcmType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ambient_mesh.proxy._aes_gcm_vaes.AesGcm",
    .tp_basicsize = sizeof(AesGcm),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AesGcm(key): AES-128-GCM or AES-256-GCM with VAES and VPCLMULQDQ (96-bit nonces, 16-byte tags)",
    .tp_new = AesGcm_new,
    .tp_dealloc = (destructor)AesGcm_dealloc,
    .tp_methods = AesGcm_methods,
};

static PyObject *cpu_supported(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(cpu_ok);
}

static PyMethodDef module_methods[] = {
    {"cpu_supported", cpu_supported, METH_NOARGS, "cpu_supported() -> bool: this CPU has AVX2, VAES and VPCLMULQDQ"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_aes_gcm_vaes", "AES-GCM with VAES and VPCLMULQDQ (see the source's top comment).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__aes_gcm_vaes(void) {
    cpu_ok = cpu_has_instructions();
    PyObject *exceptions = PyImport_ImportModule("cryptography.exceptions");
    if (!exceptions)
        return NULL;
    invalid_tag = PyObject_GetAttrString(exceptions, "InvalidTag");
    Py_DECREF(exceptions);
    if (!invalid_tag)
        return NULL;
    if (PyType_Ready(&AesGcmType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    Py_INCREF(&AesGcmType);
    if (PyModule_AddObject(module, "AesGcm", (PyObject *)&AesGcmType) < 0) {
        Py_DECREF(&AesGcmType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
