/* Fused float32 elementwise steps of the decoder layer, each one pass over its rows (built
 * with cpu_gemv.c into one library by cpu_kernels.py; bound and dispatched by cpu_fused.py):
 *
 * - kvflow_add_rms_norm: x += delta (in place, the residual stream), out = RMSNorm(x) * w;
 * - kvflow_rope: RoPE applied in place to [T, heads, d] rows (q and k of the qkv output);
 * - kvflow_silu_mul: out = SiLU(gate) * up from the fused gate/up output [T, 2I].
 *
 * Every product and sum rounds where torch's ops round (the library is built with
 * -ffp-contract=off: no multiply-add is contracted): the residual add and RoPE give torch's
 * bits; RMSNorm differs from torch only in the order of its sum of squares, SiLU in its exp
 * (a polynomial within ~1 ulp of expf). Rows are split over `threads` OpenMP threads (torch's
 * pool) when there are enough of them to pay for the fork. */
#include <math.h>
#include <omp.h>

/* Below this many elements a call runs on the calling thread (a decode step's few rows). */
#define PARALLEL_MIN 16384L


#include "cpu_kernels.h"
#include "cpu_simd.h"

#ifdef __AVX512F__

static inline float sum_squares(const float *x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long j = 0;
    for (; j + 32 <= n; j += 32) {
        __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(v0, v0));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(v1, v1));
    }
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(v, v));
    }
    if (j < n) {
        __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (n - j)) - 1), x + j);
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(v, v));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static inline void silu_mul_row(const float *g, const float *u, float *o, long n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (long j = 0; j < n; j += 16) {
        __mmask16 m = lanes(n - j);
        __m512 x = _mm512_maskz_loadu_ps(m, g + j);
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + j)));
    }
}
#elif defined(KVFLOW_AVX2)
static inline float sum_squares(const float *x, long n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
    }
    for (; j < n; j += 8) {
        __m256 v = _mm256_maskload_ps(x + j, lanes8(n - j));
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v, v));
    }
    return hsum8(_mm256_add_ps(a0, a1));
}

static inline void silu_mul_row(const float *g, const float *u, float *o, long n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (long j = 0; j < n; j += 8) {
        __m256i m = lanes8(n - j);
        __m256 x = _mm256_maskload_ps(g + j, m);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_maskstore_ps(o + j, m, _mm256_mul_ps(s, _mm256_maskload_ps(u + j, m)));
    }
}
#else
static inline float sum_squares(const float *x, long n) {
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (long j = 0; j < n; j++) a += x[j] * x[j];
    return a;
}

static inline void silu_mul_row(const float *g, const float *u, float *o, long n) {
    for (long j = 0; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}
#endif

static inline void add_norm_row(float *x, const float *delta, const float *w, float *out, long n,
                                float eps) {
    if (delta) {
#pragma omp simd
        for (long j = 0; j < n; j++) x[j] = x[j] + delta[j];
    }
    /* torch: x * rsqrt(mean(x^2) + eps) * w, rsqrt as 1 / sqrt, the mean as sum / n */
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
#pragma omp simd
    for (long j = 0; j < n; j++) out[j] = (x[j] * r) * w[j];
}

/* x[rows, n] (row stride xs) += delta (row stride ds; NULL: no add), then out[rows, n] (row
 * stride os) = RMSNorm(x) * w. */
void kvflow_add_rms_norm(float *x, long xs, const float *delta, long ds, const float *w, float *out,
                         long os, long rows, long n, float eps, long threads) {
#pragma omp parallel for if (rows > 1 && rows * n >= PARALLEL_MIN) num_threads(threads) \
    schedule(static)
    for (long i = 0; i < rows; i++)
        add_norm_row(x + i * xs, delta ? delta + i * ds : 0, w, out + i * os, n, eps);
}

/* x[rows, heads, d] (strides ts, hs, 1) rotated in place by cos and the signed sin (first half
 * negated) [rows, d] (row stride cs): x * cos + cat(x2, x1) * signed_sin, as rope.py computes. */
void kvflow_rope(float *x, long ts, long hs, long heads, long d, const float *cos,
                 const float *sin, long cs, long rows, long threads) {
    long half = d / 2;
#pragma omp parallel for if (rows > 1 && rows * heads * d >= PARALLEL_MIN) num_threads(threads) \
    schedule(static)
    for (long i = 0; i < rows; i++) {
        const float *c = cos + i * cs, *s = sin + i * cs;
        for (long h = 0; h < heads; h++) {
            float *a = x + i * ts + h * hs, *b = a + half;
#pragma omp simd
            for (long j = 0; j < half; j++) {
                float x1 = a[j], x2 = b[j];
                a[j] = x1 * c[j] + x2 * s[j];
                b[j] = x2 * c[half + j] + x1 * s[half + j];
            }
        }
    }
}

/* gu[rows, 2n] (row stride gs: gate columns, then up) -> out[rows, n] (contiguous) =
 * SiLU(gate) * up, SiLU as torch computes it: x / (1 + e^-x). */
void kvflow_silu_mul(const float *gu, long gs, float *out, long rows, long n, long threads) {
#pragma omp parallel for if (rows > 1 && rows * n >= PARALLEL_MIN) num_threads(threads) \
    schedule(static)
    for (long i = 0; i < rows; i++) silu_mul_row(gu + i * gs, gu + i * gs + n, out + i * n, n);
}
