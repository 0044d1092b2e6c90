/* Paged decode attention for float32 on the CPU: each query row attends to its keys where they
 * lie in the KV page pool, through its own page list (no gather into a contiguous context).
 * Built with the other kernels into one library by cpu_kernels.py; bound by cpu_attn.py.
 *
 * A row r has Q queries per KV head (the query heads that share it, grouped-query attention)
 * and attends to the keys at table positions [lo_r, hi_r): key t lies in page
 * table[r][t / block], slot t % block. Each (row, KV head, part of the keys) is one work item
 * computed in one pass with an online softmax (flash style: a running maximum m, a running
 * sum l of e^(s - m) and a running sum of e^(s - m) v, rescaled when m grows), in tiles of at
 * most TILE keys within a page. A long row is split into parts so that a few rows still give
 * every thread work; the parts of a row are merged by their maxima and sums, the same merge
 * the log-sum-exp gives. Scores are q.k * scale, as torch's scaled_dot_product_attention. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

/* Keys per tile: a tile's scores stay in a stack buffer, its K and V rows in L1/L2. */
#define TILE 64L
/* Below this many query-key products a call runs on the calling thread. */
#define PARALLEL_MIN 8192L
/* A part of a row has at least this many keys (a work item pays for its own merge). */
#define PART_MIN 256L

#ifdef __AVX512F__
static inline float dot(const float *a, const float *b, long d) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    long j = 0;
    for (; j + 32 <= d; j += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), acc1);
    }
    for (; j < d; j += 16) {
        __mmask16 m = d - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - j)) - 1);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), _mm512_maskz_loadu_ps(m, b + j),
                               acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* The sums of a[0..15] (16 lanes each) as one vector: lane j holds the sum of a[j]. Pairs
 * of vectors are interleaved and added (4 lanes of 128 bits each keep partial sums of 2, then
 * 4 vectors), then the 128-bit lanes are added across: 45 operations for 16 sums. */
static inline __m512 sum16(__m512 *a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even),
                               _mm512_shuffle_f32x4(u[0], u[1], odd));
    __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even),
                               _mm512_shuffle_f32x4(u[2], u[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, even),
                         _mm512_shuffle_f32x4(v01, v23, odd));
}

/* s[j] = q.k[j] * scale for the n keys k (row stride ks); returns the largest. Keys go 16 at
 * a time, each with its own accumulator, summed across by `sum16`. */
static inline float scores(const float *q, const float *k, long ks, long n, long d, float scale,
                           float *s) {
    __m512 top = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 a[16];
        for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();
        for (long c = 0; c < d; c += 16) {
            __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
            __m512 qc = _mm512_maskz_loadu_ps(m, q + c);
            for (int u = 0; u < 16; u++)
                a[u] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k + (j + u) * ks + c), a[u]);
        }
        __m512 x = _mm512_mul_ps(sum16(a), sc);
        _mm512_storeu_ps(s + j, x);
        top = _mm512_max_ps(top, x);
    }
    float best = _mm512_reduce_max_ps(top);
    for (; j < n; j++) {
        s[j] = dot(q, k + j * ks, d) * scale;
        best = s[j] > best ? s[j] : best;
    }
    return best;
}

/* s[j] = e^(s[j] - top) for j < n; returns their sum. */
static inline float exp_shifted(float *s, long n, float top) {
    __m512 t = _mm512_set1_ps(top), sum = _mm512_setzero_ps();
    for (long j = 0; j < n; j += 16) {
        __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc[d] = acc * alpha + sum_j p[j] v[j] over the n rows of v (row stride vs). */
static inline void accumulate(float *acc, float alpha, const float *p, const float *v, long vs,
                              long n, long d) {
    for (long c = 0; c < d; c += 64) {  /* 64 columns (4 registers) at a time */
        long w = d - c < 64 ? d - c : 64;
        __mmask16 mk[4];
        __m512 a[4];
        for (int u = 0; u < 4; u++) {
            long left = w - 16 * u;
            mk[u] = left >= 16 ? (__mmask16)0xFFFF
                               : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
            a[u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[u], acc + c + 16 * u),
                                 _mm512_set1_ps(alpha));
        }
        for (long j = 0; j < n; j++) {
            __m512 pj = _mm512_set1_ps(p[j]);
            const float *vj = v + j * vs + c;
            for (int u = 0; u < 4; u++)
                a[u] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(mk[u], vj + 16 * u), a[u]);
        }
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(acc + c + 16 * u, mk[u], a[u]);
    }
}
#else
static inline float dot(const float *a, const float *b, long d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (long j = 0; j < d; j++) acc += a[j] * b[j];
    return acc;
}

static inline float scores(const float *q, const float *k, long ks, long n, long d, float scale,
                           float *s) {
    float best = -INFINITY;
    for (long j = 0; j < n; j++) {
        s[j] = dot(q, k + j * ks, d) * scale;
        best = s[j] > best ? s[j] : best;
    }
    return best;
}

static inline float exp_shifted(float *s, long n, float top) {
    float sum = 0.0f;
    for (long j = 0; j < n; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}

static inline void accumulate(float *acc, float alpha, const float *p, const float *v, long vs,
                              long n, long d) {
#pragma omp simd
    for (long c = 0; c < d; c++) acc[c] *= alpha;
    for (long j = 0; j < n; j++) {
        const float *vj = v + j * vs;
#pragma omp simd
        for (long c = 0; c < d; c++) acc[c] += p[j] * vj[c];
    }
}
#endif

/* Where the pool is and how it is strided (elements): page, k/v, head, slot; head_dim is
 * contiguous. `base` points at the layer's slice of page 0, k. */
typedef struct {
    float *base;
    long page, kv, head, slot, block;
} Pool;

/* One work item: Q queries (stride qs) over keys [a, b) of a row's table; the running state
 * (m[Q], l[Q], acc[Q][d]) in `state`. */
static void attend_part(const Pool *pool, const long *table, long h, const float *q, long qs,
                        long Q, long d, float scale, long a, long b, float *state) {
    float *m = state, *l = state + Q, *acc = state + 2 * Q;
    float s[TILE];
    for (long i = 0; i < Q; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * Q * d);
    long t = a;
    while (t < b) {
        long page = table[t / pool->block], slot = t % pool->block;
        long n = pool->block - slot;
        if (n > b - t) n = b - t;
        if (n > TILE) n = TILE;
        const float *k = pool->base + page * pool->page + h * pool->head + slot * pool->slot;
        const float *v = k + pool->kv;
        for (long i = 0; i < Q; i++) {
            float top = scores(q + i * qs, k, pool->slot, n, d, scale, s);
            float m_new = top > m[i] ? top : m[i];
            float alpha = m[i] == m_new ? 1.0f : expf(m[i] - m_new);  /* first tile: e^-inf = 0 */
            l[i] = l[i] * alpha + exp_shifted(s, n, m_new);
            accumulate(acc + i * d, alpha, s, v, pool->slot, n, d);
            m[i] = m_new;
        }
        t += n;
    }
}

/* Paged attention of `rows` rows, each with Q queries per KV head.
 *
 * pool: the pool tensor's layer slice (page 0, k), strides page_stride, kv_stride,
 *   head_stride, slot_stride (elements), `block` slots a page.
 * table [rows, table_stride]: each row's page ids; ranges [rows, 2]: its keys [lo, hi).
 * q: row stride q_row, query stride q_head; row r's query i of KV head h is at
 *   q + r * q_row + (h * Q + i) * q_head.
 * out [rows, kv_heads * Q, d] (contiguous); lse [rows, kv_heads * Q] or NULL: each query's
 *   log-sum-exp of its scores (-inf for a row without keys, whose output is 0).
 * new_k/new_v (or NULL): the rows' new K/V [rows, kv_heads, d] (row strides k_row, v_row,
 *   head strides k_head, v_head), written first into the slots [rows, 2] (page, slot). */
void kvflow_paged_attention(float *base, long page_stride, long kv_stride, long head_stride,
                            long slot_stride, long block, const long *table, long table_stride,
                            const long *ranges, long rows, const float *q, long q_row,
                            long q_head, long kv_heads, long Q, long d, float scale, float *out,
                            float *lse, const float *new_k, long k_row, long k_head,
                            const float *new_v, long v_row, long v_head, const long *slots,
                            long threads) {
    Pool pool = {base, page_stride, kv_stride, head_stride, slot_stride, block};
    if (new_k) {
        for (long r = 0; r < rows; r++) {
            float *dst = base + slots[2 * r] * page_stride + slots[2 * r + 1] * slot_stride;
            for (long h = 0; h < kv_heads; h++) {
                memcpy(dst + h * head_stride, new_k + r * k_row + h * k_head, sizeof(float) * d);
                memcpy(dst + kv_stride + h * head_stride, new_v + r * v_row + h * v_head,
                       sizeof(float) * d);
            }
        }
    }
    /* parts: each row's keys cut into parts of `part` keys, enough work items for every
     * thread where the rows are few and long */
    long total = 0;
    for (long r = 0; r < rows; r++)
        if (ranges[2 * r + 1] > ranges[2 * r]) total += ranges[2 * r + 1] - ranges[2 * r];
    long work = total * kv_heads * Q;
    if (work < PARALLEL_MIN) threads = 1;
    long part = total * kv_heads / (4 * threads) + 1;
    if (part < PART_MIN) part = PART_MIN;
    if (part > block) part = (part + block - 1) / block * block;  /* whole pages */
    long *first = malloc(sizeof(long) * (rows + 1));  /* row r's parts: first[r] .. first[r+1] */
    first[0] = 0;
    for (long r = 0; r < rows; r++) {
        long n = ranges[2 * r + 1] - ranges[2 * r];
        first[r + 1] = first[r] + (n > 0 ? (n + part - 1) / part : 1);
    }
    long parts = first[rows], width = Q * (d + 2);
    float *states = malloc(sizeof(float) * parts * kv_heads * width);
    long *owner = malloc(sizeof(long) * parts);
    for (long r = 0; r < rows; r++)
        for (long p = first[r]; p < first[r + 1]; p++) owner[p] = r;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < parts * kv_heads; item++) {
            long p = item / kv_heads, h = item % kv_heads, r = owner[p];
            long lo = ranges[2 * r] + (p - first[r]) * part;
            long hi = lo + part < ranges[2 * r + 1] ? lo + part : ranges[2 * r + 1];
            attend_part(&pool, table + r * table_stride, h, q + r * q_row + h * Q * q_head, q_head,
                        Q, d, scale, lo, hi, states + item * width);
        }
#pragma omp for schedule(static)
        for (long rh = 0; rh < rows * kv_heads; rh++) {
            long r = rh / kv_heads, h = rh % kv_heads;
            for (long i = 0; i < Q; i++) {
                float top = -INFINITY;
                for (long p = first[r]; p < first[r + 1]; p++) {
                    float mp = states[(p * kv_heads + h) * width + i];
                    top = mp > top ? mp : top;
                }
                float *o = out + ((r * kv_heads + h) * Q + i) * d;
                float sum = 0.0f;
                for (long c = 0; c < d; c++) o[c] = 0.0f;
                if (top != -INFINITY) {
                    for (long p = first[r]; p < first[r + 1]; p++) {
                        const float *st = states + (p * kv_heads + h) * width;
                        if (st[i] == -INFINITY) continue;
                        float w = expf(st[i] - top);
                        const float *acc = st + 2 * Q + i * d;
                        sum += st[Q + i] * w;
#pragma omp simd
                        for (long c = 0; c < d; c++) o[c] += acc[c] * w;
                    }
                    float inv = 1.0f / sum;
#pragma omp simd
                    for (long c = 0; c < d; c++) o[c] *= inv;
                }
                if (lse)
                    lse[(r * kv_heads + h) * Q + i] = top == -INFINITY ? -INFINITY : top + logf(sum);
            }
        }
    }
    free(states);
    free(owner);
    free(first);
}
