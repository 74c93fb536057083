/* One decode step's attention for many sequences in one call (see cache/attend.py).
 *
 * For each row r (one new query token of sequence r) and query head h, with kv = h / group:
 *   s_j = (q[r, h] . K_r[kv, j]) * scale         for j < len[r]
 *   p_j = exp(s_j - max_j s_j)
 *   out[r, h] = (sum_j p_j V_r[kv, j]) / (sum_j p_j)
 * K_r and V_r are the sequence's own cache: keys[r] + kv * k_head[r] + j * d (floats), the same
 * for values, so a row reads only its own tokens, wherever its cache lives (an arena with room
 * to spare, or a tensor sized to its tokens).
 *
 * Fixed order, the same on every path (AVX-512 and the plain loop give the same bits):
 * - a dot product over d runs in 16 lanes, lane l taking elements l, l + 16, ... by fused
 *   multiply-adds in order, and the lanes are summed in the tree (l, l + 8), (l, l + 4), (l, l + 2),
 *   (l, l + 1);
 * - the exponential is one fixed sequence of float32 operations (a degree-6 polynomial after
 *   reducing by ln 2, fused multiply-adds, scaled by 2^n through the exponent bits): scalar and
 *   vector code compute the same operations on the same values;
 * - the weights' sum runs over j in order; the output accumulates p_j v_j in order of j with
 *   one fused multiply-add per element, then is divided by the sum.
 * A row's result therefore depends only on its query and its own cache: not on the other rows
 * of the call, their number or lengths, nor on the capacity behind its cache.
 *
 * limit caps the vector loops (0: AVX-512 where the CPU has it, 2: the plain loop), so that both
 * paths can be checked against each other on one machine.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define EXP_MIN (-87.0f) /* below this the weight is taken as 0 (e^-87 < 2^-125) */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define P5 1.9875691500e-4f
#define P4 1.3981999507e-3f
#define P3 8.3334519073e-3f
#define P2 4.1665795894e-2f
#define P1 1.6666665459e-1f
#define P0 5.0000001201e-1f

static float exp_plain(float x) { /* x <= 0 */
    if (!(x >= EXP_MIN)) {
        return 0.0f;
    }
    const float n = nearbyintf(x * LOG2E), minus_n = 0.0f - n;
    float r = fmaf(minus_n, LN2_HI, x);
    r = fmaf(minus_n, LN2_LO, r);
    float p = fmaf(P5, r, P4);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P1);
    p = fmaf(p, r, P0);
    const float z = r * r;
    const float y = fmaf(p, z, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static float lanes_sum(const float *a) { /* the fixed tree over 16 lanes */
    float t8[8], t4[4];
    for (int i = 0; i < 8; i++) {
        t8[i] = a[i] + a[i + 8];
    }
    for (int i = 0; i < 4; i++) {
        t4[i] = t8[i] + t8[i + 4];
    }
    const float t2a = t4[0] + t4[2], t2b = t4[1] + t4[3];
    return t2a + t2b;
}

static float dot_plain(const float *q, const float *k, int64_t d) {
    float acc[LANES] = {0};
    for (int64_t c = 0; c < d; c += LANES) {
        for (int l = 0; l < LANES && c + l < d; l++) {
            acc[l] = fmaf(q[c + l], k[c + l], acc[l]);
        }
    }
    return lanes_sum(acc);
}

static void head_plain(const float *q, const float *k, const float *v, int64_t len, int64_t d, float scale,
                       float *s, float *out) {
    float m = -INFINITY;
    for (int64_t j = 0; j < len; j++) {
        s[j] = dot_plain(q, k + j * d, d) * scale;
        m = s[j] > m ? s[j] : m;
    }
    for (int64_t j = 0; j < len; j++) {
        s[j] = exp_plain(s[j] - m);
    }
    float l = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        l += s[j];
    }
    for (int64_t e = 0; e < d; e++) {
        out[e] = 0.0f;
    }
    for (int64_t j = 0; j < len; j++) {
        const float *vj = v + j * d;
        for (int64_t e = 0; e < d; e++) {
            out[e] = fmaf(s[j], vj[e], out[e]);
        }
    }
    for (int64_t e = 0; e < d; e++) {
        out[e] = out[e] / l;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KAMERA_X86 1
#include <immintrin.h>
#define T512 __attribute__((target("avx512f,avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

T512 INLINE __mmask16 tail_mask(int64_t left) { return left >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

T512 INLINE float lanes_sum512(__m512 a) { /* the tree of lanes_sum */
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(a), high);
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4)); /* lanes 0, 1: t4[0] + t4[2], t4[1] + t4[3] */
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

T512 INLINE __m512 exp512(__m512 x) { /* exp_plain, lane by lane */
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), n), _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), n), _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(P5), r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P0));
    const __m512 z = _mm512_mul_ps(r, r);
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
}

/* The weighted values of hn query heads (1 to 4, a constant where inlined) of d = 64: each value
 * row read once for all of them, 4 x hn accumulators in registers; per element the same fused
 * multiply-adds in order of j, then the division, as in the general loop below. */
T512 INLINE void values64(const float *v, int64_t len, const float *s, int64_t s_stride, const int hn,
                          float *out) {
    __m512 o[4][4];
    for (int h = 0; h < hn; h++) {
        for (int c = 0; c < 4; c++) {
            o[h][c] = _mm512_setzero_ps();
        }
    }
    for (int64_t j = 0; j < len; j++) {
        const float *vj = v + j * 4 * LANES;
        const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + LANES);
        const __m512 v2 = _mm512_loadu_ps(vj + 2 * LANES), v3 = _mm512_loadu_ps(vj + 3 * LANES);
        for (int h = 0; h < hn; h++) {
            const __m512 p = _mm512_set1_ps(s[h * s_stride + j]);
            o[h][0] = _mm512_fmadd_ps(p, v0, o[h][0]);
            o[h][1] = _mm512_fmadd_ps(p, v1, o[h][1]);
            o[h][2] = _mm512_fmadd_ps(p, v2, o[h][2]);
            o[h][3] = _mm512_fmadd_ps(p, v3, o[h][3]);
        }
    }
    for (int h = 0; h < hn; h++) {
        const __m512 lv = _mm512_set1_ps(s[h * s_stride + len]);
        for (int c = 0; c < 4; c++) {
            _mm512_storeu_ps(out + h * 4 * LANES + c * LANES, _mm512_div_ps(o[h][c], lv));
        }
    }
}

/* The query heads of one KV head (g of them, q and out g * d floats) over its keys: each key read
 * once for all of them, four keys' dot products at a time (independent chains; each key's own
 * sum is the lanes' fixed order), and the output accumulated for up to 256 floats of d in
 * registers. The same operations per value as head_plain. */
T512 static void group_avx512(const float *q, const float *k, const float *v, int64_t len, int64_t d, int64_t g,
                              float scale, float *s, float *out) {
    const int64_t chunks = (d + LANES - 1) / LANES;
    for (int64_t h = 0; h < g; h++) {
        const float *qh = q + h * d;
        float *sh = s + h * (len + LANES);
        int64_t j = 0;
        for (; j + 4 <= len; j += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *k0 = k + j * d;
            for (int64_t c = 0; c < d; c += LANES) {
                const __mmask16 mk = tail_mask(d - c);
                const __m512 qc = _mm512_maskz_loadu_ps(mk, qh + c);
                a0 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mk, k0 + c), a0);
                a1 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mk, k0 + d + c), a1);
                a2 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mk, k0 + 2 * d + c), a2);
                a3 = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mk, k0 + 3 * d + c), a3);
            }
            sh[j] = lanes_sum512(a0) * scale;
            sh[j + 1] = lanes_sum512(a1) * scale;
            sh[j + 2] = lanes_sum512(a2) * scale;
            sh[j + 3] = lanes_sum512(a3) * scale;
        }
        for (; j < len; j++) {
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += LANES) {
                const __mmask16 mk = tail_mask(d - c);
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, qh + c), _mm512_maskz_loadu_ps(mk, k + j * d + c), a0);
            }
            sh[j] = lanes_sum512(a0) * scale;
        }
        float m = -INFINITY;
        for (j = 0; j < len; j++) {
            m = sh[j] > m ? sh[j] : m;
        }
        const __m512 mv = _mm512_set1_ps(m);
        for (j = 0; j < len; j += LANES) {
            const __mmask16 mk = tail_mask(len - j);
            _mm512_mask_storeu_ps(sh + j, mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + j), mv)));
        }
        float l = 0.0f;
        for (j = 0; j < len; j++) {
            l += sh[j];
        }
        sh[len] = l;
    }
    if (d == 4 * LANES) { /* the common head size: every head's accumulators in registers */
        for (int64_t h0 = 0; h0 < g; h0 += 4) {
            switch (g - h0 < 4 ? g - h0 : 4) {
            case 1:
                values64(v, len, s + h0 * (len + LANES), len + LANES, 1, out + h0 * d);
                break;
            case 2:
                values64(v, len, s + h0 * (len + LANES), len + LANES, 2, out + h0 * d);
                break;
            case 3:
                values64(v, len, s + h0 * (len + LANES), len + LANES, 3, out + h0 * d);
                break;
            default:
                values64(v, len, s + h0 * (len + LANES), len + LANES, 4, out + h0 * d);
                break;
            }
        }
        return;
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += 16) { /* 16 registers of d at a time */
        const int64_t cn = chunks - c0 < 16 ? chunks - c0 : 16;
        for (int64_t h = 0; h < g; h++) {
            const float *sh = s + h * (len + LANES);
            __m512 o[16];
            for (int64_t c = 0; c < cn; c++) {
                o[c] = _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < len; j++) {
                const __m512 p = _mm512_set1_ps(sh[j]);
                const float *vj = v + j * d + c0 * LANES;
                for (int64_t c = 0; c < cn; c++) {
                    const __mmask16 mk = tail_mask(d - (c0 + c) * LANES);
                    o[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mk, vj + c * LANES), o[c]);
                }
            }
            const __m512 lv = _mm512_set1_ps(sh[len]);
            for (int64_t c = 0; c < cn; c++) {
                const __mmask16 mk = tail_mask(d - (c0 + c) * LANES);
                _mm512_mask_storeu_ps(out + h * d + (c0 + c) * LANES, mk, _mm512_div_ps(o[c], lv));
            }
        }
    }
}

static int have_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#endif

/* 1 where the AVX-512 loop runs here, else 0 (the plain loop: the same bits, far slower). */
int kamera_attend_vectorised(void) {
#ifdef KAMERA_X86
    return have_avx512();
#else
    return 0;
#endif
}

/* rows: n; heads, kv_heads (heads % kv_heads == 0), d; q [n, heads, d] contiguous; keys[r],
 * values[r]: addresses of sequence r's first key / value of kv head 0; k_head[r], v_head[r]: floats
 * from one kv head to the next; lens[r]: tokens, the new one included; new_k, new_v: NULL, or the
 * new token's key and value [n, kv_heads, d], written at token lens[r] - 1 of each row's cache
 * before it is read; out [n, heads, d]. Returns 0, -1 where scratch for the scores could not be
 * allocated, -2 on bad sizes. */
int kamera_attend_rows(int64_t n, int64_t heads, int64_t kv_heads, int64_t d, float scale, const float *q,
                       const int64_t *keys, const int64_t *values, const int64_t *k_head, const int64_t *v_head,
                       const int64_t *lens, const float *new_k, const float *new_v, float *out, int limit) {
    if (n < 0 || heads < 1 || kv_heads < 1 || heads % kv_heads != 0 || d < 1) {
        return -2;
    }
    const int64_t group = heads / kv_heads;
    int64_t longest = 1;
    for (int64_t r = 0; r < n; r++) {
        if (lens[r] < 1) {
            return -2;
        }
        longest = lens[r] > longest ? lens[r] : longest;
    }
    float *s = malloc((size_t)(group * (longest + LANES)) * sizeof(float));
    if (s == NULL) {
        return -1;
    }
#ifdef KAMERA_X86
    const int wide = limit < 1 && have_avx512();
#else
    const int wide = 0;
    (void)limit;
#endif
    for (int64_t r = 0; r < n; r++) {
        float *kr = (float *)(intptr_t)keys[r], *vr = (float *)(intptr_t)values[r];
        const int64_t len = lens[r];
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            float *k = kr + kv * k_head[r], *v = vr + kv * v_head[r];
            if (new_k != NULL) {
                memcpy(k + (len - 1) * d, new_k + (r * kv_heads + kv) * d, (size_t)d * sizeof(float));
                memcpy(v + (len - 1) * d, new_v + (r * kv_heads + kv) * d, (size_t)d * sizeof(float));
            }
            const float *qg = q + (r * heads + kv * group) * d;
            float *og = out + (r * heads + kv * group) * d;
#ifdef KAMERA_X86
            if (wide) {
                group_avx512(qg, k, v, len, d, group, scale, s, og);
                continue;
            }
#endif
            for (int64_t h = 0; h < group; h++) {
                head_plain(qg + h * d, k, v, len, d, scale, s, og + h * d);
            }
        }
    }
    free(s);
    return 0;
}
