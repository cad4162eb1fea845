/* The decoder's small ops, for CPU runners off the fp32 exactness reference: RMSNorm, SiLU-and-multiply, and one
 * call per layer for RoPE, the K/V store and attention over the paged slot pool.
 *
 * A decode step on a CPU is its weight matmuls plus about 35 small torch ops a layer, each a few microseconds of
 * dispatch, allocation and Python; at 30 layers that is a third of the step. Each call here replaces several of
 * them with one loop over few rows. Every function computes in fp32 and rounds once, at its output (and at the K/V
 * it stores), so its results are at least as near the fp32 model as torch's bf16 kernels. The exactness reference
 * (dense fp32, transformers' arithmetic bit for bit) never calls them.
 *
 * Each function comes in two forms, for fp32 and bf16 activations (suffix _f32, _bf16). Built by
 * spec_core/cpu_kernels.py with -O3 -march=native -fopenmp-simd and called through ctypes, which releases the GIL
 * for the call. Pointers are to contiguous row-major buffers; indices are int64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

/* How many slot rows ahead attention asks for its K/V rows. */
#define AHEAD 8
/* Attention's queries per pass over a row's slots (its score buffer holds QUERY_CHUNK x heads x slots). */
#define QUERY_CHUNK 32

static inline float load_bf16(const bf16 *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does (a NaN stays a NaN). */
static inline void store_bf16(bf16 *p, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        *p = (bf16)((u >> 16) | 0x40);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = (bf16)(u >> 16);
}

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float f) { *p = f; }

/* exp(x) in fp32 to about 1 ulp (Cephes' range reduction and polynomial), written so that loops of it vectorize
 * (libm's expf does not, without -ffast-math); exp(-inf) and anything below -87.3 is 0. */
static inline float exp_f32(float x) {
    float c = x < 88.3762626647949f ? x : 88.3762626647949f;
    c = c > -87.3365447504f ? c : -87.3365447504f;
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale * (float)(x >= -87.3365447504f);
}

static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < d; e++) s += a[e] * b[e];
    return s;
}

static inline void axpy_f32(float *restrict y, float a, const float *restrict x, int64_t d) {
#pragma omp simd
    for (int64_t e = 0; e < d; e++) y[e] += a * x[e];
}

/* A K or V row as fp32: the pool's own row for fp32, converted into buf for bf16. */
static inline const float *row_f32(const float *p, float *buf, int64_t d) {
    (void)buf;
    (void)d;
    return p;
}

static inline const float *row_bf16(const bf16 *restrict p, float *restrict buf, int64_t d) {
#pragma omp simd
    for (int64_t e = 0; e < d; e++) buf[e] = load_bf16(p + e);
    return buf;
}

/* Ask for the bytes [p, p + n) ahead of their use: a layer's K/V rows are cold (the weights streamed through the
 * caches since this layer last ran), and the rows of one request are scattered over its blocks. */
static inline void prefetch(const void *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch((const char *)p + off);
}

/* Lanes of the softmax's sum: the i-th nonzero entry adds into lane i % SUM_LANES, and the lanes add up in one fixed
 * order. */
#define SUM_LANES 8

/* Softmax of each of m rows of n scores, in place (a row's -inf entries become 0). The sum's order depends only on
 * the order of the entries that are not zero, never on where masked slots sit among them or after them: a query's
 * weights are the same in a one-token step, a chain's verify and a tree's (whose siblings are masked in between). */
static void softmax_rows(float *restrict sc, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++) {
        float *restrict row = sc + r * n, top = -INFINITY, lanes[SUM_LANES] = {0.f};
#pragma omp simd reduction(max : top)
        for (int64_t x = 0; x < n; x++) top = row[x] > top ? row[x] : top;
#pragma omp simd
        for (int64_t x = 0; x < n; x++) row[x] = exp_f32(row[x] - top);
        int64_t rank = 0;
        for (int64_t x = 0; x < n; x++)
            if (row[x] != 0.f) lanes[rank++ % SUM_LANES] += row[x];
        float total = 0.f;
        for (int l = 0; l < SUM_LANES; l++) total += lanes[l];
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t x = 0; x < n; x++) row[x] *= inv;
    }
}

/* ---- Attention's two passes over a row's slots, vectorized across slots (AVX2; fp32 and bf16 pools). ----
 * The same floats as the generic loops below, which gcc vectorizes as: a score is 8 lanes, lane l the sum of the
 * products q[e]·k[e] for e = l mod 8 in order (a multiply, then an add), and the lanes then added one by one to 0; an
 * output element is the fused multiply-adds of its slots' p · v in slot order. There, each score's lanes are summed
 * through memory one at a time and each output's accumulator is loaded and stored at every slot. Here 8 slots' scores
 * are made together (8 accumulators, one 8 × 8 transpose, 8 vector adds) and the outputs stay in registers over a
 * chunk of slots: a query's attention at context 256, 1.3 ms over 30 layers before. Each query's arithmetic is still
 * its own. The contract test compares the two forms bit for bit (to rounding where AVX-512 lets the compiler
 * vectorize the generic loop 16 lanes wide: the same sums in another order). */
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

/* RoPE of one head of d: y = x cos + rotate_half(x) sin, in fp32 (x read through LOAD). */
#define ROPE_HEAD(NAME, ACT, LOAD)                                                                                   \
    static inline void NAME(const ACT *restrict x, const float *restrict cos, const float *restrict sin,           \
                            float *restrict y, int64_t d) {                                                          \
        const int64_t half = d / 2;                                                                                  \
        _Pragma("omp simd") for (int64_t i = 0; i < half; i++) {                                                     \
            const float a = LOAD(x + i), b = LOAD(x + i + half);                                                     \
            y[i] = a * cos[i] - b * sin[i];                                                                          \
            y[i + half] = b * cos[i + half] + a * sin[i + half];                                                     \
        }                                                                                                            \
    }

#define KERNELS(SUF, ACT, LOAD, STORE)                                                                               \
    ROPE_HEAD(rope_head_##SUF, ACT, LOAD)                                                                            \
                                                                                                                     \
    /* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, for rows of d. */                                             \
    void rms_norm_##SUF(const ACT *restrict x, const ACT *restrict w, ACT *restrict out, int64_t rows, int64_t d,   \
                        float eps) {                                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                                         \
            const ACT *restrict xr = x + r * d;                                                                      \
            ACT *restrict o = out + r * d;                                                                           \
            float ss = 0.f;                                                                                          \
            _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < d; i++) {                                  \
                const float v = LOAD(xr + i);                                                                        \
                ss += v * v;                                                                                         \
            }                                                                                                        \
            const float inv = 1.0f / sqrtf(ss / (float)d + eps);                                                    \
            _Pragma("omp simd") for (int64_t i = 0; i < d; i++) STORE(o + i, LOAD(xr + i) * inv * LOAD(w + i));      \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    /* out[r] = silu(gu[r, :f]) * gu[r, f:], for rows of 2f (the gate, then the up projection). */                  \
    void silu_mul_##SUF(const ACT *restrict gu, ACT *restrict out, int64_t rows, int64_t f) {                      \
        for (int64_t r = 0; r < rows; r++) {                                                                         \
            const ACT *restrict g = gu + r * 2 * f, *restrict u = g + f;                                             \
            ACT *restrict o = out + r * f;                                                                           \
            _Pragma("omp simd") for (int64_t i = 0; i < f; i++) {                                                    \
                const float a = LOAD(g + i);                                                                         \
                STORE(o + i, a / (1.0f + exp_f32(-a)) * LOAD(u + i));                                                \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    void rope_store_attend_##SUF(const ACT *qkv, const float *cos, const float *sin, const int64_t *pos, ACT *pool, \
                                 const int64_t *write, const int64_t *kv, const uint8_t *mask, ACT *out, int64_t B,  \
                                 int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t D) {                          \
        const int64_t n = B * T, width = (H + 2 * KVH) * D, slot = 2 * KVH * D, group = H / KVH;                     \
        const int64_t tq = T < QUERY_CHUNK ? T : QUERY_CHUNK;                                                        \
        const float scale = 1.0f / sqrtf((float)D);                                                                  \
        float *q = malloc(sizeof(float) * (size_t)(n * H * D + D + tq * H * S + tq * H * D));                        \
        float *row = q + n * H * D, *scores = row + D, *acc = scores + tq * H * S;                                   \
        for (int64_t i = 0; i < n; i++) { /* RoPE on q (scaled, kept in fp32) and k; k and v to their slot */        \
            const ACT *x = qkv + i * width;                                                                          \
            const float *c = cos + pos[i] * D, *s = sin + pos[i] * D;                                                \
            for (int64_t h = 0; h < H; h++) {                                                                        \
                float *qh = q + (i * H + h) * D;                                                                     \
                rope_head_##SUF(x + h * D, c, s, qh, D);                                                             \
                for (int64_t e = 0; e < D; e++) qh[e] *= scale;                                                      \
            }                                                                                                        \
            ACT *dst = pool + write[i] * slot;                                                                       \
            for (int64_t j = 0; j < KVH; j++) {                                                                      \
                rope_head_##SUF(x + (H + j) * D, c, s, row, D);                                                      \
                for (int64_t e = 0; e < D; e++) STORE(dst + j * D + e, row[e]);                                      \
            }                                                                                                        \
            memcpy(dst + KVH * D, x + (H + KVH) * D, sizeof(ACT) * (size_t)(KVH * D));                               \
        }                                                                                                            \
        /* Then attention (every store first: a tree's nodes see ancestors written by this call), for each row's     \
         * queries in chunks of QUERY_CHUNK. A chunk's queries share the row's slots: one pass over them computes    \
         * every head's scores (each slot's K heads are contiguous), a second accumulates every head's output from   \
         * its V heads. Score and output row r is query t of the chunk, head h: r = t * H + h, with                  \
         * h = j * group + g on K/V head j. Each query's arithmetic is its own, whatever the chunk holds. */         \
        for (int64_t b = 0; b < B; b++) {                                                                            \
            const int64_t *slots = kv + b * S;                                                                       \
            for (int64_t t0 = 0; t0 < T; t0 += QUERY_CHUNK) {                                                        \
                const int64_t tc = T - t0 < QUERY_CHUNK ? T - t0 : QUERY_CHUNK, m = tc * H;                          \
                const uint8_t *mb = mask ? mask + (b * T + t0) * S : NULL;                                           \
                const float *qb = q + (b * T + t0) * H * D;                                                          \
                if (!scores_fast_##SUF(pool, slots, slot, S, KVH, D, H, tc, mb, qb, scores)) {                       \
                    for (int64_t x = 0; x < S; x++) {                                                                \
                        if (x + AHEAD < S) prefetch(pool + slots[x + AHEAD] * slot, KVH * D * (int64_t)sizeof(ACT)); \
                        const ACT *base = pool + slots[x] * slot;                                                    \
                        for (int64_t j = 0; j < KVH; j++) {                                                          \
                            const float *k = row_##SUF(base + j * D, row, D);                                        \
                            for (int64_t t = 0; t < tc; t++) {                                                       \
                                const int seen = !mb || mb[t * S + x];                                               \
                                for (int64_t h = j * group; h < (j + 1) * group; h++)                                \
                                    scores[(t * H + h) * S + x] =                                                    \
                                        seen ? dot_f32(qb + (t * H + h) * D, k, D) : -INFINITY;                      \
                            }                                                                                        \
                        }                                                                                            \
                    }                                                                                                \
                }                                                                                                    \
                softmax_rows(scores, m, S);                                                                          \
                memset(acc, 0, sizeof(float) * (size_t)(m * D));                                                     \
                if (!values_fast_##SUF(pool, slots, slot, S, KVH, D, H, tc, scores, acc)) {                          \
                    for (int64_t x = 0; x < S; x++) {                                                                \
                        if (x + AHEAD < S)                                                                           \
                            prefetch(pool + slots[x + AHEAD] * slot + KVH * D, KVH * D * (int64_t)sizeof(ACT));      \
                        const ACT *base = pool + slots[x] * slot + KVH * D;                                          \
                        for (int64_t j = 0; j < KVH; j++) {                                                          \
                            const float *v = row_##SUF(base + j * D, row, D);                                        \
                            for (int64_t t = 0; t < tc; t++)                                                         \
                                for (int64_t h = j * group; h < (j + 1) * group; h++) {                              \
                                    const float p = scores[(t * H + h) * S + x];                                     \
                                    if (p != 0.f) axpy_f32(acc + (t * H + h) * D, p, v, D);                          \
                                }                                                                                    \
                        }                                                                                            \
                    }                                                                                                \
                }                                                                                                    \
                ACT *o = out + (b * T + t0) * H * D;                                                                 \
                for (int64_t e = 0; e < m * D; e++) STORE(o + e, acc[e]);                                            \
            }                                                                                                        \
        }                                                                                                            \
        free(q);                                                                                                     \
    }

KERNELS(f32, float, load_f32, store_f32)
KERNELS(bf16, bf16, load_bf16, store_bf16)
