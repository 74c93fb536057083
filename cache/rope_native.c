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
 */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KAMERA_CLONES
#endif

KAMERA_CLONES
void kamera_rotate_f32(const float *x, int64_t xs0, int64_t xs1, int64_t xs2,
                       float *out, int64_t os0, int64_t os1, int64_t os2,
                       const float *cs, const float *sn, int64_t ts,
                       int64_t n0, int64_t n1, int64_t n_tokens, int64_t dim, int64_t rd,
                       int interleaved) {
    const int64_t h = rd / 2;
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
