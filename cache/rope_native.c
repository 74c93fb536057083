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
 * stream != 0 asks for non-temporal stores where the layout allows them (AVX-512, "half"
 * pairing over the whole feature dim, rd/2 a multiple of 16, 64-byte aligned output rows): a
 * large rotation into a window buffer then writes its output without first reading every
 * destination line into the cache, the traffic a plain store costs.
 */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_X86 1
#include <immintrin.h>
#define KAMERA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KAMERA_CLONES
#endif

#ifdef KAMERA_X86
__attribute__((target("avx512f")))
static void rotate_half_stream(const float *x, int64_t xs0, int64_t xs1, int64_t xs2,
                               float *out, int64_t os0, int64_t os1, int64_t os2,
                               const float *cs, const float *sn, int64_t ts,
                               int64_t n0, int64_t n1, int64_t n_tokens, int64_t h) {
    for (int64_t i0 = 0; i0 < n0; i0++) {
        for (int64_t i1 = 0; i1 < n1; i1++) {
            for (int64_t t = 0; t < n_tokens; t++) {
                const float *xr = x + i0 * xs0 + i1 * xs1 + t * xs2;
                float *o = out + i0 * os0 + i1 * os1 + t * os2;
                const float *c = cs + t * ts, *s = sn + t * ts;
                for (int64_t f = 0; f < h; f += 16) {
                    const __m512 a = _mm512_loadu_ps(xr + f), b = _mm512_loadu_ps(xr + h + f);
                    const __m512 cv = _mm512_loadu_ps(c + f), sv = _mm512_loadu_ps(s + f);
                    _mm512_stream_ps(o + f, _mm512_fnmadd_ps(b, sv, _mm512_mul_ps(a, cv)));
                    _mm512_stream_ps(o + h + f, _mm512_fmadd_ps(a, sv, _mm512_mul_ps(b, cv)));
                }
            }
        }
    }
    _mm_sfence(); /* the streamed lines are visible before the caller reads them */
}
#endif

KAMERA_CLONES
void kamera_rotate_f32(const float *x, int64_t xs0, int64_t xs1, int64_t xs2,
                       float *out, int64_t os0, int64_t os1, int64_t os2,
                       const float *cs, const float *sn, int64_t ts,
                       int64_t n0, int64_t n1, int64_t n_tokens, int64_t dim, int64_t rd,
                       int interleaved, int stream) {
    const int64_t h = rd / 2;
#ifdef KAMERA_X86
    const int aligned = ((uintptr_t)out % 64 == 0) && os0 % 16 == 0 && os1 % 16 == 0 && os2 % 16 == 0;
    if (stream && !interleaved && rd == dim && h % 16 == 0 && aligned && __builtin_cpu_supports("avx512f")) {
        rotate_half_stream(x, xs0, xs1, xs2, out, os0, os1, os2, cs, sn, ts, n0, n1, n_tokens, h);
        return;
    }
#endif
    for (int64_t i0 = 0; i0 < n0; i0++) {
        for (int64_t i1 = 0; i1 < n1; i1++) {
            for (int64_t t = 0; t < n_tokens; t++) {
                const float *restrict xr = x + i0 * xs0 + i1 * xs1 + t * xs2;
                float *restrict o = out + i0 * os0 + i1 * os1 + t * os2;
                const float *restrict c = cs + t * ts;
                const float *restrict s = sn + t * ts;
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
            }
        }
    }
}
