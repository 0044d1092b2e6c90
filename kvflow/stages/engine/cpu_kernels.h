/* The kernels one C file calls in another (cpu_decode.c calls the others), declared once and
 * included where they are defined too, so that a changed signature fails to compile. The
 * entry points only Python calls (through ctypes, cpu_*.py) are not declared here. */
#ifndef KVFLOW_CPU_KERNELS_H
#define KVFLOW_CPU_KERNELS_H

void kvflow_gemv(const float *x, const float *w, const float *b, float *y, long M, long N, long K,
                 long threads);
void kvflow_panel_gemm(const float *x, const float *p, const float *b, float *y, long M, long N,
                       long K, long threads);
void kvflow_rope(float *x, long ts, long hs, long heads, long d, const float *cos,
                 const float *sin, long cs, long rows, long threads);
void kvflow_add_rms_norm(float *x, long xs, const float *delta, long ds, const float *w,
                         float *out, long os, long rows, long n, float eps, long threads);
void kvflow_silu_mul(const float *gu, long gs, float *out, long rows, long n, long threads);
void kvflow_paged_attention(float *base, long page_stride, long kv_stride, long head_stride,
                            long slot_stride, long block, const long *table, long table_stride,
                            const long *ranges, long rows, const float *q, long q_row,
                            long q_head, long kv_heads, long Q, long d, float scale, float *out,
                            float *lse, const float *new_k, long k_row, long k_head,
                            const float *new_v, long v_row, long v_head, const long *slots,
                            long threads);

#endif
