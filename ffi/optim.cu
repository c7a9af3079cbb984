// optim: fused AdamW apply (optax.clip_by_global_norm + optax.adamw + optax.apply_updates in one pass)
// over the leaves of a parameter pytree.
//
// FFI target jaxfox_adamw_apply (jaxfox/optim.py, FusedAdamW.step), for L leaves (V: the flattened leading
// dims vmap's broadcast_all adds to every operand; 1 without vmap):
//   inputs  scalars [V, 3] f32 = (lr_neg, bc1, bc2), then
//           params_0..L-1 [V, n_i] f32, grads_0..L-1 [V, n_i] f32,
//           mu, nu: L buffers [V, n_i] each (flat_moments 0) or one [V, P] each, P = sum n_i (flat_moments 1:
//             leaf i's moments at elements off_i = n_0 + .. + n_{i-1} of every instance's row),
//           masks_0..L-1 [V, n_i] PRED (mask_modes[i] 2) or [V, 0] (modes 0 / 1)
//   attrs   b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_grad_norm (f32: the float32 values
//           the reference's weak-typed Python constants become, 1 - b1 rounded from double like Python does),
//           clip (0/1), flat_moments (0/1), mask_modes [L] (0: no decay, 1: decay everywhere, 2: elementwise)
//   outputs workspace [V, sum_i NormBlocks(n_i)] f32 (clip) or [V, 0]: the per-block partial sums of g^2,
//           then params'_0..L-1, mu', nu' (shaped as the inputs), aliased to params, mu, nu in the ffi_call
//           (results that are not the same buffers as their inputs are first copied from them).
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
// Global norm (clip only), deterministic, no atomics, a fixed function of the leaf sizes only (not of the
// GPU's SM count or of how leaves are grouped into launches): leaf i has NormBlocks(n_i) =
// max(1, min(1024, ceil(n_i / 4096))) partials, the leaves' partials in leaf order. Block b of leaf i (256
// threads): thread t takes float4 column c = b * 256 + t of the leaf, then c += NormBlocks(n_i) * 256, ...
// (the last, partial column of n_i % 4 elements read as scalars, missing elements as 0), accumulating
// acc = fma(x, x, acc) for x, y, z, w of each column in order; the block sums its 256 accumulators by warp
// shuffles (offsets 16, 8, 4, 2, 1), then warp sums 0..7 left to right, float32, and writes its partial.
// Every block of the apply kernel then sums all partials in float64: thread t adds partials t, t + 256, ...
// in order, the same shuffle / warp tree in float64, rounds the total to float32 and takes sqrt (IEEE);
// all blocks compute the same bits. The apply kernel runs, per leaf, a grid-stride loop over float4 columns
// (scalar tail for the last partial column), each element read and written by one thread, so its grid size
// does not affect any result. Leaves whose buffers are not 16-byte aligned (not expected from XLA) take the
// same loops with scalar loads: same order, same bits.
//
// Launches: the leaves' descriptors travel in the kernel parameters (a LeafTable, up to kMaxLeaves leaves
// per launch, < 4 KB): no device-side table, no allocation, nothing for a command buffer to keep alive.
// More leaves take more launches: with clipping, every norm launch runs before the first apply launch.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kNormBlockElems = 4096;  // jaxfox/optim.py _NORM_BLOCK_ELEMS
constexpr int64_t kMaxNormBlocks = 1024;   // jaxfox/optim.py _MAX_NORM_BLOCKS (per leaf)
constexpr int kScalars = 3;                // lr_neg, bc1, bc2
constexpr int kMaxLeaves = 56;             // leaves per launch: 56 x 64 B + header < 4 KB of parameters

int64_t NormBlocks(int64_t n) { return std::max<int64_t>(1, std::min(kMaxNormBlocks, CeilDiv(n, kNormBlockElems))); }

struct AdamWConsts {
  float b1, omb1, b2, omb2, eps, wd, max_norm;
};

struct LeafDesc {
  float* p;              // params, updated in place
  const float* g;        // grads
  float* m;              // mu (in place): leaf element e of instance v at m[v * mstride + e]
  float* v;              // nu (in place), as m
  const uint8_t* mask;   // mode 2: leaf element e of instance v at mask[v * n + e]
  int64_t n;             // elements of the leaf (per instance); p, g, mask rows are n apart
  int32_t begin;         // first block of the leaf in this launch
  uint8_t mode;          // 0: no decay, 1: decay, 2: elementwise mask
  uint8_t vec;           // float4 loads (all pointers 16-byte aligned, rows too)
};

struct LeafTable {
  LeafDesc leaf[kMaxLeaves];
  int64_t mstride;       // elements between instances in m and v: P (flat moments) or 0 (= n of the leaf)
  int64_t part_base;     // norm kernel: index of the launch's first partial (per instance)
  int64_t parts;         // partials per instance, all leaves
  int32_t count;         // leaves in this launch
  int32_t blocks;        // blocks of this launch (grid x)
};
static_assert(sizeof(LeafTable) <= 3800, "kernel parameters must stay under 4 KB");

// The leaf of block b (blocks of a leaf are consecutive, leaf 0 begins at 0).
__device__ __forceinline__ int FindLeaf(const LeafTable& t, int b) {
  int i = 0;
  for (int j = 1; j < t.count; ++j) i = (t.leaf[j].begin <= b) ? j : i;
  return i;
}
__device__ __forceinline__ int LeafBlocks(const LeafTable& t, int i) {
  return (i + 1 < t.count ? t.leaf[i + 1].begin : t.blocks) - t.leaf[i].begin;
}

// Column c of x (elements 4c .. 4c+3), zeros beyond n. `full` = n / 4 columns are whole.
__device__ __forceinline__ float4 LoadCol(const float* x, int64_t c, int64_t full, int64_t n, bool vec) {
  if (vec && c < full) return reinterpret_cast<const float4*>(x)[c];
  const int64_t e = 4 * c;
  return make_float4(e < n ? x[e] : 0.f, e + 1 < n ? x[e + 1] : 0.f, e + 2 < n ? x[e + 2] : 0.f,
                     e + 3 < n ? x[e + 3] : 0.f);
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

// Norm kernel (clip only): partials[inst, part_base + b] = sum of g^2 over block b's columns of its leaf.
__global__ void __launch_bounds__(kThreads)
adamw_sumsq_kernel(const __grid_constant__ LeafTable t, float* __restrict__ partials) {
  __shared__ float red[kWarps];
  const int b = blockIdx.x;
  const int i = FindLeaf(t, b);
  const LeafDesc& L = t.leaf[i];
  const int64_t inst = blockIdx.y;
  const float* g = L.g + inst * L.n;
  const int64_t full = L.n / 4, cols = (L.n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(LeafBlocks(t, i)) * kThreads;
  float acc = 0.f;
#pragma unroll 4
  for (int64_t c = static_cast<int64_t>(b - L.begin) * kThreads + threadIdx.x; c < cols; c += stride) {
    const float4 x = LoadCol(g, c, full, L.n, L.vec != 0);
    acc = __fmaf_rn(x.x, x.x, acc);
    acc = __fmaf_rn(x.y, x.y, acc);
    acc = __fmaf_rn(x.z, x.z, acc);
    acc = __fmaf_rn(x.w, x.w, acc);
  }
  const float total = BlockSum(acc, red);
  if (threadIdx.x == 0) partials[inst * t.parts + t.part_base + b] = total;
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

// Apply kernel: the update + apply of block b's share of its leaf, in place (every element read before it
// is written, by the same thread; p, m, v not __restrict__: read through the coherent path).
template <bool kClip>
__global__ void __launch_bounds__(kThreads)
adamw_apply_kernel(const __grid_constant__ LeafTable t, const float* __restrict__ scalars,
                   const float* __restrict__ partials, AdamWConsts c) {
  const int64_t inst = blockIdx.y;
  const float lr_neg = scalars[inst * kScalars + 0];
  const float bc1 = scalars[inst * kScalars + 1];
  const float bc2 = scalars[inst * kScalars + 2];
  bool clip_now = false;
  float norm = 0.f;
  if (kClip) {
    __shared__ double red[kWarps];
    __shared__ float s_norm;
    const float* part = partials + inst * t.parts;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < t.parts; j += kThreads) s += static_cast<double>(part[j]);
    s = BlockSum(s, red);
    if (threadIdx.x == 0) s_norm = __fsqrt_rn(static_cast<float>(s));
    __syncthreads();
    norm = s_norm;
    clip_now = !((norm < c.max_norm) || (norm == 0.f));  // NaN norm: clip (g / NaN = NaN), as optax
  }
  const int b = blockIdx.x;
  const int i = FindLeaf(t, b);
  const LeafDesc& L = t.leaf[i];
  const int64_t n = L.n;
  const int64_t moff = inst * (t.mstride > 0 ? t.mstride : n);
  float* pi = L.p + inst * n;
  const float* gi = L.g + inst * n;
  float* mi = L.m + moff;
  float* ni = L.v + moff;
  const uint8_t* ki = L.mode == 2 ? L.mask + inst * n : nullptr;
  const bool vec = L.vec != 0;
  const int mode = L.mode;
  const int64_t full = n / 4, cols = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(LeafBlocks(t, i)) * kThreads;
  for (int64_t v = static_cast<int64_t>(b - L.begin) * kThreads + threadIdx.x; v < cols; v += stride) {
    if (vec && v < full) {
      float4 p = reinterpret_cast<const float4*>(pi)[v];
      const float4 g = reinterpret_cast<const float4*>(gi)[v];
      float4 m = reinterpret_cast<const float4*>(mi)[v];
      float4 q = reinterpret_cast<const float4*>(ni)[v];
      uint32_t k = mode == 1 ? 0x01010101u : 0u;
      if (mode == 2) k = reinterpret_cast<const uint32_t*>(ki)[v];  // 4 PRED bytes, little-endian
      AdamWElem(p.x, g.x, m.x, q.x, (k & 0x000000ffu) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.y, g.y, m.y, q.y, (k & 0x0000ff00u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.z, g.z, m.z, q.z, (k & 0x00ff0000u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      AdamWElem(p.w, g.w, m.w, q.w, (k & 0xff000000u) != 0, clip_now, norm, c, lr_neg, bc1, bc2);
      reinterpret_cast<float4*>(pi)[v] = p;
      reinterpret_cast<float4*>(mi)[v] = m;
      reinterpret_cast<float4*>(ni)[v] = q;
    } else {
      const int64_t e1 = min(n, 4 * v + 4);
      for (int64_t e = 4 * v; e < e1; ++e) {
        float p = pi[e], m = mi[e], q = ni[e];
        const bool decay = mode == 1 || (mode == 2 && ki[e] != 0);
        AdamWElem(p, gi[e], m, q, decay, clip_now, norm, c, lr_neg, bc1, bc2);
        pi[e] = p;
        mi[e] = m;
        ni[e] = q;
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

// One buffer of the call: its data, leading (vmap) element count and last dimension.
struct Buf {
  void* data = nullptr;
  int64_t lead = 0, n = 0;
};

ffi::Error Describe(ffi::AnyBuffer b, ffi::DataType want, const std::string& name, Buf* out) {
  if (b.element_type() != want) {
    return InvalidArgument("adamw_apply: " + name + " must be " + (want == ffi::DataType::PRED ? "bool" : "float32"));
  }
  auto dims = b.dimensions();
  if (dims.size() < 1) return InvalidArgument("adamw_apply: " + name + " must have rank >= 1, got a scalar");
  out->data = b.untyped_data();
  out->n = dims[dims.size() - 1];
  out->lead = DimProduct(dims, 0, dims.size() - 1);
  return ffi::Error::Success();
}

}  // namespace

static ffi::Error AdamWApplyImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> scalars, float b1, float one_minus_b1,
                                 float b2, float one_minus_b2, float eps, float weight_decay, float max_grad_norm,
                                 int64_t clip, int64_t flat_moments, ffi::Span<const int64_t> mask_modes,
                                 ffi::RemainingArgs args, ffi::ResultBuffer<ffi::F32> workspace,
                                 ffi::RemainingRets rets) {
  ClearStaleCudaError();
  const int64_t L = static_cast<int64_t>(mask_modes.size());
  const int64_t S = flat_moments != 0 ? 1 : L;  // moment buffers per moment
  if (static_cast<int64_t>(args.size()) != 3 * L + 2 * S || static_cast<int64_t>(rets.size()) != L + 2 * S) {
    return InvalidArgument("adamw_apply: " + std::to_string(L) + " leaves need " + std::to_string(3 * L + 2 * S) +
                           " operands after scalars and " + std::to_string(L + 2 * S) +
                           " results after the workspace, got " + std::to_string(args.size()) + " and " +
                           std::to_string(rets.size()));
  }
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(scalars, "adamw_apply: scalars", {kScalars}, &V));
  std::vector<Buf> in(args.size()), out(rets.size());
  auto arg_name = [&](size_t k) {
    const char* what[] = {"params", "grads", "mu", "nu", "mask"};
    size_t group, idx;
    if (k < static_cast<size_t>(2 * L)) group = k / L, idx = k % L;
    else if (k < static_cast<size_t>(2 * L + 2 * S)) group = 2 + (k - 2 * L) / S, idx = (k - 2 * L) % S;
    else group = 4, idx = k - 2 * L - 2 * S;
    return std::string(what[group]) + "[" + std::to_string(idx) + "]";
  };
  for (size_t k = 0; k < args.size(); ++k) {
    auto b = args.get<ffi::AnyBuffer>(k);
    if (b.has_error()) return b.error();
    const bool is_mask = k >= static_cast<size_t>(2 * L + 2 * S);
    JAXFOX_RETURN_IF_ERROR(Describe(*b, is_mask ? ffi::DataType::PRED : ffi::DataType::F32, arg_name(k), &in[k]));
    if (in[k].lead != V) return InvalidArgument("adamw_apply: " + arg_name(k) + ": leading (batched) dims differ");
  }
  for (size_t k = 0; k < rets.size(); ++k) {
    auto b = rets.get<ffi::AnyBuffer>(k);
    if (b.has_error()) return b.error();
    JAXFOX_RETURN_IF_ERROR(Describe(**b, ffi::DataType::F32, "result " + std::to_string(k + 1), &out[k]));
    // result k aliases operand: params (k < L), then mu, nu
    const Buf& src = in[k < static_cast<size_t>(L) ? k : k + L];
    if (out[k].lead != V || out[k].n != src.n) {
      return InvalidArgument("adamw_apply: result " + std::to_string(k + 1) + " is not shaped as its operand");
    }
  }
  int64_t P = 0;
  std::vector<int64_t> moff(L, 0);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t n = in[i].n;
    if (in[L + i].n != n) return InvalidArgument("adamw_apply: " + arg_name(L + i) + " is not shaped as params");
    if (mask_modes[i] < 0 || mask_modes[i] > 2) {
      return InvalidArgument("adamw_apply: mask_modes[" + std::to_string(i) + "] must be 0, 1 or 2");
    }
    if (in[2 * L + 2 * S + i].n != (mask_modes[i] == 2 ? n : 0)) {
      return InvalidArgument("adamw_apply: " + arg_name(2 * L + 2 * S + i) + " has the wrong length");
    }
    if (flat_moments == 0 && (in[2 * L + i].n != n || in[2 * L + L + i].n != n)) {
      return InvalidArgument("adamw_apply: mu[" + std::to_string(i) + "] / nu[" + std::to_string(i) +
                             "] are not shaped as params");
    }
    moff[i] = P;
    P += n;
  }
  if (flat_moments != 0 && (in[2 * L].n != P || in[2 * L + 1].n != P)) {
    return InvalidArgument("adamw_apply: flat mu / nu must have " + std::to_string(P) + " elements per instance");
  }
  int64_t parts = 0;
  for (int64_t i = 0; i < L; ++i) parts += NormBlocks(in[i].n);
  const int64_t need = clip != 0 ? V * parts : 0;
  if (static_cast<int64_t>(workspace->element_count()) < need) {
    return InvalidArgument("adamw_apply: workspace has " + std::to_string(workspace->element_count()) +
                           " elements, needs " + std::to_string(need));
  }
  if (V == 0 || P == 0) return ffi::Error::Success();
  if (V > 65535) return InvalidArgument("adamw_apply: more than 65535 batched instances");

  // In place: a result that is not its operand's buffer (no aliasing) starts as a copy of it.
  for (size_t k = 0; k < rets.size(); ++k) {
    const Buf& src = in[k < static_cast<size_t>(L) ? k : k + L];
    if (out[k].data != src.data) {
      cudaMemcpyAsync(out[k].data, src.data, static_cast<size_t>(V * src.n) * sizeof(float), cudaMemcpyDeviceToDevice,
                      stream);
    }
  }
  float* mu_base = static_cast<float*>(out[L].data);
  float* nu_base = static_cast<float*>(out[L + S].data);
  std::vector<LeafDesc> leaves(L);
  for (int64_t i = 0; i < L; ++i) {
    LeafDesc& d = leaves[i];
    d.p = static_cast<float*>(out[i].data);
    d.g = static_cast<const float*>(in[L + i].data);
    d.m = flat_moments != 0 ? mu_base + moff[i] : static_cast<float*>(out[L + i].data);
    d.v = flat_moments != 0 ? nu_base + moff[i] : static_cast<float*>(out[L + S + i].data);
    d.mask = static_cast<const uint8_t*>(in[2 * L + 2 * S + i].data);
    d.n = in[i].n;
    d.mode = static_cast<uint8_t>(mask_modes[i]);
    const bool rows = V == 1 || (d.n % 4 == 0 && (flat_moments == 0 || P % 4 == 0));
    d.vec = rows && Aligned(d.p, 16) && Aligned(d.g, 16) && Aligned(d.m, 16) && Aligned(d.v, 16) &&
            (d.mode != 2 || Aligned(d.mask, 4));
  }
  const AdamWConsts c{b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_grad_norm};
  const bool do_clip = clip != 0;
  auto* apply = do_clip ? adamw_apply_kernel<true> : adamw_apply_kernel<false>;
  const int64_t resident =
      static_cast<int64_t>(GetDeviceInfo().sm_count) * BlocksPerSm(reinterpret_cast<const void*>(apply));
  const int64_t cap = std::max<int64_t>(1, CeilDiv(std::max<int64_t>(resident, 1), V));
  // Groups of up to kMaxLeaves leaves (apply: a leaf with no elements has no blocks and is left out; norm:
  // every leaf has at least one block, whose partial is 0 for an empty leaf, as NormBlocks counts it).
  auto for_each_launch = [&](bool norm, auto&& launch) -> ffi::Error {
    LeafTable t{};
    t.mstride = flat_moments != 0 ? P : 0;
    t.parts = parts;
    int64_t part = 0;
    auto flush = [&]() -> ffi::Error {
      if (t.count == 0) return ffi::Error::Success();
      launch(t);
      JAXFOX_RETURN_IF_ERROR(LastCudaError(norm ? "adamw_apply (norm)" : "adamw_apply"));
      t.count = 0;
      t.blocks = 0;
      return ffi::Error::Success();
    };
    for (int64_t i = 0; i < L; ++i) {
      const int64_t blocks = norm ? NormBlocks(leaves[i].n) : std::min(cap, CeilDiv(CeilDiv(leaves[i].n, 4), kThreads));
      if (blocks == 0) continue;
      if (t.count == kMaxLeaves || t.blocks + blocks > (int64_t{1} << 30)) JAXFOX_RETURN_IF_ERROR(flush());
      if (t.count == 0) t.part_base = part;  // the launch's first partial (norm kernel)
      t.leaf[t.count] = leaves[i];
      t.leaf[t.count].begin = t.blocks;
      ++t.count;
      t.blocks += static_cast<int32_t>(blocks);
      part += blocks;
    }
    return flush();
  };
  float* partials = do_clip ? workspace->typed_data() : nullptr;
  if (do_clip) {
    JAXFOX_RETURN_IF_ERROR(for_each_launch(true, [&](const LeafTable& t) {
      adamw_sumsq_kernel<<<dim3(static_cast<unsigned>(t.blocks), static_cast<unsigned>(V)), kThreads, 0, stream>>>(
          t, partials);
    }));
  }
  const float* sc = scalars.typed_data();
  return for_each_launch(false, [&](const LeafTable& t) {
    apply<<<dim3(static_cast<unsigned>(t.blocks), static_cast<unsigned>(V)), kThreads, 0, stream>>>(t, sc, partials,
                                                                                                      c);
  });
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_adamw_apply, jaxfox::AdamWApplyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // scalars
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<float>("max_grad_norm")
                                  .Attr<int64_t>("clip")
                                  .Attr<int64_t>("flat_moments")
                                  .Attr<xla::ffi::Span<const int64_t>>("mask_modes")
                                  .RemainingArgs()                          // params, grads, mu, nu, masks
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace
                                  .RemainingRets(),                         // params', mu', nu'
                              {xla::ffi::Traits::kCmdBufferCompatible});
