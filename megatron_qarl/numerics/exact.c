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
 * x [M, K] row-major, the weight given K-major: wt [K, N] (w transposed). The loop runs over blocks of NB outputs
 * at once (one x element times NB weights: the compiler vectorizes across n, which changes no output's order; the
 * block is compiled for AVX2 and for plain x86-64, chosen per CPU, with the same results). */
#define NB 32

/* acc[j] = sum over k in [k0, k1) in ascending k of xr[k] * wt[k * N + n0 + j], j < len (len <= NB). */
__attribute__((target_clones("avx2", "default")))
static void qx_block(const float *xr, const float *wt, int64_t N, int64_t n0, int64_t len, int64_t k0, int64_t k1,
                     float *acc) {
    if (len == NB) {  /* a constant trip count: the accumulators stay in vector registers */
        float a[NB];
        for (int j = 0; j < NB; j++) a[j] = 0.0f;
        for (int64_t k = k0; k < k1; k++) {
            const float xv = xr[k];
            const float *wr = wt + k * N + n0;
            for (int j = 0; j < NB; j++) a[j] += xv * wr[j];
        }
        for (int j = 0; j < NB; j++) acc[j] = a[j];
        return;
    }
    for (int64_t j = 0; j < len; j++) acc[j] = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        const float xv = xr[k];
        const float *wr = wt + k * N + n0;
        for (int64_t j = 0; j < len; j++) acc[j] += xv * wr[j];
    }
}

/* Two rows at once over a full block (len == NB): rows m and m + 1 share each weight load, and their 2 x NB
 * accumulators are independent chains (twice the additions in flight); each output's order is qx_block's. */
__attribute__((target_clones("avx2", "default")))
static void qx_block2(const float *x0, const float *x1, const float *wt, int64_t N, int64_t n0, int64_t k0,
                      int64_t k1, float *acc0, float *acc1) {
    float a[NB], b[NB];
    for (int j = 0; j < NB; j++) a[j] = b[j] = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        const float xv0 = x0[k], xv1 = x1[k];
        const float *wr = wt + k * N + n0;
        for (int j = 0; j < NB; j++) {
            a[j] += xv0 * wr[j];
            b[j] += xv1 * wr[j];
        }
    }
    for (int j = 0; j < NB; j++) {
        acc0[j] = a[j];
        acc1[j] = b[j];
    }
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

int qx_linear(const float *x, int64_t M, int64_t K, const float *wt, int64_t N, int64_t chunk, int partials,
              float *out, int threads) {
    if (chunk <= 0 || K % chunk) return -1;
    const int64_t nc = K / chunk, nblocks = (N + NB - 1) / NB, pairs = (M + 1) / 2;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t mp = 0; mp < pairs; mp++)
        for (int64_t bi = 0; bi < nblocks; bi++) {
            const int64_t m0 = 2 * mp, rows = M - m0 < 2 ? 1 : 2;
            const int64_t n0 = bi * NB, len = N - n0 < NB ? N - n0 : NB;
            float acc[2][NB], tot[2][NB];
            for (int64_t c = 0; c < nc; c++) {
                if (rows == 2 && len == NB)
                    qx_block2(x + m0 * K, x + (m0 + 1) * K, wt, N, n0, c * chunk, (c + 1) * chunk, acc[0], acc[1]);
                else
                    for (int64_t r = 0; r < rows; r++)
                        qx_block(x + (m0 + r) * K, wt, N, n0, len, c * chunk, (c + 1) * chunk, acc[r]);
                for (int64_t r = 0; r < rows; r++)
                    qx_take(out, tot[r], acc[r], m0 + r, N, n0, len, c, nc, partials);
            }
            if (!partials)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t j = 0; j < len; j++) out[(m0 + r) * N + n0 + j] = tot[r][j];
        }
    return 0;
}

/* RMSNorm of each row: r = 1 / sqrtf(qx_dot(x, x) / H + eps); y[h] = (x[h] * r) * w[h]. */
int qx_rmsnorm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * H;
        const float ms = qx_dot(xr, xr, H) / (float)H;
        const float r = 1.0f / sqrtf(ms + eps);
        for (int64_t h = 0; h < H; h++) out[m * H + h] = (xr[h] * r) * w[h];
    }
    return 0;
}

/* SiLU(g) * u elementwise: (g / (1 + expf(-g))) * u. */
int qx_silu_mul(const float *g, const float *u, int64_t n, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) out[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
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

/* softmax (log_ != 0: log-softmax) of each row of x [M, V]: e = expf(x - max) / sum, or x - (max + logf(sum)). */
int qx_softmax(const float *x, int64_t M, int64_t V, int log_, float *out, int threads) {
    if (V <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * V;
        float mx;
        const float s = qx_row_expsum(xr, V, &mx);
        if (log_) {
            const float lse = mx + logf(s);
            for (int64_t v = 0; v < V; v++) out[m * V + v] = xr[v] - lse;
        } else {
            for (int64_t v = 0; v < V; v++) out[m * V + v] = expf(xr[v] - mx) / s;
        }
    }
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
