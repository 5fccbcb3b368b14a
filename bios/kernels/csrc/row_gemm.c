/* y = x Wᵀ (+ b) for a decode step's few rows, streaming a packed fp32 weight once from memory.
 *
 * W [n, k] is packed as [ceil(n / VW)][k][VW]: each block of VW output features is one contiguous stream, read
 * with a software prefetch a few lines ahead while RB rows of x are multiplied into RB vector accumulators held
 * in registers (VW = RB = 16 with AVX-512, 8 with AVX2). Each output is its k products summed in order with
 * fused multiply-adds, starting from its bias (or zero): a column's result does not depend on which other
 * columns share its pack, so a stack of weights gives each weight's own numbers bit for bit.
 * Built by bios/kernels/c_kernels.py. */
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define RB VW
#define PREFETCH_FLOATS 512 /* 2 KiB ahead of the block's stream (measured: none 13 GB/s, 512 18.6 GB/s) */

int bios_vector_width(void) { return VW; }

void bios_row_gemm(const float* x, long ldx, const float* wp, const float* bias, float* y, long ldy,
                   int rows, int k, int n, int threads) {
  int blocks = (n + VW - 1) / VW, chunks = (rows + RB - 1) / RB;
  /* x's rows as [chunk][k][RB], zero-padded, so a step of the k loop broadcasts from one cache line. The buffer
   * is the calling thread's, kept for its next call (a decode step makes ~120 of these products). */
  static __thread float* scratch;
  static __thread size_t scratch_floats;
  size_t need = (size_t)chunks * k * RB;
  if (need > scratch_floats) {
    free(scratch);
    scratch = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
    if (!scratch) abort();
    scratch_floats = need;
  }
  float* xt = scratch; /* the team's threads read it through this shared local, not their own thread's copy */
  #pragma omp parallel num_threads(threads)
  {
  for (int c = 0; c < chunks; c++) {
    int live = rows - c * RB < RB ? rows - c * RB : RB;
    const float* xs = x + (long)c * RB * ldx;
    float* xc = xt + (size_t)c * k * RB;
    #pragma omp for schedule(static)
    for (int i = 0; i < k; i++) {
      if (live == RB) {
        #pragma GCC unroll 16
        for (int r = 0; r < RB; r++) xc[i * RB + r] = xs[r * ldx + i];
      } else {
        for (int r = 0; r < RB; r++) xc[i * RB + r] = r < live ? xs[r * ldx + i] : 0;
      }
    }
  }
  #pragma omp for schedule(static)
  for (int b = 0; b < blocks; b++) {
    const float* w = wp + (size_t)b * k * VW;
    int width = n - b * VW < VW ? n - b * VW : VW;
    vec start = {0};
    if (bias) memcpy(&start, bias + b * VW, width * sizeof(float));
    for (int c = 0; c < chunks; c++) {
      const float* xc = xt + (size_t)c * k * RB;
      vec acc[RB];
      #pragma GCC unroll 16
      for (int r = 0; r < RB; r++) acc[r] = start;
      for (int i = 0; i < k; i++) {
        vec wv = *(const vec*)(w + (size_t)i * VW);
        __builtin_prefetch(w + (size_t)i * VW + PREFETCH_FLOATS);
        #pragma GCC unroll 16
        for (int r = 0; r < RB; r++) acc[r] += xc[i * RB + r] * wv;
      }
      int last = rows - c * RB < RB ? rows - c * RB : RB;
      for (int r = 0; r < last; r++) {
        float* out = y + (c * RB + r) * ldy + b * VW;
        if (width == VW) *(vec*)out = acc[r];
        else memcpy(out, &acc[r], width * sizeof(float));
      }
    }
  }
  }
}
