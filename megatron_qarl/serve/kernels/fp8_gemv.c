/* W8A8-FP8 (block-quantized e4m3 weights, per-token-group e4m3 activations) GEMM for the embedded engine's
 * decode (one token or a few): megatron_qarl/serve/kernels/native.py builds it with the other kernels.
 *
 * SGLang's block-FP8 GEMM (w8a8_block_fp8_matmul: per K block of B, the fp32 dot of the codes, times the
 * activation's scale, times the weight's, added to an fp32 accumulator):
 *
 *   y[t, col_r + n] = sum over blocks b of  ((sum_{k in b} qx[t, k] * qw_r[n, k]) * sx[t, b]) * sw_r[n / B, b]
 *
 * for every activation row t through every linear r (diag = 0), or row t = r through linear r (diag = 1).
 * qx, sx: the activation quantized per token and group of B here, by quant_group (the learner's
 * quant_act_fp8_per_token_group, bit for bit); qw_r: the checkpoint's float8_e4m3fn codes [N_r, K] read in place
 * as bytes; sw_r: its fp32 weight_scale_inv [ceil(N_r / B), K / B]. K must be a multiple of B and B of 16.
 *
 * A weight code w becomes fp32 through F16C: the byte shifted into a 16-bit word, sign at bit 15 and the 7
 * other bits at bits 7-13, is the fp16 number w / 256 (normal and subnormal codes alike: e4m3's exponent
 * field and mantissa land on fp16's, bias 7 vs 15), and vcvtph2ps widens it exactly. (The NaN codes 0x7f and
 * 0xff, which the quantizer never writes, would read as 480 / 256.) Products of two e4m3 values are exact in
 * fp32, so each block's dot carries the factor 2^-8 exactly; it is multiplied back by 256 (exact) before the
 * scales.
 *
 * The order of the fp32 additions is fixed and the same in every implementation (AVX-512, AVX2, plain C), so
 * they give the same bits, and a row's result does not depend on how many rows the call has: per row and
 * block, 16 lanes, lane i of chunk c (16 values) adds the product at k = 16c + i into accumulator c mod 2;
 * the block's dot is the 16 lanes of the two accumulators' sum added in the tree of qarl_simd.h's hsum16.
 * out is fp32 or bf16 (round to nearest even), row t at out + t * ld.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qarl_bf16.h"
#include "qarl_simd.h"

#define TOKENS 64 /* activation rows per pass over a block of weight rows */

/* fp32 -> the nearest float8_e4m3fn value (round half to even), as an fp32 number; |v| <= 448 or NaN. Below
 * 2^-6 (e4m3's subnormals, steps of 2^-9): v + 2^14 rounds to a multiple of 2^-9 in fp32 (its ulp there), and
 * subtracting 2^14 is exact. From 2^-6: the fp32 mantissa rounded to 3 bits on its bit pattern (a carry moves
 * into the exponent, as it should). No libm calls: this runs on every activation element. */
static inline float e4m3_round(float v) {
    uint32_t u, a;
    memcpy(&u, &v, 4);
    a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return v; /* NaN */
    if (a < 0x3c800000u) {         /* |v| < 2^-6 */
        float f;
        memcpy(&f, &a, 4);
        f = (f + 16384.0f) - 16384.0f;
        memcpy(&a, &f, 4);
    } else {
        a = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    }
    u = (u & 0x80000000u) | a;
    memcpy(&v, &u, 4);
    return v;
}

/* The learner's quant_act_fp8_per_token_group (megatron_qarl/qat/quantizer.py), op for op in fp32, per group
 * of B:  a = max(max_k |x_k|, 1e-10);  inv = 448 / a;  q_k = e4m3(clamp(x_k * inv, -448, 448));
 * s = a * fp32(1 / 448). Writes q as fp32 values. Built with -ffp-contract=off. */
static void quant_group(const void *x, int x_bf16, int64_t B, float *q, float *s) {
    const float a = qarl_amax_floor(x, x_bf16, B);
    const float inv = 448.0f / a;
    for (int64_t k = 0; k < B; k++) {
        float v = qarl_at(x, x_bf16, k) * inv;
        v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v; /* NaN stays NaN, as torch's clamp */
        q[k] = e4m3_round(v);
    }
    *s = a * (float)(1.0 / 448.0);
}

#if QARL_X86
/* quant_group, 8 values at a time (B a multiple of 8; the same operations, so the same codes and scale). */
QARL_AVX2 static void quant_group_avx2(const void *x, int x_bf16, int64_t B, float *q, float *s) {
    float a = amax_avx2(x, x_bf16, B);
    a = a < 1e-10f ? 1e-10f : a;
    const __m256 inv = _mm256_set1_ps(448.0f / a), lo = _mm256_set1_ps(-448.0f), hi = _mm256_set1_ps(448.0f);
    const __m256 m14 = _mm256_set1_ps(16384.0f);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), sub_max = _mm256_set1_epi32(0x3c800000);
    const __m256i nan_min = _mm256_set1_epi32(0x7f800000), one = _mm256_set1_epi32(1);
    for (int64_t k = 0; k < B; k += 8) {
        __m256 v = _mm256_mul_ps(load8_f32(x, x_bf16, k), inv);
        v = _mm256_min_ps(hi, _mm256_max_ps(lo, v)); /* NaN (the second operand) stays NaN */
        __m256i u = _mm256_castps_si256(v), a32 = _mm256_and_si256(u, abs_mask);
        __m256 f = _mm256_castsi256_ps(a32);
        __m256i sub = _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(f, m14), m14));
        __m256i nrm = _mm256_add_epi32(a32, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff),
                                                             _mm256_and_si256(_mm256_srli_epi32(a32, 20), one)));
        nrm = _mm256_and_si256(nrm, _mm256_set1_epi32((int)0xfff00000u));
        __m256i r = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(sub_max, a32));
        r = _mm256_or_si256(r, _mm256_andnot_si256(abs_mask, u));
        r = _mm256_blendv_epi8(r, u, _mm256_cmpgt_epi32(a32, nan_min)); /* NaN */
        _mm256_storeu_ps(q + k, _mm256_castsi256_ps(r));
    }
    *s = a * (float)(1.0 / 448.0);
}
#endif

/* isa: QARL_ISA_PLAIN for the C loop, else the AVX2 one where B allows (the same results). */
int qarl_quant_fp8(int isa, const void *x, int x_bf16, int64_t T, int64_t K, int64_t B, float *q, float *s) {
    if (T <= 0 || K <= 0 || B <= 0 || K % B) return -1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < K / B; b++) {
            const void *xg = (const char *)x + (t * K + b * B) * (x_bf16 ? 2 : 4);
#if QARL_X86
            if (isa != QARL_ISA_PLAIN && B % 8 == 0) {
                quant_group_avx2(xg, x_bf16, B, q + t * K + b * B, s + t * (K / B) + b);
                continue;
            }
#endif
            (void)isa;
            quant_group(xg, x_bf16, B, q + t * K + b * B, s + t * (K / B) + b);
        }
    return 0;
}

/* Applies one block's dot to the row's running sum, in SGLang's order. */
static inline float add_block(float y, float dot, float sx, float sw) { return y + ((dot * 256.0f) * sx) * sw; }

#if QARL_X86
/* Codes in the high byte of 16-bit words -> the fp16 numbers w / 256 (sign kept at bit 15, the rest shifted
 * down one bit to bits 7-13). */
QARL_AVX2 static inline __m256i e4m3_words(__m256i hi_bytes) {
    return _mm256_and_si256(_mm256_srai_epi16(hi_bytes, 1), _mm256_set1_epi16((short)0xBF80));
}

/* 16 weight codes -> fp16 w / 256, lanes 0-15 in order. */
QARL_AVX2 static inline __m256i e4m3_halfs(const uint8_t *w) {
    return e4m3_words(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w)), 8));
}

/* m (1 or 2, a constant where inlined) activation rows against one weight row. Chunks go in pairs (even into
 * e, odd into o) so that no branch picks the accumulator, and 2 rows keep all 8 accumulators in registers. */
QARL_AVX2 static inline __attribute__((always_inline)) void tile_avx2(const float *X, const float *SX, int64_t K,
                                                                       int64_t B, const uint8_t *w, const float *sw,
                                                                       const int m, float *y, int64_t ys) {
    float acc[2] = {0.0f, 0.0f};
    for (int64_t b = 0; b < K / B; b++) {
        __m256 e[2][2], o[2][2]; /* [token][lanes 0-7 / 8-15] */
        for (int j = 0; j < m; j++) e[j][0] = e[j][1] = o[j][0] = o[j][1] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 2 <= B / 16; c += 2) { /* 32 codes: unpacking with zero bytes interleaves the 128-bit halves */
            const int64_t k = b * B + c * 16;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k)), z = _mm256_setzero_si256();
            const __m256i l = e4m3_words(_mm256_unpacklo_epi8(z, v)), h = e4m3_words(_mm256_unpackhi_epi8(z, v));
            const __m256 c0 = _mm256_cvtph_ps(_mm256_castsi256_si128(l));      /* codes 0-7: chunk c, lanes 0-7 */
            const __m256 c1 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));      /* codes 8-15: lanes 8-15 */
            const __m256 c2 = _mm256_cvtph_ps(_mm256_extracti128_si256(l, 1)); /* codes 16-23: chunk c + 1 */
            const __m256 c3 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)); /* codes 24-31 */
            for (int j = 0; j < m; j++) {
                const float *xk = X + j * K + k;
                e[j][0] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xk), e[j][0]);
                e[j][1] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xk + 8), e[j][1]);
                o[j][0] = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xk + 16), o[j][0]);
                o[j][1] = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xk + 24), o[j][1]);
            }
        }
        if (c < B / 16) { /* an odd count of chunks: the last one is even */
            const int64_t k = b * B + c * 16;
            const __m256i h0 = e4m3_halfs(w + k);
            const __m256 lo0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h0));
            const __m256 hi0 = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
            for (int j = 0; j < m; j++) {
                e[j][0] = _mm256_fmadd_ps(lo0, _mm256_loadu_ps(X + j * K + k), e[j][0]);
                e[j][1] = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(X + j * K + k + 8), e[j][1]);
            }
        }
        for (int j = 0; j < m; j++) {
            float dot = hsum16_avx2(_mm256_add_ps(e[j][0], o[j][0]), _mm256_add_ps(e[j][1], o[j][1]));
            acc[j] = add_block(acc[j], dot, SX[j * (K / B) + b], sw[b]);
        }
    }
    for (int j = 0; j < m; j++) y[j * ys] = acc[j];
}

QARL_AVX2 static void block_avx2(const float *X, const float *SX, int64_t nt, int64_t K, int64_t B, const uint8_t *w,
                                 const float *sw, int64_t row0, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *wi = w + i * K;
        const float *swi = sw + ((row0 + i) / B) * (K / B);
        for (int64_t t = 0; t < nt; t += 2) {
            const float *xt = X + t * K, *st = SX + t * (K / B);
            if (nt - t >= 2)
                tile_avx2(xt, st, K, B, wi, swi, 2, y + i * nt + t, 1);
            else
                tile_avx2(xt, st, K, B, wi, swi, 1, y + i * nt + t, 1);
        }
    }
}

/* The same lanes in one zmm: up to 4 activation rows per weight conversion. */
QARL_AVX512 static inline __attribute__((always_inline)) void tile_avx512(const float *X, const float *SX,
                                                                           int64_t K, int64_t B, const uint8_t *w,
                                                                           const float *sw, const int m, float *y,
                                                                           int64_t ys) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < K / B; b++) {
        __m512 e[4], o[4];
        for (int j = 0; j < m; j++) e[j] = o[j] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 2 <= B / 16; c += 2) {
            const int64_t k = b * B + c * 16;
            const __m512 v0 = _mm512_cvtph_ps(e4m3_halfs(w + k)), v1 = _mm512_cvtph_ps(e4m3_halfs(w + k + 16));
            for (int j = 0; j < m; j++) {
                e[j] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(X + j * K + k), e[j]);
                o[j] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(X + j * K + k + 16), o[j]);
            }
        }
        if (c < B / 16) {
            const int64_t k = b * B + c * 16;
            const __m512 v0 = _mm512_cvtph_ps(e4m3_halfs(w + k));
            for (int j = 0; j < m; j++) e[j] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(X + j * K + k), e[j]);
        }
        for (int j = 0; j < m; j++)
            acc[j] = add_block(acc[j], hsum16_avx512(_mm512_add_ps(e[j], o[j])), SX[j * (K / B) + b], sw[b]);
    }
    for (int j = 0; j < m; j++) y[j * ys] = acc[j];
}

QARL_AVX512 static void block_avx512(const float *X, const float *SX, int64_t nt, int64_t K, int64_t B,
                                     const uint8_t *w, const float *sw, int64_t row0, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *wi = w + i * K;
        const float *swi = sw + ((row0 + i) / B) * (K / B);
        for (int64_t t = 0; t < nt; t += 4) {
            const float *xt = X + t * K, *st = SX + t * (K / B);
            float *yt = y + i * nt + t;
            switch (nt - t < 4 ? nt - t : 4) {
            case 1: tile_avx512(xt, st, K, B, wi, swi, 1, yt, 1); break;
            case 2: tile_avx512(xt, st, K, B, wi, swi, 2, yt, 1); break;
            case 3: tile_avx512(xt, st, K, B, wi, swi, 3, yt, 1); break;
            default: tile_avx512(xt, st, K, B, wi, swi, 4, yt, 1); break;
            }
        }
    }
}
#endif

/* e4m3 code -> its value / 256 (fp32), as F16C reads the shifted byte. */
static float e4m3_scaled(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = e ? ldexpf((float)(8 + m), e - 7 - 3 - 8) : ldexpf((float)m, -9 - 8);
    return c & 0x80 ? -v : v;
}

static void block_plain(const float *X, const float *SX, int64_t nt, int64_t K, int64_t B, const uint8_t *w,
                        const float *sw, int64_t row0, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows; i++) {
        const float *swi = sw + ((row0 + i) / B) * (K / B);
        for (int64_t t = 0; t < nt; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < K / B; b++) {
                float lanes[2][16] = {{0}};
                for (int64_t c = 0; c < B / 16; c++)
                    for (int l = 0; l < 16; l++) {
                        const int64_t k = b * B + c * 16 + l;
                        lanes[c & 1][l] += e4m3_scaled(w[i * K + k]) * X[t * K + k];
                    }
                float v[16], h[8], q[4];
                for (int l = 0; l < 16; l++) v[l] = lanes[0][l] + lanes[1][l];
                for (int l = 0; l < 8; l++) h[l] = v[8 + l] + v[l];
                for (int l = 0; l < 4; l++) q[l] = h[4 + l] + h[l];
                acc = add_block(acc, (q[0] + q[2]) + (q[1] + q[3]), SX[t * (K / B) + b], swi[b]);
            }
            y[i * nt + t] = acc;
        }
    }
}

typedef void (*block_fn)(const float *, const float *, int64_t, int64_t, int64_t, const uint8_t *, const float *,
                         int64_t, int64_t, float *);

/* Returns 0; -1 on a shape the caller should not have passed; -2 out of memory; -3 an instruction set this
 * build lacks. */
int qarl_fp8_gemm(int isa, const void *x, int x_bf16, int64_t T, int64_t K, int64_t B, const uint8_t *const *w,
                  const float *const *sw, const int64_t *n, const int64_t *col, int64_t R, int diag, void *out,
                  int64_t ld, int out_bf16, int threads) {
    if (qarl_check(T, K, n, R, diag) || B <= 0 || B % 16 || K % B) return -1;
    block_fn fn = block_plain;
    QARL_PICK(isa, fn, block_avx512, block_avx2);
    float *X = (float *)malloc(sizeof(float) * (size_t)(T * K));
    float *SX = (float *)malloc(sizeof(float) * (size_t)(T * (K / B)));
    if (X == NULL || SX == NULL) {
        free(X);
        free(SX);
        return -2;
    }
    qarl_quant_fp8(isa, x, x_bf16, T, K, B, X, SX);
    const int64_t total = qarl_items(n, R);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < total; item++) {
        int64_t r, row0, rows, t0, t1;
        qarl_item(n, R, diag, T, item, &r, &row0, &rows, &t0, &t1);
        float y[QARL_ROWS * TOKENS];
        for (int64_t tb = t0; tb < t1; tb += TOKENS) {
            const int64_t nt = t1 - tb < TOKENS ? t1 - tb : TOKENS;
            fn(X + tb * K, SX + tb * (K / B), nt, K, B, w[r] + row0 * K, sw[r], row0, rows, y);
            qarl_store_tile(out, out_bf16, ld, col[r] + row0, tb, y, rows, nt);
        }
    }
    free(X);
    free(SX);
    return 0;
}
