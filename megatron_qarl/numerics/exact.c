/* Exact kernels: every result depends only on its own row's operands, never on how many rows a call has, how
 * many threads run it, or where the row sits in the batch (megatron_qarl/numerics/native.py binds them; the
 * formulas are in megatron_qarl/numerics/ops.py, whose torch references they are tested against).
 *
 * Fixed reduction orders everywhere. The linear: K in chunks, each a sequential float32 sum in ascending k, the
 * chunks added in ascending order. Other dot products (RMSNorm's sum of squares, attention's q.k) keep LANES (8)
 * float32 partial sums, element i going to lane i % 8 in ascending i, combined as ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)). Each lane or output is a sequential sum, so the compiler may vectorize across lanes or
 * outputs (it does) without changing a bit.
 * Built with -O3 -ffp-contract=off (no fused multiply-add) and without -ffast-math (no reassociation); the
 * transcendental functions are libm's scalar expf / logf / sqrtf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static inline float qx_dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[k + j] * b[k + j];
    for (int j = 0; k + j < n; j++) acc[j] += a[k + j] * b[k + j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* y[m, n] = sum over chunks c in ascending order of p[m, n, c] (s = p0; s = s + p1; ...), where p[m, n, c] is the
 * sum over chunk c's k in ascending order of x[m, k] * w[k, n] in one float32 accumulator. partials != 0: write p
 * [M, N, K / chunk] instead (a tensor-parallel rank's share; the caller adds the gathered chunks in the same order).
 * x [M, K] row-major, the weight given K-major: wt [K, N] (w transposed). The work is blocks of NB outputs by up
 * to 4 rows (qx_item; vectorized across outputs, which changes no output's order; compiled for AVX2 and for plain
 * x86-64, chosen per CPU, with the same results). */
#define NB 32

/* acc[j] = sum over k in [k0, k1) in ascending k of xr[k] * wt[k * N + n0 + j], j < len (len <= NB): the scalar
 * loop of a block whose width is not a multiple of 8 (qx_tile takes the others). */
static inline __attribute__((always_inline)) void qx_block(const float *xr, const float *wt, int64_t N, int64_t n0,
                                                           int64_t len, int64_t k0, int64_t k1, float *acc) {
    for (int64_t j = 0; j < len; j++) acc[j] = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        const float xv = xr[k];
        const float *wr = wt + k * N + n0;
        for (int64_t j = 0; j < len; j++) acc[j] += xv * wr[j];
    }
}

/* nr rows (1 to 4, rows of x at stride K; they share each weight vector loaded) of nv x 8 outputs n0 .. over every
 * chunk of K, each output's order qx_block's: out (rows at stride ld) the chunks summed in order (t = a_0;
 * t = t + a_c), or the partials part ([rows, outputs, nc] at row stride ld * nc, when not NULL). Written with GCC's
 * generic vectors (8 floats: one AVX2 register, two SSE ones) and inlined with constant nr and nv, so that the
 * accumulators stay in registers: an array form spilled them and ran at a quarter of the adders' rate. */
typedef float qx_v8 __attribute__((vector_size(32), aligned(4)));

#if defined(__x86_64__) || defined(__i386__)
#define QX_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QX_CLONES /* one build: target_clones is x86's (GCC's generic vectors map onto NEON etc. alike) */
#endif

static inline __attribute__((always_inline)) qx_v8 qx_load8(const float *p) {
    qx_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void qx_tile(const float *x, int64_t K, const int nr, const int nv,
                                                          const float *wt, int64_t N, int64_t n0, int64_t chunk,
                                                          float *out, int64_t ld, float *part) {
    const int64_t nc = K / chunk;
    qx_v8 t[4][4] = {{{0}}};
    for (int64_t c = 0; c < nc; c++) {
        qx_v8 a[4][4] = {{{0}}};
        for (int64_t k = c * chunk; k < (c + 1) * chunk; k++) {
            const float *wr = wt + k * N + n0;
            qx_v8 w[4];
            for (int i = 0; i < nv; i++) w[i] = qx_load8(wr + 8 * i);
            for (int r = 0; r < nr; r++) {
                const float s = x[r * K + k];
                const qx_v8 u = {s, s, s, s, s, s, s, s};
                for (int i = 0; i < nv; i++) a[r][i] += u * w[i];
            }
        }
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < nv; i++) {
                if (part)
                    for (int j = 0; j < 8; j++) part[(r * ld + 8 * i + j) * nc + c] = a[r][i][j];
                else
                    t[r][i] = c == 0 ? a[r][i] : t[r][i] + a[r][i];
            }
    }
    if (!part)
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < nv; i++) memcpy(out + r * ld + 8 * i, &t[r][i], sizeof t[r][i]);
}

/* Chunk c's sums acc of row m, outputs n0 .. n0 + len: written as partials, or added to the row's running total. */
static inline void qx_take(float *out, float *tot, const float *acc, int64_t m, int64_t N, int64_t n0, int64_t len,
                           int64_t c, int64_t nc, int partials) {
    if (partials) {
        for (int64_t j = 0; j < len; j++) out[(m * N + n0 + j) * nc + c] = acc[j];
    } else if (c == 0) {
        for (int64_t j = 0; j < len; j++) tot[j] = acc[j];
    } else {
        for (int64_t j = 0; j < len; j++) tot[j] = tot[j] + acc[j];
    }
}

/* Rows m0 .. m0 + rows - 1 (rows 1 to 4) of outputs n0 .. n0 + len - 1 over every chunk: the chunks summed in order
 * into out [M, N], or the partials. One call per such item (the blocks inlined, compiled for AVX2 and for plain
 * x86-64, chosen per CPU): a call per chunk cost as much as its arithmetic at small K. */
QX_CLONES
static void qx_item(const float *x, int64_t K, const float *wt, int64_t N, int64_t m0, int64_t rows, int64_t n0,
                    int64_t len, int64_t chunk, int partials, float *out) {
    const int64_t nc = K / chunk;
    if (len % 8 == 0) {
        const float *xm = x + m0 * K;
        float *o = out + m0 * N + n0, *p = partials ? out + (m0 * N + n0) * nc : NULL;
#define QX_TILE(nr, nv, at) qx_tile(xm, K, nr, nv, wt, N, n0 + (at), chunk, o + (at), N, p ? p + (at) * nc : NULL)
        if (rows == 4 && len == NB) { /* four rows share each weight vector: two halves of 16 outputs */
            QX_TILE(4, 2, 0);
            QX_TILE(4, 2, 16);
            return;
        }
        for (int64_t r = 0; r < rows; r++, xm += K, o += N, p = p ? p + N * nc : NULL)
            switch (len / 8) {
            case 1: QX_TILE(1, 1, 0); break;
            case 2: QX_TILE(1, 2, 0); break;
            case 3: QX_TILE(1, 3, 0); break;
            default: QX_TILE(1, 4, 0); break;
            }
#undef QX_TILE
        return;
    }
    for (int64_t r = 0; r < rows; r++) { /* a block of fewer than 8 outputs or not a multiple of 8: row by row */
        float acc[NB], tot[NB];
        for (int64_t c = 0; c < nc; c++) {
            qx_block(x + (m0 + r) * K, wt, N, n0, len, c * chunk, (c + 1) * chunk, acc);
            qx_take(out, tot, acc, m0 + r, N, n0, len, c, nc, partials);
        }
        if (!partials)
            for (int64_t j = 0; j < len; j++) out[(m0 + r) * N + n0 + j] = tot[j];
    }
}

int qx_linear(const float *x, int64_t M, int64_t K, const float *wt, int64_t N, int64_t chunk, int partials,
              float *out, int threads) {
    if (chunk <= 0 || K % chunk) return -1;
    const int64_t nblocks = (N + NB - 1) / NB, quads = (M + 3) / 4;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t bi = 0; bi < nblocks; bi++) /* a block's K x NB weights stay in L1 while row quads pass */
        for (int64_t mq = 0; mq < quads; mq++) {
            const int64_t m0 = 4 * mq, n0 = bi * NB;
            qx_item(x, K, wt, N, m0, M - m0 < 4 ? M - m0 : 4, n0, N - n0 < NB ? N - n0 : NB, chunk, partials, out);
        }
    return 0;
}

/* RMSNorm of one row: r = 1 / sqrtf(qx_dot(x, x) / H + eps); y[h] = (x[h] * r) * w[h]. */
static inline void qx_row_rmsnorm(const float *xr, int64_t H, const float *w, float eps, float *out) {
    const float ms = qx_dot(xr, xr, H) / (float)H;
    const float r = 1.0f / sqrtf(ms + eps);
    for (int64_t h = 0; h < H; h++) out[h] = (xr[h] * r) * w[h];
}

/* RMSNorm of each row. */
int qx_rmsnorm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) qx_row_rmsnorm(x + m * H, H, w, eps, out + m * H);
    return 0;
}

/* RMSNorm's gradient (not bit-exact: the backward's order is free): with r = 1 / sqrtf(mean(x^2) + eps) and
 * d = sum_h gy[h] w[h] x[h], gx[h] = r gy[h] w[h] - x[h] r^3 d / H; xhat = x r (the weight's gradient is
 * sum over rows of gy * xhat, taken by the caller). */
int qx_rmsnorm_bwd(const float *x, const float *gy, int64_t M, int64_t H, const float *w, float eps, float *gx,
                   float *xhat, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * H, *gr = gy + m * H;
        const float r = 1.0f / sqrtf(qx_dot(xr, xr, H) / (float)H + eps);
        double d = 0.0;
        for (int64_t h = 0; h < H; h++) d += (double)gr[h] * w[h] * xr[h];
        const float c = (float)(d / (double)H) * r * r * r;
        for (int64_t h = 0; h < H; h++) {
            gx[m * H + h] = r * gr[h] * w[h] - xr[h] * c;
            xhat[m * H + h] = xr[h] * r;
        }
    }
    return 0;
}

/* SiLU(g) * u's gradient: with s = sigmoid(g), dg = gy u s (1 + g (1 - s)), du = gy g s. */
int qx_silu_mul_bwd(const float *g, const float *u, const float *gy, int64_t n, float *dg, float *du, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) {
        const float s = 1.0f / (1.0f + expf(-g[i]));
        dg[i] = gy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
        du[i] = gy[i] * g[i] * s;
    }
    return 0;
}

/* SiLU(g) * u: (g / (1 + expf(-g))) * u. */
static inline float qx_silu1(float g, float u) { return (g / (1.0f + expf(-g))) * u; }

/* SiLU(g) * u elementwise. */
int qx_silu_mul(const float *g, const float *u, int64_t n, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) out[i] = qx_silu1(g[i], u[i]);
    return 0;
}

/* Row max, then the sum of expf(x - max) in ascending column order. */
static inline float qx_row_expsum(const float *x, int64_t V, float *mx_out) {
    float mx = x[0];
    for (int64_t v = 1; v < V; v++) mx = x[v] > mx ? x[v] : mx;
    float s = 0.0f;
    for (int64_t v = 0; v < V; v++) s = s + expf(x[v] - mx);
    *mx_out = mx;
    return s;
}

/* softmax (log_ != 0: log-softmax) of one row x [V]: e = expf(x - max) / sum, or x - (max + logf(sum)). */
static inline void qx_row_softmax(const float *xr, int64_t V, int log_, float *out) {
    float mx;
    const float s = qx_row_expsum(xr, V, &mx);
    if (log_) {
        const float lse = mx + logf(s);
        for (int64_t v = 0; v < V; v++) out[v] = xr[v] - lse;
    } else {
        for (int64_t v = 0; v < V; v++) out[v] = expf(xr[v] - mx) / s;
    }
}

/* softmax (or log-softmax) of each row of x [M, V]. */
int qx_softmax(const float *x, int64_t M, int64_t V, int log_, float *out, int threads) {
    if (V <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) qx_row_softmax(x + m * V, V, log_, out + m * V);
    return 0;
}

/* Attention of query rows over exactly their keys, in key order. q [R, Hq, D]; query row r, head h reads KV head
 * g = h / (Hq / Hkv) at k + kbase[r] + g * hs + j * ls for keys j = 0 .. nkeys[r] - 1 (v alike). Per (r, h):
 * s_j = qx_dot(q, k_j) * scale; e_j = expf(s_j - max s); Z = sum_j e_j (key order); o[d] = sum_j e_j * v_j[d]
 * (key order) / Z. out [R, Hq, D]. */
int qx_attention(const float *q, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, const float *k, const float *v,
                 const int64_t *kbase, const int64_t *nkeys, int64_t ls, int64_t hs, float scale, float *out,
                 int threads) {
    if (Hkv <= 0 || Hq % Hkv) return -1;
    const int64_t rep = Hq / Hkv;
    int64_t maxl = 1;
    for (int64_t r = 0; r < R; r++) {
        if (nkeys[r] <= 0) return -1;
        maxl = nkeys[r] > maxl ? nkeys[r] : maxl;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *e = malloc(sizeof(float) * (size_t)maxl), *acc = malloc(sizeof(float) * (size_t)D);
        if (!e || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < R; r++)
            for (int64_t h = 0; h < Hq; h++) {
                if (!e || !acc) continue;
                const float *qr = q + (r * Hq + h) * D;
                const float *kb = k + kbase[r] + (h / rep) * hs, *vb = v + kbase[r] + (h / rep) * hs;
                const int64_t L = nkeys[r];
                float mx = -INFINITY;
                for (int64_t j = 0; j < L; j++) {
                    e[j] = qx_dot(qr, kb + j * ls, D) * scale;
                    mx = e[j] > mx ? e[j] : mx;
                }
                float z = 0.0f;
                for (int64_t j = 0; j < L; j++) {
                    e[j] = expf(e[j] - mx);
                    z = z + e[j];
                }
                for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                for (int64_t j = 0; j < L; j++)
                    for (int64_t d = 0; d < D; d++) acc[d] = acc[d] + e[j] * vb[j * ls + d];
                float *o = out + (r * Hq + h) * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[d] / z;
            }
        free(e);
        free(acc);
    }
    return failed ? -2 : 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * The engine's fused blocks (serve/exact_forward.py): one call per attention block and one per MoE block of a
 * layer, each row computed with the functions above in the order megatron_qarl/numerics/layers.py and ops.py
 * compose them (the learner's moe/exact.py calls those), so the bits are the same; what goes is the Python
 * between the kernels, which costs more than the arithmetic of a decode step.
 * ------------------------------------------------------------------------------------------------------------ */

/* ops.round_to to bfloat16: round to nearest even, widened back (c10's round_to_nearest_even: a NaN becomes its
 * quiet NaN 0x7fc0; torch's vectorized conversion gives 0xffff there, the one difference from x.to(bf16).float()). */
static inline float qx_round_bf16_1(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u = 0x7fc00000u;
        memcpy(&f, &u, 4);
        return f;
    }
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* ops.round_to(x, bfloat16) of n floats, out of place (in place when out == x). */
int qx_round_bf16(const float *x, int64_t n, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) out[i] = qx_round_bf16_1(x[i]);
    return 0;
}

static inline void qx_round_row(float *x, int64_t n, int act_bf16) {
    if (act_bf16)
        for (int64_t i = 0; i < n; i++) x[i] = qx_round_bf16_1(x[i]);
}

/* One row of qx_linear (the same blocks, chunks and additions): out[N] = x[K] @ wt[K, N]; the chunk is ``chunk``
 * where it divides K, else K (ops.chunk_of). */
static void qx_row_linear(const float *xr, int64_t K, const float *wt, int64_t N, int64_t chunk, float *out) {
    const int64_t c = K % chunk == 0 ? chunk : K;
    for (int64_t n0 = 0; n0 < N; n0 += NB) qx_item(xr, K, wt, N, 0, 1, n0, N - n0 < NB ? N - n0 : NB, c, 0, out);
}

#define QX_ACT_EPS 1e-10f /* qat/quantizer.py ACT_EPS */
#define QX_FP8_MAX 448.0f

/* float8_e4m3fn rounding of |f| <= 448 (c10's fp8e4m3fn_from_fp32_value, widened back): below 2^-6 in steps of
 * 2^-9 (one fp32 addition of 2^14 rounds there), above to 3 mantissa bits, nearest even; the sign kept. */
static inline float qx_e4m3(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    float r;
    if (b >= (1087u << 20)) {
        r = NAN; /* a NaN input (finite ones are clamped to 448 first) */
    } else if (b < (121u << 23)) {
        float a;
        memcpy(&a, &b, 4);
        r = (a + 16384.0f) - 16384.0f;
    } else {
        b = (b + 0x7ffffu + ((b >> 20) & 1u)) & 0xfff00000u;
        memcpy(&r, &b, 4);
    }
    return sign ? -r : r;
}

/* float8_e5m2 rounding (c10's fp8e5m2_from_fp32_value, widened back): below 2^-14 in steps of 2^-16 (one fp32
 * addition of 2^7 rounds there), above to 2 mantissa bits, nearest even, a result of 65536 or more (from 61440 up,
 * by rounding) infinite; the sign kept, a NaN a NaN. */
static inline float qx_e5m2(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    float r;
    if (b > 0x7f800000u) {
        r = NAN;
    } else if (b < (113u << 23)) {
        float a;
        memcpy(&a, &b, 4);
        r = (a + 128.0f) - 128.0f;
    } else {
        b = (b + 0xfffffu + ((b >> 21) & 1u)) & 0xffe00000u;
        memcpy(&r, &b, 4);
        if (r >= 65536.0f) r = INFINITY;
    }
    return sign ? -r : r;
}

/* qat/kv_cache.py's kv_round_trip of n floats in place (fmt 0: none): x = act(fp8(act(act(x) / s)) * s), fmt 1
 * e4m3 (a finite overflow saturates to +-448, as c10's cast does), 2 e5m2. */
static void qx_kv_round_row(float *x, int64_t n, int fmt, float s, int act_bf16) {
    if (!fmt) return;
    for (int64_t i = 0; i < n; i++) {
        float v = (act_bf16 ? qx_round_bf16_1(x[i]) : x[i]) / s;
        if (act_bf16) v = qx_round_bf16_1(v);
        if (fmt == 1) {
            v = v < -QX_FP8_MAX ? -QX_FP8_MAX : (v > QX_FP8_MAX ? QX_FP8_MAX : v);
            v = qx_e4m3(v);
        } else {
            v = qx_e5m2(v);
        }
        v = v * s;
        x[i] = act_bf16 ? qx_round_bf16_1(v) : v;
    }
}

/* qx_kv_round_row of n floats, out of place (tests and the learner's exact forward). */
int qx_kv_round(const float *x, int64_t n, int fmt, float s, int act_bf16, float *out) {
    if (fmt < 0 || fmt > 2 || !(s > 0.0f)) return -1;
    memcpy(out, x, sizeof(float) * (size_t)n);
    qx_kv_round_row(out, n, fmt, s, act_bf16);
    return 0;
}

static inline float qx_amax(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (isnan(a)) return a;
        m = a > m ? a : m;
    }
    return m < QX_ACT_EPS ? QX_ACT_EPS : m;
}

/* ops.quant_act into out: quant 0 none (a copy), 1 INT8 per token (quant_act_int8_per_token then its dequant:
 * q = trunc(2t) - trunc(t), t = x * (127 / a), times a / 127), 2 FP8 per token and group of g
 * (quant_act_fp8_per_token_group: e4m3(clamp(x * (448 / a), +-448)) times a * fp32(1 / 448)). */
static void qx_quant_act(const float *x, int64_t K, int quant, int64_t g, float *out) {
    if (quant == 1) {
        const float a = qx_amax(x, K), mult = 127.0f / a, s = a / 127.0f;
        for (int64_t k = 0; k < K; k++) {
            const float t = x[k] * mult;
            out[k] = (truncf(t * 2.0f) - truncf(t)) * s;
        }
    } else if (quant == 2) {
        const float inv448 = (float)(1.0 / 448.0);
        for (int64_t k0 = 0; k0 < K; k0 += g) {
            const float a = qx_amax(x + k0, g), inv = QX_FP8_MAX / a, s = a * inv448;
            for (int64_t k = k0; k < k0 + g; k++) {
                float v = x[k] * inv;
                v = v < -QX_FP8_MAX ? -QX_FP8_MAX : (v > QX_FP8_MAX ? QX_FP8_MAX : v);
                out[k] = qx_e4m3(v) * s;
            }
        }
    } else {
        memcpy(out, x, sizeof(float) * (size_t)K);
    }
}

/* layers.dense of one row: round(quant_act(x) @ W.T); tmp holds K floats. */
static inline void qx_row_dense(const float *x, int64_t K, int quant, int64_t g, const float *wt, int64_t N,
                                int64_t chunk, int act_bf16, float *tmp, float *out) {
    const float *in = x;
    if (quant) {
        qx_quant_act(x, K, quant, g, tmp);
        in = tmp;
    }
    qx_row_linear(in, K, wt, N, chunk, out);
    qx_round_row(out, N, act_bf16);
}

/* An attention block of the engine (serve/exact_forward.py; numerics/layers.py's composition, with the residual):
 *   n = round(rmsnorm(x, ln)); [q | k | v] = dense(n, W_qkv); per head q, k = round(rope(round(rmsnorm(., qn|kn))));
 *   the row's k, v written at (slot, position) of the float32 caches [slots, Hkv, S, D] (as the FP8 cache of format
 *   kv_fmt reads them back, qx_kv_round_row with k_scale / v_scale); then (every row's keys written)
 *   o = round(qx_attention over keys 0 .. pos); x = round(x + dense(o, W_o)).
 * x [R, H] is updated in place; wt operands K-major; cos, sin the rope tables [L, D]; quant / g per linear as
 * qx_quant_act. */
int qx_attn_block(float *x, int64_t R, int64_t H, const float *ln, float eps, const float *qkv_t, int qkv_quant,
                  int64_t qkv_g, const float *qn, const float *kn, const float *cos_t, const float *sin_t,
                  const int64_t *pos, const int64_t *slot, float *kc, float *vc, int64_t S, int64_t Hq, int64_t Hkv,
                  int64_t D, float scale, const float *o_t, int o_quant, int64_t o_g, int64_t chunk, int act_bf16,
                  int kv_fmt, float k_scale, float v_scale, int threads) {
    if (Hkv <= 0 || Hq % Hkv || D % 2 || R <= 0 || kv_fmt < 0 || kv_fmt > 2 || !(k_scale > 0.0f) ||
        !(v_scale > 0.0f))
        return -1;
    const int64_t NQKV = (Hq + 2 * Hkv) * D, HO = Hq * D, half = D / 2;
    float *Q = malloc(sizeof(float) * (size_t)(R * HO)), *O = malloc(sizeof(float) * (size_t)(R * HO));
    int64_t *kbase = malloc(sizeof(int64_t) * (size_t)R), *nkeys = malloc(sizeof(int64_t) * (size_t)R);
    int failed = !Q || !O || !kbase || !nkeys;
    for (int64_t r = 0; r < R && !failed; r++) {
        if (pos[r] < 0 || pos[r] >= S) failed = -1;
        kbase[r] = slot[r] * (Hkv * S * D);
        nkeys[r] = pos[r] + 1;
    }
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *n = malloc(sizeof(float) * (size_t)H), *tmp = malloc(sizeof(float) * (size_t)H),
                  *qkv = malloc(sizeof(float) * (size_t)NQKV), *hd = malloc(sizeof(float) * (size_t)D);
            if (!n || !tmp || !qkv || !hd) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                if (!n || !tmp || !qkv || !hd) continue;
                qx_row_rmsnorm(x + r * H, H, ln, eps, n);
                qx_round_row(n, H, act_bf16);
                qx_row_dense(n, H, qkv_quant, qkv_g, qkv_t, NQKV, chunk, act_bf16, tmp, qkv);
                const float *cs = cos_t + pos[r] * D, *sn = sin_t + pos[r] * D;
                for (int64_t h = 0; h < Hq + Hkv; h++) { /* q heads, then k heads: norm, round, rope, round */
                    const float *src = qkv + h * D;
                    qx_row_rmsnorm(src, D, h < Hq ? qn : kn, eps, hd);
                    qx_round_row(hd, D, act_bf16);
                    float *dst = h < Hq ? Q + r * HO + h * D : kc + kbase[r] + (h - Hq) * S * D + pos[r] * D;
                    for (int64_t i = 0; i < D; i++) {
                        const float a = hd[i] * cs[i], b = hd[i < half ? i + half : i - half] * sn[i];
                        dst[i] = a + b;
                    }
                    qx_round_row(dst, D, act_bf16);
                    if (h >= Hq) qx_kv_round_row(dst, D, kv_fmt, k_scale, act_bf16);
                }
                for (int64_t g = 0; g < Hkv; g++) {
                    float *dst = vc + kbase[r] + g * S * D + pos[r] * D;
                    memcpy(dst, qkv + (Hq + Hkv + g) * D, sizeof(float) * (size_t)D);
                    qx_kv_round_row(dst, D, kv_fmt, v_scale, act_bf16);
                }
            }
            free(n);
            free(tmp);
            free(qkv);
            free(hd);
        }
    }
    if (!failed) failed = qx_attention(Q, R, Hq, Hkv, D, kc, vc, kbase, nkeys, D, S * D, scale, O, threads);
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *tmp = malloc(sizeof(float) * (size_t)HO), *a = malloc(sizeof(float) * (size_t)H);
            if (!tmp || !a) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                if (!tmp || !a) continue;
                float *o = O + r * HO;
                qx_round_row(o, HO, act_bf16);
                qx_row_dense(o, HO, o_quant, o_g, o_t, H, chunk, act_bf16, tmp, a);
                float *xr = x + r * H;
                for (int64_t h = 0; h < H; h++) xr[h] = xr[h] + a[h];
                qx_round_row(xr, H, act_bf16);
            }
            free(tmp);
            free(a);
        }
    }
    free(Q);
    free(O);
    free(kbase);
    free(nkeys);
    return failed == 1 ? -2 : failed;
}

/* A MoE block of the engine (serve/exact_forward.py; numerics/layers.py's composition, with the residual), row by
 * row:
 *   n = round(rmsnorm(x, ln)); p = softmax(n @ W_router.T) (not rounded); the top k of p by a stable descending
 *   order (a tie to the lower expert id), order[k] written to order_out [R, k]; w = p_top / (p_1 + ... + p_k)
 *   (summed in top-k order) with norm_topk; experts taken in ascending id: h = round(silu(g) * u) with [g | u] =
 *   dense(n, W_gu[e]), y_e = dense(h, W_down[e]); acc = w_0 y_0, acc = acc + w_j y_j; x = round(x + round(acc)).
 * gu_t[e] [H, 2F] and down_t[e] [F, H] K-major; router_t [H, E]. */
int qx_moe_block(float *x, int64_t R, int64_t H, const float *ln, float eps, const float *router_t, int64_t E,
                 int64_t topk, int norm_topk, const float *const *gu_t, const float *const *down_t, int64_t F,
                 int gu_quant, int64_t gu_g, int down_quant, int64_t down_g, int64_t chunk, int act_bf16,
                 int64_t *order_out, int threads) {
    if (R <= 0 || topk <= 0 || topk > E) return -1;
    const int64_t wide = H > 2 * F ? H : 2 * F;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *n = malloc(sizeof(float) * (size_t)H), *p = malloc(sizeof(float) * (size_t)E),
              *tmp = malloc(sizeof(float) * (size_t)(wide > E ? wide : E)),
              *gu = malloc(sizeof(float) * (size_t)(2 * F)), *hh = malloc(sizeof(float) * (size_t)F),
              *y = malloc(sizeof(float) * (size_t)H), *acc = malloc(sizeof(float) * (size_t)H),
              *top = malloc(sizeof(float) * (size_t)topk);
        int64_t *order = malloc(sizeof(int64_t) * (size_t)topk), *ids = malloc(sizeof(int64_t) * (size_t)topk);
        char *taken = malloc((size_t)E);
        const int ok = n && p && tmp && gu && hh && y && acc && top && order && ids && taken;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (!ok) continue;
            float *xr = x + r * H;
            qx_row_rmsnorm(xr, H, ln, eps, n);
            qx_round_row(n, H, act_bf16);
            qx_row_linear(n, H, router_t, E, chunk, tmp);
            qx_row_softmax(tmp, E, 0, p);
            memset(taken, 0, (size_t)E);
            for (int64_t i = 0; i < topk; i++) { /* stable descending: the first of the largest not yet taken */
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++)
                    if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
                taken[best] = 1;
                order[i] = best;
                top[i] = p[best];
            }
            if (norm_topk) {
                float sum = top[0];
                for (int64_t i = 1; i < topk; i++) sum = sum + top[i];
                for (int64_t i = 0; i < topk; i++) top[i] = top[i] / sum;
            }
            for (int64_t i = 0; i < topk; i++) order_out[r * topk + i] = order[i];
            int64_t m = 0; /* ids ascending: taken[] marks them */
            for (int64_t e = 0; e < E; e++)
                if (taken[e]) ids[m++] = e;
            for (int64_t j = 0; j < topk; j++) {
                const int64_t e = ids[j];
                float w = 0.0f;
                for (int64_t i = 0; i < topk; i++)
                    if (order[i] == e) w = top[i];
                qx_row_dense(n, H, gu_quant, gu_g, gu_t[e], 2 * F, chunk, act_bf16, tmp, gu);
                for (int64_t f = 0; f < F; f++) hh[f] = qx_silu1(gu[f], gu[F + f]);
                qx_round_row(hh, F, act_bf16);
                qx_row_dense(hh, F, down_quant, down_g, down_t[e], H, chunk, act_bf16, tmp, y);
                if (j == 0)
                    for (int64_t h = 0; h < H; h++) acc[h] = w * y[h];
                else
                    for (int64_t h = 0; h < H; h++) acc[h] = acc[h] + w * y[h];
            }
            qx_round_row(acc, H, act_bf16);
            for (int64_t h = 0; h < H; h++) xr[h] = xr[h] + acc[h];
            qx_round_row(xr, H, act_bf16);
        }
        free(n), free(p), free(tmp), free(gu), free(hh), free(y), free(acc), free(top), free(order), free(ids);
        free(taken);
    }
    return failed ? -2 : 0;
}
