/* y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]) for the few rows of a decode step, float32, all
 * contiguous. The output rows are split in `threads` contiguous ranges (multiples of 4), one
 * per OpenMP thread; each row of w is read once from memory, in order within its block.
 * Built and loaded by cpu_gemv.py, which loads it after torch so that the OpenMP runtime it
 * links (libgomp.so.1) is torch's own, with torch's thread pool.
 *
 * With AVX-512, one or two rows take each weight row alone (`dot`: one stream, the plain
 * read's rate; the blocks measured 5-10% slower at two rows). Three or more rows are
 * register-blocked: 4 weight rows by up to 4 input rows of accumulators (16 zmm), each weight vector loaded once for every input row and each input
 * vector once for the 4 weight rows (8 loads per 16 FMAs instead of 32), and the block's 16
 * sums reduced together by a transpose-and-add (`reduce16`) instead of one horizontal
 * reduction per (output, row). Above 4 rows the block's weight rows are read again for the
 * next 4 input rows, from the cache. K tails are masked loads; the last N % 4 outputs use
 * `dot`. With AVX2 and FMA (no AVX-512), blocks of 4 weight rows by 2 input rows (16 ymm
 * registers), each accumulator summed across at the end. Otherwise a plain vectorizable loop
 * per (output, row). */
#include <omp.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#define OB 4 /* outputs (weight rows) per block */
#define RB 4 /* input rows per block */
#define BLOCK_MIN_ROWS 3 /* fewer rows: one dot product per output and row */

#ifdef __AVX512F__
#include <immintrin.h>
static inline float dot(const float *x, const float *w, long K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(w + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(w + k + 48), a3);
    }
    for (; k + 16 <= K; k += 16)
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* The 16 lane-sums of v[0..15] in one vector: lane 4 * L + p holds the sum of v[4 * p + L].
 * Four levels, each adding two vectors' halves: 256-bit halves, 128-bit lanes, then pairs and
 * single floats within each lane (15 adds and 30 shuffles for 16 sums). */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) /* [v2j's half-sum (256 bits) | v2j+1's] */
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++) /* 128-bit lane L: v[4j + L]'s quarter-sum */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) /* lane L: v[8j + L] at floats 0, 2; v[8j + 4 + L] at 1, 3 */
        c[j] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * j], b[2 * j + 1]),
                             _mm512_unpackhi_ps(b[2 * j], b[2 * j + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
}

/* y[m, o + j] for j < 4 and m < R (R <= 4, a constant where inlined): the rows x[0..R) (row
 * stride K) by the weight rows w[0..4) (stride K); y has row stride N. */
static inline __attribute__((always_inline)) void block(const float *x, const float *w,
                                                        const float *b, float *y, long N,
                                                        long K, int R, int ahead) {
    __m512 acc[RB * OB]; /* acc[4 * o + m]: so reduce16 puts (o, m) in lane 4 * m + o */
    for (int i = 0; i < RB * OB; i++) acc[i] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + K + k);
        __m512 w2 = _mm512_loadu_ps(w + 2 * K + k), w3 = _mm512_loadu_ps(w + 3 * K + k);
        /* in registers: GCC would otherwise fold each load into every FMA that uses it */
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
        if (ahead) { /* the next block's 4 rows, in address order */
            const char *p = (const char *)(w + OB * K + OB * k);
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
            _mm_prefetch(p + 128, _MM_HINT_T0);
            _mm_prefetch(p + 192, _MM_HINT_T0);
        }
        for (int m = 0; m < R; m++) {
            __m512 xm = _mm512_loadu_ps(x + m * K + k);
            __asm__("" : "+v"(xm)); /* likewise: one load for the 4 weight rows */
            acc[m] = _mm512_fmadd_ps(xm, w0, acc[m]);
            acc[4 + m] = _mm512_fmadd_ps(xm, w1, acc[4 + m]);
            acc[8 + m] = _mm512_fmadd_ps(xm, w2, acc[8 + m]);
            acc[12 + m] = _mm512_fmadd_ps(xm, w3, acc[12 + m]);
        }
    }
    if (k < K) {
        __mmask16 t = (__mmask16)((1u << (K - k)) - 1);
        __m512 w0 = _mm512_maskz_loadu_ps(t, w + k), w1 = _mm512_maskz_loadu_ps(t, w + K + k);
        __m512 w2 = _mm512_maskz_loadu_ps(t, w + 2 * K + k);
        __m512 w3 = _mm512_maskz_loadu_ps(t, w + 3 * K + k);
        for (int m = 0; m < R; m++) {
            __m512 xm = _mm512_maskz_loadu_ps(t, x + m * K + k);
            acc[m] = _mm512_fmadd_ps(xm, w0, acc[m]);
            acc[4 + m] = _mm512_fmadd_ps(xm, w1, acc[4 + m]);
            acc[8 + m] = _mm512_fmadd_ps(xm, w2, acc[8 + m]);
            acc[12 + m] = _mm512_fmadd_ps(xm, w3, acc[12 + m]);
        }
    }
    __m512 s = reduce16(acc); /* 128-bit lane m: outputs o .. o + 3 of row m */
    if (b) s = _mm512_add_ps(s, _mm512_broadcast_f32x4(_mm_loadu_ps(b)));
    float out[RB * OB];
    _mm512_storeu_ps(out, s);
    for (int m = 0; m < R; m++) memcpy(y + m * N, out + 4 * m, OB * sizeof(float));
}

/* Outputs [lo, hi) in blocks of OB for all M rows; returns the first output left over. */
static long blocked(const float *x, const float *w, const float *b, float *y, long M, long N,
                    long K, long lo, long hi) {
    long o = lo;
    for (; o + OB <= hi; o += OB) {
        const float *wo = w + o * K, *bo = b ? b + o : 0;
        for (long m = 0; m < M; m += RB) {
            const float *xm = x + m * K;
            float *ym = y + m * N + o;
            switch (M - m < RB ? M - m : RB) {
            case 1: block(xm, wo, bo, ym, N, K, 1, m == 0); break;
            case 2: block(xm, wo, bo, ym, N, K, 2, m == 0); break;
            case 3: block(xm, wo, bo, ym, N, K, 3, m == 0); break;
            default: block(xm, wo, bo, ym, N, K, 4, m == 0); break;
            }
        }
    }
    return o;
}
#elif defined(KVFLOW_AVX2)
static inline float dot(const float *x, const float *w, long K) { return dot8(x, w, K); }

/* AVX2 (16 registers): 4 weight rows by 2 input rows of accumulators, each weight vector
 * loaded once for both rows and each input vector once for the 4 weight rows. */
static inline __attribute__((always_inline)) void block2(const float *x, const float *w,
                                                         const float *b, float *y, long N,
                                                         long K, int R) {
    __m256 acc[2][OB];
    for (int m = 0; m < 2; m++)
        for (int o = 0; o < OB; o++) acc[m][o] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[OB];
        for (int o = 0; o < OB; o++) wv[o] = _mm256_loadu_ps(w + o * K + k);
        for (int m = 0; m < R; m++) {
            __m256 xm = _mm256_loadu_ps(x + m * K + k);
            for (int o = 0; o < OB; o++) acc[m][o] = _mm256_fmadd_ps(xm, wv[o], acc[m][o]);
        }
    }
    if (k < K) { /* the masked tail */
        __m256i t = lanes8(K - k);
        __m256 wv[OB];
        for (int o = 0; o < OB; o++) wv[o] = _mm256_maskload_ps(w + o * K + k, t);
        for (int m = 0; m < R; m++) {
            __m256 xm = _mm256_maskload_ps(x + m * K + k, t);
            for (int o = 0; o < OB; o++) acc[m][o] = _mm256_fmadd_ps(xm, wv[o], acc[m][o]);
        }
    }
    for (int m = 0; m < R; m++)
        for (int o = 0; o < OB; o++) y[m * N + o] = hsum8(acc[m][o]) + (b ? b[o] : 0.0f);
}

static long blocked(const float *x, const float *w, const float *b, float *y, long M, long N,
                    long K, long lo, long hi) {
    long o = lo;
    for (; o + OB <= hi; o += OB) {
        const float *wo = w + o * K, *bo = b ? b + o : 0;
        for (long m = 0; m < M; m += 2) {
            if (M - m >= 2) block2(x + m * K, wo, bo, y + m * N + o, N, K, 2);
            else block2(x + m * K, wo, bo, y + m * N + o, N, K, 1);
        }
    }
    return o;
}
#else
static inline float dot(const float *x, const float *w, long K) {
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (long k = 0; k < K; k++) a += x[k] * w[k];
    return a;
}

static long blocked(const float *x, const float *w, const float *b, float *y, long M, long N,
                    long K, long lo, long hi) {
    (void)x, (void)w, (void)b, (void)y, (void)M, (void)N, (void)K, (void)hi;
    return lo; /* no blocked path without AVX2 */
}
#endif

/* Outputs [lo, hi) of every row: blocked from block_min rows on (where this CPU has a blocked
 * path), the rest one dot product per output and row. */
static void rows(const float *x, const float *w, const float *b, float *y, long M, long N,
                 long K, long lo, long hi, long block_min) {
    long o = M >= block_min ? blocked(x, w, b, y, M, N, K, lo, hi) : lo;
    for (; o < hi; o++) {
        const float *wr = w + o * K;
        for (long m = 0; m < M; m++) y[m * N + o] = dot(x + m * K, wr, K) + (b ? b[o] : 0.0f);
    }
}

/* y = x W^T + b. With M >= block_min rows, the rows are register-blocked; with fewer, one
 * dot product per output and row (block_min > M: the kernel before blocking, which
 * kvflow.tools.bench.gemv measures against). */
void kvflow_gemv_blocked_from(const float *x, const float *w, const float *b, float *y, long M,
                              long N, long K, long threads, long block_min) {
    if (threads <= 1 || N < 64) {
        rows(x, w, b, y, M, N, K, 0, N, block_min);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), n = omp_get_num_threads();
        long step = ((N + n - 1) / n + OB - 1) / OB * OB; /* whole blocks per thread */
        long lo = t * step, hi = lo + step < N ? lo + step : N;
        if (lo < hi) rows(x, w, b, y, M, N, K, lo, hi, block_min);
    }
}

void kvflow_gemv(const float *x, const float *w, const float *b, float *y, long M, long N,
                 long K, long threads) {
    kvflow_gemv_blocked_from(x, w, b, y, M, N, K, threads, BLOCK_MIN_ROWS);
}
