/* Matrix products with weights in GGUF blocks, float32 activations (see cache/qmatmul.py).
 *
 * y[r, j] = sum_k x[r, k] * W[j, k] for r < n_rows and j < n_out, where W[j, :] is stored as
 * k / 32 blocks of one GGUF type:
 *   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles; weight i of the block is
 *                    d * q_i + m, q_i the low nibble of byte i (i < 16) or the high nibble of
 *                    byte i - 16;
 *   Q8_0 (34 bytes): float16 d, 32 int8 q_i; weight i is d * q_i.
 * Weights are dequantised to float32 exactly as gguf-py does (d * q is exact in float32, so one
 * rounding of d * q + m): block by block in registers when x has fewer than MANY rows (each
 * block used by up to FEW rows of x at once, and each loaded run of x by two rows of W where k is
 * long), else TILE rows of W at a time into a buffer that the rows of x then run over, MR rows
 * and one of the two accumulators at a time.
 *
 * Row independence: y[r, j] is computed by the same operations in the same order whatever
 * n_rows, r, n_out, the loop taken or the rows of W that j was dequantised with: a dot product
 * over k with two accumulators taking alternate runs of lanes, added and summed across lanes in a
 * fixed order. A row's result is therefore bit for bit the same alone or in any batch (tested in
 * tests/test_qlinear.py).
 *
 * limit caps the vector loops (0: the best the CPU has, 1: none with AVX-512, 2: the plain loop
 * only), so that every path can be checked on one machine. The plain loop keeps eight lanes in
 * an array, which compilers vectorise without reordering any sum (built with
 * -ffp-contract=off, so no multiply-add is fused behind our back).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MANY 12    /* from this many rows of x on, the buffered loop */
#define TILE 4     /* rows of W dequantised together into the buffer */
#define MR 4       /* rows of x run together over the buffer (AVX-512) */
#define FEW 8      /* rows of x that use each block dequantised in registers at once (AVX-512) */
#define FEW_AVX2 4 /* the same with AVX2's sixteen registers */
#define X_BYTES (24 * 1024) /* the most bytes of x that each block is read against (the L1 cache) */
#define PF 2048    /* blocks are prefetched this many bytes ahead (AVX-512 few rows) */
#define GGML_Q4_1 3
#define GGML_Q8_0 8

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_X86 1
#include <immintrin.h>
#endif

static float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        uint32_t e = 113, m = man;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int64_t block_bytes(int kind) { return kind == GGML_Q4_1 ? 20 : kind == GGML_Q8_0 ? 34 : 0; }

/* One block's 32 weights into t, exactly as gguf-py's dequantize_blocks. */
static void dequant_block_plain(int kind, const uint8_t *b, float *t) {
    const float d = half_to_float(b);
    if (kind == GGML_Q4_1) {
        const float m = half_to_float(b + 2);
        for (int i = 0; i < 16; i++) {
            t[i] = d * (float)(b[4 + i] & 0x0f) + m;
            t[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
    } else {
        for (int i = 0; i < QK; i++) {
            t[i] = d * (float)(int8_t)b[2 + i];
        }
    }
}

static float dot_plain(const float *x, const float *w, int64_t k) {
    float acc[8] = {0};
    for (int64_t c = 0; c < k; c += 8) {
        for (int l = 0; l < 8; l++) {
            acc[l] += x[c + l] * w[c + l];
        }
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#ifdef KAMERA_X86
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")
#define T512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define T256 __attribute__((target("avx2,fma,f16c")))

T256 INLINE __m128 half_pair(const uint8_t *b) { /* the block's first two float16 as float32 */
    int32_t v;
    memcpy(&v, b, sizeof v);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

/* One block's weights 0..15 and 16..31 in w[0], w[1]: d * q + m in one rounding (d * q is exact),
 * so the same float32 values as gguf-py's dequantisation and the plain loop. */
T512 INLINE void block_avx512(int kind, const uint8_t *b, __m512 *w) {
    const __m128 dm = half_pair(b);
    const __m512 d = _mm512_broadcastss_ps(dm);
    if (kind == GGML_Q4_1) {
        const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
        w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), m);
        w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
    } else {
        for (int p = 0; p < 2; p++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * p));
            w[p] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        }
    }
}

/* The same with 8 lanes: w[0..3] hold weights 0..7, 8..15, 16..23, 24..31. */
T256 INLINE void block_avx2(int kind, const uint8_t *b, __m256 *w) {
    const __m128 dm = half_pair(b);
    const __m256 d = _mm256_broadcastss_ps(dm);
    if (kind == GGML_Q4_1) {
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
        const __m256i v0 = _mm256_cvtepu8_epi32(q), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
        const __m256i low = _mm256_set1_epi32(15);
        w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), m);
        w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), m);
        w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), m);
        w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), m);
    } else {
        for (int p = 0; p < 4; p++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * p));
            w[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
    }
}

/* a + b summed across lanes in the tree of the order below (the one GCC's _mm512_reduce_add_ps
 * takes, written out so that no compiler's header can change it). */
T512 INLINE float hsum_avx512(__m512 a, __m512 b) {
    const __m512 s = _mm512_add_ps(a, b);
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    const __m256 h8 = _mm256_add_ps(high, _mm512_castps512_ps256(s));
    const __m128 h4 = _mm_add_ps(_mm256_extractf128_ps(h8, 1), _mm256_castps256_ps128(h8));
    const __m128 h2 = _mm_add_ps(h4, _mm_shuffle_ps(h4, h4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

T256 INLINE float hsum_avx2(__m256 a, __m256 b) {
    const __m256 s = _mm256_add_ps(a, b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* The order of the sums, which every loop below keeps for each (row of x, row of W); pinned against
 * a reference in tests/test_qmatmul_order.py. Two accumulators, each lane a chain of fused
 * multiply-adds (one rounding each) in order of k: with AVX-512 the first takes weights 0..15 of
 * every block, the second 16..31; with AVX2 the first takes 0..7 then 16..23, the second 8..15
 * then 24..31. At the end the two are added lane by lane and the lanes summed in a tree: lane l
 * plus lane l + 8 (AVX-512), then l + 4, l + 2, l + 1. Two loops: few rows of x dequantise each
 * block in registers and use it at once; many rows dequantise TILE rows of W into a buffer once
 * and run register-blocked over it. A row's numbers are the same whichever loop a call takes. */

/* Few rows: y[r * ys + j] = x[r] . W[j] for nr rows of x and nj consecutive rows of W (row bytes
 * rb): each block of the nj rows is dequantised once and serves the nr rows, and each loaded run
 * of x serves the nj rows of W. */
T512 INLINE void rows_avx512(int kind, int nr, int nj, const uint8_t *row, int64_t rb, int64_t nb, int64_t bb,
                             const float *x, int64_t xs, float *y, int64_t ys) {
    __m512 a[FEW][2][2];
    UNROLL for (int r = 0; r < nr; r++) {
        UNROLL for (int j = 0; j < nj; j++) {
            a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 w[2][2];
        UNROLL for (int j = 0; j < nj; j++) {
            _mm_prefetch((const char *)(row + j * rb + b * bb + PF), _MM_HINT_T0);
            block_avx512(kind, row + j * rb + b * bb, w[j]);
        }
        UNROLL for (int r = 0; r < nr; r++) {
            const float *xr = x + r * xs + b * QK;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            UNROLL for (int j = 0; j < nj; j++) {
                a[r][j][0] = _mm512_fmadd_ps(x0, w[j][0], a[r][j][0]);
                a[r][j][1] = _mm512_fmadd_ps(x1, w[j][1], a[r][j][1]);
            }
        }
    }
    UNROLL for (int r = 0; r < nr; r++) {
        UNROLL for (int j = 0; j < nj; j++) {
            y[r * ys + j] = hsum_avx512(a[r][j][0], a[r][j][1]);
        }
    }
}

T256 INLINE void rows_avx2(int kind, int nr, const uint8_t *row, int64_t nb, int64_t bb, const float *x,
                           int64_t xs, float *y, int64_t ys) {
    __m256 a[FEW_AVX2][2];
    for (int r = 0; r < nr; r++) {
        a[r][0] = a[r][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        block_avx2(kind, row + b * bb, w);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * xs + b * QK;
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], a[r][0]);
            a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], a[r][1]);
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], a[r][0]);
            a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], a[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        y[r * ys] = hsum_avx2(a[r][0], a[r][1]);
    }
}

/* Many rows, one of the two accumulators at a time: p[r * TILE + j] = the accumulator of half h
 * (weights 16 h .. 16 h + 15 of every block) of x[r] . t[j], for nr rows of x and the TILE
 * dequantised rows t. The accumulators of the two halves never meet before the final sum, so
 * running them one after the other keeps every sum's order and halves the registers they need. */
T512 INLINE void tile_half_avx512(int nr, int h, const float *t, int64_t k, const float *x, int64_t xs,
                                  __m512 *p) {
    __m512 a[MR][TILE];
    UNROLL for (int r = 0; r < nr; r++) {
        UNROLL for (int j = 0; j < TILE; j++) {
            a[r][j] = _mm512_setzero_ps();
        }
    }
    for (int64_t c = 16 * h; c < k; c += QK) {
        __m512 w[TILE];
        UNROLL for (int j = 0; j < TILE; j++) {
            w[j] = _mm512_loadu_ps(t + j * k + c);
        }
        UNROLL for (int r = 0; r < nr; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * xs + c);
            UNROLL for (int j = 0; j < TILE; j++) {
                a[r][j] = _mm512_fmadd_ps(xv, w[j], a[r][j]);
            }
        }
    }
    UNROLL for (int r = 0; r < nr; r++) {
        UNROLL for (int j = 0; j < TILE; j++) {
            p[r * TILE + j] = a[r][j];
        }
    }
}

/* out[r * TILE + j] = x[r] . t[j] for nr rows of x: both halves, then their sum. */
T512 INLINE void tile_rows_avx512(int nr, const float *t, int64_t k, const float *x, int64_t xs, float *out) {
    __m512 p[2][MR * TILE];
    tile_half_avx512(nr, 0, t, k, x, xs, p[0]);
    tile_half_avx512(nr, 1, t, k, x, xs, p[1]);
    for (int i = 0; i < nr * TILE; i++) {
        out[i] = hsum_avx512(p[0][i], p[1][i]);
    }
}

T256 INLINE void tile_rows_avx2(const float *t, int64_t k, const float *x, float *out) {
    __m256 a[TILE][2];
    for (int j = 0; j < TILE; j++) {
        a[j][0] = a[j][1] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < k; c += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
        for (int j = 0; j < TILE; j++) {
            a[j][0] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(t + j * k + c), a[j][0]);
            a[j][1] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(t + j * k + c + 8), a[j][1]);
        }
    }
    for (int j = 0; j < TILE; j++) {
        out[j] = hsum_avx2(a[j][0], a[j][1]);
    }
}

/* Few rows of x, AVX-512: the rows of x in groups of FEW against one row of W at a time, or, where
 * FEW rows of x would not stay in the L1 cache (X_BYTES) beside the blocks, in groups of FEW / 2
 * against two rows of W at a time (each loaded run of x serves both). Each (type, group shape) is
 * its own inlined copy so that the accumulators live in registers. */
#define ROWS512(K, NR, NJ) rows_avx512(K, NR, NJ, row, rb, nb, bb, xr, xs, yr, ys)
#define SWITCH_ROWS512(K)                                                                            \
    if (nj == 2) {                                                                                   \
        switch (nr) {                                                                                \
        case 4: ROWS512(K, 4, 2); break;                                                             \
        case 3: ROWS512(K, 3, 2); break;                                                             \
        case 2: ROWS512(K, 2, 2); break;                                                             \
        default: ROWS512(K, 1, 2); break;                                                            \
        }                                                                                            \
    } else {                                                                                         \
        switch (nr) {                                                                                \
        case 8: ROWS512(K, 8, 1); break;                                                             \
        case 7: ROWS512(K, 7, 1); break;                                                             \
        case 6: ROWS512(K, 6, 1); break;                                                             \
        case 5: ROWS512(K, 5, 1); break;                                                             \
        case 4: ROWS512(K, 4, 1); break;                                                             \
        case 3: ROWS512(K, 3, 1); break;                                                             \
        case 2: ROWS512(K, 2, 1); break;                                                             \
        default: ROWS512(K, 1, 1); break;                                                            \
        }                                                                                            \
    }

T512 static void few_avx512(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t xs,
                            int64_t n_rows, float *y, int64_t ys) {
    const int64_t nb = k / QK, bb = block_bytes(kind), rb = nb * bb;
    const int pairs = n_rows > 1 && FEW * k * (int64_t)sizeof(float) > X_BYTES;
    const int64_t group = pairs ? FEW / 2 : FEW;
    for (int64_t j = 0; j < n_out;) {
        const int nj = pairs && n_out - j >= 2 ? 2 : 1;
        const uint8_t *row = w + j * rb;
        for (int64_t r = 0; r < n_rows; r += group) {
            const int nr = n_rows - r < group ? (int)(n_rows - r) : (int)group;
            const float *xr = x + r * xs;
            float *yr = y + r * ys + j;
            if (kind == GGML_Q4_1) {
                SWITCH_ROWS512(GGML_Q4_1)
            } else {
                SWITCH_ROWS512(GGML_Q8_0)
            }
        }
        j += nj;
    }
}

/* Few rows of x, AVX2: every row of W in turn against the rows of x in groups of FEW_AVX2. */
T256 static void few_avx2(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t xs,
                          int64_t n_rows, float *y, int64_t ys) {
    const int64_t nb = k / QK, bb = block_bytes(kind);
    for (int64_t j = 0; j < n_out; j++) {
        const uint8_t *row = w + j * nb * bb;
        for (int64_t r = 0; r < n_rows; r += FEW_AVX2) {
            const int64_t nr = n_rows - r < FEW_AVX2 ? n_rows - r : FEW_AVX2;
            const float *xr = x + r * xs;
            float *yr = y + r * ys + j;
            if (kind == GGML_Q4_1) {
                switch (nr) {
                case 4: rows_avx2(GGML_Q4_1, 4, row, nb, bb, xr, xs, yr, ys); break;
                case 3: rows_avx2(GGML_Q4_1, 3, row, nb, bb, xr, xs, yr, ys); break;
                case 2: rows_avx2(GGML_Q4_1, 2, row, nb, bb, xr, xs, yr, ys); break;
                default: rows_avx2(GGML_Q4_1, 1, row, nb, bb, xr, xs, yr, ys); break;
                }
            } else {
                switch (nr) {
                case 4: rows_avx2(GGML_Q8_0, 4, row, nb, bb, xr, xs, yr, ys); break;
                case 3: rows_avx2(GGML_Q8_0, 3, row, nb, bb, xr, xs, yr, ys); break;
                case 2: rows_avx2(GGML_Q8_0, 2, row, nb, bb, xr, xs, yr, ys); break;
                default: rows_avx2(GGML_Q8_0, 1, row, nb, bb, xr, xs, yr, ys); break;
                }
            }
        }
    }
}

/* Many rows of x: TILE rows of W dequantised into t, then the rows of x against them, MR at a time. */
T512 static void many_avx512(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t xs,
                             int64_t n_rows, float *y, int64_t ys, float *t) {
    const int64_t nb = k / QK, bb = block_bytes(kind);
    float out[MR * TILE];
    for (int64_t j0 = 0; j0 < n_out; j0 += TILE) {
        const int nj = n_out - j0 < TILE ? (int)(n_out - j0) : TILE;
        for (int j = 0; j < nj; j++) {
            for (int64_t b = 0; b < nb; b++) {
                __m512 v[2];
                block_avx512(kind, w + ((j0 + j) * nb + b) * bb, v);
                _mm512_storeu_ps(t + j * k + b * QK, v[0]);
                _mm512_storeu_ps(t + j * k + b * QK + 16, v[1]);
            }
        }
        for (int64_t r = 0; r < n_rows; r += MR) {
            const int nr = n_rows - r < MR ? (int)(n_rows - r) : MR;
            const float *xr = x + r * xs;
            switch (nr) {
            case MR: tile_rows_avx512(MR, t, k, xr, xs, out); break;
            case 3: tile_rows_avx512(3, t, k, xr, xs, out); break;
            case 2: tile_rows_avx512(2, t, k, xr, xs, out); break;
            default: tile_rows_avx512(1, t, k, xr, xs, out); break;
            }
            for (int i = 0; i < nr; i++) {
                memcpy(y + (r + i) * ys + j0, out + i * TILE, (size_t)nj * sizeof(float));
            }
        }
    }
}

T256 static void many_avx2(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t xs,
                           int64_t n_rows, float *y, int64_t ys, float *t) {
    const int64_t nb = k / QK, bb = block_bytes(kind);
    float out[TILE];
    for (int64_t j0 = 0; j0 < n_out; j0 += TILE) {
        const int nj = n_out - j0 < TILE ? (int)(n_out - j0) : TILE;
        for (int j = 0; j < nj; j++) {
            for (int64_t b = 0; b < nb; b++) {
                __m256 v[4];
                block_avx2(kind, w + ((j0 + j) * nb + b) * bb, v);
                for (int p = 0; p < 4; p++) {
                    _mm256_storeu_ps(t + j * k + b * QK + 8 * p, v[p]);
                }
            }
        }
        for (int64_t r = 0; r < n_rows; r++) {
            tile_rows_avx2(t, k, x + r * xs, out);
            memcpy(y + r * ys + j0, out, (size_t)nj * sizeof(float));
        }
    }
}
#endif

/* Returns 0, or -1 for an unknown block type or sizes, -2 when out of memory. */
int kamera_qmatmul_f32(const uint8_t *w, int kind, int64_t n_out, int64_t k, const float *x,
                       int64_t x_stride, int64_t n_rows, float *y, int64_t y_stride, int limit) {
    const int64_t bb = block_bytes(kind), nb = k / QK, row_bytes = bb * nb;
    if (bb == 0 || k <= 0 || k % QK || n_out < 0 || n_rows < 0) {
        return -1;
    }
    float *t = aligned_alloc(64, (size_t)(TILE * k) * sizeof(float));
    if (t == NULL) {
        return -2;
    }
    memset(t, 0, (size_t)(TILE * k) * sizeof(float)); /* rows of a last, partial tile: computed, then dropped */
#ifdef KAMERA_X86
    const int avx2 = limit < 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && limit < 1 && __builtin_cpu_supports("avx512f");
    if (avx2 && n_rows < MANY) {
        (avx512 ? few_avx512 : few_avx2)(kind, w, n_out, k, x, x_stride, n_rows, y, y_stride);
    } else if (avx512) {
        many_avx512(kind, w, n_out, k, x, x_stride, n_rows, y, y_stride, t);
    } else if (avx2) {
        many_avx2(kind, w, n_out, k, x, x_stride, n_rows, y, y_stride, t);
    }
    if (avx2) {
        free(t);
        return 0;
    }
#else
    (void)limit;
#endif
    for (int64_t j = 0; j < n_out; j++) {
        for (int64_t b = 0; b < nb; b++) {
            dequant_block_plain(kind, w + j * row_bytes + b * bb, t + b * QK);
        }
        for (int64_t r = 0; r < n_rows; r++) {
            y[r * y_stride + j] = dot_plain(x + r * x_stride, t, k);
        }
    }
    free(t);
    return 0;
}
