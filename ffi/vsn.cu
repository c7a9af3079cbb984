// vsn: the m per-variable GRNs of a variable selection network, forward and backward kernels and
// their XLA FFI handlers (targets jaxfox_vsn_grn_fwd, jaxfox_vsn_grn_bwd). Math: jaxfox/grn.py and
// jaxfox/vsn.py (TFT eqs. 2-8, google-research gated_residual_network); OPS.md "GRN, GLU, VSN".
//
// Per row r (of R) and variable j (of m), x = xs[r, j, :] (d values), with variable j's weights:
//   a2 = x W2 + b2,  e2 = ELU(a2)               [H]
//   e1 = e2 W1 + b1                              [H]
//   g4 = e1 W4 + b4, g5 = e1 W5 + b5             [O]
//   z  = s + g4 * sigmoid(g5),  s = x Ws + bs (d != O) or x (d == O)
//   y  = LayerNorm(z) = zhat * gamma + beta,  zhat = dev * rstd (dev, rstd: jaxfox.grn.layer_norm's
//        shifted passes: dlt = z - z[0], dev = dlt - mean(dlt), dev -= mean(dev), var = mean(dev^2))
// The VSN combines them as out[r] = sum_j v[r, j] y[r, j, :] (XLA code after the forward kernel). The
// backward kernel takes v [R, m] and dout = d out [R, O], not the [R, m, O] cotangent of y:
//   dy = v[r, j] * dout[r, :]  (formed in registers),  dv[r, j] = sum_o dout[r, o] y[r, j, o]  (an output)
// Backward, from dy:
//   gy = dy * gamma,  dz = rstd (gy - mean(gy) - zhat mean(gy zhat))
//   dg4 = dz sigmoid(g5),  dg5 = dz g4 sigmoid(g5) (1 - sigmoid(g5))
//   de1 = dg4 W4^T + dg5 W5^T,  da2 = (de1 W1^T) ELU'(a2)   (ELU'(a2) = 1 if e2 > 0 else e2 + 1)
//   dx  = da2 W2^T + (dz Ws^T or dz)
//   dW2 = x^T da2, dW1 = e2^T de1, dW4 = e1^T dg4, dW5 = e1^T dg5, dWs = x^T dz, db* = column sums,
//   dgamma = sum dy zhat, dbeta = sum dy    (sums over the rows)
//
// Kernels: one CTA of 256 threads per (run of consecutive 64-row tiles, variable j, instance v; the
// forward sizes its runs so that the grid is about one wave); the variable's weights are staged in
// shared memory once per CTA (row stride N + 1, odd, so that the transposed
// products of the backward read them without bank conflicts), activations are kept k-major
// ([width][kTRp] floats) so each thread reads 4 rows with one float4. Every product is a small
// register-tiled GEMM: thread (rg, cl) computes rows 4 rg .. 4 rg + 3 and columns cl, cl + 16.
// The LayerNorm of a row is computed by the 16 threads that hold it (shuffles inside a half warp).
// The backward CTA recomputes the forward of its rows (no residuals besides x and the weights),
// loops over `tiles_per_block` consecutive row tiles, and accumulates the parameter gradient of
// them in registers (4 x 4 tiles of each dW, column sums for the biases, gamma and beta), each
// element summed over the rows in a fixed order, then writes one partial row [m * P] per CTA; the
// partials are summed over the CTAs by LaunchReduceAxis0 (reduce.cu's fixed order) in the same
// handler. No atomics: bitwise deterministic, and a row's outputs do not depend on the other rows.
// Widths are limited to d, H, O <= kMaxWidth (jaxfox/vsn.py runs the XLA reference otherwise).
#include <algorithm>
#include <cmath>

#include "common.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kRowTile = 64;              // rows per tile (jaxfox/vsn.py _ROW_TILE)
constexpr int kTRp = kRowTile + 4;        // row stride of the k-major activation arrays (float4 aligned)
constexpr int kMaxWidth = 32;             // d, H, O <= kMaxWidth (jaxfox/vsn.py KERNEL_MAX_WIDTH)
constexpr int kMaxMats = 5;               // parameter-gradient matrices: dW2, dW1, dW4, dW5, dWs
constexpr int kTilesPerThread = 2;        // 4 x 4 dW tiles per thread: at most 320 tiles at widths 32


using ParamLayout = GrnParamLayout;  // variable j's row of the flat [m, P] matrix (common.h), I = d

// Shared-memory layout (offsets in floats, each a multiple of 4). Weights W [K][N] are stored with
// row stride N + 1; activations are k-major [rows][kTRp] with rows padded to a multiple of 4.
struct SmemLayout {
  int w2, w1, w4, w5, ws;          // weights
  int b2, b1, b4, b5, bs, gamma, beta;
  int x, e2, e1;                   // x^T [Round4(d)], e2^T, e1^T [Round4(H)]
  int dg4, dg5, dz, de1, da2;      // backward: [Round4(O)] x 3, [Round4(H)] x 2
  int scratch;                     // backward: [2][16][O] dgamma / dbeta partials of the 16 row groups
  int total;
};

__host__ __device__ inline SmemLayout MakeSmemLayout(int d, int H, int O, bool skip, bool bwd) {
  SmemLayout S;
  int o = 0;
  auto take = [&o](int n) { const int at = o; o += Round4(n); return at; };
  S.w2 = take(d * (H + 1));
  S.w1 = take(H * (H + 1));
  S.w4 = take(H * (O + 1));
  S.w5 = take(H * (O + 1));
  S.ws = take(skip ? d * (O + 1) : 0);
  S.b2 = take(H); S.b1 = take(H); S.b4 = take(O); S.b5 = take(O); S.bs = take(skip ? O : 0);
  S.gamma = take(O); S.beta = take(O);
  S.x = take(Round4(d) * kTRp);
  S.e2 = take(Round4(H) * kTRp);
  S.e1 = take(Round4(H) * kTRp);
  S.dg4 = S.dg5 = S.dz = S.de1 = S.da2 = S.scratch = o;
  if (bwd) {
    S.dg4 = take(Round4(O) * kTRp);
    S.dg5 = take(Round4(O) * kTRp);
    S.dz = take(Round4(O) * kTRp);
    S.de1 = take(Round4(H) * kTRp);
    S.da2 = take(Round4(H) * kTRp);
    S.scratch = take(2 * 16 * O);
  }
  S.total = o;
  return S;
}

struct StackDims {
  int64_t V = -1, R = 0, m = 0, P = 0;
  int d = 0, H = 0, O = 0;
  bool skip = false;
  float eps = 1e-5f;
};

// The kernels are instantiated for kHO = kMaxWidth (H = O = 32, the main job's VSN: every product width a
// compile-time constant, so the product loops have no column predicates and constant strides) and for kHO = 0
// (any widths, read from D at run time).
template <int kHO>
__device__ __forceinline__ int Hidden(const StackDims& D) { return kHO ? kHO : D.H; }
template <int kHO>
__device__ __forceinline__ int Output(const StackDims& D) { return kHO ? kHO : D.O; }
inline bool FixedWidths(const StackDims& D) { return D.H == kMaxWidth && D.O == kMaxWidth; }  // kHO = kMaxWidth

__device__ __forceinline__ float HalfWarpSum(float v) {  // sum over the 16 lanes of a half warp
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Stages W [K][N] (row-major at src) into dst with row stride N + 1.
__device__ __forceinline__ void StageMatrix(float* dst, const float* __restrict__ src, int K, int N) {
  for (int idx = threadIdx.x; idx < K * N; idx += kThreads) {
    const int k = idx / N, n = idx - k * N;
    dst[k * (N + 1) + n] = __ldg(src + idx);
  }
}

__device__ __forceinline__ void StageVector(float* dst, const float* __restrict__ src, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) dst[i] = __ldg(src + i);
}

// Stages variable j's weights (wj: its row of the flat [m, P] matrix) into the CTA's shared memory.
__device__ __forceinline__ void StageWeights(float* sm, const SmemLayout& S, const float* __restrict__ wj,
                                             const ParamLayout& L, int d, int H, int O, bool skip) {
  StageMatrix(sm + S.w2, wj + L.w2, d, H);
  StageMatrix(sm + S.w1, wj + L.w1, H, H);
  StageMatrix(sm + S.w4, wj + L.w4, H, O);
  StageMatrix(sm + S.w5, wj + L.w5, H, O);
  if (skip) {
    StageMatrix(sm + S.ws, wj + L.ws, d, O);
    StageVector(sm + S.bs, wj + L.bs, O);
  }
  StageVector(sm + S.b2, wj + L.b2, H);
  StageVector(sm + S.b1, wj + L.b1, H);
  StageVector(sm + S.b4, wj + L.b4, O);
  StageVector(sm + S.b5, wj + L.b5, O);
  StageVector(sm + S.gamma, wj + L.gamma, O);
  StageVector(sm + S.beta, wj + L.beta, O);
}

// acc[i][c] += sum_{k < K} AT[k][r0 + i] * W[k * ks + col_c * cs], col_0 = cl, col_1 = cl + 16, for the
// columns < N (the others stay untouched). ks = N + 1, cs = 1 reads W [K][N]; ks = 1, cs = K + 1 reads
// the transpose of a staged [N][K] matrix.
__device__ __forceinline__ void TileGemm(const float* AT, int K, const float* W, int ks, int cs, int N, int r0,
                                         int cl, float (&acc)[4][2]) {
  const bool v0 = cl < N, v1 = cl + 16 < N;
  const float* w0 = W + cl * cs;
  const float* w1 = W + (cl + 16) * cs;
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(AT + k * kTRp + r0);
    const float b0 = v0 ? w0[k * ks] : 0.f;
    const float b1 = v1 ? w1[k * ks] : 0.f;
    acc[0][0] = fmaf(a.x, b0, acc[0][0]); acc[0][1] = fmaf(a.x, b1, acc[0][1]);
    acc[1][0] = fmaf(a.y, b0, acc[1][0]); acc[1][1] = fmaf(a.y, b1, acc[1][1]);
    acc[2][0] = fmaf(a.z, b0, acc[2][0]); acc[2][1] = fmaf(a.z, b1, acc[2][1]);
    acc[3][0] = fmaf(a.w, b0, acc[3][0]); acc[3][1] = fmaf(a.w, b1, acc[3][1]);
  }
}

// acc[i][c] += b[col_c] for the columns < N (after the product, as XLA's x @ W + b rounds).
__device__ __forceinline__ void AddBias(const float* b, int N, int cl, float (&acc)[4][2]) {
  const float b0 = cl < N ? b[cl] : 0.f, b1 = cl + 16 < N ? b[cl + 16] : 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) { acc[i][0] += b0; acc[i][1] += b1; }
}

__device__ __forceinline__ void InitZero(float (&acc)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) { acc[i][0] = 0.f; acc[i][1] = 0.f; }
}

// AT[c][r0 .. r0 + 3] = v[.][c] for the columns c < Np (Round4 of the width); columns >= N get 0.
__device__ __forceinline__ void StoreTile(float* AT, int N, int Np, int r0, int cl, const float (&v)[4][2]) {
#pragma unroll
  for (int cc = 0; cc < 2; ++cc) {
    const int c = cl + 16 * cc;
    if (c < Np) {
      const bool ok = c < N;
      *reinterpret_cast<float4*>(AT + c * kTRp + r0) =
          make_float4(ok ? v[0][cc] : 0.f, ok ? v[1][cc] : 0.f, ok ? v[2][cc] : 0.f, ok ? v[3][cc] : 0.f);
    }
  }
}

// Loads x rows [row0, row0 + 64) of variable j into xT[k][r] (zeros for rows >= R and k >= d).
__device__ __forceinline__ void LoadX(float* xT, const float* __restrict__ x, int64_t row0, int64_t R, int64_t m,
                                      int64_t j, int d) {
  const int dp = Round4(d);
  for (int idx = threadIdx.x; idx < kRowTile * dp; idx += kThreads) {
    const int r = idx / dp, k = idx - r * dp;
    const int64_t row = row0 + r;
    xT[k * kTRp + r] = (row < R && k < d) ? __ldg(x + (row * m + j) * d + k) : 0.f;
  }
}

// The forward of one row tile, up to the LayerNorm: fills S.x, S.e2, S.e1 and returns, for the thread's
// 4 rows x 2 columns, g4, sigmoid(g5), zhat and rstd. Starts after the weights are staged (its first barrier
// orders them); the callers' next barrier orders what follows.
struct TileFwd {
  float g4[4][2], sg5[4][2], zhat[4][2], rstd[4];  // sg5 = sigmoid(g5), once for the forward and the backward
};

template <int kHO>
__device__ __forceinline__ void ForwardTile(float* sm, const SmemLayout& S, const float* __restrict__ x, int64_t row0,
                                            const StackDims& D, int64_t j, int r0, int cl, TileFwd& t) {
  const int d = D.d, H = Hidden<kHO>(D), O = Output<kHO>(D);
  LoadX(sm + S.x, x, row0, D.R, D.m, j, d);
  __syncthreads();
  float acc[4][2];
  InitZero(acc);
  TileGemm(sm + S.x, d, sm + S.w2, H + 1, 1, H, r0, cl, acc);
  AddBias(sm + S.b2, H, cl, acc);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) acc[i][c] = acc[i][c] > 0.f ? acc[i][c] : expm1f(acc[i][c]);
  StoreTile(sm + S.e2, H, Round4(H), r0, cl, acc);
  __syncthreads();
  InitZero(acc);
  TileGemm(sm + S.e2, H, sm + S.w1, H + 1, 1, H, r0, cl, acc);
  AddBias(sm + S.b1, H, cl, acc);
  StoreTile(sm + S.e1, H, Round4(H), r0, cl, acc);
  __syncthreads();
  InitZero(t.g4);
  InitZero(t.sg5);
  TileGemm(sm + S.e1, H, sm + S.w4, O + 1, 1, O, r0, cl, t.g4);
  TileGemm(sm + S.e1, H, sm + S.w5, O + 1, 1, O, r0, cl, t.sg5);
  AddBias(sm + S.b4, O, cl, t.g4);
  AddBias(sm + S.b5, O, cl, t.sg5);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) t.sg5[i][c] = Sigmoid(t.sg5[i][c]);
  float z[4][2];
  if (D.skip) {
    InitZero(z);
    TileGemm(sm + S.x, d, sm + S.ws, O + 1, 1, O, r0, cl, z);
    AddBias(sm + S.bs, O, cl, z);
  } else {  // d == O: identity skip
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = cl + 16 * c;
#pragma unroll
      for (int i = 0; i < 4; ++i) z[i][c] = col < O ? sm[S.x + col * kTRp + r0 + i] : 0.f;
    }
  }
  const bool v0 = cl < O, v1 = cl + 16 < O;
  const float inv_o = 1.f / static_cast<float>(O);
  const int lead = (threadIdx.x & 31) & 16;  // lane holding column 0 of this half warp's rows
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float z0 = z[i][0] + t.g4[i][0] * t.sg5[i][0];
    const float z1 = z[i][1] + t.g4[i][1] * t.sg5[i][1];
    const float x0 = __shfl_sync(0xffffffffu, z0, lead);
    float d0 = v0 ? z0 - x0 : 0.f, d1 = v1 ? z1 - x0 : 0.f;
    const float mean = HalfWarpSum(d0 + d1) * inv_o;
    d0 = v0 ? d0 - mean : 0.f;
    d1 = v1 ? d1 - mean : 0.f;
    const float corr = HalfWarpSum(d0 + d1) * inv_o;
    d0 = v0 ? d0 - corr : 0.f;
    d1 = v1 ? d1 - corr : 0.f;
    const float var = HalfWarpSum(d0 * d0 + d1 * d1) * inv_o;
    const float rstd = rsqrtf(var + D.eps);
    t.rstd[i] = rstd;
    t.zhat[i][0] = d0 * rstd;
    t.zhat[i][1] = d1 * rstd;
  }
}

constexpr int kFwdBlocksPerSm = 3;  // the forward's launch bound

template <int kHO>
__global__ void __launch_bounds__(kThreads, kFwdBlocksPerSm)
vsn_grn_fwd_kernel(const float* __restrict__ w, const float* __restrict__ x, const __grid_constant__ StackDims D,
                   const __grid_constant__ ParamLayout L, const __grid_constant__ SmemLayout S, int tiles_per_block,
                   float* __restrict__ y) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int64_t j = blockIdx.y, v = blockIdx.z;
  const int d = D.d, H = Hidden<kHO>(D), O = Output<kHO>(D);
  const float* wj = w + (v * D.m + j) * D.P;
  StageWeights(sm, S, wj, L, d, H, O, D.skip);
  const int rg = threadIdx.x >> 4, cl = threadIdx.x & 15, r0 = 4 * rg;
  const int64_t tiles = (D.R + kRowTile - 1) / kRowTile;
  float* yv = y + v * D.R * D.m * O;
  for (int tt = 0; tt < tiles_per_block; ++tt) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + tt;
    if (tile >= tiles) break;
    const int64_t row0 = tile * kRowTile;
    TileFwd t;
    ForwardTile<kHO>(sm, S, x + v * D.R * D.m * d, row0, D, j, r0, cl, t);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = cl + 16 * c;
      if (col >= O) continue;
      const float g = sm[S.gamma + col], b = sm[S.beta + col];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = row0 + r0 + i;
        if (row < D.R) yv[(row * D.m + j) * O + col] = fmaf(t.zhat[i][c], g, b);
      }
    }
    __syncthreads();  // the next tile's LoadX overwrites x, which this tile's skip path read
  }
}

template <int kHO>
__global__ void __launch_bounds__(kThreads, 2)
vsn_grn_bwd_kernel(const float* __restrict__ w, const float* __restrict__ x, const float* __restrict__ vsel,
                   const float* __restrict__ dout, const __grid_constant__ StackDims D,
                   const __grid_constant__ ParamLayout L, const __grid_constant__ SmemLayout S, int tiles_per_block,
                   float* __restrict__ dx, float* __restrict__ dvsel, float* __restrict__ partial) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int tid = threadIdx.x;
  const int64_t j = blockIdx.y, v = blockIdx.z;
  const int d = D.d, H = Hidden<kHO>(D), O = Output<kHO>(D);
  const float* wj = w + (v * D.m + j) * D.P;
  StageWeights(sm, S, wj, L, d, H, O, D.skip);

  // The thread's parameter-gradient work, fixed for the CTA: up to kTilesPerThread dW tiles, one bias
  // element (column sum of a Q^T array) and one of dgamma / dbeta.
  const int nmat = D.skip ? 5 : 4;
  const int mp[kMaxMats] = {S.x, S.e2, S.e1, S.e1, S.x};
  const int mq[kMaxMats] = {S.da2, S.de1, S.dg4, S.dg5, S.dz};
  const int mk[kMaxMats] = {d, H, H, H, d};
  const int mn[kMaxMats] = {H, H, O, O, O};
  const int mo[kMaxMats] = {L.w2, L.w1, L.w4, L.w5, L.ws};
  const int mb[kMaxMats] = {L.b2, L.b1, L.b4, L.b5, L.bs};
  WTile wt[kTilesPerThread];
  float wacc[kTilesPerThread][4][4];
  AssignWTiles<kTilesPerThread, kThreads>(tid, nmat, mp, mq, mk, mn, mo, wt, wacc);
  int bias_q = -1, bias_out = 0;
  {
    int idx = tid;
    for (int q = 0; q < nmat; ++q) {
      if (bias_q < 0 && idx < mn[q]) { bias_q = mq[q] + idx * kTRp; bias_out = mb[q] + idx; }
      if (bias_q < 0) idx -= mn[q];
    }
  }
  float bias_acc = 0.f, norm_acc = 0.f;

  const int rg = tid >> 4, cl = tid & 15, r0 = 4 * rg;
  const float inv_o = 1.f / static_cast<float>(O);
  const int64_t tiles = (D.R + kRowTile - 1) / kRowTile;
  const float* xv = x + v * D.R * D.m * d;
  const float* vselv = vsel + v * D.R * D.m;
  const float* doutv = dout + v * D.R * O;
  float* dvselv = dvsel + v * D.R * D.m;
  float* dxv = dx + v * D.R * D.m * d;
  for (int tt = 0; tt < tiles_per_block; ++tt) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + tt;
    if (tile >= tiles) break;
    const int64_t row0 = tile * kRowTile;
    TileFwd t;
    ForwardTile<kHO>(sm, S, xv, row0, D, j, r0, cl, t);

    // LayerNorm and GLU backward: dz, dg4, dg5 of the thread's 4 rows x 2 columns.
    float dz[4][2], dg4[4][2], dg5[4][2];
    float pg[2] = {0.f, 0.f}, pb[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + r0 + i;
      const float vrj = row < D.R ? __ldg(vselv + row * D.m + j) : 0.f;
      float gy[2], dyi[2], dvp = 0.f;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = cl + 16 * c;
        const bool ok = col < O && row < D.R;
        const float g = ok ? __ldg(doutv + row * O + col) : 0.f;   // dout[r, col]
        dyi[c] = vrj * g;
        if (col < O) dvp = fmaf(g, fmaf(t.zhat[i][c], sm[S.gamma + col], sm[S.beta + col]), dvp);  // dout * y
        gy[c] = col < O ? dyi[c] * sm[S.gamma + col] : 0.f;
        pg[c] = fmaf(dyi[c], t.zhat[i][c], pg[c]);
        pb[c] += dyi[c];
      }
      const float dv = HalfWarpSum(dvp);
      if (cl == 0 && row < D.R) dvselv[row * D.m + j] = dv;
      const float mg = HalfWarpSum(gy[0] + gy[1]) * inv_o;
      const float mgz = HalfWarpSum(gy[0] * t.zhat[i][0] + gy[1] * t.zhat[i][1]) * inv_o;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = cl + 16 * c;
        dz[i][c] = col < O ? t.rstd[i] * (gy[c] - mg - t.zhat[i][c] * mgz) : 0.f;
        const float sg = t.sg5[i][c];
        dg4[i][c] = dz[i][c] * sg;
        dg5[i][c] = dz[i][c] * t.g4[i][c] * sg * (1.f - sg);
      }
    }
    StoreTile(sm + S.dz, O, Round4(O), r0, cl, dz);
    StoreTile(sm + S.dg4, O, Round4(O), r0, cl, dg4);
    StoreTile(sm + S.dg5, O, Round4(O), r0, cl, dg5);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = cl + 16 * c;
      if (col < O) {
        sm[S.scratch + rg * O + col] = pg[c];
        sm[S.scratch + (16 + rg) * O + col] = pb[c];
      }
    }
    __syncthreads();

    // dgamma (threads < O) and dbeta (O <= tid < 2 O): the 16 row groups' partials, in order.
    if (tid < 2 * O) {
      const int half = tid < O ? 0 : 1, col = tid - half * O;
      float s = 0.f;
      for (int g = 0; g < 16; ++g) s += sm[S.scratch + (half * 16 + g) * O + col];
      norm_acc += s;
    }
    // de1 = dg4 W4^T + dg5 W5^T
    float acc[4][2];
    InitZero(acc);
    TileGemm(sm + S.dg4, O, sm + S.w4, 1, O + 1, H, r0, cl, acc);
    TileGemm(sm + S.dg5, O, sm + S.w5, 1, O + 1, H, r0, cl, acc);
    StoreTile(sm + S.de1, H, Round4(H), r0, cl, acc);
    __syncthreads();

    // da2 = (de1 W1^T) ELU'(a2)
    InitZero(acc);
    TileGemm(sm + S.de1, H, sm + S.w1, 1, H + 1, H, r0, cl, acc);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = cl + 16 * c;
      if (col < H) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float e2 = sm[S.e2 + col * kTRp + r0 + i];
          acc[i][c] *= e2 > 0.f ? 1.f : e2 + 1.f;
        }
      }
    }
    StoreTile(sm + S.da2, H, Round4(H), r0, cl, acc);
    __syncthreads();

    // dx = da2 W2^T + (dz Ws^T or dz)
    if (d <= 4) {
      // Narrow output (the main job's d = 4): thread (c, r) = (tid / 64, tid % 64) sums row r's column c over
      // k in the order of the wide product below (the W2 part, then the skip part), so both give the same bits;
      // the 16-column register tiles of the wide product would leave 3/4 of the lanes idle.
      const int r = tid & (kRowTile - 1), c = tid >> 6;
      if (c < d) {
        float a = 0.f;
        const float* w2c = sm + S.w2 + c * (H + 1);
        for (int k = 0; k < H; ++k) a = fmaf(sm[S.da2 + k * kTRp + r], w2c[k], a);
        if (D.skip) {
          const float* wsc = sm + S.ws + c * (O + 1);
          for (int k = 0; k < O; ++k) a = fmaf(sm[S.dz + k * kTRp + r], wsc[k], a);
        } else {
          a += sm[S.dz + c * kTRp + r];
        }
        const int64_t row = row0 + r;
        if (row < D.R) dxv[(row * D.m + j) * d + c] = a;
      }
    } else {
      InitZero(acc);
      TileGemm(sm + S.da2, H, sm + S.w2, 1, H + 1, d, r0, cl, acc);
      if (D.skip) {
        TileGemm(sm + S.dz, O, sm + S.ws, 1, O + 1, d, r0, cl, acc);
      } else {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = cl + 16 * c;
          if (col < d) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i][c] += sm[S.dz + col * kTRp + r0 + i];
          }
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = cl + 16 * c;
        if (col >= d) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t row = row0 + r0 + i;
          if (row < D.R) dxv[(row * D.m + j) * d + col] = acc[i][c];
        }
      }
    }

    // Parameter gradients of the tile's rows (rows >= R have zero Q^T columns).
    AccumulateWTiles<kTilesPerThread, kRowTile, kTRp>(sm, wt, wacc);
    if (bias_q >= 0) {
      float s = 0.f;
      for (int r = 0; r < kRowTile; r += 4) {
        const float4 q = *reinterpret_cast<const float4*>(sm + bias_q + r);
        s += (q.x + q.y) + (q.z + q.w);
      }
      bias_acc += s;
    }
    __syncthreads();  // the next tile overwrites x, e2, e1 and the gradient arrays
  }

  // One partial row [m * P] per CTA: every parameter element written by exactly one thread.
  float* out = partial + ((v * gridDim.x + blockIdx.x) * D.m + j) * D.P;
  WriteWTiles(out, wt, wacc);
  if (bias_q >= 0) out[bias_out] = bias_acc;
  if (tid < 2 * O) out[(tid < O ? L.gamma : L.beta - O) + tid] = norm_acc;
}

// Shared checks of both handlers: w [.., m, P], x [.., R, m, d] (float32), the widths and eps.
ffi::Error CheckStack(const ffi::Buffer<ffi::F32>& w, const ffi::Buffer<ffi::F32>& x, int64_t hidden_size,
                      int64_t output_size, float eps, StackDims* D, ParamLayout* L) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 3) return InvalidArgument("vsn: x must have rank >= 3 [R, m, d], got " + DimsToString(xd));
  if (wd.size() < 2) return InvalidArgument("vsn: w must have rank >= 2 [m, P], got " + DimsToString(wd));
  D->R = xd[xd.size() - 3];
  D->m = xd[xd.size() - 2];
  const int64_t d = xd[xd.size() - 1];
  if (d < 1 || d > kMaxWidth || hidden_size < 1 || hidden_size > kMaxWidth || output_size < 1 ||
      output_size > kMaxWidth) {
    return InvalidArgument("vsn: widths d=" + std::to_string(d) + ", hidden_size=" + std::to_string(hidden_size) +
                           ", output_size=" + std::to_string(output_size) + " must be in [1, " +
                           std::to_string(kMaxWidth) + "]");
  }
  if (!(eps > 0.f) || !std::isfinite(eps)) return InvalidArgument("vsn: eps must be a finite float > 0");
  D->d = static_cast<int>(d);
  D->H = static_cast<int>(hidden_size);
  D->O = static_cast<int>(output_size);
  D->skip = D->d != D->O;
  D->eps = eps;
  *L = MakeGrnParamLayout(D->d, D->H, D->O, D->skip);
  D->P = L->P;
  D->V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(w, "vsn: w", {D->m, D->P}, &D->V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(x, "vsn: x", {D->R, D->m, d}, &D->V));
  if (D->V > 65535 || D->m > 65535) return InvalidArgument("vsn: more than 65535 variables or batched instances");
  if (CeilDiv(D->R, kRowTile) > 0x7fffffff) return InvalidArgument("vsn: too many rows");
  return ffi::Error::Success();
}


// FFI target jaxfox_vsn_grn_fwd: w [.., m, P], x [.., R, m, d] -> y [.., R, m, O] (all float32).
ffi::Error VsnGrnFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x, int64_t hidden_size,
                         int64_t output_size, float eps, ffi::ResultBuffer<ffi::F32> y) {
  ClearStaleCudaError();
  StackDims D;
  ParamLayout L;
  JAXFOX_RETURN_IF_ERROR(CheckStack(w, x, hidden_size, output_size, eps, &D, &L));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*y, "vsn: y", {D.R, D.m, D.O}, &D.V));
  if (D.V == 0 || D.R == 0 || D.m == 0) return ffi::Error::Success();
  const SmemLayout S = MakeSmemLayout(D.d, D.H, D.O, D.skip, false);
  const int64_t bytes = static_cast<int64_t>(S.total) * 4;
  const auto kernel = FixedWidths(D) ? vsn_grn_fwd_kernel<kMaxWidth> : vsn_grn_fwd_kernel<0>;
  JAXFOX_RETURN_IF_ERROR(PrepareSmem("vsn", kernel, bytes));
  // Row tiles per CTA: enough that the grid is about one wave of kFwdBlocksPerSm CTAs an SM, so each CTA
  // stages its variable's weights once for several tiles (a row's result does not depend on the tiling).
  const int64_t tiles = CeilDiv(D.R, kRowTile);
  const int64_t slots = std::max<int64_t>(1, int64_t(GetDeviceInfo().sm_count) * kFwdBlocksPerSm);
  const int64_t per = std::max<int64_t>(1, CeilDiv(tiles * D.m * D.V, slots));
  const int64_t blocks = CeilDiv(tiles, std::min(per, tiles));
  if (blocks > 0x7fffffff) return InvalidArgument("vsn: too many row tiles");
  dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(D.m), static_cast<unsigned>(D.V));
  kernel<<<grid, kThreads, bytes, stream>>>(w.typed_data(), x.typed_data(), D, L, S,
                                            static_cast<int>(CeilDiv(tiles, blocks)), y->typed_data());
  return LastCudaError("vsn_grn_fwd");
}

// FFI target jaxfox_vsn_grn_bwd: (w, x, v [.., R, m], dout [.., R, O]) -> dw [.., m, P], dx [.., R, m, d],
// dv [.., R, m], and the workspaces partials [.., blocks, m * P] (blocks = ceil(ceil(R / 64) / tiles_per_block))
// and chunk partials [.., chunks * m * P] (or [.., 0] when chunks == 1).
ffi::Error VsnGrnBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> vsel, ffi::Buffer<ffi::F32> dout, int64_t hidden_size,
                         int64_t output_size, float eps, int64_t tiles_per_block, int64_t chunks,
                         ffi::ResultBuffer<ffi::F32> dw, ffi::ResultBuffer<ffi::F32> dx,
                         ffi::ResultBuffer<ffi::F32> dvsel, ffi::ResultBuffer<ffi::F32> part,
                         ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  StackDims D;
  ParamLayout L;
  JAXFOX_RETURN_IF_ERROR(CheckStack(w, x, hidden_size, output_size, eps, &D, &L));
  JAXFOX_RETURN_IF_ERROR(CheckShape(vsel, "vsn: v", {D.R, D.m}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(dout, "vsn: dout", {D.R, D.O}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dw, "vsn: dw", {D.m, D.P}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dx, "vsn: dx", {D.R, D.m, D.d}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dvsel, "vsn: dv", {D.R, D.m}, &D.V));
  if (tiles_per_block < 1 || tiles_per_block > 0x7fffffff) {
    return InvalidArgument("vsn: tiles_per_block must be >= 1, got " + std::to_string(tiles_per_block));
  }
  const int64_t tiles = CeilDiv(D.R, kRowTile);
  const int64_t blocks = tiles == 0 ? 0 : CeilDiv(tiles, tiles_per_block);
  JAXFOX_RETURN_IF_ERROR(CheckShape(*part, "vsn: partials workspace", {blocks, D.m * D.P}, &D.V));
  if (D.V == 0 || D.m == 0) return ffi::Error::Success();
  if (D.R == 0) {
    cudaMemsetAsync(dw->typed_data(), 0, sizeof(float) * D.V * D.m * D.P, stream);
    return LastCudaError("vsn_grn_bwd (R = 0)");
  }
  if (chunks < 1 || chunks > 65535 || chunks > blocks) {
    return InvalidArgument("vsn: chunks must be in [1, min(blocks, 65535)], got " + std::to_string(chunks));
  }
  const int64_t need = chunks > 1 ? D.V * chunks * D.m * D.P : 0;
  if (static_cast<int64_t>(ws->element_count()) < need) {
    return InvalidArgument("vsn: workspace has " + std::to_string(ws->element_count()) + " elements, needs " +
                           std::to_string(need));
  }
  if (blocks > 0x7fffffff) return InvalidArgument("vsn: too many row tiles");
  const SmemLayout S = MakeSmemLayout(D.d, D.H, D.O, D.skip, true);
  const int64_t bytes = static_cast<int64_t>(S.total) * 4;
  const auto kernel = FixedWidths(D) ? vsn_grn_bwd_kernel<kMaxWidth> : vsn_grn_bwd_kernel<0>;
  JAXFOX_RETURN_IF_ERROR(PrepareSmem("vsn", kernel, bytes));
  dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(D.m), static_cast<unsigned>(D.V));
  kernel<<<grid, kThreads, bytes, stream>>>(w.typed_data(), x.typed_data(), vsel.typed_data(), dout.typed_data(), D,
                                            L, S, static_cast<int>(tiles_per_block), dx->typed_data(),
                                            dvsel->typed_data(), part->typed_data());
  JAXFOX_RETURN_IF_ERROR(LastCudaError("vsn_grn_bwd"));
  // [V, blocks, m * P] -> [V, m * P]: the CTAs' partials added in reduce.cu's fixed order.
  return LaunchReduceAxis0(stream, part->typed_data(), D.V, blocks, D.m * D.P, chunks,
                           chunks > 1 ? ws->typed_data() : nullptr, dw->typed_data());
}

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_vsn_grn_fwd, jaxfox::VsnGrnFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [m, P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [R, m, d]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Attr<float>("eps")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // y [R, m, O]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_vsn_grn_bwd, jaxfox::VsnGrnBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v [R, m]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // dout [R, O]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("tiles_per_block")
                                  .Attr<int64_t>("chunks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw [m, P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dx [R, m, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dv [R, m]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: per-CTA partials
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
