/* SIMD helpers shared by the CPU kernels (included by cpu_fused.c, cpu_attn.c and
 * cpu_prefill.c; the build in cpu_kernels.py hashes this header with the sources). */
#ifndef KVFLOW_CPU_SIMD_H
#define KVFLOW_CPU_SIMD_H

#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf polynomial, scaled by
 * 2^n with scalef (which gives 0, denormals and inf where e^x has them). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* 2^x for x <= 0, within 2e-7 relative (Cephes' exp2f polynomial on [-0.5, 0.5]); below
 * -125 it is 2^-125 (a normal float: no denormal reaches the sums and products). */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The lanes of a 16-float vector that hold the first `left` floats (all 16, or none). */
static inline __mmask16 lanes(long left) {
    return left >= 16 ? (__mmask16)0xFFFF
                      : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The same polynomials on 8 lanes (AVX2 with FMA, no AVX-512: Zen 2/3, Haswell to Alder
 * Lake). 2^n is made from its exponent bits and multiplied in, in two halves where |n| may
 * pass 126, so that e^x still gives 0, denormals and inf where it has them. */
static inline __m256 pow2i8(__m256i n) { /* 2^n for -126 <= n <= 127 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1); /* n in [-150, 129] */
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2i8(half)), pow2i8(_mm256_sub_epi32(ni, half)));
}

/* 2^x for x <= 0, as exp2_16: below -125 it is 2^-125. */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(p, pow2i8(_mm256_cvtps_epi32(n)));
}

/* The lanes of an 8-float vector that hold the first `left` floats, for maskload/maskstore. */
static inline __m256i lanes8(long left) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int k = left >= 8 ? 8 : (left <= 0 ? 0 : (int)left);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), idx);
}

/* A masked load, a plain one where all 8 lanes are wanted (`full`, a constant where inlined:
 * the inner loops then carry no masks). */
static inline __attribute__((always_inline)) __m256 load8(const float *p, __m256i m, int full) {
    return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
}

/* The sum of 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sum x[k] w[k] over k < K: 4 accumulators, a masked tail. */
static inline float dot8(const float *x, const float *w, long K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
    }
    for (; k < K; k += 8) {
        __m256i m = lanes8(K - k);
        a0 = _mm256_fmadd_ps(_mm256_maskload_ps(x + k, m), _mm256_maskload_ps(w + k, m), a0);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

#define KVFLOW_AVX2 1
#endif /* __AVX512F__, __AVX2__ */
#endif /* KVFLOW_CPU_SIMD_H */
