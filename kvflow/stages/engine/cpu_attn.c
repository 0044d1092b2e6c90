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
 * the log-sum-exp gives. Scores are q.k * scale, as torch's scaled_dot_product_attention.
 * With AVX-512, AVX2 + FMA (8-lane exponentials and multiply-adds), or plain loops, as the
 * CPU has. */
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
/* Queries of a KV head computed together (grouped-query attention): each key and value row
 * is read once for them. */
#define GROUP 3

/* Ask for a row of d floats (into the caches, for reading): a tile is a page of its own,
 * where the hardware's prefetchers start over. */
static inline void prefetch_row(const char *row, long d) {
    for (long c = 0; c < (long)sizeof(float) * d; c += 64) __builtin_prefetch(row + c, 0, 3);
}

#ifdef __AVX512F__
static inline float dot(const float *a, const float *b, long d) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    long j = 0;
    for (; j + 32 <= d; j += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), acc1);
    }
    for (; j < d; j += 16) {
        __mmask16 m = lanes(d - j);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), _mm512_maskz_loadu_ps(m, b + j),
                               acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* The sums of a[0..7] (16 lanes each) as 8 lanes: lane j holds the sum of a[j]. Pairs of
 * vectors are interleaved and added (each 128-bit lane keeps partial sums of 2, then of 4
 * vectors), then the 128-bit lanes are added across: 25 operations for 8 sums. */
static inline __m256 sum8(const __m512 *a) {
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even),
                             _mm512_shuffle_f32x4(u[0], u[1], odd));
    __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v, v, even), _mm512_shuffle_f32x4(v, v, odd));
    return _mm512_castps512_ps256(w);
}

/* s[i][j] = q_i.k[j] * scale (s: [GROUP][TILE]) for nq (<= GROUP) queries q + i * qs and the
 * n keys k (row stride ks); top[i]: the largest score of query i. Keys go 8 at a time, each
 * element of a key loaded once for the nq queries (nq x 8 vector accumulators), summed
 * across by `sum8`. nq is a constant where this is inlined. */
static inline __attribute__((always_inline)) void scores_n(const float *q, long qs, const int nq,
                                                           const float *k, long ks, long n,
                                                           long d, float scale, float *s,
                                                           float *top) {
    __m256 best[GROUP], sc = _mm256_set1_ps(scale);
    for (int i = 0; i < nq; i++) best[i] = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        __m512 a[GROUP][8];
        for (int i = 0; i < nq; i++)
            for (int u = 0; u < 8; u++) a[i][u] = _mm512_setzero_ps();
        for (long c = 0; c < d; c += 16) {
            __mmask16 m = lanes(d - c);
            __m512 qc[GROUP];
            for (int i = 0; i < nq; i++) qc[i] = _mm512_maskz_loadu_ps(m, q + i * qs + c);
            for (int u = 0; u < 8; u++) {
                __m512 kc = _mm512_maskz_loadu_ps(m, k + (j + u) * ks + c);
                for (int i = 0; i < nq; i++) a[i][u] = _mm512_fmadd_ps(qc[i], kc, a[i][u]);
            }
        }
        for (int i = 0; i < nq; i++) {
            __m256 x = _mm256_mul_ps(sum8(a[i]), sc);
            _mm256_storeu_ps(s + i * TILE + j, x);
            best[i] = _mm256_max_ps(best[i], x);
        }
    }
    for (int i = 0; i < nq; i++) {
        float lane[8], b = -INFINITY;
        _mm256_storeu_ps(lane, best[i]);
        for (int u = 0; u < 8; u++) b = lane[u] > b ? lane[u] : b;
        for (long r = j; r < n; r++) {
            s[i * TILE + r] = dot(q + i * qs, k + r * ks, d) * scale;
            b = s[i * TILE + r] > b ? s[i * TILE + r] : b;
        }
        top[i] = b;
    }
}

static void scores_group(const float *q, long qs, int nq, const float *k, long ks, long n, long d,
                         float scale, float *s, float *top) {
    if (nq == 3) scores_n(q, qs, 3, k, ks, n, d, scale, s, top);
    else if (nq == 2) scores_n(q, qs, 2, k, ks, n, d, scale, s, top);
    else scores_n(q, qs, 1, k, ks, n, d, scale, s, top);
}

/* s[j] = e^(s[j] - top) for j < n; returns their sum. */
static inline float exp_shifted(float *s, long n, float top) {
    __m512 t = _mm512_set1_ps(top), sum = _mm512_setzero_ps();
    for (long j = 0; j < n; j += 16) {
        __mmask16 m = lanes(n - j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc_i[d] = acc_i * alpha[i] + sum_j p[i][j] v[j] for nq queries (acc_i = acc + i * d; p:
 * [GROUP][TILE]) over the n rows of v (row stride vs): each value row loaded once for the nq
 * queries, nq x 4 independent accumulators. The first pn rows of the next tile's K and V
 * (pk, pv, same stride) are asked for on the way (`prefetch_row`). */
static inline __attribute__((always_inline)) void accumulate_n(
    float *acc, const float *alpha, const float *p, const float *v, long vs, long n, long d,
    const int nq, const char *pk, const char *pv, long pn) {
    for (long c = 0; c < d; c += 64) {  /* 64 columns (4 registers) at a time */
        __mmask16 mk[4];
        __m512 a[GROUP][4];
        for (int u = 0; u < 4; u++) mk[u] = lanes(d - c - 16 * u);
        for (int i = 0; i < nq; i++) {
            __m512 al = _mm512_set1_ps(alpha[i]);
            for (int u = 0; u < 4; u++)
                a[i][u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[u], acc + i * d + c + 16 * u), al);
        }
        for (long j = 0; j < n; j++) {
            if (c == 0 && j < pn) {
                prefetch_row(pk + sizeof(float) * j * vs, d);
                prefetch_row(pv + sizeof(float) * j * vs, d);
            }
            const float *vj = v + j * vs + c;
            __m512 x[4];
            for (int u = 0; u < 4; u++) x[u] = _mm512_maskz_loadu_ps(mk[u], vj + 16 * u);
            for (int i = 0; i < nq; i++) {
                __m512 pj = _mm512_set1_ps(p[i * TILE + j]);
                for (int u = 0; u < 4; u++) a[i][u] = _mm512_fmadd_ps(pj, x[u], a[i][u]);
            }
        }
        for (int i = 0; i < nq; i++)
            for (int u = 0; u < 4; u++)
                _mm512_mask_storeu_ps(acc + i * d + c + 16 * u, mk[u], a[i][u]);
    }
}

#elif defined(KVFLOW_AVX2)
/* AVX2: one query's scores a key at a time (`dot8`: FMA dot products),
 * the exponentials 8 at a time, and the values 16 columns at a time for the group's
 * queries (nq x 2 accumulators, each value row loaded once for them). */
static inline float dot(const float *a, const float *b, long d) { return dot8(a, b, d); }

static void scores_group(const float *q, long qs, int nq, const float *k, long ks, long n, long d,
                         float scale, float *s, float *top) {
    for (int i = 0; i < nq; i++) {
        float best = -INFINITY, *si = s + i * TILE;
        for (long j = 0; j < n; j++) {
            si[j] = dot(q + i * qs, k + j * ks, d) * scale;
            best = si[j] > best ? si[j] : best;
        }
        top[i] = best;
    }
}

/* s[j] = e^(s[j] - top) for j < n; returns their sum. */
static inline float exp_shifted(float *s, long n, float top) {
    __m256 t = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    for (long j = 0; j < n; j += 8) {
        __m256i m = lanes8(n - j);
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), t)),
                                 _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(s + j, m, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

/* The values of 16 columns from c (masked to d unless `full`) for nq queries. */
static inline __attribute__((always_inline)) void accumulate_cols(
    float *acc, const float *alpha, const float *p, const float *v, long vs, long n, long d,
    long c, const int nq, const int full) {
    __m256i mk[2] = {lanes8(d - c), lanes8(d - c - 8)};
    __m256 a[GROUP][2];
    for (int i = 0; i < nq; i++) {
        __m256 al = _mm256_set1_ps(alpha[i]);
        for (int u = 0; u < 2; u++)
            a[i][u] = _mm256_mul_ps(_mm256_maskload_ps(acc + i * d + c + 8 * u, mk[u]), al);
    }
    for (long j = 0; j < n; j++) {
        const float *vj = v + j * vs + c;
        __m256 x0 = load8(vj, mk[0], full), x1 = load8(vj + 8, mk[1], full);
        for (int i = 0; i < nq; i++) {
            __m256 pj = _mm256_broadcast_ss(p + i * TILE + j);
            a[i][0] = _mm256_fmadd_ps(pj, x0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(pj, x1, a[i][1]);
        }
    }
    for (int i = 0; i < nq; i++)
        for (int u = 0; u < 2; u++) _mm256_maskstore_ps(acc + i * d + c + 8 * u, mk[u], a[i][u]);
}

static inline __attribute__((always_inline)) void accumulate_n(
    float *acc, const float *alpha, const float *p, const float *v, long vs, long n, long d,
    const int nq, const char *pk, const char *pv, long pn) {
    for (long j = 0; j < pn; j++) {
        prefetch_row(pk + sizeof(float) * j * vs, d);
        prefetch_row(pv + sizeof(float) * j * vs, d);
    }
    for (long c = 0; c < d; c += 16) {
        if (d - c >= 16) accumulate_cols(acc, alpha, p, v, vs, n, d, c, nq, 1);
        else accumulate_cols(acc, alpha, p, v, vs, n, d, c, nq, 0);
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

static void scores_group(const float *q, long qs, int nq, const float *k, long ks, long n, long d,
                         float scale, float *s, float *top) {
    for (int i = 0; i < nq; i++) top[i] = scores(q + i * qs, k, ks, n, d, scale, s + i * TILE);
}

static void accumulate_group(float *acc, const float *alpha, const float *p, const float *v,
                             long vs, long n, long d, int nq, const char *pk, const char *pv,
                             long pn) {
    for (long j = 0; j < pn; j++) {
        prefetch_row(pk + sizeof(float) * j * vs, d);
        prefetch_row(pv + sizeof(float) * j * vs, d);
    }
    for (int i = 0; i < nq; i++) accumulate(acc + i * d, alpha[i], p + i * TILE, v, vs, n, d);
}
#endif

#if defined(__AVX512F__) || defined(KVFLOW_AVX2)
/* The group's queries with nq a constant in each call (the SIMD paths' accumulate_n). */
static void accumulate_group(float *acc, const float *alpha, const float *p, const float *v,
                             long vs, long n, long d, int nq, const char *pk, const char *pv,
                             long pn) {
    if (nq == 3) accumulate_n(acc, alpha, p, v, vs, n, d, 3, pk, pv, pn);
    else if (nq == 2) accumulate_n(acc, alpha, p, v, vs, n, d, 2, pk, pv, pn);
    else accumulate_n(acc, alpha, p, v, vs, n, d, 1, pk, pv, pn);
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
    float s[GROUP * TILE], top[GROUP], alpha[GROUP];
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
        /* the next tile (another page), asked for while this one is computed */
        const char *pk = NULL, *pv = NULL;
        long pn = 0;
        if (t + n < b) {
            long u = t + n, next = table[u / pool->block];
            pn = pool->block - u % pool->block;
            if (pn > b - u) pn = b - u;
            if (pn > TILE) pn = TILE;
            pk = (const char *)(pool->base + next * pool->page + h * pool->head +
                                (u % pool->block) * pool->slot);
            pv = pk + sizeof(float) * pool->kv;
        }
        for (long i0 = 0; i0 < Q; i0 += GROUP) {
            int nq = Q - i0 < GROUP ? (int)(Q - i0) : GROUP;
            scores_group(q + i0 * qs, qs, nq, k, pool->slot, n, d, scale, s, top);
            for (int i = 0; i < nq; i++) {
                float m_old = m[i0 + i], m_new = top[i] > m_old ? top[i] : m_old;
                alpha[i] = m_old == m_new ? 1.0f : expf(m_old - m_new); /* first tile: 0 */
                l[i0 + i] = l[i0 + i] * alpha[i] + exp_shifted(s + i * TILE, n, m_new);
                m[i0 + i] = m_new;
            }
            accumulate_group(acc + i0 * d, alpha, s, v, pool->slot, n, d, nq,
                             i0 == 0 ? pk : NULL, pv, i0 == 0 ? pn : 0);
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
