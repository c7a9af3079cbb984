// iql: the value loss of Implicit Q-Learning for an ensemble of G value networks D -> H -> 1 (ReLU) that share
// their input, between XLA's two products (FFI target jaxfox_iql_head), or on sm_90 with the first product too
// (jaxfox_iql_fused, below). Math and conventions: jaxfox/iql.py (Kostrikov et al. 2021, eq. 5; OPS.md "Losses",
// expectile).
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
// the products (and their TF32 rounding) are XLA's (on the fused path, the first product is the kernel's TF32).
// (It replaces a kernel that also ran both products on mma.sync, with the weight gradient accumulated in
// registers: 0.89x XLA on the H200; XLA's GEMMs were faster than its products. BENCHMARKS.md, thirty-fifth session.)
#include <cstdint>
#include <utility>

#include "common.h"
#include "tensor_core.h"

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

#if defined(JAXFOX_SM90A_BUILD)  // builds with sm_90a machine code (CMakeLists.txt): the fused kernel and its target
// ---- The fused path (sm_90a): the first product on wgmma, with the head in its epilogue -----------------------
// jaxfox_iql_fused does what XLA's forward GEMM and jaxfox_iql_head do together, without pre ever reaching device
// memory: CTA (x, y) computes the 128-row tile x of the pre-activations of its networks (one network g = y, or at H =
// 128 with G even the two networks 2 y and 2 y + 1, so that obs is read once for both; IqlFusedImpl says which and
// why), obs[rows] [W1_g | ..] (128 x 128 NI, K = D), on the tensor cores (two warpgroups of 64 rows; obs and W1_g^T
// stream through 3 cp.async stages of 32-float chunks of K in 128-byte swizzled rows), then applies the head to the
// accumulators in registers (a row's H columns are spread over the 4 lanes of a quad: the value is the quad's butterfly
// sum) and writes dpre TRANSPOSED (dpre^T [G H, B]: 17.7-17.9 us a launch against 19.1 us for dpre [B, G H] in the
// bench's IQL step on an H100, BENCHMARKS.md forty-seventh session; it is also the K-major operand a tensor-core dW1
// would need), dy and the block's partial row [db1 | dw2 | db2 | loss | 0 0] (each thread's sums over its two rows go
// to shared memory, one row of sums per (warp, quad), and a thread per column adds the 64 of them in order), which
// iql_finish_kernel sums as on the head path. Bits depend on the shapes only. TF32: the tensor cores read the float32
// inputs' TF32 bits (truncation).
constexpr int kFusedRows = 128;     // rows of a CTA's tile (jaxfox/iql.py _FUSED_ROWS)
constexpr int kFusedStages = 3;
constexpr int kChunkBytes = 128;    // one swizzled row of a stage: 32 floats of K

__host__ __device__ constexpr int FusedStageBytes(int ni) { return kFusedRows * kChunkBytes * (1 + ni); }
__host__ __device__ constexpr int FusedSmemBytes(int ni) {
  return 1024 + kFusedStages * FusedStageBytes(ni) + 2 * 128 * ni * 4;  // alignment slack, stages, b1 and w2
}

// NI column tiles of 128 a CTA, NPC networks a CTA (H = 128 NI / NPC; CTA (x, y) takes networks NPC y .. NPC y +
// NPC - 1, whose W1^T rows are adjacent), MinBlocks CTAs an SM (the register cap).
template <int NI, int NPC, int MinBlocks>
__global__ void __launch_bounds__(kThreads, MinBlocks)
    iql_fused_kernel(const float* __restrict__ obs, const float* __restrict__ w1t, const float* __restrict__ target,
                     const float* __restrict__ b1, const float* __restrict__ w2, const float* __restrict__ b2,
                     const float* __restrict__ taus, int64_t B, int D, float inv_b, float* __restrict__ dpret,
                     float* __restrict__ dy, float* __restrict__ part) {
#if defined(JAXFOX_HAS_WGMMA)
  constexpr int H = 128 * NI / NPC, TPN = NI / NPC;  // TPN: column tiles a network
  static_assert(NI % NPC == 0, "iql_fused_kernel: a network's columns are whole tiles of 128");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  float* b1s = reinterpret_cast<float*>(smem + kFusedStages * FusedStageBytes(NI));
  float* w2s = b1s + 128 * NI;
  const int g0 = NPC * blockIdx.y, G = NPC * gridDim.y, tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kFusedRows;
  for (int c = tid; c < 128 * NI; c += kThreads) {
    b1s[c] = b1[static_cast<int64_t>(g0) * H + c];
    w2s[c] = w2[static_cast<int64_t>(g0) * H + c];
  }
  const int nk = (D + 31) / 32;
  // chunk kc of K into stage st: A rows r (obs row row0 + r), B rows n (W1^T row g0 H + n); thread tid copies the
  // 16-byte chunk c = tid % 8 of rows tid / 8 + 32 i (the same swizzled chunk position in each of them)
  const int cq = tid & 7, rq = tid >> 3;
  const uint32_t sw = rq * kChunkBytes + ((cq ^ (rq & 7)) << 4);
  const int64_t a_rows = B - row0 - rq;  // rows rq + 32 i < a_rows exist
  const float* a_src = obs + (row0 + rq) * static_cast<int64_t>(D) + 4 * cq;
  const float* b_src = w1t + (static_cast<int64_t>(g0) * H + rq) * D + 4 * cq;
  const int64_t step = 32 * static_cast<int64_t>(D);
  auto load = [&](int kc, int st) {
    unsigned char* sa = smem + st * FusedStageBytes(NI) + sw;
    unsigned char* sb = sa + kFusedRows * kChunkBytes;
    const bool k_ok = 32 * kc + 4 * cq < D;
#pragma unroll
    for (int i = 0; i < kFusedRows / 32; ++i) {
      const bool ok = k_ok && 32 * i < a_rows;
      CpAsync16(reinterpret_cast<float*>(sa + i * 32 * kChunkBytes), ok ? a_src + i * step + 32 * kc : obs, ok);
    }
#pragma unroll
    for (int i = 0; i < 4 * NI; ++i) {
      CpAsync16(reinterpret_cast<float*>(sb + i * 32 * kChunkBytes), k_ok ? b_src + i * step + 32 * kc : w1t, k_ok);
    }
  };
#pragma unroll
  for (int s = 0; s < kFusedStages - 1; ++s) {
    if (s < nk) load(s, s);
    CpAsyncCommit();
  }
  const int wg = tid >> 7;  // warpgroup: rows 64 wg .. 64 wg + 63 of the tile
  float acc[NI][64];
#pragma unroll
  for (int i = 0; i < NI; ++i)
#pragma unroll
    for (int q = 0; q < 64; ++q) acc[i][q] = 0.f;
  for (int kc = 0; kc < nk; ++kc) {
    CpAsyncWaitGroup<kFusedStages - 2>();  // this thread's copies of chunk kc have landed
    FenceProxyAsyncShared();
    __syncthreads();  // everyone's copies of chunk kc; everyone's wgmma of chunk kc - 1 done (waited below)
    if (kc + kFusedStages - 1 < nk) load(kc + kFusedStages - 1, (kc + kFusedStages - 1) % kFusedStages);
    CpAsyncCommit();
    const int st = kc % kFusedStages;
    const uint32_t sa = base + st * FusedStageBytes(NI) + wg * 64 * kChunkBytes;
    const uint32_t sb = base + st * FusedStageBytes(NI) + kFusedRows * kChunkBytes;
#pragma unroll
    for (int i = 0; i < NI; ++i) WgmmaFenceOperand(acc[i]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        WgmmaM64N128K8Tf32(acc[i], WgmmaDescSw128(sa + 32 * kk),
                           WgmmaDescSw128(sb + i * 128 * kChunkBytes + 32 * kk), (kc | kk) != 0);
      }
    }
    WgmmaCommit();
    WgmmaWaitAll();
#pragma unroll
    for (int i = 0; i < NI; ++i) WgmmaFenceOperand(acc[i]);
  }
  CpAsyncWaitAll();
  __syncthreads();  // every stage is free: the reduction rows below reuse them

  // the head, on the accumulators: rows r0 = 64 wg + 16 w + l / 4 and r1 = r0 + 8; columns 128 i + 8 j + 2 t, + 1
  // of the CTA (network n = i / TPN of the CTA's, its column 128 (i % TPN) + 8 j + 2 t)
  const int warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int64_t r0 = row0 + 64 * wg + 16 * (warp & 3) + (lane >> 2), r1 = r0 + 8;
  const bool ok0 = r0 < B, ok1 = r1 < B;
  const float y0 = ok0 ? target[r0] : 0.f, y1 = ok1 ? target[r1] : 0.f;
  float s0[NPC], s1[NPC];
#pragma unroll
  for (int n = 0; n < NPC; ++n) s0[n] = s1[n] = 0.f;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int n = i / TPN;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 128 * i + 8 * j + 2 * t;
      const float2 bb = *reinterpret_cast<const float2*>(b1s + c), ww = *reinterpret_cast<const float2*>(w2s + c);
      float* a = &acc[i][4 * j];
      a[0] += bb.x; a[1] += bb.y; a[2] += bb.x; a[3] += bb.y;
      s0[n] = fmaf(Relu(a[0]), ww.x, s0[n]);
      s0[n] = fmaf(Relu(a[1]), ww.y, s0[n]);
      s1[n] = fmaf(Relu(a[2]), ww.x, s1[n]);
      s1[n] = fmaf(Relu(a[3]), ww.y, s1[n]);
    }
  }
  float wt0[NPC], wt1[NPC], u0[NPC], u1[NPC], dv0[NPC], dv1[NPC];
#pragma unroll
  for (int n = 0; n < NPC; ++n) {
    s0[n] += __shfl_xor_sync(0xffffffffu, s0[n], 1);
    s1[n] += __shfl_xor_sync(0xffffffffu, s1[n], 1);
    s0[n] += __shfl_xor_sync(0xffffffffu, s0[n], 2);  // the same bits in the 4 lanes of a quad
    s1[n] += __shfl_xor_sync(0xffffffffu, s1[n], 2);
    const float tau = taus[g0 + n], b2g = b2[g0 + n];
    u0[n] = y0 - (s0[n] + b2g);
    u1[n] = y1 - (s1[n] + b2g);
    wt0[n] = u0[n] < 0.f ? 1.f - tau : tau;
    wt1[n] = u1[n] < 0.f ? 1.f - tau : tau;
    dv0[n] = ok0 ? -2.f * wt0[n] * u0[n] * inv_b : 0.f;
    dv1[n] = ok1 ? -2.f * wt1[n] * u1[n] * inv_b : 0.f;
    if (t == 0) {
      if (ok0) dy[static_cast<int64_t>(g0 + n) * B + r0] = -dv0[n];
      if (ok1) dy[static_cast<int64_t>(g0 + n) * B + r1] = -dv1[n];
    }
  }
  // the row pair's partial rows: [db1 | dw2 | db2 | loss | 0 0] of rows r0 and r1 for each of the NPC networks
  // (P floats each, adjacent), kRedStride floats a (warp, quad), in the stages (free now); the stride is 8 banks
  // mod 32, so a warp's float2 stores hit distinct banks
  constexpr int P = 2 * H + 4;
  constexpr int kRedStride = NPC * P + ((8 - NPC * P) % 32 + 32) % 32;
  static_assert(8 * kWarps * kRedStride * 4 <= kFusedStages * FusedStageBytes(NI), "iql_fused_kernel: reduction rows");
  float* red = reinterpret_cast<float*>(smem) + (8 * warp + (lane >> 2)) * kRedStride;
  // dpre^T [G H, B]: element (g0 H + c, r); a warp's store covers 4 columns of 8 consecutive rows (32-byte segments)
  float* d0 = dpret + static_cast<int64_t>(g0) * H * B + r0;
  float* d1 = dpret + static_cast<int64_t>(g0) * H * B + r1;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int n = i / TPN;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 128 * i + 8 * j + 2 * t, cr = c + n * (P - H);  // cr: its db1 in the reduction row
      const float2 ww = *reinterpret_cast<const float2*>(w2s + c);
      float* a = &acc[i][4 * j];
      // rows past B add exact zeros (not 0 * w2 or 0 * h, which an infinite weight would make NaN)
      const float e00 = ok0 && a[0] > 0.f ? dv0[n] * ww.x : 0.f, e01 = ok0 && a[1] > 0.f ? dv0[n] * ww.y : 0.f;
      const float e10 = ok1 && a[2] > 0.f ? dv1[n] * ww.x : 0.f, e11 = ok1 && a[3] > 0.f ? dv1[n] * ww.y : 0.f;
      if (ok0) {
        d0[c * B] = e00;
        d0[(c + 1) * B] = e01;
      }
      if (ok1) {
        d1[c * B] = e10;
        d1[(c + 1) * B] = e11;
      }
      const float h00 = ok0 ? Relu(a[0]) : 0.f, h01 = ok0 ? Relu(a[1]) : 0.f;
      const float h10 = ok1 ? Relu(a[2]) : 0.f, h11 = ok1 ? Relu(a[3]) : 0.f;
      // this thread's two rows' sums: db1 of columns c, c + 1 and dw2 of columns c, c + 1
      *reinterpret_cast<float2*>(red + cr) = make_float2(e00 + e10, e01 + e11);
      *reinterpret_cast<float2*>(red + H + cr) =
          make_float2(fmaf(h00, dv0[n], h10 * dv1[n]), fmaf(h01, dv0[n], h11 * dv1[n]));
    }
  }
  if (t == 0) {
#pragma unroll
    for (int n = 0; n < NPC; ++n) {
      red[n * P + 2 * H] = dv0[n] + dv1[n];
      red[n * P + 2 * H + 1] = (ok0 ? wt0[n] * u0[n] * u0[n] : 0.f) + (ok1 ? wt1[n] * u1[n] * u1[n] : 0.f);
    }
  }
  __syncthreads();
  // column sums over the tile's 64 row pairs, in the fixed order warp 0 quad 0, warp 0 quad 1, ..; network n's
  // row goes to part[x, g0 + n]
  float* out = part + (static_cast<int64_t>(blockIdx.x) * G + g0) * P;
  const float* rows = reinterpret_cast<const float*>(smem);
  for (int e = tid; e < NPC * P; e += kThreads) {
    const int el = e % P;
    float v = 0.f;
    if (el < 2 * H + 2) {
#pragma unroll 8
      for (int q = 0; q < 8 * kWarps; ++q) v += rows[q * kRedStride + e];
      if (el == 2 * H + 1) v *= inv_b;
    }
    out[e] = v;
  }
#else
  __trap();  // only sm_90a machine code holds this kernel: a launch of any other image is an error, not garbage
#endif  // JAXFOX_HAS_WGMMA
}
#endif  // JAXFOX_SM90A_BUILD

// The operand and result shapes that both IQL targets share (G networks of width H, B rows; not dpre, which the fused
// target writes transposed); `op` names the target.
ffi::Error CheckIqlShapes(const char* op, int64_t B, int64_t G, int64_t H, const ffi::Buffer<ffi::F32>& target,
                          const ffi::Buffer<ffi::F32>& w2, const ffi::Buffer<ffi::F32>& b2,
                          const ffi::Buffer<ffi::F32>& taus, const ffi::Buffer<ffi::F32>& db1,
                          const ffi::Buffer<ffi::F32>& dw2, const ffi::Buffer<ffi::F32>& db2,
                          const ffi::Buffer<ffi::F32>& loss, const ffi::Buffer<ffi::F32>& dy) {
  auto wrong = [op](const char* what, const ffi::Buffer<ffi::F32>& buf) {
    return InvalidArgument(std::string(op) + ": " + what + ", got " + DimsToString(buf.dimensions()));
  };
  if (!HasShape(target, {B})) return wrong("target must be [B]", target);
  if (!HasShape(w2, {G, H})) return wrong("w2 must be [G, H]", w2);
  if (!HasShape(b2, {G})) return wrong("b2 must be [G]", b2);
  if (!HasShape(taus, {G})) return wrong("taus must be [G]", taus);
  if (!HasShape(db1, {G, H})) return wrong("db1 must be [G, H]", db1);
  if (!HasShape(dw2, {G, H})) return wrong("dw2 must be [G, H]", dw2);
  if (!HasShape(db2, {G})) return wrong("db2 must be [G]", db2);
  if (!HasShape(loss, {G})) return wrong("loss must be [G]", loss);
  if (!HasShape(dy, {G, B})) return wrong("dy must be [G, B]", dy);
  return ffi::Error::Success();
}

// Both targets' second launch: iql_finish_kernel sums the S partial rows [S, G, 2 H + 4] into db1, dw2, db2 and loss.
ffi::Error LaunchFinish(cudaStream_t stream, ffi::Buffer<ffi::F32>& part, int64_t S, int64_t G, int64_t H,
                        ffi::Buffer<ffi::F32>& db1, ffi::Buffer<ffi::F32>& dw2, ffi::Buffer<ffi::F32>& db2,
                        ffi::Buffer<ffi::F32>& loss) {
  iql_finish_kernel<<<static_cast<unsigned>(CeilDiv(G * (2 * H + 4), 32)), 32 * kSumRows, 0, stream>>>(
      part.typed_data(), static_cast<int>(S), static_cast<int>(G), static_cast<int>(H), db1.typed_data(),
      dw2.typed_data(), db2.typed_data(), loss.typed_data());
  return LastCudaError("iql_finish");
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
  if (!HasShape(*dpre, {B, G * H})) return wrong("dpre must be [B, G H]", *dpre);
  JAXFOX_RETURN_IF_ERROR(CheckIqlShapes("iql_head", B, G, H, target, w2, b2, taus, *db1, *dw2, *db2, *loss, *dy));
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
  return LaunchFinish(stream, *part, splits, G, H, *db1, *dw2, *db2, *loss);
}

#if defined(JAXFOX_SM90A_BUILD)
// FFI target jaxfox_iql_fused (registered only by builds with sm_90a machine code; compute capability 9.0): (obs
// [B, D], w1t [G H, D] = the networks' first-layer weights as rows [W1_1^T; ..; W1_G^T], target [B], b1 [G, H], w2
// [G, H], b2 [G], taus [G]) -> the results of jaxfox_iql_head for pre = obs w1t^T, except dpre, which comes
// transposed (dpre^T [G H, B]), with S = ceil(B / 128) partial rows. H is 128 or 256, D a multiple of 4. Two
// launches: the fused kernel and iql_finish_kernel.
ffi::Error IqlFusedImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> obs, ffi::Buffer<ffi::F32> w1t,
                        ffi::Buffer<ffi::F32> target, ffi::Buffer<ffi::F32> b1, ffi::Buffer<ffi::F32> w2,
                        ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> taus, float inv_batch,
                        ffi::ResultBuffer<ffi::F32> db1, ffi::ResultBuffer<ffi::F32> dw2,
                        ffi::ResultBuffer<ffi::F32> db2, ffi::ResultBuffer<ffi::F32> loss,
                        ffi::ResultBuffer<ffi::F32> dpre, ffi::ResultBuffer<ffi::F32> dy,
                        ffi::ResultBuffer<ffi::F32> part) {
  ClearStaleCudaError();
  auto wrong = [](const char* what, const auto& buf) {
    return InvalidArgument(std::string("iql_fused: ") + what + ", got " + DimsToString(buf.dimensions()));
  };
  if (GetDeviceInfo().cc_major != 9) {
    return InvalidArgument("iql_fused: needs a compute capability 9.0 device (its kernel is sm_90a machine code)");
  }
  if (b1.dimensions().size() != 2) return wrong("b1 must be [G, H]", b1);
  if (obs.dimensions().size() != 2) return wrong("obs must be [B, D]", obs);
  const int64_t G = b1.dimensions()[0], H = b1.dimensions()[1], B = obs.dimensions()[0], D = obs.dimensions()[1];
  if (G < 1 || G > 65535) return InvalidArgument("iql_fused: G must be in [1, 65535], got " + std::to_string(G));
  if (H != 128 && H != 256) return InvalidArgument("iql_fused: H must be 128 or 256, got " + std::to_string(H));
  if (D < 4 || D % 4 != 0 || D > 0x7fffffff / 4) {
    return InvalidArgument("iql_fused: D must be a positive multiple of 4, got " + std::to_string(D));
  }
  if (B < 1 || B > 0x7fffffff - kFusedRows) return InvalidArgument("iql_fused: B must be in [1, 2^31 - 129]");
  const int64_t P = 2 * H + 4, S = CeilDiv(B, kFusedRows);
  if (!HasShape(w1t, {G * H, D})) return wrong("w1t must be [G H, D]", w1t);
  if (!HasShape(*dpre, {G * H, B})) return wrong("dpre^T must be [G H, B]", *dpre);
  JAXFOX_RETURN_IF_ERROR(CheckIqlShapes("iql_fused", B, G, H, target, w2, b2, taus, *db1, *dw2, *db2, *loss, *dy));
  if (!HasShape(*part, {S, G, P})) return wrong("partials workspace must be [ceil(B / 128), G, 2 H + 4]", *part);
  if (!Aligned(obs.typed_data(), 16) || !Aligned(w1t.typed_data(), 16)) {
    return InvalidArgument("iql_fused: obs and w1t must be 16-byte aligned (XLA's buffers are)");
  }
  auto launch = [&](auto kernel, int smem, int64_t grid_y) -> ffi::Error {  // grid (S, G / networks a CTA)
    JAXFOX_RETURN_IF_ERROR(PrepareSmem("iql_fused", kernel, smem));
    const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(grid_y));
    kernel<<<grid, kThreads, smem, stream>>>(obs.typed_data(), w1t.typed_data(), target.typed_data(),
                                             b1.typed_data(), w2.typed_data(), b2.typed_data(), taus.typed_data(),
                                             B, static_cast<int>(D), inv_batch, dpre->typed_data(),
                                             dy->typed_data(), part->typed_data());
    return LastCudaError("iql_fused");
  };
  // H = 128 with G even and at least kPairMinCtas pair CTAs: one CTA an SM, two networks a CTA (50.0 us a step of
  // the bench's IQL pair on an H100 against 52.6-53.1 us for one network a CTA, two CTAs an SM; BENCHMARKS.md,
  // forty-eighth session). Otherwise two CTAs an SM, one network each (128 registers a thread; against 58.21 us with
  // one CTA an SM and no register cap, forty-fifth session): with few tiles, twice the CTAs beat reading obs once
  // (G = 2 on an H100: B = 8192, 64 pair CTAs, 38.3 us one network a CTA against 40.1 us; B = 12288, 96 pair CTAs,
  // 50.1 against 44.8 us; forty-ninth session).
  constexpr int64_t kPairMinCtas = 96;
  if (H == 256) {
    JAXFOX_RETURN_IF_ERROR(launch(iql_fused_kernel<2, 1, 1>, FusedSmemBytes(2), G));
  } else if (G % 2 == 0 && S * (G / 2) >= kPairMinCtas) {  // two networks a CTA: obs read once for both
    JAXFOX_RETURN_IF_ERROR(launch(iql_fused_kernel<2, 2, 1>, FusedSmemBytes(2), G / 2));
  } else {
    JAXFOX_RETURN_IF_ERROR(launch(iql_fused_kernel<1, 1, 2>, FusedSmemBytes(1), G));
  }
  return LaunchFinish(stream, *part, S, G, H, *db1, *dw2, *db2, *loss);
}
#endif  // JAXFOX_SM90A_BUILD

}  // namespace
}  // namespace jaxfox

// The operands after the leading ones (pre, or obs and w1t), the attribute and the results, the same for both targets:
// target [B], b1 [G, H], w2 [G, H], b2 [G], taus [G]; inv_batch; db1 [G, H], dw2 [G, H], db2 [G], loss [G], dpre
// [B, G H] (the fused target: dpre^T [G H, B]), dy [G, B] and the workspace of partial rows [S, G, P].
namespace jaxfox {
namespace {
template <typename Binding>
auto IqlHeadBinding(Binding b) {
  using F32 = ffi::Buffer<ffi::F32>;
  return std::move(b)
      .template Arg<F32>()
      .template Arg<F32>()
      .template Arg<F32>()
      .template Arg<F32>()
      .template Arg<F32>()
      .template Attr<float>("inv_batch")
      .template Ret<F32>()
      .template Ret<F32>()
      .template Ret<F32>()
      .template Ret<F32>()
      .template Ret<F32>()
      .template Ret<F32>()
      .template Ret<F32>();
}
}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iql_head, jaxfox::IqlHeadImpl,
                              jaxfox::IqlHeadBinding(xla::ffi::Ffi::Bind()
                                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                         .Arg<xla::ffi::Buffer<xla::ffi::F32>>()),  // pre [B, G H]
                              {xla::ffi::Traits::kCmdBufferCompatible});

#if defined(JAXFOX_SM90A_BUILD)
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iql_fused, jaxfox::IqlFusedImpl,
                              jaxfox::IqlHeadBinding(xla::ffi::Ffi::Bind()
                                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                         .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // obs [B, D]
                                                         .Arg<xla::ffi::Buffer<xla::ffi::F32>>()),  // w1t [G H, D]
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif  // JAXFOX_SM90A_BUILD
