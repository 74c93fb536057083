/* Matrix products with weights in GGUF blocks, float32 activations (see cache/qmatmul.py).
 *
 * y[r, j] = sum_k x[r, k] * W[j, k] for r < n_rows and j < n_out, where W[j, :] is stored as
 * k / 32 blocks of one GGUF type:
 *   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles; weight i of the block is
 *                    d * q_i + m, q_i the low nibble of byte i (i < 16) or the high nibble of
 *                    byte i - 16;
 *   Q8_0 (34 bytes): float16 d, 32 int8 q_i; weight i is d * q_i.
 * Weights are dequantised four rows of W at a time into float32 exactly as gguf-py does (d * q
 * is exact in float32, so one rounding of d * q + m), then every row of x is multiplied with
 * them.
 *
 * Row independence: y[r, j] is computed by the same operations in the same order whatever
 * n_rows, r, n_out or the group of rows of W that j was dequantised with: a dot product over k
 * with two accumulators taking alternate runs of lanes, added and summed across lanes in a
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
#define GROUP 4 /* rows of x sharing each dequantised block */

T256 INLINE __m128 half_pair(const uint8_t *b) { /* (d, m) or (d, next) as float32 */
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
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
    }
}

/* y[r] = x[r] . W[j] for nr rows of x and one row of W: per row two accumulators, one for
 * weights 0..15 and one for 16..31 of every block, added and summed across lanes at the end.
 * The same operations for a row whatever nr (each block's weights are the same values). */
T512 INLINE void rows_avx512(int kind, int nr, const uint8_t *row, int64_t nb, int64_t bb,
                             const float *x, int64_t xs, float *y, int64_t ys) {
    __m512 a[GROUP][2];
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

/* Two accumulators per row: weights 0..7 and 16..23 into the first, 8..15 and 24..31 into the
 * second, then added and summed across lanes in a fixed order. */
T256 INLINE void rows_avx2(int kind, int nr, const uint8_t *row, int64_t nb, int64_t bb,
                           const float *x, int64_t xs, float *y, int64_t ys) {
    __m256 a[GROUP][2];
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
        const __m256 s = _mm256_add_ps(a[r][0], a[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        y[r * ys] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}

/* Every row of W against the rows of x in groups of GROUP, each (type, group size) pair its own
 * inlined copy so the accumulators live in registers. */
#define PRODUCT(name, target, rows)                                                          \
    target static void name(int kind, const uint8_t *w, int64_t n_out, int64_t k, const float *x, \
                            int64_t xs, int64_t n_rows, float *y, int64_t ys) {              \
        const int64_t nb = k / QK, bb = block_bytes(kind);                                   \
        for (int64_t j = 0; j < n_out; j++) {                                                \
            const uint8_t *row = w + j * nb * bb;                                            \
            for (int64_t r = 0; r < n_rows; r += GROUP) {                                    \
                const int nr = n_rows - r < GROUP ? (int)(n_rows - r) : GROUP;               \
                const float *xr = x + r * xs;                                                \
                float *yr = y + r * ys + j;                                                  \
                if (kind == GGML_Q4_1) {                                                     \
                    switch (nr) {                                                            \
                    case 4: rows(GGML_Q4_1, 4, row, nb, bb, xr, xs, yr, ys); break;          \
                    case 3: rows(GGML_Q4_1, 3, row, nb, bb, xr, xs, yr, ys); break;          \
                    case 2: rows(GGML_Q4_1, 2, row, nb, bb, xr, xs, yr, ys); break;          \
                    default: rows(GGML_Q4_1, 1, row, nb, bb, xr, xs, yr, ys); break;         \
                    }                                                                        \
                } else {                                                                     \
                    switch (nr) {                                                            \
                    case 4: rows(GGML_Q8_0, 4, row, nb, bb, xr, xs, yr, ys); break;          \
                    case 3: rows(GGML_Q8_0, 3, row, nb, bb, xr, xs, yr, ys); break;          \
                    case 2: rows(GGML_Q8_0, 2, row, nb, bb, xr, xs, yr, ys); break;          \
                    default: rows(GGML_Q8_0, 1, row, nb, bb, xr, xs, yr, ys); break;         \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

PRODUCT(product_avx512, T512, rows_avx512)
PRODUCT(product_avx2, T256, rows_avx2)
#endif

/* Returns 0, or -1 for an unknown block type or sizes, -2 when out of memory. */
int kamera_qmatmul_f32(const uint8_t *w, int kind, int64_t n_out, int64_t k, const float *x,
                       int64_t x_stride, int64_t n_rows, float *y, int64_t y_stride, int limit) {
    const int64_t bb = block_bytes(kind), row_bytes = bb * (k / QK);
    if (bb == 0 || k <= 0 || k % QK || n_out < 0 || n_rows < 0) {
        return -1;
    }
#ifdef KAMERA_X86
    const int avx2 = limit < 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    if (avx2 && limit < 1 && __builtin_cpu_supports("avx512f")) {
        product_avx512(kind, w, n_out, k, x, x_stride, n_rows, y, y_stride);
        return 0;
    }
    if (avx2) {
        product_avx2(kind, w, n_out, k, x, x_stride, n_rows, y, y_stride);
        return 0;
    }
#else
    (void)limit;
#endif
    float *t = malloc((size_t)k * sizeof(float));
    if (t == NULL) {
        return -2;
    }
    for (int64_t j = 0; j < n_out; j++) {
        for (int64_t b = 0; b < k / QK; b++) {
            dequant_block_plain(kind, w + j * row_bytes + b * bb, t + b * QK);
        }
        for (int64_t r = 0; r < n_rows; r++) {
            y[r * y_stride + j] = dot_plain(x + r * x_stride, t, k);
        }
    }
    free(t);
    return 0;
}
