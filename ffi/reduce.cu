// reduce_axis0: deterministic sum over the batch axis of per-sample gradient partials.
//
// Order (a fixed function of the shape, independent of launch configuration and stream):
// rows are split into `chunks` contiguous ranges of ceil(B / chunks) rows; inside a range the rows
// are taken in groups of 4 consecutive rows summed as ((r0 + r1) + (r2 + r3)) (a short tail group
// left to right), groups accumulated left to right; chunk partials are then added in chunk order.
// No atomics: every output element is written by exactly one thread.
#include <mutex>
#include <set>
#include <utility>

#include "common.h"

namespace jaxfox {

ffi::Error AllowLargeSmem(const void* kernel) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, dev})) return ffi::Error::Success();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         GetDeviceInfo().max_smem_optin);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  }
  done.insert({kernel, dev});
  return ffi::Error::Success();
}

DeviceInfo GetDeviceInfo() {
  static DeviceInfo cache[64];
  static bool have[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (!have[dev]) {
    DeviceInfo info;
    cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cache[dev] = info;
    have[dev] = true;
  }
  return cache[dev];
}

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T Add(T a, T b) { return a + b; }
__device__ __forceinline__ float4 Add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
template <typename T> __device__ __forceinline__ T Zero();
template <> __device__ __forceinline__ float Zero<float>() { return 0.f; }
template <> __device__ __forceinline__ float4 Zero<float4>() { return make_float4(0.f, 0.f, 0.f, 0.f); }

// T is float or float4 (then P % 4 == 0); `cols` counts T-sized columns.
template <typename T>
__global__ void __launch_bounds__(kThreads)
reduce_rows_kernel(const T* __restrict__ x, int64_t B, int64_t cols, int64_t rows_per_chunk,
                   int64_t chunks, T* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= cols) return;
  const int64_t v = blockIdx.z, chunk = blockIdx.y;
  const T* xv = x + v * B * cols + col;
  const int64_t r0 = chunk * rows_per_chunk;
  const int64_t r1 = min(B, r0 + rows_per_chunk);
  T acc = Zero<T>();
  int64_t r = r0;
#pragma unroll 2
  for (; r + 4 <= r1; r += 4) {
    T a = xv[(r + 0) * cols], b = xv[(r + 1) * cols], c = xv[(r + 2) * cols], d = xv[(r + 3) * cols];
    acc = Add(acc, Add(Add(a, b), Add(c, d)));
  }
  if (r < r1) {
    T g = xv[r * cols];
    for (int64_t q = r + 1; q < r1; ++q) g = Add(g, xv[q * cols]);
    acc = Add(acc, g);
  }
  out[(v * chunks + chunk) * cols + col] = acc;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
sum_chunks_kernel(const T* __restrict__ ws, int64_t chunks, int64_t cols, T* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= cols) return;
  const int64_t v = blockIdx.z;
  const T* w = ws + v * chunks * cols + col;
  T acc = w[0];
  for (int64_t c = 1; c < chunks; ++c) acc = Add(acc, w[c * cols]);
  out[v * cols + col] = acc;
}

template <typename T>
ffi::Error LaunchTyped(cudaStream_t stream, const float* x, int64_t V, int64_t B, int64_t P, int64_t chunks,
                       float* workspace, float* out) {
  constexpr int64_t kVec = sizeof(T) / sizeof(float);
  const int64_t cols = P / kVec;
  const int64_t rows_per_chunk = CeilDiv(B, chunks);
  dim3 grid(static_cast<unsigned>(CeilDiv(cols, kThreads)), static_cast<unsigned>(chunks),
            static_cast<unsigned>(V));
  T* first = reinterpret_cast<T*>(chunks == 1 ? out : workspace);
  reduce_rows_kernel<T><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const T*>(x), B, cols, rows_per_chunk,
                                                       chunks, first);
  if (chunks > 1) {
    dim3 grid2(static_cast<unsigned>(CeilDiv(cols, kThreads)), 1, static_cast<unsigned>(V));
    sum_chunks_kernel<T><<<grid2, kThreads, 0, stream>>>(reinterpret_cast<const T*>(workspace), chunks, cols,
                                                         reinterpret_cast<T*>(out));
  }
  return LastCudaError("reduce_axis0");
}

}  // namespace

ffi::Error LaunchReduceAxis0(cudaStream_t stream, const float* x, int64_t V, int64_t B, int64_t P,
                             int64_t chunks, float* workspace, float* out) {
  if (V == 0 || P == 0) return ffi::Error::Success();
  if (V > 65535) return InvalidArgument("reduce_axis0: more than 65535 batched instances");
  if (chunks < 1 || chunks > 65535 || chunks > (B > 0 ? B : 1)) {
    return InvalidArgument("reduce_axis0: chunks must be in [1, min(B, 65535)], got " + std::to_string(chunks));
  }
  if (B == 0) {
    cudaMemsetAsync(out, 0, sizeof(float) * V * P, stream);
    return LastCudaError("reduce_axis0 (B = 0)");
  }
  if (chunks > 1 && workspace == nullptr) return InvalidArgument("reduce_axis0: chunks > 1 needs a workspace");
  const bool aligned = (P % 4 == 0) && Aligned(x, 16) && Aligned(out, 16) && (chunks == 1 || Aligned(workspace, 16));
  return aligned ? LaunchTyped<float4>(stream, x, V, B, P, chunks, workspace, out)
                 : LaunchTyped<float>(stream, x, V, B, P, chunks, workspace, out);
}

// FFI target jaxfox_reduce_axis0: x [..., B, P] f32 -> out [..., P], workspace [V * chunks * P] (or [0]).
static ffi::Error ReduceAxis0Impl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, int64_t chunks,
                                  ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> workspace) {
  ClearStaleCudaError();
  auto dims = x.dimensions();
  if (dims.size() < 2) return InvalidArgument("reduce_axis0: x must have rank >= 2, got " + DimsToString(dims));
  const int64_t B = dims[dims.size() - 2], P = dims[dims.size() - 1];
  const int64_t V = DimProduct(dims, 0, dims.size() - 2);
  if (out->element_count() != V * P) return InvalidArgument("reduce_axis0: output size mismatch");
  const int64_t need = chunks > 1 ? V * chunks * P : 0;
  if (static_cast<int64_t>(workspace->element_count()) < need) {
    return InvalidArgument("reduce_axis0: workspace has " + std::to_string(workspace->element_count()) +
                           " elements, needs " + std::to_string(need));
  }
  return LaunchReduceAxis0(stream, x.typed_data(), V, B, P, chunks, workspace->typed_data(), out->typed_data());
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_reduce_axis0, jaxfox::ReduceAxis0Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("chunks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
