/* A training pass's elementwise steps in fp32, one pass over memory each instead of several PyTorch ops (each a
 * pass of its own over activation-sized tensors). Rows are many (a pass's tokens), split over PyTorch's threads.
 * Built by bios/kernels/c_kernels.py. */
#include "vec.h"

/* The SwiGLU activation's gradient: from gate_up [rows][2n] (gate, then up; row stride ld) and grad_y [rows][n]
 * (row stride ld_grad), grad [rows][2n] (row stride ld_out): d/dgate = grad_y·up·silu'(gate), d/dup =
 * grad_y·silu(gate), with silu(g) = g·s, s = 1 / (1 + exp(-g)), silu'(g) = s·(1 + g·(1 - s)); on `threads`
 * threads. */
void bios_swiglu_backward(const float* gate_up, long ld, const float* grad_y, long ld_grad, float* grad, long ld_out,
                          int rows, int n, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const float* gate = gate_up + r * ld;
    const float* up = gate + n;
    const float* gy = grad_y + r * ld_grad;
    float* grad_gate = grad + r * ld_out;
    float* grad_up = grad_gate + n;
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec g = vload(gate + i), gyv = vload(gy + i);
      vec s = 1.0f / (1.0f + vexp(-g));
      vstore(grad_up + i, gyv * (g * s));
      vstore(grad_gate + i, gyv * vload(up + i) * (s * (1.0f + g * (1.0f - s))));
    }
    for (; i < n; i++) {
      float g = gate[i], s = 1.0f / (1.0f + __builtin_expf(-g));
      grad_up[i] = gy[i] * (g * s);
      grad_gate[i] = gy[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    }
  }
}

/* RMSNorm backward (its forward: bios_add_rms_norm in csrc/decode_ops.c), from x, inv_rms and grad_y [rows][n]: grad_x = inv_rms · (g - x̂ · mean(g · x̂)) with
 * g = grad_y · weight and x̂ = x · inv_rms; and, if grad_weight is given, grad_weight = Σ_rows grad_y · x̂ (summed by
 * column blocks, so no two threads write one sum). All rows have stride n. */
void bios_rms_norm_backward(const float* x, const float* weight, const float* inv_rms, const float* grad_y,
                            float* grad_x, float* grad_weight, int rows, int n, int threads) {
  #pragma omp parallel num_threads(threads) if (threads > 1)
  {
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
      const float* h = x + (long)r * n;
      const float* gy = grad_y + (long)r * n;
      float inverse = inv_rms[r], dot = 0.0f;
      #pragma omp simd reduction(+ : dot)
      for (int i = 0; i < n; i++) dot += gy[i] * weight[i] * (h[i] * inverse);
      float projection = dot / (float)n;
      float* gx = grad_x + (long)r * n;
      #pragma omp simd
      for (int i = 0; i < n; i++) gx[i] = (gy[i] * weight[i] - h[i] * inverse * projection) * inverse;
    }
    if (grad_weight) {
      #pragma omp for schedule(static)
      for (int start = 0; start < n; start += 64) {
        int end = start + 64 < n ? start + 64 : n;
        float sums[64] = {0};
        for (int r = 0; r < rows; r++) {
          const float* h = x + (long)r * n;
          const float* gy = grad_y + (long)r * n;
          float inverse = inv_rms[r];
          #pragma omp simd
          for (int i = start; i < end; i++) sums[i - start] += gy[i] * (h[i] * inverse);
        }
        for (int i = start; i < end; i++) grad_weight[i] = sums[i - start];
      }
    }
  }
}

/* bf16 <-> fp32: a bf16 is the top half of an fp32; rounding to it is to nearest, ties to even, as PyTorch's
 * casts round (NaN stays NaN). Vectors of VW bf16 load widened to fp32 and store rounded. */
typedef unsigned short hvec __attribute__((vector_size(VW * 2), aligned(2)));
typedef unsigned int uvec __attribute__((vector_size(VW * 4), aligned(4)));

static inline float bf16_to_float(unsigned short b) {
  unsigned int bits = (unsigned int)b << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

static inline unsigned short float_to_bf16(float f) {
  unsigned int bits;
  __builtin_memcpy(&bits, &f, 4);
  if (f != f) return 0x7FC0;
  return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

static inline vec hload(const unsigned short* p) {
  return (vec)(__builtin_convertvector(*(const hvec*)p, uvec) << 16);
}

/* v rounded to bf16, as the top halves of its lanes (the low halves zero). */
static inline uvec vround_bits(vec v) {
  uvec bits = (uvec)v;
  uvec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  uvec nan = (uvec)(v != v);
  return (rounded & ~nan) | (0x7FC00000u & nan);
}

static inline vec vround_bf16(vec v) { return (vec)vround_bits(v); }

static inline void hstore(unsigned short* p, vec v) {
  *(hvec*)p = __builtin_convertvector(vround_bits(v) >> 16, hvec);
}

/* RMSNorm of bf16 rows x [rows][n] with a bf16 weight, in Hugging Face's LlamaRMSNorm rounding: statistics in
 * fp32, x̂ = x · inv_rms rounded to bf16, then weight · x̂ rounded to bf16 (the sum of squares in another order
 * than PyTorch's); inv_rms[r] kept for the backward. On `threads` threads. */
void bios_rms_norm_bf16(const unsigned short* x, const unsigned short* weight, unsigned short* out, float* inv_rms,
                        int rows, int n, float eps, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const unsigned short* h = x + (long)r * n;
    vec sums = (vec){0};
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec v = hload(h + i);
      sums += v * v;
    }
    float squares = hsum(sums);
    for (; i < n; i++) squares += bf16_to_float(h[i]) * bf16_to_float(h[i]);
    float inverse = 1.0f / __builtin_sqrtf(squares / (float)n + eps);
    inv_rms[r] = inverse;
    unsigned short* o = out + (long)r * n;
    for (i = 0; i + VW <= n; i += VW) hstore(o + i, hload(weight + i) * vround_bf16(hload(h + i) * inverse));
    for (; i < n; i++) o[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(h[i]) * inverse));
  }
}

/* Its backward for x: grad_x = inv_rms · (g - x̂ · mean(g · x̂)), g = grad_y · weight, x̂ = x · inv_rms, all in
 * fp32 (PyTorch's ops round g and grad_y · x̂ to bf16 on the way), rounded to bf16 once. */
void bios_rms_norm_backward_bf16(const unsigned short* x, const unsigned short* weight, const float* inv_rms,
                                 const unsigned short* grad_y, unsigned short* grad_x, int rows, int n, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const unsigned short* h = x + (long)r * n;
    const unsigned short* gy = grad_y + (long)r * n;
    float inverse = inv_rms[r];
    vec sums = (vec){0};
    int i = 0;
    for (; i + VW <= n; i += VW) sums += hload(gy + i) * hload(weight + i) * (hload(h + i) * inverse);
    float dot = hsum(sums);
    for (; i < n; i++) dot += bf16_to_float(gy[i]) * bf16_to_float(weight[i]) * (bf16_to_float(h[i]) * inverse);
    float projection = dot / (float)n;
    unsigned short* gx = grad_x + (long)r * n;
    for (i = 0; i + VW <= n; i += VW)
      hstore(gx + i, (hload(gy + i) * hload(weight + i) - hload(h + i) * inverse * projection) * inverse);
    for (; i < n; i++) {
      float g = bf16_to_float(gy[i]) * bf16_to_float(weight[i]);
      gx[i] = float_to_bf16((g - bf16_to_float(h[i]) * inverse * projection) * inverse);
    }
  }
}

static inline vec row_load(const void* row, int bf16, int i) {
  return bf16 ? hload((const unsigned short*)row + i) : vload((const float*)row + i);
}

static inline float row_at(const void* row, int bf16, int i) {
  return bf16 ? bf16_to_float(((const unsigned short*)row)[i]) : ((const float*)row)[i];
}

/* The output head's log-softmax, each row of logits [rows][n] (fp32, or bf16 if `bf16`; row stride ld) read once
 * from memory and then worked on in the cache, in fp32: lse[r] = max + log Σ exp(l - max), logprobs[r] =
 * l[targets[r]] - lse[r]. With `grads`, the row is overwritten by the gradient of scale·logprobs[r] with respect
 * to it, scale·(onehot(target) - softmax), scale = row_scale[r] (1 where row_scale is NULL); bf16 rows get it
 * rounded once, as a cast of the fp32 gradient would (exp taken again rather than kept: no fp32 copy of the
 * logits). PyTorch's ops took four passes over memory, and a bf16 head two casts (bios/kernels/cross_entropy.py).
 * On `threads` threads. */
void bios_log_softmax_rows(void* logits, long ld, int bf16, const long* targets, const float* row_scale,
                           float* logprobs, float* lse, int rows, int n, int grads, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    void* row = (char*)logits + r * ld * (bf16 ? 2 : 4);
    float* l = (float*)row;
    vec top = (vec){0} - __builtin_inff();
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec v = row_load(row, bf16, i);
      top = blend(v > top, v, top);
    }
    float most = hmax(top);
    for (; i < n; i++) most = row_at(row, bf16, i) > most ? row_at(row, bf16, i) : most;
    int t = (int)targets[r];
    float target = row_at(row, bf16, t);
    vec sums = (vec){0};
    for (i = 0; i + VW <= n; i += VW) {
      vec e = vexp(row_load(row, bf16, i) - most);
      sums += e;
      if (grads && !bf16) vstore(l + i, e);
    }
    float sum = hsum(sums);
    for (; i < n; i++) {
      float e = __builtin_expf(row_at(row, bf16, i) - most);
      sum += e;
      if (grads && !bf16) l[i] = e;
    }
    lse[r] = most + __builtin_logf(sum);
    logprobs[r] = target - lse[r];
    if (!grads) continue;
    float scale = row_scale ? row_scale[r] : 1.0f;
    float coefficient = -scale / sum;
    unsigned short* h = (unsigned short*)row;
    for (i = 0; i + VW <= n; i += VW) {
      vec d = (bf16 ? vexp(hload(h + i) - most) : vload(l + i)) * coefficient;
      if (t >= i && t < i + VW) d[t - i] += scale;
      if (bf16) hstore(h + i, d); else vstore(l + i, d);
    }
    for (; i < n; i++) {
      float d = (bf16 ? __builtin_expf(row_at(row, bf16, i) - most) : l[i]) * coefficient;
      if (i == t) d += scale;
      if (bf16) h[i] = float_to_bf16(d); else l[i] = d;
    }
  }
}

/* RoPE of bf16 x [rows][heads][d] (row stride ld_x) into out (row stride ld_out), with bf16 cos and signed_sin
 * [rows][d] (bios_rotate's fp32 form, csrc/decode_ops.c): each product and the sum rounded to bf16 apart, as
 * PyTorch's bf16 ops round, so the same numbers bit for bit. On `threads` threads. */
void bios_rotate_bf16(const unsigned short* x, long ld_x, unsigned short* out, long ld_out, int rows, int heads, int d,
                      const unsigned short* cos, const unsigned short* signed_sin, int threads) {
  int half = d / 2;
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const unsigned short* c = cos + (long)r * d;
    const unsigned short* s = signed_sin + (long)r * d;
    for (int h = 0; h < heads; h++) {
      const unsigned short* head = x + r * ld_x + (long)h * d;
      unsigned short* rotated = out + r * ld_out + (long)h * d;
      int i = 0;
      for (; i + VW <= half; i += VW) {
        vec low = hload(head + i), high = hload(head + half + i);
        vec first = vround_bf16(low * hload(c + i)) + vround_bf16(high * hload(s + i));
        vec second = vround_bf16(high * hload(c + half + i)) + vround_bf16(low * hload(s + half + i));
        hstore(rotated + i, first);
        hstore(rotated + half + i, second);
      }
      for (; i < half; i++) {
        float low = bf16_to_float(head[i]), high = bf16_to_float(head[half + i]);
        float first = round_bf16(low * bf16_to_float(c[i])) + round_bf16(high * bf16_to_float(s[i]));
        float second = round_bf16(high * bf16_to_float(c[half + i])) + round_bf16(low * bf16_to_float(s[half + i]));
        rotated[i] = float_to_bf16(first);
        rotated[half + i] = float_to_bf16(second);
      }
    }
  }
}
