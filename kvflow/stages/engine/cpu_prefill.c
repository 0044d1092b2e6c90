/* Paged prefill attention for float32 on the CPU: the queries of one chunk [start, start + T)
 * of a request attend causally to its keys [0, start + T), read where they lie in the KV page
 * pool through the request's page list (no gather). Built with the other kernels into one
 * library by cpu_kernels.py; bound by cpu_attn.py.
 *
 * Flash style. A work item is (a block of query positions, a KV head): its ROWS rows are the
 * block's positions times the G query heads that share the KV head (grouped-query attention;
 * row i * G + g is position i, head g), padded with zero rows. It goes over the keys a tile at
 * a time (at most TILE keys within one page) with an online softmax per row: a running
 * maximum m, a running sum l of 2^(s - m) and the running sum O of 2^(s - m) v, rescaled by
 * 2^(m_old - m_new) when m grows. The scores are kept in base 2, s = k . q * scale * log2(e)
 * (2^(s - m) is e^(k . q * scale - m'), the same softmax), so that an exponential is a power
 * of two: no range reduction by ln 2.
 *
 * The scores are computed transposed, S[key][row] = k . q[row] * scale: the block's queries
 * are packed once per item as Q^T [d][ROWS], so a score microkernel broadcasts a key's
 * element from the pool and multiplies it into ROWS / 16 vectors of rows (8 keys x 3 vectors
 * of accumulators): no key is transposed or copied. The softmax then runs down the keys with
 * the rows in vectors (no horizontal sums), and P.V adds each key's value row (read in the
 * pool) times its 6 rows' probabilities into 6 x 64 accumulators of O. The causal mask is
 * applied only in the tiles that cross the block's first position; tiles after the block's
 * last position are not computed. Items are spread over torch's OpenMP threads a KV head at a
 * time, each head's longest (last) blocks first: consecutive items of a thread read the same
 * head's keys and values, which stay in its cache (a head of 2,000 positions: 1 MB).
 *
 * With AVX2 and FMA (no AVX-512; 16 registers of 8 floats) the same tiles run 8 rows a
 * vector: scores for 4 keys x 24 rows at a time, P.V into 6 rows x 16 columns; without
 * either, plain loops (whose exponentials are libm's, several times slower). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

/* log2(e): the scores are scaled by it once, so the softmax takes powers of two. */
#define LOG2E 1.44269504088896341f

/* Rows of a work item (query positions x grouped heads, padded): 3 vectors of 16. */
#define ROWS 48L
/* Keys per tile: a tile's scores S[TILE][ROWS] stay in a 12 KiB buffer. */
#define TILE 64L

/* One work item's scratch, per thread. */
typedef struct {
    float *qt;   /* [d][ROWS]: the block's queries, transposed; zero for padded rows */
    float *s;    /* [TILE][ROWS]: a tile's scores, then its probabilities */
    float *o;    /* [ROWS][d]: the running sums of e^(s - m) v */
    float m[ROWS], l[ROWS], alpha[ROWS];
    int pos[ROWS]; /* each row's position (a padded row: the block's last) */
} Scratch;

#ifdef __AVX512F__
/* S[j][0..47] = scale * sum_c k[j][c] qt[c][0..47] for NK (<= 8) keys j: NK x 3 vector
 * accumulators, one broadcast of a key's element per 3 multiply-adds. */
static inline __attribute__((always_inline)) void scores_keys(const float *qt, const float *k,
                                                               long ks, long d, __m512 sc,
                                                               float *s, const int nk) {
    __m512 a[8][3];
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < 3; v++) a[j][v] = _mm512_setzero_ps();
    for (long c = 0; c < d; c++) {
        const float *qc = qt + c * ROWS;
        __m512 q0 = _mm512_loadu_ps(qc), q1 = _mm512_loadu_ps(qc + 16),
               q2 = _mm512_loadu_ps(qc + 32);
        for (int j = 0; j < nk; j++) {
            __m512 kj = _mm512_set1_ps(k[j * ks + c]);
            a[j][0] = _mm512_fmadd_ps(kj, q0, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(kj, q1, a[j][1]);
            a[j][2] = _mm512_fmadd_ps(kj, q2, a[j][2]);
        }
    }
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < 3; v++) _mm512_storeu_ps(s + j * ROWS + 16 * v, _mm512_mul_ps(a[j][v], sc));
}

static void tile_scores(const float *qt, const float *k, long ks, long n, long d, float scale,
                        float *s) {
    __m512 sc = _mm512_set1_ps(scale * LOG2E);
    long j = 0;
    for (; j + 8 <= n; j += 8) scores_keys(qt, k + j * ks, ks, d, sc, s + j * ROWS, 8);
    for (; j < n; j++) scores_keys(qt, k + j * ks, ks, d, sc, s + j * ROWS, 1);
}

/* The tile's scores S[n][ROWS] (base 2) become probabilities 2^(s - m_new) (0 where
 * masked: key position t0 + j after the row's position, in a diagonal tile); m, l updated,
 * alpha = 2^(m_old - m_new) for rescaling O (the first tile: m_old = -inf, alpha 2^-125,
 * which multiplies the zeros of O and l). A row's first tile holds key 0, which every row
 * sees, so m_new is finite. */
static void tile_softmax(Scratch *w, long n, long t0, int diagonal) {
    float *s = w->s;
    for (int v = 0; v < 3; v++) {
        __m512i pos = _mm512_loadu_si512(w->pos + 16 * v);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (long j = 0; j < n; j++) {
            __m512 x = _mm512_loadu_ps(s + j * ROWS + 16 * v);
            if (diagonal) {
                __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(t0 + j)), pos);
                x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
                _mm512_storeu_ps(s + j * ROWS + 16 * v, x);
            }
            top = _mm512_max_ps(top, x);
        }
        __m512 m_old = _mm512_loadu_ps(w->m + 16 * v);
        __m512 m_new = _mm512_max_ps(m_old, top);
        __m512 alpha = exp2_16(_mm512_sub_ps(m_old, m_new));
        __m512 sum = _mm512_setzero_ps();
        if (diagonal) {
            for (long j = 0; j < n; j++) {
                __m512 x = _mm512_loadu_ps(s + j * ROWS + 16 * v);
                __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                __m512 p = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_sub_ps(x, m_new)));
                _mm512_storeu_ps(s + j * ROWS + 16 * v, p);
                sum = _mm512_add_ps(sum, p);
            }
        } else {  /* no key masked: every score finite */
            for (long j = 0; j < n; j++) {
                __m512 x = _mm512_loadu_ps(s + j * ROWS + 16 * v);
                __m512 p = exp2_16(_mm512_sub_ps(x, m_new));
                _mm512_storeu_ps(s + j * ROWS + 16 * v, p);
                sum = _mm512_add_ps(sum, p);
            }
        }
        __m512 l = _mm512_loadu_ps(w->l + 16 * v);
        _mm512_storeu_ps(w->l + 16 * v, _mm512_add_ps(_mm512_mul_ps(l, alpha), sum));
        _mm512_storeu_ps(w->m + 16 * v, m_new);
        _mm512_storeu_ps(w->alpha + 16 * v, alpha);
    }
}

/* O[r] = O[r] * alpha[r] + sum_j P[j][r] v[j] for 6 rows r0.., 64 columns c0.. (masked to d):
 * 6 x 4 vector accumulators, a key's value row loaded once per 6 rows. */
static inline void values_rows(Scratch *w, long r0, long c0, long d, const float *v, long vs,
                               long n) {
    long width = d - c0 < 64 ? d - c0 : 64;
    __mmask16 mk[4];
    for (int u = 0; u < 4; u++) mk[u] = lanes(width - 16 * u);
    __m512 a[6][4];
    for (int r = 0; r < 6; r++) {
        __m512 al = _mm512_set1_ps(w->alpha[r0 + r]);
        const float *o = w->o + (r0 + r) * d + c0;
        for (int u = 0; u < 4; u++)
            a[r][u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[u], o + 16 * u), al);
    }
    const float *p = w->s + r0;
    for (long j = 0; j < n; j++) {
        const float *vj = v + j * vs + c0;
        __m512 x0 = _mm512_maskz_loadu_ps(mk[0], vj), x1 = _mm512_maskz_loadu_ps(mk[1], vj + 16),
               x2 = _mm512_maskz_loadu_ps(mk[2], vj + 32),
               x3 = _mm512_maskz_loadu_ps(mk[3], vj + 48);
        for (int r = 0; r < 6; r++) {
            __m512 pr = _mm512_set1_ps(p[j * ROWS + r]);
            a[r][0] = _mm512_fmadd_ps(pr, x0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pr, x1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(pr, x2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(pr, x3, a[r][3]);
        }
    }
    for (int r = 0; r < 6; r++) {
        float *o = w->o + (r0 + r) * d + c0;
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(o + 16 * u, mk[u], a[r][u]);
    }
}

static void tile_values(Scratch *w, long rows, long d, const float *v, long vs, long n) {
    for (long r0 = 0; r0 < rows; r0 += 6)
        for (long c0 = 0; c0 < d; c0 += 64) values_rows(w, r0, c0, d, v, vs, n);
}
#elif defined(KVFLOW_AVX2)
/* AVX2 (16 vector registers): the same tiles, 8 rows a vector. S[j][h..h+24) for NK (<= 4)
 * keys j and the 24 rows from h: NK x 3 accumulators, one broadcast per 3 multiply-adds. */
static inline __attribute__((always_inline)) void scores_keys8(const float *qt, const float *k,
                                                                long ks, long d, __m256 sc,
                                                                float *s, const int nk) {
    __m256 a[4][3];
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < 3; v++) a[j][v] = _mm256_setzero_ps();
    for (long c = 0; c < d; c++) {
        const float *qc = qt + c * ROWS;
        __m256 q0 = _mm256_loadu_ps(qc), q1 = _mm256_loadu_ps(qc + 8),
               q2 = _mm256_loadu_ps(qc + 16);
        for (int j = 0; j < nk; j++) {
            __m256 kj = _mm256_broadcast_ss(k + j * ks + c);
            a[j][0] = _mm256_fmadd_ps(kj, q0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(kj, q1, a[j][1]);
            a[j][2] = _mm256_fmadd_ps(kj, q2, a[j][2]);
        }
    }
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < 3; v++) _mm256_storeu_ps(s + j * ROWS + 8 * v, _mm256_mul_ps(a[j][v], sc));
}

static void tile_scores(const float *qt, const float *k, long ks, long n, long d, float scale,
                        float *s) {
    __m256 sc = _mm256_set1_ps(scale * LOG2E);
    for (long h = 0; h < ROWS; h += 24) {
        long j = 0;
        for (; j + 4 <= n; j += 4) scores_keys8(qt + h, k + j * ks, ks, d, sc, s + j * ROWS + h, 4);
        for (; j < n; j++) scores_keys8(qt + h, k + j * ks, ks, d, sc, s + j * ROWS + h, 1);
    }
}

/* As the AVX-512 tile_softmax, 8 rows a vector. */
static void tile_softmax(Scratch *w, long n, long t0, int diagonal) {
    float *s = w->s;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int v = 0; v < ROWS / 8; v++) {
        __m256i pos = _mm256_loadu_si256((const __m256i *)(w->pos + 8 * v));
        __m256 top = ninf;
        for (long j = 0; j < n; j++) {
            __m256 x = _mm256_loadu_ps(s + j * ROWS + 8 * v);
            if (diagonal) { /* masked where t0 + j > pos */
                __m256i after = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(t0 + j)), pos);
                x = _mm256_blendv_ps(x, ninf, _mm256_castsi256_ps(after));
                _mm256_storeu_ps(s + j * ROWS + 8 * v, x);
            }
            top = _mm256_max_ps(top, x);
        }
        __m256 m_old = _mm256_loadu_ps(w->m + 8 * v);
        __m256 m_new = _mm256_max_ps(m_old, top);
        __m256 alpha = exp2_8(_mm256_sub_ps(m_old, m_new));
        __m256 sum = _mm256_setzero_ps();
        for (long j = 0; j < n; j++) {
            __m256 x = _mm256_loadu_ps(s + j * ROWS + 8 * v);
            __m256 p = exp2_8(_mm256_sub_ps(x, m_new));
            if (diagonal) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
            _mm256_storeu_ps(s + j * ROWS + 8 * v, p);
            sum = _mm256_add_ps(sum, p);
        }
        __m256 l = _mm256_loadu_ps(w->l + 8 * v);
        _mm256_storeu_ps(w->l + 8 * v, _mm256_add_ps(_mm256_mul_ps(l, alpha), sum));
        _mm256_storeu_ps(w->m + 8 * v, m_new);
        _mm256_storeu_ps(w->alpha + 8 * v, alpha);
    }
}

/* O[r] = O[r] * alpha[r] + sum_j P[j][r] v[j] for 6 rows r0.., 16 columns c0.. (masked to
 * d unless `full`): 6 x 2 accumulators, a key's 16 values loaded once per 6 rows. */
static inline __attribute__((always_inline)) void values_rows_n(Scratch *w, long r0, long c0,
                                                                long d, const float *v,
                                                                long vs, long n,
                                                                const int full) {
    __m256i mk[2] = {lanes8(d - c0), lanes8(d - c0 - 8)};
    __m256 a[6][2];
    for (int r = 0; r < 6; r++) {
        __m256 al = _mm256_set1_ps(w->alpha[r0 + r]);
        const float *o = w->o + (r0 + r) * d + c0;
        for (int u = 0; u < 2; u++) a[r][u] = _mm256_mul_ps(_mm256_maskload_ps(o + 8 * u, mk[u]), al);
    }
    const float *p = w->s + r0;
    for (long j = 0; j < n; j++) {
        const float *vj = v + j * vs + c0;
        __m256 x0 = load8(vj, mk[0], full), x1 = load8(vj + 8, mk[1], full);
        for (int r = 0; r < 6; r++) {
            __m256 pr = _mm256_broadcast_ss(p + j * ROWS + r);
            a[r][0] = _mm256_fmadd_ps(pr, x0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(pr, x1, a[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) {
        float *o = w->o + (r0 + r) * d + c0;
        for (int u = 0; u < 2; u++) _mm256_maskstore_ps(o + 8 * u, mk[u], a[r][u]);
    }
}

static void tile_values(Scratch *w, long rows, long d, const float *v, long vs, long n) {
    for (long r0 = 0; r0 < rows; r0 += 6)
        for (long c0 = 0; c0 < d; c0 += 16) {
            if (d - c0 >= 16) values_rows_n(w, r0, c0, d, v, vs, n, 1);
            else values_rows_n(w, r0, c0, d, v, vs, n, 0);
        }
}
#else
static void tile_scores(const float *qt, const float *k, long ks, long n, long d, float scale,
                        float *s) {
    for (long j = 0; j < n; j++) {
        float acc[ROWS];
        for (long r = 0; r < ROWS; r++) acc[r] = 0.0f;
        for (long c = 0; c < d; c++) {
            float kc = k[j * ks + c];
#pragma omp simd
            for (long r = 0; r < ROWS; r++) acc[r] += kc * qt[c * ROWS + r];
        }
        for (long r = 0; r < ROWS; r++) s[j * ROWS + r] = acc[r] * (scale * LOG2E);
    }
}

static void tile_softmax(Scratch *w, long n, long t0, int diagonal) {
    float *s = w->s;
    for (long r = 0; r < ROWS; r++) {
        float top = -INFINITY;
        for (long j = 0; j < n; j++) {
            if (diagonal && t0 + j > w->pos[r]) s[j * ROWS + r] = -INFINITY;
            top = s[j * ROWS + r] > top ? s[j * ROWS + r] : top;
        }
        float m_new = top > w->m[r] ? top : w->m[r];
        float alpha = w->m[r] == -INFINITY ? 0.0f : exp2f(w->m[r] - m_new);
        float sum = 0.0f;
        for (long j = 0; j < n; j++) {
            float x = s[j * ROWS + r];
            float p = x == -INFINITY ? 0.0f : exp2f(x - m_new);
            s[j * ROWS + r] = p;
            sum += p;
        }
        w->l[r] = w->l[r] * alpha + sum;
        w->m[r] = m_new;
        w->alpha[r] = alpha;
    }
}

static void tile_values(Scratch *w, long rows, long d, const float *v, long vs, long n) {
    for (long r = 0; r < rows; r++) {
        float *o = w->o + r * d;
        float al = w->alpha[r];
#pragma omp simd
        for (long c = 0; c < d; c++) o[c] *= al;
        for (long j = 0; j < n; j++) {
            float p = w->s[j * ROWS + r];
            const float *vj = v + j * vs;
#pragma omp simd
            for (long c = 0; c < d; c++) o[c] += p * vj[c];
        }
    }
}
#endif

/* Rows per item: the most positions whose G heads fit in ROWS. */
static long positions_per_item(long G) { return ROWS / G; }

/* Causal prefill attention of one chunk.
 *
 * pool: the pool tensor's layer slice (page 0, k), strides page_stride, kv_stride,
 *   head_stride, slot_stride (elements), `block` slots a page, head_dim contiguous.
 * pages: the request's page ids in block order, covering position start + T - 1.
 * q: T positions (stride q_row) of kv_heads * G query heads (stride q_head), d contiguous;
 *   query head h * G + g shares KV head h.
 * out [T, kv_heads * G, d] (contiguous).
 * new_k/new_v (or NULL): the chunk's own K/V [T, kv_heads, d] (row strides k_row, v_row,
 *   head strides k_head, v_head, d contiguous), written first into the slots of positions
 *   [start, start + T) (as the decode kernel writes its step's K/V), so that the chunk is one
 *   call a layer.
 * Returns 0, or -1 where G > ROWS (not supported: the caller keeps torch's attention). */
int kvflow_paged_prefill(float *base, long page_stride, long kv_stride, long head_stride,
                         long slot_stride, long block, const long *pages, long start, long T,
                         const float *q, long q_row, long q_head, long kv_heads, long G, long d,
                         float scale, float *out, const float *new_k, long k_row, long k_head,
                         const float *new_v, long v_row, long v_head, long threads) {
    if (G < 1 || G > ROWS || T < 1) return -1;
    long per = positions_per_item(G);
    long blocks = (T + per - 1) / per, items = blocks * kv_heads;
    if (items < 2) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (new_k) {  /* the chunk's K/V into its slots; the loop's barrier precedes the reads */
#pragma omp for schedule(static)
            for (long i = 0; i < T; i++) {
                long p = start + i;
                float *dst = base + pages[p / block] * page_stride + (p % block) * slot_stride;
                for (long h = 0; h < kv_heads; h++) {
                    memcpy(dst + h * head_stride, new_k + i * k_row + h * k_head,
                           sizeof(float) * d);
                    memcpy(dst + kv_stride + h * head_stride, new_v + i * v_row + h * v_head,
                           sizeof(float) * d);
                }
            }
        }
        Scratch w;
        w.qt = aligned_alloc(64, sizeof(float) * d * ROWS);
        w.s = aligned_alloc(64, sizeof(float) * TILE * ROWS);
        w.o = aligned_alloc(64, sizeof(float) * ROWS * d);
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < items; item++) {
            long b = blocks - 1 - item % blocks, h = item / blocks;  /* a head at a time */
            long i0 = b * per, n_pos = T - i0 < per ? T - i0 : per;
            long rows = n_pos * G, rows6 = (rows + 5) / 6 * 6;
            long first = start + i0, end = start + i0 + n_pos;  /* positions [first, end) */
            memset(w.qt, 0, sizeof(float) * d * ROWS);
            for (long r = 0; r < ROWS; r++) {
                w.m[r] = -INFINITY;
                w.l[r] = 0.0f;
                w.pos[r] = (int)(r < rows ? first + r / G : end - 1);
            }
            for (long r = 0; r < rows; r++) {
                const float *qr = q + (i0 + r / G) * q_row + (h * G + r % G) * q_head;
                for (long c = 0; c < d; c++) w.qt[c * ROWS + r] = qr[c];
            }
            memset(w.o, 0, sizeof(float) * ROWS * d);
            for (long t0 = 0; t0 < end;) {
                long page = pages[t0 / block], slot = t0 % block;
                long n = block - slot;
                if (n > TILE) n = TILE;
                if (n > end - t0) n = end - t0;
                const float *k = base + page * page_stride + h * head_stride + slot * slot_stride;
                tile_scores(w.qt, k, slot_stride, n, d, scale, w.s);
                tile_softmax(&w, n, t0, t0 + n - 1 > first);
                tile_values(&w, rows6, d, k + kv_stride, slot_stride, n);
                t0 += n;
            }
            for (long r = 0; r < rows; r++) {
                float *o = out + ((i0 + r / G) * kv_heads * G + h * G + r % G) * d;
                float inv = 1.0f / w.l[r];
                for (long c = 0; c < d; c++) o[c] = w.o[r * d + c] * inv;
            }
        }
        free(w.qt);
        free(w.s);
        free(w.o);
    }
    return 0;
}
