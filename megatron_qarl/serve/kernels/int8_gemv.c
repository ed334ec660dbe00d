/* W8A8-INT8 GEMM for the embedded engine's decode (one token or a few): megatron_qarl/serve/kernels/native.py builds
 * and loads this file with the other kernels and documents why they exist.
 *
 *   y[t, col_r + n] = (float)(sum_k xq[t, k] * W_r[n, k]) * sw_r[n] * sx[t]        (n in [0, N_r))
 *
 * for every activation row t through every linear r (diag = 0: a layer's fused linears, or one token through
 * its top-k experts), or row t = r through linear r alone (diag = 1: the k rows of a token's experts' down).
 * xq, sx: the activation rows x quantized per token (int8 codes, fp32 scales) by quant_row, the learner's
 * formula; W_r: int8 weight codes [N_r, K] (row-major, the checkpoint's own tensor); sw_r: fp32 per-channel
 * scales [N_r]. The integer sum is exact (int32), as in SGLang's kernel, so every instruction set gives the
 * same bits whatever its order of additions; the two float products are done in that order (the order
 * torch._int_mm's caller and oneDNN use). out is fp32 or bf16 (round to nearest even, as torch's
 * .to(torch.bfloat16)), row t at out + t * ld.
 *
 * Instruction sets (qarl_simd.h; the caller picks):
 * - AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so the activation goes in shifted,
 *   u = q + 128, and the kernel accumulates sum(u * w) and sum(128 * w) side by side (the weight row is read
 *   once): sum(q * w) = sum(u * w) - sum(128 * w).
 * - AVX2: vpmaddubsw (unsigned x signed bytes, pairs added in saturating int16) on |w| and q * sign(w). Codes
 *   are |q| <= 127 (quant_row: |t| < 127.5) and |w| <= 128, so a pair is at most 2 * 128 * 127 = 32512 < 2^15:
 *   no saturation (oneDNN's u8s8 GEMM on the unsigned activation can saturate on CPUs without VNNI).
 *   vpmaddwd by ones widens the pairs to int32. Up to 4 activation rows share each load of a weight row.
 * - plain C: the same sums, one product at a time (the tests' reference, and non-x86 machines).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qarl_bf16.h"
#include "qarl_simd.h"

#define TOKENS 64 /* activation rows per pass over a block of weight rows (bounds the accumulators) */

#if QARL_X86
/* One weight row against one shifted activation row: one sequential stream (measured: interleaving 2-8 rows
 * per block is 1.1-2x slower at one thread, the hardware prefetcher follows one stream per thread best), 4
 * independent accumulator pairs so that vpdpbusd's latency is hidden. */
QARL_AVX512VNNI static inline int32_t row_vnni(const uint8_t *u, const int8_t *w, int64_t K) {
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    int64_t k = 0;
    for (; k + 256 <= K; k += 256) {
        __m512i w0 = _mm512_loadu_si512((const void *)(w + k)), w1 = _mm512_loadu_si512((const void *)(w + k + 64));
        __m512i w2 = _mm512_loadu_si512((const void *)(w + k + 128));
        __m512i w3 = _mm512_loadu_si512((const void *)(w + k + 192));
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)(u + k)), w0);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512((const void *)(u + k + 64)), w1);
        a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512((const void *)(u + k + 128)), w2);
        a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512((const void *)(u + k + 192)), w3);
        c0 = _mm512_dpbusd_epi32(c0, k128, w0);
        c1 = _mm512_dpbusd_epi32(c1, k128, w1);
        c2 = _mm512_dpbusd_epi32(c2, k128, w2);
        c3 = _mm512_dpbusd_epi32(c3, k128, w3);
    }
    for (; k + 64 <= K; k += 64) {
        __m512i w0 = _mm512_loadu_si512((const void *)(w + k));
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)(u + k)), w0);
        c0 = _mm512_dpbusd_epi32(c0, k128, w0);
    }
    if (k < K) {
        __mmask64 m = (~(__mmask64)0) >> (64 - (K - k));
        __m512i w0 = _mm512_maskz_loadu_epi8(m, (const void *)(w + k));
        a0 = _mm512_dpbusd_epi32(a0, _mm512_maskz_loadu_epi8(m, (const void *)(u + k)), w0);
        c0 = _mm512_dpbusd_epi32(c0, _mm512_maskz_mov_epi8(m, k128), w0);
    }
    __m512i a = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    __m512i c = _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3));
    return _mm512_reduce_add_epi32(_mm512_sub_epi32(a, c));
}

QARL_AVX512VNNI static void block_vnni(const uint8_t *u, int64_t nt, int64_t K, const int8_t *w, int64_t rows,
                                       int32_t *acc) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t++) acc[i * nt + t] = row_vnni(u + t * K, w + i * K, K);
}

QARL_AVX2 static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 32 products of x and w added into acc (8 int32 lanes), exact: see the header comment. */
QARL_AVX2 static inline __m256i dot32_avx2(__m256i acc, __m256i aw, __m256i w, const int8_t *x) {
    __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
}

/* m (1-4, a constant where it is inlined) activation rows x[j * K ...] against one weight row w. */
QARL_AVX2 static inline __attribute__((always_inline)) void tile_avx2(const int8_t *x, int64_t K, const int8_t *w,
                                                                       const int m, int32_t *out, int64_t stride) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), aw = _mm256_abs_epi8(wv);
        a0 = dot32_avx2(a0, aw, wv, x + k);
        if (m > 1) a1 = dot32_avx2(a1, aw, wv, x + K + k);
        if (m > 2) a2 = dot32_avx2(a2, aw, wv, x + 2 * K + k);
        if (m > 3) a3 = dot32_avx2(a3, aw, wv, x + 3 * K + k);
    }
    int32_t s[4] = {hsum8_epi32(a0), hsum8_epi32(a1), hsum8_epi32(a2), hsum8_epi32(a3)};
    for (; k < K; k++)
        for (int j = 0; j < m; j++) s[j] += (int32_t)x[j * K + k] * (int32_t)w[k];
    for (int j = 0; j < m; j++) out[j * stride] = s[j];
}

QARL_AVX2 static void block_avx2(const int8_t *x, int64_t nt, int64_t K, const int8_t *w, int64_t rows,
                                 int32_t *acc) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t += 4) {
            const int8_t *xt = x + t * K, *wi = w + i * K;
            int32_t *o = acc + i * nt + t;
            switch (nt - t < 4 ? nt - t : 4) {
            case 1: tile_avx2(xt, K, wi, 1, o, 1); break;
            case 2: tile_avx2(xt, K, wi, 2, o, 1); break;
            case 3: tile_avx2(xt, K, wi, 3, o, 1); break;
            default: tile_avx2(xt, K, wi, 4, o, 1); break;
            }
        }
}
#endif

static void block_plain(const int8_t *x, int64_t nt, int64_t K, const int8_t *w, int64_t rows, int32_t *acc) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t++) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; k++) s += (int32_t)x[t * K + k] * (int32_t)w[i * K + k];
            acc[i * nt + t] = s;
        }
}

/* The learner's quant_act_int8_per_token (megatron_qarl/qat/quantizer.py), op for op in fp32:
 *   a = max(max_k |x_k|, 1e-10);  t_k = x_k * (127 / a);  q_k = round_half_away(t_k) = trunc(2 t_k) - trunc(t_k);
 *   s = a / 127.  x is fp32 (x_bf16 = 0) or bf16 (x_bf16 = 1, widened exactly). Built with -ffp-contract=off.
 * trunc by conversion to int (exact: |2 t| <= 255); a NaN gives code 0, as x86's conversion of torch's NaN. */
static void quant_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *s) {
    const float a = qarl_amax_floor(x, x_bf16, K);
    const float mult = 127.0f / a;
    for (int64_t k = 0; k < K; k++) {
        float t = qarl_at(x, x_bf16, k) * mult;
        q[k] = t != t ? 0 : (int8_t)((int32_t)(2.0f * t) - (int32_t)t);
    }
    *s = a / 127.0f;
}

#if QARL_X86
/* quant_row, 8 values at a time (K a multiple of 8; the same operations, so the same codes and scale). */
QARL_AVX2 static void quant_row_avx2(const void *x, int x_bf16, int64_t K, int8_t *q, float *s) {
    float a = amax_avx2(x, x_bf16, K);
    a = a < 1e-10f ? 1e-10f : a;
    const __m256 mult = _mm256_set1_ps(127.0f / a), two = _mm256_set1_ps(2.0f);
    for (int64_t k = 0; k < K; k += 8) {
        __m256 t = _mm256_mul_ps(load8_f32(x, x_bf16, k), mult);
        __m256i c = _mm256_sub_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(two, t)), _mm256_cvttps_epi32(t));
        __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)); /* |c| <= 127 */
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(c16, c16));
    }
    *s = a / 127.0f;
}
#endif

/* isa: QARL_ISA_PLAIN for the C loop, else the AVX2 one where K allows (the same results). */
int qarl_quant_int8(int isa, const void *x, int x_bf16, int64_t rows, int64_t K, int8_t *q, float *s) {
    if (rows <= 0 || K <= 0) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const void *xr = (const char *)x + r * K * (x_bf16 ? 2 : 4);
#if QARL_X86
        if (isa != QARL_ISA_PLAIN && K % 8 == 0) {
            quant_row_avx2(xr, x_bf16, K, q + r * K, s + r);
            continue;
        }
#endif
        (void)isa;
        quant_row(xr, x_bf16, K, q + r * K, s + r);
    }
    return 0;
}

static void block(int isa, const int8_t *xq, int64_t nt, int64_t K, const int8_t *w, int64_t rows, int32_t *acc) {
#if QARL_X86
    if (isa == QARL_ISA_AVX512) {
        block_vnni((const uint8_t *)xq, nt, K, w, rows, acc);
        return;
    }
    if (isa == QARL_ISA_AVX2) {
        block_avx2(xq, nt, K, w, rows, acc);
        return;
    }
#endif
    (void)isa;
    block_plain(xq, nt, K, w, rows, acc);
}

/* The product of the codes xq [T, K] (scales sx [T]) by the linears, in parallel over blocks of weight rows;
 * xq as the ISA wants it (VNNI: shifted to u = q + 128). */
static void gemm_codes(int isa, const int8_t *xq, const float *sx, int64_t T, int64_t K, const int8_t *const *w,
                       const float *const *sw, const int64_t *n, const int64_t *col, int64_t R, int diag, void *out,
                       int64_t ld, int out_bf16, int threads) {
    const int64_t total = qarl_items(n, R);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < total; item++) {
        int64_t r, row0, rows, t0, t1;
        qarl_item(n, R, diag, T, item, &r, &row0, &rows, &t0, &t1);
        int32_t acc[QARL_ROWS * TOKENS];
        for (int64_t tb = t0; tb < t1; tb += TOKENS) {
            const int64_t nt = t1 - tb < TOKENS ? t1 - tb : TOKENS;
            block(isa, xq + tb * K, nt, K, w[r] + row0 * K, rows, acc);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t t = 0; t < nt; t++) {
                    float y = (float)acc[i * nt + t] * sw[r][row0 + i] * sx[tb + t];
                    int64_t at = (tb + t) * ld + col[r] + row0 + i;
                    if (out_bf16)
                        ((uint16_t *)out)[at] = f32_to_bf16(y);
                    else
                        ((float *)out)[at] = y;
                }
        }
    }
}

/* y for the activation rows x [T, K] (fp32 or bf16), quantized here per token exactly as the learner does,
 * through the R linears (see the top of the file). Returns 0, -1 on a shape the caller should not have
 * passed, -2 if out of memory. */
int qarl_int8_gemm(int isa, const void *x, int x_bf16, int64_t T, int64_t K, const int8_t *const *w,
                   const float *const *sw, const int64_t *n, const int64_t *col, int64_t R, int diag, void *out,
                   int64_t ld, int out_bf16, int threads) {
    if (qarl_check(T, K, n, R, diag)) return -1;
    int8_t *xq = (int8_t *)malloc((size_t)(T * K));
    float *sx = (float *)malloc(sizeof(float) * (size_t)T);
    if (xq == NULL || sx == NULL) {
        free(xq);
        free(sx);
        return -2;
    }
    qarl_quant_int8(isa, x, x_bf16, T, K, xq, sx);
    if (isa == QARL_ISA_AVX512) /* in place: u = q + 128 = q ^ 0x80 as a byte */
        for (int64_t k = 0; k < T * K; k++) ((uint8_t *)xq)[k] ^= 0x80u;
    gemm_codes(isa, xq, sx, T, K, w, sw, n, col, R, diag, out, ld, out_bf16, threads);
    free(xq);
    free(sx);
    return 0;
}

/* The product of given codes (no quantization) by the plain loop, fp32 out: the tests' reference. */
int qarl_int8_gemm_codes_plain(const int8_t *xq, const float *sx, int64_t T, int64_t K, const int8_t *const *w,
                               const float *const *sw, const int64_t *n, const int64_t *col, int64_t R, int diag,
                               float *out, int64_t ld) {
    if (qarl_check(T, K, n, R, diag)) return -1;
    gemm_codes(QARL_ISA_PLAIN, xq, sx, T, K, w, sw, n, col, R, diag, out, ld, 0, 1);
    return 0;
}
