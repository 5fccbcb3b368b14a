/* The small steps of a decode step's layer, fp32, one call each instead of several PyTorch ops: a decode step
 * streams every weight through the caches, so each op after a product runs cold, and the dispatch of a small
 * PyTorch op then costs far more than its arithmetic (SmolLM2's 16 x 576 RMSNorm: 12 us warm, ~50 us in a
 * decode step). Rows are few (a decode step's batch), so these run on the calling thread alone (a training
 * pass's RMSNorm forward, `bios.kernels.norms`, takes `bios_add_rms_norm` on all of PyTorch's threads).
 * Built by bios/kernels/c_kernels.py. */
#include <math.h>
#include <string.h>

#include "vec.h"

/* hidden[r] += delta[r] (if delta), then out[r] = weight * (hidden[r] / sqrt(mean(hidden[r]^2) + eps)): the
 * residual add and the next RMSNorm of a Llama layer, with Hugging Face's rounding steps (normalise, then scale);
 * the sum of squares in another order than PyTorch's. inv_rms[r] (if given) keeps 1 / sqrt(...) for a training
 * pass's backward (csrc/training_ops.c); on `threads` threads (a decode step's few rows: 1). */
void bios_add_rms_norm(float* hidden, long ld_hidden, const float* delta, long ld_delta, const float* weight,
                       float* out, long ld_out, float* inv_rms, int rows, int n, float eps, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    float* h = hidden + r * ld_hidden;
    if (delta) {
      const float* d = delta + r * ld_delta;
      #pragma omp simd
      for (int i = 0; i < n; i++) h[i] += d[i];
    }
    float squares = 0.0f;
    #pragma omp simd reduction(+ : squares)
    for (int i = 0; i < n; i++) squares += h[i] * h[i];
    float inverse = 1.0f / sqrtf(squares / (float)n + eps);
    if (inv_rms) inv_rms[r] = inverse;
    float* o = out + r * ld_out;
    #pragma omp simd
    for (int i = 0; i < n; i++) o[i] = weight[i] * (h[i] * inverse);
  }
}

/* RoPE of x [rows][heads][d] (row stride ld_x) into out (row stride ld_out; out == x rotates in place):
 * x·cos + rotate_half(x)·sin, with sin's first half negated by the caller (`signed_sin`), cos and sin [rows][d].
 * Each product and the sum rounded apart, as PyTorch's elementwise ops do: the same numbers bit for bit. A
 * training pass's backward rotates the gradient back with sin's halves swapped and negated (bios/kernels/rotary.py);
 * on `threads` threads (a decode step's few rows: 1). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void bios_rotate(const float* x, long ld_x, float* out, long ld_out, int rows, int heads, int d, const float* cos,
                 const float* signed_sin, int threads) {
#ifdef __clang__
  #pragma clang fp contract(off) /* clang ignores GCC's optimize pragma (and this one under -ffp-contract=fast) */
#endif
  int half = d / 2;
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const float* c = cos + (long)r * d;
    const float* s = signed_sin + (long)r * d;
    for (int h = 0; h < heads; h++) {
      const float* head = x + r * ld_x + (long)h * d;
      float* rotated = out + r * ld_out + (long)h * d;
      float low[half];
      memcpy(low, head, half * sizeof(float));
      #pragma omp simd
      for (int i = 0; i < half; i++) rotated[i] = head[i] * c[i] + head[i + half] * s[i];
      #pragma omp simd
      for (int i = 0; i < half; i++) rotated[i + half] = head[i + half] * c[i + half] + low[i] * s[i + half];
    }
  }
}
#pragma GCC pop_options

/* out[r] = silu(gate[r]) * up[r], gate and up the two halves of gate_up [rows][2 * n] (row stride ld): the SwiGLU
 * activation, silu(g) = g / (1 + exp(-g)), on `threads` threads (a decode step's few rows: 1). */
void bios_swiglu(const float* gate_up, long ld, float* out, int rows, int n, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const float* gate = gate_up + r * ld;
    const float* up = gate + n;
    float* o = out + (long)r * n;
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec g = vload(gate + i);
      vstore(o + i, g / (1.0f + vexp(-g)) * vload(up + i));
    }
    for (; i < n; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
  }
}
