/* Attention of a training pass in fp32 where each query sees one interval of keys (causal, causal within packed
 * sequences, a sliding window), forward and backward, computing only the blocks of scores the intervals reach.
 *
 * PyTorch's CPU flash attention computes every query-key pair of a row of up to 512 keys and masks the causal
 * half afterwards (the same time with is_causal as without); here a block of R queries multiplies only the keys
 * its intervals span, about half the work for causal rows. Each task is one (batch row, kv head): its keys and
 * values are transposed once into scratch, its query heads run one after another, and the kv head's key and value
 * gradients sum in scratch and are written once (no two threads write one). Products are register tiles of R
 * rows by two vectors; softmax statistics are fp32 and exp is vec.h's. Tensors are [batch, position, head, dim]
 * with dim contiguous and any other strides (`strides` gives batch, position and head strides in floats, three
 * per tensor in argument order). Queries and keys may be RoPE'd on the way in (`cos` and `sin` tables, [batch or
 * one][position][dim], their batch and position strides after the tensors'; `sin` with its first half negated,
 * as bios/kernels/rotary.py's `signed_sin`): then a stacked q/k/v projection output goes in as it is, and the
 * gradients come out for it, rotated back. Built by bios/kernels/c_kernels.py; called by
 * bios/kernels/interval_attention.py. */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

#define R (VW == 16 ? 8 : 6) /* query rows per block: register tiles of R x 2 vectors (AVX-512 has twice the registers) */
#define TILE (2 * VW) /* keys per register tile */

typedef struct {
  long batch, position, head;
} strides3;

/* RoPE tables, or none (cos NULL): row (b, i) at b * batch + i * position. */
typedef struct {
  const float *cos, *sin;
  long batch, position;
} tables;

/* RoPE here rounds each product and the sum apart, as PyTorch's ops and `bios_rotate` (csrc/decode_ops.c) do: the
 * queries and keys it rotates are those bits, so a stacked call computes what RoPE then attention would. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
/* out = RoPE of x's one head [D] at row (b, i), times `scale`: x·cos + (x's halves swapped)·signed sin (a copy
 * where there are no tables). */
static void rotate_in(const float* x, tables t, int b, int i, int D, float scale, float* out) {
#ifdef __clang__
  #pragma clang fp contract(off)
#endif
  if (!t.cos) {
    for (int e = 0; e < D; e++) out[e] = x[e] * scale;
    return;
  }
  const float* c = t.cos + b * t.batch + i * t.position;
  const float* s = t.sin + b * t.batch + i * t.position;
  int half = D / 2;
  for (int e = 0; e < D; e += VW) {
    int other = e < half ? e + half : e - half;
    vstore(out + e, (vload(x + e) * vload(c + e) + vload(x + other) * vload(s + e)) * scale);
  }
}

/* The gradient through `rotate_in` (scale 1) of g [D] at row (b, i), into out: g·cos + (g's halves swapped)·(the
 * signed sin's halves swapped). */
static void rotate_back(const float* g, tables t, int b, int i, int D, float* out) {
#ifdef __clang__
  #pragma clang fp contract(off)
#endif
  if (!t.cos) {
    for (int e = 0; e < D; e++) out[e] = g[e];
    return;
  }
  const float* c = t.cos + b * t.batch + i * t.position;
  const float* s = t.sin + b * t.batch + i * t.position;
  int half = D / 2;
  for (int e = 0; e < D; e += VW) {
    int other = e < half ? e + half : e - half;
    vstore(out + e, vload(g + e) * vload(c + e) + vload(g + other) * vload(s + other));
  }
}
#pragma GCC pop_options

static inline long round_up(long n, long to) { return (n + to - 1) / to * to; }

/* The largest of s[l..u] (-inf if none), VW lanes at a time: a scalar running max is a chain of dependent maxes. */
static float row_max(const float* s, int l, int u) {
  vec best = (vec){0} - INFINITY;
  int j = l;
  for (; j + VW <= u + 1; j += VW) {
    vec v = vload(s + j);
    best = blend(v > best, v, best);
  }
  float m = hmax(best);
  for (; j <= u; j++) m = s[j] > m ? s[j] : m;
  return m;
}
/* out[r][j] = Σ_e a[r][e] · bt[e][j] for r < R and j < n (n a multiple of VW), bt's rows `ld` apart: tiles of
 * two vectors of keys, and one vector at the end where n is an odd number of them. */
static void rows_by_columns(const float* const* a, const float* bt, long ld, int d, int n, float* out, long ld_out) {
  int j = 0;
  for (; j + TILE <= n; j += TILE) {
    vec acc[R][2] = {{{0}}};
    for (int e = 0; e < d; e++) {
      vec b0 = vload(bt + e * ld + j), b1 = vload(bt + e * ld + j + VW);
      for (int r = 0; r < R; r++) {
        float s = a[r][e];
        acc[r][0] += s * b0;
        acc[r][1] += s * b1;
      }
    }
    for (int r = 0; r < R; r++) {
      vstore(out + r * ld_out + j, acc[r][0]);
      vstore(out + r * ld_out + j + VW, acc[r][1]);
    }
  }
  if (j < n) {
    vec acc[R] = {{0}};
    for (int e = 0; e < d; e++) {
      vec b0 = vload(bt + e * ld + j);
      for (int r = 0; r < R; r++) acc[r] += a[r][e] * b0;
    }
    for (int r = 0; r < R; r++) vstore(out + r * ld_out + j, acc[r]);
  }
}

/* One kv head's n rows (`ld` apart; batch row b), RoPE'd by the tables, into rows [n][d], contiguous (a stacked
 * projection's rows are kilobytes apart: read in place, each would be a cache line and a page of its own), and
 * unless t is NULL their transpose t[d][padded] (zero past n). */
static void load_keys(const float* keys, long ld, tables tb, int b, int n, int d, float* rows, float* t, int padded) {
  for (int j = 0; j < n; j++) rotate_in(keys + j * ld, tb, b, j, d, 1.0f, rows + (long)j * d);
  if (!t) return;
  for (int j = 0; j < padded; j++)
    for (int e = 0; e < d; e++) t[(long)e * padded + j] = j < n ? rows[(long)j * d + e] : 0.0f;
}

/* One block's shared key span: the smallest first key, one past the largest last key, the first rounded down to
 * a vector. Rows past the sequence (r >= rows) do not count. */
static void block_span(const int* lo, const int* hi, int rows, int* first, int* tiled_first, int* end) {
  int a = lo[0], b = hi[0];
  for (int r = 1; r < rows; r++) {
    a = lo[r] < a ? lo[r] : a;
    b = hi[r] > b ? hi[r] : b;
  }
  *first = a;
  *tiled_first = a / VW * VW;
  *end = b + 1;
}

/* The queries of one block: rows i0.. of head h, RoPE'd and scaled, with their key intervals; rows past S repeat
 * the last. */
static int load_block(const float* q, strides3 qs, tables tb, int b, int h, int i0, int S, int D, float scale,
                      const int* lo, const int* hi, float* rows, const float** a, int* rlo, int* rhi) {
  int count = S - i0 < R ? S - i0 : R;
  for (int r = 0; r < R; r++) {
    int i = r < count ? i0 + r : i0 + count - 1;
    rotate_in(q + b * qs.batch + i * qs.position + h * qs.head, tb, b, i, D, scale, rows + r * D);
    a[r] = rows + r * D;
    rlo[r] = lo[(long)b * S + i];
    rhi[r] = hi[(long)b * S + i];
  }
  return count;
}

/* out_j += Σ_r w[r][j] · x_r for every key j in [first, end), one tile of columns: x's R rows `ldx` apart and kept in
 * registers, out's rows `ld_out` apart, w's rows `ld` apart with w[r][j] at w[r * ld + j - j0]. */
static void accumulate_rows(const float* w, long ld, int j0, int first, int end, const float* x, long ldx, float* out,
                            long ld_out) {
  vec a0[R], a1[R];
  for (int r = 0; r < R; r++) {
    a0[r] = vload(x + r * ldx);
    a1[r] = vload(x + r * ldx + VW);
  }
  for (int j = first; j < end; j++) {
    float* o = out + (long)j * ld_out;
    vec s0 = vload(o), s1 = vload(o + VW);
    for (int r = 0; r < R; r++) {
      float weight = w[r * ld + j - j0];
      s0 += weight * a0[r];
      s1 += weight * a1[r];
    }
    vstore(o, s0);
    vstore(o + VW, s1);
  }
}

/* out[r] = scale · Σ_j w[r][j] · m_j over keys j in [first, end), for the block's R rows: m's rows [D] contiguous,
 * w as in accumulate_rows, out [R][D]. */
static void weighted_rows(const float* w, long ld, int j0, int first, int end, const float* m, int D, float scale,
                          float* out) {
  for (int dc = 0; dc < D; dc += TILE) {
    vec acc[R][2] = {{{0}}};
    for (int j = first; j < end; j++) {
      vec m0 = vload(m + (long)j * D + dc), m1 = vload(m + (long)j * D + dc + VW);
      for (int r = 0; r < R; r++) {
        float weight = w[r * ld + j - j0];
        acc[r][0] += weight * m0;
        acc[r][1] += weight * m1;
      }
    }
    for (int r = 0; r < R; r++) {
      vstore(out + r * D + dc, acc[r][0] * scale);
      vstore(out + r * D + dc + VW, acc[r][1] * scale);
    }
  }
}

/* Tensor `tensor`'s batch, position and head strides from the call's list. */
static strides3 strides_at(const long* strides, int tensor) {
  strides3 s = {strides[3 * tensor], strides[3 * tensor + 1], strides[3 * tensor + 2]};
  return s;
}

/* What both directions share. The call: the tensors' strides and the RoPE tables. */
typedef struct {
  strides3 q, k, v, out;
  tables rope;
  const int *lo, *hi;
  int B, S, Sk, Hq, Hkv, D, padded; /* S queries, Sk keys */
  float scale;
} call;

static call read_call(const long* strides, int tensors, const int* lo, const int* hi, const float* cos,
                      const float* sin, int B, int S, int Sk, int Hq, int Hkv, int D, float scale) {
  call c = {strides_at(strides, 0), strides_at(strides, 1), strides_at(strides, 2), strides_at(strides, 3),
            {cos, sin, strides[3 * tensors], strides[3 * tensors + 1]}, lo, hi, B, S, Sk, Hq, Hkv, D,
            (int)round_up(Sk, TILE), scale};
  return c;
}

/* One (batch row, kv head) task's keys, RoPE'd, and values, as contiguous rows [Sk][D], and the keys' transpose
 * [D][padded] (and the values', where vt is not NULL). */
typedef struct {
  float *keys, *kt, *values, *vt;
} head;

static void load_head(const call* c, const float* k, const float* v, int b, int hk, head h) {
  tables none = {0};
  load_keys(k + b * c->k.batch + hk * c->k.head, c->k.position, c->rope, b, c->Sk, c->D, h.keys, h.kt, c->padded);
  load_keys(v + b * c->v.batch + hk * c->v.head, c->v.position, none, b, c->Sk, c->D, h.values, h.vt, c->padded);
}

/* One block of R query rows of head h from i0: its scaled, RoPE'd queries (rows [R][D]), their intervals and
 * shared key span, and their scores against the span's keys, scores[r][j - j0]. */
typedef struct {
  const float* a[R];
  int lo[R], hi[R], count, first, j0, end;
} block;

static void block_scores(const call* c, const float* q, int b, int h, int i0, const float* kt, float* rows,
                         float* scores, block* blk) {
  blk->count = load_block(q, c->q, c->rope, b, h, i0, c->S, c->D, c->scale, c->lo, c->hi, rows, blk->a, blk->lo,
                          blk->hi);
  block_span(blk->lo, blk->hi, blk->count, &blk->first, &blk->j0, &blk->end);
  rows_by_columns(blk->a, kt + blk->j0, c->padded, c->D, (int)round_up(blk->end - blk->j0, VW), scores, c->padded);
}

/* Per-thread scratch carved from one allocation: `matrices` of [D][padded] floats, `blocks` of [R][padded] and
 * `row_sets` of [R][D]; `take` hands them out one at a time, 64-byte aligned. */
static float* scratch_for(const call* c, int matrices, int blocks, int row_sets) {
  return aligned_alloc(64, sizeof(float) * (matrices * round_up((long)c->D * c->padded, 16)
                                            + blocks * round_up((long)R * c->padded, 16)
                                            + row_sets * round_up((long)R * c->D, 16)));
}

static float* take(float** cursor, long n) {
  float* p = *cursor;
  *cursor += round_up(n, 16);
  return p;
}

/* A task's head buffers from the scratch; the values' transpose only where `transposed_values`. */
static head take_head(float** cursor, const call* c, int transposed_values) {
  long n = (long)c->D * c->padded;
  head h = {take(cursor, n), take(cursor, n), take(cursor, n), NULL};
  if (transposed_values) h.vt = take(cursor, n);
  return h;
}

/* forward: out [B][S][Hq][D] and lse [B][Hq][S] (the log of each row's softmax denominator, for backward) from
 * q [B][S][Hq][D], k and v [B][Sk][Hkv][D]; query i of batch row b sees keys lo[b][i]..hi[b][i] (none if hi < lo:
 * then lo must be 0, and its output is zeros). Queries are RoPE'd at their index i: with tables, Sk == S.
 * strides: q, k, v, out, then the tables'. D must be a multiple of TILE. */
void bios_interval_attention(const float* q, const float* k, const float* v, float* out, float* lse,
                             const long* strides, const int* lo, const int* hi, const float* cos, const float* sin,
                             int B, int S, int Sk, int Hq, int Hkv, int D, float scale, int threads) {
  call c = read_call(strides, 4, lo, hi, cos, sin, B, S, Sk, Hq, Hkv, D, scale);
  int G = Hq / Hkv, padded = c.padded;
  #pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* scratch = scratch_for(&c, 3, 1, 2);
    float* cursor = scratch;
    head kv = take_head(&cursor, &c, 0);
    float* scores = take(&cursor, (long)R * padded);
    float* rows = take(&cursor, (long)R * D);
    float* weighted = take(&cursor, (long)R * D);
    #pragma omp for schedule(static)
    for (int task = 0; task < B * Hkv; task++) {
      int b = task / Hkv, hk = task % Hkv;
      load_head(&c, k, v, b, hk, kv);
      for (int h = hk * G; h < (hk + 1) * G; h++) {
        for (int i0 = 0; i0 < S; i0 += R) {
          block blk;
          block_scores(&c, q, b, h, i0, kv.kt, rows, scores, &blk);
          float inverse[R];
          for (int r = 0; r < R; r++) {
            float* s = scores + r * padded - blk.j0; /* s[j] is key j's score */
            int l = blk.lo[r], u = blk.hi[r];
            float m = row_max(s, l, u), sum = 0.0f;
            int j = l;
            vec total = {0};
            for (; j + VW <= u + 1; j += VW) {
              vec p = vexp(vload(s + j) - m);
              vstore(s + j, p);
              total += p;
            }
            sum = hsum(total);
            for (; j <= u; j++) sum += (s[j] = expf(s[j] - m));
            for (j = blk.first; j < l; j++) s[j] = 0.0f;
            for (j = u + 1; j < blk.end; j++) s[j] = 0.0f;
            inverse[r] = sum > 0.0f ? 1.0f / sum : 0.0f; /* a query that sees no key: zeros */
            if (r < blk.count) lse[((long)b * Hq + h) * S + i0 + r] = m + logf(sum);
          }
          weighted_rows(scores, padded, blk.j0, blk.first, blk.end, kv.values, D, 1.0f, weighted);
          for (int r = 0; r < blk.count; r++) {
            float* o = out + b * c.out.batch + (i0 + r) * c.out.position + h * c.out.head;
            for (int e = 0; e < D; e += VW) vstore(o + e, vload(weighted + r * D + e) * inverse[r]);
          }
        }
      }
    }
    free(scratch);
  }
}

/* backward: grad_q, grad_k, grad_v from grad_out and the forward's q, k, v, out and lse, the same intervals.
 * strides: q, k, v, out, grad_out, grad_q, grad_k, grad_v, then the tables'. With P = exp(scores - lse),
 * D_i = grad_out_i · out_i and dS = P (grad_out vᵀ - D): grad_v = Pᵀ grad_out, grad_q = scale dS k, grad_k =
 * scale dSᵀ q (q and k RoPE'd, and these two rotated back). grad_q, grad_k and grad_v may be parts of one
 * stacked gradient. */
void bios_interval_attention_backward(const float* q, const float* k, const float* v, const float* out,
                                      const float* lse, const float* grad_out, float* grad_q, float* grad_k,
                                      float* grad_v, const long* strides, const int* lo, const int* hi,
                                      const float* cos, const float* sin, int B, int S, int Sk, int Hq, int Hkv,
                                      int D, float scale, int threads) {
  call c = read_call(strides, 8, lo, hi, cos, sin, B, S, Sk, Hq, Hkv, D, scale);
  strides3 gos = strides_at(strides, 4), gqs = strides_at(strides, 5), gks = strides_at(strides, 6),
           gvs = strides_at(strides, 7);
  tables none = {0};
  int G = Hq / Hkv, padded = c.padded;
  #pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* scratch = scratch_for(&c, 6, 2, 3);
    float* cursor = scratch;
    head kv = take_head(&cursor, &c, 1);
    float* dk = take(&cursor, (long)D * padded);
    float* dv = take(&cursor, (long)D * padded);
    float* p = take(&cursor, (long)R * padded);
    float* ds = take(&cursor, (long)R * padded);
    float* rows = take(&cursor, (long)R * D);
    float* grad_rows = take(&cursor, (long)R * D);
    float* grad_q_rows = take(&cursor, (long)R * D);
    #pragma omp for schedule(static)
    for (int task = 0; task < B * Hkv; task++) {
      int b = task / Hkv, hk = task % Hkv;
      load_head(&c, k, v, b, hk, kv);
      for (long x = 0; x < (long)padded * D; x++) dk[x] = dv[x] = 0.0f;
      for (int h = hk * G; h < (hk + 1) * G; h++) {
        for (int i0 = 0; i0 < S; i0 += R) {
          block blk;
          block_scores(&c, q, b, h, i0, kv.kt, rows, p, &blk);
          const float* ga[R];
          float delta[R], log_sum[R];
          for (int r = 0; r < R; r++) {
            int i = r < blk.count ? i0 + r : i0 + blk.count - 1;
            const float* g = grad_out + b * gos.batch + i * gos.position + h * gos.head;
            const float* o = out + b * c.out.batch + i * c.out.position + h * c.out.head;
            vec dot = {0};
            for (int e = 0; e < D; e += VW) {
              vec ge = vload(g + e);
              vstore(grad_rows + r * D + e, r < blk.count ? ge : (vec){0}); /* a repeated row adds nothing */
              dot += ge * vload(o + e);
            }
            delta[r] = hsum(dot);
            log_sum[r] = lse[((long)b * Hq + h) * S + i];
            ga[r] = grad_rows + r * D;
          }
          int j0 = blk.j0, first = blk.first, end = blk.end;
          rows_by_columns(ga, kv.vt + j0, padded, D, (int)round_up(end - j0, VW), ds, padded);
          for (int r = 0; r < R; r++) {
            float* pr = p + r * padded - j0;
            float* dr = ds + r * padded - j0;
            int l = blk.lo[r], u = r < blk.count ? blk.hi[r] : l - 1, j;
            for (j = first; j < l; j++) pr[j] = dr[j] = 0.0f;
            for (j = l; j + VW <= u + 1; j += VW) {
              vec weight = vexp(vload(pr + j) - log_sum[r]);
              vstore(pr + j, weight);
              vstore(dr + j, weight * (vload(dr + j) - delta[r]));
            }
            for (; j <= u; j++) {
              pr[j] = expf(pr[j] - log_sum[r]);
              dr[j] = pr[j] * (dr[j] - delta[r]);
            }
            for (j = u + 1 > first ? u + 1 : first; j < end; j++) pr[j] = dr[j] = 0.0f;
          }
          for (int dc = 0; dc < D; dc += TILE) { /* dv_j += Σ_r P[r][j] grad_out_r; dk_j += Σ_r dS[r][j] scale q_r */
            accumulate_rows(p, padded, j0, first, end, grad_rows + dc, D, dv + dc, D);
            accumulate_rows(ds, padded, j0, first, end, rows + dc, D, dk + dc, D);
          }
          weighted_rows(ds, padded, j0, first, end, kv.keys, D, scale, grad_q_rows); /* grad_q = scale dS k */
          for (int r = 0; r < blk.count; r++)
            rotate_back(grad_q_rows + r * D, c.rope, b, i0 + r, D,
                        grad_q + b * gqs.batch + (i0 + r) * gqs.position + h * gqs.head);
        }
      }
      for (int j = 0; j < c.Sk; j++) {
        rotate_back(dk + (long)j * D, c.rope, b, j, D, grad_k + b * gks.batch + j * gks.position + hk * gks.head);
        rotate_back(dv + (long)j * D, none, b, j, D, grad_v + b * gvs.batch + j * gvs.position + hk * gvs.head);
      }
    }
    free(scratch);
  }
}
