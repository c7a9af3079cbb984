// Prioritized replay: multi-block prefix sum with float64 accumulation and the stratified sampler.
// XLA FFI handlers (targets jaxfox_prefix_sum, jaxfox_per_sample). Math, edge rules and the
// reference: jaxfox/per.py, OPS.md "Prioritized replay".
//
// The array is cut into tiles of kTile = 256 threads x 8 items. Every prefix value is formed in
// float64 as offset_g + local_i and then rounded to float32 once:
//   local_i  in-tile inclusive prefix: a sequential sum over each thread's 8 items, plus the
//            exclusive scan (warp shuffles, then warp totals) of the thread totals. Pass 1 and
//            pass 3 run the same code, so local_i is the same double in both.
//   offset_g exclusive scan of the tile totals (pass 2, one block per instance).
// The float64 sums of float32 inputs are exact, or within ~n 2^-53 relative, so c_i is the float32
// rounding of the exact prefix (the reference's double-float scan is within 0.5 ulp too).
// Sampling (mode 1) searches the "searchable" prefix of the reference,
//   c_i = max_{j <= i, q_j > 0} RN32(offset + local_j)   (0 before the first positive q),
// i.e. jax.lax.cummax(where(q > 0, c, 0)). Max is exact, so the split into tiles cannot change it:
// pass 1 keeps lmax_g = max local_i over the tile's positive slots; as x -> RN32(offset_g + x) is
// monotone, pass 2 gets the tile's max M_g = RN32(offset_g + lmax_g) and the exclusive max-scan of
// the M_g (carry_g) before pass 3 writes c. c is non-decreasing and flat over zero slots, so
// searchsorted-right never returns a zero-priority slot below the clamp (last positive slot).
//   Pass 4 (sampler, one block per instance): u_k = ((k + r_k) / B) * S in float32 as the
//   reference, idx_k = first i with c_i > u_k (a binary search over the tile ends, then inside the
//   tile), min(idx, last positive slot); S == 0 -> floor((k + r_k) / B * size) clipped; weights
//   (q_min / q_k)^beta with q_min the batch minimum (block reduction; min is exact).
// No atomics; every output element has one writer; results are bitwise reproducible.
#include <cmath>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int kTile = kThreads * kItems;
constexpr int kScanThreads = 1024;
constexpr unsigned kFull = 0xffffffffu;

// One record per tile, plus one for the whole array (index G), per instance. 40 bytes.
struct TileRec {
  double total;   // pass 1: sum of the tile's values
  double lmax;    // pass 1: max local_i over positive slots (-1 when none)
  double offset;  // pass 2: exclusive prefix of the tile totals
  float carry;    // pass 2: max of M over earlier tiles (mode 1)
  float end;      // pass 2: c at the tile's last element (mode 1); record G: S, the total
  int last_pos;   // pass 1: last slot with q > 0 (-1 when none); record G: over all tiles (0 when none)
  int pad;
};
constexpr int kRecFloats = sizeof(TileRec) / sizeof(float);
static_assert(sizeof(TileRec) == 40, "TileRec layout");

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Exclusive scan of one value per thread over the block (blockDim.x = 32 * nwarps, nwarps <= 32),
// in a fixed order: Hillis-Steele in each warp, then the same over the warp totals.
// `sm` holds 33 T. Returns the thread's exclusive prefix (identity for thread 0); *total gets the
// block total. Contains __syncthreads (all threads must call it).
template <typename T, typename Op>
__device__ T BlockExclusiveScan(T x, Op op, T identity, T* sm, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFull, inc, o);
    if (lane >= o) inc = op(y, inc);
  }
  T exc = __shfl_up_sync(kFull, inc, 1);
  if (lane == 0) exc = identity;
  __syncthreads();  // sm may still be read by a previous call
  if (lane == 31) sm[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? sm[lane] : identity;
    T winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(kFull, winc, o);
      if (lane >= o) winc = op(y, winc);
    }
    T wexc = __shfl_up_sync(kFull, winc, 1);
    if (lane == 0) wexc = identity;
    __syncwarp();
    if (lane < nwarps) sm[lane] = wexc;
    if (lane == 31) sm[32] = winc;  // nwarps <= 32: lane 31's inclusive value is the block total
  }
  __syncthreads();
  const T woff = sm[warp];
  *total = sm[32];
  return op(woff, exc);
}

// The value at slot i: mode 0 the raw input, mode 1 the score q_i = p_i^alpha (0 beyond size or
// for p <= 0 / NaN, as the reference's `pos` mask).
__device__ __forceinline__ float Score(const float* __restrict__ x, int64_t i, int mode, int64_t size, float alpha) {
  const float p = x[i];
  if (mode == 0) return p;
  return (i < size && p > 0.f) ? powf(p, alpha) : 0.f;
}

// Loads the tile (coalesced through shared memory) and computes each of this thread's items'
// values and in-tile inclusive prefixes (float64). Identical in passes 1 and 3.
struct TileScan {
  float val[kItems];
  double loc[kItems];
  double total;
};

__device__ void ScanTile(const float* __restrict__ x, int64_t n, int64_t tile, int mode, int64_t size, float alpha,
                         float* stage /*[kTile]*/, double* sm /*[33]*/, TileScan* ts) {
  const int64_t t0 = tile * kTile;
  for (int k = threadIdx.x; k < kTile; k += kThreads) {
    const int64_t i = t0 + k;
    stage[k] = i < n ? Score(x, i, mode, size, alpha) : 0.f;
  }
  __syncthreads();
  double run = 0.0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    ts->val[j] = stage[threadIdx.x * kItems + j];
    run += static_cast<double>(ts->val[j]);
    ts->loc[j] = run;
  }
  const double exc = BlockExclusiveScan<double>(run, SumOp(), 0.0, sm, &ts->total);
#pragma unroll
  for (int j = 0; j < kItems; ++j) ts->loc[j] = exc + ts->loc[j];
}

__device__ __forceinline__ TileRec* Recs(float* ws, int64_t v, int64_t G) {
  return reinterpret_cast<TileRec*>(ws) + v * (G + 1);
}

// Pass 1: tile totals, lmax and last positive slot.
__global__ void __launch_bounds__(kThreads)
scan_tiles_kernel(const float* __restrict__ x, int64_t n, int64_t G, int mode, const int32_t* __restrict__ size,
                  const float* __restrict__ alpha, float* __restrict__ ws) {
  __shared__ float stage[kTile];
  __shared__ double sm[33];
  __shared__ int smi[32];
  const int64_t g = blockIdx.x, v = blockIdx.y;
  const int64_t sz = mode ? static_cast<int64_t>(size[v]) : n;
  const float al = mode ? alpha[v] : 1.f;
  TileScan ts;
  ScanTile(x + v * n, n, g, mode, sz, al, stage, sm, &ts);
  double lmax = -1.0;
  int last = -1;
  if (mode) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (ts.val[j] > 0.f) {
        lmax = fmax(lmax, ts.loc[j]);
        last = static_cast<int>(g * kTile + threadIdx.x * kItems + j);
      }
    }
    // Block max of lmax and last (exact, any order).
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lmax = fmax(lmax, __shfl_xor_sync(kFull, lmax, o));
      last = max(last, __shfl_xor_sync(kFull, last, o));
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      sm[warp] = lmax;
      smi[warp] = last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kThreads / 32; ++w) {
        lmax = fmax(lmax, sm[w]);
        last = max(last, smi[w]);
      }
    }
  }
  if (threadIdx.x == 0) {
    TileRec* rec = Recs(ws, v, G) + g;
    rec->total = ts.total;
    rec->lmax = lmax;
    rec->last_pos = last;
  }
}

// Pass 2: one block per instance: offsets, tile maxima carries, tile ends, totals.
__global__ void __launch_bounds__(kScanThreads)
scan_totals_kernel(int64_t G, int mode, float* __restrict__ ws) {
  __shared__ double sm[33];
  __shared__ float smf[33];
  __shared__ int smi[32];
  TileRec* rec = Recs(ws, blockIdx.x, G);
  const int64_t per = (G + kScanThreads - 1) / kScanThreads;
  const int64_t g0 = threadIdx.x * per, g1 = min(G, g0 + per);
  double run = 0.0;
  for (int64_t g = g0; g < g1; ++g) run += rec[g].total;
  double total;
  double off = BlockExclusiveScan<double>(run, SumOp(), 0.0, sm, &total);
  for (int64_t g = g0; g < g1; ++g) {
    rec[g].offset = off;
    off += rec[g].total;
  }
  if (mode == 0) return;
  // M_g = RN32(offset_g + lmax_g) on tiles with a positive slot, else 0; exclusive max-scan.
  float mrun = 0.f;
  int last = -1;
  for (int64_t g = g0; g < g1; ++g) {
    const float M = rec[g].lmax >= 0.0 ? static_cast<float>(rec[g].offset + rec[g].lmax) : 0.f;
    mrun = fmaxf(mrun, M);
    last = max(last, rec[g].last_pos);
  }
  float mtotal;
  float carry = BlockExclusiveScan<float>(mrun, MaxOp(), 0.f, smf, &mtotal);
  for (int64_t g = g0; g < g1; ++g) {
    const float M = rec[g].lmax >= 0.0 ? static_cast<float>(rec[g].offset + rec[g].lmax) : 0.f;
    rec[g].carry = carry;
    carry = fmaxf(carry, M);
    rec[g].end = carry;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(kFull, last, o));
  if ((threadIdx.x & 31) == 0) smi[threadIdx.x >> 5] = last;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kScanThreads / 32; ++w) last = max(last, smi[w]);
    rec[G].end = mtotal;
    rec[G].last_pos = last < 0 ? 0 : last;
    rec[G].total = total;
  }
}

// Pass 3: c (plain prefix in mode 0, the searchable prefix in mode 1).
__global__ void __launch_bounds__(kThreads)
write_prefix_kernel(const float* __restrict__ x, int64_t n, int64_t G, int mode, const int32_t* __restrict__ size,
                    const float* __restrict__ alpha, const float* __restrict__ ws, float* __restrict__ c) {
  __shared__ float stage[kTile];
  __shared__ double sm[33];
  __shared__ float smf[33];
  const int64_t g = blockIdx.x, v = blockIdx.y;
  const int64_t sz = mode ? static_cast<int64_t>(size[v]) : n;
  const float al = mode ? alpha[v] : 1.f;
  TileScan ts;
  ScanTile(x + v * n, n, g, mode, sz, al, stage, sm, &ts);
  const TileRec rec = reinterpret_cast<const TileRec*>(ws)[v * (G + 1) + g];
  float out[kItems];
  if (mode == 0) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) out[j] = static_cast<float>(rec.offset + ts.loc[j]);
  } else {
    float run = 0.f;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const float vj = ts.val[j] > 0.f ? static_cast<float>(rec.offset + ts.loc[j]) : 0.f;
      run = fmaxf(run, vj);
      out[j] = run;
    }
    float tmax;
    const float exc = BlockExclusiveScan<float>(run, MaxOp(), 0.f, smf, &tmax);
    const float base = fmaxf(rec.carry, exc);
#pragma unroll
    for (int j = 0; j < kItems; ++j) out[j] = fmaxf(base, out[j]);
  }
  __syncthreads();  // everyone is done reading stage in ScanTile
#pragma unroll
  for (int j = 0; j < kItems; ++j) stage[threadIdx.x * kItems + j] = out[j];
  __syncthreads();
  const int64_t t0 = g * kTile;
  float* cv = c + v * n;
  for (int k = threadIdx.x; k < kTile; k += kThreads) {
    if (t0 + k < n) cv[t0 + k] = stage[k];
  }
}

// First index in [lo, hi) with a[i * stride] > u (hi when none). a is non-decreasing.
__device__ __forceinline__ int64_t SearchRight(const float* a, int64_t stride, int64_t lo, int64_t hi, float u) {
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (a[mid * stride] > u) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Pass 4: the draws and the importance weights, one block per instance.
__global__ void __launch_bounds__(kScanThreads)
sample_kernel(const float* __restrict__ prio, int64_t C, int64_t G, const int32_t* __restrict__ size,
              const float* __restrict__ alpha, const float* __restrict__ beta, const float* __restrict__ r,
              int64_t B, const float* __restrict__ ws, const float* __restrict__ c, int32_t* __restrict__ idx,
              float* __restrict__ w) {
  __shared__ float smf[32];
  const int64_t v = blockIdx.x;
  const TileRec* rec = reinterpret_cast<const TileRec*>(ws) + v * (G + 1);
  const float* pv = prio + v * C;
  const float* cv = c + v * C;
  const float* rv = r + v * B;
  int32_t* iv = idx + v * B;
  float* wv = w + v * B;
  const int64_t sz = min(max(static_cast<int64_t>(size[v]), int64_t{0}), C);
  const float al = alpha[v], be = beta[v];
  const float total = rec[G].end;
  const int64_t last_pos = rec[G].last_pos;
  // an infinite S (a q_i = inf, or the sum past float32 max) falls back to uniform draws, as the reference does
  const bool prioritized = total > 0.f && isfinite(total);
  const float bf = static_cast<float>(B), nf = static_cast<float>(size[v]);
  const int64_t top = sz > 0 ? sz - 1 : 0;
  const float* ends = &rec[0].end;
  float qmin = INFINITY;
  for (int64_t k = threadIdx.x; k < B; k += blockDim.x) {
    const float frac = (static_cast<float>(k) + rv[k]) / bf;
    int64_t i;
    if (prioritized) {
      const float u = frac * total;
      const int64_t g = SearchRight(ends, kRecFloats, 0, G, u);
      i = g < G ? SearchRight(cv, 1, g * kTile, min(C, (g + 1) * kTile), u) : C;
      i = min(i, last_pos);
    } else {
      const float f = floorf(frac * nf);
      i = f > 0.f ? static_cast<int64_t>(f) : 0;  // floor >= 0 (frac, size >= 0)
      i = min(i, top);
    }
    iv[k] = static_cast<int32_t>(i);
    qmin = fminf(qmin, Score(pv, i, 1, sz, al));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) qmin = fminf(qmin, __shfl_xor_sync(kFull, qmin, o));
  if ((threadIdx.x & 31) == 0) smf[threadIdx.x >> 5] = qmin;
  __syncthreads();
  qmin = smf[0];
  for (int j = 1; j < static_cast<int>(blockDim.x >> 5); ++j) qmin = fminf(qmin, smf[j]);
  for (int64_t k = threadIdx.x; k < B; k += blockDim.x) {
    float wk;
    if (prioritized) {
      wk = powf(qmin / Score(pv, iv[k], 1, sz, al), be);
    } else {
      wk = sz > 0 ? 1.f : 0.f;
    }
    wv[k] = wk;
  }
}

int64_t NumTiles(int64_t n) { return n > 0 ? CeilDiv(n, kTile) : 0; }

ffi::Error CheckWorkspace(const ffi::ResultBuffer<ffi::F32>& ws, int64_t V, int64_t G, const char* who) {
  const int64_t need = V * (G + 1) * kRecFloats;
  if (static_cast<int64_t>(ws->element_count()) < need) {
    return InvalidArgument(std::string(who) + ": workspace has " + std::to_string(ws->element_count()) +
                           " elements, needs " + std::to_string(need));
  }
  if (!Aligned(ws->typed_data(), alignof(double))) {
    return InvalidArgument(std::string(who) + ": workspace is not 8-byte aligned");
  }
  return ffi::Error::Success();
}

// Passes 1-3 for V instances of length n.
ffi::Error LaunchPrefix(cudaStream_t stream, const float* x, int64_t V, int64_t n, int mode, const int32_t* size,
                        const float* alpha, float* ws, float* c) {
  const int64_t G = NumTiles(n);
  if (G > 0x7fffffff || V > 65535) return InvalidArgument("prefix_sum: too many tiles or instances");
  dim3 grid(static_cast<unsigned>(G), static_cast<unsigned>(V));
  scan_tiles_kernel<<<grid, kThreads, 0, stream>>>(x, n, G, mode, size, alpha, ws);
  scan_totals_kernel<<<static_cast<unsigned>(V), kScanThreads, 0, stream>>>(G, mode, ws);
  write_prefix_kernel<<<grid, kThreads, 0, stream>>>(x, n, G, mode, size, alpha, ws, c);
  return LastCudaError("prefix_sum");
}

}  // namespace

// FFI target jaxfox_prefix_sum: x [V.., n] f32 -> c [V.., n] (inclusive prefix sums, float64
// accumulation, rounded once), workspace [V.., (ceil(n / 2048) + 1) * 10] f32.
static ffi::Error PrefixSumImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> c,
                                ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  auto dims = x.dimensions();
  if (dims.size() < 1) return InvalidArgument("prefix_sum: x must have rank >= 1, got " + DimsToString(dims));
  const int64_t n = dims[dims.size() - 1];
  const int64_t V = DimProduct(dims, 0, dims.size() - 1);
  if (static_cast<int64_t>(c->element_count()) != V * n) return InvalidArgument("prefix_sum: output size mismatch");
  if (V == 0 || n == 0) return ffi::Error::Success();
  const int64_t G = NumTiles(n);
  JAXFOX_RETURN_IF_ERROR(CheckWorkspace(ws, V, G, "prefix_sum"));
  return LaunchPrefix(stream, x.typed_data(), V, n, 0, nullptr, nullptr, ws->typed_data(), c->typed_data());
}

// FFI target jaxfox_per_sample: priorities [V.., C] f32, size [V..] s32, alpha [V..] f32,
// beta [V..] f32, uniforms r [V.., B] f32 in [0, 1) -> indices [V.., B] s32, weights [V.., B] f32,
// searchable prefix c [V.., C] f32 (workspace), workspace [V.., (ceil(C / 2048) + 1) * 10] f32.
static ffi::Error PerSampleImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> prio, ffi::Buffer<ffi::S32> size,
                                ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> r,
                                ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> c, ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  auto pd = prio.dimensions();
  auto rd = r.dimensions();
  if (pd.size() < 1 || rd.size() < 1) return InvalidArgument("per_sample: priorities and r must have rank >= 1");
  const int64_t C = pd[pd.size() - 1], B = rd[rd.size() - 1];
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(prio, "priorities", {C}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(size, "size", {}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(alpha, "alpha", {}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(beta, "beta", {}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(r, "r", {B}, &V));
  if (static_cast<int64_t>(idx->element_count()) != V * B || static_cast<int64_t>(w->element_count()) != V * B ||
      static_cast<int64_t>(c->element_count()) != V * C) {
    return InvalidArgument("per_sample: output sizes do not match the inputs");
  }
  if (V == 0 || B == 0) return ffi::Error::Success();
  if (C < 1 || C > 0x7fffffff) return InvalidArgument("per_sample: capacity must be in [1, 2^31), got " +
                                                      std::to_string(C));
  const int64_t G = NumTiles(C);
  JAXFOX_RETURN_IF_ERROR(CheckWorkspace(ws, V, G, "per_sample"));
  JAXFOX_RETURN_IF_ERROR(LaunchPrefix(stream, prio.typed_data(), V, C, 1, size.typed_data(), alpha.typed_data(),
                                      ws->typed_data(), c->typed_data()));
  sample_kernel<<<static_cast<unsigned>(V), kScanThreads, 0, stream>>>(
      prio.typed_data(), C, G, size.typed_data(), alpha.typed_data(), beta.typed_data(), r.typed_data(), B,
      ws->typed_data(), c->typed_data(), idx->typed_data(), w->typed_data());
  return LastCudaError("per_sample");
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_prefix_sum, jaxfox::PrefixSumImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // c
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(), // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_per_sample, jaxfox::PerSampleImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // priorities
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // size
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // alpha
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // r (uniforms)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // indices
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // weights
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // c (workspace)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(), // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
