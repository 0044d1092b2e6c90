/* A float32 decode step's decoder layers in one call (bound by cpu_decode.py): the same kernels
 * the model's modules call one by one from Python (cpu_gemv.c, cpu_fused.c, cpu_attn.c), with
 * the same arguments in the same order, so the results are the same bits; what is gone is the
 * Python between them (module calls, argument checks, views, ~0.1-0.4 ms a layer).
 *
 * Per layer l, for the M rows x [M, hidden] (the residual stream, updated in place) and h (its
 * normed copy, the layer's input; on return the final norm of the stream):
 *   qkv = h Wqkv^T (+b); RoPE on q and k; write k, v at the rows' slots and attend over the
 *   pool (paged); x += attn Wo^T (+b); h = norm(x); gu = h Wgu^T (+b); act = SiLU(g) * u;
 *   x += act Wdown^T (+b); h = next_norm(x).
 * weights[4 l + i] and biases[4 l + i] (NULL: none), i = qkv, o, gate_up, down; norms[2 l] is
 * layer l's post-attention norm weight, norms[2 l + 1] the next layer's input norm weight (the
 * final norm's after the last layer). The pool's layer l starts at pool + l * layer_stride.
 * panels[4 l + i] (panels NULL, or an entry NULL: none): that projection's weight packed for
 * cpu_panel.c, which computes it instead of the matrix-vector kernel (the same kernel as the
 * module's `OneDNNDenseLinear` with a panel copy, so the same bits). */
#include <string.h>

#include "cpu_kernels.h"

/* y = x W^T (+b) on the panel copy where there is one, else on W. */
static void project(const float *x, const float *w, const float *p, const float *b, float *y,
                    long M, long N, long K, long threads) {
    if (p) kvflow_panel_gemm(x, p, b, y, M, N, K, threads);
    else kvflow_gemv(x, w, b, y, M, N, K, threads);
}

void kvflow_decode_layers(float *x, float *h, long M, long layers, const float *const *weights,
                          const float *const *biases, const float *const *norms, float eps,
                          long hidden, long heads, long kv_heads, long d, long inter,
                          const float *cos, const float *sin, float *pool, long layer_stride,
                          long page_stride, long kv_stride, long head_stride, long slot_stride,
                          long block, const long *table, long table_stride, const long *ranges,
                          const long *slots, float scale, float *qkv, float *attn, float *delta,
                          float *gu, float *act, const float *const *panels, long threads) {
    long qn = (heads + 2 * kv_heads) * d;
    for (long l = 0; l < layers; l++) {
        const float *const *w = weights + 4 * l, *const *b = biases + 4 * l;
        const float *p[4] = {0, 0, 0, 0};
        if (panels) memcpy(p, panels + 4 * l, sizeof p);
        project(h, w[0], p[0], b[0], qkv, M, qn, hidden, threads);
        kvflow_rope(qkv, qn, d, heads + kv_heads, d, cos, sin, d, M, threads);
        kvflow_paged_attention(pool + l * layer_stride, page_stride, kv_stride, head_stride,
                               slot_stride, block, table, table_stride, ranges, M, qkv, qn, d,
                               kv_heads, heads / kv_heads, d, scale, attn, 0,
                               qkv + heads * d, qn, d, qkv + (heads + kv_heads) * d, qn, d,
                               slots, threads);
        project(attn, w[1], p[1], b[1], delta, M, hidden, heads * d, threads);
        kvflow_add_rms_norm(x, hidden, delta, hidden, norms[2 * l], h, hidden, M, hidden, eps,
                            threads);
        project(h, w[2], p[2], b[2], gu, M, 2 * inter, hidden, threads);
        kvflow_silu_mul(gu, 2 * inter, act, M, inter, threads);
        project(act, w[3], p[3], b[3], delta, M, hidden, inter, threads);
        kvflow_add_rms_norm(x, hidden, delta, hidden, norms[2 * l + 1], h, hidden, M, hidden,
                            eps, threads);
    }
}
