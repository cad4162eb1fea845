/* kquant_gemm.c's SIMD forms: one strip of 16 outputs against nr <= KQ_ROWS rows, into out[nr][16]. Each tile's
 * codes are decoded once into 8 vectors of unsigned bytes (16 outputs × 4 inputs) and dotted with every row. The
 * integers and the float operations are the plain-C form's (strip_plain), in its order.
 *
 * AVX-512 VNNI: one vpdpbusd (unsigned codes × signed activations, summed 4 at a time into 16 int32 lanes) per
 * vector and row. A code offset o (Q8_0's 128, Q5_0's 16, Q6_K's 32) enters as the sums' start, −o · Σ q(x).
 * AVX2: the same dot products 8 outputs at a time (the strip in two halves) with vpmaddubsw: codes of at most 63
 * times 127 sum in pairs well within int16; Q8_0 multiplies |q| by q(x) with q's sign (vpsignb), as llama.cpp does.
 */
#define KQ_INLINE static inline __attribute__((always_inline))
#ifndef W_PREFETCH
#define W_PREFETCH 2048
#endif
/* Software prefetch W_PREFETCH bytes ahead, in calls of at least `rows` rows. Q4_K decodes fast enough for one or
 * two rows to keep pace with the hardware prefetchers alone (its prefetches slowed those by 5-10%), so it prefetches
 * from 3 rows on (5 rows over 335 MB: 27 -> 22 ms); the other formats' decoding holds the stream back at one row
 * already (Q6_K, one row over 339 MB: 21 -> 17 ms). */
#define KQ_PREFETCH(nr, rows) (W_PREFETCH && (nr) >= (rows))

#if KQ_SIMD == 2

/* 4 bytes read as one int32 (an unaligned, aliasing load the compiler may fold into its user as a broadcast). */
typedef int32_t __attribute__((may_alias, aligned(1))) kq_i32;

KQ_INLINE __m512i bc4(const int8_t *x) { return _mm512_set1_epi32(*(const kq_i32 *)x); }

/* s + u · (4 bytes of x broadcast), the broadcast folded into the instruction's memory operand (compilers keep it a
 * separate instruction). */
KQ_INLINE __m512i dpbusd_bc(__m512i s, __m512i u, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(u), "m"(*(const kq_i32 *)x));
    return s;
}

/* Σ over vectors u[0..3] of u · q(x) (inputs x[0..16)), from s. */
KQ_INLINE __m512i dot4(__m512i s, const __m512i *u, const int8_t *x) {
    s = dpbusd_bc(s, u[0], x);
    s = dpbusd_bc(s, u[1], x + 4);
    s = dpbusd_bc(s, u[2], x + 8);
    return dpbusd_bc(s, u[3], x + 12);
}

KQ_INLINE void nibbles(const uint8_t *p, __m512i u[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * i);
        u[i] = _mm512_and_si512(v, low);
        u[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

/* v shifted left by s bits (right by −s) in 16-bit lanes; the caller masks each byte's bits it wants. */
KQ_INLINE __m512i shift(__m512i v, int s) { return s >= 0 ? _mm512_slli_epi16(v, s) : _mm512_srli_epi16(v, -s); }

/* u | (h & mask) */
KQ_INLINE __m512i merge(__m512i u, __m512i h, __m512i mask) { return _mm512_ternarylogic_epi32(u, h, mask, 0xF8); }

KQ_INLINE __m512 u8_ps(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
KQ_INLINE __m512 i8_ps(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
KQ_INLINE __m512 h16_ps(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Q8_0 and Q5_0: a tile of 32 inputs, d per output. */
KQ_INLINE void strip_32(int64_t fmt, const kq_rows *a, const int nr, const uint8_t *w, int64_t k,
                        float *out) {
    const int64_t nb = k / 32, unit = fmt == KQ_Q8_0 ? 544 : 352;
    const int off = fmt == KQ_Q8_0 ? 128 : 16;
    __m512 acc[KQ_ROWS];
    __m512i u[8];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += unit) {
        for (int l = 0; KQ_PREFETCH(nr, 1) && l < unit; l += 64) _mm_prefetch((const char *)w + W_PREFETCH + l, _MM_HINT_T0);
        const __m512 d = h16_ps(w);
        if (fmt == KQ_Q8_0) {
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            for (int i = 0; i < 8; i++) u[i] = _mm512_xor_si512(_mm512_loadu_si512(w + 32 + 64 * i), flip);
        } else {
            const __m512i hb = _mm512_loadu_si512(w + 288), m10 = _mm512_set1_epi8(0x10);
            nibbles(w + 32, u);
            for (int i = 0; i < 8; i++) u[i] = merge(u[i], shift(hb, 4 - i), m10);
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            const int64_t at = 8 * b + r;
            const int8_t *x = a->q + 256 * b + 32 * r;
            const __m512i start = _mm512_set1_epi32(-off * a->s[3 * at + 2]);
            const __m512i s = _mm512_add_epi32(dot4(start, u, x), dot4(_mm512_setzero_si512(), u + 4, x + 16));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a->d[at])), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

KQ_INLINE void strip_q4k(const kq_rows *a, const int nr, const uint8_t *w, int64_t k, float *out) {
    __m512 acc[KQ_ROWS], mins[KQ_ROWS];
    __m512i u[8];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; sb++, w += 2368) {
        const __m512 d = h16_ps(w), dmin = h16_ps(w + 32);
        for (int g = 0; g < 8; g++) {
            const uint8_t *t = w + 64 + 288 * g;
            for (int l = 0; KQ_PREFETCH(nr, 3) && l < 288; l += 64) _mm_prefetch((const char *)t + W_PREFETCH + l, _MM_HINT_T0);
            const int64_t b = 8 * sb + g;
            const __m512 sc = _mm512_mul_ps(d, u8_ps(t)), bm = _mm512_mul_ps(dmin, u8_ps(t + 16));
            nibbles(t + 32, u);
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                const int64_t at = 8 * b + r;
                const int8_t *x = a->q + 256 * b + 32 * r;
                const __m512i zero = _mm512_setzero_si512();
                const __m512i s = _mm512_add_epi32(dot4(zero, u, x), dot4(zero, u + 4, x + 16));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sc, _mm512_set1_ps(a->d[at])), acc[r]);
                mins[r] = _mm512_fnmadd_ps(bm, _mm512_set1_ps(a->sx[at]), mins[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], mins[r]));
}

KQ_INLINE void strip_q6k(const kq_rows *a, const int nr, const uint8_t *w, int64_t k, float *out) {
    const __m512i m30 = _mm512_set1_epi8(0x30);
    __m512 acc[KQ_ROWS];
    __m512i u[8];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; sb++, w += 3360) {
        const __m512 d = h16_ps(w);
        for (int g = 0; g < 8; g++) {
            const uint8_t *t = w + 32 + 416 * g;
            for (int l = 0; KQ_PREFETCH(nr, 1) && l < 416; l += 64) _mm_prefetch((const char *)t + W_PREFETCH + l, _MM_HINT_T0);
            const int64_t b = 8 * sb + g;
            const __m512 sc0 = _mm512_mul_ps(d, i8_ps(t)), sc1 = _mm512_mul_ps(d, i8_ps(t + 16));
            nibbles(t + 32, u);
            for (int h = 0; h < 2; h++) {
                const __m512i hi = _mm512_loadu_si512(t + 288 + 64 * h);
                for (int s = 0; s < 4; s++) u[4 * h + s] = merge(u[4 * h + s], shift(hi, 4 - 2 * s), m30);
            }
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                const int64_t at = 8 * b + r;
                const int8_t *x = a->q + 256 * b + 32 * r;
                const __m512 dx = _mm512_set1_ps(a->d[at]);
                const __m512i s0 = dot4(_mm512_set1_epi32(-32 * a->s[3 * at]), u, x);
                const __m512i s1 = dot4(_mm512_set1_epi32(-32 * a->s[3 * at + 1]), u + 4, x + 16);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(sc0, dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(sc1, dx), acc[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

KQ_INLINE void strip_fmt(int64_t fmt, const kq_rows *a, const int nr, const uint8_t *w, int64_t k,
                         float *out) {
    if (fmt == KQ_Q4_K) strip_q4k(a, nr, w, k, out);
    else if (fmt == KQ_Q6_K) strip_q6k(a, nr, w, k, out);
    else if (fmt == KQ_Q8_0) strip_32(KQ_Q8_0, a, nr, w, k, out);
    else strip_32(KQ_Q5_0, a, nr, w, k, out);
}

#elif KQ_SIMD == 1

KQ_INLINE __m256i bc4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* Σ over vectors u[0..3] (codes <= 63) of u · q(x), inputs x[0..16): pairs of products summed in int16. */
KQ_INLINE __m256i dot4(const __m256i *u, const int8_t *x) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], bc4(x)), _mm256_maddubs_epi16(u[1], bc4(x + 4)));
    const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], bc4(x + 8)), _mm256_maddubs_epi16(u[3], bc4(x + 12)));
    return _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_madd_epi16(q, ones));
}

/* Q8_0: Σ over 8 vectors of signed codes q (magnitudes mag) of q · q(x), inputs x[0..32). */
KQ_INLINE __m256i dot8_signed(const __m256i *q, const __m256i *mag, const int8_t *x) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[i], _mm256_sign_epi8(bc4(x + 4 * i), q[i])), ones));
    return s;
}

/* Half h of a tile's nibble vectors (each 64-byte vector's bytes [32h, 32h + 32): outputs 8h..8h + 7). */
KQ_INLINE void nibbles(const uint8_t *p, int h, __m256i u[8]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < 4; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
        u[i] = _mm256_and_si256(v, low);
        u[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

KQ_INLINE __m256i shift(__m256i v, int s) { return s >= 0 ? _mm256_slli_epi16(v, s) : _mm256_srli_epi16(v, -s); }
KQ_INLINE __m256i merge(__m256i u, __m256i h, __m256i mask) { return _mm256_or_si256(u, _mm256_and_si256(h, mask)); }
KQ_INLINE __m256 u8_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
KQ_INLINE __m256 i8_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
KQ_INLINE __m256 h16_ps(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

KQ_INLINE void strip_32(int64_t fmt, const kq_rows *a, const int nr, const uint8_t *w0, int64_t k,
                        float *out) {
    const int64_t nb = k / 32, unit = fmt == KQ_Q8_0 ? 544 : 352;
    for (int h = 0; h < 2; h++) {
        const uint8_t *w = w0;
        __m256 acc[KQ_ROWS];
        __m256i u[8], mag[8];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, w += unit) {
            if (h == 0)
                for (int l = 0; KQ_PREFETCH(nr, 1) && l < unit; l += 64) _mm_prefetch((const char *)w + W_PREFETCH + l, _MM_HINT_T0);
            const __m256 d = h16_ps(w + 16 * h);
            if (fmt == KQ_Q8_0) {
                for (int i = 0; i < 8; i++) {
                    u[i] = _mm256_loadu_si256((const __m256i *)(w + 32 + 64 * i + 32 * h));
                    mag[i] = _mm256_abs_epi8(u[i]);
                }
            } else {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 288 + 32 * h)), m10 = _mm256_set1_epi8(0x10);
                nibbles(w + 32, h, u);
                for (int i = 0; i < 8; i++) u[i] = merge(u[i], shift(hb, 4 - i), m10);
            }
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                const int64_t at = 8 * b + r;
                const int8_t *x = a->q + 256 * b + 32 * r;
                __m256i s;
                if (fmt == KQ_Q8_0) {
                    s = dot8_signed(u, mag, x);
                } else {
                    s = _mm256_add_epi32(dot4(u, x), dot4(u + 4, x + 16));
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * a->s[3 * at + 2]));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a->d[at])), acc[r]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, acc[r]);
    }
}

KQ_INLINE void strip_q4k(const kq_rows *a, const int nr, const uint8_t *w0, int64_t k, float *out) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *w = w0;
        __m256 acc[KQ_ROWS], mins[KQ_ROWS];
        __m256i u[8];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = mins[r] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < k / 256; sb++, w += 2368) {
            const __m256 d = h16_ps(w + 16 * h), dmin = h16_ps(w + 32 + 16 * h);
            for (int g = 0; g < 8; g++) {
                const uint8_t *t = w + 64 + 288 * g;
                if (h == 0)
                    for (int l = 0; KQ_PREFETCH(nr, 3) && l < 288; l += 64) _mm_prefetch((const char *)t + W_PREFETCH + l, _MM_HINT_T0);
                const int64_t b = 8 * sb + g;
                const __m256 sc = _mm256_mul_ps(d, u8_ps(t + 8 * h)), bm = _mm256_mul_ps(dmin, u8_ps(t + 16 + 8 * h));
                nibbles(t + 32, h, u);
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    const int64_t at = 8 * b + r;
                    const int8_t *x = a->q + 256 * b + 32 * r;
                    const __m256i s = _mm256_add_epi32(dot4(u, x), dot4(u + 4, x + 16));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sc, _mm256_set1_ps(a->d[at])), acc[r]);
                    mins[r] = _mm256_fnmadd_ps(bm, _mm256_set1_ps(a->sx[at]), mins[r]);
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, _mm256_add_ps(acc[r], mins[r]));
    }
}

KQ_INLINE void strip_q6k(const kq_rows *a, const int nr, const uint8_t *w0, int64_t k, float *out) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const uint8_t *w = w0;
        __m256 acc[KQ_ROWS];
        __m256i u[8];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < k / 256; sb++, w += 3360) {
            const __m256 d = h16_ps(w + 16 * h);
            for (int g = 0; g < 8; g++) {
                const uint8_t *t = w + 32 + 416 * g;
                if (h == 0)
                    for (int l = 0; KQ_PREFETCH(nr, 1) && l < 416; l += 64) _mm_prefetch((const char *)t + W_PREFETCH + l, _MM_HINT_T0);
                const int64_t b = 8 * sb + g;
                const __m256 sc0 = _mm256_mul_ps(d, i8_ps(t + 8 * h)), sc1 = _mm256_mul_ps(d, i8_ps(t + 16 + 8 * h));
                nibbles(t + 32, h, u);
                for (int v = 0; v < 2; v++) {
                    const __m256i hi = _mm256_loadu_si256((const __m256i *)(t + 288 + 64 * v + 32 * h));
                    for (int s = 0; s < 4; s++) u[4 * v + s] = merge(u[4 * v + s], shift(hi, 4 - 2 * s), m30);
                }
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    const int64_t at = 8 * b + r;
                    const int8_t *x = a->q + 256 * b + 32 * r;
                    const __m256 dx = _mm256_set1_ps(a->d[at]);
                    const __m256i s0 = _mm256_sub_epi32(dot4(u, x), _mm256_set1_epi32(32 * a->s[3 * at]));
                    const __m256i s1 = _mm256_sub_epi32(dot4(u + 4, x + 16), _mm256_set1_epi32(32 * a->s[3 * at + 1]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(sc0, dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(sc1, dx), acc[r]);
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, acc[r]);
    }
}

KQ_INLINE void strip_fmt(int64_t fmt, const kq_rows *a, const int nr, const uint8_t *w, int64_t k,
                         float *out) {
    if (fmt == KQ_Q4_K) strip_q4k(a, nr, w, k, out);
    else if (fmt == KQ_Q6_K) strip_q6k(a, nr, w, k, out);
    else if (fmt == KQ_Q8_0) strip_32(KQ_Q8_0, a, nr, w, k, out);
    else strip_32(KQ_Q5_0, a, nr, w, k, out);
}

#endif

#if KQ_SIMD
/* One strip against nr rows, with nr a constant in each case (the rows' sums stay in registers). */
static void strip_simd(int64_t fmt, const kq_rows *a, int64_t nr, const uint8_t *w, int64_t k, float *out) {
    switch (nr) {
    case 1: strip_fmt(fmt, a, 1, w, k, out); break;
    case 2: strip_fmt(fmt, a, 2, w, k, out); break;
    case 3: strip_fmt(fmt, a, 3, w, k, out); break;
    case 4: strip_fmt(fmt, a, 4, w, k, out); break;
    case 5: strip_fmt(fmt, a, 5, w, k, out); break;
    case 6: strip_fmt(fmt, a, 6, w, k, out); break;
    case 7: strip_fmt(fmt, a, 7, w, k, out); break;
    default: strip_fmt(fmt, a, 8, w, k, out); break;
    }
}
#endif
