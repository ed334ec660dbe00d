/* What the CPU running the engine supports, for native.py's choice of kernels (qarl_simd.h). The compiler's
 * runtime checks read CPUID and, for AVX and AVX-512, whether the OS saves their registers (XGETBV). */
#include "qarl_simd.h"

int qarl_cpu_features(void) {
#if QARL_X86
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        f |= QARL_CPU_AVX2;
    if ((f & QARL_CPU_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        f |= QARL_CPU_AVX512;
    if ((f & QARL_CPU_AVX512) && __builtin_cpu_supports("avx512vnni")) f |= QARL_CPU_AVX512VNNI;
    if ((f & QARL_CPU_AVX512) && __builtin_cpu_supports("avx512bf16")) f |= QARL_CPU_AVX512BF16;
    return f;
#else
    return 0;
#endif
}
