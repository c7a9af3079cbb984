// IQN quantile head (jaxfox/iqn.py): z[b, i] = ReLU((ReLU(e[b, i] W_phi + b_phi) * psi[b]) W_h + b_h) . w_out + b_out,
// e[b, i, k] = cos(pi tau[b, i] k); forward and backward on the tensor cores (mma.sync m16n8k8, TF32 operands
// rounded to nearest, float32 accumulation), without writing any [B, N, H] activation to global memory.
//
// One persistent block of 256 threads per SM keeps W_h and W_phi (TF32-rounded) in shared memory and walks
// over tiles of whole samples (floor(64 / N) samples, at most 64 rows = (sample, fraction) pairs). Per tile
// the forward is two products, [rows, K] x [K, H] and [rows, H] x [H, H]; the backward recomputes them and
// adds d m = d h W_h^T, the weight gradients (d W_h += m^T d h, d W_phi += e^T d phi, accumulated in
// registers over the block's tiles) and, when asked, d e = d phi W_phi^T for d tau. Each block writes its
// parameter-gradient partial once, and LaunchReduceAxis0 adds the partials in a fixed order (no atomics):
// the gradients are bitwise reproducible for a given grid, which the caller fixes (attr `grid`), not the
// device. d psi of a sample is a sum over the sample's own rows, inside one tile.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"
#include "tensor_core.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTileRows = 64;  // jaxfox/iqn.py _MAX_TILE_ROWS
constexpr float kPi = 3.14159265358979323846f;

// v[q] = TF32(cos(fl(pi tau) (c + q))) for q < 16, the cosine embedding's features c .. c + 15 of one row: sincos of
// the chunk's first angle, then rotations by (cos, sin)(pi tau). Both forward kernels and the backward use it, so
// their e values are bit-identical.
__device__ __forceinline__ void CosChunk16(float tau, int c, float (&v)[16]) {
  const float x = kPi * tau;
  float s1, c1, sk, ck;
  sincosf(x, &s1, &c1);
  sincosf(x * static_cast<float>(c), &sk, &ck);
#pragma unroll
  for (int q = 0; q < 16; ++q) {
    v[q] = Tf32(ck);
    const float cn = fmaf(ck, c1, -sk * s1);
    sk = fmaf(sk, c1, ck * s1);
    ck = cn;
  }
}

// Shared-memory layout (floats) and flat parameter layout of one (K, H) instantiation. Every region starts
// at a multiple of 8 floats (float2 / 32-byte aligned) and every row stride is a multiple of 4 floats; the
// +4 padding of the row strides spreads a fragment's rows over the banks.
template <int K, int H, bool kBackward>
struct Layout {
  static constexpr int kLH = H + 4;  // row stride of [*, H] tiles
  // row stride of the weights: the forward reads them only as row-major B fragments (lane (g, t) reads row t,
  // column g), conflict-free at a stride = 8 (mod 32); the backward also reads them transposed, which wants 4.
  static constexpr int kLW = kBackward ? H + 4 : H + 8;
  static constexpr int kLK = K + 4;  // row stride of the [rows, K] tile
  static constexpr int kWh = 0;                                // W_h [H][kLW]
  static constexpr int kWphi = kWh + H * kLW;                  // W_phi [K][kLW]
  static constexpr int kCos = kWphi + K * kLW;                 // e, later d e [64][kLK]
  static constexpr int kPhi = kCos + kMaxTileRows * kLK;       // phi, later d phi_pre (backward only)
  static constexpr int kM = kPhi + kMaxTileRows * kLH;         // m = phi * psi, later d m
  static constexpr int kHp = kM + kMaxTileRows * kLH;          // W_h product, later d h
  static constexpr int kBphi = kHp + kMaxTileRows * kLH;       // b_phi [H]
  static constexpr int kBh = kBphi + H;                        // b_h [H]
  static constexpr int kWout = kBh + H;                        // w_out [H]
  static constexpr int kDz = kWout + H;                        // d z of the tile's rows [64]
  static constexpr int kRowSample = kDz + kMaxTileRows;        // row -> sample within the tile [64] (int)
  static constexpr int kRowLoss = kRowSample + kMaxTileRows;   // loss mode: each row's loss [64]
  static constexpr int kTotal = kRowLoss + kMaxTileRows;
  // flat parameters (jaxfox/iqn.py _flatten): w_h, w_phi, b_phi, b_h, w_out, b_out, zero padding
  static constexpr int kPWh = 0;
  static constexpr int kPWphi = H * H;
  static constexpr int kPBphi = kPWphi + K * H;
  static constexpr int kPBh = kPBphi + H;
  static constexpr int kPWout = kPBh + H;
  static constexpr int kPBout = kPWout + H;
  static constexpr int kP = kPBout + 1;
  static constexpr int kPpad = (kP + 7) / 8 * 8;
  static_assert(kWphi % 8 == 0 && kCos % 8 == 0 && kPhi % 8 == 0 && kM % 8 == 0 && kHp % 8 == 0,
                "regions must be 32-byte aligned");
};

// kBackward = false: z [B, N] from (w, psi, taus). kBackward: d psi [B, H], d taus [B, N] (kTaus) and the
// block's parameter-gradient partial part[blockIdx.x] [kPpad] from (w, psi, taus, dz).
// kLoss (with kBackward, without kTaus): d z is not read but computed in the tile from z and the sample's N'
// target values, d z[b, i] = -dz_scale / kappa sum_j |tau_i - 1{delta < 0}| clip(delta, -kappa, kappa) with
// delta = y[b, j] - z[b, i] and dz_scale = 1 / (B N'): the gradient of the quantile Huber loss
// (1 / B) sum_b sum_i (1 / N') sum_j |tau_i - 1{delta < 0}| L_kappa(delta) / kappa (jaxfox.quantile_huber_loss);
// each sample's loss term goes to loss_b[b].
template <int K, int H, bool kBackward, bool kTaus, bool kLoss = false>
__global__ void __launch_bounds__(kThreads, 1)
    iqn_head_kernel(const float* __restrict__ w, const float* __restrict__ psi, const float* __restrict__ taus,
                    const float* __restrict__ dz, int B, int N, int samples_per_tile, int tiles,
                    float* __restrict__ z, float* __restrict__ dpsi, float* __restrict__ dtaus,
                    float* __restrict__ part, const float* __restrict__ targets, int Nt, float kappa,
                    float dz_scale, float* __restrict__ loss_b) {
  static_assert(!kLoss || (kBackward && !kTaus), "the loss mode is a backward without d taus");
  static_assert(!kLoss || kThreads == 4 * kMaxTileRows, "the loss pass runs 4 threads a row");
  using S = Layout<K, H, kBackward>;
  using RowT = WarpTile<kMaxTileRows / 16, H / 16>;  // [rows, H] products
  using CosT = WarpTile<kMaxTileRows / 16, K / 16>;  // [rows, K] product (d e)
  using WhT = WarpTile<H / 16, H / 16>;              // d W_h [H, H]
  using WphiT = WarpTile<K / 16, H / 16>;            // d W_phi [K, H]
  constexpr int kLH = S::kLH, kLK = S::kLK, kLW = S::kLW;
  constexpr int kGroups = kThreads / H;              // threads per column in the column passes
  extern __shared__ __align__(128) float sm[];
  int* row_sample = reinterpret_cast<int*>(sm + S::kRowSample);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int col = tid % H, grp = tid / H;

  for (int e = tid; e < H * H; e += kThreads) sm[S::kWh + (e / H) * kLW + e % H] = Tf32(w[S::kPWh + e]);
  for (int e = tid; e < K * H; e += kThreads) sm[S::kWphi + (e / H) * kLW + e % H] = Tf32(w[S::kPWphi + e]);
  for (int j = tid; j < H; j += kThreads) {
    sm[S::kBphi + j] = w[S::kPBphi + j];
    sm[S::kBh + j] = w[S::kPBh + j];
    sm[S::kWout + j] = w[S::kPWout + j];
  }
  if (tid < kMaxTileRows) row_sample[tid] = tid / N;  // the only division by N
  const float b_out = w[S::kPBout];

  Frags<WhT::kFR, WhT::kFC> acc_wh;
  Frags<WphiT::kFR, WphiT::kFC> acc_wphi;
  float acc_dbphi = 0.f, acc_dbh = 0.f, acc_dwout = 0.f, acc_dbout = 0.f;
  if (kBackward) {
    acc_wh.Zero();
    acc_wphi.Zero();
  }
  // The next tile's taus, d z and first psi values are loaded into registers while this tile computes, so
  // that a tile never waits a full global-memory round trip before its first product.
  constexpr int kPerRow = K / 16;  // threads per row in (a), 16 features each
  constexpr int kPf = 2;           // psi values per thread carried in registers (the rest load in (a))
  const int my_r = tid / kPerRow;
  float pf_tau = 0.f, pf_dz = 0.f, pf_psi[kPf] = {0.f, 0.f};
  auto prefetch = [&](int tn) {
    if (tn >= tiles) return;
    const int s0n = tn * samples_per_tile;
    const int nsn = min(samples_per_tile, B - s0n);
    const int64_t row0n = static_cast<int64_t>(s0n) * N;
    if (my_r < nsn * N) {
      pf_tau = taus[row0n + my_r];
      if (kBackward && !kLoss && tid % kPerRow == 0) pf_dz = dz[row0n + my_r];
    }
#pragma unroll
    for (int q = 0; q < kPf; ++q) {
      const int e = tid + q * kThreads;
      if (e < nsn * H) pf_psi[q] = __ldg(psi + static_cast<int64_t>(s0n) * H + e);
    }
  };
  prefetch(blockIdx.x);
  __syncthreads();

  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int s0 = t * samples_per_tile;
    const int ns = min(samples_per_tile, B - s0);
    const int rows = ns * N;
    const int row_frags = (rows + 15) >> 4;
    const int64_t row0 = static_cast<int64_t>(s0) * N;

    // (a) e[r, k] = cos(fl(pi tau) k): sincos of the chunk's first angle, then rotations by (cos, sin)(pi tau).
    const float cur_tau = pf_tau, cur_dz = pf_dz;
    float cur_psi[kPf];
#pragma unroll
    for (int q = 0; q < kPf; ++q) cur_psi[q] = pf_psi[q];
    prefetch(t + gridDim.x);
    {
      const int r = my_r, c = (tid % kPerRow) * 16;
      if (r < 16 * row_frags) {
        float* dst = sm + S::kCos + r * kLK + c;
        if (r < rows) {
          float v[16];
          CosChunk16(cur_tau, c, v);
#pragma unroll
          for (int q = 0; q < 16; ++q) dst[q] = v[q];
        } else {
#pragma unroll
          for (int q = 0; q < 16; ++q) dst[q] = 0.f;
        }
        if (kBackward && !kLoss && c == 0) sm[S::kDz + r] = r < rows ? cur_dz : 0.f;
      }
      // the tile's psi rows -> the HP region (free until (d)): element e = tid + q * 256 is row e / H
#pragma unroll
      for (int q = 0; q < kPf; ++q) {
        const int e = tid + q * kThreads;
        if (e < ns * H) sm[S::kHp + (e / H) * kLH + e % H] = cur_psi[q];
      }
      const float* src = psi + static_cast<int64_t>(s0) * H;
#pragma unroll 8
      for (int e = tid + kPf * kThreads; e < ns * H; e += kThreads) {
        sm[S::kHp + (e / H) * kLH + e % H] = __ldg(src + e);
      }
    }
    __syncthreads();

    // (b) the W_phi product -> PHI (backward) or M (forward)
    float* const pre = sm + (kBackward ? S::kPhi : S::kM);
    {
      Frags<RowT::kFR, RowT::kFC> acc;
      acc.Zero();
      WarpMma<RowT::kFR, RowT::kFC, true, true>(acc, sm + S::kCos, kLK, sm + S::kWphi, kLW, RowT::Row0(warp),
                                                RowT::Col0(warp), K / 8, row_frags, lane);
      StoreRows(pre, kLH, acc, RowT::Row0(warp), RowT::Col0(warp), row_frags, lane);
    }
    __syncthreads();

    // (c) phi = ReLU(. + b_phi), m = phi * psi (0 on padding rows). Each thread keeps one column; the
    // loop is unrolled so that its shared-memory loads are issued together.
    {
      const float bphi = sm[S::kBphi + col];
#pragma unroll
      for (int q = 0; q < kMaxTileRows / kGroups; ++q) {
        const int r = grp + q * kGroups;
        if (r < 16 * row_frags) {
          float phi = 0.f, m = 0.f;
          if (r < rows) {
            phi = Relu(pre[r * kLH + col] + bphi);
            m = phi * sm[S::kHp + row_sample[r] * kLH + col];
          }
          if (kBackward) pre[r * kLH + col] = phi;
          sm[S::kM + r * kLH + col] = Tf32(m);
        }
      }
    }
    __syncthreads();

    if constexpr (!kBackward) {
      // (d) the W_h product and, in its epilogue, z = ReLU(. + b_h) . w_out + b_out: each warp sums its 32
      // columns per row (lanes t of a row by shuffles), the column-warps' partials are added in order.
      float* zpart = sm + S::kPhi;  // [64][kWcw]; the forward has no phi tile
      {
        Frags<RowT::kFR, RowT::kFC> acc;
        acc.Zero();
        const int r0 = RowT::Row0(warp), c0 = RowT::Col0(warp), g = lane >> 2, t4 = lane & 3;
        WarpMma<RowT::kFR, RowT::kFC, true, true>(acc, sm + S::kM, kLH, sm + S::kWh, kLW, r0, c0, H / 8,
                                                  row_frags, lane);
#pragma unroll
        for (int i = 0; i < RowT::kFR; ++i) {
          if (r0 + i < row_frags) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              float v = 0.f;
#pragma unroll
              for (int j = 0; j < 2 * RowT::kFC; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int cc = 16 * c0 + 8 * j + 2 * t4 + e;
                  v = fmaf(Relu(acc.c[i][j][2 * half + e] + sm[S::kBh + cc]), sm[S::kWout + cc], v);
                }
              }
              v += __shfl_xor_sync(0xffffffffu, v, 1);
              v += __shfl_xor_sync(0xffffffffu, v, 2);
              if (t4 == 0) zpart[(16 * (r0 + i) + g + 8 * half) * RowT::kWcw + RowT::ColWarp(warp)] = v;
            }
          }
        }
      }
      __syncthreads();
      if (tid < rows) {
        float v = 0.f;
#pragma unroll
        for (int cw = 0; cw < RowT::kWcw; ++cw) v += zpart[tid * RowT::kWcw + cw];
        z[row0 + tid] = v + b_out;
      }
      // no barrier here: the next tile writes zpart (and everything else this tile still reads) only after
      // three more barriers
    } else {
      // (d) the W_h product -> HP
      {
        Frags<RowT::kFR, RowT::kFC> acc;
        acc.Zero();
        WarpMma<RowT::kFR, RowT::kFC, true, true>(acc, sm + S::kM, kLH, sm + S::kWh, kLW, RowT::Row0(warp),
                                                  RowT::Col0(warp), H / 8, row_frags, lane);
        StoreRows(sm + S::kHp, kLH, acc, RowT::Row0(warp), RowT::Col0(warp), row_frags, lane);
      }
      __syncthreads();

      if constexpr (kLoss) {
        // (d') z of each row, its loss against the sample's N' targets and d z -> DZ, 4 threads a row (lanes
        // 4r .. 4r + 3 of one warp), each summing every 4th column / target, added by two shuffles (the same
        // sum in all 4 lanes). Rows are conflict-free: bank (4 r + p + 4 c') mod 32 over a warp's 8 rows.
        const int r = tid >> 2, p = tid & 3;
        const bool live = r < rows;
        float v = 0.f;
        if (live) {
          const float* hp = sm + S::kHp + r * kLH;
#pragma unroll 8
          for (int c = p; c < H; c += 4) v = fmaf(Relu(hp[c] + sm[S::kBh + c]), sm[S::kWout + c], v);
        }
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        const float zr = v + b_out;
        float lsum = 0.f, gsum = 0.f;
        if (live) {
          const float tau = __ldg(taus + row0 + r);
          const float* y = targets + (static_cast<int64_t>(s0) + row_sample[r]) * Nt;
          for (int j = p; j < Nt; j += 4) {
            const float delta = __ldg(y + j) - zr;
            const float wt = fabsf(tau - (delta < 0.f ? 1.f : 0.f));
            const float ad = fabsf(delta);
            // L_kappa and its derivative; NaN fails both comparisons and propagates as in the reference (an
            // infinite target takes the linear branch, clip = +-kappa, as the reference's gradient does)
            const float hub = ad <= kappa ? 0.5f * delta * delta : kappa * (ad - 0.5f * kappa);
            const float clip = ad <= kappa ? delta : (delta > 0.f ? kappa : (delta < 0.f ? -kappa : delta));
            lsum = fmaf(wt, hub, lsum);
            gsum = fmaf(wt, clip, gsum);
          }
        }
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        gsum += __shfl_xor_sync(0xffffffffu, gsum, 1);
        gsum += __shfl_xor_sync(0xffffffffu, gsum, 2);
        if (p == 0 && r < 16 * row_frags) {
          sm[S::kDz + r] = live ? -gsum / kappa * dz_scale : 0.f;
          sm[S::kRowLoss + r] = live ? lsum / kappa / static_cast<float>(Nt) : 0.f;
        }
        __syncthreads();
        // each sample's loss: its N row terms added in order (ROW LOSS is rewritten only after (e)-(i)'s barriers)
        if (tid < ns) {
          float acc = 0.f;
          for (int i = 0; i < N; ++i) acc += sm[S::kRowLoss + tid * N + i];
          loss_b[s0 + tid] = acc;
        }
      }

      // (e) h = ReLU(. + b_h), d h = d z w_out 1{h > 0} -> HP; column sums of d w_out, d b_h, d b_out
#pragma unroll 4
      for (int r = grp; r < 16 * row_frags; r += kGroups) {
        float* p = sm + S::kHp + r * kLH + col;
        const float hp = *p + sm[S::kBh + col];
        const float g = sm[S::kDz + r];
        const float dh = hp > 0.f ? g * sm[S::kWout + col] : 0.f;
        acc_dwout = fmaf(g, Relu(hp), acc_dwout);
        acc_dbh += dh;
        if (col == 0) acc_dbout += g;
        *p = Tf32(dh);
      }
      __syncthreads();

      // (f) d W_h += m^T d h (A = m^T: M read column-major; the sum runs over the tile's rows)
      WarpMma<WhT::kFR, WhT::kFC, false, true>(acc_wh, sm + S::kM, kLH, sm + S::kHp, kLH, WhT::Row0(warp),
                                               WhT::Col0(warp), 2 * row_frags, 1 << 30, lane);
      __syncthreads();

      // (g) d m = d h W_h^T -> M (B = W_h^T: W_h read column-major)
      {
        Frags<RowT::kFR, RowT::kFC> acc;
        acc.Zero();
        WarpMma<RowT::kFR, RowT::kFC, true, false>(acc, sm + S::kHp, kLH, sm + S::kWh, kLW, RowT::Row0(warp),
                                                   RowT::Col0(warp), H / 8, row_frags, lane);
        StoreRows(sm + S::kM, kLH, acc, RowT::Row0(warp), RowT::Col0(warp), row_frags, lane);
      }
      __syncthreads();

      // (h) per (sample, column): d psi = sum over the sample's rows of d m phi; d phi_pre = d m psi 1{phi > 0}
      for (int q = 0, s = grp; s < ns; ++q, s += kGroups) {
        const int64_t b = s0 + s;
        // psi[b][col] is element tid + q * 256 of the tile's psi rows: in a register for q < kPf
        const float ps = q == 0 ? cur_psi[0] : (q == 1 ? cur_psi[1] : __ldg(psi + b * H + col));
        float acc = 0.f;
#pragma unroll 4
        for (int i = 0; i < N; ++i) {
          const int r = s * N + i;
          const float dm = sm[S::kM + r * kLH + col];
          const float phi = sm[S::kPhi + r * kLH + col];
          acc = fmaf(dm, phi, acc);
          const float dp = phi > 0.f ? dm * ps : 0.f;
          acc_dbphi += dp;
          sm[S::kPhi + r * kLH + col] = Tf32(dp);
        }
        dpsi[b * H + col] = acc;
      }
      __syncthreads();

      // (i) d W_phi += e^T d phi_pre (padding rows are 0 in both)
      WarpMma<WphiT::kFR, WphiT::kFC, false, true>(acc_wphi, sm + S::kCos, kLK, sm + S::kPhi, kLH,
                                                   WphiT::Row0(warp), WphiT::Col0(warp), 2 * row_frags, 1 << 30, lane);
      if (kTaus) {
        __syncthreads();
        // (j) d e = d phi_pre W_phi^T -> the e tile (B = W_phi^T: W_phi read column-major)
        {
          Frags<CosT::kFR, CosT::kFC> acc;
          acc.Zero();
          WarpMma<CosT::kFR, CosT::kFC, true, false>(acc, sm + S::kPhi, kLH, sm + S::kWphi, kLW, CosT::Row0(warp),
                                                     CosT::Col0(warp), H / 8, row_frags, lane);
          StoreRows(sm + S::kCos, kLK, acc, CosT::Row0(warp), CosT::Col0(warp), row_frags, lane);
        }
        __syncthreads();
        // (k) d tau = sum_k d e[k] (-sin(fl(pi tau) k)) k pi, one warp per row
        for (int r = warp; r < rows; r += kWarps) {
          const float x = kPi * taus[row0 + r];
          float s = 0.f;
#pragma unroll
          for (int k = lane; k < K; k += 32) {
            const float kf = static_cast<float>(k);
            s = fmaf(sm[S::kCos + r * kLK + k] * -sinf(x * kf), kf * kPi, s);
          }
          s = WarpSum(s);
          if (lane == 0) dtaus[row0 + r] = s;
        }
      }
      __syncthreads();  // the next tile overwrites every tile buffer
    }
  }

  if constexpr (!kBackward) return;
  float* prow = part + static_cast<int64_t>(blockIdx.x) * S::kPpad;
  StoreRows(prow + S::kPWh, H, acc_wh, WhT::Row0(warp), WhT::Col0(warp), 1 << 30, lane);
  StoreRows(prow + S::kPWphi, H, acc_wphi, WphiT::Row0(warp), WphiT::Col0(warp), 1 << 30, lane);
  // column sums: the kGroups threads of a column added in group order (the loop's last barrier has passed)
  float* red = sm + S::kHp;
  red[(grp * 3 + 0) * H + col] = acc_dbphi;
  red[(grp * 3 + 1) * H + col] = acc_dbh;
  red[(grp * 3 + 2) * H + col] = acc_dwout;
  if (col == 0) red[3 * kGroups * H + grp] = acc_dbout;
  __syncthreads();
  if (tid < H) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f;
    for (int g = 0; g < kGroups; ++g) {
      s0 += red[(g * 3 + 0) * H + tid];
      s1 += red[(g * 3 + 1) * H + tid];
      s2 += red[(g * 3 + 2) * H + tid];
    }
    prow[S::kPBphi + tid] = s0;
    prow[S::kPBh + tid] = s1;
    prow[S::kPWout + tid] = s2;
  }
  if (tid == 0) {
    float s = 0.f;
    for (int g = 0; g < kGroups; ++g) s += red[3 * kGroups * H + g];
    prow[S::kPBout] = s;
  }
  if (tid >= S::kP - S::kPBout && tid < S::kPpad - S::kPBout) prow[S::kPBout + tid] = 0.f;  // padding
}

#if defined(JAXFOX_SM90A_BUILD)  // builds with sm_90a machine code (CMakeLists.txt)
// ---- The forward on wgmma (sm_90a, H = 128) ---------------------------------------------------------------------
// z of iqn_head_kernel<K, 128, false, false>, with both products on Hopper's warpgroup MMA (TF32, float32
// accumulation) instead of mma.sync: one persistent CTA an SM keeps W_phi^T and W_h^T (TF32-rounded) in shared
// memory, and each of its two warpgroups walks its own tiles of whole samples (the same tiles as the mma.sync
// kernel), t = 2 blockIdx.x + warpgroup, step 2 gridDim.x. A tile: (a) e = cos(pi tau k) (the same values as the
// mma.sync kernel: sincos of each 16-wide chunk's first angle, then rotations), TF32-rounded, -> E; (b) E W_phi on
// wgmma; (c) m = ReLU(. + b_phi) * psi[sample], TF32-rounded, from the accumulators -> M; (d) M W_h on wgmma; (e)
// z = ReLU(. + b_h) . w_out + b_out from the accumulators: a row's 128 columns are held by the 4 lanes of a quad
// (32 each, summed in column order), added by two shuffles. Operands are K-major tiles of 32-float rows, 128-byte
// swizzled (ffi/tensor_core.h WgmmaDescSw128). Rows are independent: a sample's z does not depend on the batch.
template <int K>
struct WgFwdLayout {  // bytes from the 1024-aligned base
  static constexpr int H = 128, kRows = kMaxTileRows;
  static constexpr int kWhT = 0;                              // W_h^T [H/32 blocks][H rows n][32 k]
  static constexpr int kWphiT = kWhT + H * H * 4;             // W_phi^T [K/32][H][32]
  static constexpr int kE = kWphiT + K * H * 4;               // per warpgroup: E [K/32][64][32], then M [H/32][64][32]
  static constexpr int kM = kE + K * kRows * 4;
  static constexpr int kWg = K * kRows * 4 + H * kRows * 4;   // bytes a warpgroup
  static constexpr int kVec = kE + 2 * kWg;                   // b_phi, b_h, w_out [H] floats each
  static constexpr int kRowSample = kVec + 3 * H * 4;         // row -> sample within a tile [64] (int)
  static constexpr int kBytes = kRowSample + kRows * 4;
  static constexpr int kSmem = 1024 + kBytes;                 // with the alignment slack
  static_assert(K % 32 == 0 && kE % 1024 == 0 && kM % 1024 == 0 && kWg % 1024 == 0, "1024-byte swizzle atoms");
};

// Float offset of element (row r, k) in a K-major swizzled operand of R rows (32-float blocks of K, each R x 128
// bytes; 16-byte chunk c of row r at chunk c ^ (r % 8)).
template <int R>
__device__ __forceinline__ int SwOff(int r, int k) {
  return (k >> 5) * (R * 32) + r * 32 + ((((k & 31) >> 2) ^ (r & 7)) << 2) + (k & 3);
}

__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

template <int K>
__global__ void __launch_bounds__(kThreads, 1)
    iqn_head_fwd_wgmma_kernel(const float* __restrict__ w, const float* __restrict__ psi,
                              const float* __restrict__ taus, int B, int N, int samples_per_tile, int tiles,
                              float* __restrict__ z) {
#if defined(JAXFOX_HAS_WGMMA)
  constexpr int H = 128;
  using S = Layout<K, H, false>;  // the flat parameter layout
  using L = WgFwdLayout<K>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  float* whT = reinterpret_cast<float*>(smem + L::kWhT);
  float* wphiT = reinterpret_cast<float*>(smem + L::kWphiT);
  float* vec = reinterpret_cast<float*>(smem + L::kVec);  // b_phi | b_h | w_out
  int* row_sample = reinterpret_cast<int*>(smem + L::kRowSample);
  const int tid = threadIdx.x;
  // W[k][n] (x @ W, row-major) -> row n, column k of the transposed operand
  for (int e = tid; e < H * H; e += kThreads) whT[SwOff<H>(e % H, e / H)] = Tf32(w[S::kPWh + e]);
  for (int e = tid; e < K * H; e += kThreads) wphiT[SwOff<H>(e % H, e / H)] = Tf32(w[S::kPWphi + e]);
  for (int j = tid; j < H; j += kThreads) {
    vec[j] = w[S::kPBphi + j];
    vec[H + j] = w[S::kPBh + j];
    vec[2 * H + j] = w[S::kPWout + j];
  }
  if (tid < kMaxTileRows) row_sample[tid] = tid / N;  // the only division by N
  const float b_out = w[S::kPBout];
  FenceProxyAsyncShared();
  __syncthreads();

  const int wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31, t4 = lane & 3;
  const uint32_t e_base = base + L::kE + wg * L::kWg, m_base = e_base + (L::kM - L::kE);
  float* es = reinterpret_cast<float*>(smem + L::kE + wg * L::kWg);
  float* ms = reinterpret_cast<float*>(smem + L::kM + wg * L::kWg);
  // (a)'s work: row wt / 2, K / 2 features from (wt % 2) K / 2, in chunks of 16
  const int ar = wt >> 1, ak = (wt & 1) * (K / 2);
  // (c), (e): rows r0, r1 = r0 + 8 of the tile, columns 8 j + 2 t4 (+ 1) for j < 16
  const int r0 = 16 * warp + (lane >> 2), r1 = r0 + 8;
  const int stride = 2 * gridDim.x;
  int t = 2 * blockIdx.x + wg;
  float pf_tau = 0.f;
  auto tile_rows = [&](int tt) { return min(samples_per_tile, B - tt * samples_per_tile) * N; };
  if (t < tiles && ar < tile_rows(t)) pf_tau = taus[static_cast<int64_t>(t) * samples_per_tile * N + ar];
  float acc[64];
#pragma unroll
  for (int q = 0; q < 64; ++q) acc[q] = 0.f;
  for (; t < tiles; t += stride) {
    const int s0 = t * samples_per_tile;
    const int rows = tile_rows(t);
    const int64_t row0 = static_cast<int64_t>(s0) * N;
    const float tau = pf_tau;
    if (t + stride < tiles && ar < tile_rows(t + stride)) {
      pf_tau = taus[static_cast<int64_t>(t + stride) * samples_per_tile * N + ar];
    }
    // (a) E
#pragma unroll
    for (int ch = 0; ch < K / 32; ++ch) {
      const int c = ak + 16 * ch;
      float v[16];
      if (ar < rows) {
        CosChunk16(tau, c, v);
      } else {
#pragma unroll
        for (int q = 0; q < 16; ++q) v[q] = 0.f;
      }
#pragma unroll
      for (int q = 0; q < 16; q += 4) {
        *reinterpret_cast<float4*>(es + SwOff<kMaxTileRows>(ar, c + q)) = make_float4(v[q], v[q + 1], v[q + 2], v[q + 3]);
      }
    }
    FenceProxyAsyncShared();
    WarpgroupBarrier(wg);
    // this thread's psi values for (c), loaded while the first product runs
    const bool ok0 = r0 < rows, ok1 = r1 < rows;
    const float* p0 = psi + (static_cast<int64_t>(s0) + (ok0 ? row_sample[r0] : 0)) * H + 2 * t4;
    const float* p1 = psi + (static_cast<int64_t>(s0) + (ok1 ? row_sample[r1] : 0)) * H + 2 * t4;
    // (b) E W_phi
    WgmmaFenceOperand(acc);
    WgmmaFence();
    WgmmaSw128Product<K / 32>(acc, e_base, kMaxTileRows * 128, base + L::kWphiT, H * 128);
    WgmmaCommit();
    float2 ps0[16], ps1[16];  // read only where ok0 / ok1
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (ok0) ps0[j] = __ldg(reinterpret_cast<const float2*>(p0 + 8 * j));
      if (ok1) ps1[j] = __ldg(reinterpret_cast<const float2*>(p1 + 8 * j));
    }
    WgmmaWaitAll();
    WgmmaFenceOperand(acc);
    // (c) M = TF32(ReLU(. + b_phi) * psi), 0 on padding rows
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 8 * j + 2 * t4;
      const float2 bb = *reinterpret_cast<const float2*>(vec + c);
      const float* a = &acc[4 * j];
      *reinterpret_cast<float2*>(ms + SwOff<kMaxTileRows>(r0, c)) =
          ok0 ? make_float2(Tf32(Relu(a[0] + bb.x) * ps0[j].x), Tf32(Relu(a[1] + bb.y) * ps0[j].y))
              : make_float2(0.f, 0.f);
      *reinterpret_cast<float2*>(ms + SwOff<kMaxTileRows>(r1, c)) =
          ok1 ? make_float2(Tf32(Relu(a[2] + bb.x) * ps1[j].x), Tf32(Relu(a[3] + bb.y) * ps1[j].y))
              : make_float2(0.f, 0.f);
    }
    FenceProxyAsyncShared();
    WarpgroupBarrier(wg);
    // (d) M W_h
    WgmmaFenceOperand(acc);
    WgmmaFence();
    WgmmaSw128Product<H / 32>(acc, m_base, kMaxTileRows * 128, base + L::kWhT, H * 128);
    WgmmaCommit();
    WgmmaWaitAll();
    WgmmaFenceOperand(acc);
    // (e) z
    float v0 = 0.f, v1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 8 * j + 2 * t4;
      const float2 bh = *reinterpret_cast<const float2*>(vec + H + c);
      const float2 wo = *reinterpret_cast<const float2*>(vec + 2 * H + c);
      const float* a = &acc[4 * j];
      v0 = fmaf(Relu(a[0] + bh.x), wo.x, v0);
      v0 = fmaf(Relu(a[1] + bh.y), wo.y, v0);
      v1 = fmaf(Relu(a[2] + bh.x), wo.x, v1);
      v1 = fmaf(Relu(a[3] + bh.y), wo.y, v1);
    }
    v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
    v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
    v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
    v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
    if (t4 == 0) {
      if (ok0) z[row0 + r0] = v0 + b_out;
      if (ok1) z[row0 + r1] = v1 + b_out;
    }
    // E and M are rewritten next only after this warpgroup's next barrier, which every warp reaches after its
    // wgmma waits above
  }
#else
  __trap();  // only sm_90a machine code holds this kernel: a launch of any other image is an error, not garbage
#endif  // JAXFOX_HAS_WGMMA
}
#endif  // JAXFOX_SM90A_BUILD

// Calls f(integral_constant K, integral_constant H) for the instantiated shapes (jaxfox/iqn.py _KERNEL_K/_H).
template <typename F>
ffi::Error ByShape(int64_t K, int64_t H, F&& f) {
  using std::integral_constant;
  if (K == 64 && H == 128) return f(integral_constant<int, 64>{}, integral_constant<int, 128>{});
  if (K == 32 && H == 128) return f(integral_constant<int, 32>{}, integral_constant<int, 128>{});
  if (K == 64 && H == 64) return f(integral_constant<int, 64>{}, integral_constant<int, 64>{});
  if (K == 32 && H == 64) return f(integral_constant<int, 32>{}, integral_constant<int, 64>{});
  return InvalidArgument("iqn_head: no kernel for n_cos = " + std::to_string(K) + ", hidden = " + std::to_string(H) +
                         " (kernels: n_cos in {32, 64}, hidden in {64, 128})");
}

struct Dims {
  int64_t B = 0, N = 0, spt = 1, tiles = 0;
};

ffi::Error CheckInputs(const ffi::Buffer<ffi::F32>& w, const ffi::Buffer<ffi::F32>& psi,
                       const ffi::Buffer<ffi::F32>& taus, int64_t n_cos, int64_t hidden, int64_t n_quantiles,
                       int64_t ppad, Dims* d) {
  if (psi.dimensions().size() != 2 || taus.dimensions().size() != 2 || w.dimensions().size() != 1) {
    return InvalidArgument("iqn_head: expected w [P], psi [B, H], taus [B, N]; got w " + DimsToString(w.dimensions()) +
                           ", psi " + DimsToString(psi.dimensions()) + ", taus " + DimsToString(taus.dimensions()));
  }
  d->B = psi.dimensions()[0];
  d->N = n_quantiles;
  if (psi.dimensions()[1] != hidden) {
    return InvalidArgument("iqn_head: psi must be [B, hidden], got " + DimsToString(psi.dimensions()));
  }
  if (taus.dimensions()[0] != d->B || taus.dimensions()[1] != d->N) {
    return InvalidArgument("iqn_head: taus must be [B, n_quantiles] = [" + std::to_string(d->B) + ", " +
                           std::to_string(d->N) + "], got " + DimsToString(taus.dimensions()));
  }
  if (w.dimensions()[0] != ppad) {
    return InvalidArgument("iqn_head: w must have " + std::to_string(ppad) + " floats, got " +
                           DimsToString(w.dimensions()));
  }
  if (d->N < 1 || d->N > kMaxTileRows) return InvalidArgument("iqn_head: n_quantiles must be in [1, 64]");
  if (d->B * d->N > 0x7fffffff) return InvalidArgument("iqn_head: B * n_quantiles must be < 2^31");
  d->spt = kMaxTileRows / d->N;
  d->tiles = CeilDiv(d->B, d->spt);
  return ffi::Error::Success();
}

// FFI target jaxfox_iqn_head_fwd: (w [P], psi [B, H], taus [B, N]) -> z [B, N].
ffi::Error IqnHeadFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> psi,
                          ffi::Buffer<ffi::F32> taus, int64_t n_cos, int64_t hidden, int64_t n_quantiles,
                          ffi::ResultBuffer<ffi::F32> z) {
  ClearStaleCudaError();
  return ByShape(n_cos, hidden, [&](auto kc, auto hc) -> ffi::Error {
    constexpr int K = decltype(kc)::value, H = decltype(hc)::value;
    using S = Layout<K, H, false>;
    Dims d;
    JAXFOX_RETURN_IF_ERROR(CheckInputs(w, psi, taus, n_cos, hidden, n_quantiles, S::kPpad, &d));
    if (z->dimensions().size() != 2 || z->dimensions()[0] != d.B || z->dimensions()[1] != d.N) {
      return InvalidArgument("iqn_head: z must be [B, N], got " + DimsToString(z->dimensions()));
    }
    if (d.B == 0) return ffi::Error::Success();
#if defined(JAXFOX_SM90A_BUILD)
    // compute capability 9.0 and H = 128: the wgmma kernel, two warpgroups (two tiles at a time) a CTA (1.81x the
    // mma.sync kernel at B = 16384, N = 32, K = 64 on an H100: 239 against 433 us, BENCHMARKS.md fifty-second session)
    if constexpr (H == 128) {
      if (GetDeviceInfo().cc_major == 9) {
        auto wk = iqn_head_fwd_wgmma_kernel<K>;
        const int64_t wbytes = WgFwdLayout<K>::kSmem;
        JAXFOX_RETURN_IF_ERROR(PrepareSmem("iqn_head", wk, wbytes));
        const int wgrid = static_cast<int>(std::min<int64_t>(CeilDiv(d.tiles, int64_t{2}),
                                                             std::max(1, GetDeviceInfo().sm_count)));
        wk<<<wgrid, kThreads, wbytes, stream>>>(w.typed_data(), psi.typed_data(), taus.typed_data(),
                                                static_cast<int>(d.B), static_cast<int>(d.N),
                                                static_cast<int>(d.spt), static_cast<int>(d.tiles), z->typed_data());
        return LastCudaError("iqn_head_fwd");
      }
    }
#endif  // JAXFOX_SM90A_BUILD
    auto kernel = iqn_head_kernel<K, H, false, false>;
    const int64_t bytes = int64_t{S::kTotal} * 4;
    JAXFOX_RETURN_IF_ERROR(PrepareSmem("iqn_head", kernel, bytes));
    const int grid = static_cast<int>(std::min<int64_t>(d.tiles, std::max(1, GetDeviceInfo().sm_count)));
    kernel<<<grid, kThreads, bytes, stream>>>(w.typed_data(), psi.typed_data(), taus.typed_data(), nullptr,
                                              static_cast<int>(d.B), static_cast<int>(d.N), static_cast<int>(d.spt),
                                              static_cast<int>(d.tiles), z->typed_data(), nullptr, nullptr, nullptr,
                                              nullptr, 0, 1.f, 0.f, nullptr);
    return LastCudaError("iqn_head_fwd");
  });
}

// The gradient outputs and workspaces of the backward and the loss: dw [P], d psi [B, H], partials [grid, P]
// (grid in [1, min(tiles, 65535)] when B > 0) and chunk partials (>= chunks * P floats when chunks > 1).
ffi::Error CheckGradOutputs(const Dims& d, int64_t H, int64_t ppad, int64_t grid, int64_t chunks,
                            const ffi::Buffer<ffi::F32>& dw, const ffi::Buffer<ffi::F32>& dpsi,
                            const ffi::Buffer<ffi::F32>& part, const ffi::Buffer<ffi::F32>& ws) {
  auto wrong = [](const char* what, const ffi::Buffer<ffi::F32>& buf) {
    return InvalidArgument(std::string("iqn_head: ") + what + ", got " + DimsToString(buf.dimensions()));
  };
  if (!HasShape(dw, {ppad})) return wrong("dw must be [P]", dw);
  if (!HasShape(dpsi, {d.B, H})) return wrong("dpsi must be [B, H]", dpsi);
  if (d.B == 0) return ffi::Error::Success();
  if (grid < 1 || grid > d.tiles || grid > 65535) {
    return InvalidArgument("iqn_head: grid must be in [1, min(tiles = " + std::to_string(d.tiles) +
                           ", 65535)], got " + std::to_string(grid));
  }
  if (!HasShape(part, {grid, ppad})) return wrong("partials workspace must be [grid, P]", part);
  if (chunks < 1 || chunks > grid) return InvalidArgument("iqn_head: chunks must be in [1, grid]");
  const int64_t need = chunks > 1 ? chunks * ppad : 0;
  if (static_cast<int64_t>(ws.element_count()) < need) {
    return InvalidArgument("iqn_head: workspace has " + std::to_string(ws.element_count()) + " elements, needs " +
                           std::to_string(need));
  }
  return ffi::Error::Success();
}

// The launch shared by the backward and the loss: dw = 0 for an empty batch; else `kernel` over `grid` persistent
// blocks (each writing its parameter-gradient partial row of `part`), then the partials' ordered sum into dw.
template <int K, int H, typename Kernel, typename... Args>
ffi::Error LaunchAndReduce(cudaStream_t stream, const char* op, const char* launch, const Dims& d, Kernel kernel,
                           int64_t grid, int64_t chunks, float* part, float* ws, float* dw, Args... args) {
  using S = Layout<K, H, true>;
  if (d.B == 0) {
    cudaMemsetAsync(dw, 0, sizeof(float) * S::kPpad, stream);
    return LastCudaError((std::string(launch) + " (B = 0)").c_str());
  }
  const int64_t bytes = int64_t{S::kTotal} * 4;
  JAXFOX_RETURN_IF_ERROR(PrepareSmem(op, kernel, bytes));
  kernel<<<static_cast<int>(grid), kThreads, bytes, stream>>>(args...);
  JAXFOX_RETURN_IF_ERROR(LastCudaError(launch));
  return LaunchReduceAxis0(stream, part, 1, grid, S::kPpad, chunks, chunks > 1 ? ws : nullptr, dw);
}

// FFI target jaxfox_iqn_head_bwd: (w, psi, taus, dz [B, N]) -> dw [P], d psi [B, H], d taus [B, N] or [0]
// (not computed), and the workspaces partials [grid, P] and chunk partials [chunks * P] (or [0]).
ffi::Error IqnHeadBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> psi,
                          ffi::Buffer<ffi::F32> taus, ffi::Buffer<ffi::F32> dz, int64_t n_cos, int64_t hidden,
                          int64_t n_quantiles, int64_t chunks, int64_t grid, ffi::ResultBuffer<ffi::F32> dw,
                          ffi::ResultBuffer<ffi::F32> dpsi, ffi::ResultBuffer<ffi::F32> dtaus,
                          ffi::ResultBuffer<ffi::F32> part, ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  return ByShape(n_cos, hidden, [&](auto kc, auto hc) -> ffi::Error {
    constexpr int K = decltype(kc)::value, H = decltype(hc)::value;
    using S = Layout<K, H, true>;
    Dims d;
    JAXFOX_RETURN_IF_ERROR(CheckInputs(w, psi, taus, n_cos, hidden, n_quantiles, S::kPpad, &d));
    if (!HasShape(dz, {d.B, d.N})) {
      return InvalidArgument("iqn_head: dz must be [B, N], got " + DimsToString(dz.dimensions()));
    }
    const bool want_taus = !HasShape(*dtaus, {0});
    if (want_taus && !HasShape(*dtaus, {d.B, d.N})) {
      return InvalidArgument("iqn_head: dtaus must be [B, N] or [0], got " + DimsToString(dtaus->dimensions()));
    }
    JAXFOX_RETURN_IF_ERROR(CheckGradOutputs(d, H, S::kPpad, grid, chunks, *dw, *dpsi, *part, *ws));
    auto kernel = want_taus ? iqn_head_kernel<K, H, true, true> : iqn_head_kernel<K, H, true, false>;
    return LaunchAndReduce<K, H>(
        stream, "iqn_head", "iqn_head_bwd", d, kernel, grid, chunks, part->typed_data(), ws->typed_data(),
        dw->typed_data(), w.typed_data(), psi.typed_data(), taus.typed_data(), dz.typed_data(),
        static_cast<int>(d.B), static_cast<int>(d.N), static_cast<int>(d.spt), static_cast<int>(d.tiles),
        static_cast<float*>(nullptr), dpsi->typed_data(), want_taus ? dtaus->typed_data() : nullptr,
        part->typed_data(), static_cast<const float*>(nullptr), 0, 1.f, 0.f, static_cast<float*>(nullptr));
  });
}

// FFI target jaxfox_iqn_loss: (w, psi, taus [B, N], targets [B, N']) -> the per-sample quantile Huber loss
// loss_b [B] of z = iqn_head(w, psi, taus) against the targets, and its gradient (of the batch mean
// (1 / B) sum_b loss_b) dw [P], d psi [B, H], with the backward's workspaces: ONE launch computes z, the
// loss, d z and the backward (the forward kernel's z is never needed), then the partials' ordered sum.
ffi::Error IqnLossImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> psi,
                       ffi::Buffer<ffi::F32> taus, ffi::Buffer<ffi::F32> targets, int64_t n_cos, int64_t hidden,
                       int64_t n_quantiles, int64_t chunks, int64_t grid, float kappa,
                       ffi::ResultBuffer<ffi::F32> loss_b, ffi::ResultBuffer<ffi::F32> dw,
                       ffi::ResultBuffer<ffi::F32> dpsi, ffi::ResultBuffer<ffi::F32> part,
                       ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  return ByShape(n_cos, hidden, [&](auto kc, auto hc) -> ffi::Error {
    constexpr int K = decltype(kc)::value, H = decltype(hc)::value;
    using S = Layout<K, H, true>;
    Dims d;
    JAXFOX_RETURN_IF_ERROR(CheckInputs(w, psi, taus, n_cos, hidden, n_quantiles, S::kPpad, &d));
    if (targets.dimensions().size() != 2 || targets.dimensions()[0] != d.B || targets.dimensions()[1] < 1) {
      return InvalidArgument("iqn_loss: targets must be [B, N'] with B = " + std::to_string(d.B) +
                             " and N' >= 1, got " + DimsToString(targets.dimensions()));
    }
    const int64_t nt = targets.dimensions()[1];
    if (d.B * nt > 0x7fffffff) return InvalidArgument("iqn_loss: B * N' must be < 2^31");
    if (!(kappa > 0.f) || !std::isfinite(kappa)) return InvalidArgument("iqn_loss: kappa must be finite and > 0");
    if (!HasShape(*loss_b, {d.B})) {
      return InvalidArgument("iqn_loss: loss_b must be [B], got " + DimsToString(loss_b->dimensions()));
    }
    JAXFOX_RETURN_IF_ERROR(CheckGradOutputs(d, H, S::kPpad, grid, chunks, *dw, *dpsi, *part, *ws));
    const double count = static_cast<double>(d.B) * static_cast<double>(nt);  // B = 0: no launch
    const float dz_scale = count > 0 ? static_cast<float>(1.0 / count) : 0.f;
    return LaunchAndReduce<K, H>(
        stream, "iqn_loss", "iqn_loss", d, iqn_head_kernel<K, H, true, false, true>, grid, chunks,
        part->typed_data(), ws->typed_data(), dw->typed_data(), w.typed_data(), psi.typed_data(), taus.typed_data(),
        static_cast<const float*>(nullptr), static_cast<int>(d.B), static_cast<int>(d.N), static_cast<int>(d.spt),
        static_cast<int>(d.tiles), static_cast<float*>(nullptr), dpsi->typed_data(), static_cast<float*>(nullptr),
        part->typed_data(), targets.typed_data(), static_cast<int>(nt), kappa, dz_scale, loss_b->typed_data());
  });
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iqn_head_fwd, jaxfox::IqnHeadFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // psi [B, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // taus [B, N]
                                  .Attr<int64_t>("n_cos")
                                  .Attr<int64_t>("hidden")
                                  .Attr<int64_t>("n_quantiles")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // z [B, N]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iqn_head_bwd, jaxfox::IqnHeadBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // psi [B, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // taus [B, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // dz [B, N]
                                  .Attr<int64_t>("n_cos")
                                  .Attr<int64_t>("hidden")
                                  .Attr<int64_t>("n_quantiles")
                                  .Attr<int64_t>("chunks")
                                  .Attr<int64_t>("grid")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw [P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dpsi [B, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dtaus [B, N] or [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: per-block partials
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_iqn_loss, jaxfox::IqnLossImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // psi [B, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // taus [B, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // targets [B, N']
                                  .Attr<int64_t>("n_cos")
                                  .Attr<int64_t>("hidden")
                                  .Attr<int64_t>("n_quantiles")
                                  .Attr<int64_t>("chunks")
                                  .Attr<int64_t>("grid")
                                  .Attr<float>("kappa")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // loss_b [B]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw [P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dpsi [B, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: per-block partials
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
