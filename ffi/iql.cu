// iql: the value loss of Implicit Q-Learning for an ensemble of G value networks D -> H -> 1 (ReLU) that share
// their input, with its parameter gradient, in ONE kernel (FFI target jaxfox_iql_value_loss). Math and
// conventions: jaxfox/iql.py (Kostrikov et al. 2021, eq. 5; OPS.md "Losses", expectile).
//
// Per network g and row b (of B), x = obs[b], y = target[b]:
//   p = x W1_g + b1_g  [H],  h = ReLU(p),  v = h . w2_g + b2_g,  u = y - v,  w = |tau_g - 1{u < 0}|
//   loss_g = (1/B) sum_b w u^2
// and the gradient of loss_g (network g's parameters enter only loss_g):
//   dv = -(2/B) w u,  dh = dv w2_g (p > 0)
//   dW1_g = x^T dh,  db1_g = sum_b dh,  dw2_g = sum_b h dv,  db2_g = sum_b dv,  dy[g, b] = -dv = d loss_g / d y_b
// Products on the tensor cores (mma.sync m16n8k8, TF32, float32 accumulation: what XLA does for float32 matmuls at
// the default precision), the operands rounded to nearest TF32 in shared memory (W1 once, every x tile after it
// arrives, dh when written); everything else float32.
//
// Grid (S, G) of 256 threads. CTA (s, g) stages W1_g in shared memory once, then walks over the 32-row tiles
// s, s + S, s + 2 S, ... with the next tile's x copied in (cp.async, double buffer) while the current one computes:
// p = x W1_g with warp w summing inputs [w / 4 * D / 2, + D / 2) for all 32 rows x H / 4 columns (the upper
// half's sums handed to the lower half's warps through shared memory), an epilogue for v, u, the loss and dv
// (row sums of the 4 column warps through shared memory), dh (TF32) to shared memory, and dW1_g += x^T dh
// accumulated in registers over the CTA's tiles (each warp a 64 x 64 block of [D, H] when D = 256, H = 128). At
// the end the CTA writes its partial row [dW1_g (D H, as W1's [d][h]) | db1_g (H) | dw2_g (H) | db2_g | loss_g | 0 0]
// with coalesced stores (staged in the freed W1 buffer), and LaunchReduceAxis0 sums the S partials of every network
// in a fixed order in the same handler: no atomics, and the result's bits depend only on the shapes (S is a
// function of them, chosen by jaxfox/iql.py), not the device.
// No [B, H] activation goes to global memory; obs is read once per network.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.h"
#include "tensor_core.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 32;  // rows per tile (jaxfox/iql.py _TILE_ROWS)
static_assert(kThreads / 32 == kMmaWarps, "WarpTile assumes 8 warps");

// Shared-memory layout (floats) of one (D, H) instantiation; every region and row starts at a multiple of 4
// floats (16-byte cp.async destinations). Row strides: x rows D + 4 (= 4 mod 32: the row-major A fragments of
// x W1 are conflict-free; the transposed reads of x^T dh have 2-way conflicts), W1 and dh rows H + 8 (= 8 mod
// 32: conflict-free row-major B fragments).
template <int D, int H>
struct Layout {
  static constexpr int kLX = D + 4;
  static constexpr int kLW = H + 8;
  static constexpr int kW1 = 0;                        // W1_g [D][kLW], TF32
  static constexpr int kX = kW1 + D * kLW;             // x tiles [2][kRows][kLX], TF32 after arrival
  static constexpr int kDh = kX + 2 * kRows * kLX;     // dh [kRows][kLW], TF32
  static constexpr int kB1 = kDh + kRows * kLW;        // b1_g [H]
  static constexpr int kW2 = kB1 + H;                  // w2_g [H]
  static constexpr int kVs = kW2 + H;                  // the 4 column warps' partial row sums of h w2 [4][kRows]
  static constexpr int kDv = kVs + 4 * kRows;          // dv of the tile's rows [kRows]
  static constexpr int kRed = kDv + kRows;             // end: db1, dw2 [2][H]
  static constexpr int kTotal = kRed + 2 * H;
  static constexpr int kP = D * H + 2 * H + 4;         // partial row, 2 floats of padding (16-byte rows)
  static_assert(kX % 4 == 0 && kDh % 4 == 0 && kB1 % 4 == 0, "regions must be 16-byte aligned");
};

// Rows [row0, row0 + kRows) of obs [B, D] into dst [kRows][kLX] (zeros for rows >= B), asynchronously.
template <int D, int H>
__device__ __forceinline__ void LoadX(float* dst, const float* __restrict__ obs, int64_t row0, int64_t B) {
  using S = Layout<D, H>;
  constexpr int kVec = D / 4;
  for (int e = threadIdx.x; e < kRows * kVec; e += kThreads) {
    const int r = e / kVec, c = 4 * (e - r * kVec);
    const int64_t row = row0 + r;
    const bool ok = row < B;
    CpAsync16(dst + r * S::kLX + c, ok ? obs + row * D + c : obs, ok);
  }
}

// In-place TF32 rounding (to nearest) of `rows` rows of `len` floats (row stride ld) at p.
__device__ __forceinline__ void RoundRows(float* p, int rows, int len, int ld) {
  const int per = len / 4;
  for (int e = threadIdx.x; e < rows * per; e += kThreads) {
    const int r = e / per, c = 4 * (e - r * per);
    float4* q = reinterpret_cast<float4*>(p + r * ld + c);
    float4 v = *q;
    v.x = Tf32(v.x); v.y = Tf32(v.y); v.z = Tf32(v.z); v.w = Tf32(v.w);
    *q = v;
  }
}

template <int D, int H>
__global__ void __launch_bounds__(kThreads, 1)
    iql_value_loss_kernel(const float* __restrict__ obs, const float* __restrict__ target,
                          const float* __restrict__ w1, const float* __restrict__ b1, const float* __restrict__ w2,
                          const float* __restrict__ b2, const float* __restrict__ taus, int B, int tiles,
                          float inv_b, float* __restrict__ dy, float* __restrict__ part) {
  using S = Layout<D, H>;
  constexpr int kPFC = H / 64;                  // p = x W1 [kRows, H]: warp w holds all rows x 16 kPFC columns,
                                                // over half of the K = D inputs (w / 4); the halves meet in shared memory
  using WT = WarpTile<D / 16, H / 16, 2>;       // dW1 = x^T dh: [D, H], 2 column warps
  constexpr int kLX = S::kLX, kLW = S::kLW;
  extern __shared__ __align__(128) float sm[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = blockIdx.y, splits = gridDim.x;
  const int qg = lane >> 2, qt = lane & 3;      // the MMA fragments' lane coordinates (g, t)

  const float* w1g = w1 + static_cast<int64_t>(g) * D * H;
  for (int e = tid; e < D * (H / 4); e += kThreads) {
    const int k = e / (H / 4), c = 4 * (e - k * (H / 4));
    CpAsync16(sm + S::kW1 + k * kLW + c, w1g + k * H + c, true);
  }
  for (int j = tid; j < H; j += kThreads) {
    sm[S::kB1 + j] = b1[g * H + j];
    sm[S::kW2 + j] = w2[g * H + j];
  }
  const float tau = taus[g], b2g = b2[g];
  int t = blockIdx.x;
  if (t < tiles) LoadX<D, H>(sm + S::kX, obs, static_cast<int64_t>(t) * kRows, B);
  CpAsyncCommit();

  Frags<WT::kFR, WT::kFC> acc_w;  // dW1 partial of the warp's [64 x 64] (D = 256, H = 128) block
  acc_w.Zero();
  float acc_db1[2 * kPFC][2], acc_dw2[2 * kPFC][2];  // the thread's columns, summed over its rows (warps 0-3)
#pragma unroll
  for (int j = 0; j < 2 * kPFC; ++j) acc_db1[j][0] = acc_db1[j][1] = acc_dw2[j][0] = acc_dw2[j][1] = 0.f;
  float acc_loss = 0.f, acc_db2 = 0.f;  // warp 0: the rows' loss and dv sums
  const int khalf = warp >> 2, pcw = warp & 3, pc0 = pcw * kPFC;
  const int wr0 = WT::Row0(warp), wc0 = WT::Col0(warp);

  for (int it = 0; t < tiles; ++it, t += splits) {
    float* x = sm + S::kX + (it & 1) * kRows * kLX;
    const int64_t row0 = static_cast<int64_t>(t) * kRows;
    const int tn = t + splits;
    if (tn < tiles) {  // the next tile's x into the other buffer (its last reader was the previous tile's dW1)
      LoadX<D, H>(sm + S::kX + ((it + 1) & 1) * kRows * kLX, obs, static_cast<int64_t>(tn) * kRows, B);
      CpAsyncCommit();
      CpAsyncWaitGroup<1>();
    } else {
      CpAsyncWaitGroup<0>();
    }
    float y = 0.f;
    if (warp == 0 && row0 + lane < B) y = __ldg(target + row0 + lane);
    __syncthreads();
    if (it == 0) RoundRows(sm + S::kW1, D, H, kLW);
    RoundRows(x, kRows, D, kLX);  // truncating obs instead (tensor cores ignore the low bits) biased the loss 80x
    __syncthreads();              // more than XLA's TF32 error on the H200

    // p = x W1_g (+ b1): warp w sums inputs [w / 4 * D / 2, + D / 2) for all rows x its 16 kPFC columns; the
    // upper half's warps hand their sums to the lower half's through the dh buffer (free until the dh step).
    Frags<2, kPFC> acc_p;
    acc_p.Zero();
    WarpMma<2, kPFC, true, true>(acc_p, x + khalf * (D / 2), kLX, sm + S::kW1 + khalf * (D / 2) * kLW, kLW, 0,
                                 pc0, D / 16, kRows / 16, lane);
    if (khalf == 1) StoreRows(sm + S::kDh, kLW, acc_p, 0, pc0, kRows / 16, lane);
    __syncthreads();
    if (khalf == 0) {
      float vpart[4] = {0.f, 0.f, 0.f, 0.f};  // rows qg + 8 m
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2 * kPFC; ++j) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int row = 16 * i + qg + 8 * (q >> 1), col = 16 * pc0 + 8 * j + 2 * qt + (q & 1);
            acc_p.c[i][j][q] = (acc_p.c[i][j][q] + sm[S::kDh + row * kLW + col]) + sm[S::kB1 + col];
            vpart[2 * i + (q >> 1)] = fmaf(Relu(acc_p.c[i][j][q]), sm[S::kW2 + col], vpart[2 * i + (q >> 1)]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        vpart[m] += __shfl_xor_sync(0xffffffffu, vpart[m], 1);
        vpart[m] += __shfl_xor_sync(0xffffffffu, vpart[m], 2);
        if (qt == 0) sm[S::kVs + pcw * kRows + qg + 8 * m] = vpart[m];
      }
    }
    __syncthreads();
    if (warp == 0) {  // row `lane` of the tile: v, u, the loss and dv
      const int64_t row = row0 + lane;
      const float* vs = sm + S::kVs + lane;
      const float v = (((vs[0] + vs[kRows]) + vs[2 * kRows]) + vs[3 * kRows]) + b2g;
      const float u = y - v;
      const float wgt = u < 0.f ? 1.f - tau : tau;
      const bool ok = row < B;
      const float dv = ok ? -2.f * wgt * u * inv_b : 0.f;
      sm[S::kDv + lane] = dv;
      if (ok) {
        acc_loss = fmaf(wgt * u, u, acc_loss);
        acc_db2 += dv;
        dy[static_cast<int64_t>(g) * B + row] = -dv;
      }
    }
    __syncthreads();

    // dh = dv w2 (p > 0) into shared memory (TF32, over the upper half's sums: each thread rewrites the elements
    // it read) and the bias / w2 column sums.
    if (khalf == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = 16 * i + qg;
        const float dv0 = sm[S::kDv + r], dv1 = sm[S::kDv + r + 8];
#pragma unroll
        for (int j = 0; j < 2 * kPFC; ++j) {
          const int col = 16 * pc0 + 8 * j + 2 * qt;
          float dh[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float p = acc_p.c[i][j][q], dvr = q < 2 ? dv0 : dv1;
            dh[q] = p > 0.f ? dvr * sm[S::kW2 + col + (q & 1)] : 0.f;
            acc_db1[j][q & 1] += dh[q];
            acc_dw2[j][q & 1] = fmaf(Relu(p), dvr, acc_dw2[j][q & 1]);
          }
          *reinterpret_cast<float2*>(sm + S::kDh + r * kLW + col) = make_float2(Tf32(dh[0]), Tf32(dh[1]));
          *reinterpret_cast<float2*>(sm + S::kDh + (r + 8) * kLW + col) = make_float2(Tf32(dh[2]), Tf32(dh[3]));
        }
      }
    }
    __syncthreads();

    // dW1_g += x^T dh: A(d, b) = x[b][d] (column-major A), B(b, h) = dh[b][h] (row-major B), K = the tile's rows.
    WarpMma<WT::kFR, WT::kFC, false, true>(acc_w, x, kLX, sm + S::kDh, kLW, wr0, wc0, kRows / 8, D / 16, lane);
    __syncthreads();  // dh, the row sums and this x buffer are rewritten by the next tiles
  }

  // The CTA's partial row. dW1: the C fragments (row d, column h) staged as W1's [d][h] in the W1 region (no
  // longer read), then copied out with coalesced 16-byte stores.
  float* out = part + (static_cast<int64_t>(blockIdx.x) * gridDim.y + g) * S::kP;
  StoreRows(sm + S::kW1, kLW, acc_w, wr0, wc0, D / 16, lane);
  // db1, dw2: warps 0-3 sum the thread's columns over the 8 lanes of the same t (rows); each column has one warp.
  if (khalf == 0) {
#pragma unroll
    for (int j = 0; j < 2 * kPFC; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          acc_db1[j][e] += __shfl_xor_sync(0xffffffffu, acc_db1[j][e], o);
          acc_dw2[j][e] += __shfl_xor_sync(0xffffffffu, acc_dw2[j][e], o);
        }
        if (qg == 0) {
          const int col = 16 * pc0 + 8 * j + 2 * qt + e;
          sm[S::kRed + col] = acc_db1[j][e];
          sm[S::kRed + H + col] = acc_dw2[j][e];
        }
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < D * (H / 4); e += kThreads) {
    const int k = e / (H / 4), c = 4 * (e - k * (H / 4));
    *reinterpret_cast<float4*>(out + k * H + c) = *reinterpret_cast<const float4*>(sm + S::kW1 + k * kLW + c);
  }
  for (int j = tid; j < 2 * H; j += kThreads) out[D * H + j] = sm[S::kRed + j];
  if (warp == 0) {
    const float db2 = WarpSum(acc_db2), loss = WarpSum(acc_loss);
    if (lane == 0) {
      out[D * H + 2 * H] = db2;
      out[D * H + 2 * H + 1] = loss * inv_b;
      out[D * H + 2 * H + 2] = out[D * H + 2 * H + 3] = 0.f;
    }
  }
}

// Calls f(integral_constant D, integral_constant H) for the instantiated shapes (jaxfox/iql.py _KERNEL_D/_H).
template <typename F>
ffi::Error ByShape(int64_t D, int64_t H, F&& f) {
  auto with_h = [&](auto dc) -> ffi::Error {
    if (H == 64) return f(dc, std::integral_constant<int, 64>{});
    if (H == 128) return f(dc, std::integral_constant<int, 128>{});
    return InvalidArgument("iql_value_loss: no kernel for hidden = " + std::to_string(H) + " (kernels: 64, 128)");
  };
  if (D == 64) return with_h(std::integral_constant<int, 64>{});
  if (D == 128) return with_h(std::integral_constant<int, 128>{});
  if (D == 256) return with_h(std::integral_constant<int, 256>{});
  return InvalidArgument("iql_value_loss: no kernel for obs_dim = " + std::to_string(D) +
                         " (kernels: 64, 128, 256)");
}

// FFI target jaxfox_iql_value_loss: (obs [B, D], target [B], w1 [G, D, H], b1 [G, H], w2 [G, H], b2 [G],
// taus [G]) -> grads [G, P] (each network's reduced partial row, P = D H + 2 H + 4), dy [G, B], and the
// workspaces partials [S, G, P] and chunk partials [chunks * G * P] (or [0]); the loss is at D H + 2 H + 1; attrs inv_batch = 1 / B, and
// chunks (jaxfox.reduce.reduce_chunks(S, G P)). S, the grid's splits of the row tiles, is the partials' first dim.
ffi::Error IqlValueLossImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> obs, ffi::Buffer<ffi::F32> target,
                            ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> b1, ffi::Buffer<ffi::F32> w2,
                            ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> taus, float inv_batch, int64_t chunks,
                            ffi::ResultBuffer<ffi::F32> grads, ffi::ResultBuffer<ffi::F32> dy,
                            ffi::ResultBuffer<ffi::F32> part, ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  if (obs.dimensions().size() != 2 || w1.dimensions().size() != 3) {
    return InvalidArgument("iql_value_loss: expected obs [B, D] and w1 [G, D, H], got obs " +
                           DimsToString(obs.dimensions()) + ", w1 " + DimsToString(w1.dimensions()));
  }
  const int64_t B = obs.dimensions()[0], D = obs.dimensions()[1];
  const int64_t G = w1.dimensions()[0], H = w1.dimensions()[2];
  return ByShape(D, H, [&](auto dc, auto hc) -> ffi::Error {
    constexpr int kD = decltype(dc)::value, kH = decltype(hc)::value;
    using S = Layout<kD, kH>;
    auto wrong = [](const char* what, const auto& buf) {
      return InvalidArgument(std::string("iql_value_loss: ") + what + ", got " + DimsToString(buf.dimensions()));
    };
    if (!HasShape(w1, {G, kD, kH})) return wrong("w1 must be [G, D, H]", w1);
    if (!HasShape(target, {B})) return wrong("target must be [B]", target);
    if (!HasShape(b1, {G, kH})) return wrong("b1 must be [G, H]", b1);
    if (!HasShape(w2, {G, kH})) return wrong("w2 must be [G, H]", w2);
    if (!HasShape(b2, {G})) return wrong("b2 must be [G]", b2);
    if (!HasShape(taus, {G})) return wrong("taus must be [G]", taus);
    if (!HasShape(*grads, {G, S::kP})) return wrong("grads must be [G, D H + 2 H + 4]", *grads);
    if (!HasShape(*dy, {G, B})) return wrong("dy must be [G, B]", *dy);
    if (G < 1 || G > 65535) return InvalidArgument("iql_value_loss: G must be in [1, 65535]");
    if (B < 1 || B > 0x7fffffff - kRows) return InvalidArgument("iql_value_loss: B must be in [1, 2^31 - 33]");
    const int64_t tiles = CeilDiv(B, kRows);
    if (part->dimensions().size() != 3 || !HasShape(*part, {part->dimensions()[0], G, S::kP})) {
      return wrong("partials workspace must be [S, G, P]", *part);
    }
    const int64_t splits = part->dimensions()[0];
    if (splits < 1 || splits > tiles || splits > 0x7fffffff) {
      return InvalidArgument("iql_value_loss: the partials' first dim S must be in [1, tiles = " +
                             std::to_string(tiles) + "], got " + std::to_string(splits));
    }
    if (chunks < 1 || chunks > splits) return InvalidArgument("iql_value_loss: chunks must be in [1, S]");
    const int64_t need = chunks > 1 ? chunks * G * S::kP : 0;
    if (static_cast<int64_t>(ws->element_count()) < need) {
      return InvalidArgument("iql_value_loss: workspace has " + std::to_string(ws->element_count()) +
                             " elements, needs " + std::to_string(need));
    }
    auto kernel = iql_value_loss_kernel<kD, kH>;
    const int64_t bytes = int64_t{S::kTotal} * 4;
    JAXFOX_RETURN_IF_ERROR(PrepareSmem("iql_value_loss", kernel, bytes));
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(G));
    kernel<<<grid, kThreads, bytes, stream>>>(obs.typed_data(), target.typed_data(), w1.typed_data(),
                                              b1.typed_data(), w2.typed_data(), b2.typed_data(), taus.typed_data(),
                                              static_cast<int>(B), static_cast<int>(tiles), inv_batch,
                                              dy->typed_data(), part->typed_data());
    JAXFOX_RETURN_IF_ERROR(LastCudaError("iql_value_loss"));
    return LaunchReduceAxis0(stream, part->typed_data(), 1, splits, G * S::kP, chunks,
                             chunks > 1 ? ws->typed_data() : nullptr, grads->typed_data());
  });
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iql_value_loss, jaxfox::IqlValueLossImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // obs [B, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // target [B]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w1 [G, D, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b1 [G, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w2 [G, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b2 [G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // taus [G]
                                  .Attr<float>("inv_batch")
                                  .Attr<int64_t>("chunks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // grads [G, P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dy [G, B]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: partials [S, G, P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
