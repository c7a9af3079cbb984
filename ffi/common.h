// Shared helpers for jaxfox's XLA FFI handlers: includes, CUDA-error -> ffi::Error,
// shape checks, device properties, and the deterministic reduction used by every backward pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfox {

namespace ffi = xla::ffi;

// Every handler ends with this: a failed launch becomes an XLA error, never a crash.
inline ffi::Error LastCudaError(const char* where) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(where) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

inline ffi::Error InvalidArgument(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

#define JAXFOX_RETURN_IF_ERROR(expr)   \
  do {                                 \
    ffi::Error _err = (expr);          \
    if (_err.failure()) return _err;   \
  } while (0)

// Product of dims[begin:end).
template <typename Dims>
inline int64_t DimProduct(const Dims& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

template <typename Dims>
inline std::string DimsToString(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks that `buf` has rank leading+trailing.size() and the given trailing dims (-1: any),
// and that its leading (vmap) dims multiply to `lead` (pass -1 to accept and return them).
template <typename Buffer>
inline ffi::Error CheckShape(const Buffer& buf, const char* name, std::initializer_list<int64_t> trailing,
                             int64_t* lead) {
  auto dims = buf.dimensions();
  if (dims.size() < trailing.size()) {
    return InvalidArgument(std::string(name) + ": expected rank >= " + std::to_string(trailing.size()) +
                           ", got shape " + DimsToString(dims));
  }
  size_t nl = dims.size() - trailing.size();
  size_t i = nl;
  for (int64_t want : trailing) {
    if (want >= 0 && dims[i] != want) {
      return InvalidArgument(std::string(name) + ": dimension " + std::to_string(i) + " is " +
                             std::to_string(dims[i]) + ", expected " + std::to_string(want) + " (shape " +
                             DimsToString(dims) + ")");
    }
    ++i;
  }
  int64_t l = DimProduct(dims, 0, nl);
  if (*lead < 0) {
    *lead = l;
  } else if (l != *lead) {
    return InvalidArgument(std::string(name) + ": leading (batched) dims " + DimsToString(dims) +
                           " do not match the other operands");
  }
  return ffi::Error::Success();
}

// True when `buf`'s shape is exactly `want` (rank and every dim; no leading vmap dims).
template <typename Buffer>
inline bool HasShape(const Buffer& buf, std::initializer_list<int64_t> want) {
  auto dims = buf.dimensions();
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t v : want) {
    if (dims[i++] != v) return false;
  }
  return true;
}

struct DeviceInfo {
  int sm_count = 0;
  int cc_major = 0;
  int max_smem_optin = 0;  // bytes of shared memory a block may opt into
};

// Lets `kernel` use the device's opt-in maximum of dynamic shared memory (once per kernel and
// device; a host-side attribute, not a stream operation).
ffi::Error AllowLargeSmem(const void* kernel);

// Handlers call this first: a CUDA runtime error left over from earlier work on this thread
// must not be reported as theirs.
inline void ClearStaleCudaError() { (void)cudaGetLastError(); }

// Queried once per device (host-side attribute queries only: safe during graph capture).
DeviceInfo GetDeviceInfo();

// Checks that `bytes` of dynamic shared memory fit the device's opt-in limit (InvalidArgument naming `op`
// otherwise) and lets `kernel` use them when they exceed the default 48 KiB.
template <typename Kernel>
ffi::Error PrepareSmem(const char* op, Kernel kernel, int64_t bytes) {
  const int64_t limit = GetDeviceInfo().max_smem_optin;
  if (bytes > limit) {
    return InvalidArgument(std::string(op) + ": needs " + std::to_string(bytes) +
                           " bytes of shared memory, the device allows " + std::to_string(limit));
  }
  if (bytes > 48 * 1024) return AllowLargeSmem(reinterpret_cast<const void*>(kernel));
  return ffi::Error::Success();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether p is a multiple of n bytes (vector loads and 16-byte cp.async need 16).
inline bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Device helpers shared by the kernels. WarpSum / WarpMax: butterfly reductions over the 32 lanes of a warp
// (every lane must be active; each lane gets the result).
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Fixed-order column sums of S partial rows part [S, C] (no atomics; the order depends on S only): a block of
// 32 x kSumRows threads takes 32 consecutive columns (coalesced 128-byte row segments), thread row r sums the rows
// s = r, r + kSumRows, ... in ascending order, then thread row 0 adds the kSumRows row sums in order r = 0, 1, ...
// Call from every thread of the block (blockDim.x == 32 * kSumRows; lane = threadIdx.x % 32 owns column `col`);
// returns true, with the sum in *total, in the row-0 threads whose column is < C.
constexpr int kSumRows = 32;
__device__ __forceinline__ bool FixedOrderColumnSum(const float* __restrict__ part, int64_t S, int64_t C, int64_t col,
                                                    float* total) {
  __shared__ float red[kSumRows][33];
  const int lane = threadIdx.x & 31, r = threadIdx.x >> 5;
  float v = 0.f;
  if (col < C) {
#pragma unroll 4
    for (int64_t s = r; s < S; s += kSumRows) v += part[s * C + col];
  }
  red[r][lane] = v;
  __syncthreads();
  if (r != 0 || col >= C) return false;
  float t = red[0][lane];
#pragma unroll
  for (int i = 1; i < kSumRows; ++i) t += red[i][lane];
  *total = t;
  return true;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// ReLU that keeps NaN (as XLA's max(x, 0) does): fmaxf(x, 0) would return 0 for a NaN and hide it.
__device__ __forceinline__ float Relu(float x) { return x < 0.f ? 0.f : x; }

// Asynchronous global -> shared copies (cp.async, sm_80+): a thread issues all of its copies without waiting on
// each load (a load-then-store loop waits one memory latency per element). valid false writes zeros and reads
// nothing. 4-byte copies go through L1 (.ca), 16-byte ones bypass it (.cg; dst and src 16-byte aligned). Wait
// (CpAsyncWaitAll, or CpAsyncCommit + CpAsyncWaitGroup<N> to leave the N newest groups in flight), then a
// barrier, before another thread reads dst.
__device__ __forceinline__ void CpAsync4(float* dst, const float* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsync16(float* dst, const float* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__host__ __device__ inline int Round4(int v) { return (v + 3) & ~3; }
__host__ __device__ inline int64_t Round4(int64_t v) { return (v + 3) & ~int64_t{3}; }

// Offsets (floats) of one GRN's parameters in its flat row, in the order of jaxfox/grn.py _FLAT_KEYS
// (w2, b2, w1, b1, w4, b4, w5, b5, [ws, bs when the input width I != O], gamma, beta; each leaf row-major).
// Shared by ffi/grn.cu (one GRN, I = its input width) and ffi/vsn.cu (one row per variable, I = d).
struct GrnParamLayout {
  int w2, b2, w1, b1, w4, b4, w5, b5, ws, bs, gamma, beta, P;
};

__host__ __device__ inline GrnParamLayout MakeGrnParamLayout(int I, int H, int O, bool skip) {
  GrnParamLayout L;
  int o = 0;
  L.w2 = o; o += I * H;
  L.b2 = o; o += H;
  L.w1 = o; o += H * H;
  L.b1 = o; o += H;
  L.w4 = o; o += H * O;
  L.b4 = o; o += O;
  L.w5 = o; o += H * O;
  L.b5 = o; o += O;
  L.ws = o; if (skip) o += I * O;
  L.bs = o; if (skip) o += O;
  L.gamma = o; o += O;
  L.beta = o; o += O;
  L.P = o;
  return L;
}

// Parameter-gradient register tiles of the GRN backward kernels (ffi/grn.cu, ffi/vsn.cu). One 4 x 4 tile of a
// parameter-gradient matrix dW [K][N] = sum_r P^T[k][r] Q^T[n][r] (P^T, Q^T: k-major arrays in shared memory,
// row stride kTRp): the thread's rows k = kt + KT a and columns n = nt + NT b (a, b < 4; interleaved so that
// neighbouring threads read neighbouring rows of Q^T without bank conflicts).
struct WTile {
  int p, q;        // smem offsets of P^T and Q^T
  int kt, KT, nt, NT, K, N;
  int out;         // offset of dW in the parameter row
  bool active;
};

// Thread tid's kSlots tiles (work items tid + s kThreads, numbered over the nmat matrices q in order: P^T at
// mp[q], Q^T at mq[q], dW [mk[q]][mn[q]] at mo[q] in the parameter row), fixed for the CTA; accumulators zeroed.
template <int kSlots, int kThreads, int kMats>
__device__ __forceinline__ void AssignWTiles(int tid, int nmat, const int (&mp)[kMats], const int (&mq)[kMats],
                                             const int (&mk)[kMats], const int (&mn)[kMats],
                                             const int (&mo)[kMats], WTile (&wt)[kSlots],
                                             float (&wacc)[kSlots][4][4]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    wt[s].active = false;
    int idx = tid + s * kThreads;
    for (int q = 0; q < nmat; ++q) {
      const int KT = Round4(mk[q]) / 4, NT = Round4(mn[q]) / 4;
      if (!wt[s].active && idx < KT * NT) {
        wt[s] = WTile{mp[q], mq[q], idx / NT, KT, idx % NT, NT, mk[q], mn[q], mo[q], true};
      }
      if (!wt[s].active) idx -= KT * NT;
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) wacc[s][a][b] = 0.f;
  }
}

// Adds one row tile to the thread's tiles: wacc[s][a][b] += sum_r P^T[k_a][r] Q^T[n_b][r] over the kRows rows of
// the k-major arrays in sm (row stride kTRp; rows in order, four at a time, so the sum's order is fixed).
template <int kSlots, int kRows, int kTRp>
__device__ __forceinline__ void AccumulateWTiles(const float* sm, const WTile (&wt)[kSlots],
                                                 float (&wacc)[kSlots][4][4]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (!wt[s].active) continue;
    const float* pT = sm + wt[s].p + wt[s].kt * kTRp;
    const float* qT = sm + wt[s].q + wt[s].nt * kTRp;
    const int pstep = wt[s].KT * kTRp, qstep = wt[s].NT * kTRp;
#pragma unroll 2
    for (int r = 0; r < kRows; r += 4) {
      float4 pa[4], qb[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) pa[a] = *reinterpret_cast<const float4*>(pT + a * pstep + r);
#pragma unroll
      for (int b = 0; b < 4; ++b) qb[b] = *reinterpret_cast<const float4*>(qT + b * qstep + r);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          float acc = wacc[s][a][b];
          acc = fmaf(pa[a].x, qb[b].x, acc);
          acc = fmaf(pa[a].y, qb[b].y, acc);
          acc = fmaf(pa[a].z, qb[b].z, acc);
          acc = fmaf(pa[a].w, qb[b].w, acc);
          wacc[s][a][b] = acc;
        }
    }
  }
}

// Writes the thread's tiles into the CTA's partial row `out` (every element of a dW by exactly one thread).
template <int kSlots>
__device__ __forceinline__ void WriteWTiles(float* out, const WTile (&wt)[kSlots],
                                            const float (&wacc)[kSlots][4][4]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (!wt[s].active) continue;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int k = wt[s].kt + wt[s].KT * a;
      if (k >= wt[s].K) continue;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int n = wt[s].nt + wt[s].NT * b;
        if (n < wt[s].N) out[wt[s].out + k * wt[s].N + n] = wacc[s][a][b];
      }
    }
  }
}

// Deterministic sum over axis 1 of x [V, B, P] -> out [V, P] (see reduce.cu for the order).
// `chunks` splits B into that many contiguous row ranges whose partials go to `workspace`
// [V, chunks, P] and are then added in chunk order; chunks == 1 needs no workspace.
ffi::Error LaunchReduceAxis0(cudaStream_t stream, const float* x, int64_t V, int64_t B, int64_t P,
                             int64_t chunks, float* workspace, float* out);

}  // namespace jaxfox
