/* W8A8-INT8 GEMV for the embedded engine's one-token decode: megatron_qarl/rollout/native.py builds and
 * loads this file (cc -O3 -march=native -ffp-contract=off -fopenmp -shared) and documents why it exists.
 *
 * For r in [0, R):  y[r, n] = (float)(sum_k xq[r', k] * W_r[n, k]) * sw_r[n] * sx[r']     (n in [0, N))
 * where r' = r if x_rows == R, else 0 (one token through R linears: the top-k experts' gate_up).
 * xq, sx: the activation rows x quantized per token (int8 codes, fp32 scales) by quant_row, the learner's
 * formula; W_r: int8 weight codes [N, K] (row-major, the checkpoint's own tensor); sw_r: fp32 per-channel
 * scales [N]. The integer sum is exact (int32), as in oneDNN's u8s8 GEMM and SGLang's kernel; the two
 * float products are done in that order (the order torch._int_mm's caller and oneDNN use).
 *
 * AVX512-VNNI path: vpdpbusd multiplies unsigned by signed bytes, so the activation goes in shifted,
 * u = q + 128, and the kernel accumulates sum(u * w) and sum(128 * w) side by side (the weight row is read
 * once): sum(q * w) = sum(u * w) - sum(128 * w). Elsewhere a plain loop (same result, slower).
 * out is fp32 or bf16 (round to nearest even, as torch's .to(torch.bfloat16)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qarl_bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QARL_VNNI 1
#else
#define QARL_VNNI 0
#endif

int qarl_int8_gemv_has_vnni(void) { return QARL_VNNI; }

#define ROWS 16 /* output rows per OpenMP work item */

#if QARL_VNNI
/* One weight row, read as one sequential stream (measured: interleaving 2-8 rows per block is 1.1-2x slower
 * at one thread, the hardware prefetcher follows one stream per thread best), 4 independent accumulator
 * pairs so that vpdpbusd's latency is hidden. */
static inline int32_t row_vnni(const uint8_t *u, const int8_t *w, int64_t K) {
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
#endif

static void block_plain(const int8_t *q, const int8_t *w, int64_t K, int64_t rows, int32_t *acc) {
    for (int i = 0; i < rows; i++) {
        int32_t s = 0;
        for (int64_t k = 0; k < K; k++) s += (int32_t)q[k] * (int32_t)w[i * K + k];
        acc[i] = s;
    }
}

/* The learner's quant_act_int8_per_token (megatron_qarl/qat/quantizer.py), op for op in fp32:
 *   a = max(max_k |x_k|, 1e-10);  t_k = x_k * (127 / a);  q_k = round_half_away(t_k) = trunc(2 t_k) - trunc(t_k);
 *   s = a / 127.  x is fp32 (x_bf16 = 0) or bf16 (x_bf16 = 1, widened exactly). Built with -ffp-contract=off. */
static void quant_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *s) {
    float a = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        v = v < 0 ? -v : v;
        a = v > a || v != v ? v : a; /* a NaN propagates, as torch's amax */
    }
    a = a < 1e-10f ? 1e-10f : a;
    const float mult = 127.0f / a;
    for (int64_t k = 0; k < K; k++) {
        float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        float t = v * mult;
        q[k] = (int8_t)(truncf(2.0f * t) - truncf(t));
    }
    *s = a / 127.0f;
}

int qarl_quant_int8(const void *x, int x_bf16, int64_t rows, int64_t K, int8_t *q, float *s) {
    if (rows <= 0 || K <= 0) return -1;
    for (int64_t r = 0; r < rows; r++)
        quant_row((const char *)x + r * K * (x_bf16 ? 2 : 4), x_bf16, K, q + r * K, s + r);
    return 0;
}

/* y[r, :] for the activation rows x [x_rows, K] (fp32 or bf16), quantized here per token exactly as the
 * learner does, through linears r = 0..R-1. Returns 0, -1 on a shape the caller should not have passed,
 * -2 if out of memory. */
int qarl_int8_gemv(const void *x, int x_bf16, int64_t x_rows, int64_t K, const int8_t *const *w,
                   const float *const *sw, int64_t R, int64_t N, void *out, int out_bf16, int threads) {
    if (R <= 0 || N <= 0 || K <= 0 || (x_rows != 1 && x_rows != R)) return -1;
    int8_t *xq = (int8_t *)malloc((size_t)(x_rows * K));
    if (xq == NULL) return -2;
    float *sx = (float *)malloc(sizeof(float) * (size_t)x_rows);
    if (sx == NULL) {
        free(xq);
        return -2;
    }
    qarl_quant_int8(x, x_bf16, x_rows, K, xq, sx);
#if QARL_VNNI
    uint8_t *u = (uint8_t *)xq; /* in place: u = q + 128 = q ^ 0x80 as a byte */
    for (int64_t k = 0; k < x_rows * K; k++) u[k] ^= 0x80u;
#endif
    const int64_t blocks = (N + ROWS - 1) / ROWS;
    const int64_t total = R * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t r = t / blocks, n0 = (t % blocks) * ROWS;
        const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
        const int64_t xr = x_rows == 1 ? 0 : r;
        int32_t acc[ROWS];
        const int8_t *wr = w[r] + n0 * K;
#if QARL_VNNI
        for (int i = 0; i < rows; i++) acc[i] = row_vnni(u + xr * K, wr + i * K, K);
#else
        block_plain(xq + xr * K, wr, K, rows, acc);
#endif
        for (int i = 0; i < rows; i++) {
            float y = (float)acc[i] * sw[r][n0 + i] * sx[xr];
            if (out_bf16)
                ((uint16_t *)out)[r * N + n0 + i] = f32_to_bf16(y);
            else
                ((float *)out)[r * N + n0 + i] = y;
        }
    }
    free(xq);
    free(sx);
    return 0;
}

/* The plain loop, callable on any build: the tests check the VNNI path against it. */
int qarl_int8_gemv_plain(const int8_t *xq, const float *sx, int64_t x_rows, int64_t K, const int8_t *const *w,
                         const float *const *sw, int64_t R, int64_t N, float *out) {
    if (R <= 0 || N <= 0 || K <= 0 || (x_rows != 1 && x_rows != R)) return -1;
    for (int64_t r = 0; r < R; r++)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
            const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
            const int64_t xr = x_rows == 1 ? 0 : r;
            int32_t acc[ROWS];
            block_plain(xq + xr * K, w[r] + n0 * K, K, rows, acc);
            for (int i = 0; i < rows; i++) out[r * N + n0 + i] = (float)acc[i] * sw[r][n0 + i] * sx[xr];
        }
    return 0;
}
