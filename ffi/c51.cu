// Fused branching C51 double-Q loss: forward and the gradient wrt logits_tm1 in one kernel.
// XLA FFI handler (target jaxfox_c51_loss). Math, edge rules and the reference: jaxfox/c51.py,
// OPS.md "Branching C51".
//
// Launch: one block per sample (grid = V * B), a warp per branch (warps stride over D). Atom i of
// a length-N row lives in lane i % 32, register slot i / 32 (K = ceil(N / 32) slots, templated).
// Per (sample b, branch d), all float32:
//   q[a]   = sum_i z_i softmax(logits_t_online[b, d, a])_i;   a* = first argmax (NaN counts as max)
//   p      = softmax(logits_t_target[b, d, a*])
//   bj     = clip((clip(r + discount z_j, z_0, z_{N-1}) - z_0) / dz, 0, N - 1),  dz = (z_{N-1} - z_0) / (N - 1)
//   m_i    = sum_j clip(1 - |bj - i|, 0, 1) p_j        (every j, in order; p, b staged in shared memory)
//   ls     = log_softmax(logits_tm1[b, d, a_tm1])
//   loss_d = -sum_i m_i ls_i
//   delta  = softmax(logits_tm1[b, d, a_tm1]) * sum_i m_i - m   (row a_tm1; other rows 0)
// loss[b] = (sum_d loss_d, d = 0, 1, ... in order) / D. The caller scales delta by (cotangent / D).
// Warp reductions are xor butterflies (every lane ends with the same value; fixed order), so the
// results are bitwise reproducible. No atomics.
#include <cmath>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kMaxWarps = 4;

// Softmax pieces of one row: e_k = exp(x_k - max) (0 beyond N), returns sum_k e_k (warp-wide).
template <int K>
__device__ __forceinline__ float RowExp(const float* __restrict__ row, int N, int lane, float (&e)[K],
                                        float (&sh)[K]) {
  float x[K];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = lane + 32 * k;
    x[k] = i < N ? row[i] : -INFINITY;
    mx = fmaxf(mx, x[k]);
  }
  mx = WarpMax(mx);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = lane + 32 * k;
    sh[k] = x[k] - mx;
    e[k] = i < N ? expf(sh[k]) : 0.f;
    s += e[k];
  }
  return WarpSum(s);
}

template <int K>
__global__ void __launch_bounds__(kMaxWarps * 32)
c51_loss_kernel(int64_t B, int D, int A, int N, const float* __restrict__ logits_tm1,
                const int32_t* __restrict__ a_tm1, const float* __restrict__ r_t,
                const float* __restrict__ discount_t, const float* __restrict__ target,
                const float* __restrict__ online, const float* __restrict__ support,
                float* __restrict__ loss, float* __restrict__ delta_out) {
  extern __shared__ float smem[];  // [nwarps][2N] (p, b) then [D] branch losses
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t s = blockIdx.x;  // flattened (v, b)
  const int64_t v = s / B;
  float* sp = smem + warp * 2 * N;
  float* sb = sp + N;
  float* sloss = smem + nwarps * 2 * N;

  const float* z = support + v * N;
  float zr[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = lane + 32 * k;
    zr[k] = i < N ? z[i] : 0.f;
  }
  const float vmin = z[0], vmax = z[N - 1];
  const float dz = (vmax - vmin) / static_cast<float>(N - 1);
  const float r = r_t[s], disc = discount_t[s];

  for (int d = warp; d < D; d += nwarps) {
    const int64_t base = (s * D + d) * static_cast<int64_t>(A) * N;
    // Double-DQN action selection from the online logits.
    int best_a = 0;
    float best_q = 0.f;
    for (int a = 0; a < A; ++a) {
      float e[K], sh[K];
      const float se = RowExp<K>(online + base + static_cast<int64_t>(a) * N, N, lane, e, sh);
      float q = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) q += (e[k] / se) * zr[k];
      q = WarpSum(q);
      if (a == 0 || (!isnan(best_q) && (isnan(q) || q > best_q))) {
        best_q = q;
        best_a = a;
      }
    }
    // Target distribution and the projected atoms.
    {
      float e[K], sh[K];
      const float se = RowExp<K>(target + base + static_cast<int64_t>(best_a) * N, N, lane, e, sh);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = lane + 32 * k;
        if (i < N) {
          const float tz = fminf(fmaxf(r + disc * zr[k], vmin), vmax);
          sp[i] = e[k] / se;
          sb[i] = fminf(fmaxf((tz - vmin) / dz, 0.f), static_cast<float>(N - 1));
        }
      }
    }
    __syncwarp();
    float m[K];
#pragma unroll
    for (int k = 0; k < K; ++k) m[k] = 0.f;
    for (int j = 0; j < N; ++j) {
      const float bj = sb[j], pj = sp[j];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float w = fminf(fmaxf(1.f - fabsf(bj - static_cast<float>(lane + 32 * k)), 0.f), 1.f);
        m[k] += w * pj;
      }
    }
    // Cross-entropy against log_softmax of the taken action's logits.
    int at = a_tm1[s * D + d];
    at = at < 0 ? 0 : (at >= A ? A - 1 : at);
    float e[K], sh[K];
    const float se = RowExp<K>(logits_tm1 + base + static_cast<int64_t>(at) * N, N, lane, e, sh);
    const float lse = logf(se);
    float ce = 0.f, msum = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = lane + 32 * k;
      if (i < N) {
        ce += m[k] * (sh[k] - lse);
        msum += m[k];
      }
    }
    ce = WarpSum(ce);
    if (lane == 0) sloss[d] = -ce;
    if (delta_out != nullptr) {
      msum = WarpSum(msum);
      float* drow = delta_out + base;
      for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int i = lane + 32 * k;
          if (i < N) drow[static_cast<int64_t>(a) * N + i] = a == at ? (e[k] / se) * msum - m[k] : 0.f;
        }
      }
    }
    __syncwarp();  // sp/sb are rewritten by this warp's next branch
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += sloss[d];
    loss[s] = acc / static_cast<float>(D);
  }
}

template <int K>
ffi::Error Launch(cudaStream_t stream, int64_t S, int64_t B, int D, int A, int N, const float* lt,
                  const int32_t* at, const float* r, const float* disc, const float* tgt, const float* onl,
                  const float* z, float* loss, float* delta) {
  const int nwarps = D < kMaxWarps ? D : kMaxWarps;
  const size_t smem = sizeof(float) * (static_cast<size_t>(nwarps) * 2 * N + D);
  JAXFOX_RETURN_IF_ERROR(PrepareSmem("c51_loss", &c51_loss_kernel<K>, static_cast<int64_t>(smem)));
  c51_loss_kernel<K><<<static_cast<unsigned>(S), nwarps * 32, smem, stream>>>(B, D, A, N, lt, at, r, disc, tgt,
                                                                              onl, z, loss, delta);
  return LastCudaError("c51_loss");
}

}  // namespace

// FFI target jaxfox_c51_loss. Operands (leading vmap dims V allowed, the same on all):
// logits_tm1, logits_t_target, logits_t_online [V.., B, D, A, N] f32; a_tm1 [V.., B, D] s32;
// r_t, discount_t [V.., B] f32; support [V.., N] f32. Results: loss [V.., B]; delta [V.., B, D, A, N]
// (or 0 elements when the gradient is not wanted).
static ffi::Error C51LossImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits_tm1, ffi::Buffer<ffi::S32> a_tm1,
                              ffi::Buffer<ffi::F32> r_t, ffi::Buffer<ffi::F32> discount_t,
                              ffi::Buffer<ffi::F32> target, ffi::Buffer<ffi::F32> online,
                              ffi::Buffer<ffi::F32> support, ffi::ResultBuffer<ffi::F32> loss,
                              ffi::ResultBuffer<ffi::F32> delta) {
  ClearStaleCudaError();
  auto dims = logits_tm1.dimensions();
  if (dims.size() < 4) {
    return InvalidArgument("c51_loss: logits_tm1 must be [..., B, D, A, N], got " + DimsToString(dims));
  }
  const size_t r0 = dims.size() - 4;
  const int64_t B = dims[r0], D = dims[r0 + 1], A = dims[r0 + 2], N = dims[r0 + 3];
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(logits_tm1, "logits_tm1", {B, D, A, N}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(target, "logits_t_target", {B, D, A, N}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(online, "logits_t_online", {B, D, A, N}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(a_tm1, "a_tm1", {B, D}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(r_t, "r_t", {B}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(discount_t, "discount_t", {B}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(support, "support", {N}, &V));
  const int64_t S = V * B;
  if (static_cast<int64_t>(loss->element_count()) != S) {
    return InvalidArgument("c51_loss: loss has " + std::to_string(loss->element_count()) + " elements, expected " +
                           std::to_string(S));
  }
  const int64_t nd = static_cast<int64_t>(delta->element_count());
  if (nd != 0 && nd != S * D * A * N) {
    return InvalidArgument("c51_loss: delta has " + std::to_string(nd) + " elements, expected 0 or " +
                           std::to_string(S * D * A * N));
  }
  if (S == 0) return ffi::Error::Success();
  if (D < 1 || A < 1 || N < 2 || N > 1024 || D > 65536 || S > 0x7fffffff) {
    return InvalidArgument("c51_loss: unsupported sizes D = " + std::to_string(D) + ", A = " + std::to_string(A) +
                           ", N = " + std::to_string(N) + " (need D, A >= 1, 2 <= N <= 1024), V * B = " +
                           std::to_string(S));
  }
  const float *lt = logits_tm1.typed_data(), *r = r_t.typed_data(), *disc = discount_t.typed_data(),
              *tg = target.typed_data(), *on = online.typed_data(), *z = support.typed_data();
  const int32_t* at = a_tm1.typed_data();
  float* lo = loss->typed_data();
  float* de = nd ? delta->typed_data() : nullptr;
  const int d = static_cast<int>(D), a = static_cast<int>(A), n = static_cast<int>(N);
  const int K = static_cast<int>(CeilDiv(N, 32));
  if (K <= 1) return Launch<1>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
  if (K <= 2) return Launch<2>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
  if (K <= 4) return Launch<4>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
  if (K <= 8) return Launch<8>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
  if (K <= 16) return Launch<16>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
  return Launch<32>(stream, S, B, d, a, n, lt, at, r, disc, tg, on, z, lo, de);
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_c51_loss, jaxfox::C51LossImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // logits_tm1
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // a_tm1
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // r_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // discount_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // logits_t_target
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // logits_t_online
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // support
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // loss
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(), // delta (or 0 elements)
                              {xla::ffi::Traits::kCmdBufferCompatible});
