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
 * block used by up to FEW rows of x at once), else TILE rows of W at a time into a buffer that
 * every row of x then runs over.
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
#define TILE 4 /* rows of W dequantised together for many rows of x */
#define FEW 4  /* up to this many rows of x dequantise each block in registers */
#define MANY 12 /* from this many rows of x on, the buffered loop */
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

T256 INLINE float hsum_avx2(__m256 a, __m256 b) {
    const __m256 s = _mm256_add_ps(a, b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* The order of the sums, which every loop below keeps for each (row of x, row of W): two
 * accumulators, the first fed the weights 0..15 of every block (AVX-512; 0..7 and 16..23 with
 * AVX2), the second the rest, each in order of k; added and summed across lanes at the end. Two
 * loops: few rows of x dequantise each block in registers and use it at once; many rows dequantise
 * TILE rows of W into a buffer once and run register-blocked over it. A row's numbers are the same
 * whichever loop a call takes. */

/* Few rows: y[r] = x[r] . W[j] for nr rows of x and one row of W. */
T512 INLINE void rows_avx512(int kind, int nr, const uint8_t *row, int64_t nb, int64_t bb, const float *x,
                             int64_t xs, float *y, int64_t ys) {
    __m512 a[FEW][2];
    for (int r = 0; r < nr; r++) {
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 w[2];
        block_avx512(kind, row + b * bb, w);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * xs + b * QK;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w[0], a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w[1], a[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        y[r * ys] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
    }
}

T256 INLINE void rows_avx2(int kind, int nr, const uint8_t *row, int64_t nb, int64_t bb, const float *x,
                           int64_t xs, float *y, int64_t ys) {
    __m256 a[FEW][2];
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

/* Many rows: out[r * TILE + j] = x[r] . t[j] for nr rows of x and the TILE dequantised rows t. */
T512 INLINE void tile_rows_avx512(int nr, const float *t, int64_t k, const float *x, int64_t xs, float *out) {
    __m512 a[2][TILE][2];
    for (int r = 0; r < nr; r++) {
        for (int j = 0; j < TILE; j++) {
            a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t c = 0; c < k; c += QK) {
        for (int h = 0; h < 2; h++) {
            __m512 w[TILE];
            for (int j = 0; j < TILE; j++) {
                w[j] = _mm512_loadu_ps(t + j * k + c + 16 * h);
            }
            for (int r = 0; r < nr; r++) {
                const __m512 xv = _mm512_loadu_ps(x + r * xs + c + 16 * h);
                for (int j = 0; j < TILE; j++) {
                    a[r][j][h] = _mm512_fmadd_ps(xv, w[j], a[r][j][h]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int j = 0; j < TILE; j++) {
            out[r * TILE + j] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][j][0], a[r][j][1]));
        }
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

/* Few rows of x: every row of W in turn against the rows of x in groups of FEW, each (type,
 * group size) its own inlined copy so the accumulators live in registers. */
#define FEW_ROWS(name, target, rows)                                                                 \
    target static void name(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x,    \
                            int64_t xs, int64_t n_rows, float *y, int64_t ys) {                      \
        const int64_t nb = k / QK, bb = block_bytes(kind);                                           \
        for (int64_t j = 0; j < n_out; j++) {                                                        \
            const uint8_t *row = w + j * nb * bb;                                                    \
            for (int64_t r = 0; r < n_rows; r += FEW) {                                              \
                const int64_t nr = n_rows - r < FEW ? n_rows - r : FEW;                              \
                const float *xr = x + r * xs;                                                        \
                float *yr = y + r * ys + j;                                                          \
                if (kind == GGML_Q4_1) {                                                             \
                    switch (nr) {                                                                    \
                    case 4: rows(GGML_Q4_1, 4, row, nb, bb, xr, xs, yr, ys); break;                  \
                    case 3: rows(GGML_Q4_1, 3, row, nb, bb, xr, xs, yr, ys); break;                  \
                    case 2: rows(GGML_Q4_1, 2, row, nb, bb, xr, xs, yr, ys); break;                  \
                    default: rows(GGML_Q4_1, 1, row, nb, bb, xr, xs, yr, ys); break;                 \
                    }                                                                                \
                } else {                                                                             \
                    switch (nr) {                                                                    \
                    case 4: rows(GGML_Q8_0, 4, row, nb, bb, xr, xs, yr, ys); break;                  \
                    case 3: rows(GGML_Q8_0, 3, row, nb, bb, xr, xs, yr, ys); break;                  \
                    case 2: rows(GGML_Q8_0, 2, row, nb, bb, xr, xs, yr, ys); break;                  \
                    default: rows(GGML_Q8_0, 1, row, nb, bb, xr, xs, yr, ys); break;                 \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

FEW_ROWS(few_avx512, T512, rows_avx512)
FEW_ROWS(few_avx2, T256, rows_avx2)

/* Many rows of x: TILE rows of W dequantised into t, then every row of x against them. */
T512 static void many_avx512(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t xs,
                             int64_t n_rows, float *y, int64_t ys, float *t) {
    const int64_t nb = k / QK, bb = block_bytes(kind);
    float out[2 * TILE];
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
        for (int64_t r = 0; r < n_rows; r += 2) {
            const int nr = n_rows - r < 2 ? 1 : 2;
            if (nr == 2) {
                tile_rows_avx512(2, t, k, x + r * xs, xs, out);
            } else {
                tile_rows_avx512(1, t, k, x + r * xs, xs, out);
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
