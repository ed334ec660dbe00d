/* bf16 <-> fp32, and reading and writing either, for the engine's native kernels (int8_gemv.c, int4_gemv.c,
 * fp8_gemv.c). */
#ifndef QARL_BF16_H
#define QARL_BF16_H
#include <stdint.h>
#include <string.h>

/* Round to nearest even, as torch's .to(torch.bfloat16); a NaN stays a NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Exact. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x[k] of an fp32 (x_bf16 = 0) or bf16 (x_bf16 = 1, widened exactly) vector. */
static inline float qarl_at(const void *x, int x_bf16, int64_t k) {
    return x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
}

/* max(max_k |x_k|, 1e-10) over n values, in fp32: a NaN propagates, as torch's amax, and stays past the floor. */
static inline float qarl_amax_floor(const void *x, int x_bf16, int64_t n) {
    float a = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        float v = qarl_at(x, x_bf16, k);
        v = v < 0 ? -v : v;
        a = v > a || v != v ? v : a;
    }
    return a < 1e-10f ? 1e-10f : a;
}

/* A tile's fp32 results y [rows, nt] (row i of the tile is output column col + i, token t is output row tb + t)
 * into out (row stride ld), as bf16 (out_bf16 = 1, rounded to nearest even) or fp32. */
static inline void qarl_store_tile(void *out, int out_bf16, int64_t ld, int64_t col, int64_t tb, const float *y,
                                   int64_t rows, int64_t nt) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < nt; t++) {
            int64_t at = (tb + t) * ld + col + i;
            if (out_bf16)
                ((uint16_t *)out)[at] = f32_to_bf16(y[i * nt + t]);
            else
                ((float *)out)[at] = y[i * nt + t];
        }
}
#endif
