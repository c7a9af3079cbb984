// optim: fused AdamW apply (optax.clip_by_global_norm + optax.adamw + optax.apply_updates in one pass).
//
// FFI target jaxfox_adamw_apply (jaxfox/optim.py, FusedAdamW.step on FlatParams):
//   inputs  params [V, P] f32, grads [V, P] f32, mu [V, P] f32, nu [V, P] f32,
//           mask [V, P] PRED (mask_mode 2) or [V, 0] (modes 0 / 1), scalars [V, 3] f32 = (lr_neg, bc1, bc2)
//           (V: the flattened leading dims vmap's broadcast_all adds; 1 without vmap)
//   attrs   b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_grad_norm (f32: the float32 values
//           the reference's weak-typed Python constants become, 1 - b1 rounded from double like Python does),
//           clip (0/1), mask_mode (0: no decay, 1: decay everywhere, 2: elementwise), norm_blocks (clip only)
//   outputs params' [V, P], mu' [V, P], nu' [V, P] (aliased to params, mu, nu in the ffi_call),
//           workspace [V, norm_blocks] f32 (clip) or [V, 0]: the per-block partial sums of g^2.
//
// Per element, float32, the reference's operation order, every operation rounded on its own
// (__f*_rn intrinsics: nvcc never contracts them into FMAs):
//   g  <- keep ? g : (g / norm) * max_norm                        keep = norm < max_norm || norm == 0
//   mu' = (1-b1) * g + b1 * mu;   nu' = (1-b2) * (g * g) + b2 * nu
//   u   = (mu' / bc1) / (sqrt(nu' / bc2) + eps);   u += wd * p where decayed
//   p'  = p + lr_neg * u
// XLA's fusion of the reference may contract a * b + c into one FMA (LLVM's NVPTX backend fuses by
// default), and it sums the global norm in its own order, so kernel and reference differ by ~1 ulp of
// each contracted operation per step; this kernel is the unfused evaluation of the reference's jaxpr.
//
// Global norm (clip only), deterministic, no atomics, a fixed function of (P, norm_blocks) only (not of the
// GPU's SM count): kernel 1 has norm_blocks blocks of 256 threads; thread t of block b takes float4 column
// v = b * 256 + t, then v += norm_blocks * 256, ... (the last, partial column of P % 4 elements is read as
// scalars, missing elements as 0), accumulating acc = fma(x, x, acc) for x, y, z, w of each column in order;
// the block sums its 256 accumulators by warp shuffles (offsets 16, 8, 4, 2, 1), then warp sums 0..7 left to
// right, float32, and writes partial[b]. Every block of the apply kernel then sums the norm_blocks partials in
// float64: thread t adds partials t, t + 256, ... in order, the same shuffle / warp tree in float64, rounds
// the total to float32 and takes sqrt (IEEE); all blocks compute the same bits. The apply kernel runs a
// grid-stride loop over float4 columns (scalar tail for the last partial column), each element read and
// written by one thread, so its grid size (SM count x resident blocks per SM) does not affect any result.
// Misaligned buffers (not expected from XLA) take the same loops with scalar loads: same order, same bits.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxNormBlocks = 1024;  // jaxfox/optim.py _MAX_NORM_BLOCKS
constexpr int kScalars = 3;               // lr_neg, bc1, bc2

struct AdamWConsts {
  float b1, omb1, b2, omb2, eps, wd, max_norm;
};

// Column v of x (elements 4v .. 4v+3), zeros beyond P. `full` = P / 4 columns are whole.
template <bool kVec>
__device__ __forceinline__ float4 LoadCol(const float* x, int64_t v, int64_t full, int64_t P) {
  if (kVec && v < full) return reinterpret_cast<const float4*>(x)[v];
  const int64_t e = 4 * v;
  return make_float4(e < P ? x[e] : 0.f, e + 1 < P ? x[e + 1] : 0.f, e + 2 < P ? x[e + 2] : 0.f,
                     e + 3 < P ? x[e + 3] : 0.f);
}

// Fixed-order block sum (valid in thread 0): shuffles 16, 8, 4, 2, 1 per warp, then warps 0..7 in order.
template <typename T>
__device__ __forceinline__ T BlockSum(T x, T* smem) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = x;
  __syncthreads();
  T total = smem[0];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w) total += smem[w];
  }
  return total;
}

// Kernel 1 (clip only): partials[inst, b] = sum of g^2 over block b's columns (order: file header).
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
adamw_sumsq_kernel(const float* __restrict__ grads, int64_t P, float* __restrict__ partials) {
  __shared__ float red[kWarps];
  const int64_t inst = blockIdx.y;
  const float* g = grads + inst * P;
  const int64_t full = P / 4, cols = (P + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float acc = 0.f;
#pragma unroll 4
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < cols; v += stride) {
    const float4 x = LoadCol<kVec>(g, v, full, P);
    acc = __fmaf_rn(x.x, x.x, acc);
    acc = __fmaf_rn(x.y, x.y, acc);
    acc = __fmaf_rn(x.z, x.z, acc);
    acc = __fmaf_rn(x.w, x.w, acc);
  }
  const float total = BlockSum(acc, red);
  if (threadIdx.x == 0) partials[inst * gridDim.x + blockIdx.x] = total;
}

// One element, the reference's order (file header). `clip_now` = clipping active (!keep).
__device__ __forceinline__ void AdamWElem(float& p, float g, float& m, float& v, bool decay, bool clip_now,
                                          float norm, const AdamWConsts& c, float lr_neg, float bc1, float bc2) {
  if (clip_now) g = __fmul_rn(__fdiv_rn(g, norm), c.max_norm);
  m = __fadd_rn(__fmul_rn(c.omb1, g), __fmul_rn(c.b1, m));
  v = __fadd_rn(__fmul_rn(c.omb2, __fmul_rn(g, g)), __fmul_rn(c.b2, v));
  float u = __fdiv_rn(__fdiv_rn(m, bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bc2)), c.eps));
  if (decay) u = __fadd_rn(u, __fmul_rn(c.wd, p));
  p = __fadd_rn(p, __fmul_rn(lr_neg, u));
}

// Kernel 2: the update + apply. params/mu/nu may be the same buffers as their outputs (aliased), so
// those pointers are not __restrict__ and are read through the coherent path; every element is read
// before it is written, by the same thread.
template <bool kVec, bool kClip, int kMaskMode>
__global__ void __launch_bounds__(kThreads)
adamw_apply_kernel(const float* params, const float* grads, const float* mu, const float* nu,
                   const uint8_t* mask, const float* scalars, const float* partials, int64_t P,
                   int64_t norm_blocks, AdamWConsts c, float* params_out, float* mu_out, float* nu_out) {
  const int64_t inst = blockIdx.y;
  const int64_t off = inst * P;
  const float lr_neg = scalars[inst * kScalars + 0];
  const float bc1 = scalars[inst * kScalars + 1];
  const float bc2 = scalars[inst * kScalars + 2];
  bool clip_now = false;
  float norm = 0.f;
  if (kClip) {
    __shared__ double red[kWarps];
    __shared__ float s_norm;
    const float* part = partials + inst * norm_blocks;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < norm_blocks; j += kThreads) s += static_cast<double>(part[j]);
    s = BlockSum(s, red);
    if (threadIdx.x == 0) s_norm = __fsqrt_rn(static_cast<float>(s));
    __syncthreads();
    norm = s_norm;
    clip_now = !((norm < c.max_norm) || (norm == 0.f));  // NaN norm: clip (g / NaN = NaN), as optax
  }
  const float* pi = params + off;
  const float* gi = grads + off;
  const float* mi = mu + off;
  const float* ni = nu + off;
  const uint8_t* ki = kMaskMode == 2 ? mask + off : nullptr;
  float* po = params_out + off;
  float* mo = mu_out + off;
  float* no = nu_out + off;
  const int64_t full = P / 4, cols = (P + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < cols; v += stride) {
    if (kVec && v < full) {
      float4 p = reinterpret_cast<const float4*>(pi)[v];
      const float4 g = reinterpret_cast<const float4*>(gi)[v];
      float4 m = reinterpret_cast<const float4*>(mi)[v];
      float4 n = reinterpret_cast<const float4*>(ni)[v];
      uint32_t k = kMaskMode == 1 ? 0x01010101u : 0u;
      if (kMaskMode == 2) k = reinterpret_cast<const uint32_t*>(ki)[v];  // 4 PRED bytes, little-endian
      AdamWElem(p.x, g.x, m.x, n.x, (k & 0x000000ffu) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.y, g.y, m.y, n.y, (k & 0x0000ff00u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.z, g.z, m.z, n.z, (k & 0x00ff0000u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.w, g.w, m.w, n.w, (k & 0xff000000u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      reinterpret_cast<float4*>(po)[v] = p;
      reinterpret_cast<float4*>(mo)[v] = m;
      reinterpret_cast<float4*>(no)[v] = n;
    } else {
      const int64_t e1 = min(P, 4 * v + 4);
      for (int64_t e = 4 * v; e < e1; ++e) {
        float p = pi[e], m = mi[e], n = ni[e];
        const bool decay = kMaskMode == 1 || (kMaskMode == 2 && ki[e] != 0);
        AdamWElem(p, gi[e], m, n, decay, clip_now, norm, c, lr_neg, bc1, bc2);
        po[e] = p;
        mo[e] = m;
        no[e] = n;
      }
    }
  }
}

// Resident blocks per SM of `kernel` at kThreads threads (a host-side query, cached per kernel and device).
int BlocksPerSm(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({kernel, dev});
  if (it != cache.end()) return it->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess || n < 1) {
    (void)cudaGetLastError();
    n = 1;
  }
  cache[{kernel, dev}] = n;
  return n;
}

struct ApplyArgs {
  const float *params, *grads, *mu, *nu;
  const uint8_t* mask;
  const float* scalars;
  float* partials;
  int64_t V, P, norm_blocks;
  AdamWConsts c;
  float *params_out, *mu_out, *nu_out;
};

template <bool kVec, bool kClip, int kMaskMode>
void LaunchTyped(cudaStream_t stream, const ApplyArgs& a) {
  if (kClip) {
    dim3 grid1(static_cast<unsigned>(a.norm_blocks), static_cast<unsigned>(a.V));
    adamw_sumsq_kernel<kVec><<<grid1, kThreads, 0, stream>>>(a.grads, a.P, a.partials);
  }
  auto* kernel = adamw_apply_kernel<kVec, kClip, kMaskMode>;
  const int64_t cols = CeilDiv(a.P, 4);
  const int64_t resident = static_cast<int64_t>(GetDeviceInfo().sm_count) * BlocksPerSm(reinterpret_cast<const void*>(kernel));
  int64_t blocks = CeilDiv(resident > 0 ? resident : 1, a.V);
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, CeilDiv(cols, kThreads)));
  dim3 grid2(static_cast<unsigned>(blocks), static_cast<unsigned>(a.V));
  kernel<<<grid2, kThreads, 0, stream>>>(a.params, a.grads, a.mu, a.nu, a.mask, a.scalars, a.partials, a.P,
                                         a.norm_blocks, a.c, a.params_out, a.mu_out, a.nu_out);
}

template <bool kVec, bool kClip>
void LaunchMask(cudaStream_t stream, const ApplyArgs& a, int64_t mask_mode) {
  if (mask_mode == 0) LaunchTyped<kVec, kClip, 0>(stream, a);
  else if (mask_mode == 1) LaunchTyped<kVec, kClip, 1>(stream, a);
  else LaunchTyped<kVec, kClip, 2>(stream, a);
}

inline bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

static ffi::Error AdamWApplyImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::F32> grads,
                                 ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::PRED> mask,
                                 ffi::Buffer<ffi::F32> scalars, float b1, float one_minus_b1, float b2,
                                 float one_minus_b2, float eps, float weight_decay, float max_grad_norm,
                                 int64_t clip, int64_t mask_mode, int64_t norm_blocks,
                                 ffi::ResultBuffer<ffi::F32> params_out, ffi::ResultBuffer<ffi::F32> mu_out,
                                 ffi::ResultBuffer<ffi::F32> nu_out, ffi::ResultBuffer<ffi::F32> workspace) {
  ClearStaleCudaError();
  auto pd = params.dimensions();
  if (pd.size() < 1) return InvalidArgument("adamw_apply: params must have rank >= 1, got a scalar");
  const int64_t P = pd[pd.size() - 1];
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(params, "adamw_apply: params", {P}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(grads, "adamw_apply: grads", {P}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(mu, "adamw_apply: mu", {P}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(nu, "adamw_apply: nu", {P}, &V));
  if (mask_mode < 0 || mask_mode > 2) {
    return InvalidArgument("adamw_apply: mask_mode must be 0, 1 or 2, got " + std::to_string(mask_mode));
  }
  JAXFOX_RETURN_IF_ERROR(CheckShape(mask, "adamw_apply: mask", {mask_mode == 2 ? P : 0}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(scalars, "adamw_apply: scalars", {kScalars}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*params_out, "adamw_apply: params_out", {P}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*mu_out, "adamw_apply: mu_out", {P}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*nu_out, "adamw_apply: nu_out", {P}, &V));
  if (clip != 0 && (norm_blocks < 1 || norm_blocks > kMaxNormBlocks)) {
    return InvalidArgument("adamw_apply: norm_blocks must be in [1, " + std::to_string(kMaxNormBlocks) +
                           "] with clipping, got " + std::to_string(norm_blocks));
  }
  const int64_t need = clip != 0 ? V * norm_blocks : 0;
  if (static_cast<int64_t>(workspace->element_count()) < need) {
    return InvalidArgument("adamw_apply: workspace has " + std::to_string(workspace->element_count()) +
                           " elements, needs " + std::to_string(need));
  }
  if (V == 0 || P == 0) return ffi::Error::Success();
  if (V > 65535) return InvalidArgument("adamw_apply: more than 65535 batched instances");

  ApplyArgs a;
  a.params = params.typed_data();
  a.grads = grads.typed_data();
  a.mu = mu.typed_data();
  a.nu = nu.typed_data();
  a.mask = reinterpret_cast<const uint8_t*>(mask.untyped_data());
  a.scalars = scalars.typed_data();
  a.partials = clip != 0 ? workspace->typed_data() : nullptr;
  a.V = V;
  a.P = P;
  a.norm_blocks = clip != 0 ? norm_blocks : 0;
  a.c = AdamWConsts{b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_grad_norm};
  a.params_out = params_out->typed_data();
  a.mu_out = mu_out->typed_data();
  a.nu_out = nu_out->typed_data();
  // float4 columns need 16-byte aligned rows (every instance's row when V > 1), the mask 4-byte ones.
  const bool rows = V == 1 || P % 4 == 0;
  const bool vec = rows && Aligned(a.params, 16) && Aligned(a.grads, 16) && Aligned(a.mu, 16) && Aligned(a.nu, 16) &&
                   Aligned(a.params_out, 16) && Aligned(a.mu_out, 16) && Aligned(a.nu_out, 16) &&
                   (mask_mode != 2 || Aligned(a.mask, 4));
  const bool c = clip != 0;
  if (vec && c) LaunchMask<true, true>(stream, a, mask_mode);
  else if (vec) LaunchMask<true, false>(stream, a, mask_mode);
  else if (c) LaunchMask<false, true>(stream, a, mask_mode);
  else LaunchMask<false, false>(stream, a, mask_mode);
  return LastCudaError("adamw_apply");
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_adamw_apply, jaxfox::AdamWApplyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // params
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // grads
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mu
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // nu
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()  // mask
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // scalars
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<float>("max_grad_norm")
                                  .Attr<int64_t>("clip")
                                  .Attr<int64_t>("mask_mode")
                                  .Attr<int64_t>("norm_blocks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // params_out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mu_out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // nu_out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
