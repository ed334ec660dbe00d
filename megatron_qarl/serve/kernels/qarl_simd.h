/* Instruction sets of the engine's native kernels (int8_gemv.c, int4_gemv.c, fp8_gemv.c and their AVX2 parts).
 *
 * The library is built for the baseline of the architecture (no -march=native): every SIMD function carries
 * its instruction set as a target attribute, and the drivers pick one per call from an explicit ``isa``
 * argument that native.py chooses from what the CPU supports (qarl_cpu_features()). So one build holds the
 * AVX2 and the AVX-512 code, and the tests run every variant a machine can execute.
 */
#ifndef QARL_SIMD_H
#define QARL_SIMD_H
#include <stdint.h>

#define QARL_ISA_PLAIN 0  /* portable C */
#define QARL_ISA_AVX2 1   /* AVX2 + FMA + F16C (Haswell, Zen 1-3 and later) */
#define QARL_ISA_AVX512 2 /* AVX512F/BW/VL/DQ plus the format's extension (VNNI for int8, BF16 for int4) */

/* qarl_cpu_features() bits */
#define QARL_CPU_AVX2 1      /* avx2, fma, f16c */
#define QARL_CPU_AVX512 2    /* avx512f, avx512bw, avx512vl, avx512dq */
#define QARL_CPU_AVX512VNNI 4
#define QARL_CPU_AVX512BF16 8

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QARL_X86 1
#include <immintrin.h>
#define QARL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QARL_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define QARL_AVX512VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define QARL_AVX512BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* The sum of 16 fp32 lanes held as lo (lanes 0-7) and hi (8-15), in a fixed tree: (hi + lo), then the upper
 * 128 bits plus the lower, then lanes {2, 3} plus {0, 1}, then lane 1 plus lane 0. This is the order of GCC's
 * _mm512_reduce_add_ps (avx512fintrin.h); hsum16_avx512 below is the same tree on one zmm, so the AVX2 and
 * AVX-512 kernels that use them give the same bits. IEEE addition is commutative, the association is what
 * is fixed. */
QARL_AVX2 static inline float hsum16_avx2(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* 8 bf16 (as uint16) or fp32 values widened to fp32, exactly. */
QARL_AVX2 static inline __m256 load8_f32(const void *x, int x_bf16, int64_t k) {
    if (x_bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + k))), 16));
    return _mm256_loadu_ps((const float *)x + k);
}

/* max_k |x_k| over [0, n) (n a multiple of 8), NaN if any x_k is NaN (as torch's amax). */
QARL_AVX2 static inline float amax_avx2(const void *x, int x_bf16, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps(), nan = m;
    for (int64_t k = 0; k < n; k += 8) {
        __m256 v = _mm256_and_ps(load8_f32(x, x_bf16, k), abs_mask);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float l[8], a = 0.0f;
    _mm256_storeu_ps(l, m);
    for (int i = 0; i < 8; i++) a = l[i] > a ? l[i] : a;
    return _mm256_movemask_ps(nan) ? __builtin_nanf("") : a;
}

QARL_AVX512 static inline float hsum16_avx512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum16_avx2(lo, hi);
}
#else
#define QARL_X86 0
#endif

/* A driver's block function for isa: fn keeps the portable one for QARL_ISA_PLAIN; off x86 any other isa returns
 * -3 from the driver (an instruction set this build lacks). */
#if QARL_X86
#define QARL_PICK(isa, fn, avx512, avx2)                                                                        \
    do {                                                                                                        \
        if ((isa) == QARL_ISA_AVX512) (fn) = (avx512);                                                          \
        if ((isa) == QARL_ISA_AVX2) (fn) = (avx2);                                                              \
    } while (0)
#else
#define QARL_PICK(isa, fn, avx512, avx2)                                                                        \
    do {                                                                                                        \
        if ((isa) != QARL_ISA_PLAIN) return -3;                                                                 \
    } while (0)
#endif

int qarl_cpu_features(void);

/* Output rows per OpenMP work item, and the work item list of a call: R linears of n[r] rows each, cut into
 * blocks of QARL_ROWS rows; item i covers rows [row0, row0 + rows) of linear r. */
#define QARL_ROWS 16

static inline int64_t qarl_items(const int64_t *n, int64_t R) {
    int64_t total = 0;
    for (int64_t r = 0; r < R; r++) total += (n[r] + QARL_ROWS - 1) / QARL_ROWS;
    return total;
}

/* Work item ``item``: rows [row0, row0 + rows) of linear r, for the tokens [t0, t1): all T rows of the activation
 * (diag = 0: every row through every linear), or row r alone (diag = 1: row r of the activation through linear r,
 * T = R). */
static inline void qarl_item(const int64_t *n, int64_t R, int diag, int64_t T, int64_t item, int64_t *r, int64_t *row0,
                             int64_t *rows, int64_t *t0, int64_t *t1) {
    int64_t i = 0;
    for (; i < R - 1; i++) {
        int64_t blocks = (n[i] + QARL_ROWS - 1) / QARL_ROWS;
        if (item < blocks) break;
        item -= blocks;
    }
    *r = i;
    *row0 = item * QARL_ROWS;
    *rows = n[i] - *row0 < QARL_ROWS ? n[i] - *row0 : QARL_ROWS;
    *t0 = diag ? i : 0;
    *t1 = diag ? i + 1 : T;
}

/* Checks shared by the drivers: -1 on a shape the caller should not have passed. */
static inline int qarl_check(int64_t T, int64_t K, const int64_t *n, int64_t R, int diag) {
    if (R <= 0 || T <= 0 || K <= 0 || (diag && T != R)) return -1;
    for (int64_t r = 0; r < R; r++)
        if (n[r] <= 0) return -1;
    return 0;
}
#endif
