/* Integer matrix products for decode steps: GGUF blocks times activations quantised to int8
 * (see cache/qdot.py).
 *
 * y[r, j] ~ sum_k x[r, k] * W[j, k], the way llama.cpp's CPU products run a quantised model:
 * each row of x is quantised in blocks of 32 to int8 (d = max |x| / 127, q = round(x / d)), each
 * block's dot product with the weights' integer codes is summed exactly in int32, and the block's
 * scales turn it into float32:
 *
 *   Q4_1 (w = dw * c + mw, c in 0..15):   acc += (float)sum(c * q) * (dw * dx);  acc += mw * sx
 *   Q8_0 (w = dw * c, c in -128..127):    acc += (float)sum(c * q) * (dw * dx)
 *
 * where sx = dx * (float)sum(q), each line's float operations rounded in the order written (no
 * fused multiply-add: built with -ffp-contract=off), blocks in order of k from acc = 0. Integer
 * sums are exact, so the order in which a vector loop adds the codes' products does not matter:
 * every path (AVX-512 VNNI, plain C) gives the same bits, and y[r, j] depends on row r of x and
 * row j of W only, whatever the number of rows in the call, the row's place or the split of the
 * outputs over threads.
 *
 * The weights are packed once (qdot.py, `pack`) in groups of 16 output rows, block by block, so
 * that one 32-bit lane of a vector holds four consecutive codes of one output row:
 *   Q4_1: 256 bytes per group and block, four runs of 64 bytes; byte 4 * j + t of run p holds
 *         c[j, 4p + t] in its low nibble and c[j, 4(p + 4) + t] in its high one;
 *   Q8_0: 512 bytes per group and block, eight runs of 64; byte 4 * j + t of run p holds
 *         c[j, 4p + t] + 128 (so that the codes are unsigned; 128 * sum(q) is taken off again);
 * and the scales as float16, 16 per group and block (dw; for Q4_1 then mw). A last, partial
 * group is padded with zero rows, computed and not stored.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define G 16   /* output rows per group: one float32 lane each */
#define RT 12  /* rows of x per pass over a group's blocks (accumulators kept in registers) */
#define GGML_Q4_1 3
#define GGML_Q8_0 8

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_X86 1
#include <immintrin.h>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,avx2")))
#endif

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
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

/* Bytes of codes and of scales per group and block. */
static int64_t code_bytes(int kind) { return kind == GGML_Q4_1 ? 256 : kind == GGML_Q8_0 ? 512 : 0; }
static int64_t scale_count(int kind) { return kind == GGML_Q4_1 ? 2 * G : G; }

/* Row r of x in blocks of 32: codes q (int8), dx and sx per block. A block holding a value that
 * is not finite gets dx = NaN and zero codes, so that every output of the row is NaN. */
static void quantise_row(const float *x, int64_t k, int8_t *q, float *dx, float *sx, int32_t *qsum) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(v[i]);
            finite &= isfinite(a) != 0;
            amax = a > amax ? a : amax;
        }
        int8_t *c = q + b * QK;
        if (!finite) {
            memset(c, 0, QK);
            dx[b] = NAN;
            sx[b] = NAN;
            qsum[b] = 0;
            continue;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < QK; i++) {
            const float t = nearbyintf(v[i] * id);
            const int32_t n = t > 127.0f ? 127 : t < -127.0f ? -127 : (int32_t)t;
            c[i] = (int8_t)n;
            s += n;
        }
        dx[b] = d;
        sx[b] = d * (float)s;
        qsum[b] = s;
    }
}

/* The plain loop: one output at a time, the codes read from the packed layout. */
static void rows_plain(int kind, const uint8_t *codes, const uint16_t *scales, int64_t n_out,
                       int64_t nb, const int8_t *q, const float *dx, const float *sx,
                       const int32_t *qsum, int64_t n_rows, float *y, int64_t ys) {
    const int64_t cb = code_bytes(kind), sc = scale_count(kind);
    for (int64_t j = 0; j < n_out; j++) {
        const int64_t g = j / G, l = j % G;
        for (int64_t r = 0; r < n_rows; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *c = codes + (g * nb + b) * cb;
                const uint16_t *s = scales + (g * nb + b) * sc;
                const int8_t *qb = q + (r * nb + b) * QK;
                int32_t isum = 0;
                if (kind == GGML_Q4_1) {
                    for (int p = 0; p < 4; p++) {
                        for (int t = 0; t < 4; t++) {
                            const uint8_t byte = c[64 * p + 4 * l + t];
                            isum += (int32_t)(byte & 0x0f) * qb[4 * p + t];
                            isum += (int32_t)(byte >> 4) * qb[4 * (p + 4) + t];
                        }
                    }
                } else {
                    for (int p = 0; p < 8; p++) {
                        for (int t = 0; t < 4; t++) {
                            isum += (int32_t)c[64 * p + 4 * l + t] * qb[4 * p + t];
                        }
                    }
                    isum -= 128 * qsum[r * nb + b];
                }
                const float dw = half_to_float(s[l]);
                const float scale = dw * dx[r * nb + b];
                const float part = (float)isum * scale;
                acc = acc + part;
                if (kind == GGML_Q4_1) {
                    const float shift = half_to_float(s[G + l]) * sx[r * nb + b];
                    acc = acc + shift;
                }
            }
            y[r * ys + j] = acc;
        }
    }
}

#ifdef KAMERA_X86
/* One group (16 outputs) for up to RT rows: each block's codes unpacked once into eight vectors
 * of 16 lanes x 4 codes, then every row's four codes at a time broadcast against them. */
VNNI static inline __attribute__((always_inline)) void group_vnni(
    int kind, const uint8_t *codes, const uint16_t *scales, int64_t nb, const int8_t *q, const float *dx,
    const float *sx, const int32_t *qsum, const int nr, float *y, int64_t ys, int n_store) {
    const int64_t cb = code_bytes(kind), sc = scale_count(kind);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[RT];
    for (int r = 0; r < nr; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = codes + b * cb;
        const uint16_t *s = scales + b * sc;
        __m512i w[8];
        if (kind == GGML_Q4_1) {
            for (int p = 0; p < 4; p++) {
                const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
                w[p] = _mm512_and_si512(v, low);
                w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int p = 0; p < 8; p++) {
                w[p] = _mm512_loadu_si512((const void *)(c + 64 * p));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        const __m512 mw = kind == GGML_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + G)))
                                            : _mm512_setzero_ps();
        for (int r = 0; r < nr; r++) {
            const int32_t *qb = (const int32_t *)(q + (r * nb + b) * QK);
            /* two chains of integer sums (exact: their order does not matter), to overlap */
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            for (int p = 0; p < 8; p += 2) {
                even = _mm512_dpbusd_epi32(even, w[p], _mm512_set1_epi32(qb[p]));
                odd = _mm512_dpbusd_epi32(odd, w[p + 1], _mm512_set1_epi32(qb[p + 1]));
            }
            __m512i isum = _mm512_add_epi32(even, odd);
            if (kind == GGML_Q8_0) {
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * qsum[r * nb + b]));
            }
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale));
            if (kind == GGML_Q4_1) {
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(sx[r * nb + b])));
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << n_store) - 1u);
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(y + r * ys, keep, acc[r]);
    }
}

/* group_vnni compiled for each count of rows, so that the accumulators stay in registers */
#define ROWS_CASE(n)                                                                   \
    case n:                                                                            \
        group_vnni(kind, codes, scales, nb, q, dx, sx, qsum, n, y, ys, n_store);       \
        break;
VNNI static void group_rows(int kind, const uint8_t *codes, const uint16_t *scales, int64_t nb,
                            const int8_t *q, const float *dx, const float *sx, const int32_t *qsum,
                            int nr, float *y, int64_t ys, int n_store) {
    switch (nr) {
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
        ROWS_CASE(4)
        ROWS_CASE(5)
        ROWS_CASE(6)
        ROWS_CASE(7)
        ROWS_CASE(8)
        ROWS_CASE(9)
        ROWS_CASE(10)
        ROWS_CASE(11)
        ROWS_CASE(12)
    default:
        break;
    }
}
#undef ROWS_CASE

VNNI static void rows_vnni(int kind, const uint8_t *codes, const uint16_t *scales, int64_t n_out,
                           int64_t nb, const int8_t *q, const float *dx, const float *sx,
                           const int32_t *qsum, int64_t n_rows, float *y, int64_t ys) {
    const int64_t cb = code_bytes(kind), sc = scale_count(kind);
    for (int64_t g = 0; g * G < n_out; g++) {
        const int n_store = n_out - g * G < G ? (int)(n_out - g * G) : G;
        for (int64_t r0 = 0; r0 < n_rows; r0 += RT) {
            const int nr = n_rows - r0 < RT ? (int)(n_rows - r0) : RT;
            group_rows(kind, codes + g * nb * cb, scales + g * nb * sc, nb, q + r0 * nb * QK,
                       dx + r0 * nb, sx + r0 * nb, qsum + r0 * nb, nr, y + r0 * ys + g * G, ys, n_store);
        }
    }
}
#endif

int kamera_qdot_vectorised(void) {
#ifdef KAMERA_X86
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* Rows of x quantised once: codes [n_rows, k] and per block dx, sx, sum of codes. */
int kamera_qdot_quantise(const float *x, int64_t x_stride, int64_t n_rows, int64_t k, int8_t *q,
                         float *dx, float *sx, int32_t *qsum) {
    if (k <= 0 || k % QK || n_rows < 0) {
        return -1;
    }
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < n_rows; r++) {
        quantise_row(x + r * x_stride, k, q + r * k, dx + r * nb, sx + r * nb, qsum + r * nb);
    }
    return 0;
}

/* y[r, j0 + j] for j < n_out over groups starting at output j0 (a multiple of 16): codes and
 * scales point at group j0 / 16; x's rows quantised as by kamera_qdot_quantise. Returns 0, or -1
 * for an unknown block type or sizes, -2 when out of memory. */
int kamera_qdot_f32(const uint8_t *codes, const uint16_t *scales, int kind, int64_t n_out, int64_t k,
                    const float *x, int64_t x_stride, int64_t n_rows, float *y, int64_t y_stride,
                    int limit) {
    if (code_bytes(kind) == 0 || k <= 0 || k % QK || n_out < 0 || n_rows < 0) {
        return -1;
    }
    const int64_t nb = k / QK;
    /* codes, then dx, sx and the sums of codes per block (4-byte aligned after the codes) */
    char *buf = malloc((size_t)(n_rows * k + 3 * n_rows * nb * 4 + 4));
    if (buf == NULL) {
        return -2;
    }
    int8_t *q = (int8_t *)buf;
    float *dx = (float *)(buf + n_rows * k), *sx = dx + n_rows * nb;
    int32_t *qsum = (int32_t *)(sx + n_rows * nb);
    kamera_qdot_quantise(x, x_stride, n_rows, k, q, dx, sx, qsum);
#ifdef KAMERA_X86
    if (limit < 2 && kamera_qdot_vectorised()) {
        rows_vnni(kind, codes, scales, n_out, nb, q, dx, sx, qsum, n_rows, y, y_stride);
        free(buf);
        return 0;
    }
#else
    (void)limit;
#endif
    rows_plain(kind, codes, scales, n_out, nb, q, dx, sx, qsum, n_rows, y, y_stride);
    free(buf);
    return 0;
}
