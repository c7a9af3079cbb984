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
// fewer when they would not fit in 96 KiB; jaxfox/attention.py _samples_per_block) and stages their hs rows
// (float32; bfloat16 converted), u and the per-sample vectors in shared memory (Layout below;
// jaxfox/attention.py _smem_bytes computes the same size). Forward: (b) scores, one
// (row, head) a thread; (c) the softmax, one warp per (sample, head); (d) c, one (sample, head, column) a
// thread summing over t in order. Backward: (b) a = dalpha + h . dc; (c) ds in place; (d) dh, one (row,
// column) a thread; (e) the block's du partial [n, H], one (head, column) a thread summing the block's rows
// in order, written to part[instance, block]; LaunchReduceAxis0 adds the blocks' partials in a fixed order.
// No atomics: bitwise reproducible, and a sample's alpha and c (and dh, given its d alpha and d c) do not depend
// on the batch around it.
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

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void Store(float* p, float v) { *p = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Group i of four consecutive elements (16-byte aligned for float, 8-byte for bfloat16), as floats.
__device__ __forceinline__ float4 Load4(const float* __restrict__ p, int i) {
  return __ldg(reinterpret_cast<const float4*>(p) + i);
}
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* __restrict__ p, int i) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p) + i);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void Store4(float* p, int i, float4 v) { reinterpret_cast<float4*>(p)[i] = v; }
__device__ __forceinline__ void Store4(__nv_bfloat16* p, int i, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  reinterpret_cast<uint2*>(p)[i] = raw;
}

// Row stride (floats) of the [rows][H] arrays in shared memory. H % 4 == 0: a multiple of 4 (16-byte rows for float4
// accesses) that is 4 (mod 8), so the 8 rows a warp's lanes read at once (8 rows x 4 heads in the score products)
// start in distinct banks. Otherwise odd (scalar accesses; threads reading one column of different rows hit
// different banks). jaxfox/attention.py _smem_bytes computes the same sizes.
__host__ __device__ inline int RowStride(int H) { return H % 4 != 0 ? (H | 1) : (H % 8 == 0 ? H + 4 : H); }
__host__ __device__ inline int64_t Round4(int64_t x) { return (x + 3) & ~int64_t{3}; }

// Shared-memory layout in floats for G samples of T steps (R = G T rows), n heads, H features; every region starts
// 16-byte aligned.
struct Layout {
  int hp, rq;
  int64_t x, u, a, s, dc, m, total;
  __host__ __device__ Layout(int G, int T, int H, int n) {
    const int R = G * T;
    hp = RowStride(H);
    rq = R | 1;
    x = 0;                                // hs rows [R][hp]
    u = x + int64_t{R} * hp;              // u [n][hp]
    a = u + int64_t{n} * hp;              // alpha [n][rq]
    s = a + Round4(int64_t{n} * rq);      // scores / exp / alpha (fwd); a, then ds (bwd) [n][rq]
    dc = s + Round4(int64_t{n} * rq);     // dc [G n][hp] (bwd)
    m = dc + int64_t{G} * n * hp;         // valid flags [R] (fwd)
    total = m + R;
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

// Copies R rows of W elements (global, row-major, converted to float) into dst [R][stride] (shared), each thread
// issuing kStageUnroll loads before it stores any (the rows' loads in flight at once instead of one after the
// other). Groups of four elements when W % 4 == 0 (src rows 16-/8-byte aligned and stride % 4 == 0 then).
template <typename In>
__device__ __forceinline__ void StageRows(float* dst, int stride, const In* __restrict__ src, int R, int W) {
  if (W % 4 == 0) {
    const int W4 = W / 4, total = R * W4;
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
        if (i < total) {
          const int r = i / W4;
          *reinterpret_cast<float4*>(dst + r * stride + 4 * (i - r * W4)) = v[k];
        }
      }
    }
  } else {
    const int total = R * W;
    for (int base = threadIdx.x; base < total; base += kThreads * kStageUnroll) {
      float v[kStageUnroll];
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) v[k] = ToFloat(src[i]);
      }
#pragma unroll
      for (int k = 0; k < kStageUnroll; ++k) {
        const int i = base + k * kThreads;
        if (i < total) {
          const int r = i / W;
          dst[r * stride + (i - r * W)] = v[k];
        }
      }
    }
  }
}

// u (global [H, n]) as [n][hp] in shared memory.
__device__ __forceinline__ void StageU(float* dst, int hp, const float* __restrict__ u, int H, int n) {
  for (int e = threadIdx.x; e < n * H; e += kThreads) {
    const int h = e / n;
    dst[(e - h * n) * hp + h] = __ldg(u + e);
  }
}

// a . b over W elements of two shared-memory rows (16-byte aligned when W % 4 == 0), in a fixed order: element k
// goes to partial sum k mod 4 (ascending k), then (p0 + p1) + (p2 + p3).
__device__ __forceinline__ float RowDot(const float* a, const float* b, int W) {
  float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
  const int W4 = W / 4;
  if (W % 4 == 0) {
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll 4
    for (int k = 0; k < W4; ++k) {
      const float4 x = a4[k], y = b4[k];
      p0 = fmaf(x.x, y.x, p0);
      p1 = fmaf(x.y, y.y, p1);
      p2 = fmaf(x.z, y.z, p2);
      p3 = fmaf(x.w, y.w, p3);
    }
  } else {
#pragma unroll 2
    for (int k = 0; k < W4; ++k) {
      p0 = fmaf(a[4 * k], b[4 * k], p0);
      p1 = fmaf(a[4 * k + 1], b[4 * k + 1], p1);
      p2 = fmaf(a[4 * k + 2], b[4 * k + 2], p2);
      p3 = fmaf(a[4 * k + 3], b[4 * k + 3], p3);
    }
    const int k = 4 * W4;
    if (k < W) p0 = fmaf(a[k], b[k], p0);
    if (k + 1 < W) p1 = fmaf(a[k + 1], b[k + 1], p1);
    if (k + 2 < W) p2 = fmaf(a[k + 2], b[k + 2], p2);
  }
  return (p0 + p1) + (p2 + p3);
}

// Forward: (hs [V, B, T, H], mask [V, B, T], u [V, H, n]) -> alpha [V, B, n, T], c [V, B, n, H].
template <typename In>
__global__ void __launch_bounds__(kThreads) attention_pool_fwd_kernel(
    const In* __restrict__ hs, const bool* __restrict__ mask, const float* __restrict__ u, int64_t B, int T, int H,
    int n, int G, float* __restrict__ alpha, float* __restrict__ c) {
  extern __shared__ __align__(16) float sm[];
  const Layout L(G, T, H, n);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const BlockSamples blk(B, T, G);
  const int ns = blk.ns, R = blk.R;
  const int64_t b0 = blk.b0;

  // (a) stage hs rows, u and the valid flags
  for (int r = tid; r < R; r += kThreads) sm[L.m + r] = mask[b0 * T + r] ? 1.f : 0.f;
  StageU(sm + L.u, L.hp, u + int64_t{blockIdx.y} * H * n, H, n);
  StageRows(sm + L.x, L.hp, hs + b0 * T * H, R, H);
  __syncthreads();

  // (b) scores s[j][r] = h_r . u_j
  for (int i = tid; i < R * n; i += kThreads) {
    const int r = i / n, j = i - r * n;
    sm[L.s + int64_t{j} * L.rq + r] = RowDot(sm + L.x + int64_t{r} * L.hp, sm + L.u + int64_t{j} * L.hp, H);
  }
  __syncthreads();

  // (c) softmax over the valid steps of each (sample, head), one warp each; alpha to global memory and S
  for (int grp = warp; grp < ns * n; grp += kWarps) {
    const int g = grp / n, j = grp - g * n;
    float* srow = sm + L.s + int64_t{j} * L.rq + g * T;
    const float* valid = sm + L.m + g * T;
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
  __syncthreads();

  // (d) c[g, j, :] = sum_t alpha[j, g T + t] h_{g T + t}, t ascending
  for (int i = tid; i < ns * n * H; i += kThreads) {
    const int gj = i / H, h = i - gj * H;
    const int g = gj / n, j = gj - g * n;
    const float* a = sm + L.s + int64_t{j} * L.rq + g * T;
    const float* x = sm + L.x + int64_t{g} * T * L.hp + h;
    float acc = 0.f;
#pragma unroll 8
    for (int t = 0; t < T; ++t) acc = fmaf(a[t], x[t * L.hp], acc);
    c[b0 * n * H + i] = acc;  // i = (g n + j) H + h
  }
}

// Backward: (hs, u, alpha, dalpha [V, B, n, T], dc [V, B, n, H]) -> dh [V, B, T, H] (kDh), and the block's
// du partial part[V, gridDim.x, n H] (layout [j][h]).
template <typename In, bool kDh>
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

  // (a) stage alpha, dalpha (into S), u, dc and the hs rows
  for (int e = tid; e < ns * n * T; e += kThreads) {  // e = (g n + j) T + t, as alpha / dalpha are laid out
    const int gj = e / T, t = e - gj * T;
    const int g = gj / n, j = gj - g * n;
    const int64_t at = int64_t{j} * L.rq + g * T + t;
    sm[L.a + at] = alpha[b0 * n * T + e];
    sm[L.s + at] = dalpha[b0 * n * T + e];
  }
  StageU(sm + L.u, L.hp, u + int64_t{blockIdx.y} * H * n, H, n);
  StageRows(sm + L.dc, L.hp, dc + b0 * n * H, ns * n, H);  // rows g n + j
  StageRows(sm + L.x, L.hp, hs + b0 * T * H, R, H);
  __syncthreads();

  // (b) a[j][r] = dalpha[j][r] + h_r . dc_{g(r), j}
  for (int i = tid; i < R * n; i += kThreads) {
    const int r = i / n, j = i - r * n;
    const int g = r / T;
    sm[L.s + int64_t{j} * L.rq + r] +=
        RowDot(sm + L.x + int64_t{r} * L.hp, sm + L.dc + int64_t{g * n + j} * L.hp, H);
  }
  __syncthreads();

  // (c) ds = alpha (a - rho) in place, rho = sum_t alpha a, one warp per (sample, head)
  for (int grp = warp; grp < ns * n; grp += kWarps) {
    const int g = grp / n, j = grp - g * n;
    float* srow = sm + L.s + int64_t{j} * L.rq + g * T;
    const float* arow = sm + L.a + int64_t{j} * L.rq + g * T;
    float rho = 0.f;
    for (int t = lane; t < T; t += 32) rho = fmaf(arow[t], srow[t], rho);
    rho = WarpSum(rho);
    for (int t = lane; t < T; t += 32) srow[t] = arow[t] * (srow[t] - rho);
  }
  __syncthreads();

  // (d) dh_r = sum_j alpha[j][r] dc_{g(r), j} + ds[j][r] u_j (j ascending, the alpha term first)
  if (kDh) {
    In* out = dh + b0 * T * H;
    if (H % 4 == 0) {  // four columns a thread, one 16-byte (8-byte bfloat16) store
      const int H4 = H / 4;
      for (int i = tid; i < R * H4; i += kThreads) {
        const int r = i / H4, h = 4 * (i - r * H4), g = r / T;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int j = 0; j < n; ++j) {
          const float al = sm[L.a + int64_t{j} * L.rq + r], ds = sm[L.s + int64_t{j} * L.rq + r];
          const float4 d4 = *reinterpret_cast<const float4*>(sm + L.dc + int64_t{g * n + j} * L.hp + h);
          const float4 u4 = *reinterpret_cast<const float4*>(sm + L.u + int64_t{j} * L.hp + h);
          acc.x = fmaf(ds, u4.x, fmaf(al, d4.x, acc.x));
          acc.y = fmaf(ds, u4.y, fmaf(al, d4.y, acc.y));
          acc.z = fmaf(ds, u4.z, fmaf(al, d4.z, acc.z));
          acc.w = fmaf(ds, u4.w, fmaf(al, d4.w, acc.w));
        }
        Store4(out, i, acc);  // element r H + h = 4 i
      }
    } else {
      for (int i = tid; i < R * H; i += kThreads) {
        const int r = i / H, h = i - r * H, g = r / T;
        float acc = 0.f;
        for (int j = 0; j < n; ++j) {
          acc = fmaf(sm[L.a + int64_t{j} * L.rq + r], sm[L.dc + int64_t{g * n + j} * L.hp + h], acc);
          acc = fmaf(sm[L.s + int64_t{j} * L.rq + r], sm[L.u + int64_t{j} * L.hp + h], acc);
        }
        Store(out + i, acc);
      }
    }
  }

  // (e) the block's du partial [j][h] = sum over its rows r (ascending) of ds[j][r] h_r
  float* prow = part + (int64_t{blockIdx.y} * gridDim.x + blockIdx.x) * n * H;
  for (int i = tid; i < n * H; i += kThreads) {
    const int j = i / H, h = i - j * H;
    const float* ds = sm + L.s + int64_t{j} * L.rq;
    const float* x = sm + L.x + h;
    float acc = 0.f;
#pragma unroll 8
    for (int r = 0; r < R; ++r) acc = fmaf(ds[r], x[r * L.hp], acc);
    prow[i] = acc;
  }
}

// du [V, n H] = the column sums of the blocks' partials [V, blocks, n H], in a fixed order (FixedOrderColumnSum).
__global__ void __launch_bounds__(32 * kSumRows)
    attention_pool_du_kernel(const float* __restrict__ part, int64_t blocks, int64_t nh, float* __restrict__ du) {
  const int64_t v = blockIdx.y, col = int64_t{blockIdx.x} * 32 + (threadIdx.x & 31);
  float total;
  if (FixedOrderColumnSum(part + v * blocks * nh, blocks, nh, col, &total)) du[v * nh + col] = total;
}

struct PoolDims {
  int64_t V = -1, B = 0, T = 0, H = 0, n = 0, G = 1, blocks = 0;
};

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
    auto kernel = attention_pool_fwd_kernel<In>;
    int64_t bytes = 0;
    JAXFOX_RETURN_IF_ERROR(Smem(d, kernel, &bytes));
    kernel<<<grid, kThreads, bytes, stream>>>(in, mask.typed_data(), u.typed_data(), d.B, static_cast<int>(d.T),
                                              static_cast<int>(d.H), static_cast<int>(d.n), static_cast<int>(d.G),
                                              alpha->typed_data(), c->typed_data());
    return LastCudaError("attention_pool_fwd");
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
    auto kernel = attention_pool_bwd_kernel<In, decltype(kdh)::value>;
    int64_t bytes = 0;
    JAXFOX_RETURN_IF_ERROR(Smem(d, kernel, &bytes));
    kernel<<<grid, kThreads, bytes, stream>>>(in, u.typed_data(), alpha.typed_data(), dalpha.typed_data(),
                                              dc.typed_data(), d.B, static_cast<int>(d.T), static_cast<int>(d.H),
                                              static_cast<int>(d.n), static_cast<int>(d.G),
                                              decltype(kdh)::value ? static_cast<In*>(dh->untyped_data()) : nullptr,
                                              part->typed_data());
    return LastCudaError("attention_pool_bwd");
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
