/* y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]) for the few rows of a decode step, float32, all
 * contiguous. The output rows are split in `threads` contiguous ranges, one per OpenMP
 * thread; each row of w is read once, from memory, in order (the product is bound by that
 * read). Built and loaded by cpu_gemv.py, which loads it after torch so that the OpenMP
 * runtime it links (libgomp.so.1) is torch's own, with torch's thread pool. */
#include <omp.h>

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
#else
static inline float dot(const float *x, const float *w, long K) {
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (long k = 0; k < K; k++) a += x[k] * w[k];
    return a;
}
#endif

static void rows(const float *x, const float *w, const float *b, float *y, long M, long N,
                 long K, long lo, long hi) {
    for (long o = lo; o < hi; o++) {
        const float *wr = w + o * K;
        for (long m = 0; m < M; m++) y[m * N + o] = dot(x + m * K, wr, K) + (b ? b[o] : 0.0f);
    }
}

void kvflow_gemv(const float *x, const float *w, const float *b, float *y, long M, long N,
                 long K, long threads) {
    if (threads <= 1 || N < 64) {
        rows(x, w, b, y, M, N, K, 0, N);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), n = omp_get_num_threads();
        long step = (N + n - 1) / n;
        long lo = t * step, hi = lo + step < N ? lo + step : N;
        if (lo < hi) rows(x, w, b, y, M, N, K, lo, hi);
    }
}
