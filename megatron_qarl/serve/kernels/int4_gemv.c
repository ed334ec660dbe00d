/* W4A16 GEMM for the embedded engine's decode (one token or a few): megatron_qarl/serve/kernels/native.py builds it
 * with the other kernels into one library and documents why it exists.
 *
 *   y[t, col_r + n] = sum_g s_r[n, g] * sum_{k in group g} x[t, k] * (u_r[n, k] - 8)          (n in [0, N_r))
 *
 * for every activation row t through every linear r (diag = 0), or row t = r through linear r alone (diag = 1).
 * x: bf16 activations [T, K]; u_r: the checkpoint's 4-bit fields (compressed-tensors pack-quantized,
 * symmetric: q = u - 8), read in place as the int32 words' bytes, byte j of a row holding u[2j] (low nibble)
 * and u[2j + 1] (high nibble); s_r: bf16 scales [N_r, K / G]. The result is written in bf16 (round to nearest
 * even) or fp32, row t at out + t * ld.
 *
 * The order of the fp32 additions is fixed, the same in the three implementations (so they give the same bits
 * on every machine, and a row's result does not depend on how many rows the call has), and it is the order of
 * the AVX512-BF16 instruction vdpbf16ps, which the first implementation used. Per row, 16 lanes:
 *   - a group is read in chunks of 64 values (32 bytes); lane i of chunk c takes the values k = 64c + 4i + e,
 *     e = 0..3. Accumulator a0 (reset per group) adds x*(u-8) at e = 2, then at e = 0; a1 at e = 3, then e = 1.
 *     Products of a bf16 and a small integer are exact in fp32, so only the additions round. As vdpbf16ps does,
 *     an x that is a bf16 denormal counts as 0 (DAZ). vdpbf16ps also flushes a denormal sum to 0 (FTZ), which
 *     the other two do not: they differ from it only where a partial sum falls below 2^-126 in magnitude.
 *   - per group g: t_(g mod 2) = fma(a0 + a1, s[g], t_(g mod 2)) (one rounding);
 *   - y = the 16 lanes of t_0 + t_1 summed in the tree of qarl_simd.h's hsum16.
 *
 * Implementations (qarl_simd.h; the caller picks): AVX512-BF16 (nibbles mapped to bf16(u - 8) by one word
 * permute, vdpbf16ps against the activation's even and odd elements), AVX2 (each nibble made an fp32 number by
 * one AND and one subtraction, two FMAs per pair in vdpbf16ps's order; up to 2 activation rows share each
 * conversion) and plain C.
 * G must be a multiple of 64 and K a multiple of G (else -1: the caller keeps torch's kernel).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qarl_bf16.h"
#include "qarl_simd.h"

/* x as one implementation reads it: AVX512-BF16 wants per row the K/2 even elements then the K/2 odd ones
 * (bf16); AVX2 and plain C want per row and chunk the four classes e = 2, 0, 3, 1 of 16 lanes (fp32, DAZ), AVX2
 * with lanes 0-3 and 8-11 (set L) before lanes 4-7 and 12-15 (set H), the order its word unpacking gives. */
static float daz(uint16_t h) { return (h & 0x7f80u) == 0 ? 0.0f : bf16_to_f32(h); }

static void arrange_lanes(const uint16_t *x, int64_t K, int by_sets, float *X) {
    static const int e_of_class[4] = {2, 0, 3, 1};
    for (int64_t c = 0; c < K / 64; c++)
        for (int cls = 0; cls < 4; cls++)
            for (int i = 0; i < 16; i++) { /* by_sets (AVX2): lanes 0-3, 8-11, then 4-7, 12-15 */
                const int at = by_sets ? (i >> 2 & 1) * 8 + (i >> 3) * 4 + (i & 3) : i;
                X[c * 64 + cls * 16 + at] = daz(x[c * 64 + 4 * i + e_of_class[cls]]);
            }
}

static void arrange_even_odd(const uint16_t *x, int64_t K, uint16_t *xeo) {
    for (int64_t j = 0; j < K / 2; j++) {
        xeo[j] = x[2 * j];
        xeo[K / 2 + j] = x[2 * j + 1];
    }
}

#if QARL_X86
/* One weight row. Per 32 bytes (64 values): widen to 32 words, split the nibbles, map u -> bf16(u - 8) with
 * one word permute each, and two vdpbf16ps against the activation's even and odd elements (pairs of
 * adjacent lanes meet matching x). Each group's sum is independent (its scale applied with one FMA), so
 * groups overlap in the out-of-order core. */
QARL_AVX512BF16 static float row_bf16(const uint16_t *xe, const uint16_t *xo, const uint8_t *w, const uint16_t *s,
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
    return hsum16_avx512(_mm512_add_ps(t0, t1));
}

QARL_AVX512BF16 static void block_bf16(const void *X, int64_t nt, int64_t K, int64_t G, const uint8_t *w,
                                       const uint16_t *s, int64_t rows, float *y) {
    uint16_t table[32] = {0};
    for (int u = 0; u < 16; u++) table[u] = f32_to_bf16((float)(u - 8));
    const __m512i lut = _mm512_loadu_si512((const void *)table);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t++) {
            const uint16_t *xe = (const uint16_t *)X + t * K;
            y[i * nt + t] = row_bf16(xe, xe + K / 2, w + i * (K / 2), s + i * (K / G), K, G, lut);
        }
}

/* A chunk's 16 words are its 16 lanes. One word unpack with the constant 0x7f80 makes each word the low half
 * of a dword whose high half is 0x7f80 (the exponent field all ones): unpacklo takes words 0-3 and 8-11 (set
 * L), unpackhi words 4-7 and 12-15 (set H; AVX2's unpacks work per 128-bit half). A word's nibble e sits at
 * bits 4e..4e+3 of such a dword P; one AND with ((150 - 4e) << 23) | (15 << 4e) makes the fp32 number
 * 2^(23 - 4e) + u, and one subtraction of 2^(23 - 4e) + 8 leaves u - 8, exactly: no shift, no int -> float
 * conversion. Each value is used as soon as it is made: with 2 rows the 8 accumulators stay in registers. The
 * weights are prefetched INT4_PREFETCH bytes ahead (the rows that follow; measured 1.05-1.15x on weights
 * streamed from memory, 2-8 KB ahead alike). X per row and chunk: the classes e = 2, 0, 3, 1 in slots 0-3,
 * each set L's 8 lanes then set H's (arrange_lanes with by_sets). */
#define INT4_PREFETCH 4096
#define INT4_AVX2_CLASS(e, slot, acc)                                                                           \
    do {                                                                                                         \
        const __m256i mask = _mm256_set1_epi32((int)(((150u - 4u * (e)) << 23) | (15u << (4 * (e)))));          \
        const __m256 bias = _mm256_set1_ps((float)(1 << (23 - 4 * (e))) + 8.0f);                                \
        const __m256 fL = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(PL, mask)), bias);                 \
        const __m256 fH = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(PH, mask)), bias);                 \
        for (int j = 0; j < m; j++) {                                                                            \
            acc[j][0] = _mm256_fmadd_ps(fL, _mm256_loadu_ps(X + j * K + c * 64 + 16 * (slot)), acc[j][0]);       \
            acc[j][1] = _mm256_fmadd_ps(fH, _mm256_loadu_ps(X + j * K + c * 64 + 16 * (slot) + 8), acc[j][1]);   \
        }                                                                                                        \
    } while (0)

/* The sum a0 + a1 of one group (chunks c0..c1) for m (1 or 2, a constant where inlined) activation rows, sets L
 * and H: out[j][set]. a0 takes e = 2 then e = 0, a1 e = 3 then e = 1, chunk after chunk. */
QARL_AVX2 static inline __attribute__((always_inline)) void group_avx2(const float *X, int64_t K, const uint8_t *w,
                                                                        int64_t c0, int64_t c1, const int m,
                                                                        __m256 out[2][2]) {
    const __m256i ones_exp = _mm256_set1_epi16(0x7f80);
    __m256 a0[2][2], a1[2][2]; /* [token][set] */
    for (int j = 0; j < m; j++) a0[j][0] = a0[j][1] = a1[j][0] = a1[j][1] = _mm256_setzero_ps();
    for (int64_t c = c0; c < c1; c++) {
        const __m256i V = _mm256_loadu_si256((const __m256i *)(w + c * 32));
        if (c & 1) _mm_prefetch((const char *)(w + c * 32 + INT4_PREFETCH), _MM_HINT_T0); /* one per line */
        const __m256i PL = _mm256_unpacklo_epi16(V, ones_exp);
        const __m256i PH = _mm256_unpackhi_epi16(V, ones_exp);
        INT4_AVX2_CLASS(2u, 0, a0);
        INT4_AVX2_CLASS(0u, 1, a0);
        INT4_AVX2_CLASS(3u, 2, a1);
        INT4_AVX2_CLASS(1u, 3, a1);
    }
    for (int j = 0; j < m; j++) {
        out[j][0] = _mm256_add_ps(a0[j][0], a1[j][0]);
        out[j][1] = _mm256_add_ps(a0[j][1], a1[j][1]);
    }
}

/* m (1 or 2, a constant where inlined) activation rows against one weight row, groups of per chunks (a constant
 * for G = 128, so that a group's chunks are unrolled). Groups go in pairs, so that t0 (even groups) and t1 (odd)
 * stay in registers. */
QARL_AVX2 static inline __attribute__((always_inline)) void tile_avx2(const float *X, int64_t K, int64_t G,
                                                                       const uint8_t *w, const uint16_t *s,
                                                                       const int64_t per, const int m, float *y,
                                                                       int64_t ys) {
    __m256 t0[2][2], t1[2][2], g[2][2]; /* [token][set L / H] */
    for (int j = 0; j < m; j++) t0[j][0] = t0[j][1] = t1[j][0] = t1[j][1] = _mm256_setzero_ps();
    const int64_t groups = K / G;
    for (int64_t gi = 0; gi < groups; gi += 2) {
        group_avx2(X, K, w, gi * per, (gi + 1) * per, m, g);
        const __m256 s0 = _mm256_set1_ps(bf16_to_f32(s[gi]));
        for (int j = 0; j < m; j++) {
            t0[j][0] = _mm256_fmadd_ps(g[j][0], s0, t0[j][0]);
            t0[j][1] = _mm256_fmadd_ps(g[j][1], s0, t0[j][1]);
        }
        if (gi + 1 < groups) {
            group_avx2(X, K, w, (gi + 1) * per, (gi + 2) * per, m, g);
            const __m256 s1 = _mm256_set1_ps(bf16_to_f32(s[gi + 1]));
            for (int j = 0; j < m; j++) {
                t1[j][0] = _mm256_fmadd_ps(g[j][0], s1, t1[j][0]);
                t1[j][1] = _mm256_fmadd_ps(g[j][1], s1, t1[j][1]);
            }
        }
    }
    for (int j = 0; j < m; j++) { /* sets L (0-3 | 8-11), H (4-7 | 12-15) -> lanes 0-7, 8-15 */
        const __m256 l = _mm256_add_ps(t0[j][0], t1[j][0]), h = _mm256_add_ps(t0[j][1], t1[j][1]);
        y[j * ys] = hsum16_avx2(_mm256_permute2f128_ps(l, h, 0x20), _mm256_permute2f128_ps(l, h, 0x31));
    }
}

QARL_AVX2 static void block_avx2(const void *X, int64_t nt, int64_t K, int64_t G, const uint8_t *w,
                                 const uint16_t *s, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t += 2) {
            const float *xt = (const float *)X + t * K;
            const uint8_t *wi = w + i * (K / 2);
            const uint16_t *si = s + i * (K / G);
            if (G == 128) { /* the usual group, its two chunks unrolled: measured 1.03-1.1x */
                if (nt - t >= 2)
                    tile_avx2(xt, K, G, wi, si, 2, 2, y + i * nt + t, 1);
                else
                    tile_avx2(xt, K, G, wi, si, 2, 1, y + i * nt + t, 1);
            } else if (nt - t >= 2)
                tile_avx2(xt, K, G, wi, si, G / 64, 2, y + i * nt + t, 1);
            else
                tile_avx2(xt, K, G, wi, si, G / 64, 1, y + i * nt + t, 1);
        }
}
#endif

/* The same sums one lane at a time. */
static float row_plain(const float *X, int64_t K, int64_t G, const uint8_t *w, const uint16_t *s) {
    float t[2][16] = {{0}};
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
        float a0[16] = {0}, a1[16] = {0};
        for (int64_t c = g0 / 64; c < (g0 + G) / 64; c++)
            for (int i = 0; i < 16; i++) {
                const uint8_t lo = w[c * 32 + 2 * i], hi = w[c * 32 + 2 * i + 1];
                const float *xc = X + c * 64 + i;
                a0[i] += (float)((hi & 15) - 8) * xc[0];
                a0[i] += (float)((lo & 15) - 8) * xc[16];
                a1[i] += (float)((hi >> 4) - 8) * xc[32];
                a1[i] += (float)((lo >> 4) - 8) * xc[48];
            }
        const float sc = bf16_to_f32(s[gi]);
        for (int i = 0; i < 16; i++) t[gi & 1][i] = fmaf(a0[i] + a1[i], sc, t[gi & 1][i]);
    }
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = t[0][i] + t[1][i];
    float h[8], q[4];
    for (int i = 0; i < 8; i++) h[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; i++) q[i] = h[4 + i] + h[i];
    const float p0 = q[0] + q[2], p1 = q[1] + q[3];
    return p0 + p1;
}

static void block_plain(const void *X, int64_t nt, int64_t K, int64_t G, const uint8_t *w, const uint16_t *s,
                        int64_t rows, float *y) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t++)
            y[i * nt + t] = row_plain((const float *)X + t * K, K, G, w + i * (K / 2), s + i * (K / G));
}

typedef void (*block_fn)(const void *, int64_t, int64_t, int64_t, const uint8_t *, const uint16_t *, int64_t,
                         float *);

#define TOKENS 64 /* activation rows per pass over a block of weight rows */

/* Returns 0; -1 on shapes this kernel does not take (see the top); -2 out of memory; -3 an instruction set
 * this build lacks. */
int qarl_int4_gemm(int isa, const uint16_t *x, int64_t T, int64_t K, int64_t G, const uint8_t *const *w,
                   const uint16_t *const *s, const int64_t *n, const int64_t *col, int64_t R, int diag, void *out,
                   int64_t ld, int out_bf16, int threads) {
    if (qarl_check(T, K, n, R, diag) || G <= 0 || G % 64 || K % G) return -1;
    block_fn fn = block_plain;
    QARL_PICK(isa, fn, block_bf16, block_avx2);
    const size_t per_row = isa == QARL_ISA_AVX512 ? sizeof(uint16_t) : sizeof(float);
    void *X = malloc(per_row * (size_t)(T * K));
    if (X == NULL) return -2;
    for (int64_t t = 0; t < T; t++) {
        if (isa == QARL_ISA_AVX512)
            arrange_even_odd(x + t * K, K, (uint16_t *)X + t * K);
        else
            arrange_lanes(x + t * K, K, isa == QARL_ISA_AVX2, (float *)X + t * K);
    }
    const int64_t total = qarl_items(n, R);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < total; item++) {
        int64_t r, row0, rows, t0, t1;
        qarl_item(n, R, diag, T, item, &r, &row0, &rows, &t0, &t1);
        float y[QARL_ROWS * TOKENS];
        for (int64_t tb = t0; tb < t1; tb += TOKENS) {
            const int64_t nt = t1 - tb < TOKENS ? t1 - tb : TOKENS;
            fn((const char *)X + per_row * (size_t)(tb * K), nt, K, G, w[r] + row0 * (K / 2), s[r] + row0 * (K / G),
               rows, y);
            qarl_store_tile(out, out_bf16, ld, col[r] + row0, tb, y, rows, nt);
        }
    }
    free(X);
    return 0;
}
