/* W4A16 GEMV for the embedded engine's one-token decode: megatron_qarl/rollout/native.py builds it with
 * int8_gemv.c into one library and documents why it exists.
 *
 * For r in [0, R):  y[r, n] = sum_g s_r[n, g] * sum_{k in group g} x[r', k] * (u_r[n, k] - 8)
 * where r' = r if x_rows == R, else 0; x: bf16 activations [x_rows, K]; u_r: the checkpoint's 4-bit fields
 * (compressed-tensors pack-quantized, symmetric: q = u - 8), read in place as the int32 words' bytes, byte j
 * of a row holding u[2j] (low nibble) and u[2j + 1] (high nibble); s_r: bf16 scales [N, K / G].
 * Products are exact (bf16 x small integer), sums in fp32; the result is written in bf16 (round to nearest
 * even) or fp32. Needs AVX512-BF16 (vdpbf16ps); qarl_int4_gemv_supported() says whether this build has it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qarl_bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QARL_BF16DP 1
#else
#define QARL_BF16DP 0
#endif

int qarl_int4_gemv_supported(void) { return QARL_BF16DP; }

#if QARL_BF16DP
/* One weight row. Per 32 bytes (64 values): widen to 32 words, split the nibbles, map u -> bf16(u - 8) with
 * one word permute each, and two vdpbf16ps against the activation's even and odd elements (pairs of
 * adjacent lanes meet matching x). Each group's sum is independent (its scale applied with one FMA), so
 * groups overlap in the out-of-order core. */
static inline float row_int4(const uint16_t *xe, const uint16_t *xo, const uint8_t *w, const uint16_t *s,
                             int64_t K, int64_t G, __m512i lut) {
    const __m512i m0f = _mm512_set1_epi16(0x0F);
    __m512 t0 = _mm512_setzero_ps(), t1 = t0;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t j = g0 / 2; j < (g0 + G) / 2; j += 32) {
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + j)));
            __m512i wl = _mm512_permutexvar_epi16(_mm512_and_si512(b, m0f), lut);
            __m512i wh = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)wl, (__m512bh)_mm512_loadu_si512((const void *)(xe + j)));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)wh, (__m512bh)_mm512_loadu_si512((const void *)(xo + j)));
        }
        __m512 sc = _mm512_set1_ps(bf16_to_f32(s[gi]));
        if (gi & 1)
            t1 = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sc, t1);
        else
            t0 = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sc, t0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
}
#endif

/* Returns 0; -1 on shapes this kernel does not take (the caller keeps torch's kernel for those: G a multiple
 * of 64, K a multiple of G, x_rows 1 or R); -2 out of memory; -3 built without AVX512-BF16. */
int qarl_int4_gemv(const uint16_t *x, int64_t x_rows, int64_t K, int64_t G, const uint8_t *const *w,
                   const uint16_t *const *s, int64_t R, int64_t N, void *out, int out_bf16, int threads) {
#if QARL_BF16DP
    if (R <= 0 || N <= 0 || K <= 0 || G <= 0 || G % 64 || K % G || (x_rows != 1 && x_rows != R)) return -1;
    uint16_t *xeo = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(x_rows * K));
    if (xeo == NULL) return -2;
    for (int64_t r = 0; r < x_rows; r++) /* per row: the K/2 even elements, then the K/2 odd ones */
        for (int64_t j = 0; j < K / 2; j++) {
            xeo[r * K + j] = x[r * K + 2 * j];
            xeo[r * K + K / 2 + j] = x[r * K + 2 * j + 1];
        }
    uint16_t table[32] = {0};
    for (int u = 0; u < 16; u++) {
        float v = (float)(u - 8);
        table[u] = f32_to_bf16(v);
    }
    const __m512i lut = _mm512_loadu_si512((const void *)table);
    const int64_t rows_per_item = 16, blocks = (N + rows_per_item - 1) / rows_per_item, total = R * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t r = t / blocks, n0 = (t % blocks) * rows_per_item;
        const int64_t n1 = n0 + rows_per_item < N ? n0 + rows_per_item : N;
        const uint16_t *xe = xeo + (x_rows == 1 ? 0 : r) * K;
        for (int64_t n = n0; n < n1; n++) {
            float y = row_int4(xe, xe + K / 2, w[r] + n * (K / 2), s[r] + n * (K / G), K, G, lut);
            if (out_bf16)
                ((uint16_t *)out)[r * N + n] = f32_to_bf16(y);
            else
                ((float *)out)[r * N + n] = y;
        }
    }
    free(xeo);
    return 0;
#else
    (void)x; (void)x_rows; (void)K; (void)G; (void)w; (void)s; (void)R; (void)N; (void)out; (void)out_bf16;
    (void)threads;
    return -3;
#endif
}
