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
 * spec_core/backends/cpu/cpu_kernels.py with -O3 -march=native -fopenmp-simd and called through ctypes, which releases the GIL
 * for the call. Pointers are to contiguous row-major buffers; indices are int64.
 *
 * Ragged rows. Attention takes B rows of up to T new tokens. With lens NULL every row has T (pad tokens included,
 * as in the padded [B, T] batch); otherwise row b has lens[b] and the per-token buffers (qkv, pos, write, out) hold
 * only real tokens, row after row, so pad tokens cost neither attention nor (in the caller) matmuls. The mask
 * stays [B, T, S]. A token's arithmetic is the same either way.
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

#include "attention_simd.h"

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
                                 const int64_t *write, const int64_t *kv, const uint8_t *mask, const int64_t *lens,  \
                                 ACT *out, int64_t B, int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t D) {     \
        int64_t n = B * T;                                                                                           \
        if (lens) /* ragged rows: row b's lens[b] tokens, packed one row after another (module comment) */          \
            for (int64_t b = n = 0; b < B; b++) n += lens[b];                                                        \
        const int64_t width = (H + 2 * KVH) * D, slot = 2 * KVH * D, group = H / KVH;                                \
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
        for (int64_t b = 0, r0 = 0; b < B; r0 += lens ? lens[b] : T, b++) {                                         \
            const int64_t *slots = kv + b * S, tb = lens ? lens[b] : T;                                              \
            for (int64_t t0 = 0; t0 < tb; t0 += QUERY_CHUNK) {                                                       \
                const int64_t tc = tb - t0 < QUERY_CHUNK ? tb - t0 : QUERY_CHUNK, m = tc * H;                        \
                const uint8_t *mb = mask ? mask + (b * T + t0) * S : NULL;                                           \
                const float *qb = q + (r0 + t0) * H * D;                                                             \
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
                ACT *o = out + (r0 + t0) * H * D;                                                                    \
                for (int64_t e = 0; e < m * D; e++) STORE(o + e, acc[e]);                                            \
            }                                                                                                        \
        }                                                                                                            \
        free(q);                                                                                                     \
    }

KERNELS(f32, float, load_f32, store_f32)
KERNELS(bf16, bf16, load_bf16, store_bf16)
