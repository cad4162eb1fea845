/* Attention's score and value passes vectorized across slots, for decode_ops.c (included there, after the helpers
 * they use: bf16, prefetch, row_bf16, AHEAD). */
/* ---- Attention's two passes over a row's slots, vectorized across slots (AVX2; fp32 and bf16 pools). ----
 * The same floats as the generic loops (decode_ops.c), which gcc vectorizes as: a score is 8 lanes, lane l the sum
 * of the products q[e]·k[e] for e = l mod 8 in order (a multiply, then an add), and the lanes then added one by one
 * to 0; an output element is the fused multiply-adds of its slots' p · v in slot order. There, each score's lanes
 * are summed through memory one at a time and each output's accumulator is loaded and stored at every slot. Here 8
 * slots' scores are made together (8 accumulators, one 8 × 8 transpose, 8 vector adds) and the outputs stay in
 * registers over a chunk of slots: a query's attention at context 256, 1.3 ms over 30 layers before. Each query's
 * arithmetic is still its own. The contract test compares the two forms bit for bit (to rounding where AVX-512 lets
 * the compiler vectorize the generic loop 16 lanes wide: the same sums in another order). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(GENERIC_ATTENTION) /* the switch: for the contract test */
#include <immintrin.h>
/* Slots per chunk of the values pass: their V rows stay in L1 across a chunk's queries and heads. */
#define V_CHUNK 64

/* out[i] = q · k[i] over d (a multiple of 8) for 8 rows k[i], each summed as described above. */
static inline void dot8_f32(const float *restrict q, const float *const *k, int64_t d, float *restrict out) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        for (int i = 0; i < 8; i++) {
            __m256 prod = _mm256_mul_ps(qv, _mm256_loadu_ps(k[i] + e));
            __asm__("" : "+x"(prod)); /* rounded on its own, as there: not contracted into a fused multiply-add */
            a[i] = _mm256_add_ps(a[i], prod);
        }
    }
    /* transpose: t[l] holds lane l of every a[i] */
    const __m256 u0 = _mm256_unpacklo_ps(a[0], a[1]), u1 = _mm256_unpackhi_ps(a[0], a[1]);
    const __m256 u2 = _mm256_unpacklo_ps(a[2], a[3]), u3 = _mm256_unpackhi_ps(a[2], a[3]);
    const __m256 u4 = _mm256_unpacklo_ps(a[4], a[5]), u5 = _mm256_unpackhi_ps(a[4], a[5]);
    const __m256 u6 = _mm256_unpacklo_ps(a[6], a[7]), u7 = _mm256_unpackhi_ps(a[6], a[7]);
    const __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xee);
    const __m256 t[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                         _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                         _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                         _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    __m256 r = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++) r = _mm256_add_ps(r, t[l]);
    _mm256_storeu_ps(out, r);
}

/* Scores of a chunk's queries against 8 slots x0.. (n of them real): k8[i] is slot x0 + i's K row, every K/V head's
 * D floats in turn (rows past n repeat a real one and are never written). */
static inline void scores_8_f32(const float *const *k8, int64_t n, int64_t x0, int64_t S, int64_t KVH, int64_t D,
                                int64_t H, int64_t tc, const uint8_t *mb, const float *qb, float *scores) {
    const int64_t group = H / KVH;
    float got[8];
    const float *k[8];
    for (int64_t j = 0; j < KVH; j++) {
        for (int64_t i = 0; i < 8; i++) k[i] = k8[i] + j * D;
        for (int64_t t = 0; t < tc; t++)
            for (int64_t h = j * group; h < (j + 1) * group; h++) {
                const int64_t r = t * H + h;
                dot8_f32(qb + r * D, k, D, got);
                for (int64_t i = 0; i < n; i++) scores[r * S + x0 + i] = !mb || mb[t * S + x0 + i] ? got[i] : -INFINITY;
            }
    }
}

/* Scores [tc · H, S] of a chunk's queries qb (already scaled) against the row's slots; -inf where mb masks. */
static void attend_scores_f32(const float *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH,
                              int64_t D, int64_t H, int64_t tc, const uint8_t *mb, const float *qb, float *scores) {
    const float *k8[8];
    for (int64_t x0 = 0; x0 < S; x0 += 8) {
        const int64_t n = S - x0 < 8 ? S - x0 : 8;
        for (int64_t i = 0; i < 8 && x0 + 8 + i < S; i++) prefetch(pool + slots[x0 + 8 + i] * slot, KVH * D * 4);
        for (int64_t i = 0; i < 8; i++) k8[i] = pool + slots[x0 + (i < n ? i : 0)] * slot;
        scores_8_f32(k8, n, x0, S, KVH, D, H, tc, mb, qb, scores);
    }
}

/* acc [tc · H, D] += Σ p[x] · v[x] over slots x0..x1-1 in slot order, skipping p = 0; vrows[x - x0] is slot x's V
 * row (every V head's D floats in turn). */
static inline void values_chunk_f32(const float *const *vrows, int64_t x0, int64_t x1, int64_t KVH, int64_t D,
                                    int64_t H, int64_t tc, int64_t S, const float *scores, float *acc) {
    const int64_t group = H / KVH;
    for (int64_t j = 0; j < KVH; j++)
        for (int64_t t = 0; t < tc; t++)
            for (int64_t h = j * group; h < (j + 1) * group; h++) {
                const int64_t r = t * H + h;
                const float *p = scores + r * S;
                int64_t e0 = 0;
                for (; e0 + 64 <= D; e0 += 64) { /* 8 accumulators in registers */
                    float *o = acc + r * D + e0;
                    __m256 a[8];
                    for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(o + 8 * c);
                    for (int64_t x = x0; x < x1; x++)
                        if (p[x] != 0.f) {
                            const __m256 pv = _mm256_set1_ps(p[x]);
                            const float *v = vrows[x - x0] + j * D + e0;
                            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * c), a[c]);
                        }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + 8 * c, a[c]);
                }
                for (; e0 < D; e0 += 8) {
                    float *o = acc + r * D + e0;
                    __m256 a = _mm256_loadu_ps(o);
                    for (int64_t x = x0; x < x1; x++)
                        if (p[x] != 0.f)
                            a = _mm256_fmadd_ps(_mm256_set1_ps(p[x]), _mm256_loadu_ps(vrows[x - x0] + j * D + e0), a);
                    _mm256_storeu_ps(o, a);
                }
            }
}

/* acc [tc · H, D] (zeroed) += Σ_x p[x] · v[x] over the row's slots, in slot order, skipping p = 0. */
static void attend_values_f32(const float *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH,
                              int64_t D, int64_t H, int64_t tc, const float *scores, float *acc) {
    const float *vrows[V_CHUNK];
    for (int64_t x0 = 0; x0 < S; x0 += V_CHUNK) {
        const int64_t x1 = S - x0 < V_CHUNK ? S : x0 + V_CHUNK;
        for (int64_t x = x1; x < x1 + V_CHUNK && x < S; x++) prefetch(pool + slots[x] * slot + KVH * D, KVH * D * 4);
        for (int64_t x = x0; x < x1; x++) vrows[x - x0] = pool + slots[x] * slot + KVH * D;
        values_chunk_f32(vrows, x0, x1, KVH, D, H, tc, S, scores, acc);
    }
}

/* The same two passes over a bf16 pool: each chunk's K (V) rows are converted to fp32 once (exactly), then the fp32
 * passes run on them, so a query's floats are those of an fp32 pool holding the same values. */
static void attend_scores_bf16(const bf16 *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH,
                               int64_t D, int64_t H, int64_t tc, const uint8_t *mb, const float *qb, float *scores) {
    const int64_t w = KVH * D;
    float *buf = malloc(sizeof(float) * (size_t)(8 * w));
    const float *k8[8];
    for (int64_t x0 = 0; x0 < S; x0 += 8) {
        const int64_t n = S - x0 < 8 ? S - x0 : 8;
        for (int64_t i = 0; i < 8 && x0 + 8 + i < S; i++) prefetch(pool + slots[x0 + 8 + i] * slot, w * 2);
        for (int64_t i = 0; i < n; i++) row_bf16(pool + slots[x0 + i] * slot, buf + i * w, w);
        for (int64_t i = 0; i < 8; i++) k8[i] = buf + (i < n ? i : 0) * w;
        scores_8_f32(k8, n, x0, S, KVH, D, H, tc, mb, qb, scores);
    }
    free(buf);
}

static void attend_values_bf16(const bf16 *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH,
                               int64_t D, int64_t H, int64_t tc, const float *scores, float *acc) {
    const int64_t w = KVH * D;
    float *buf = malloc(sizeof(float) * (size_t)(V_CHUNK * w));
    const float *vrows[V_CHUNK];
    for (int64_t x0 = 0; x0 < S; x0 += V_CHUNK) {
        const int64_t x1 = S - x0 < V_CHUNK ? S : x0 + V_CHUNK;
        for (int64_t x = x0; x < x1; x++) {
            if (x + AHEAD < S) prefetch(pool + slots[x + AHEAD] * slot + w, w * 2);
            vrows[x - x0] = row_bf16(pool + slots[x] * slot + w, buf + (x - x0) * w, w);
        }
        values_chunk_f32(vrows, x0, x1, KVH, D, H, tc, S, scores, acc);
    }
    free(buf);
}

/* The passes above where they apply (heads a multiple of 8 wide); 0 where the generic loops must run. */
#define FAST_PASSES(SUF, ACT)                                                                                        \
    static inline int scores_fast_##SUF(const ACT *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH, \
                                        int64_t D, int64_t H, int64_t tc, const uint8_t *mb, const float *qb,        \
                                        float *scores) {                                                             \
        if (D % 8) return 0;                                                                                         \
        attend_scores_##SUF(pool, slots, slot, S, KVH, D, H, tc, mb, qb, scores);                                    \
        return 1;                                                                                                    \
    }                                                                                                                \
    static inline int values_fast_##SUF(const ACT *pool, const int64_t *slots, int64_t slot, int64_t S, int64_t KVH, \
                                        int64_t D, int64_t H, int64_t tc, const float *scores, float *acc) {         \
        if (D % 8) return 0;                                                                                         \
        attend_values_##SUF(pool, slots, slot, S, KVH, D, H, tc, scores, acc);                                       \
        return 1;                                                                                                    \
    }
FAST_PASSES(f32, float)
FAST_PASSES(bf16, bf16)
#else
#define scores_fast_f32(...) 0
#define values_fast_f32(...) 0
#define scores_fast_bf16(...) 0
#define values_fast_bf16(...) 0
#endif
