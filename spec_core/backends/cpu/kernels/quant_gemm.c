/* Quantized matmuls over activations quantized per row and block: y = x · Wᵀ for fp32 rows x, each block of 32 of a
 * row quantized to int8 with its own scale d_x (its largest |x| / 127: llama.cpp's Q8_0 activations), then integer
 * dot products per block, scaled and summed in fp32. Two weight formats:
 *
 * - w8a8_gemm: int8 weights with one scale per output channel (--dtype w8a8 on CPUs without VNNI). The products use
 *   the sign trick, |w| (u8, at most 127) times x with w's sign (s8), so a pair sums to at most 2 · 127 · 127 < 2^15
 *   and all 8 bits stay (fbgemm keeps 7 there: its u8 x s8 pair sums would saturate int16).
 * - q4_gemm: 4-bit codes q in 0..15 with a scale d and a minimum m per block of 32 inputs and output (the GGUF's Q4_1:
 *   w = d · q + m, d and m in fp16; --dtype int4). Σ w·x over a block is d · d_x · Σ q·q(x) + m · d_x · Σ q(x).
 *
 * Why. fbgemm's dynamic linear quantizes a call's rows with one scale, so a row's result depends on the rows beside
 * it; torch's int4 kernel takes bf16 activations. Here a row's arithmetic is its own, in a fixed order (the plain-C
 * forms round as the AVX2 ones do), so its output is bit for bit the same whatever rows share the call: with the
 * kernels' attention, a forward is batch-invariant, and SD and SSD equal the dtype's own AR token for token.
 *
 * Layout, packed at load and zero-padded: [n8 = ceil(N/8)][k32 = ceil(K/32)][8][8 outputs][4 inputs] int8 for w8a8
 * (vector i: inputs 4i..4i + 3 of each output); for q4, codes [n8][k32][4][8 outputs][4 bytes] (byte (p, j, t):
 * input 4p + t of output j in its low nibble, input 16 + 4p + t in its high one) and scales [n8][k32][2][8 outputs]
 * fp16 (d, then m). A step of 32 inputs over 8 outputs reads contiguous bytes, and a decode step streams each matrix
 * once: memory-bound at one row; each further row costs its integer multiplies.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_SIMD 1
#else
#define QUANT_SIMD 0
#endif

/* How far ahead of the current step a row asks for the weight's bytes. */
#define W_AHEAD 1024
/* The most rows q4 multiplies per unpacking of a block's codes. */
#define ROW_GROUP 8

/* Whether the kernels were built with AVX2, FMA and F16C (else they are the plain C loops: the same floats, several
 * times slower). */
int quant_simd(void) { return QUANT_SIMD; }

/* Row x (k values) as int8 in q (kp >= k values, zero tail), with a scale per block of 32 in d (max|x| / 127 over the
 * block) and each block's d · Σ q in sums. One scale per block keeps a few large channels from
 * coarsening the rest. */
static void quantize_row(const float *restrict x, int8_t *restrict q, float *restrict d, float *restrict sums,
                         int64_t k, int64_t kp) {
    memset(q, 0, (size_t)kp);
    for (int64_t b = 0; b < kp / 32; b++) {
        const int64_t lo = 32 * b, hi = lo + 32 < k ? lo + 32 : k;
        float top = 0.f;
        for (int64_t i = lo; i < hi; i++) top = fmaxf(top, fabsf(x[i]));
        const float inv = top > 0.f ? 127.f / top : 0.f;
        int32_t total = 0;
        for (int64_t i = lo; i < hi; i++) {
            q[i] = (int8_t)nearbyintf(x[i] * inv);
            total += q[i];
        }
        d[b] = top / 127.f;
        sums[b] = d[b] * (float)total;
    }
}

/* w8a8: the 8 dot products of each of nr <= ROW_GROUP quantized rows (codes kp apart, block scales d kp / 32 apart)
 * with one packed block of 8 outputs (kp / 32 steps), into out[nr][8]. A step's 256 bytes are 8 vectors; vector i
 * holds, at byte 4j + t, input 4i + t of output j, so a multiply-add against 4 of the row's bytes broadcast gives
 * every output's partial sum in its own lane (no horizontal adds; see dot_q4). Each output's step is the exact
 * integer dot product of its 32 inputs, scaled by the block's d and added into the output's lane with one fused
 * multiply-add, so both forms round identically, whatever rows share the group. */
static void dot_w8(const int8_t *restrict xq, const float *restrict d, int64_t nr, const int8_t *restrict b,
                   int64_t kp, float *restrict out) {
    const int64_t blocks = kp / 32;
#if QUANT_SIMD
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_GROUP];
    __m256i w[8], mag[8];
    for (int64_t r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kp; k += 32, b += 256) {
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)b + W_AHEAD + 64 * l, _MM_HINT_T0);
        for (int i = 0; i < 8; i++) {
            w[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i));
            mag[i] = _mm256_abs_epi8(w[i]);
        }
        for (int64_t r = 0; r < nr; r++) {
            const int8_t *x = xq + r * kp + k;
            __m256i t = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(x + 4 * i)), w[i]);
                t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[i], xs), ones));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d[r * blocks + k / 32]), acc[r]);
        }
    }
    for (int64_t r = 0; r < nr; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
#else
    for (int64_t r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < kp; k += 32) {
                int32_t t = 0;
                for (int i = 0; i < 32; i++)
                    t += (int32_t)b[k * 8 + 32 * (i / 4) + 4 * j + i % 4] * (int32_t)xq[r * kp + k + i];
                acc = fmaf((float)t, d[r * blocks + k / 32], acc);
            }
            out[8 * r + j] = acc;
        }
#endif
}

/* q4: the 8 dot products of each of nr <= ROW_GROUP quantized rows (codes kp apart; block scales d and block sums s,
 * kp / 32 apart) with one block of 8 outputs' codes c and scales sc, into out[nr][8]. Each output's step is the exact
 * integer Σ q·q(x) over its 32 inputs, added with one fused multiply-add by d_w[j] · d_x into the output's lane; the
 * minimums go into a second lane per output, m[j] · s, also fused; the two are added at the end. A row's arithmetic
 * is the same whatever rows share its group.
 *
 * A step's 128 code bytes are 4 vectors; vector p holds, at byte 4j + t, input 4p + t of output j in its low nibble
 * and input 16 + 4p + t in its high one. Unpacked, each is 8 outputs × 4 inputs, so one multiply-add against 4 of the
 * row's bytes broadcast gives every output's partial sum in its own lane: 8 such products summed in int16 (at most
 * 8 · 2 · 15 · 127 < 2^15) and one widening add give the 8 block sums with no horizontal adds. Codes are unpacked
 * once per step for all the rows: each further row costs 8 byte multiplies a step (half what the per-output layout
 * with horizontal sums cost: layers of SmolLM2 at 5 rows 18.0 → 11.9 ms, one thread, AVX2 EPYC). */
#if QUANT_SIMD
static inline __m256i block_sums_q4(const __m256i *u, const int8_t *x) {
    __m256i t = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(*(const int32_t *)x));
    for (int i = 1; i < 8; i++)
        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(u[i], _mm256_set1_epi32(*(const int32_t *)(x + 4 * i))));
    return _mm256_madd_epi16(t, _mm256_set1_epi16(1));
}
#endif

static void dot_q4(const int8_t *restrict xq, const float *restrict d, const float *restrict s, int64_t nr,
                   const uint8_t *restrict c, const uint16_t *restrict sc, int64_t kp, float *restrict out) {
    const int64_t blocks = kp / 32;
#if QUANT_SIMD
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[ROW_GROUP], mins[ROW_GROUP];
    __m256i u[8];
    for (int64_t r = 0; r < nr; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kp; k += 32, c += 128, sc += 16) {
        _mm_prefetch((const char *)c + W_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)c + W_AHEAD + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)sc + W_AHEAD / 4, _MM_HINT_T0);
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * p));
            u[p] = _mm256_and_si256(v, low);
            u[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 8)));
        for (int64_t r = 0; r < nr; r++) {
            mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[r * blocks + k / 32]), mins[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums_q4(u, xq + r * kp + k)),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(d[r * blocks + k / 32])), acc[r]);
        }
    }
    for (int64_t r = 0; r < nr; r++) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], mins[r]));
#else
    for (int64_t r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) {
            float acc = 0.f, mins = 0.f;
            for (int64_t k = 0; k < kp; k += 32) {
                const uint8_t *ck = c + k * 4 + 4 * j;
                const uint16_t *sk = sc + k / 2;
                const int8_t *xk = xq + r * kp + k;
                const float scale = half_to_float(sk[j]) * d[r * blocks + k / 32];
                mins = fmaf(half_to_float(sk[8 + j]), s[r * blocks + k / 32], mins);
                int32_t t = 0;
                for (int i = 0; i < 16; i++) {
                    const uint8_t b = ck[32 * (i / 4) + i % 4];
                    t += (int32_t)(b & 15) * (int32_t)xk[i] + (int32_t)(b >> 4) * (int32_t)xk[16 + i];
                }
                acc = fmaf((float)t, scale, acc);
            }
            out[8 * r + j] = acc + mins;
        }
#endif
}

/* The rows of x quantized: codes [rows, kp], then block scales and block sums [rows, kp / 32] each (one buffer,
 * freed by the caller). */
static int8_t *quantize_rows(const float *x, int64_t rows, int64_t k, int64_t kp, float **d, float **s) {
    const int64_t blocks = kp / 32;
    float *buf = malloc(sizeof(float) * (size_t)(2 * rows * blocks) + (size_t)(rows * kp));
    *d = buf;
    *s = buf + rows * blocks;
    int8_t *xq = (int8_t *)(buf + 2 * rows * blocks);
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k, xq + r * kp, *d + r * blocks, *s + r * blocks, k, kp);
    return xq;
}

/* ---- Threads: a call's output blocks split across `threads` threads (the caller's and threads - 1 workers). ----
 * Each output's arithmetic is the same whichever thread computes it, so the split changes no result. Workers are
 * started on first use and kept; between calls they spin briefly (a decode step's matmuls come microseconds apart),
 * then sleep on a condition variable. One caller at a time (calls are serialized by `pool.call`). */

typedef void (*task_fn)(const void *job, int64_t begin, int64_t end);

#define MAX_WORKERS 63
#define SPIN 4000

static struct {
    pthread_mutex_t mu, call;
    pthread_cond_t wake, done;
    int workers;
    atomic_ulong gen;
    atomic_int pending;
    task_fn fn;
    const void *job;
    int64_t blocks;
    int parts;
    unsigned long start[MAX_WORKERS + 1]; /* the generation each worker was started at: its first job is the next */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .call = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if QUANT_SIMD
    _mm_pause();
#endif
}

static void run_part(int part) {
    const int64_t per = (pool.blocks + pool.parts - 1) / pool.parts, begin = part * per;
    const int64_t end = begin + per < pool.blocks ? begin + per : pool.blocks;
    if (begin < end) pool.fn(pool.job, begin, end);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned long seen = pool.start[id];
    for (;;) {
        for (int i = 0; i < SPIN && atomic_load(&pool.gen) == seen; i++) cpu_relax();
        if (atomic_load(&pool.gen) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.gen); /* every worker counts itself done, so no call starts before all have seen it */
        if (id < pool.parts) run_part(id);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* A forked child has none of the parent's workers: it starts its own if it needs them. */
static void pool_after_fork(void) {
    pool.workers = 0;
    pthread_mutex_init(&pool.mu, NULL);
    pthread_mutex_init(&pool.call, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
}

/* fn over blocks [0, blocks), split into `threads` contiguous parts (fewer where there are fewer blocks); also
 * kquant_gemm.c's. */
void run_blocks(task_fn fn, const void *job, int64_t blocks, int64_t threads) {
    int parts = (int)(threads < blocks ? threads : blocks);
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1) {
        fn(job, 0, blocks);
        return;
    }
    pthread_mutex_lock(&pool.call);
    if (pool.workers == 0) pthread_atfork(NULL, NULL, pool_after_fork);
    while (pool.workers < parts - 1) {
        pthread_t t;
        pool.start[pool.workers + 1] = atomic_load(&pool.gen);
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        pthread_detach(t);
        pool.workers++;
    }
    if (parts > pool.workers + 1) parts = pool.workers + 1;
    pool.fn = fn;
    pool.job = job;
    pool.blocks = blocks;
    pool.parts = parts;
    atomic_store(&pool.pending, pool.workers);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.gen, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_part(0);
    for (int i = 0; i < SPIN && atomic_load(&pool.pending) > 0; i++) cpu_relax();
    if (atomic_load(&pool.pending) > 0) {
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.pending) > 0) pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.call);
}

/* ---- The two matmuls. ---- */

typedef struct {
    const int8_t *xq, *w;
    const uint8_t *codes;
    const uint16_t *scales;
    const float *d, *s, *wscale;
    float *y;
    int64_t rows, kp, n;
} gemm_job;

/* Output blocks [begin, end) of a job, every row: w8a8's where the job has int8 weights, else q4's. */
static void gemm_blocks(const void *arg, int64_t begin, int64_t end) {
    const gemm_job *g = arg;
    const int64_t blocks = g->kp / 32;
    float out[8 * ROW_GROUP];
    for (int64_t c = 8 * begin; c < 8 * end && c < g->n; c += 8) {
        const int64_t width = g->n - c < 8 ? g->n - c : 8;
        for (int64_t r0 = 0; r0 < g->rows; r0 += ROW_GROUP) {
            const int64_t nr = g->rows - r0 < ROW_GROUP ? g->rows - r0 : ROW_GROUP;
            if (g->w) {
                dot_w8(g->xq + r0 * g->kp, g->d + r0 * blocks, nr, g->w + c * g->kp, g->kp, out);
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t j = 0; j < width; j++) out[8 * r + j] *= g->wscale[c + j];
            } else {
                dot_q4(g->xq + r0 * g->kp, g->d + r0 * blocks, g->s + r0 * blocks, nr, g->codes + c * g->kp / 2,
                       g->scales + c * blocks * 2, g->kp, out);
            }
            for (int64_t r = 0; r < nr; r++)
                for (int64_t j = 0; j < width; j++) g->y[(r0 + r) * g->n + c + j] = out[8 * r + j];
        }
    }
}

/* y[r, n] = wscale[n] · Σ_b d_x[r, b] · (Σ_{k in b} q(x)[r, k] · w[n, k]) for `rows` rows of k inputs and n outputs;
 * w packed as above, wscale zero-padded to a multiple of 8 entries; on `threads` threads. */
void w8a8_gemm(const float *x, const int8_t *w, const float *wscale, float *y, int64_t rows, int64_t k, int64_t n,
               int64_t threads) {
    gemm_job g = {.w = w, .wscale = wscale, .y = y, .rows = rows, .kp = (k + 31) / 32 * 32, .n = n};
    float *d, *s;
    g.xq = quantize_rows(x, rows, k, g.kp, &d, &s);
    g.d = d;
    run_blocks(gemm_blocks, &g, (n + 7) / 8, threads);
    free(d);
}

/* y[r, n] = Σ_b (d[n, b] · d_x[r, b] · Σ_{k in b} q[n, k] · q(x)[r, k] + m[n, b] · d_x[r, b] · Σ_{k in b} q(x)[r, k])
 * for `rows` rows of k inputs and n outputs; codes and scales packed as above; on `threads` threads. */
void q4_gemm(const float *x, const uint8_t *codes, const uint16_t *scales, float *y, int64_t rows, int64_t k,
             int64_t n, int64_t threads) {
    gemm_job g = {.codes = codes, .scales = scales, .y = y, .rows = rows, .kp = (k + 31) / 32 * 32, .n = n};
    float *d, *s;
    g.xq = quantize_rows(x, rows, k, g.kp, &d, &s);
    g.d = d;
    g.s = s;
    run_blocks(gemm_blocks, &g, (n + 7) / 8, threads);
    free(d);
}
