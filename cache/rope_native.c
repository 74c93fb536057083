/* RoPE rotation in one read-rotate-write pass over float32 keys (see cache/native.py).
 *
 * out[i0, i1, t, :] = R(cos[t], sin[t]) x[i0, i1, t, :] for every pair (a, b) of the first
 * rd features: (a, b) -> (a cos - b sin, b cos + a sin), the same direction as cache/rope.py's
 * rotate; features rd..D are copied. Pairs are (f, f + rd/2) for "half" pairing and
 * (2f, 2f + 1) for "interleaved". Strides are in elements; the feature stride is 1 for x and
 * out. cos and sin hold rd/2 values per token, token stride ts (0: one row for every token).
 * x and out must not overlap.
 *
 * Compiled once per machine with function multiversioning on x86-64, so one shared object runs
 * the AVX-512, AVX2 or baseline loop that the CPU it is loaded on supports.
 *
 * Rotating the whole feature dim runs explicit vector loops on x86-64: "half" pairing (Llama,
 * Qwen, Mistral...) with AVX-512 (rd/2 a multiple of 16) or AVX2 (of 8), "interleaved" pairing
 * (DeepSeek) with AVX-512 (rd/2 a multiple of 8); everything else the compiler's vectorisation
 * of the plain loop. stream != 0 asks for non-temporal stores where the AVX-512 loop runs and the
 * output rows are 64-byte aligned: a large rotation into a window buffer then writes its output
 * without first reading every destination line into the cache, the traffic a plain store costs.
 * limit caps the vector loops (0: the best the CPU has, 1: none with AVX-512, 2: the plain loop
 * only), so that every path can be checked on one machine.
 */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_X86 1
#include <immintrin.h>
#define KAMERA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KAMERA_CLONES
#endif

/* Where the rows of one rotation are: input, output, their strides, the cos/sin tables. */
struct rows {
    const float *x;
    int64_t xs0, xs1, xs2;
    float *out;
    int64_t os0, os1, os2;
    const float *cs, *sn;
    int64_t ts, n0, n1, n_tokens;
};

/* Runs the statements given for every row (i0, i1, t) with xr / o pointing at its input and
 * output features and c / s at its cos and sin; g is a local copy of the struct rows, so the
 * compiler keeps its fields in registers across the stores. */
#define FOR_EACH_ROW(g, ...)                                                        \
    for (int64_t i0 = 0; i0 < (g).n0; i0++) {                                        \
        for (int64_t i1 = 0; i1 < (g).n1; i1++) {                                    \
            for (int64_t t = 0; t < (g).n_tokens; t++) {                             \
                const float *restrict xr = (g).x + i0 * (g).xs0 + i1 * (g).xs1 + t * (g).xs2; \
                float *restrict o = (g).out + i0 * (g).os0 + i1 * (g).os1 + t * (g).os2;     \
                const float *restrict c = (g).cs + t * (g).ts;                       \
                const float *restrict s = (g).sn + t * (g).ts;                       \
                __VA_ARGS__                                                          \
            }                                                                        \
        }                                                                            \
    }

#ifdef KAMERA_X86
/* "half" pairing over the whole feature dim, h a multiple of 16: two 16-wide vectors per pair
 * block, the output either stored (any alignment) or streamed (64-byte aligned rows). */
__attribute__((target("avx512f")))
static void rotate_half_avx512(const struct rows *r, int64_t h, int stream) {
    const struct rows g = *r;
    FOR_EACH_ROW(g, {
        for (int64_t f = 0; f < h; f += 16) {
            const __m512 a = _mm512_loadu_ps(xr + f), b = _mm512_loadu_ps(xr + h + f);
            const __m512 cv = _mm512_loadu_ps(c + f), sv = _mm512_loadu_ps(s + f);
            const __m512 oa = _mm512_fnmadd_ps(b, sv, _mm512_mul_ps(a, cv));
            const __m512 ob = _mm512_fmadd_ps(a, sv, _mm512_mul_ps(b, cv));
            if (stream) {
                _mm512_stream_ps(o + f, oa);
                _mm512_stream_ps(o + h + f, ob);
            } else {
                _mm512_storeu_ps(o + f, oa);
                _mm512_storeu_ps(o + h + f, ob);
            }
        }
    })
    if (stream) {
        _mm_sfence(); /* the streamed lines are visible before the caller reads them */
    }
}

/* "interleaved" pairing over the whole feature dim, h a multiple of 8: 16 features (8 pairs) at
 * a time, out = x * (c0 c0 c1 c1 ...) + swap(x) * (-s0 s0 -s1 s1 ...). */
__attribute__((target("avx512f")))
static void rotate_interleaved_avx512(const struct rows *r, int64_t h) {
    const struct rows g = *r;
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 zero = _mm512_setzero_ps();
    FOR_EACH_ROW(g, {
        for (int64_t f = 0; f < h; f += 8) {
            const __m512 v = _mm512_loadu_ps(xr + 2 * f);
            const __m512 cv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(c + f)));
            __m512 sv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(s + f)));
            sv = _mm512_mask_sub_ps(sv, 0x5555, zero, sv); /* -sin on the first of each pair */
            const __m512 swapped = _mm512_permute_ps(v, 0xB1); /* (a, b) -> (b, a) */
            _mm512_storeu_ps(o + 2 * f, _mm512_fmadd_ps(swapped, sv, _mm512_mul_ps(v, cv)));
        }
    })
}

/* "half" pairing with 8-wide vectors (h a multiple of 8), for x86-64 CPUs without AVX-512. */
__attribute__((target("avx2,fma")))
static void rotate_half_avx2(const struct rows *r, int64_t h) {
    const struct rows g = *r;
    FOR_EACH_ROW(g, {
        for (int64_t f = 0; f < h; f += 8) {
            const __m256 a = _mm256_loadu_ps(xr + f), b = _mm256_loadu_ps(xr + h + f);
            const __m256 cv = _mm256_loadu_ps(c + f), sv = _mm256_loadu_ps(s + f);
            _mm256_storeu_ps(o + f, _mm256_fnmadd_ps(b, sv, _mm256_mul_ps(a, cv)));
            _mm256_storeu_ps(o + h + f, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
        }
    })
}
#endif

/* Any pairing, any rotary_dim: the plain loop, vectorised by the compiler. */
KAMERA_CLONES
static void rotate_plain(const struct rows *r, int64_t dim, int64_t rd, int interleaved) {
    const struct rows g = *r;
    const int64_t h = rd / 2;
    FOR_EACH_ROW(g, {
        if (interleaved) {
            for (int64_t f = 0; f < h; f++) {
                const float a = xr[2 * f], b = xr[2 * f + 1];
                o[2 * f] = a * c[f] - b * s[f];
                o[2 * f + 1] = b * c[f] + a * s[f];
            }
        } else {
            for (int64_t f = 0; f < h; f++) {
                const float a = xr[f], b = xr[f + h];
                o[f] = a * c[f] - b * s[f];
                o[f + h] = b * c[f] + a * s[f];
            }
        }
        for (int64_t d = rd; d < dim; d++) {
            o[d] = xr[d];
        }
    })
}

void kamera_rotate_f32(const float *x, int64_t xs0, int64_t xs1, int64_t xs2,
                       float *out, int64_t os0, int64_t os1, int64_t os2,
                       const float *cs, const float *sn, int64_t ts,
                       int64_t n0, int64_t n1, int64_t n_tokens, int64_t dim, int64_t rd,
                       int interleaved, int stream, int limit) {
    const struct rows r = {x, xs0, xs1, xs2, out, os0, os1, os2, cs, sn, ts, n0, n1, n_tokens};
    const int64_t h = rd / 2;
#ifdef KAMERA_X86
    const int avx512 = limit < 1 && __builtin_cpu_supports("avx512f");
    const int avx2 = limit < 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (rd == dim && interleaved && h % 8 == 0 && avx512) {
        rotate_interleaved_avx512(&r, h);
        return;
    }
    if (rd == dim && !interleaved && h % 16 == 0 && avx512) {
        const int aligned = (uintptr_t)out % 64 == 0 && os0 % 16 == 0 && os1 % 16 == 0 && os2 % 16 == 0;
        rotate_half_avx512(&r, h, stream && aligned);
        return;
    }
    if (rd == dim && !interleaved && h % 8 == 0 && avx2) {
        rotate_half_avx2(&r, h);
        return;
    }
#else
    (void)stream;
    (void)limit;
#endif
    rotate_plain(&r, dim, rd, interleaved);
}
