// iql: the value loss of Implicit Q-Learning for an ensemble of G value networks D -> H -> 1 (ReLU) that share
// their input, between XLA's two products (FFI target jaxfox_iql_head). Math and conventions: jaxfox/iql.py
// (Kostrikov et al. 2021, eq. 5; OPS.md "Losses", expectile).
//
// XLA runs pre = obs [W1_1 | .. | W1_G] (one [B, D] x [D, G H] GEMM) and, by autodiff, dW1 = obs^T dpre (and
// d obs = dpre W1^T); this kernel everything between them. Per row b and network g, with y = target[b] and
// p = pre[b, g H + .] + b1_g:
//   h = ReLU(p), v = h . w2_g + b2_g, u = y - v, w = |tau_g - 1{u < 0}|, loss_g = (1/B) sum_b w u^2,
//   dv = -(2/B) w u, dpre[b, g H + .] = dv w2_g (p > 0), dy[g, b] = -dv = d loss_g / d y_b,
// and the parameter-gradient sums db1_g = sum_b dpre, dw2_g = sum_b h dv, db2_g = sum_b dv.
// Grid (S, G) of 8 warps; CTA (s, g) walks over the 32-row tiles s, s + S, ...; a warp takes 4 consecutive rows
// of a tile (all loaded before any is used), one row at a time across its 32 lanes (lane l: columns 4 l + 128 j,
// float4 loads and stores). The warps' column sums meet in shared memory in warp order, each CTA writes its
// partial row [db1 | dw2 | db2 | loss | 0 0], and iql_finish_kernel sums the S partial rows of every network in a
// fixed order and writes db1, dw2, db2 and loss as separate results (no slicing left to XLA), in the same handler:
// no atomics, the bits depend on the shapes only (S is a function of them, chosen by jaxfox/iql.py). All float32:
// the products (and their TF32 rounding) are XLA's.
// (It replaces a kernel that also ran both products on mma.sync, with the weight gradient accumulated in
// registers: 0.89x XLA on the H200; XLA's GEMMs were faster than its products. BENCHMARKS.md, thirty-fifth session.)
#include <cstdint>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeadRows = 4;                  // rows a warp takes from a tile
constexpr int kHeadTile = kWarps * kHeadRows;  // rows of a tile (jaxfox/iql.py _HEAD_TILE)

__device__ __forceinline__ float4 Ld4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

template <int KH>  // float4 columns a lane holds of a row: H <= 128 KH
__global__ void __launch_bounds__(kThreads, KH == 1 ? 3 : 1)
    iql_head_kernel(const float* __restrict__ pre, const float* __restrict__ target, const float* __restrict__ b1,
                    const float* __restrict__ w2, const float* __restrict__ b2, const float* __restrict__ taus,
                    int64_t B, int H, int tiles, float inv_b, float* __restrict__ dpre, float* __restrict__ dy,
                    float* __restrict__ part) {
  __shared__ __align__(16) float red[kWarps][2 * 128 * KH + 4];  // rows of 16-byte multiples (float4 stores)
  const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ld = static_cast<int64_t>(gridDim.y) * H;  // row stride of pre and dpre
  const int64_t col0 = static_cast<int64_t>(g) * H;
  float4 bb[KH], ww[KH], a_db1[KH], a_dw2[KH];
  bool on[KH];
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < KH; ++j) {
    const int c = 4 * lane + 128 * j;
    on[j] = c < H;
    bb[j] = on[j] ? Ld4(b1 + col0 + c) : zero;
    ww[j] = on[j] ? Ld4(w2 + col0 + c) : zero;
    a_db1[j] = a_dw2[j] = zero;
  }
  const float tau = taus[g], b2g = b2[g];
  float a_db2 = 0.f, a_loss = 0.f;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = static_cast<int64_t>(t) * kHeadTile + warp * kHeadRows;
    float4 p[kHeadRows][KH];
    float y[kHeadRows];
#pragma unroll
    for (int i = 0; i < kHeadRows; ++i) {
      const bool ok = r0 + i < B;
      y[i] = ok ? __ldg(target + r0 + i) : 0.f;
#pragma unroll
      for (int j = 0; j < KH; ++j) p[i][j] = ok && on[j] ? Ld4(pre + (r0 + i) * ld + col0 + 4 * lane + 128 * j) : zero;
    }
#pragma unroll
    for (int i = 0; i < kHeadRows; ++i) {
      const int64_t row = r0 + i;
      if (row >= B) break;  // warp-uniform
      float4 h[KH];
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < KH; ++j) {
        float4& q = p[i][j];
        q.x += bb[j].x; q.y += bb[j].y; q.z += bb[j].z; q.w += bb[j].w;
        h[j] = make_float4(Relu(q.x), Relu(q.y), Relu(q.z), Relu(q.w));
        s = fmaf(h[j].x, ww[j].x, s);
        s = fmaf(h[j].y, ww[j].y, s);
        s = fmaf(h[j].z, ww[j].z, s);
        s = fmaf(h[j].w, ww[j].w, s);
      }
      const float v = WarpSum(s) + b2g;  // the same bits in every lane (butterfly)
      const float u = y[i] - v;
      const float wgt = u < 0.f ? 1.f - tau : tau;
      const float dv = -2.f * wgt * u * inv_b;
      a_loss = fmaf(wgt * u, u, a_loss);
      a_db2 += dv;
      if (lane == 0) dy[static_cast<int64_t>(g) * B + row] = -dv;
#pragma unroll
      for (int j = 0; j < KH; ++j) {
        if (!on[j]) continue;
        const float4& q = p[i][j];
        const float4 d = make_float4(q.x > 0.f ? dv * ww[j].x : 0.f, q.y > 0.f ? dv * ww[j].y : 0.f,
                                     q.z > 0.f ? dv * ww[j].z : 0.f, q.w > 0.f ? dv * ww[j].w : 0.f);
        *reinterpret_cast<float4*>(dpre + row * ld + col0 + 4 * lane + 128 * j) = d;
        a_db1[j].x += d.x; a_db1[j].y += d.y; a_db1[j].z += d.z; a_db1[j].w += d.w;
        a_dw2[j].x = fmaf(h[j].x, dv, a_dw2[j].x);
        a_dw2[j].y = fmaf(h[j].y, dv, a_dw2[j].y);
        a_dw2[j].z = fmaf(h[j].z, dv, a_dw2[j].z);
        a_dw2[j].w = fmaf(h[j].w, dv, a_dw2[j].w);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < KH; ++j) {
    const int c = 4 * lane + 128 * j;
    if (!on[j]) continue;
    *reinterpret_cast<float4*>(&red[warp][c]) = a_db1[j];
    *reinterpret_cast<float4*>(&red[warp][H + c]) = a_dw2[j];
  }
  if (lane == 0) {
    red[warp][2 * H] = a_db2;
    red[warp][2 * H + 1] = a_loss;
  }
  __syncthreads();
  const int P = 2 * H + 4;
  float* out = part + (static_cast<int64_t>(blockIdx.x) * gridDim.y + g) * P;
  for (int e = threadIdx.x; e < P; e += kThreads) {
    float v = 0.f;
    if (e < 2 * H + 2) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += red[w][e];
      if (e == 2 * H + 1) v *= inv_b;
    }
    out[e] = v;
  }
}

// The S partial rows of every network summed in a fixed order (FixedOrderColumnSum, ffi/common.h: rows s = r,
// r + 32, ... by thread row r, then the 32 row sums in order r = 0 .. 31) and scattered into the outputs: db1 [G, H],
// dw2 [G, H], db2 [G] and loss [G]. A 32 x 32 block takes 32 consecutive columns of the [S, G P] partials.
__global__ void __launch_bounds__(32 * kSumRows)
    iql_finish_kernel(const float* __restrict__ part, int S, int G, int H, float* __restrict__ db1,
                      float* __restrict__ dw2, float* __restrict__ db2, float* __restrict__ loss) {
  const int P = 2 * H + 4;
  const int64_t C = static_cast<int64_t>(G) * P, col = static_cast<int64_t>(blockIdx.x) * 32 + (threadIdx.x & 31);
  float t;
  if (!FixedOrderColumnSum(part, S, C, col, &t)) return;
  const int g = static_cast<int>(col / P), e = static_cast<int>(col % P);
  if (e < H) {
    db1[static_cast<int64_t>(g) * H + e] = t;
  } else if (e < 2 * H) {
    dw2[static_cast<int64_t>(g) * H + e - H] = t;
  } else if (e == 2 * H) {
    db2[g] = t;
  } else if (e == 2 * H + 1) {
    loss[g] = t;
  }
}

// FFI target jaxfox_iql_head: (pre [B, G H] = obs [W1_1 | .. | W1_G] without the bias, target [B], b1 [G, H],
// w2 [G, H], b2 [G], taus [G]) -> db1 [G, H], dw2 [G, H], db2 [G], loss [G] (the column sums of every network,
// the loss already divided by B), dpre [B, G H], dy [G, B], and the workspace partials [S, G, P] (P = 2 H + 4: each
// block's row [db1 | dw2 | db2 | loss | 0 0]); attr inv_batch = 1 / B. S (the grid's splits of the 32-row tiles) is
// the partials' first dim. Two launches: the head kernel and the fixed-order sum of its partial rows.
ffi::Error IqlHeadImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> pre, ffi::Buffer<ffi::F32> target,
                       ffi::Buffer<ffi::F32> b1, ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> b2,
                       ffi::Buffer<ffi::F32> taus, float inv_batch, ffi::ResultBuffer<ffi::F32> db1,
                       ffi::ResultBuffer<ffi::F32> dw2, ffi::ResultBuffer<ffi::F32> db2,
                       ffi::ResultBuffer<ffi::F32> loss, ffi::ResultBuffer<ffi::F32> dpre,
                       ffi::ResultBuffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> part) {
  ClearStaleCudaError();
  auto wrong = [](const char* what, const auto& buf) {
    return InvalidArgument(std::string("iql_head: ") + what + ", got " + DimsToString(buf.dimensions()));
  };
  if (b1.dimensions().size() != 2) return wrong("b1 must be [G, H]", b1);
  if (pre.dimensions().size() != 2) return wrong("pre must be [B, G H]", pre);
  const int64_t G = b1.dimensions()[0], H = b1.dimensions()[1], B = pre.dimensions()[0];
  if (G < 1 || G > 65535) return InvalidArgument("iql_head: G must be in [1, 65535], got " + std::to_string(G));
  if (H < 4 || H > 512 || H % 4 != 0) {
    return InvalidArgument("iql_head: H must be a multiple of 4 in [4, 512], got " + std::to_string(H));
  }
  if (B < 1 || B > 0x7fffffff - kHeadTile) return InvalidArgument("iql_head: B must be in [1, 2^31 - 33]");
  const int64_t P = 2 * H + 4;
  if (!HasShape(pre, {B, G * H})) return wrong("pre must be [B, G H]", pre);
  if (!HasShape(target, {B})) return wrong("target must be [B]", target);
  if (!HasShape(w2, {G, H})) return wrong("w2 must be [G, H]", w2);
  if (!HasShape(b2, {G})) return wrong("b2 must be [G]", b2);
  if (!HasShape(taus, {G})) return wrong("taus must be [G]", taus);
  if (!HasShape(*db1, {G, H})) return wrong("db1 must be [G, H]", *db1);
  if (!HasShape(*dw2, {G, H})) return wrong("dw2 must be [G, H]", *dw2);
  if (!HasShape(*db2, {G})) return wrong("db2 must be [G]", *db2);
  if (!HasShape(*loss, {G})) return wrong("loss must be [G]", *loss);
  if (!HasShape(*dpre, {B, G * H})) return wrong("dpre must be [B, G H]", *dpre);
  if (!HasShape(*dy, {G, B})) return wrong("dy must be [G, B]", *dy);
  const int64_t tiles = CeilDiv(B, kHeadTile);
  if (part->dimensions().size() != 3 || !HasShape(*part, {part->dimensions()[0], G, P})) {
    return wrong("partials workspace must be [S, G, 2 H + 4]", *part);
  }
  const int64_t splits = part->dimensions()[0];
  if (splits < 1 || splits > tiles) {
    return InvalidArgument("iql_head: the partials' first dim S must be in [1, tiles = " + std::to_string(tiles) +
                           "], got " + std::to_string(splits));
  }
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(G));
  auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(pre.typed_data(), target.typed_data(), b1.typed_data(), w2.typed_data(),
                                          b2.typed_data(), taus.typed_data(), B, static_cast<int>(H),
                                          static_cast<int>(tiles), inv_batch, dpre->typed_data(), dy->typed_data(),
                                          part->typed_data());
  };
  switch (CeilDiv(H, 128)) {
    case 1: launch(iql_head_kernel<1>); break;
    case 2: launch(iql_head_kernel<2>); break;
    case 3: launch(iql_head_kernel<3>); break;
    default: launch(iql_head_kernel<4>); break;
  }
  JAXFOX_RETURN_IF_ERROR(LastCudaError("iql_head"));
  iql_finish_kernel<<<static_cast<unsigned>(CeilDiv(G * P, 32)), 32 * kSumRows, 0, stream>>>(
      part->typed_data(), static_cast<int>(splits), static_cast<int>(G), static_cast<int>(H), db1->typed_data(),
      dw2->typed_data(), db2->typed_data(), loss->typed_data());
  return LastCudaError("iql_finish");
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iql_head, jaxfox::IqlHeadImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // pre [B, G H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // target [B]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b1 [G, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w2 [G, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b2 [G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // taus [G]
                                  .Attr<float>("inv_batch")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // db1 [G, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw2 [G, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // db2 [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // loss [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dpre [B, G H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dy [G, B]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: partials [S, G, P]
                              {xla::ffi::Traits::kCmdBufferCompatible});
