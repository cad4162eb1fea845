/* The whole decoder stack in one call, for runners whose every matrix is one of quant_gemm.c's (int4, and w8a8
 * without VNNI) over fp32 activations: for each layer, RMSNorm, the QKV matmul, RoPE + K/V store + attention
 * (decode_ops.c), the output matmul and its residual, RMSNorm, the gate/up matmul, SiLU-and-multiply, the down
 * matmul and its residual.
 *
 * Why. Called op by op from Python, a layer costs about 60 us of dispatch besides its arithmetic (ctypes, tensor
 * allocations, the matmul wrapper's checks): about 2 ms of a 13 ms int4 decode step over 30 layers. Here the loop is
 * in C and its buffers are allocated once per call.
 *
 * Exactness. The same functions run in the same order on the same fp32 buffers as the op-by-op path
 * (cpu_kernels.run_paged), and the residual adds and the bias add are single fp32 adds as torch's are: the hidden
 * states come out bit for bit the same (tested).
 */
#include <stdint.h>
#include <stdlib.h>

/* From decode_ops.c and quant_gemm.c (one library). */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps);
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t f);
void rope_store_attend_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos, float *pool,
                           const int64_t *write, const int64_t *kv, const uint8_t *mask, const int64_t *lens,
                           float *out, int64_t B, int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t D);
void w8a8_gemm(const float *x, const int8_t *w, const float *wscale, float *y, int64_t rows, int64_t k, int64_t n,
               int64_t threads);
void q4_gemm(const float *x, const uint8_t *codes, const uint16_t *scales, float *y, int64_t rows, int64_t k,
             int64_t n, int64_t threads);
int kq_gemm(const float *x, const uint8_t *w, const int64_t *strips, float *y, int64_t rows, int64_t k,
            int64_t n_strips, int64_t n, int64_t threads);

/* One packed matrix: kind 0 is w8a8 (w: int8 codes, s: fp32 scales), kind 1 is q4 (w: codes, s: fp16 d and m),
 * kind 2 a GGUF matrix in its own formats (w: packed strips, s: the strip table of `strips` entries). */
typedef struct {
    const void *w, *s;
    int64_t kind, in, out, strips;
} qmat;

/* One layer's weights; qkv_bias may be NULL. Mirrors cpu_kernels.QLayer. */
typedef struct {
    const float *ln_attn, *ln_mlp, *qkv_bias;
    qmat qkv, o, gate_up, down;
} qlayer;

static int mat_mul(const qmat *m, const float *x, float *y, int64_t rows, int64_t threads) {
    if (m->kind == 0)
        w8a8_gemm(x, m->w, m->s, y, rows, m->in, m->out, threads);
    else if (m->kind == 1)
        q4_gemm(x, m->w, m->s, y, rows, m->in, m->out, threads);
    else
        return kq_gemm(x, m->w, m->s, y, rows, m->in, m->strips, m->out, threads);
    return 0;
}

static void add_rows(float *restrict h, const float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] += y[i];
}

/* h [n, hidden] in place: every layer of `layers` over the new tokens (positions `pos`, K/V written at `write` in
 * the pool, each layer's pool `pool_stride` floats after the last; `kv` [B, S] the slots each row attends, `mask`
 * [B, T, S] or NULL; `lens` NULL, n = B·T, or the ragged rows' token counts, n = their sum, as in decode_ops.c),
 * the matmuls on `threads` threads. Returns 0, or -1 where a buffer cannot be allocated. */
int decoder_layers_f32(float *h, const qlayer *layers, int64_t n_layers, float eps, const float *cos,
                       const float *sin, const int64_t *pos, float *pool, int64_t pool_stride, const int64_t *write,
                       const int64_t *kv, const uint8_t *mask, const int64_t *lens, int64_t B, int64_t T, int64_t S,
                       int64_t H, int64_t KVH, int64_t D, int64_t threads) {
    if (n_layers == 0) return 0;
    int64_t n = B * T;
    if (lens)
        for (int64_t b = n = 0; b < B; b++) n += lens[b];
    const int64_t hidden = layers[0].qkv.in, ff = layers[0].down.in, width = layers[0].qkv.out;
    const int64_t wide = width > 2 * ff ? width : 2 * ff;
    float *buf = malloc(sizeof(float) * (size_t)(n * (hidden + wide + H * D + hidden + ff)));
    if (!buf) return -1;
    float *normed = buf, *wide_out = normed + n * hidden, *attn = wide_out + n * wide, *y = attn + n * H * D;
    float *act = y + n * hidden;
    int rc = 0;
    for (int64_t li = 0; li < n_layers && rc == 0; li++) {
        const qlayer *l = layers + li;
        rms_norm_f32(h, l->ln_attn, normed, n, hidden, eps);
        rc |= mat_mul(&l->qkv, normed, wide_out, n, threads);
        if (l->qkv_bias)
            for (int64_t r = 0; r < n; r++) add_rows(wide_out + r * width, l->qkv_bias, width);
        rope_store_attend_f32(wide_out, cos, sin, pos, pool + li * pool_stride, write, kv, mask, lens, attn, B, T,
                              S, H, KVH, D);
        rc |= mat_mul(&l->o, attn, y, n, threads);
        add_rows(h, y, n * hidden);
        rms_norm_f32(h, l->ln_mlp, normed, n, hidden, eps);
        rc |= mat_mul(&l->gate_up, normed, wide_out, n, threads);
        silu_mul_f32(wide_out, act, n, ff);
        rc |= mat_mul(&l->down, act, y, n, threads);
        add_rows(h, y, n * hidden);
    }
    free(buf);
    return rc ? -1 : 0;
}
