// attention_pool: the per-sample streaming part of multi-head attention pooling over time with one learned
// query, forward and backward kernels and their XLA FFI handlers (targets jaxfox_attention_pool_fwd,
// jaxfox_attention_pool_bwd). Math and conventions: jaxfox/attention.py, OPS.md "Attention pooling over time".
//
// Per sample (x @ W convention; head j owns the columns D_j = [j d, (j + 1) d), d = H / n), with
// u_j = W_k[:, D_j] q_{D_j} / sqrt d (computed by XLA, once for the batch):
//   s[j, t]     = h_t . u_j                                       (= q_j . k_{t,j} / sqrt d)
//   alpha[j, :] = softmax over the valid t of s[j, :]             (float32, max subtracted; masked t -> 0;
//                                                                   no valid t -> alpha = 0)
//   c_j         = sum_t alpha[j, t] h_t                           [H]
// These kernels compute (alpha, c) from (hs, mask, u), and the backward of that map:
//   a[j, t]     = dalpha[j, t] + h_t . dc_j,   rho_j = sum_t alpha[j, t] a[j, t]
//   ds[j, t]    = alpha[j, t] (a[j, t] - rho_j)                   (softmax backward; 0 at masked t)
//   dh_t        = sum_j alpha[j, t] dc_j + ds[j, t] u_j
//   du_j        = sum_b sum_t ds_b[j, t] h_{b,t}
// The weight products around them (u from W_k and q; pv_{D_j} = c_j W_v[:, D_j]; pooled = pv W_o + b_o; and
// their gradients) are batched GEMMs left to XLA in jaxfox/attention.py: a CTA never reads a weight matrix
// (the previous kernels, one CTA a sample doing u, pv and pooled itself, spent most of their time on
// dependent weight reads and were slower than XLA, BENCHMARKS.md).
//
// Kernels: a CTA of 256 threads owns G whole samples (G = attr samples_per_block: G T <= 64 rows unless T > 64,
// fewer when they would not fit in 96 KiB, one sample up to 160 KiB; jaxfox/attention.py _samples_per_block) and
// stages their hs rows (float32 by cp.async, every copy issued before any is waited for; bfloat16 converted), u and
// the per-sample vectors in shared memory (Layout below; jaxfox/attention.py _smem_bytes computes the same size).
// Every product is a warp walking rows with its lanes on the columns (LaneLayout: VW = 4, 2 or 1 consecutive columns
// a lane, NC chunks of 32 VW columns) and the per-head vectors of a group of 4 heads (u, or a sample's dc) in
// registers. Forward: (b) scores, a row a warp, the four head sums by one 6-shuffle butterfly (WarpSum4);
// (c) the softmax, one warp per (sample, head); (d) c, each warp summing its steps of one sample (t ascending) in
// registers, the k = 8 / G warps of a sample then added in warp order. Backward: (b) a = dalpha + h . dc as (b);
// (c) ds in place; (d) dh, a row a warp, stored straight from registers; (e) the block's du partial [n, H], each
// warp summing rows w, w + 8, ... in registers, the 8 warps' sums added in order into part[instance, block];
// attention_pool_du_kernel then adds the blocks' partials column by column in block order (FixedOrderColumnSum).
// Leading (vmap, broadcast_all) dims of every operand are a flattened instance count V (grid.y).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStageUnroll = 8;  // loads each thread keeps in flight while staging rows into shared memory
constexpr int kHeadGroup = 4;    // heads whose per-lane vectors a warp holds in registers at once

// Group i of four consecutive bfloat16 elements (8-byte aligned), as floats.
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* __restrict__ p, int i) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p) + i);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// VW consecutive floats: loads from shared memory (aligned to 4 VW bytes) and stores to global memory.
template <int VW>
struct Vec {
  float v[VW];
};
template <int VW>
__device__ __forceinline__ Vec<VW> LdsV(const float* p) {
  Vec<VW> r;
  if constexpr (VW == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    r.v[0] = t.x, r.v[1] = t.y, r.v[2] = t.z, r.v[3] = t.w;
  } else if constexpr (VW == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    r.v[0] = t.x, r.v[1] = t.y;
  } else {
#pragma unroll
    for (int e = 0; e < VW; ++e) r.v[e] = p[e];
  }
  return r;
}
template <int VW>
__device__ __forceinline__ void StV(float* p, const float* v) {
  if constexpr (VW == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (VW == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  } else {
#pragma unroll
    for (int e = 0; e < VW; ++e) p[e] = v[e];
  }
}
template <int VW>
__device__ __forceinline__ void StV(__nv_bfloat16* p, const float* v) {
  if constexpr (VW == 4) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    uint2 raw;
    raw.x = *reinterpret_cast<const uint32_t*>(&lo);
    raw.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p) = raw;
  } else if constexpr (VW == 2) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v[0], v[1]);
  } else {
#pragma unroll
    for (int e = 0; e < VW; ++e) p[e] = __float2bfloat16(v[e]);
  }
}

// Sums four per-lane values over the warp with 6 shuffles (a fixed butterfly): lane l returns the total of value
// (l >> 3) & 3, i.e. lanes 0-7 that of p0, 8-15 p1, 16-23 p2, 24-31 p3.
__device__ __forceinline__ float WarpSum4(float p0, float p1, float p2, float p3) {
  const int lane = threadIdx.x & 31;
  const bool b4 = lane & 16, b3 = lane & 8;
  float k0 = b4 ? p2 : p0, k1 = b4 ? p3 : p1;
  k0 += __shfl_xor_sync(0xffffffffu, b4 ? p0 : p2, 16);
  k1 += __shfl_xor_sync(0xffffffffu, b4 ? p1 : p3, 16);
  float k = b3 ? k1 : k0;
  k += __shfl_xor_sync(0xffffffffu, b3 ? k0 : k1, 8);
  k += __shfl_xor_sync(0xffffffffu, k, 4);
  k += __shfl_xor_sync(0xffffffffu, k, 2);
  k += __shfl_xor_sync(0xffffffffu, k, 1);
  return k;
}

// Shared-memory layout in floats for G samples of T steps (R = G T rows), n heads, H features, rows of H floats;
// every region starts 16-byte aligned. jaxfox/attention.py _smem_bytes computes the same size.
struct Layout {
  int64_t x, u, a, s, dc, m, slot, total;
  __host__ __device__ Layout(int G, int T, int H, int n) {
    const int64_t R = int64_t{G} * T;
    x = 0;                                 // hs rows [R][H]
    u = x + Round4(R * H);                 // u [n][H]
    a = u + Round4(int64_t{n} * H);        // alpha [n][R] (bwd)
    s = a + Round4(int64_t{n} * R);        // scores / exp / alpha (fwd); a, then ds (bwd) [n][R]
    dc = s + Round4(int64_t{n} * R);       // dc [G n][H] (bwd)
    m = dc + Round4(int64_t{G} * n * H);   // valid flags [R] (fwd)
    slot = m + Round4(R);                  // per-warp sums [kWarps][n H] (fwd: c slices; bwd: du)
    total = slot + int64_t{kWarps} * n * H;
  }
};

// The samples of this block: G per block along blockIdx.x (the last block may hold fewer), instance blockIdx.y.
struct BlockSamples {
  int ns, R;   // samples in this block, their rows ns T
  int64_t b0;  // global sample index (instance * B + first sample) of the block's first sample
  __device__ __forceinline__ BlockSamples(int64_t B, int T, int G) {
    const int64_t s0 = int64_t{blockIdx.x} * G;
    ns = static_cast<int>(B - s0 < G ? B - s0 : G);
    R = ns * T;
    b0 = int64_t{blockIdx.y} * B + s0;
  }
};

// Which rows a warp walks when its sums must stay within one sample: k = max(1, kWarps / G) warps share a sample;
// warp w takes sample g = w / k (then g + kWarps / k, ... while k == 1) and its steps t = w % k, + k, ...
struct SampleSlices {
  int k, g0, dg, t0;
  __device__ __forceinline__ SampleSlices(int G, int warp) {
    k = G >= kWarps ? 1 : kWarps / G;
    g0 = warp / k;
    dg = kWarps / k;
    t0 = warp - g0 * k;
  }
};

// Copies R rows of W elements (global, row-major) into dst [R][W] (shared, float). Float input: cp.async copies
// (16 bytes when W % 4 == 0, else 4), none waited for here: the caller waits (CpAsyncWaitAll) and synchronises
// before reading dst. Bfloat16 input (converted): each thread issues kStageUnroll loads before it stores any, in
// groups of four elements when W % 4 == 0.
__device__ __forceinline__ void StageRows(float* dst, const float* __restrict__ src, int R, int W) {
  if (W % 4 == 0) {
    for (int i = threadIdx.x; i < R * (W / 4); i += kThreads) CpAsync16(dst + 4 * i, src + 4 * i, true);
  } else {
    for (int i = threadIdx.x; i < R * W; i += kThreads) CpAsync4(dst + i, src + i, true);
  }
}
__device__ __forceinline__ void StageRows(float* dst, const __nv_bfloat16* __restrict__ src, int R, int W) {
  if (W % 4 == 0) {
    const int total = R * (W / 4);
    for (int base = threadIdx.x; base < total; base += kThreads * kStageUnroll) {
      float4 v[kStageUnroll];
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) v[k] = Load4(src, i);
      }
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) reinterpret_cast<float4*>(dst)[i] = v[k];
      }
    }
  } else {
    const int total = R * W;
    for (int base = threadIdx.x; base < total; base += kThreads * kStageUnroll) {
      float v[kStageUnroll];
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) v[k] = __bfloat162float(src[i]);
      }
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) dst[i] = v[k];
      }
    }
  }
}

// u (global [H, n]) as [n][H] in shared memory, by 4-byte cp.async copies (waited for by the caller).
__device__ __forceinline__ void StageU(float* dst, const float* __restrict__ u, int H, int n) {
  for (int e = threadIdx.x; e < n * H; e += kThreads) {
    const int h = e / n;
    CpAsync4(dst + (e - h * n) * H + h, u + e, true);
  }
}

// A lane's columns of a row of H features: chunk q (< NC) holds columns q 32 VW + lane VW + e, e < VW, valid when
// that start is < H (H % VW == 0, so a chunk is whole or absent).
template <int VW>
__device__ __forceinline__ int LaneCol(int q, int lane) {
  return q * 32 * VW + lane * VW;
}

// The lane's columns of rows j0 .. j0 + 3 of a [rows][H] shared array (rows >= j_end and absent chunks: 0).
template <int VW, int NC>
__device__ __forceinline__ void LoadHeadGroup(float (&out)[kHeadGroup][NC][VW], const float* base, int H, int j0,
                                              int j_end, int lane) {
#pragma unroll
  for (int jj = 0; jj < kHeadGroup; ++jj) {
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const int col = LaneCol<VW>(q, lane);
      const bool ok = j0 + jj < j_end && col < H;
      const Vec<VW> v = ok ? LdsV<VW>(base + int64_t{j0 + jj} * H + col) : Vec<VW>{};
#pragma unroll
      for (int e = 0; e < VW; ++e) out[jj][q][e] = ok ? v.v[e] : 0.f;
    }
  }
}

// Scores of row r for heads j0 .. j0 + 3 against the lane's vectors w (the four head sums of x_r . w_j), written to
// dst[j][r] of a [n][R] array by lanes 0, 8, 16, 24. Per lane: element e of chunk q added in order (q, e) into one
// partial per head; then WarpSum4's butterfly.
template <int VW, int NC>
__device__ __forceinline__ void RowScores(const float* xr, const float (&w)[kHeadGroup][NC][VW], int H, int j0,
                                          int n, int R, int r, int lane, float* dst, bool accumulate) {
  float p[kHeadGroup] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    const int col = LaneCol<VW>(q, lane);
    if (col < H) {
      const Vec<VW> xv = LdsV<VW>(xr + col);
#pragma unroll
      for (int jj = 0; jj < kHeadGroup; ++jj) {
#pragma unroll
        for (int e = 0; e < VW; ++e) p[jj] = fmaf(xv.v[e], w[jj][q][e], p[jj]);
      }
    }
  }
  const float total = WarpSum4(p[0], p[1], p[2], p[3]);
  const int j = j0 + (lane >> 3);
  if ((lane & 7) == 0 && j < n) {
    float* o = dst + int64_t{j} * R + r;
    *o = accumulate ? *o + total : total;
  }
}

// acc[jj] += W[j0 + jj][r] x_r at the lane's columns, for the heads j0 + jj < n of a [n][R] weight array W.
template <int VW, int NC>
__device__ __forceinline__ void AddWeightedRow(float (&acc)[kHeadGroup][NC][VW], const float* W, int R, int r, int j0,
                                               int n, const float* xr, int H, int lane) {
  float w[kHeadGroup];
#pragma unroll
  for (int jj = 0; jj < kHeadGroup; ++jj) w[jj] = j0 + jj < n ? W[int64_t{j0 + jj} * R + r] : 0.f;
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    const int col = LaneCol<VW>(q, lane);
    if (col < H) {
      const Vec<VW> xv = LdsV<VW>(xr + col);
#pragma unroll
      for (int jj = 0; jj < kHeadGroup; ++jj) {
#pragma unroll
        for (int e = 0; e < VW; ++e) acc[jj][q][e] = fmaf(w[jj], xv.v[e], acc[jj][q][e]);
      }
    }
  }
}

// Writes the heads j0 + jj < n of acc at the lane's columns into dst [n][H].
template <int VW, int NC>
__device__ __forceinline__ void StoreHeadGroup(float* dst, const float (&acc)[kHeadGroup][NC][VW], int H, int j0,
                                               int n, int lane) {
#pragma unroll
  for (int jj = 0; jj < kHeadGroup; ++jj) {
#pragma unroll
    for (int q = 0; q < NC; ++q) {
      const int col = LaneCol<VW>(q, lane);
      if (j0 + jj < n && col < H) StV<VW>(dst + int64_t{j0 + jj} * H + col, acc[jj][q]);
    }
  }
}

// Softmax over the valid steps of each (sample, head), one warp each, in place in S; alpha also to global memory.
__device__ __forceinline__ void Softmax(float* S, const float* valid_flags, float* __restrict__ alpha, int64_t b0,
                                       int ns, int T, int n, int R, int warp, int lane) {
  for (int grp = warp; grp < ns * n; grp += kWarps) {
    const int g = grp / n, j = grp - g * n;
    float* srow = S + int64_t{j} * R + g * T;
    const float* valid = valid_flags + g * T;
    float mx = -INFINITY;
    for (int t = lane; t < T; t += 32) {
      if (valid[t] != 0.f) mx = fmaxf(mx, srow[t]);
    }
    mx = WarpMax(mx);
    float sum = 0.f;
    for (int t = lane; t < T; t += 32) {
      const float e = valid[t] != 0.f ? expf(srow[t] - mx) : 0.f;
      srow[t] = e;
      sum += e;
    }
    sum = WarpSum(sum);
    float* out = alpha + ((b0 + g) * n + j) * T;
    for (int t = lane; t < T; t += 32) {
      const float a = sum == 0.f ? 0.f : srow[t] / sum;  // no valid step: alpha = 0 (a NaN sum stays NaN)
      srow[t] = a;
      out[t] = a;
    }
  }
}

// Forward: (hs [V, B, T, H], mask [V, B, T], u [V, H, n]) -> alpha [V, B, n, T], c [V, B, n, H].
template <typename In, int VW, int NC>
__global__ void __launch_bounds__(kThreads) attention_pool_fwd_kernel(
    const In* __restrict__ hs, const bool* __restrict__ mask, const float* __restrict__ u, int64_t B, int T, int H,
    int n, int G, float* __restrict__ alpha, float* __restrict__ c) {
  extern __shared__ __align__(16) float sm[];
  const Layout L(G, T, H, n);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const BlockSamples blk(B, T, G);
  const int ns = blk.ns, R = blk.R;
  const int64_t b0 = blk.b0;
  const int64_t nh = int64_t{n} * H;
  float* X = sm + L.x;
  float* S = sm + L.s;

  // (a) stage u (as [n][H]), the hs rows and the valid flags: every copy issued before any is waited for
  StageU(sm + L.u, u + int64_t{blockIdx.y} * H * n, H, n);
  StageRows(X, hs + b0 * T * H, R, H);
  for (int r = tid; r < R; r += kThreads) sm[L.m + r] = mask[b0 * T + r] ? 1.f : 0.f;
  CpAsyncWaitAll();
  __syncthreads();

  // (b) scores s[j][r] = h_r . u_j: warp w takes rows w, w + 8, ...; u of a head group in registers
  for (int j0 = 0; j0 < n; j0 += kHeadGroup) {
    float ur[kHeadGroup][NC][VW];
    LoadHeadGroup<VW, NC>(ur, sm + L.u, H, j0, n, lane);
    for (int r = warp; r < R; r += kWarps) RowScores<VW, NC>(X + int64_t{r} * H, ur, H, j0, n, R, r, lane, S, false);
  }
  __syncthreads();

  // (c) softmax over the valid steps of each (sample, head)
  Softmax(S, sm + L.m, alpha, b0, ns, T, n, R, warp, lane);
  __syncthreads();

  // (d) c[g, j, :] = sum_t alpha[j, g T + t] h_{g T + t}: each warp sums its steps of one sample (t ascending) in
  // registers; k > 1 warps of a sample add their sums in warp order through the slots
  const SampleSlices sl(G, warp);
  for (int g = sl.g0; g < ns; g += sl.dg) {
    for (int j0 = 0; j0 < n; j0 += kHeadGroup) {
      float acc[kHeadGroup][NC][VW] = {};
      for (int t = sl.t0; t < T; t += sl.k) {
        const int r = g * T + t;
        AddWeightedRow<VW, NC>(acc, S, R, r, j0, n, X + int64_t{r} * H, H, lane);
      }
      StoreHeadGroup<VW, NC>(sl.k == 1 ? c + (b0 + g) * nh : sm + L.slot + warp * nh, acc, H, j0, n, lane);
    }
  }
  if (sl.k > 1) {
    __syncthreads();
    for (int i = tid; i < ns * nh; i += kThreads) {
      const int g = static_cast<int>(i / nh);
      const int64_t e = i - g * nh;
      float v = 0.f;
      for (int w = 0; w < sl.k; ++w) v += sm[L.slot + (g * sl.k + w) * nh + e];
      c[b0 * nh + i] = v;
    }
  }
}

// Backward: (hs, u, alpha, dalpha [V, B, n, T], dc [V, B, n, H]) -> dh [V, B, T, H] (kDh), and the block's
// du partial part[V, gridDim.x, n H] (layout [j][h]).
template <typename In, int VW, int NC, bool kDh>
__global__ void __launch_bounds__(kThreads) attention_pool_bwd_kernel(
    const In* __restrict__ hs, const float* __restrict__ u, const float* __restrict__ alpha,
    const float* __restrict__ dalpha, const float* __restrict__ dc, int64_t B, int T, int H, int n, int G,
    In* __restrict__ dh, float* __restrict__ part) {
  extern __shared__ __align__(16) float sm[];
  const Layout L(G, T, H, n);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const BlockSamples blk(B, T, G);
  const int ns = blk.ns, R = blk.R;
  const int64_t b0 = blk.b0;
  const int64_t nh = int64_t{n} * H;
  float* X = sm + L.x;
  float* A = sm + L.a;
  float* S = sm + L.s;
  float* DC = sm + L.dc;

  // (a) stage alpha, dalpha (into S), u, dc (rows g n + j) and the hs rows: every copy issued before any is waited for
  for (int e = tid; e < ns * n * T; e += kThreads) {  // e = (g n + j) T + t, as alpha / dalpha are laid out
    const int gj = e / T, t = e - gj * T;
    const int g = gj / n, j = gj - g * n;
    const int64_t at = int64_t{j} * R + g * T + t;
    CpAsync4(A + at, alpha + b0 * n * T + e, true);
    CpAsync4(S + at, dalpha + b0 * n * T + e, true);
  }
  StageU(sm + L.u, u + int64_t{blockIdx.y} * H * n, H, n);
  StageRows(DC, dc + b0 * nh, ns * n, H);
  StageRows(X, hs + b0 * T * H, R, H);
  CpAsyncWaitAll();
  __syncthreads();

  // (b) a[j][r] = dalpha[j][r] + h_r . dc_{g(r), j}: a warp walks steps of one sample, dc of a head group in registers
  const SampleSlices sl(G, warp);
  for (int g = sl.g0; g < ns; g += sl.dg) {
    for (int j0 = 0; j0 < n; j0 += kHeadGroup) {
      float dr[kHeadGroup][NC][VW];
      LoadHeadGroup<VW, NC>(dr, DC + int64_t{g} * nh, H, j0, n, lane);
      for (int t = sl.t0; t < T; t += sl.k) {
        const int r = g * T + t;
        RowScores<VW, NC>(X + int64_t{r} * H, dr, H, j0, n, R, r, lane, S, true);
      }
    }
  }
  __syncthreads();

  // (c) ds = alpha (a - rho) in place, rho = sum_t alpha a, one warp per (sample, head)
  for (int grp = warp; grp < ns * n; grp += kWarps) {
    const int g = grp / n, j = grp - g * n;
    float* srow = S + int64_t{j} * R + g * T;
    const float* arow = A + int64_t{j} * R + g * T;
    float rho = 0.f;
    for (int t = lane; t < T; t += 32) rho = fmaf(arow[t], srow[t], rho);
    rho = WarpSum(rho);
    for (int t = lane; t < T; t += 32) srow[t] = arow[t] * (srow[t] - rho);
  }
  __syncthreads();

  // (d) dh_r = sum_j alpha[j][r] dc_{g(r), j} + ds[j][r] u_j (j ascending, the alpha term first): a warp walks steps
  // of one sample; with n <= 4 heads dc and u stay in registers
  if (kDh) {
    for (int g = sl.g0; g < ns; g += sl.dg) {
      In* out = dh + (b0 + g) * T * H;
      if (n <= kHeadGroup) {
        float dr[kHeadGroup][NC][VW], ur[kHeadGroup][NC][VW];
        LoadHeadGroup<VW, NC>(dr, DC + int64_t{g} * nh, H, 0, n, lane);
        LoadHeadGroup<VW, NC>(ur, sm + L.u, H, 0, n, lane);
        for (int t = sl.t0; t < T; t += sl.k) {
          const int r = g * T + t;
          float al[kHeadGroup], ds[kHeadGroup];
#pragma unroll
          for (int jj = 0; jj < kHeadGroup; ++jj) {
            al[jj] = jj < n ? A[int64_t{jj} * R + r] : 0.f;
            ds[jj] = jj < n ? S[int64_t{jj} * R + r] : 0.f;
          }
#pragma unroll
          for (int q = 0; q < NC; ++q) {
            const int col = LaneCol<VW>(q, lane);
            if (col >= H) continue;
            float acc[VW];
#pragma unroll
            for (int e = 0; e < VW; ++e) {
              acc[e] = 0.f;
#pragma unroll
              for (int jj = 0; jj < kHeadGroup; ++jj) {
                if (jj < n) acc[e] = fmaf(ds[jj], ur[jj][q][e], fmaf(al[jj], dr[jj][q][e], acc[e]));
              }
            }
            StV<VW>(out + int64_t{t} * H + col, acc);
          }
        }
      } else {
        for (int t = sl.t0; t < T; t += sl.k) {
          const int r = g * T + t;
#pragma unroll
          for (int q = 0; q < NC; ++q) {
            const int col = LaneCol<VW>(q, lane);
            if (col >= H) continue;
            float acc[VW] = {};
            for (int j = 0; j < n; ++j) {
              const float al = A[int64_t{j} * R + r], ds = S[int64_t{j} * R + r];
              const Vec<VW> d = LdsV<VW>(DC + int64_t{g} * nh + int64_t{j} * H + col);
              const Vec<VW> uj = LdsV<VW>(sm + L.u + int64_t{j} * H + col);
#pragma unroll
              for (int e = 0; e < VW; ++e) acc[e] = fmaf(ds, uj.v[e], fmaf(al, d.v[e], acc[e]));
            }
            StV<VW>(out + int64_t{t} * H + col, acc);
          }
        }
      }
    }
  }

  // (e) the block's du partial [j][h] = sum over its rows of ds[j][r] h_r: warp w sums rows w, w + 8, ... (ascending)
  // in registers, then the warps' sums are added in warp order
  for (int j0 = 0; j0 < n; j0 += kHeadGroup) {
    float acc[kHeadGroup][NC][VW] = {};
    for (int r = warp; r < R; r += kWarps) AddWeightedRow<VW, NC>(acc, S, R, r, j0, n, X + int64_t{r} * H, H, lane);
    StoreHeadGroup<VW, NC>(sm + L.slot + warp * nh, acc, H, j0, n, lane);
  }
  __syncthreads();
  float* prow = part + (int64_t{blockIdx.y} * gridDim.x + blockIdx.x) * nh;
  for (int64_t i = tid; i < nh; i += kThreads) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += sm[L.slot + w * nh + i];
    prow[i] = v;
  }
}

// du [V, n H] = the column sums of the blocks' partials [V, blocks, n H], in a fixed order (FixedOrderColumnSum).
__global__ void __launch_bounds__(32 * kSumRows)
    attention_pool_du_kernel(const float* __restrict__ part, int64_t blocks, int64_t nh, float* __restrict__ du) {
  const int64_t v = blockIdx.y, col = int64_t{blockIdx.x} * 32 + (threadIdx.x & 31);
  float total;
  if (FixedOrderColumnSum(part + v * blocks * nh, blocks, nh, col, &total)) du[v * nh + col] = total;
}

// The lane vector width and chunk count of a row of H features: VW = 4 when H % 4 == 0 and H >= 128, else 2 when
// H % 2 == 0 and H >= 64, else 1 (so that a warp's lanes are all busy where H allows); NC = the chunks of 32 VW
// columns, rounded up to 1, 2 or 4 (the compiled variants); 0 when H needs more than 4 (jaxfox/attention.py
// _lane_chunks routes those shapes to XLA).
inline void LaneLayout(int64_t H, int* vw, int* nc) {
  *vw = H % 4 == 0 && H >= 128 ? 4 : H % 2 == 0 && H >= 64 ? 2 : 1;
  const int64_t chunks = CeilDiv(H, 32 * *vw);
  *nc = chunks <= 1 ? 1 : chunks <= 2 ? 2 : chunks <= 4 ? 4 : 0;
}

struct PoolDims {
  int64_t V = -1, B = 0, T = 0, H = 0, n = 0, G = 1, blocks = 0;
  int vw = 1, nc = 1;  // LaneLayout(H)
};

// Calls f(integral_constant VW, integral_constant NC) for the compiled kernel variant of the lane layout (vw, nc).
template <typename F>
ffi::Error WithLaneLayout(int vw, int nc, F&& f) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if (vw == 4) return nc == 1 ? f(Four{}, One{}) : nc == 2 ? f(Four{}, Two{}) : f(Four{}, Four{});
  if (vw == 2) return nc == 1 ? f(Two{}, One{}) : nc == 2 ? f(Two{}, Two{}) : f(Two{}, Four{});
  return nc == 1 ? f(One{}, One{}) : nc == 2 ? f(One{}, Two{}) : f(One{}, Four{});
}

// hs [V.., B, T, H] (float32 or bfloat16), u [V.., H, n], samples_per_block G -> dims; checks that the block
// layout fits the device's shared memory and the grid's limits.
ffi::Error CheckCommon(const ffi::AnyBuffer& hs, const ffi::Buffer<ffi::F32>& u, int64_t samples_per_block,
                       PoolDims* d) {
  if (hs.element_type() != ffi::F32 && hs.element_type() != ffi::BF16) {
    return InvalidArgument("attention_pool: hs must be float32 or bfloat16");
  }
  auto hd = hs.dimensions();
  auto ud = u.dimensions();
  if (hd.size() < 3 || ud.size() < 2) {
    return InvalidArgument("attention_pool: expected hs [.., B, T, H] and u [.., H, n], got hs " + DimsToString(hd) +
                           ", u " + DimsToString(ud));
  }
  d->B = hd[hd.size() - 3];
  d->T = hd[hd.size() - 2];
  d->H = hd[hd.size() - 1];
  d->n = ud[ud.size() - 1];
  JAXFOX_RETURN_IF_ERROR(CheckShape(hs, "attention_pool: hs", {d->B, d->T, d->H}, &d->V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(u, "attention_pool: u", {d->H, d->n}, &d->V));
  if (d->n < 1 || d->H < 1 || d->H % d->n != 0) {
    return InvalidArgument("attention_pool: u must be [H, n] with n >= 1 dividing H, got " + DimsToString(ud));
  }
  LaneLayout(d->H, &d->vw, &d->nc);
  if (d->nc == 0) {
    return InvalidArgument("attention_pool: H = " + std::to_string(d->H) +
                           " needs more than 4 column chunks a lane (H <= 512 with H % 4 == 0, H <= 256 with H % 2 == 0, "
                           "else H <= 128)");
  }
  d->G = samples_per_block;
  if (d->G < 1 || d->G * d->T > 0x7fffffff / (d->H + 1)) {
    return InvalidArgument("attention_pool: samples_per_block must be >= 1 with a block's rows indexable, got " +
                           std::to_string(samples_per_block));
  }
  d->blocks = CeilDiv(d->B, d->G);
  if (d->blocks > 0x7fffffff || d->V > 65535) {
    return InvalidArgument("attention_pool: too many blocks (" + std::to_string(d->blocks) + " per instance, " +
                           std::to_string(d->V) + " instances)");
  }
  return ffi::Error::Success();
}

template <typename Kernel>
ffi::Error Smem(const PoolDims& d, Kernel kernel, int64_t* bytes) {
  const Layout L(static_cast<int>(d.G), static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.n));
  *bytes = L.total * 4;
  return PrepareSmem("attention_pool", kernel, *bytes);
}

// FFI target jaxfox_attention_pool_fwd: (hs [.., B, T, H], mask [.., B, T], u [.., H, n]) -> alpha [.., B, n, T],
// c [.., B, n, H].
ffi::Error AttentionPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer hs, ffi::Buffer<ffi::PRED> mask,
                                ffi::Buffer<ffi::F32> u, int64_t samples_per_block, ffi::ResultBuffer<ffi::F32> alpha,
                                ffi::ResultBuffer<ffi::F32> c) {
  ClearStaleCudaError();
  PoolDims d;
  JAXFOX_RETURN_IF_ERROR(CheckCommon(hs, u, samples_per_block, &d));
  JAXFOX_RETURN_IF_ERROR(CheckShape(mask, "attention_pool: mask", {d.B, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*alpha, "attention_pool: alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*c, "attention_pool: c", {d.B, d.n, d.H}, &d.V));
  if (d.V == 0 || d.B == 0) return ffi::Error::Success();
  if (d.T == 0) {  // no steps: alpha is empty, c = 0
    cudaMemsetAsync(c->typed_data(), 0, sizeof(float) * d.V * d.B * d.n * d.H, stream);
    return LastCudaError("attention_pool_fwd (T = 0)");
  }
  const dim3 grid(static_cast<unsigned>(d.blocks), static_cast<unsigned>(d.V));
  auto launch = [&](auto* in) -> ffi::Error {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    return WithLaneLayout(d.vw, d.nc, [&](auto vw, auto nc) -> ffi::Error {
      auto kernel = attention_pool_fwd_kernel<In, decltype(vw)::value, decltype(nc)::value>;
      int64_t bytes = 0;
      JAXFOX_RETURN_IF_ERROR(Smem(d, kernel, &bytes));
      kernel<<<grid, kThreads, bytes, stream>>>(in, mask.typed_data(), u.typed_data(), d.B, static_cast<int>(d.T),
                                                static_cast<int>(d.H), static_cast<int>(d.n), static_cast<int>(d.G),
                                                alpha->typed_data(), c->typed_data());
      return LastCudaError("attention_pool_fwd");
    });
  };
  if (hs.element_type() == ffi::F32) return launch(static_cast<const float*>(hs.untyped_data()));
  return launch(static_cast<const __nv_bfloat16*>(hs.untyped_data()));
}

// FFI target jaxfox_attention_pool_bwd: (hs, u, alpha, dalpha [.., B, n, T], dc [.., B, n, H]) -> dh [.., B, T, H]
// (dtype of hs; or [.., 0]: not computed), du [.., n H] (layout [j][h]), and the workspace part [.., blocks, n H]
// (the blocks' du partials). Two launches: the backward kernel, then attention_pool_du_kernel's fixed-order sum.
ffi::Error AttentionPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer hs, ffi::Buffer<ffi::F32> u,
                                ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> dalpha, ffi::Buffer<ffi::F32> dc,
                                int64_t samples_per_block, ffi::Result<ffi::AnyBuffer> dh,
                                ffi::ResultBuffer<ffi::F32> du, ffi::ResultBuffer<ffi::F32> part) {
  ClearStaleCudaError();
  PoolDims d;
  JAXFOX_RETURN_IF_ERROR(CheckCommon(hs, u, samples_per_block, &d));
  JAXFOX_RETURN_IF_ERROR(CheckShape(alpha, "attention_pool: alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(dalpha, "attention_pool: d alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(dc, "attention_pool: d c", {d.B, d.n, d.H}, &d.V));
  const int64_t nh = d.n * d.H;
  JAXFOX_RETURN_IF_ERROR(CheckShape(*du, "attention_pool: du", {nh}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*part, "attention_pool: partials", {d.blocks, nh}, &d.V));
  const bool want_dh = dh->element_count() != 0;  // [.., 0]: hs is not differentiated
  if (want_dh) {
    JAXFOX_RETURN_IF_ERROR(CheckShape(*dh, "attention_pool: dh", {d.B, d.T, d.H}, &d.V));
    if (dh->element_type() != hs.element_type()) return InvalidArgument("attention_pool: dh dtype must match hs");
  }
  if (d.V == 0) return ffi::Error::Success();
  if (d.B == 0 || d.T == 0) {  // nothing to sum: du = 0 (dh is empty or, for T = 0, has no elements)
    cudaMemsetAsync(du->typed_data(), 0, sizeof(float) * d.V * nh, stream);
    return LastCudaError("attention_pool_bwd (B = 0 or T = 0)");
  }
  const dim3 grid(static_cast<unsigned>(d.blocks), static_cast<unsigned>(d.V));
  auto launch = [&](auto* in, auto kdh) -> ffi::Error {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    return WithLaneLayout(d.vw, d.nc, [&](auto vw, auto nc) -> ffi::Error {
      auto kernel = attention_pool_bwd_kernel<In, decltype(vw)::value, decltype(nc)::value, decltype(kdh)::value>;
      int64_t bytes = 0;
      JAXFOX_RETURN_IF_ERROR(Smem(d, kernel, &bytes));
      kernel<<<grid, kThreads, bytes, stream>>>(in, u.typed_data(), alpha.typed_data(), dalpha.typed_data(),
                                                dc.typed_data(), d.B, static_cast<int>(d.T), static_cast<int>(d.H),
                                                static_cast<int>(d.n), static_cast<int>(d.G),
                                                decltype(kdh)::value ? static_cast<In*>(dh->untyped_data()) : nullptr,
                                                part->typed_data());
      return LastCudaError("attention_pool_bwd");
    });
  };
  using Yes = std::integral_constant<bool, true>;
  using No = std::integral_constant<bool, false>;
  ffi::Error err = ffi::Error::Success();
  if (hs.element_type() == ffi::F32) {
    const auto* in = static_cast<const float*>(hs.untyped_data());
    err = want_dh ? launch(in, Yes{}) : launch(in, No{});
  } else {
    const auto* in = static_cast<const __nv_bfloat16*>(hs.untyped_data());
    err = want_dh ? launch(in, Yes{}) : launch(in, No{});
  }
  JAXFOX_RETURN_IF_ERROR(err);
  const dim3 sum_grid(static_cast<unsigned>(CeilDiv(nh, 32)), static_cast<unsigned>(d.V));
  attention_pool_du_kernel<<<sum_grid, 32 * kSumRows, 0, stream>>>(part->typed_data(), d.blocks, nh,
                                                                   du->typed_data());
  return LastCudaError("attention_pool_du");
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_attention_pool_fwd, jaxfox::AttentionPoolFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // hs
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // u [H, n]
                                  .Attr<int64_t>("samples_per_block")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // alpha
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // c
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_attention_pool_bwd, jaxfox::AttentionPoolBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // hs
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // u
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // alpha
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // d alpha
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // d c
                                  .Attr<int64_t>("samples_per_block")
                                  .Ret<xla::ffi::AnyBuffer>()               // dh (or [0])
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // du [n H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: per-block partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
