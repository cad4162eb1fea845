/* GGUF matrices in their own formats: y = x · Wᵀ for fp32 rows x and weights stored as the file stores them
 * (Q8_0, Q5_0, Q4_K, Q6_K), repacked at load into strips of 16 outputs, with every weight exactly the file's.
 *
 * Activations. Each block of 32 of a row is quantized to int8 with its own scale d_x (its largest |x| / 127, as in
 * quant_gemm.c), and its code sums are kept per 16 inputs (s16) and as d_x · Σ q(x) per 32 (sx).
 *
 * Weights. Every format is an unsigned code u per weight (0..255) with w = a · (u − o) or w = a · u + b per group:
 *   Q8_0   groups of 32: w = d · q, q = u − 128 (stored signed: q)       a = d (fp16)
 *   Q5_0   groups of 32: w = d · (u − 16), u in 0..31                      a = d (fp16)
 *   Q4_K   groups of 32: w = d·sc · u − dmin·m, u in 0..15                 a = d·sc, b = −dmin·m (sc, m 6-bit)
 *   Q6_K   groups of 16: w = d·sc · (u − 32), u in 0..63                  a = d·sc (sc int8)
 * A product of an fp16 and a 6- or 8-bit integer is exact in fp32, so a and b are the file's values exactly. A
 * group's dot product Σ (u − o) · q(x) is an exact integer; it is scaled by a · d_x (one rounding) and added with
 * one fused multiply-add per group, in input order; Q4_K adds b · sx per group into a second sum, and the two are
 * added at the end. The AVX-512 VNNI, AVX2 and plain-C forms compute the same integers and the same float
 * operations in the same order, so they give the same floats, whatever rows share a call (batch-invariant).
 *
 * Packed layout (kq_pack): strips of 16 outputs, each a run of tiles of 16 outputs × 32 inputs. A tile's codes are
 * 8 vectors of 64 bytes (vector i: byte 4j + t is input 4i + t of output j), so one VNNI multiply-add against 4 of
 * a row's bytes broadcast gives all 16 outputs' partial sums in their own lanes. Codes below 8 bits are stored as
 * nibbles: 4 vectors whose low nibbles are vectors 0..3 and high nibbles vectors 4..7; Q5_0 adds a vector of high
 * bits (bit i of byte 4j + t: vector i's), Q6_K two vectors of high bit pairs (bits 2s of vector h: vector 4h + s).
 *   Q8_0 tile:  d fp16[16], codes int8[512]                              544 bytes (8.5 bits a weight)
 *   Q5_0 tile:  d fp16[16], nibbles[256], high bits[64]                  352 bytes (5.5)
 *   Q4_K per 256 inputs: d fp16[16], dmin fp16[16], then 8 tiles of sc u8[16], m u8[16], nibbles[256]  (4.625)
 *   Q6_K per 256 inputs: d fp16[16], then 8 tiles of sc int8[2][16], nibbles[256], high pairs[128]     (6.5625)
 *
 * Multi-row. A tile's codes are decoded once and dotted with every row of the call (8 at a time), so each further
 * row costs its integer multiply-adds: 8 VNNI instructions per tile and row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_SIMD 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_SIMD 1
#else
#define KQ_SIMD 0
#endif

enum { KQ_Q8_0 = 0, KQ_Q5_0 = 1, KQ_Q4_K = 2, KQ_Q6_K = 3 };
#define KQ_ROWS 8

/* From quant_gemm.c (one library): fn over blocks [0, blocks) on `threads` threads. */
typedef void (*task_fn)(const void *job, int64_t begin, int64_t end);
void run_blocks(task_fn fn, const void *job, int64_t blocks, int64_t threads);

/* 2 where the kernels use AVX-512 VNNI, 1 for AVX2 (with FMA and F16C), 0 for the plain-C loops. */
int kq_simd(void) { return KQ_SIMD; }

/* ---- Formats: GGUF block sizes, packed sizes. ---- */

static const int64_t GGUF_BLOCK[4] = {32, 32, 256, 256};     /* inputs per GGUF block */
static const int64_t GGUF_BYTES[4] = {34, 22, 144, 210};     /* bytes per GGUF block */
static const int64_t UNIT_IN[4] = {32, 32, 256, 256};        /* inputs per packed unit of a strip */
static const int64_t UNIT_BYTES[4] = {544, 352, 2368, 3360}; /* bytes per packed unit of a strip */

/* Bytes of one packed strip of 16 outputs over k inputs (k a multiple of the format's block), or -1. */
int64_t kq_strip_bytes(int64_t fmt, int64_t k) {
    if (fmt < 0 || fmt > 3 || k <= 0 || k % UNIT_IN[fmt]) return -1;
    return k / UNIT_IN[fmt] * UNIT_BYTES[fmt];
}

static float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* ---- GGUF blocks: codes and group scales (ggml's layouts). ---- */

typedef struct {
    uint8_t u[256];      /* codes (Q8_0: the int8 value's bits) */
    uint8_t sc[16], m[8]; /* Q4_K: 8 scales and mins; Q6_K: 16 scales (int8 bits) */
    uint8_t d[2], dmin[2]; /* fp16 bits */
} gguf_block;

static void unpack_q8_0(const uint8_t *b, gguf_block *o) {
    memcpy(o->d, b, 2);
    memcpy(o->u, b + 2, 32);
}

static void unpack_q5_0(const uint8_t *b, gguf_block *o) {
    uint32_t qh;
    memcpy(o->d, b, 2);
    memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 16; i++) {
        o->u[i] = (uint8_t)((b[6 + i] & 15) | (((qh >> i) & 1) << 4));
        o->u[i + 16] = (uint8_t)((b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
}

static void unpack_q4_k(const uint8_t *b, gguf_block *o) {
    const uint8_t *s = b + 4, *q = b + 16;
    memcpy(o->d, b, 2);
    memcpy(o->dmin, b + 2, 2);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            o->sc[j] = s[j] & 63;
            o->m[j] = s[j + 4] & 63;
        } else {
            o->sc[j] = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
            o->m[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        }
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            o->u[64 * c + l] = q[32 * c + l] & 15;
            o->u[64 * c + 32 + l] = q[32 * c + l] >> 4;
        }
}

static void unpack_q6_k(const uint8_t *b, gguf_block *o) {
    const uint8_t *ql = b, *qh = b + 128;
    memcpy(o->sc, b + 192, 16);
    memcpy(o->d, b + 208, 2);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *lo = ql + 64 * h, hi = qh[32 * h + l];
            uint8_t *u = o->u + 128 * h;
            u[l] = (uint8_t)((lo[l] & 15) | ((hi & 3) << 4));
            u[l + 32] = (uint8_t)((lo[l + 32] & 15) | (((hi >> 2) & 3) << 4));
            u[l + 64] = (uint8_t)((lo[l] >> 4) | (((hi >> 4) & 3) << 4));
            u[l + 96] = (uint8_t)((lo[l + 32] >> 4) | (((hi >> 6) & 3) << 4));
        }
}

static void unpack(int64_t fmt, const uint8_t *b, gguf_block *o) {
    switch (fmt) {
    case KQ_Q8_0: unpack_q8_0(b, o); break;
    case KQ_Q5_0: unpack_q5_0(b, o); break;
    case KQ_Q4_K: unpack_q4_k(b, o); break;
    default: unpack_q6_k(b, o); break;
    }
}

/* Rows ids[0..n) of a GGUF matrix (rows of k inputs, row_bytes apart) in fp32: ggml's values bit for bit (each is
 * one exact product, Q4_K's less its exact minimum, rounded once). */
void kq_dequant_rows(int64_t fmt, const uint8_t *w, int64_t row_bytes, const int64_t *ids, int64_t n, int64_t k,
                     float *out) {
    gguf_block blk;
    const int64_t bs = GGUF_BLOCK[fmt];
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / bs; b++) {
            unpack(fmt, w + ids[r] * row_bytes + b * GGUF_BYTES[fmt], &blk);
            float *y = out + r * k + b * bs;
            const float d = fp16(blk.d);
            for (int i = 0; i < bs; i++) {
                if (fmt == KQ_Q8_0) y[i] = d * (float)(int8_t)blk.u[i];
                else if (fmt == KQ_Q5_0) y[i] = d * (float)(blk.u[i] - 16);
                else if (fmt == KQ_Q4_K) y[i] = d * (float)blk.sc[i / 32] * (float)blk.u[i] - fp16(blk.dmin) * (float)blk.m[i / 32];
                else y[i] = d * (float)(int8_t)blk.sc[i / 16] * (float)(blk.u[i] - 32);
            }
        }
}

/* ---- Packing: GGUF rows into strips. ---- */

/* Output j's 32 codes u (input order) into a tile's code vectors: full bytes (Q8_0) or nibbles, plus Q5_0's high
 * bits or Q6_K's high pairs. */
static void put_codes(int64_t fmt, uint8_t *codes, uint8_t *high, int j, const uint8_t *u) {
    for (int i = 0; i < 8; i++)
        for (int t = 0; t < 4; t++) {
            const uint8_t c = u[4 * i + t];
            if (fmt == KQ_Q8_0) {
                codes[64 * i + 4 * j + t] = c;
                continue;
            }
            codes[64 * (i % 4) + 4 * j + t] |= (uint8_t)((c & 15) << (i < 4 ? 0 : 4));
            if (fmt == KQ_Q5_0) high[4 * j + t] |= (uint8_t)(((c >> 4) & 1) << i);
            if (fmt == KQ_Q6_K) high[64 * (i / 4) + 4 * j + t] |= (uint8_t)(((c >> 4) & 3) << (2 * (i % 4)));
        }
}

/* Output j's GGUF block b (unpacked) into unit `unit` of a strip (zeroed beforehand). */
static void put_block(int64_t fmt, uint8_t *unit, int j, const gguf_block *blk) {
    if (fmt == KQ_Q8_0 || fmt == KQ_Q5_0) {
        memcpy(unit + 2 * j, blk->d, 2);
        put_codes(fmt, unit + 32, unit + 32 + 256, j, blk->u);
        return;
    }
    if (fmt == KQ_Q4_K) {
        memcpy(unit + 2 * j, blk->d, 2);
        memcpy(unit + 32 + 2 * j, blk->dmin, 2);
        for (int g = 0; g < 8; g++) {
            uint8_t *tile = unit + 64 + 288 * g;
            tile[j] = blk->sc[g];
            tile[16 + j] = blk->m[g];
            put_codes(fmt, tile + 32, NULL, j, blk->u + 32 * g);
        }
        return;
    }
    memcpy(unit + 2 * j, blk->d, 2);
    for (int g = 0; g < 8; g++) {
        uint8_t *tile = unit + 32 + 416 * g;
        tile[j] = blk->sc[2 * g];
        tile[16 + j] = blk->sc[2 * g + 1];
        put_codes(fmt, tile + 32, tile + 288, j, blk->u + 32 * g);
    }
}

/* Rows [row0, row0 + width) of a GGUF matrix (k inputs, row_bytes apart; width <= 16) as one packed strip at out
 * (kq_strip_bytes bytes); missing outputs are zero weights. Returns 0, or -1 for a bad format or size. */
int kq_pack_strip(int64_t fmt, const uint8_t *w, int64_t row_bytes, int64_t row0, int64_t width, int64_t k,
                  uint8_t *out) {
    const int64_t size = kq_strip_bytes(fmt, k);
    if (size < 0 || width < 1 || width > 16 || row_bytes != k / GGUF_BLOCK[fmt] * GGUF_BYTES[fmt]) return -1;
    memset(out, 0, (size_t)size);
    gguf_block blk;
    for (int64_t unit = 0; unit < k / UNIT_IN[fmt]; unit++)
        for (int j = 0; j < width; j++) {
            memset(&blk, 0, sizeof blk);
            unpack(fmt, w + (row0 + j) * row_bytes + unit * GGUF_BYTES[fmt], &blk);
            put_block(fmt, out + unit * UNIT_BYTES[fmt], j, &blk);
        }
    return 0;
}

typedef struct {
    int64_t fmt, row_bytes, n, k;
    const uint8_t *w;
    uint8_t *out;
} pack_job;

static void pack_strips(const void *arg, int64_t begin, int64_t end) {
    const pack_job *p = arg;
    const int64_t size = kq_strip_bytes(p->fmt, p->k);
    for (int64_t s = begin; s < end; s++) {
        const int64_t width = p->n - 16 * s < 16 ? p->n - 16 * s : 16;
        kq_pack_strip(p->fmt, p->w, p->row_bytes, 16 * s, width, p->k, p->out + s * size);
    }
}

/* Every row of a GGUF matrix (n rows) as ceil(n / 16) strips, one after the other, at out; on `threads` threads.
 * Returns 0, or -1 for a bad format or size. */
int kq_pack_matrix(int64_t fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *out,
                   int64_t threads) {
    if (kq_strip_bytes(fmt, k) < 0 || n < 1 || row_bytes != k / GGUF_BLOCK[fmt] * GGUF_BYTES[fmt]) return -1;
    pack_job p = {.fmt = fmt, .row_bytes = row_bytes, .n = n, .k = k, .w = w, .out = out};
    run_blocks(pack_strips, &p, (n + 15) / 16, threads);
    return 0;
}

/* ---- Activations. ---- */

/* A call's rows quantized, in groups of KQ_ROWS rows interleaved block by block, so that one block of every row of
 * a group is one run of bytes and each row's part sits at a fixed offset in it. */
typedef struct {
    int8_t *q;       /* [groups][k / 32][KQ_ROWS][32] codes */
    float *d, *sx;   /* [groups][k / 32][KQ_ROWS]: block scale, d · Σ q */
    int32_t *s;      /* [groups][k / 32][KQ_ROWS][3]: Σ q over the block's first 16, last 16, all 32 */
    void *buf;
} kq_act;

/* One group of rows: block b of row r is q + 256 b + 32 r, its scale d[8 b + r], its sums s + 24 b + 3 r. */
typedef struct {
    const int8_t *q;
    const float *d, *sx;
    const int32_t *s;
} kq_rows;

static kq_rows group_of(const kq_act *a, int64_t g, int64_t k) {
    const int64_t nb = k / 32;
    return (kq_rows){a->q + g * KQ_ROWS * k, a->d + g * KQ_ROWS * nb, a->sx + g * KQ_ROWS * nb,
                     a->s + g * KQ_ROWS * 3 * nb};
}

/* One block of 32 of a row: codes q = round-half-even(x · 127 / top) into q, their sums over each half into s;
 * returns top = max |x| (the SIMD forms round and sum as this loop does). */
static float quantize_block(const float *x, int8_t *q, int32_t *s) {
#if KQ_SIMD == 2
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    s[0] = _mm512_reduce_add_epi32(qa);
    s[1] = _mm512_reduce_add_epi32(qb);
    return top;
#else
    float top = 0.f;
    for (int i = 0; i < 32; i++) top = fmaxf(top, fabsf(x[i]));
    const float inv = top > 0.f ? 127.f / top : 0.f;
    s[0] = s[1] = 0;
    for (int i = 0; i < 32; i++) {
        q[i] = (int8_t)nearbyintf(x[i] * inv);
        s[i / 16] += q[i];
    }
    return top;
#endif
}

static int quantize_act(const float *x, int64_t rows, int64_t k, kq_act *a) {
    const int64_t nb = k / 32, padded = (rows + KQ_ROWS - 1) / KQ_ROWS * KQ_ROWS;
    a->buf = calloc((size_t)(padded * nb), 2 * sizeof(float) + 3 * sizeof(int32_t) + 32);
    if (!a->buf) return -1;
    a->d = a->buf;
    a->sx = a->d + padded * nb;
    a->s = (int32_t *)(a->sx + padded * nb);
    a->q = (int8_t *)(a->s + padded * nb * 3);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = (r / KQ_ROWS * nb + b) * KQ_ROWS + r % KQ_ROWS; /* (group, block, row) */
            int32_t *sums = a->s + 3 * at;
            a->d[at] = quantize_block(x + r * k + 32 * b, a->q + 32 * at, sums) / 127.f;
            sums[2] = sums[0] + sums[1];
            a->sx[at] = a->d[at] * (float)sums[2];
        }
    return 0;
}

/* ---- The plain-C form: output by output, the same integers and float operations as the SIMD forms. ---- */

/* Output j's code at input i of a tile's code vectors (Q8_0: the signed value's bits). */
static int code_at(int64_t fmt, const uint8_t *codes, const uint8_t *high, int j, int i) {
    const int v = i / 4, t = i % 4;
    if (fmt == KQ_Q8_0) return (int8_t)codes[64 * v + 4 * j + t];
    const uint8_t byte = codes[64 * (v % 4) + 4 * j + t];
    int u = v < 4 ? byte & 15 : byte >> 4;
    if (fmt == KQ_Q5_0) u |= ((high[4 * j + t] >> v) & 1) << 4;
    if (fmt == KQ_Q6_K) u |= ((high[64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3) << 4;
    return u;
}

/* Σ over inputs [lo, hi) of a tile of (code − offset) · q(x). */
static int32_t tile_dot(int64_t fmt, const uint8_t *codes, const uint8_t *high, int j, const int8_t *x, int lo,
                        int hi, int offset) {
    int32_t s = 0;
    for (int i = lo; i < hi; i++) s += (code_at(fmt, codes, high, j, i) - offset) * (int32_t)x[i];
    return s;
}

static void strip_plain(int64_t fmt, const kq_rows *a, int64_t nr, const uint8_t *w, int64_t k, float *out) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < nr; r++)
        for (int j = 0; j < 16; j++) {
            float acc = 0.f, mins = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t sb = b / 8, g = b % 8;
                const int8_t *x = a->q + 256 * b + 32 * r;
                const float dx = a->d[8 * b + r];
                if (fmt == KQ_Q8_0 || fmt == KQ_Q5_0) {
                    const uint8_t *tile = w + b * UNIT_BYTES[fmt];
                    const int32_t s = tile_dot(fmt, tile + 32, tile + 288, j, x, 0, 32, fmt == KQ_Q5_0 ? 16 : 0);
                    acc = fmaf((float)s, fp16(tile + 2 * j) * dx, acc);
                } else if (fmt == KQ_Q4_K) {
                    const uint8_t *unit = w + sb * UNIT_BYTES[fmt], *tile = unit + 64 + 288 * g;
                    const float a_ = fp16(unit + 2 * j) * (float)tile[j], b_ = fp16(unit + 32 + 2 * j) * (float)tile[16 + j];
                    acc = fmaf((float)tile_dot(fmt, tile + 32, NULL, j, x, 0, 32, 0), a_ * dx, acc);
                    mins = fmaf(-b_, a->sx[8 * b + r], mins);
                } else {
                    const uint8_t *unit = w + sb * UNIT_BYTES[fmt], *tile = unit + 32 + 416 * g;
                    const float d = fp16(unit + 2 * j);
                    for (int h = 0; h < 2; h++) {
                        const float a_ = d * (float)(int8_t)tile[16 * h + j];
                        const int32_t s = tile_dot(fmt, tile + 32, tile + 288, j, x, 16 * h, 16 * h + 16, 32);
                        acc = fmaf((float)s, a_ * dx, acc);
                    }
                }
            }
            out[16 * r + j] = fmt == KQ_Q4_K ? acc + mins : acc;
        }
}

#include "kquant_simd.h"

/* ---- Calls: strips over threads, rows in groups of KQ_ROWS. ---- */

typedef struct {
    const kq_act *a;
    const uint8_t *w;
    const int64_t *strips; /* [n_strips][4]: byte offset, format, first output, width */
    float *y;
    int64_t rows, k, n;
} kq_job;

static void kq_strips(const void *arg, int64_t begin, int64_t end) {
    const kq_job *g = arg;
    float out[16 * KQ_ROWS];
    for (int64_t s = begin; s < end; s++) {
        const int64_t *st = g->strips + 4 * s;
        for (int64_t r0 = 0; r0 < g->rows; r0 += KQ_ROWS) {
            const int64_t nr = g->rows - r0 < KQ_ROWS ? g->rows - r0 : KQ_ROWS;
            const kq_rows rows = group_of(g->a, r0 / KQ_ROWS, g->k);
#if KQ_SIMD
            strip_simd(st[1], &rows, nr, g->w + st[0], g->k, out);
#else
            strip_plain(st[1], &rows, nr, g->w + st[0], g->k, out);
#endif
            for (int64_t r = 0; r < nr; r++)
                memcpy(g->y + (r0 + r) * g->n + st[2], out + 16 * r, sizeof(float) * (size_t)st[3]);
        }
    }
}

/* y [rows, n] = x [rows, k] · Wᵀ for a matrix of n_strips packed strips (each its own format; outputs
 * [first, first + width) of y); on `threads` threads. Returns 0, or -1 where a buffer cannot be allocated. */
int kq_gemm(const float *x, const uint8_t *w, const int64_t *strips, float *y, int64_t rows, int64_t k,
            int64_t n_strips, int64_t n, int64_t threads) {
    kq_act a;
    if (quantize_act(x, rows, k, &a) != 0) return -1;
    kq_job g = {.a = &a, .w = w, .strips = strips, .y = y, .rows = rows, .k = k, .n = n};
    run_blocks(kq_strips, &g, n_strips, threads);
    free(a.buf);
    return 0;
}

/* The plain-C form of one call on this thread (for tests: the SIMD forms must give its floats). */
int kq_gemm_plain(const float *x, const uint8_t *w, const int64_t *strips, float *y, int64_t rows, int64_t k,
                  int64_t n_strips, int64_t n) {
    kq_act a;
    if (quantize_act(x, rows, k, &a) != 0) return -1;
    float out[16 * KQ_ROWS];
    for (int64_t s = 0; s < n_strips; s++) {
        const int64_t *st = strips + 4 * s;
        for (int64_t r0 = 0; r0 < rows; r0 += KQ_ROWS) {
            const int64_t nr = rows - r0 < KQ_ROWS ? rows - r0 : KQ_ROWS;
            const kq_rows group = group_of(&a, r0 / KQ_ROWS, k);
            strip_plain(st[1], &group, nr, w + st[0], k, out);
            for (int64_t r = 0; r < nr; r++)
                memcpy(y + (r0 + r) * n + st[2], out + 16 * r, sizeof(float) * (size_t)st[3]);
        }
    }
    free(a.buf);
    return 0;
}
