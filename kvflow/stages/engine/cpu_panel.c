/* y[M, N] = x[M, K] @ W^T (+ b[N]) for float32 on a copy of W packed in panels of 16 outputs:
 * p[q][k][j] = W[16 q + j][k] (zero past N), so that one step of k reads 16 consecutive
 * weights of 16 outputs (cpu_panel.py packs it, once per weight).
 *
 * With AVX2 and FMA (no AVX-512): the outer-product form of BLIS' Haswell kernel. Up to 6 rows
 * of x by one panel are 12 accumulators (6 rows x 2 vectors of 8 outputs); each k loads the
 * panel's 2 vectors once for the 6 rows and broadcasts each row's x[m, k] once for both: 8
 * loads per 12 FMAs, no horizontal sums (the dot-product form of cpu_gemv.c reduces each
 * accumulator across its lanes at the end, and above 2 rows re-reads its weight block per
 * pair of rows). The panels are handed out two at a time to the OpenMP threads as they come
 * free; a thread runs all M rows on a panel, 6 at a time, while the panel (K x 64 bytes)
 * stays in its L2.
 * Measured on a 2-core AMD EPYC (Zen 3) against oneDNN on its prepacked weight, SmolLM2-135M's
 * decoder linears: faster at every row count from 1 to 1,024 (docs/performance.md).
 *
 * Each output is the sum, in order, of the running sums of its products over k in chunks of
 * 256 (one running sum over 1,536 products drifted 1.3e-4 from transformers' logits of the
 * default model, past the 1e-4 its test allows), whatever M, the row group or the
 * thread count: the same input row gives the same bits in any batch. Elsewhere (AVX-512 builds,
 * plain builds), a plain loop of the same order computes it (`kvflow_panel_fast` says 0:
 * the default backends there are oneDNN's or MKL's, onednn_linear.py). */
#include <omp.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#define NR 16 /* outputs per panel */
#define MR 6  /* rows per register block */
#define KC 256 /* k per partial sum: the sums of 256 products are added up, in order */

#if defined(KVFLOW_AVX2)
long kvflow_panel_fast(void) { return 1; }

/* y[m, 0 .. ncols) for m < R (R <= 6, a constant where inlined): rows x (stride K) by the
 * panel p [K][16]; y has row stride N. */
static inline __attribute__((always_inline)) void block(const float *x, const float *p,
                                                        const float *b, float *y, long N,
                                                        long K, int R, long ncols) {
    float t[MR][NR]; /* the chunks' running total, in memory: the registers hold a chunk */
    for (long k0 = 0; k0 < K || k0 == 0; k0 += KC) {
        long k1 = k0 + KC < K ? k0 + KC : K;
        __m256 a[MR][2];
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
        for (long k = k0; k < k1; k++) {
            __m256 w0 = _mm256_loadu_ps(p + k * NR), w1 = _mm256_loadu_ps(p + k * NR + 8);
            for (int m = 0; m < R; m++) {
                __m256 xm = _mm256_broadcast_ss(x + m * K + k);
                a[m][0] = _mm256_fmadd_ps(xm, w0, a[m][0]);
                a[m][1] = _mm256_fmadd_ps(xm, w1, a[m][1]);
            }
        }
        for (int m = 0; m < R; m++) {
            if (k0) {
                a[m][0] = _mm256_add_ps(_mm256_loadu_ps(t[m]), a[m][0]);
                a[m][1] = _mm256_add_ps(_mm256_loadu_ps(t[m] + 8), a[m][1]);
            }
            _mm256_storeu_ps(t[m], a[m][0]);
            _mm256_storeu_ps(t[m] + 8, a[m][1]);
        }
    }
    __m256 b0 = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();
    __m256 b1 = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();
    for (int m = 0; m < R; m++) {
        __m256 s0 = _mm256_loadu_ps(t[m]), s1 = _mm256_loadu_ps(t[m] + 8);
        if (b) s0 = _mm256_add_ps(s0, b0), s1 = _mm256_add_ps(s1, b1);
        if (ncols == NR) {
            _mm256_storeu_ps(y + m * N, s0);
            _mm256_storeu_ps(y + m * N + 8, s1);
        } else { /* the last panel of an N that is not a multiple of 16 */
            float o[NR];
            _mm256_storeu_ps(o, s0);
            _mm256_storeu_ps(o + 8, s1);
            memcpy(y + m * N, o, ncols * sizeof(float));
        }
    }
}

/* Panel q for every row, MR rows at a time. */
static void panel(const float *x, const float *p, const float *b, float *y, long M, long N,
                  long K, long q) {
    long n0 = q * NR, nc = N - n0 < NR ? N - n0 : NR;
    const float *pq = p + q * K * NR;
    float bt[NR]; /* the bias of a partial panel, zero-padded: the loads read 16 */
    const float *bq = 0;
    if (b) {
        if (nc == NR) bq = b + n0;
        else {
            memset(bt, 0, sizeof bt);
            memcpy(bt, b + n0, nc * sizeof(float));
            bq = bt;
        }
    }
    for (long m = 0; m < M; m += MR) {
        const float *xm = x + m * K;
        float *ym = y + m * N + n0;
        switch (M - m < MR ? M - m : MR) {
        case 1: block(xm, pq, bq, ym, N, K, 1, nc); break;
        case 2: block(xm, pq, bq, ym, N, K, 2, nc); break;
        case 3: block(xm, pq, bq, ym, N, K, 3, nc); break;
        case 4: block(xm, pq, bq, ym, N, K, 4, nc); break;
        case 5: block(xm, pq, bq, ym, N, K, 5, nc); break;
        default: block(xm, pq, bq, ym, N, K, 6, nc); break;
        }
    }
}
#else
long kvflow_panel_fast(void) { return 0; }

static void panel(const float *x, const float *p, const float *b, float *y, long M, long N,
                  long K, long q) {
    long n0 = q * NR, nc = N - n0 < NR ? N - n0 : NR;
    const float *pq = p + q * K * NR;
    for (long m = 0; m < M; m++) {
        float tot[NR] = {0};
        for (long k0 = 0; k0 < K; k0 += KC) {
            long k1 = k0 + KC < K ? k0 + KC : K;
            float acc[NR] = {0};
            for (long k = k0; k < k1; k++) {
                float xv = x[m * K + k];
#pragma omp simd
                for (int j = 0; j < NR; j++) acc[j] += xv * pq[k * NR + j];
            }
            for (int j = 0; j < NR; j++) tot[j] += acc[j];
        }
        for (long j = 0; j < nc; j++) y[m * N + n0 + j] = tot[j] + (b ? b[n0 + j] : 0.0f);
    }
}
#endif

void kvflow_panel_gemm(const float *x, const float *p, const float *b, float *y, long M, long N,
                       long K, long threads) {
    long panels = (N + NR - 1) / NR;
    if (threads <= 1 || panels < 2 * threads) {
        for (long q = 0; q < panels; q++) panel(x, p, b, y, M, N, K, q);
        return;
    }
    /* Two panels at a time to whichever thread is free: a thread that the server's other
     * threads (its event loop, the streams) take a core from does fewer, rather than the
     * other waiting for it at the end (docs/performance.md, "Panels handed out as threads
     * come free"). */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2)
    for (long q = 0; q < panels; q++) panel(x, p, b, y, M, N, K, q);
}
