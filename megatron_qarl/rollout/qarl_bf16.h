/* bf16 <-> fp32 for the engine's native kernels (int8_gemv.c, int4_gemv.c). */
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
#endif
