// attention_pool: multi-head attention pooling over time with one learned query, forward and
// backward kernels and their XLA FFI handlers (targets jaxfox_attention_pool_fwd,
// jaxfox_attention_pool_bwd). Math and conventions: jaxfox/attention.py, OPS.md "Attention pooling
// over time".
//
// Notation, per sample (x @ W convention: W [in, out] row-major; head j owns the columns
// D_j = [j d, (j + 1) d), d = H / n; j(i) is the head of column i):
//   u_j[m]      = (1 / sqrt d) sum_{i in D_j} W_k[m, i] q_i     so s[j, t] = h_t . u_j = q_j . k_{t,j} / sqrt d
//   alpha[j, :] = softmax over the valid t of s[j, :]            (float32, max subtracted; masked t -> 0)
//   c_j[m]      = sum_t alpha[j, t] h_t[m]                       (attention-weighted input of head j)
//   pv[i]       = sum_m c_{j(i)}[m] W_v[m, i]                    (= sum_t alpha[j(i), t] v_t[i])
//   pooled      = pv @ W_o + b_o                                 (all steps masked: pooled = 0, alpha = 0)
// so K = hs W_k and V = hs W_v are never formed: per sample the forward costs T n H (scores) +
// T n H (c) + 3 H^2 (u, pv, pooled) multiply-adds instead of 2 T H^2.
// Backward, with g = d pooled and dalpha the cotangent of alpha:
//   dpv[i]      = sum_o W_o[i, o] g[o]
//   dc_j[m]     = sum_{i in D_j} W_v[m, i] dpv[i]
//   a[j, t]     = dalpha[j, t] + h_t . dc_j,   rho_j = sum_t alpha[j, t] a[j, t]
//   ds[j, t]    = alpha[j, t] (a[j, t] - rho_j)                 (softmax backward; 0 at masked t)
//   e_j[m]      = sum_t ds[j, t] h_t[m]                          (= d u_j)
//   dh_t        = sum_j alpha[j, t] dc_j + ds[j, t] u_j
//   dq_i        = (1 / sqrt d) sum_m W_k[m, i] e_{j(i)}[m]
// and the parameter gradients, summed over the samples b:
//   dW_k[m, i]  = (q_i / sqrt d) sum_b e_{b, j(i)}[m]
//   dW_v[m, i]  = sum_b c_{b, j(i)}[m] dpv_b[i]
//   dW_o[i, o]  = sum_b pv_b[i] g_b[o]
//   dq          = sum_b dq_b,   db_o = sum_b g_b     (a sample with no valid step contributes 0)
//
// Kernels. Forward and backward: one CTA of 256 threads per sample (grid = V * B), the whole time
// loop inside; hs is staged through shared memory in tiles of TT steps (TT = attr tile_t, chosen in
// Python so that everything fits in 48 KiB; TT = T for the target shapes, so hs is read from
// global memory once). The weights are read from L2 by every CTA (coalesced). Scores, alpha and
// the softmax-backward ds of the whole sequence live in global memory (alpha is an output; ds is a
// workspace output), per head.
// The parameter gradient is a sum of per-sample low-rank terms, so the backward CTA writes only
// per-sample factors [g | dpv | dq_b | e] ((3 + n) H floats) instead of a [B, P] partial
// (3 H^2 + 2 H floats); the forward residuals c and pv are the remaining factors. A tiled kernel
// (wgrad) then forms each output element as a sum over the samples of one row-range chunk, b
// ascending, with fmaf (chunk count: jaxfox.reduce.reduce_chunks(B, P)); with more than one chunk
// the [chunks, P] chunk partials are summed by LaunchReduceAxis0 (reduce.cu's fixed order).
// Every sum has a fixed order and every output element has one writer: no atomics, bitwise
// deterministic, and a sample's outputs do not depend on the batch around it.
#include <cuda_bf16.h>

#include <cmath>
#include <type_traits>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSmemLimitBytes = 48 * 1024;  // no opt-in needed; jaxfox/attention.py agrees
constexpr int kMinBlocks = 3;                  // fwd/bwd: 3 CTAs per SM (<= 85 registers; 3 x 41 KiB smem)
constexpr int kWTile = 32;                      // wgrad output tile: 32 x 32 (32 columns x 8 groups of 4 rows)

__host__ __device__ inline int PaddedH(int H) { return H | 1; }  // odd row stride: conflict-free column walks
__host__ __device__ inline int64_t ParamCount(int64_t H) { return 3 * H * H + 2 * H; }
__host__ __device__ inline int64_t FactorCount(int64_t H, int64_t n) { return (3 + n) * H; }
constexpr int kMinStageRows = 16;               // weight rows staged at a time, at least (when H >= 16)
// The region holds an hs tile [TT][Hp] or staged weight rows [R][Hp].
__host__ __device__ inline int RegionFloats(int H, int TT) {
  const int a = TT * PaddedH(H);
  const int c = (H < kMinStageRows ? H : kMinStageRows) * PaddedH(H);
  return a > c ? a : c;
}
// Shared memory in floats: u, m1, m2 [n][Hp]; vec [3][H]; stats [2n]; scratch [kThreads];
// at, dt [n][TT]; region. jaxfox/attention.py (_smem_floats) computes the same number to choose tile_t.
__host__ __device__ inline int64_t SmemFloats(int H, int n, int TT) {
  return 3LL * n * PaddedH(H) + 3LL * H + 2LL * n + kThreads + 2LL * n * TT + RegionFloats(H, TT);
}

struct Smem {
  float *u, *m1, *m2, *vec0, *vec1, *stats, *scratch, *at, *dt, *region;
  int Hp, R;  // R: weight rows staged at a time
};

__device__ inline Smem Carve(float* base, int H, int n, int TT) {
  Smem s;
  s.Hp = PaddedH(H);
  s.u = base;
  s.m1 = s.u + n * s.Hp;
  s.m2 = s.m1 + n * s.Hp;
  s.vec0 = s.m2 + n * s.Hp;
  s.vec1 = s.vec0 + H;  // vec[2] = vec1 + H: d pooled in the backward kernel
  s.stats = s.vec0 + 3 * H;
  s.scratch = s.stats + 2 * n;
  s.at = s.scratch + kThreads;
  s.dt = s.at + n * TT;
  s.region = s.dt + n * TT;
  const int rows = RegionFloats(H, TT) / s.Hp;
  s.R = rows < H ? rows : H;
  return s;
}

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T FromF(float x);
template <> __device__ __forceinline__ float FromF<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// tile[t * Hp + m] = float(src[t * H + m]) for t < tt, m < H (coalesced global reads).
template <typename Tin>
__device__ __forceinline__ void LoadTile(float* tile, const Tin* __restrict__ src, int tt, int H, int Hp) {
  const int count = tt * H;
  if constexpr (std::is_same<Tin, float>::value) {
    if ((H & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      const float4* s4 = reinterpret_cast<const float4*>(src);
      for (int k = threadIdx.x; k < count / 4; k += kThreads) {
        const float4 x = __ldg(s4 + k);
        const int idx = 4 * k, t = idx / H, m = idx - t * H;  // H % 4 == 0: the 4 values share a row
        float* dst = tile + t * Hp + m;
        dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
      }
      return;
    }
  }
  for (int idx = threadIdx.x; idx < count; idx += kThreads) {
    const int t = idx / H, m = idx - t * H;
    tile[t * Hp + m] = ToF(src[idx]);
  }
}

// Stages W[m0 : m0 + rows, :] (row-major, H columns) into region[r * Hp + col].
__device__ __forceinline__ void StageRows(float* region, const float* __restrict__ W, int rows, int H, int Hp) {
  const int count = rows * H;
  if ((H & 3) == 0 && (reinterpret_cast<uintptr_t>(W) & 15) == 0) {
    const float4* w4 = reinterpret_cast<const float4*>(W);
    for (int k = threadIdx.x; k < count / 4; k += kThreads) {
      const float4 x = __ldg(w4 + k);
      const int idx = 4 * k, r = idx / H, col = idx - r * H;
      float* dst = region + r * Hp + col;
      dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < count; idx += kThreads) {
    const int r = idx / H, col = idx - r * H;
    region[r * Hp + col] = __ldg(W + idx);
  }
}

// Row-segment dot products: out[j * out_stride + m] = scale * sum_{k < d} W[m, j d + k] vec[j d + k]
// for m < H, j < n (n d = H). W rows are staged R at a time; thread (r, j) sums k ascending.
// Starts and ends with the block in step (ends with __syncthreads).
__device__ __forceinline__ void RowSegDots(const float* __restrict__ W, const float* vec, int H, int n, int d, float scale,
                           const Smem& S, float* out, int out_stride) {
  for (int m0 = 0; m0 < H; m0 += S.R) {
    const int rows = min(S.R, H - m0);
    StageRows(S.region, W + static_cast<int64_t>(m0) * H, rows, H, S.Hp);
    __syncthreads();
    for (int p = threadIdx.x; p < rows * n; p += kThreads) {
      const int j = p / rows, r = p - j * rows;
      const float* w = S.region + r * S.Hp + j * d;
      const float* x = vec + j * d;
      float acc = 0.f;
      for (int k = 0; k < d; ++k) acc = fmaf(w[k], x[k], acc);
      out[j * out_stride + m0 + r] = acc * scale;
    }
    __syncthreads();
  }
}

// Column dot products: out[i] = scale * sum_m W[m, i] vecs[(i / d) * head_stride + m], i < H.
// H <= kThreads: W rows are staged R at a time (coalesced float4 loads), thread (i, part) walks
// its share of each staged block's rows (m ascending) in shared memory, and the parts' sums are
// added in part order. H > kThreads: thread i walks its column in global memory (coalesced
// across i). `out` may be shared or global. Ends with __syncthreads.
__device__ __forceinline__ void ColDots(const float* __restrict__ W, const float* vecs, int head_stride, int d, int H,
                                        float scale, const Smem& S, float* out) {
  const int tid = threadIdx.x;
  if (H > kThreads) {
    for (int i = tid; i < H; i += kThreads) {
      const float* x = vecs + (i / d) * head_stride;
      float acc = 0.f;
#pragma unroll 4
      for (int m = 0; m < H; ++m) acc = fmaf(__ldg(W + static_cast<int64_t>(m) * H + i), x[m], acc);
      out[i] = acc * scale;
    }
    __syncthreads();
    return;
  }
  const int parts = kThreads / H;
  const int part = tid / H, i = tid - part * H;
  const bool active = part < parts;
  const float* x = vecs + (i / d) * head_stride;
  float acc = 0.f;
  for (int m0 = 0; m0 < H; m0 += S.R) {
    const int rows = min(S.R, H - m0);
    StageRows(S.region, W + static_cast<int64_t>(m0) * H, rows, H, S.Hp);
    __syncthreads();
    if (active) {
      const int per = (rows + parts - 1) / parts;
      const int r1 = min(rows, (part + 1) * per);
      for (int r = part * per; r < r1; ++r) acc = fmaf(S.region[r * S.Hp + i], x[m0 + r], acc);
    }
    __syncthreads();
  }
  if (active) S.scratch[part * H + i] = acc;
  __syncthreads();
  for (int k = tid; k < H; k += kThreads) {
    float a = S.scratch[k];
    for (int p = 1; p < parts; ++p) a += S.scratch[p * H + k];
    out[k] = a * scale;
  }
  __syncthreads();
}

// dst[j * T + t] = (add ? add[j * T + t] : 0) + sum_m tile[t, m] vecs[j, m] for t < tt, j < n
// (dst and add point at step t0 of the sequence). m ascending.
__device__ __forceinline__ void HeadDots(const float* tile, int tt, const float* vecs, int H, int Hp, int n, int T,
                         const float* add, float* dst) {
  for (int p = threadIdx.x; p < tt * n; p += kThreads) {
    const int j = p / tt, t = p - j * tt;
    const float* h = tile + t * Hp;
    const float* x = vecs + j * Hp;
    float acc = 0.f;
    for (int m = 0; m < H; ++m) acc = fmaf(h[m], x[m], acc);
    if (add != nullptr) acc = add[j * T + t] + acc;
    dst[j * T + t] = acc;
  }
}

// acc[j * Hp + m] (=, when first; else +=) sum_{t < tt} w[j * TT + t] tile[t, m]; t ascending.
__device__ __forceinline__ void AccumulateHeads(const float* tile, int tt, const float* w, int TT, int H, int Hp, int n,
                                float* acc_s, bool first) {
  for (int p = threadIdx.x; p < n * H; p += kThreads) {
    const int j = p / H, m = p - j * H;
    float acc = first ? 0.f : acc_s[j * Hp + m];
    const float* wj = w + j * TT;
    for (int t = 0; t < tt; ++t) acc = fmaf(wj[t], tile[t * Hp + m], acc);
    acc_s[j * Hp + m] = acc;
  }
}

// ----------------------------------------------------------------------------------------------
// Forward: one CTA per sample row = v * B + b.
template <typename Tin>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
attention_pool_fwd_kernel(const float* __restrict__ w, const Tin* __restrict__ hs, const bool* __restrict__ mask,
                          int64_t B, int T, int H, int n, int TT, float inv_sqrt_d,
                          float* __restrict__ pooled, float* alpha, float* __restrict__ c_out,
                          float* __restrict__ pv_out) {
  extern __shared__ float smem[];
  const Smem S = Carve(smem, H, n, TT);
  const int64_t row = blockIdx.x;
  const int d = H / n;
  const float* q = w + (row / B) * ParamCount(H);
  const float* wk = q + H;
  const float* wv = wk + static_cast<int64_t>(H) * H;
  const float* wo = wv + static_cast<int64_t>(H) * H;
  const float* bo = wo + static_cast<int64_t>(H) * H;
  const Tin* hs_b = hs + row * T * H;
  const bool* mask_b = mask + row * T;
  float* alpha_b = alpha + row * n * T;  // scores, then alpha (written and read here: no __restrict__)
  float* pooled_b = pooled + row * H;
  float* c_b = c_out + row * n * H;
  float* pv_b = pv_out + row * H;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  bool mine = false;
  for (int t = tid; t < T; t += kThreads) mine |= mask_b[t];
  for (int i = tid; i < H; i += kThreads) S.vec0[i] = q[i];  // (overlaps the mask reads)
  if (!__syncthreads_or(mine)) {  // no valid step: every output of this sample is 0
    for (int i = tid; i < H; i += kThreads) { pooled_b[i] = 0.f; pv_b[i] = 0.f; }
    for (int i = tid; i < n * T; i += kThreads) alpha_b[i] = 0.f;
    for (int i = tid; i < n * H; i += kThreads) c_b[i] = 0.f;
    return;
  }
  RowSegDots(wk, S.vec0, H, n, d, inv_sqrt_d, S, S.u, S.Hp);  // u [n][Hp]

  // Pass 1: scores s[j, t] = h_t . u_j -> alpha_b.
  const bool resident = TT >= T;
  for (int t0 = 0; t0 < T; t0 += TT) {
    const int tt = min(TT, T - t0);
    LoadTile(S.region, hs_b + static_cast<int64_t>(t0) * H, tt, H, S.Hp);
    __syncthreads();
    HeadDots(S.region, tt, S.u, H, S.Hp, n, T, nullptr, alpha_b + t0);
    __syncthreads();
  }
  // Softmax statistics per head over the valid steps (warp per head, fixed shuffle tree).
  for (int j = warp; j < n; j += kWarps) {
    const float* s = alpha_b + j * T;
    float mx = -INFINITY;
    for (int t = lane; t < T; t += 32) if (mask_b[t]) mx = fmaxf(mx, s[t]);
    mx = WarpMax(mx);
    float sum = 0.f;
    for (int t = lane; t < T; t += 32) if (mask_b[t]) sum += expf(s[t] - mx);
    sum = WarpSum(sum);
    if (lane == 0) { S.stats[j] = mx; S.stats[n + j] = sum; }
  }
  __syncthreads();
  for (int p = tid; p < n * T; p += kThreads) {
    const int j = p / T, t = p - j * T;
    const float s = alpha_b[p];
    alpha_b[p] = mask_b[t] ? expf(s - S.stats[j]) / S.stats[n + j] : 0.f;
  }
  __syncthreads();

  // Pass 2: c_j = sum_t alpha[j, t] h_t (tiles in order, t ascending).
  for (int t0 = 0; t0 < T; t0 += TT) {
    const int tt = min(TT, T - t0);
    if (!resident) LoadTile(S.region, hs_b + static_cast<int64_t>(t0) * H, tt, H, S.Hp);
    for (int p = tid; p < n * tt; p += kThreads) {
      const int j = p / tt, t = p - j * tt;
      S.at[j * TT + t] = alpha_b[j * T + t0 + t];
    }
    __syncthreads();
    AccumulateHeads(S.region, tt, S.at, TT, H, S.Hp, n, S.m1, t0 == 0);
    __syncthreads();
  }

  for (int p = tid; p < n * H; p += kThreads) {
    const int j = p / H, m = p - j * H;
    c_b[p] = S.m1[j * S.Hp + m];
  }
  ColDots(wv, S.m1, S.Hp, d, H, 1.f, S, S.vec0);  // pv
  for (int i = tid; i < H; i += kThreads) pv_b[i] = S.vec0[i];
  ColDots(wo, S.vec0, 0, H, H, 1.f, S, S.vec1);   // pv @ W_o
  for (int o = tid; o < H; o += kThreads) pooled_b[o] = S.vec1[o] + __ldg(bo + o);
}

// ----------------------------------------------------------------------------------------------
// Backward: one CTA per sample. Writes dhs and the per-sample factors [g | dpv | dq_b | e (n x H)].
template <typename Tin>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
attention_pool_bwd_kernel(const float* __restrict__ w, const Tin* __restrict__ hs, const bool* __restrict__ mask,
                          const float* __restrict__ alpha, const float* __restrict__ g,
                          const float* __restrict__ dalpha, int64_t B, int T, int H, int n, int TT,
                          float inv_sqrt_d, Tin* __restrict__ dhs, float* __restrict__ fac, float* dsw) {
  extern __shared__ float smem[];
  const Smem S = Carve(smem, H, n, TT);
  const int64_t row = blockIdx.x;
  const int d = H / n;
  const float* q = w + (row / B) * ParamCount(H);
  const float* wk = q + H;
  const float* wv = wk + static_cast<int64_t>(H) * H;
  const float* wo = wv + static_cast<int64_t>(H) * H;
  const Tin* hs_b = hs + row * T * H;
  const bool* mask_b = mask + row * T;
  const float* alpha_b = alpha + row * n * T;
  const float* g_b = g + row * H;
  const float* dalpha_b = dalpha + row * n * T;
  Tin* dhs_b = dhs + row * T * H;
  float* fac_b = fac + row * FactorCount(H, n);
  float* ds_b = dsw + row * n * T;  // a[j, t], then ds[j, t] (written and read here: no __restrict__)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  float* g_s = S.vec1 + H;  // the third vec slot
  bool mine = false;
  for (int t = tid; t < T; t += kThreads) mine |= mask_b[t];
  for (int i = tid; i < H; i += kThreads) {  // (overlaps the mask reads)
    S.vec0[i] = q[i];
    g_s[i] = g_b[i];
  }
  if (!__syncthreads_or(mine)) {  // no valid step: zero input gradient and zero factors
    for (int64_t i = tid; i < static_cast<int64_t>(T) * H; i += kThreads) dhs_b[i] = FromF<Tin>(0.f);
    for (int64_t i = tid; i < FactorCount(H, n); i += kThreads) fac_b[i] = 0.f;
    return;
  }
  RowSegDots(wk, S.vec0, H, n, d, inv_sqrt_d, S, S.u, S.Hp);  // u
  RowSegDots(wo, g_s, H, n, d, 1.f, S, S.m2, S.Hp);           // per-head pieces of W_o g
  for (int i = tid; i < H; i += kThreads) {                    // dpv = sum of the pieces, j ascending
    float acc = S.m2[i];
    for (int j = 1; j < n; ++j) acc += S.m2[j * S.Hp + i];
    S.vec1[i] = acc;
  }
  __syncthreads();
  RowSegDots(wv, S.vec1, H, n, d, 1.f, S, S.m1, S.Hp);        // dc

  // Pass 1: a[j, t] = dalpha[j, t] + h_t . dc_j -> ds_b.
  const bool resident = TT >= T;
  for (int t0 = 0; t0 < T; t0 += TT) {
    const int tt = min(TT, T - t0);
    LoadTile(S.region, hs_b + static_cast<int64_t>(t0) * H, tt, H, S.Hp);
    __syncthreads();
    HeadDots(S.region, tt, S.m1, H, S.Hp, n, T, dalpha_b + t0, ds_b + t0);
    __syncthreads();
  }
  for (int j = warp; j < n; j += kWarps) {  // rho_j = sum_t alpha a
    float acc = 0.f;
    for (int t = lane; t < T; t += 32) acc = fmaf(alpha_b[j * T + t], ds_b[j * T + t], acc);
    acc = WarpSum(acc);
    if (lane == 0) S.stats[j] = acc;
  }
  __syncthreads();
  for (int p = tid; p < n * T; p += kThreads) {
    const int j = p / T;
    ds_b[p] = alpha_b[p] * (ds_b[p] - S.stats[j]);
  }
  __syncthreads();

  // Pass 2: e_j = sum_t ds[j, t] h_t; dh_t = sum_j alpha[j, t] dc_j + ds[j, t] u_j.
  for (int t0 = 0; t0 < T; t0 += TT) {
    const int tt = min(TT, T - t0);
    if (!resident) LoadTile(S.region, hs_b + static_cast<int64_t>(t0) * H, tt, H, S.Hp);
    for (int p = tid; p < n * tt; p += kThreads) {
      const int j = p / tt, t = p - j * tt;
      S.at[j * TT + t] = alpha_b[j * T + t0 + t];
      S.dt[j * TT + t] = ds_b[j * T + t0 + t];
    }
    __syncthreads();
    AccumulateHeads(S.region, tt, S.dt, TT, H, S.Hp, n, S.m2, t0 == 0);
    Tin* dst = dhs_b + static_cast<int64_t>(t0) * H;
    for (int idx = tid; idx < tt * H; idx += kThreads) {
      const int t = idx / H, m = idx - t * H;
      float acc = 0.f;
      for (int j = 0; j < n; ++j) {
        acc = fmaf(S.at[j * TT + t], S.m1[j * S.Hp + m], acc);
        acc = fmaf(S.dt[j * TT + t], S.u[j * S.Hp + m], acc);
      }
      dst[idx] = FromF<Tin>(acc);
    }
    __syncthreads();
  }

  // Factors: [g | dpv | dq_b | e].
  const int Hp = S.Hp;
  for (int i = tid; i < H; i += kThreads) {
    fac_b[i] = g_s[i];
    fac_b[H + i] = S.vec1[i];
  }
  for (int p = tid; p < n * H; p += kThreads) {
    const int j = p / H, m = p - j * H;
    fac_b[3 * H + p] = S.m2[j * Hp + m];
  }
  ColDots(wk, S.m2, Hp, d, H, inv_sqrt_d, S, fac_b + 2 * H);  // dq_b
}

// ----------------------------------------------------------------------------------------------
// Parameter gradient from the factors. Grid (3 * tiles^2 + vector blocks, chunks, V). Matrix
// blocks own a 32 x 32 tile of dW_k, dW_v or dW_o (thread: one column, 4 rows); vector blocks own
// dq and db_o elements. Each output element is summed over the chunk's samples, b ascending, and
// written once, at its place in the flat parameter vector [q | W_k | W_v | W_o | b_o] of chunk
// partial (v, chunk).
__global__ void __launch_bounds__(kThreads)
attention_pool_wgrad_kernel(const float* __restrict__ w, const float* __restrict__ fac,
                            const float* __restrict__ c, const float* __restrict__ pv, int64_t B, int H, int n,
                            float inv_sqrt_d, int64_t rows_per_chunk, int64_t chunks, int tiles,
                            float* __restrict__ out) {
  const int64_t v = blockIdx.z, chunk = blockIdx.y;
  const int64_t b0 = chunk * rows_per_chunk;
  const int64_t b1 = min(B, b0 + rows_per_chunk);
  const int64_t P = ParamCount(H), F = FactorCount(H, n);
  const int d = H / n;
  const float* facv = fac + v * B * F;
  float* o = out + (v * chunks + chunk) * P;
  const int per_mat = tiles * tiles;
  const int blk = blockIdx.x;
  if (blk < 3 * per_mat) {
    const int mat = blk / per_mat, tile = blk - mat * per_mat;
    const int col = (tile % tiles) * kWTile + (threadIdx.x & 31);
    const int r0 = (tile / tiles) * kWTile + (threadIdx.x >> 5) * 4;
    if (col >= H || r0 >= H) return;  // no barriers in this kernel
    const int nr = min(4, H - r0), j = col / d;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float scale = 1.f;
    if (mat == 0) {  // dW_k[m, i] = (q_i / sqrt d) sum_b e_b[j(i)][m]
      const float* a = facv + 3 * H + static_cast<int64_t>(j) * H + r0;
#pragma unroll 4
      for (int64_t b = b0; b < b1; ++b) {
        const float* ab = a + b * F;
#pragma unroll
        for (int k = 0; k < 4; ++k) if (k < nr) acc[k] += __ldg(ab + k);
      }
      scale = __ldg(w + v * P + col) * inv_sqrt_d;
    } else if (mat == 1) {  // dW_v[m, i] = sum_b c_b[j(i)][m] dpv_b[i]
      const float* a = c + (v * B * n + j) * static_cast<int64_t>(H) + r0;
#pragma unroll 4
      for (int64_t b = b0; b < b1; ++b) {
        const float x = __ldg(facv + b * F + H + col);
        const float* ab = a + b * n * static_cast<int64_t>(H);
#pragma unroll
        for (int k = 0; k < 4; ++k) if (k < nr) acc[k] = fmaf(__ldg(ab + k), x, acc[k]);
      }
    } else {  // dW_o[i, o] = sum_b pv_b[i] g_b[o]
      const float* a = pv + v * B * H + r0;
#pragma unroll 4
      for (int64_t b = b0; b < b1; ++b) {
        const float x = __ldg(facv + b * F + col);
        const float* ab = a + b * H;
#pragma unroll
        for (int k = 0; k < 4; ++k) if (k < nr) acc[k] = fmaf(__ldg(ab + k), x, acc[k]);
      }
    }
    float* dst = o + H + static_cast<int64_t>(mat) * H * H + static_cast<int64_t>(r0) * H + col;
#pragma unroll
    for (int k = 0; k < 4; ++k) if (k < nr) dst[static_cast<int64_t>(k) * H] = acc[k] * scale;
  } else {
    const int idx = (blk - 3 * per_mat) * kThreads + threadIdx.x;
    if (idx >= 2 * H) return;
    const int which = idx / H, i = idx - which * H;  // 0: dq = sum_b dq_b; 1: db_o = sum_b g_b
    const float* a = facv + (which == 0 ? 2 * H + i : i);
    float acc = 0.f;
#pragma unroll 4
    for (int64_t b = b0; b < b1; ++b) acc += __ldg(a + b * F);
    o[which == 0 ? i : P - H + i] = acc;
  }
}

// ----------------------------------------------------------------------------------------------
// Handlers.
struct PoolDims {
  int64_t V = -1, B = 0, T = 0, H = 0, n = 0, TT = 0, P = 0;
};

// Checks w [V, P] and hs [V, B, T, H] and the attrs; fills `d`.
ffi::Error CheckCommon(const ffi::Buffer<ffi::F32>& w, const ffi::AnyBuffer& hs, int64_t hidden_size,
                       int64_t num_heads, int64_t tile_t, PoolDims* d) {
  if (hidden_size < 1 || num_heads < 1 || hidden_size % num_heads != 0) {
    return InvalidArgument("attention_pool: hidden_size " + std::to_string(hidden_size) +
                           " must be a positive multiple of num_heads " + std::to_string(num_heads));
  }
  d->H = hidden_size;
  d->n = num_heads;
  d->P = ParamCount(d->H);
  JAXFOX_RETURN_IF_ERROR(CheckShape(w, "attention_pool: w", {d->P}, &d->V));
  auto dims = hs.dimensions();
  if (dims.size() < 3) {
    return InvalidArgument("attention_pool: hs must have rank >= 3, got shape " + DimsToString(dims));
  }
  d->B = dims[dims.size() - 3];
  d->T = dims[dims.size() - 2];
  JAXFOX_RETURN_IF_ERROR(CheckShape(hs, "attention_pool: hs", {d->B, d->T, d->H}, &d->V));
  if (hs.element_type() != ffi::F32 && hs.element_type() != ffi::BF16) {
    return InvalidArgument("attention_pool: hs must be float32 or bfloat16");
  }
  if (d->T < 1) return InvalidArgument("attention_pool: the kernel needs T >= 1 (jaxfox/attention.py routes T = 0 elsewhere)");
  d->TT = tile_t;
  if (tile_t < 1 || tile_t > d->T) {
    return InvalidArgument("attention_pool: tile_t must be in [1, T], got " + std::to_string(tile_t));
  }
  if (SmemFloats(static_cast<int>(d->H), static_cast<int>(d->n), static_cast<int>(d->TT)) * 4 > kSmemLimitBytes ||
      d->H > (1 << 20) || d->n * d->T > (int64_t{1} << 30) || d->T * d->H > (int64_t{1} << 30)) {
    return InvalidArgument("attention_pool: H = " + std::to_string(d->H) + ", num_heads = " + std::to_string(d->n) +
                           ", tile_t = " + std::to_string(d->TT) + " do not fit the kernel's 48 KiB of shared memory");
  }
  if (d->V * d->B > 0x7fffffffLL) return InvalidArgument("attention_pool: more than 2^31 - 1 samples");
  return ffi::Error::Success();
}

template <typename Tin>
void LaunchFwd(cudaStream_t stream, const PoolDims& d, const float* w, const void* hs, const bool* mask,
               float* pooled, float* alpha, float* c, float* pv) {
  const int64_t smem = SmemFloats(d.H, d.n, d.TT) * 4;
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.H / d.n)));
  attention_pool_fwd_kernel<Tin><<<static_cast<unsigned>(d.V * d.B), kThreads, smem, stream>>>(
      w, static_cast<const Tin*>(hs), mask, d.B, static_cast<int>(d.T), static_cast<int>(d.H),
      static_cast<int>(d.n), static_cast<int>(d.TT), inv_sqrt_d, pooled, alpha, c, pv);
}

// FFI target jaxfox_attention_pool_fwd: w [.., P], hs [.., B, T, H] (f32 or bf16), mask [.., B, T]
// -> pooled [.., B, H], alpha [.., B, n, T], and the residuals c [.., B, n, H], pv [.., B, H].
ffi::Error AttentionPoolFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer hs,
                                ffi::Buffer<ffi::PRED> mask, int64_t hidden_size, int64_t num_heads, int64_t tile_t,
                                ffi::ResultBuffer<ffi::F32> pooled, ffi::ResultBuffer<ffi::F32> alpha,
                                ffi::ResultBuffer<ffi::F32> c, ffi::ResultBuffer<ffi::F32> pv) {
  PoolDims d;
  JAXFOX_RETURN_IF_ERROR(CheckCommon(w, hs, hidden_size, num_heads, tile_t, &d));
  JAXFOX_RETURN_IF_ERROR(CheckShape(mask, "attention_pool: mask", {d.B, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*pooled, "attention_pool: pooled", {d.B, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*alpha, "attention_pool: alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*c, "attention_pool: c", {d.B, d.n, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*pv, "attention_pool: pv", {d.B, d.H}, &d.V));
  if (d.V == 0 || d.B == 0) return ffi::Error::Success();
  if (hs.element_type() == ffi::F32) {
    LaunchFwd<float>(stream, d, w.typed_data(), hs.untyped_data(), mask.typed_data(), pooled->typed_data(),
                     alpha->typed_data(), c->typed_data(), pv->typed_data());
  } else {
    LaunchFwd<__nv_bfloat16>(stream, d, w.typed_data(), hs.untyped_data(), mask.typed_data(), pooled->typed_data(),
                             alpha->typed_data(), c->typed_data(), pv->typed_data());
  }
  return LastCudaError("attention_pool_fwd");
}

// FFI target jaxfox_attention_pool_bwd: (w, hs, mask, alpha, c, pv, g = d pooled, dalpha)
// -> dw [.., P], dhs [.., B, T, H] (dtype of hs), and workspaces factors [.., B, (3 + n) H],
// ds [.., B, n, T], chunk partials [.., chunks * P] (or [.., 0] when chunks == 1).
ffi::Error AttentionPoolBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer hs,
                                ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> c,
                                ffi::Buffer<ffi::F32> pv, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> dalpha,
                                int64_t hidden_size, int64_t num_heads, int64_t tile_t, int64_t chunks,
                                ffi::ResultBuffer<ffi::F32> dw, ffi::Result<ffi::AnyBuffer> dhs,
                                ffi::ResultBuffer<ffi::F32> fac, ffi::ResultBuffer<ffi::F32> dsw,
                                ffi::ResultBuffer<ffi::F32> ws) {
  PoolDims d;
  JAXFOX_RETURN_IF_ERROR(CheckCommon(w, hs, hidden_size, num_heads, tile_t, &d));
  JAXFOX_RETURN_IF_ERROR(CheckShape(mask, "attention_pool: mask", {d.B, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(alpha, "attention_pool: alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(c, "attention_pool: c", {d.B, d.n, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(pv, "attention_pool: pv", {d.B, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(g, "attention_pool: d pooled", {d.B, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(dalpha, "attention_pool: d alpha", {d.B, d.n, d.T}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dw, "attention_pool: dw", {d.P}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dhs, "attention_pool: dhs", {d.B, d.T, d.H}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*fac, "attention_pool: factors", {d.B, FactorCount(d.H, d.n)}, &d.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dsw, "attention_pool: ds workspace", {d.B, d.n, d.T}, &d.V));
  if (dhs->element_type() != hs.element_type()) return InvalidArgument("attention_pool: dhs dtype must match hs");
  if (d.V == 0) return ffi::Error::Success();
  if (d.B == 0) {
    cudaMemsetAsync(dw->typed_data(), 0, sizeof(float) * d.V * d.P, stream);
    return LastCudaError("attention_pool_bwd (B = 0)");
  }
  if (chunks < 1 || chunks > 65535 || chunks > d.B) {
    return InvalidArgument("attention_pool: chunks must be in [1, min(B, 65535)], got " + std::to_string(chunks));
  }
  const int64_t need = chunks > 1 ? d.V * chunks * d.P : 0;
  if (static_cast<int64_t>(ws->element_count()) < need) {
    return InvalidArgument("attention_pool: workspace has " + std::to_string(ws->element_count()) +
                           " elements, needs " + std::to_string(need));
  }
  if (d.V > 65535) return InvalidArgument("attention_pool: more than 65535 batched instances");

  const int64_t smem = SmemFloats(d.H, d.n, d.TT) * 4;
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.H / d.n)));
  const unsigned rows = static_cast<unsigned>(d.V * d.B);
  if (hs.element_type() == ffi::F32) {
    attention_pool_bwd_kernel<float><<<rows, kThreads, smem, stream>>>(
        w.typed_data(), static_cast<const float*>(hs.untyped_data()), mask.typed_data(), alpha.typed_data(),
        g.typed_data(), dalpha.typed_data(), d.B, static_cast<int>(d.T), static_cast<int>(d.H),
        static_cast<int>(d.n), static_cast<int>(d.TT), inv_sqrt_d, static_cast<float*>(dhs->untyped_data()),
        fac->typed_data(), dsw->typed_data());
  } else {
    attention_pool_bwd_kernel<__nv_bfloat16><<<rows, kThreads, smem, stream>>>(
        w.typed_data(), static_cast<const __nv_bfloat16*>(hs.untyped_data()), mask.typed_data(),
        alpha.typed_data(), g.typed_data(), dalpha.typed_data(), d.B, static_cast<int>(d.T),
        static_cast<int>(d.H), static_cast<int>(d.n), static_cast<int>(d.TT), inv_sqrt_d,
        static_cast<__nv_bfloat16*>(dhs->untyped_data()), fac->typed_data(), dsw->typed_data());
  }
  JAXFOX_RETURN_IF_ERROR(LastCudaError("attention_pool_bwd"));

  const int tiles = static_cast<int>(CeilDiv(d.H, kWTile));
  const int vec_blocks = static_cast<int>(CeilDiv(2 * d.H, kThreads));
  dim3 grid(static_cast<unsigned>(3 * tiles * tiles + vec_blocks), static_cast<unsigned>(chunks),
            static_cast<unsigned>(d.V));
  float* partial = chunks == 1 ? dw->typed_data() : ws->typed_data();
  attention_pool_wgrad_kernel<<<grid, kThreads, 0, stream>>>(
      w.typed_data(), fac->typed_data(), c.typed_data(), pv.typed_data(), d.B, static_cast<int>(d.H),
      static_cast<int>(d.n), inv_sqrt_d, CeilDiv(d.B, chunks), chunks, tiles, partial);
  JAXFOX_RETURN_IF_ERROR(LastCudaError("attention_pool_bwd (parameter gradient)"));
  if (chunks > 1) {
    // [V, chunks, P] -> [V, P]: chunk partials added in reduce.cu's fixed order.
    return LaunchReduceAxis0(stream, ws->typed_data(), d.V, chunks, d.P, 1, nullptr, dw->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_attention_pool_fwd, jaxfox::AttentionPoolFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w (flat params)
                                  .Arg<xla::ffi::AnyBuffer>()               // hs
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("tile_t")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // pooled
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // alpha
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // c (residual)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // pv (residual)
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_attention_pool_bwd, jaxfox::AttentionPoolBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()               // hs
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // alpha
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // c
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // pv
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // d pooled
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // d alpha
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("tile_t")
                                  .Attr<int64_t>("chunks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw
                                  .Ret<xla::ffi::AnyBuffer>()               // dhs
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: factors
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: ds
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
