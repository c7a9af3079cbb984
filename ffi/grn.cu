// grn: one gated residual network with small hidden and output widths, forward and backward kernels and
// their XLA FFI handlers (targets jaxfox_grn_fwd, jaxfox_grn_bwd). Math: jaxfox/grn.py (TFT eqs. 2-5,
// google-research gated_residual_network); OPS.md "GRN, GLU, VSN". jaxfox/grn.py runs them for GRNs
// without context whose widths fit (I <= kMaxIn, H <= kMaxHidden, O <= kMaxOut, and the shared memory /
// register-tile limits below): the VSN's selection GRN (I = m d = 192, H = 32, O = m = 48 in the main job)
// and the perception model's head GRN (I = 64, H = O = 32 on B = 32 rows).
//
// Per row r (of R), a = a[r, :] (I values):
//   a2 = a W2 + b2,  e2 = ELU(a2)                 [H]
//   e1 = e2 W1 + b1                                [H]
//   g4 = e1 W4 + b4, g5 = e1 W5 + b5               [O]
//   z  = s + g4 * sigmoid(g5),  s = a Ws + bs (I != O) or a (I == O)
//   y  = LayerNorm(z) = zhat * gamma + beta        (jaxfox.grn.layer_norm's shifted passes)
//   out = y, or softmax(y) over the O entries when softmax = 1 (the VSN's selection weights, TFT eq. 6)
// Backward from the cotangent g of out: dy = g, or with softmax dy = v (g - sum_o v g);
//   gy = dy gamma,  dz = rstd (gy - mean(gy) - zhat mean(gy zhat))
//   dg4 = dz sigmoid(g5),  dg5 = dz g4 sigmoid(g5) (1 - sigmoid(g5))
//   de1 = dg4 W4^T + dg5 W5^T,  da2 = (de1 W1^T) ELU'(a2)   (ELU'(a2) = 1 if e2 > 0 else e2 + 1)
//   da  = da2 W2^T + (dz Ws^T or dz)
//   dW2 = a^T da2, dW1 = e2^T de1, dW4 = e1^T dg4, dW5 = e1^T dg5, dWs = a^T dz, db* = column sums,
//   dgamma = sum dy zhat, dbeta = sum dy    (sums over the rows)
//
// Kernels: one CTA of 256 threads (8 warps) per run of consecutive 32-row tiles (and vmap instance); the
// weights are staged in shared memory once per CTA with an odd row stride, so that both the products
// (lanes reading consecutive columns of a row) and the backward's transposed products (lanes reading
// consecutive rows of a column) are free of bank conflicts. Activations are k-major ([width][kTRp] floats):
// warp w holds rows 4 w .. 4 w + 3 of the tile and reads them with one broadcast float4; lane l computes
// the columns l and l + 32 (widths up to 64; the backward's d a loops over column chunks of 64). A row's
// LayerNorm and softmax are warp reductions. The forward saves each row's e2, e1, g4, g5, zhat and rstd
// (ResLayout) when a backward follows; the backward CTA reads them instead of recomputing the forward
// (which was a quarter of its instructions, ncu, fifteenth session), loops over `tiles_per_block` row tiles (a
// function of the shape only, chosen by jaxfox/grn.py), accumulates the parameter gradient in registers
// (4 x 4 tiles of each dW, up to kWSlots a thread; column sums for the biases, gamma and beta), each element
// summed over the rows in a fixed order, and writes one partial row [P] per CTA; LaunchReduceAxis0 sums the
// partials in a fixed order in the same handler. No atomics: bitwise deterministic, and a row's outputs do not
// depend on the other rows.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common.h"
#include "tensor_core.h"

namespace jaxfox {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = 32;          // rows per tile: 8 warps x 4 rows (jaxfox/grn.py _ROW_TILE)
constexpr int kTRp = kRowTile + 4;    // row stride of the k-major activation arrays (float4 aligned)
constexpr int kMaxIn = 256;           // I (jaxfox/grn.py KERNEL_MAX_INPUT)
constexpr int kMaxHidden = 64;        // H (KERNEL_MAX_HIDDEN): two columns a lane
constexpr int kMaxOut = 64;           // O (KERNEL_MAX_OUTPUT)
constexpr int kWSlots = 6;            // 4 x 4 dW tiles a thread (jaxfox/grn.py _W_SLOTS)
constexpr int kBiasSlots = 2;         // bias / gamma / beta columns a thread: 2 H + 5 O <= 448 <= 512
constexpr int kMats = 5;              // dW2, dW1, dW4, dW5, dWs
static_assert(kMaxHidden <= kThreads && kMaxOut <= kThreads && kMaxIn <= kThreads,
              "StageMatrix and LoadT give each thread one column");

__host__ __device__ inline int Odd(int n) { return n | 1; }  // staged row stride of a [K][n] weight

// The forward's residuals of a row, for the backward: [e2 (H) | e1 (H) | g4 (O) | g5 (O) | zhat (O) | rstd (1)]
// (column offsets; jaxfox/grn.py _res_width mirrors the width).
struct ResLayout {
  int e2, e1, g4, g5, zhat, rstd, width;
  __host__ __device__ ResLayout(int H, int O)
      : e2(0), e1(H), g4(2 * H), g5(2 * H + O), zhat(2 * H + 2 * O), rstd(2 * H + 3 * O), width(2 * H + 3 * O + 1) {}
};

// Shared-memory layout (offsets in floats, each a multiple of 4); jaxfox/grn.py _smem_bytes mirrors it.
struct SmemLayout {
  int w2, ws, w1, w4, w5;              // weights [K][Odd(N)]
  int b2, b1, b4, b5, bs, gamma, beta;
  int a, e2, e1;                       // k-major a^T [Round4(I)], e2^T, e1^T [Round4(H)]
  int dz, dg4, dg5, de1, da2;          // backward: [Round4(O)] x 3, [Round4(H)] x 2
  int scratch;                         // backward: [2][kWarps][O] dgamma / dbeta partials of the warps
  int total;
};

__host__ __device__ inline SmemLayout MakeSmemLayout(int I, int H, int O, bool skip, bool bwd) {
  SmemLayout S;
  int o = 0;
  auto take = [&o](int n) { const int at = o; o += Round4(n); return at; };
  S.w2 = take(I * Odd(H));
  S.ws = take(skip ? I * Odd(O) : 0);
  S.w1 = take(H * Odd(H));
  S.w4 = take(H * Odd(O));
  S.w5 = take(H * Odd(O));
  S.b2 = take(H); S.b1 = take(H); S.b4 = take(O); S.b5 = take(O); S.bs = take(skip ? O : 0);
  S.gamma = take(O); S.beta = take(O);
  S.a = take(Round4(I) * kTRp);
  S.e2 = take(Round4(H) * kTRp);
  S.e1 = take(Round4(H) * kTRp);
  S.dz = S.dg4 = S.dg5 = S.de1 = S.da2 = S.scratch = o;
  if (bwd) {
    S.dz = take(Round4(O) * kTRp);
    S.dg4 = take(Round4(O) * kTRp);
    S.dg5 = take(Round4(O) * kTRp);
    S.de1 = take(Round4(H) * kTRp);
    S.da2 = take(Round4(H) * kTRp);
    S.scratch = take(2 * kWarps * O);
  }
  S.total = o;
  return S;
}

// The 4 x 4 dW tiles of all five matrices (jaxfox/grn.py _dw_tiles mirrors it).
__host__ __device__ inline int DwTiles(int I, int H, int O, bool skip) {
  auto t = [](int K, int N) { return (Round4(K) / 4) * (Round4(N) / 4); };
  return t(I, H) + t(H, H) + 2 * t(H, O) + (skip ? t(I, O) : 0);
}

struct GrnDims {
  int64_t V = -1, R = 0;
  int I = 0, H = 0, O = 0;
  bool skip = false, softmax = false;
  float eps = 1e-5f;
};

// Stages W [K][N] (row-major at src, N <= kThreads) into dst with row stride Odd(N) (asynchronously:
// CpAsyncWaitAll). A thread copies column n of rows k0, k0 + kThreads / N, ...: one division a matrix, not one
// an element (ncu, fifteenth session: the per-element divisions were 11 % of the forward's instructions).
__device__ __forceinline__ void StageMatrix(float* dst, const float* __restrict__ src, int K, int N) {
  const int ld = Odd(N), rows = kThreads / N;
  const int k0 = threadIdx.x / N, n = threadIdx.x - k0 * N;
  if (k0 >= rows) return;
  for (int k = k0; k < K; k += rows) CpAsync4(dst + k * ld + n, src + k * N + n, true);
}

__device__ __forceinline__ void StageVector(float* dst, const float* __restrict__ src, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) CpAsync4(dst + i, src + i, true);
}

__device__ void StageWeights(float* sm, const SmemLayout& S, const float* __restrict__ w, const GrnParamLayout& L,
                             const GrnDims& D) {
  StageMatrix(sm + S.w2, w + L.w2, D.I, D.H);
  StageMatrix(sm + S.w1, w + L.w1, D.H, D.H);
  StageMatrix(sm + S.w4, w + L.w4, D.H, D.O);
  StageMatrix(sm + S.w5, w + L.w5, D.H, D.O);
  if (D.skip) {
    StageMatrix(sm + S.ws, w + L.ws, D.I, D.O);
    StageVector(sm + S.bs, w + L.bs, D.O);
  }
  StageVector(sm + S.b2, w + L.b2, D.H);
  StageVector(sm + S.b1, w + L.b1, D.H);
  StageVector(sm + S.b4, w + L.b4, D.O);
  StageVector(sm + S.b5, w + L.b5, D.O);
  StageVector(sm + S.gamma, w + L.gamma, D.O);
  StageVector(sm + S.beta, w + L.beta, D.O);
}

// acc[i][c] += sum_{k < K} AT[k][r0 + i] * W[k * ks + col_c * cs] with col_c = c0 + lane + 32 c, for the
// columns < N (the others are left as they are). ks = Odd(N), cs = 1 reads a staged W [K][N]; ks = 1,
// cs = Odd(K) reads the transpose of a staged [N][K] matrix. NC = 1 when the second column slot is empty for
// the whole warp (c0 + 32 >= N), so that N <= 32 does not pay for it. The loop has no predicates: a lane
// whose column is >= N reads column 0 (staged, finite) and drops its sums at the end.
template <int NC>
__device__ __forceinline__ void TileGemmCols(const float* AT, int K, const float* W, int ks, int cs, int N, int c0,
                                             int r0, int lane, float (&acc)[4][2]) {
  bool valid[NC];
  const float* wp[NC];
  float s[4][NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int col = c0 + lane + 32 * c;
    valid[c] = col < N;
    wp[c] = W + (valid[c] ? col : 0) * cs;
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i][c] = acc[i][c];
  }
  const float* ap = AT + r0;
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(ap + k * kTRp);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float b = wp[c][k * ks];
      s[0][c] = fmaf(a.x, b, s[0][c]);
      s[1][c] = fmaf(a.y, b, s[1][c]);
      s[2][c] = fmaf(a.z, b, s[2][c]);
      s[3][c] = fmaf(a.w, b, s[3][c]);
    }
  }
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i][c] = valid[c] ? s[i][c] : acc[i][c];
}

__device__ __forceinline__ void TileGemm(const float* AT, int K, const float* W, int ks, int cs, int N, int c0,
                                         int r0, int lane, float (&acc)[4][2]) {
  if (c0 + 32 >= N) {
    TileGemmCols<1>(AT, K, W, ks, cs, N, c0, r0, lane, acc);
  } else {
    TileGemmCols<2>(AT, K, W, ks, cs, N, c0, r0, lane, acc);
  }
}

__device__ __forceinline__ void InitZero(float (&acc)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) { acc[i][0] = 0.f; acc[i][1] = 0.f; }
}

// acc[i][c] += b[col_c] for the columns < N (after the product, as XLA's a @ W + b rounds).
__device__ __forceinline__ void AddBias(const float* b, int N, int lane, float (&acc)[4][2]) {
  const float b0 = lane < N ? b[lane] : 0.f, b1 = lane + 32 < N ? b[lane + 32] : 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) { acc[i][0] += b0; acc[i][1] += b1; }
}

// AT[c][r0 .. r0 + 3] = v[.][c] for the columns c < Round4(N); columns >= N get 0.
__device__ __forceinline__ void StoreTile(float* AT, int N, int r0, int lane, const float (&v)[4][2]) {
  const int Np = Round4(N);
#pragma unroll
  for (int cc = 0; cc < 2; ++cc) {
    const int c = lane + 32 * cc;
    if (c < Np) {
      const bool ok = c < N;
      *reinterpret_cast<float4*>(AT + c * kTRp + r0) =
          make_float4(ok ? v[0][cc] : 0.f, ok ? v[1][cc] : 0.f, ok ? v[2][cc] : 0.f, ok ? v[3][cc] : 0.f);
    }
  }
}

// Loads columns [0, K) of rows [row0, row0 + 32) of a row-major [R][ld] array into dstT[k][r] (zeros for rows
// >= R and k >= K), asynchronously (CpAsyncWaitAll): the tile's a (ld = K = I), or e2 / e1 from the residuals.
// A thread copies column k of rows r0, r0 + kThreads / Round4(K), ... (Round4(K) <= kThreads).
__device__ __forceinline__ void LoadT(float* dstT, const float* __restrict__ src, int ld, int64_t row0, int64_t R,
                                      int K) {
  const int kp = Round4(K), rows = kThreads / kp;
  const int r0 = threadIdx.x / kp, k = threadIdx.x - r0 * kp;
  if (r0 >= rows) return;
  for (int r = r0; r < kRowTile; r += rows) {
    const int64_t row = row0 + r;
    const bool ok = row < R && k < K;
    CpAsync4(dstT + k * kTRp + r, ok ? src + row * ld + k : src, ok);
  }
}

// The forward of one row tile, up to the LayerNorm: fills S.a, S.e2, S.e1 and returns, for the thread's
// 4 rows x 2 columns, g4, g5, zhat and rstd. Starts after the weights are staged (its first barrier
// orders them); the callers' next barrier orders what follows.
struct TileFwd {
  float g4[4][2], g5[4][2], zhat[4][2], rstd[4];
};

__device__ __forceinline__ void ForwardTile(float* sm, const SmemLayout& S, const float* __restrict__ a,
                                            int64_t row0, const GrnDims& D, int r0, int lane, TileFwd& t) {
  const int I = D.I, H = D.H, O = D.O;
  LoadT(sm + S.a, a, I, row0, D.R, I);
  CpAsyncWaitAll();  // this thread's copies (the tile's a, and the weights staged before the first tile)
  __syncthreads();   // everyone's
  float acc[4][2];
  InitZero(acc);
  TileGemm(sm + S.a, I, sm + S.w2, Odd(H), 1, H, 0, r0, lane, acc);
  AddBias(sm + S.b2, H, lane, acc);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) acc[i][c] = acc[i][c] > 0.f ? acc[i][c] : expm1f(acc[i][c]);
  StoreTile(sm + S.e2, H, r0, lane, acc);
  __syncthreads();
  InitZero(acc);
  TileGemm(sm + S.e2, H, sm + S.w1, Odd(H), 1, H, 0, r0, lane, acc);
  AddBias(sm + S.b1, H, lane, acc);
  StoreTile(sm + S.e1, H, r0, lane, acc);
  __syncthreads();
  InitZero(t.g4);
  InitZero(t.g5);
  TileGemm(sm + S.e1, H, sm + S.w4, Odd(O), 1, O, 0, r0, lane, t.g4);
  TileGemm(sm + S.e1, H, sm + S.w5, Odd(O), 1, O, 0, r0, lane, t.g5);
  AddBias(sm + S.b4, O, lane, t.g4);
  AddBias(sm + S.b5, O, lane, t.g5);
  float z[4][2];
  if (D.skip) {
    InitZero(z);
    TileGemm(sm + S.a, I, sm + S.ws, Odd(O), 1, O, 0, r0, lane, z);
    AddBias(sm + S.bs, O, lane, z);
  } else {  // I == O: identity skip
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
#pragma unroll
      for (int i = 0; i < 4; ++i) z[i][c] = col < O ? sm[S.a + col * kTRp + r0 + i] : 0.f;
    }
  }
  const bool v0 = lane < O, v1 = lane + 32 < O;
  const float inv_o = 1.f / static_cast<float>(O);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float z0 = z[i][0] + t.g4[i][0] * Sigmoid(t.g5[i][0]);
    const float z1 = z[i][1] + t.g4[i][1] * Sigmoid(t.g5[i][1]);
    const float x0 = __shfl_sync(0xffffffffu, z0, 0);  // the row's column 0
    float d0 = v0 ? z0 - x0 : 0.f, d1 = v1 ? z1 - x0 : 0.f;
    const float mean = WarpSum(d0 + d1) * inv_o;
    d0 = v0 ? d0 - mean : 0.f;
    d1 = v1 ? d1 - mean : 0.f;
    const float corr = WarpSum(d0 + d1) * inv_o;
    d0 = v0 ? d0 - corr : 0.f;
    d1 = v1 ? d1 - corr : 0.f;
    const float var = WarpSum(d0 * d0 + d1 * d1) * inv_o;
    const float rstd = rsqrtf(var + D.eps);
    t.rstd[i] = rstd;
    t.zhat[i][0] = d0 * rstd;
    t.zhat[i][1] = d1 * rstd;
  }
}

// y = zhat gamma + beta of the thread's 4 rows x 2 columns, or softmax(y) over the row's O columns
// (max subtracted; columns >= O give 0).
__device__ __forceinline__ void Output(const float* sm, const SmemLayout& S, const GrnDims& D, int lane,
                                       const TileFwd& t, float (&out)[4][2]) {
  const int O = D.O;
  const bool v0 = lane < O, v1 = lane + 32 < O;
  const float g0 = v0 ? sm[S.gamma + lane] : 0.f, g1 = v1 ? sm[S.gamma + lane + 32] : 0.f;
  const float b0 = v0 ? sm[S.beta + lane] : 0.f, b1 = v1 ? sm[S.beta + lane + 32] : 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float y0 = fmaf(t.zhat[i][0], g0, b0), y1 = fmaf(t.zhat[i][1], g1, b1);
    if (!D.softmax) {
      out[i][0] = y0;
      out[i][1] = y1;
      continue;
    }
    const float mx = WarpMax(fmaxf(v0 ? y0 : -INFINITY, v1 ? y1 : -INFINITY));
    const float e0 = v0 ? expf(y0 - mx) : 0.f, e1 = v1 ? expf(y1 - mx) : 0.f;
    const float sum = WarpSum(e0 + e1);
    out[i][0] = e0 / sum;
    out[i][1] = e1 / sum;
  }
}

// Writes the tile's residuals to res [R][ResLayout width]: e2 and e1 from their k-major arrays, g4, g5, zhat
// and rstd from the thread's registers (lane l: columns l and l + 32, coalesced).
__device__ __forceinline__ void SaveResiduals(const float* sm, const SmemLayout& S, const GrnDims& D, int64_t row0,
                                              int r0, int lane, const TileFwd& t, float* __restrict__ res) {
  const ResLayout RL(D.H, D.O);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + r0 + i;
    if (row >= D.R) continue;
    float* rr = res + row * RL.width;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
      if (col < D.H) {
        rr[RL.e2 + col] = sm[S.e2 + col * kTRp + r0 + i];
        rr[RL.e1 + col] = sm[S.e1 + col * kTRp + r0 + i];
      }
      if (col < D.O) {
        rr[RL.g4 + col] = t.g4[i][c];
        rr[RL.g5 + col] = t.g5[i][c];
        rr[RL.zhat + col] = t.zhat[i][c];
      }
    }
    if (lane == 0) rr[RL.rstd] = t.rstd[i];
  }
}

// The backward's replacement of ForwardTile: a^T, e2^T and e1^T of the tile into shared memory, and the
// thread's g4, g5, zhat and rstd, from a and the forward's residuals (rows >= R and columns >= O get 0, which
// makes their gradient 0 as in ForwardTile). Its barrier orders the staged weights too.
__device__ __forceinline__ void LoadResidualTile(float* sm, const SmemLayout& S, const float* __restrict__ a,
                                                 const float* __restrict__ res, int64_t row0, const GrnDims& D,
                                                 int r0, int lane, TileFwd& t) {
  const ResLayout RL(D.H, D.O);
  LoadT(sm + S.a, a, D.I, row0, D.R, D.I);
  LoadT(sm + S.e2, res + RL.e2, RL.width, row0, D.R, D.H);
  LoadT(sm + S.e1, res + RL.e1, RL.width, row0, D.R, D.H);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + r0 + i;
    const bool ok = row < D.R;
    const float* rr = res + (ok ? row : 0) * RL.width;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
      const bool v = ok && col < D.O;
      t.g4[i][c] = v ? __ldg(rr + RL.g4 + col) : 0.f;
      t.g5[i][c] = v ? __ldg(rr + RL.g5 + col) : 0.f;
      t.zhat[i][c] = v ? __ldg(rr + RL.zhat + col) : 0.f;
    }
    t.rstd[i] = ok ? __ldg(rr + RL.rstd) : 0.f;
  }
  CpAsyncWaitAll();
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1)
grn_fwd_kernel(const float* __restrict__ w, const float* __restrict__ a, const __grid_constant__ GrnDims D,
               const __grid_constant__ GrnParamLayout L, const __grid_constant__ SmemLayout S, int tiles_per_block,
               float* __restrict__ out, float* __restrict__ res) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int64_t v = blockIdx.z;
  StageWeights(sm, S, w + v * L.P, L, D);
  const int lane = threadIdx.x & 31, r0 = 4 * (threadIdx.x >> 5);
  const int64_t tiles = (D.R + kRowTile - 1) / kRowTile;
  const float* av = a + v * D.R * D.I;
  float* ov = out + v * D.R * D.O;
  float* resv = res == nullptr ? nullptr : res + v * D.R * ResLayout(D.H, D.O).width;
  for (int tt = 0; tt < tiles_per_block; ++tt) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + tt;
    if (tile >= tiles) break;
    const int64_t row0 = tile * kRowTile;
    TileFwd t;
    ForwardTile(sm, S, av, row0, D, r0, lane, t);
    float y[4][2];
    Output(sm, S, D, lane, t, y);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
      if (col >= D.O) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = row0 + r0 + i;
        if (row < D.R) ov[row * D.O + col] = y[i][c];
      }
    }
    if (resv != nullptr) SaveResiduals(sm, S, D, row0, r0, lane, t, resv);
    __syncthreads();  // the next tile's LoadT overwrites a, which this tile's skip path read
  }
}

// One column sum of the parameter gradient: a bias (column of a k-major Q^T array), or dgamma / dbeta
// (the warps' partials in the scratch array).
struct BiasSlot {
  int src;         // smem offset of the column (kind 0) or of scratch[half][0][col] (kind 1)
  int out;         // offset in the parameter row
  int kind;        // -1 none, 0 column of a Q^T array, 1 scratch column
};

__global__ void __launch_bounds__(kThreads, 1)
grn_bwd_kernel(const float* __restrict__ w, const float* __restrict__ a, const float* __restrict__ g,
               const float* __restrict__ res, const __grid_constant__ GrnDims D,
               const __grid_constant__ GrnParamLayout L, const __grid_constant__ SmemLayout S, int tiles_per_block,
               float* __restrict__ da, float* __restrict__ partial) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int tid = threadIdx.x;
  const int64_t v = blockIdx.z;
  const int I = D.I, H = D.H, O = D.O;
  StageWeights(sm, S, w + v * L.P, L, D);

  // The thread's parameter-gradient work, fixed for the CTA: up to kWSlots dW tiles and kBiasSlots column
  // sums (biases, gamma, beta).
  const int nmat = D.skip ? kMats : kMats - 1;
  const int mp[kMats] = {S.a, S.e2, S.e1, S.e1, S.a};
  const int mq[kMats] = {S.da2, S.de1, S.dg4, S.dg5, S.dz};
  const int mk[kMats] = {I, H, H, H, I};
  const int mn[kMats] = {H, H, O, O, O};
  const int mo[kMats] = {L.w2, L.w1, L.w4, L.w5, L.ws};
  const int mb[kMats] = {L.b2, L.b1, L.b4, L.b5, L.bs};
  WTile wt[kWSlots];
  float wacc[kWSlots][4][4];
  AssignWTiles<kWSlots, kThreads>(tid, nmat, mp, mq, mk, mn, mo, wt, wacc);
  BiasSlot bs[kBiasSlots];
  float bacc[kBiasSlots];
#pragma unroll
  for (int s = 0; s < kBiasSlots; ++s) {
    bs[s].kind = -1;
    bacc[s] = 0.f;
    int idx = tid + s * kThreads;
    for (int q = 0; q < nmat; ++q) {
      if (bs[s].kind < 0 && idx < mn[q]) bs[s] = BiasSlot{mq[q] + idx * kTRp, mb[q] + idx, 0};
      if (bs[s].kind < 0) idx -= mn[q];
    }
    if (bs[s].kind < 0 && idx < 2 * O) {
      const int half = idx < O ? 0 : 1, col = idx - half * O;
      bs[s] = BiasSlot{S.scratch + half * kWarps * O + col, (half ? L.beta : L.gamma) + col, 1};
    }
  }

  const int warp = tid >> 5, lane = tid & 31, r0 = 4 * warp;
  const float inv_o = 1.f / static_cast<float>(O);
  const int64_t tiles = (D.R + kRowTile - 1) / kRowTile;
  const float* av = a + v * D.R * I;
  const float* gv = g + v * D.R * O;
  const float* resv = res + v * D.R * ResLayout(H, O).width;
  float* dav = da + v * D.R * I;
  for (int tt = 0; tt < tiles_per_block; ++tt) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + tt;
    if (tile >= tiles) break;
    const int64_t row0 = tile * kRowTile;
    TileFwd t;
    LoadResidualTile(sm, S, av, resv, row0, D, r0, lane, t);
    float y[4][2];
    Output(sm, S, D, lane, t, y);  // softmax weights when D.softmax (their gradient needs them)

    // Softmax, LayerNorm and GLU backward: dz, dg4, dg5 of the thread's 4 rows x 2 columns.
    float dz[4][2], dg4[4][2], dg5[4][2];
    float pg[2] = {0.f, 0.f}, pb[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + r0 + i;
      float dy[2], gy[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = lane + 32 * c;
        dy[c] = (col < O && row < D.R) ? __ldg(gv + row * O + col) : 0.f;
      }
      if (D.softmax) {  // dy = v (g - sum_o v g)
        const float vg = WarpSum(y[i][0] * dy[0] + y[i][1] * dy[1]);
        dy[0] = y[i][0] * (dy[0] - vg);
        dy[1] = y[i][1] * (dy[1] - vg);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = lane + 32 * c;
        gy[c] = col < O ? dy[c] * sm[S.gamma + col] : 0.f;
        pg[c] = fmaf(dy[c], t.zhat[i][c], pg[c]);
        pb[c] += dy[c];
      }
      const float mg = WarpSum(gy[0] + gy[1]) * inv_o;
      const float mgz = WarpSum(gy[0] * t.zhat[i][0] + gy[1] * t.zhat[i][1]) * inv_o;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = lane + 32 * c;
        dz[i][c] = col < O ? t.rstd[i] * (gy[c] - mg - t.zhat[i][c] * mgz) : 0.f;
        const float sg = Sigmoid(t.g5[i][c]);
        dg4[i][c] = dz[i][c] * sg;
        dg5[i][c] = dz[i][c] * t.g4[i][c] * sg * (1.f - sg);
      }
    }
    StoreTile(sm + S.dz, O, r0, lane, dz);
    StoreTile(sm + S.dg4, O, r0, lane, dg4);
    StoreTile(sm + S.dg5, O, r0, lane, dg5);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
      if (col < O) {
        sm[S.scratch + warp * O + col] = pg[c];
        sm[S.scratch + (kWarps + warp) * O + col] = pb[c];
      }
    }
    __syncthreads();

    // de1 = dg4 W4^T + dg5 W5^T
    float acc[4][2];
    InitZero(acc);
    TileGemm(sm + S.dg4, O, sm + S.w4, 1, Odd(O), H, 0, r0, lane, acc);
    TileGemm(sm + S.dg5, O, sm + S.w5, 1, Odd(O), H, 0, r0, lane, acc);
    StoreTile(sm + S.de1, H, r0, lane, acc);
    __syncthreads();

    // da2 = (de1 W1^T) ELU'(a2)
    InitZero(acc);
    TileGemm(sm + S.de1, H, sm + S.w1, 1, Odd(H), H, 0, r0, lane, acc);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = lane + 32 * c;
      if (col < H) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float e2 = sm[S.e2 + col * kTRp + r0 + i];
          acc[i][c] *= e2 > 0.f ? 1.f : e2 + 1.f;
        }
      }
    }
    StoreTile(sm + S.da2, H, r0, lane, acc);
    __syncthreads();

    // da = da2 W2^T + (dz Ws^T or dz), in column chunks of 64
    for (int c0 = 0; c0 < I; c0 += 64) {
      InitZero(acc);
      TileGemm(sm + S.da2, H, sm + S.w2, 1, Odd(H), I, c0, r0, lane, acc);
      if (D.skip) {
        TileGemm(sm + S.dz, O, sm + S.ws, 1, Odd(O), I, c0, r0, lane, acc);
      } else {  // I == O
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = c0 + lane + 32 * c;
          if (col < I) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i][c] += sm[S.dz + col * kTRp + r0 + i];
          }
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = c0 + lane + 32 * c;
        if (col >= I) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t row = row0 + r0 + i;
          if (row < D.R) dav[row * I + col] = acc[i][c];
        }
      }
    }

    // Parameter gradients of the tile's rows (rows >= R have zero Q^T columns).
    AccumulateWTiles<kWSlots, kRowTile, kTRp>(sm, wt, wacc);
#pragma unroll
    for (int s = 0; s < kBiasSlots; ++s) {
      if (bs[s].kind == 0) {
        float sum = 0.f;
        for (int r = 0; r < kRowTile; r += 4) {
          const float4 q = *reinterpret_cast<const float4*>(sm + bs[s].src + r);
          sum += (q.x + q.y) + (q.z + q.w);
        }
        bacc[s] += sum;
      } else if (bs[s].kind == 1) {
        float sum = 0.f;
        for (int x = 0; x < kWarps; ++x) sum += sm[bs[s].src + x * O];
        bacc[s] += sum;
      }
    }
    __syncthreads();  // the next tile overwrites a, e2, e1, the gradient arrays and the scratch
  }

  // One partial row [P] per CTA: every parameter element written by exactly one thread.
  float* out = partial + (v * gridDim.x + blockIdx.x) * L.P;
  WriteWTiles(out, wt, wacc);
#pragma unroll
  for (int s = 0; s < kBiasSlots; ++s) {
    if (bs[s].kind >= 0) out[bs[s].out] = bacc[s];
  }
}

// Shared checks of both handlers: w [.., P], a [.., R, I] (float32), the widths, the limits and eps.
ffi::Error CheckGrn(const ffi::Buffer<ffi::F32>& w, const ffi::Buffer<ffi::F32>& a, int64_t hidden_size,
                    int64_t output_size, float eps, int64_t softmax, GrnDims* D, GrnParamLayout* L) {
  auto ad = a.dimensions();
  if (ad.size() < 2) return InvalidArgument("grn: a must have rank >= 2 [R, I], got " + DimsToString(ad));
  D->R = ad[ad.size() - 2];
  const int64_t I = ad[ad.size() - 1];
  if (I < 1 || I > kMaxIn || hidden_size < 1 || hidden_size > kMaxHidden || output_size < 1 ||
      output_size > kMaxOut) {
    return InvalidArgument("grn: widths I=" + std::to_string(I) + ", hidden_size=" + std::to_string(hidden_size) +
                           ", output_size=" + std::to_string(output_size) + " must be in [1, " +
                           std::to_string(kMaxIn) + "], [1, " + std::to_string(kMaxHidden) + "], [1, " +
                           std::to_string(kMaxOut) + "]");
  }
  if (!(eps > 0.f) || !std::isfinite(eps)) return InvalidArgument("grn: eps must be a finite float > 0");
  if (softmax != 0 && softmax != 1) return InvalidArgument("grn: softmax must be 0 or 1");
  D->I = static_cast<int>(I);
  D->H = static_cast<int>(hidden_size);
  D->O = static_cast<int>(output_size);
  D->skip = D->I != D->O;
  D->softmax = softmax == 1;
  D->eps = eps;
  if (DwTiles(D->I, D->H, D->O, D->skip) > kThreads * kWSlots) {
    return InvalidArgument("grn: widths I=" + std::to_string(I) + ", H=" + std::to_string(hidden_size) + ", O=" +
                           std::to_string(output_size) + " need more than " + std::to_string(kThreads * kWSlots) +
                           " 4 x 4 parameter-gradient tiles");
  }
  *L = MakeGrnParamLayout(D->I, D->H, D->O, D->skip);
  D->V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(w, "grn: w", {L->P}, &D->V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(a, "grn: a", {D->R, I}, &D->V));
  if (D->V > 65535) return InvalidArgument("grn: more than 65535 batched instances");
  if (CeilDiv(D->R, kRowTile) > 0x7fffffff) return InvalidArgument("grn: too many rows");
  return ffi::Error::Success();
}

// FFI target jaxfox_grn_fwd: w [.., P], a [.., R, I] -> out [.., R, O]: y, or softmax(y), and res [.., R, W]:
// the residuals for jaxfox_grn_bwd (W = ResLayout(H, O).width), or [.., R, 0] when no backward follows (all
// float32).
ffi::Error GrnFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> a, int64_t hidden_size,
                      int64_t output_size, float eps, int64_t softmax, ffi::ResultBuffer<ffi::F32> out,
                      ffi::ResultBuffer<ffi::F32> res) {
  ClearStaleCudaError();
  GrnDims D;
  GrnParamLayout L;
  JAXFOX_RETURN_IF_ERROR(CheckGrn(w, a, hidden_size, output_size, eps, softmax, &D, &L));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*out, "grn: out", {D.R, D.O}, &D.V));
  const auto rd = res->dimensions();
  const bool save = rd.size() > 0 && rd[rd.size() - 1] != 0;
  JAXFOX_RETURN_IF_ERROR(CheckShape(*res, "grn: res", {D.R, save ? ResLayout(D.H, D.O).width : 0}, &D.V));
  if (D.V == 0 || D.R == 0) return ffi::Error::Success();
  const SmemLayout S = MakeSmemLayout(D.I, D.H, D.O, D.skip, false);
  const int64_t bytes = static_cast<int64_t>(S.total) * 4;
  JAXFOX_RETURN_IF_ERROR(PrepareSmem("grn", grn_fwd_kernel, bytes));
  // Row tiles per CTA: about one wave of one CTA an SM, each staging the weights once for its tiles (a row's
  // result does not depend on the tiling).
  const int64_t tiles = CeilDiv(D.R, kRowTile);
  const int64_t slots = std::max<int64_t>(1, GetDeviceInfo().sm_count);
  const int64_t per = std::max<int64_t>(1, CeilDiv(tiles * D.V, slots));
  const int64_t blocks = CeilDiv(tiles, std::min(per, tiles));
  dim3 grid(static_cast<unsigned>(blocks), 1, static_cast<unsigned>(D.V));
  grn_fwd_kernel<<<grid, kThreads, bytes, stream>>>(w.typed_data(), a.typed_data(), D, L, S,
                                                    static_cast<int>(CeilDiv(tiles, blocks)), out->typed_data(),
                                                    save ? res->typed_data() : nullptr);
  return LastCudaError("grn_fwd");
}

// FFI target jaxfox_grn_bwd: (w, a, g [.., R, O] the cotangent of out, res [.., R, W] jaxfox_grn_fwd's
// residuals) -> dw [.., P], da [.., R, I], and the workspaces partials [.., blocks, P] (blocks =
// ceil(ceil(R / 32) / tiles_per_block)) and chunk partials [.., chunks * P] (or [.., 0] when chunks == 1).
ffi::Error GrnBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> a,
                      ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> res, int64_t hidden_size,
                      int64_t output_size, float eps, int64_t softmax,
                      int64_t tiles_per_block, int64_t chunks, ffi::ResultBuffer<ffi::F32> dw,
                      ffi::ResultBuffer<ffi::F32> da, ffi::ResultBuffer<ffi::F32> part,
                      ffi::ResultBuffer<ffi::F32> ws) {
  ClearStaleCudaError();
  GrnDims D;
  GrnParamLayout L;
  JAXFOX_RETURN_IF_ERROR(CheckGrn(w, a, hidden_size, output_size, eps, softmax, &D, &L));
  JAXFOX_RETURN_IF_ERROR(CheckShape(g, "grn: g", {D.R, D.O}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(res, "grn: res", {D.R, ResLayout(D.H, D.O).width}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dw, "grn: dw", {L.P}, &D.V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*da, "grn: da", {D.R, D.I}, &D.V));
  if (tiles_per_block < 1 || tiles_per_block > 0x7fffffff) {
    return InvalidArgument("grn: tiles_per_block must be >= 1, got " + std::to_string(tiles_per_block));
  }
  const int64_t tiles = CeilDiv(D.R, kRowTile);
  const int64_t blocks = tiles == 0 ? 0 : CeilDiv(tiles, tiles_per_block);
  JAXFOX_RETURN_IF_ERROR(CheckShape(*part, "grn: partials workspace", {blocks, L.P}, &D.V));
  if (D.V == 0) return ffi::Error::Success();
  if (D.R == 0) {
    cudaMemsetAsync(dw->typed_data(), 0, sizeof(float) * D.V * L.P, stream);
    return LastCudaError("grn_bwd (R = 0)");
  }
  if (chunks < 1 || chunks > 65535 || chunks > blocks) {
    return InvalidArgument("grn: chunks must be in [1, min(blocks, 65535)], got " + std::to_string(chunks));
  }
  const int64_t need = chunks > 1 ? D.V * chunks * L.P : 0;
  if (static_cast<int64_t>(ws->element_count()) < need) {
    return InvalidArgument("grn: workspace has " + std::to_string(ws->element_count()) + " elements, needs " +
                           std::to_string(need));
  }
  if (blocks > 0x7fffffff) return InvalidArgument("grn: too many row tiles");
  const SmemLayout S = MakeSmemLayout(D.I, D.H, D.O, D.skip, true);
  const int64_t bytes = static_cast<int64_t>(S.total) * 4;
  JAXFOX_RETURN_IF_ERROR(PrepareSmem("grn", grn_bwd_kernel, bytes));
  dim3 grid(static_cast<unsigned>(blocks), 1, static_cast<unsigned>(D.V));
  grn_bwd_kernel<<<grid, kThreads, bytes, stream>>>(w.typed_data(), a.typed_data(), g.typed_data(),
                                                    res.typed_data(), D, L, S,
                                                    static_cast<int>(tiles_per_block), da->typed_data(),
                                                    part->typed_data());
  JAXFOX_RETURN_IF_ERROR(LastCudaError("grn_bwd"));
  // [V, blocks, P] -> [V, P]: the CTAs' partials added in reduce.cu's fixed order.
  return LaunchReduceAxis0(stream, part->typed_data(), D.V, blocks, L.P, chunks,
                           chunks > 1 ? ws->typed_data() : nullptr, dw->typed_data());
}


// ---------------------------------------------------------------------------------------------------------------
// Tensor-core GRNs (targets jaxfox_grn_tc_fwd, jaxfox_grn_tc_bwd): the wider GRNs the kernels above do not take,
// Hd, O in {32, 64, 128} and I in {16, 32, 64, 128} (the issue's bench shape I = Hd = O = 128 and the VSN's
// per-variable GRNs d = 16, Hd = O = 128), without context. Every product runs in TF32 on mma.sync m16n8k8
// (ffi/tensor_core.h, float32 accumulate): the precision class of XLA's default float32 matmul on the GPU, so
// jaxfox/grn.py uses them only at the default matmul precision. One CTA of 8 warps a (32-row tile, vmap
// instance); each tile's chain of products stays in shared memory (A operands, rounded to TF32 when written;
// row stride K + 4, = 4 mod 8: conflict-free fragment loads); the weights are TF32 values already (rounded by
// jaxfox/grn.py), copied into shared memory in chunks of K (cp.async) for the B fragments. Two CTAs an
// SM (<= 128 registers, <= ~101 KB of shared memory each). The forward writes y and, when a backward follows, the
// residuals e2, e1, g = [g4 | g5], zhat, rstd; the backward writes dx and the row-wise gradients dg, de1, da2,
// dz from which jaxfox/grn.py forms the weight and bias gradients (XLA's GEMMs and column sums), plus each tile's
// [sum dy zhat | sum dy] (rows in increasing order) that reduce_axis0 sums into dgamma | dbeta. No atomics; a row's outputs do not depend on the other rows.
namespace tc {

constexpr int kRows = 32;  // rows of a tile (jaxfox/grn.py _TC_ROWS)
constexpr int kChunk = 16;  // rows of K a staged weight chunk holds (two chunks in flight: Product::Run)
constexpr int kThreads = 256;
constexpr int kFrags = kRows / 16;
static_assert(kThreads / 32 == kMmaWarps, "the warp tilings assume 8 warps");

__host__ __device__ constexpr int Ld(int k) { return k + 4; }  // row stride of a [32, k] tile, = 4 (mod 8)

// Warp tiling of a [32, 16 CB] product: CB >= 8: the 8 warps side by side, each 2 x CB / 8 fragments; CB = 4:
// 2 x 4 warps of one fragment; CB = 2 (1): warps 0..3 (0..1) own one fragment each and the others none
// (Row0 >= kFrags).
template <int CB>
struct TileT {
  static constexpr int kWcw = CB >= kMmaWarps ? kMmaWarps : CB;
  static constexpr int kWrw = kMmaWarps / kWcw;
  static constexpr int kFR = kWrw >= kFrags ? 1 : kFrags / kWrw;
  static constexpr int kFC = CB / kWcw;
  static_assert(kFC * kWcw == CB, "columns do not tile");
  __device__ static int Row0(int warp) { return (warp / kWcw) * kFR; }
  __device__ static int Col0(int warp) { return (warp % kWcw) * kFC; }
};

// Row stride of a staged row-major chunk [kChunk][N]: = 8 (mod 32), conflict-free B loads. A transposed chunk
// [N][kChunk] has row stride kChunk + 4 = 20 (its B loads are conflict-free too).
__host__ __device__ constexpr int LdRow(int n) { return n + 8; }

// acc += A [32, K] (shared, row stride lda) times B [K, N] where B(k, n) = W[k * ldw + n] (kBRow, ldw = N) or
// W[n * ldw + k] (a weight read transposed, ldw = K), W global (TF32 values). The weight goes through the shared
// buffers wb in chunks of K rows (cp.async, see Run; it has barriers, so every thread of the block must call it):
// the B fragments then are conflict-free shared loads (read straight from global memory through the L1 they left
// the products latency-bound: 40 us for the forward at 2048 rows, H100).
template <int N, bool kBRow>
struct Product {
  using T = TileT<N / 16>;
  Frags<T::kFR, T::kFC> acc;
  int r0, c0;
  __device__ __forceinline__ Product(int warp) : r0(T::Row0(warp)), c0(T::Col0(warp)) {
    acc.Zero();
  }
  static constexpr int kLdc = kChunk + 4;  // row stride of a transposed chunk
  static constexpr int kHalf = kBRow ? kChunk * LdRow(N) : N * kLdc;  // floats of one chunk buffer
  // Stages rows k0 .. k0 + kChunk of B into b (row stride LdRow(N), or transposed with row stride kLdc).
  __device__ __forceinline__ void Stage(float* b, const float* __restrict__ W, int ldw, int k0) {
    if (kBRow) {
      constexpr int n4 = N / 4;
      for (int i = threadIdx.x; i < kChunk * n4; i += kThreads) {
        const int kk = i / n4, c = 4 * (i - kk * n4);
        CpAsync16(b + kk * LdRow(N) + c, W + static_cast<int64_t>(k0 + kk) * ldw + c, true);
      }
    } else {
      constexpr int k4 = kChunk / 4;
      for (int i = threadIdx.x; i < N * k4; i += kThreads) {
        const int n = i / k4, c = 4 * (i - n * k4);
        CpAsync16(b + n * kLdc + c, W + static_cast<int64_t>(n) * ldw + k0 + c, true);
      }
    }
    CpAsyncCommit();
  }
  // Streams W through two shared buffers of 16 rows of K each: the copy of the next chunk is in flight while this
  // chunk's MMAs run (one chunk of 32 rows at a time: forward 24.4 vs 22.2 us at 2048 rows, H100; four buffers of
  // 8 rows with one barrier a chunk: 36.8 vs 27.9 us for two of 16 that way, H200).
  __device__ __forceinline__ void Run(const float* A, int lda, const float* __restrict__ W, int ldw, int K,
                                      float* wb, int lane) {
    const int nch = K / kChunk;  // K is a multiple of 16
    __syncthreads();  // the buffers' previous product is read
    Stage(wb, W, ldw, 0);
    for (int ch = 0; ch < nch; ++ch) {
      if (ch + 1 < nch) {
        Stage(wb + ((ch + 1) & 1) * kHalf, W, ldw, (ch + 1) * kChunk);
        CpAsyncWaitGroup<1>();
      } else {
        CpAsyncWaitGroup<0>();
      }
      __syncthreads();  // chunk ch visible to every thread
      WarpMma<T::kFR, T::kFC, true, kBRow>(acc, A + ch * kChunk, lda, wb + (ch & 1) * kHalf,
                                           kBRow ? LdRow(N) : kLdc, r0, c0, kChunk / 8, kFrags, lane);
      __syncthreads();  // chunk ch's buffer is read before chunk ch + 2 is copied into it
    }
  }
  template <typename F>
  __device__ __forceinline__ void Each(int lane, F&& f) const {
    ForEachAccPair(acc, r0, c0, kFrags, lane, f);
  }
};

__device__ __forceinline__ float Elu(float v) { return v > 0.f ? v : expm1f(v); }

// Global row pointers of a 32-row tile: rows >= R are neither read (zeros instead) nor written.
struct Rows {
  int64_t row0, R;
  __device__ __forceinline__ bool Ok(int r) const { return row0 + r < R; }
};

__device__ __forceinline__ void Store2(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

// Loads a [32, K] float32 tile (rows >= R as zeros) into shared memory as TF32, row stride Ld(K) (K % 4 == 0).
__device__ __forceinline__ void LoadTileTf32(float* dst, const float* __restrict__ src, int K, const Rows& rows) {
  const int k4 = K / 4;
  for (int i = threadIdx.x; i < kRows * k4; i += kThreads) {
    const int r = i / k4, c = 4 * (i - r * k4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rows.Ok(r)) v = __ldg(reinterpret_cast<const float4*>(src + (rows.row0 + r) * K + c));
    *reinterpret_cast<float4*>(dst + r * Ld(K) + c) = make_float4(Tf32(v.x), Tf32(v.y), Tf32(v.z), Tf32(v.w));
  }
}

struct FwdArgs {
  const float *x, *w2, *b2, *w1, *b1, *w45, *b45, *ws, *bs, *gamma, *beta;
  float *y, *e2, *e1, *g, *zhat, *rstd;  // residuals nullptr when not saved
  int64_t R;
  int I;
  float eps;
};

// Forward of one (32-row tile, instance): shared memory xs [32][Ld(I)] (TF32 x), hs [32][Ld(max(H, O))] (e2,
// then e1, then z), gs [32][Ld(2 O)] (g = [g4 | g5], float32).
template <int H, int O>
__global__ void __launch_bounds__(kThreads, 2) grn_tc_fwd_kernel(const __grid_constant__ FwdArgs a) {
  constexpr int HO = H > O ? H : O;
  extern __shared__ __align__(16) float sm[];
  const int I = a.I;
  float* xs = sm;
  float* hs = xs + kRows * Ld(I);
  float* gs = hs + kRows * Ld(HO);
  float* wb = gs + kRows * Ld(2 * O);  // two weight chunks: 2 kChunk x LdRow(max(H, 2 O)) floats
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t v = blockIdx.y;
  const Rows rows{static_cast<int64_t>(blockIdx.x) * kRows, a.R};
  const bool skip = I != O;
  const float* x = a.x + v * a.R * I;
  const float* w2 = a.w2 + v * I * H;
  const float* b2 = a.b2 + v * H;
  const float* w1 = a.w1 + v * H * H;
  const float* b1 = a.b1 + v * H;
  const float* w45 = a.w45 + v * H * 2 * O;
  const float* b45 = a.b45 + v * 2 * O;
  const float* ws = skip ? a.ws + v * I * O : nullptr;
  const float* bs = skip ? a.bs + v * O : nullptr;
  const float* gamma = a.gamma + v * O;
  const float* beta = a.beta + v * O;
  const bool save = a.e2 != nullptr;
  const int64_t base = v * a.R + rows.row0;  // the tile's first row in the [V * R] rows of every output

  LoadTileTf32(xs, x, I, rows);
  __syncthreads();

  {  // e2 = ELU(x W2 + b2)
    Product<H, true> p(warp);
    p.Run(xs, Ld(I), w2, H, I, wb, lane);
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      v0 = Elu(v0 + __ldg(b2 + c));
      v1 = Elu(v1 + __ldg(b2 + c + 1));
      Store2(hs + r * Ld(HO) + c, Tf32(v0), Tf32(v1));
      if (save && rows.Ok(r)) Store2(a.e2 + (base + r) * H + c, v0, v1);
    });
  }
  __syncthreads();
  {  // e1 = e2 W1 + b1 (in place: every warp has read e2 before any writes e1)
    Product<H, true> p(warp);
    p.Run(hs, Ld(HO), w1, H, H, wb, lane);
    __syncthreads();
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      v0 += __ldg(b1 + c);
      v1 += __ldg(b1 + c + 1);
      Store2(hs + r * Ld(HO) + c, Tf32(v0), Tf32(v1));
      if (save && rows.Ok(r)) Store2(a.e1 + (base + r) * H + c, v0, v1);
    });
  }
  __syncthreads();
  {  // g = e1 W45 + b45
    Product<2 * O, true> p(warp);
    p.Run(hs, Ld(HO), w45, 2 * O, H, wb, lane);
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      v0 += __ldg(b45 + c);
      v1 += __ldg(b45 + c + 1);
      Store2(gs + r * Ld(2 * O) + c, v0, v1);
      if (save && rows.Ok(r)) Store2(a.g + (base + r) * 2 * O + c, v0, v1);
    });
  }
  __syncthreads();  // gs complete; e1 read by every warp: hs takes z
  if (skip) {  // z = x Ws + bs + g4 sigmoid(g5)
    Product<O, true> p(warp);
    p.Run(xs, Ld(I), ws, O, I, wb, lane);
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      const float* gr = gs + r * Ld(2 * O);
      v0 += __ldg(bs + c) + gr[c] * Sigmoid(gr[O + c]);
      v1 += __ldg(bs + c + 1) + gr[c + 1] * Sigmoid(gr[O + c + 1]);
      Store2(hs + r * Ld(HO) + c, v0, v1);
    });
  } else {  // z = x + g4 sigmoid(g5), x unrounded from global
    for (int i = threadIdx.x; i < kRows * O; i += kThreads) {
      const int r = i / O, c = i - r * O;
      const float* gr = gs + r * Ld(2 * O);
      const float xv = rows.Ok(r) ? __ldg(x + (rows.row0 + r) * I + c) : 0.f;
      hs[r * Ld(HO) + c] = xv + gr[c] * Sigmoid(gr[O + c]);
    }
  }
  __syncthreads();

  // LayerNorm a warp per row (jaxfox.grn.layer_norm's passes: shift by column 0, mean, correction, variance).
  constexpr int kPer = O / 32;  // columns a lane: lane + 32 j
  const float inv_o = 1.f / static_cast<float>(O);
  for (int r = warp; r < kRows; r += kMmaWarps) {
    if (!rows.Ok(r)) break;
    const float* zr = hs + r * Ld(HO);
    float d[kPer];
    const float z0 = zr[0];
#pragma unroll
    for (int j = 0; j < kPer; ++j) d[j] = zr[lane + 32 * j] - z0;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) s += d[j];
    const float mean = WarpSum(s) * inv_o;
    s = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      d[j] -= mean;
      s += d[j];
    }
    const float corr = WarpSum(s) * inv_o;
    s = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      d[j] -= corr;
      s += d[j] * d[j];
    }
    const float var = WarpSum(s) * inv_o;
    const float rstd = rsqrtf(var + a.eps);
    const int64_t row = base + r;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = lane + 32 * j;
      const float zh = d[j] * rstd;
      a.y[row * O + c] = zh * __ldg(gamma + c) + __ldg(beta + c);
      if (save) a.zhat[row * O + c] = zh;
    }
    if (save && lane == 0) a.rstd[row] = rstd;
  }
}

struct BwdArgs {
  const float *dy, *e2, *g, *zhat, *rstd, *gamma, *w45, *w1, *w2, *ws;
  float *dx, *dg, *de1, *da2, *dz, *gb;
  int64_t R, tiles;
  int I;
};

// dx = da2 W2^T + (dz Ws^T or dz) of a tile, N = I columns.
template <int I, int H, int O>
__device__ __forceinline__ void DxProduct(const BwdArgs& a, const float* hs, const float* dzs, const float* w2,
                                          const float* ws, float* wb, const Rows& rows, int64_t base, int warp,
                                          int lane) {
  constexpr int HO = H > O ? H : O;
  Product<I, false> p(warp);
  p.Run(hs, Ld(HO), w2, H, H, wb, lane);
  if (I != O) p.Run(dzs, Ld(O), ws, O, O, wb, lane);
  p.Each(lane, [&](int r, int c, float v0, float v1) {
    if (I == O) {
      v0 += dzs[r * Ld(O) + c];
      v1 += dzs[r * Ld(O) + c + 1];
    }
    if (rows.Ok(r)) Store2(a.dx + (base + r) * I + c, v0, v1);
  });
}

// Backward of one (32-row tile, instance): shared memory dgs [32][Ld(2 O)] (TF32 dg), hs [32][Ld(max(H, O))]
// (TF32 de1, then da2), dzs [32][Ld(O)] (dz: TF32 when it is the dense skip's A operand, else float32).
template <int H, int O>
__global__ void __launch_bounds__(kThreads, 2) grn_tc_bwd_kernel(const __grid_constant__ BwdArgs a) {
  constexpr int HO = H > O ? H : O;
  extern __shared__ __align__(16) float sm[];
  const int I = a.I;
  float* dgs = sm;
  float* hs = dgs + kRows * Ld(2 * O);
  float* dzs = hs + kRows * Ld(HO);
  float* wb = dzs + kRows * Ld(O);  // two transposed weight chunks: max(H, I) x 2 (kChunk + 4) floats
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t v = blockIdx.y;
  const Rows rows{static_cast<int64_t>(blockIdx.x) * kRows, a.R};
  const bool skip = I != O;
  const int64_t base = v * a.R + rows.row0;
  const float* gamma = a.gamma + v * O;
  const float* w45 = a.w45 + v * H * 2 * O;
  const float* w1 = a.w1 + v * H * H;
  const float* w2 = a.w2 + v * I * H;
  const float* ws = skip ? a.ws + v * I * O : nullptr;

  // The tile's [sum dy zhat | sum dy] (gamma, beta), rows in increasing order.
  const int nrows = static_cast<int>(rows.R - rows.row0 < kRows ? rows.R - rows.row0 : kRows);
  for (int c = threadIdx.x; c < 2 * O; c += kThreads) {
    const int col = c < O ? c : c - O;
    float s = 0.f;
    for (int r = 0; r < nrows; ++r) {
      const float d = __ldg(a.dy + (base + r) * O + col);
      s += c < O ? d * __ldg(a.zhat + (base + r) * O + col) : d;
    }
    a.gb[(v * a.tiles + blockIdx.x) * 2 * O + c] = s;
  }

  // LayerNorm and GLU backward, a warp per row: dz, dg = [dg4 | dg5] (rows >= R: zeros in shared memory).
  constexpr int kPer = O / 32;
  const float inv_o = 1.f / static_cast<float>(O);
  for (int r = warp; r < kRows; r += kMmaWarps) {
    const bool ok = rows.Ok(r);
    const int64_t row = base + r;
    float gy[kPer], zh[kPer];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = lane + 32 * j;
      gy[j] = ok ? __ldg(a.dy + row * O + c) * __ldg(gamma + c) : 0.f;
      zh[j] = ok ? __ldg(a.zhat + row * O + c) : 0.f;
      s1 += gy[j];
      s2 += gy[j] * zh[j];
    }
    const float mg = WarpSum(s1) * inv_o, mgz = WarpSum(s2) * inv_o;
    const float rs = ok ? __ldg(a.rstd + row) : 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = lane + 32 * j;
      const float dz = rs * (gy[j] - mg - zh[j] * mgz);
      const float g4 = ok ? __ldg(a.g + row * 2 * O + c) : 0.f;
      const float g5 = ok ? __ldg(a.g + row * 2 * O + O + c) : 0.f;
      const float sg = Sigmoid(g5);
      const float dg4 = dz * sg, dg5 = dz * g4 * sg * (1.f - sg);
      dgs[r * Ld(2 * O) + c] = Tf32(dg4);
      dgs[r * Ld(2 * O) + O + c] = Tf32(dg5);
      dzs[r * Ld(O) + c] = skip ? Tf32(dz) : dz;
      if (ok) {
        a.dz[row * O + c] = dz;
        a.dg[row * 2 * O + c] = dg4;
        a.dg[row * 2 * O + O + c] = dg5;
      }
    }
  }
  __syncthreads();
  {  // de1 = dg W45^T
    Product<H, false> p(warp);
    p.Run(dgs, Ld(2 * O), w45, 2 * O, 2 * O, wb, lane);
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      Store2(hs + r * Ld(HO) + c, Tf32(v0), Tf32(v1));
      if (rows.Ok(r)) Store2(a.de1 + (base + r) * H + c, v0, v1);
    });
  }
  __syncthreads();
  {  // da2 = (de1 W1^T) ELU'(a2), ELU'(a2) = 1 where e2 > 0, else e2 + 1 (in place after every warp read de1)
    Product<H, false> p(warp);
    p.Run(hs, Ld(HO), w1, H, H, wb, lane);
    __syncthreads();
    p.Each(lane, [&](int r, int c, float v0, float v1) {
      float2 e = make_float2(0.f, 0.f);
      if (rows.Ok(r)) e = __ldg(reinterpret_cast<const float2*>(a.e2 + (base + r) * H + c));
      v0 *= e.x > 0.f ? 1.f : e.x + 1.f;
      v1 *= e.y > 0.f ? 1.f : e.y + 1.f;
      Store2(hs + r * Ld(HO) + c, Tf32(v0), Tf32(v1));
      if (rows.Ok(r)) Store2(a.da2 + (base + r) * H + c, v0, v1);
    });
  }
  __syncthreads();
  switch (I) {
    case 16: DxProduct<16, H, O>(a, hs, dzs, w2, ws, wb, rows, base, warp, lane); break;
    case 32: DxProduct<32, H, O>(a, hs, dzs, w2, ws, wb, rows, base, warp, lane); break;
    case 64: DxProduct<64, H, O>(a, hs, dzs, w2, ws, wb, rows, base, warp, lane); break;
    default: DxProduct<128, H, O>(a, hs, dzs, w2, ws, wb, rows, base, warp, lane); break;
  }
}

// Dynamic shared memory (bytes; jaxfox/grn.py _tc_smem_bytes mirrors them): the activation tiles and the
// weight-chunk buffer.
constexpr int64_t FwdSmem(int I, int H, int O) {
  return 4LL * (kRows * (Ld(I) + Ld(H > O ? H : O) + Ld(2 * O)) + 2 * kChunk * LdRow(H > 2 * O ? H : 2 * O));
}
constexpr int64_t BwdSmem(int I, int H, int O) {
  return 4LL * (kRows * (Ld(2 * O) + Ld(H > O ? H : O) + Ld(O)) + (H > I ? H : I) * 2 * (kChunk + 4));
}

bool WidthOk(int64_t n, bool input) {
  return (input && n == 16) || n == 32 || n == 64 || n == 128;
}

// Calls f(kernel-template tag) for the (H, O) instantiation; H and O already checked.
template <typename F>
ffi::Error ByWidths(int H, int O, F&& f) {
  auto pick = [&](auto h) -> ffi::Error {
    constexpr int kH = decltype(h)::value;
    switch (O) {
      case 32: return f(std::integral_constant<int, kH>{}, std::integral_constant<int, 32>{});
      case 64: return f(std::integral_constant<int, kH>{}, std::integral_constant<int, 64>{});
      default: return f(std::integral_constant<int, kH>{}, std::integral_constant<int, 128>{});
    }
  };
  switch (H) {
    case 32: return pick(std::integral_constant<int, 32>{});
    case 64: return pick(std::integral_constant<int, 64>{});
    default: return pick(std::integral_constant<int, 128>{});
  }
}

ffi::Error CheckWidths(int64_t I, int64_t H, int64_t O) {
  if (!WidthOk(I, true) || !WidthOk(H, false) || !WidthOk(O, false)) {
    return InvalidArgument("grn_tc: widths I=" + std::to_string(I) + ", hidden_size=" + std::to_string(H) +
                           ", output_size=" + std::to_string(O) +
                           " must be I in {16, 32, 64, 128} and hidden_size, output_size in {32, 64, 128}");
  }
  return ffi::Error::Success();
}

// FFI target jaxfox_grn_tc_fwd (contract: jaxfox/grn.py _grn_tc): x [.., R, I], w2 [.., I, H], b2 [.., H],
// w1 [.., H, H], b1 [.., H], w45 [.., H, 2 O], b45 [.., 2 O], ws [.., I, O] and bs [.., O] (I != O) or
// [.., 0, O] and [.., 0] (I == O), gamma, beta [.., O] -> y [.., R, O] and the residuals e2, e1 [.., Rs, H],
// g [.., Rs, 2 O], zhat [.., Rs, O], rstd [.., Rs] with Rs = R when save, else 0. Weights TF32 values.
ffi::Error GrnTcFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w2,
                        ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> b1,
                        ffi::Buffer<ffi::F32> w45, ffi::Buffer<ffi::F32> b45, ffi::Buffer<ffi::F32> ws,
                        ffi::Buffer<ffi::F32> bs, ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> beta,
                        int64_t hidden_size, int64_t output_size, float eps, int64_t save,
                        ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> e2, ffi::ResultBuffer<ffi::F32> e1,
                        ffi::ResultBuffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> zhat,
                        ffi::ResultBuffer<ffi::F32> rstd) {
  ClearStaleCudaError();
  auto xd = x.dimensions();
  if (xd.size() < 2) return InvalidArgument("grn_tc: x must have rank >= 2 [R, I], got " + DimsToString(xd));
  const int64_t R = xd[xd.size() - 2], I = xd[xd.size() - 1], H = hidden_size, O = output_size;
  JAXFOX_RETURN_IF_ERROR(CheckWidths(I, H, O));
  if (!(eps > 0.f) || !std::isfinite(eps)) return InvalidArgument("grn_tc: eps must be a finite float > 0");
  if (save != 0 && save != 1) return InvalidArgument("grn_tc: save must be 0 or 1");
  const int64_t skip = I != O, Rs = save ? R : 0;
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(x, "grn_tc: x", {R, I}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w2, "grn_tc: w2", {I, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(b2, "grn_tc: b2", {H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w1, "grn_tc: w1", {H, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(b1, "grn_tc: b1", {H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w45, "grn_tc: w45", {H, 2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(b45, "grn_tc: b45", {2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(ws, "grn_tc: ws", {skip ? I : 0, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(bs, "grn_tc: bs", {skip ? O : 0}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(gamma, "grn_tc: gamma", {O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(beta, "grn_tc: beta", {O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*y, "grn_tc: y", {R, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*e2, "grn_tc: e2", {Rs, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*e1, "grn_tc: e1", {Rs, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*g, "grn_tc: g", {Rs, 2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*zhat, "grn_tc: zhat", {Rs, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*rstd, "grn_tc: rstd", {Rs}, &V));
  if (V > 65535) return InvalidArgument("grn_tc: more than 65535 batched instances");
  const int64_t tiles = CeilDiv(R, kRows);
  if (tiles > 0x7fffffff) return InvalidArgument("grn_tc: too many rows");
  if (V == 0 || R == 0) return ffi::Error::Success();
  FwdArgs a{x.typed_data(), w2.typed_data(), b2.typed_data(), w1.typed_data(), b1.typed_data(),
            w45.typed_data(), b45.typed_data(), skip ? ws.typed_data() : nullptr,
            skip ? bs.typed_data() : nullptr, gamma.typed_data(), beta.typed_data(), y->typed_data(),
            save ? e2->typed_data() : nullptr, save ? e1->typed_data() : nullptr,
            save ? g->typed_data() : nullptr, save ? zhat->typed_data() : nullptr,
            save ? rstd->typed_data() : nullptr, R, static_cast<int>(I), eps};
  const int64_t bytes = FwdSmem(static_cast<int>(I), static_cast<int>(H), static_cast<int>(O));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(V));
  return ByWidths(static_cast<int>(H), static_cast<int>(O), [&](auto h, auto o) -> ffi::Error {
    auto kernel = grn_tc_fwd_kernel<decltype(h)::value, decltype(o)::value>;
    JAXFOX_RETURN_IF_ERROR(PrepareSmem("grn_tc_fwd", kernel, bytes));
    kernel<<<grid, kThreads, bytes, stream>>>(a);
    return LastCudaError("grn_tc_fwd");
  });
}

// FFI target jaxfox_grn_tc_bwd: dy [.., R, O], e2 [.., R, H], g [.., R, 2 O], zhat [.., R, O], rstd [.., R],
// gamma [.., O], w45 [.., H, 2 O], w1 [.., H, H], w2 [.., I, H], ws [.., I, O] or [.., 0, O] -> dx [.., R, I],
// dg [.., R, 2 O], de1, da2 [.., R, H], dz [.., R, O], gb [.., ceil(R / 32), 2 O].
ffi::Error GrnTcBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> e2,
                        ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> zhat, ffi::Buffer<ffi::F32> rstd,
                        ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> w45, ffi::Buffer<ffi::F32> w1,
                        ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> ws, int64_t hidden_size,
                        int64_t output_size, ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dg,
                        ffi::ResultBuffer<ffi::F32> de1, ffi::ResultBuffer<ffi::F32> da2,
                        ffi::ResultBuffer<ffi::F32> dz, ffi::ResultBuffer<ffi::F32> gb) {
  ClearStaleCudaError();
  auto wd = w2.dimensions();
  auto yd = dy.dimensions();
  if (wd.size() < 2 || yd.size() < 2) {
    return InvalidArgument("grn_tc: w2 and dy must have rank >= 2, got " + DimsToString(wd) + " and " +
                           DimsToString(yd));
  }
  const int64_t R = yd[yd.size() - 2], I = wd[wd.size() - 2], H = hidden_size, O = output_size;
  JAXFOX_RETURN_IF_ERROR(CheckWidths(I, H, O));
  const int64_t skip = I != O, tiles = CeilDiv(R, kRows);
  int64_t V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(dy, "grn_tc: dy", {R, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(e2, "grn_tc: e2", {R, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(g, "grn_tc: g", {R, 2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(zhat, "grn_tc: zhat", {R, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(rstd, "grn_tc: rstd", {R}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(gamma, "grn_tc: gamma", {O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w45, "grn_tc: w45", {H, 2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w1, "grn_tc: w1", {H, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w2, "grn_tc: w2", {I, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(ws, "grn_tc: ws", {skip ? I : 0, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dx, "grn_tc: dx", {R, I}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dg, "grn_tc: dg", {R, 2 * O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*de1, "grn_tc: de1", {R, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*da2, "grn_tc: da2", {R, H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*dz, "grn_tc: dz", {R, O}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(*gb, "grn_tc: gb", {tiles, 2 * O}, &V));
  if (V > 65535) return InvalidArgument("grn_tc: more than 65535 batched instances");
  if (tiles > 0x7fffffff) return InvalidArgument("grn_tc: too many rows");
  if (V == 0 || R == 0) return ffi::Error::Success();
  BwdArgs a{dy.typed_data(), e2.typed_data(), g.typed_data(), zhat.typed_data(), rstd.typed_data(),
            gamma.typed_data(), w45.typed_data(), w1.typed_data(), w2.typed_data(),
            skip ? ws.typed_data() : nullptr, dx->typed_data(), dg->typed_data(), de1->typed_data(),
            da2->typed_data(), dz->typed_data(), gb->typed_data(), R, tiles, static_cast<int>(I)};
  const int64_t bytes = BwdSmem(static_cast<int>(I), static_cast<int>(H), static_cast<int>(O));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(V));
  return ByWidths(static_cast<int>(H), static_cast<int>(O), [&](auto h, auto o) -> ffi::Error {
    auto kernel = grn_tc_bwd_kernel<decltype(h)::value, decltype(o)::value>;
    JAXFOX_RETURN_IF_ERROR(PrepareSmem("grn_tc_bwd", kernel, bytes));
    kernel<<<grid, kThreads, bytes, stream>>>(a);
    return LastCudaError("grn_tc_bwd");
  });
}

}  // namespace tc

}  // namespace
}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grn_fwd, jaxfox::GrnFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // a [R, I]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("softmax")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out [R, O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // res [R, W] or [R, 0]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grn_bwd, jaxfox::GrnBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // a [R, I]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // g [R, O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // res [R, W]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("softmax")
                                  .Attr<int64_t>("tiles_per_block")
                                  .Attr<int64_t>("chunks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dw [P]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // da [R, I]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // workspace: per-CTA partials
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace: chunk partials
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grn_tc_fwd, jaxfox::tc::GrnTcFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [R, I]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w2 [I, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b2 [H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w1 [H, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b1 [H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w45 [H, 2 O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b45 [2 O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // ws [I, O] or [0, O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // bs [O] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // gamma [O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // beta [O]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("save")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // y [R, O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // e2 [Rs, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // e1 [Rs, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // g [Rs, 2 O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // zhat [Rs, O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // rstd [Rs]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grn_tc_bwd, jaxfox::tc::GrnTcBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // dy [R, O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // e2 [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // g [R, 2 O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // zhat [R, O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // gamma [O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w45 [H, 2 O]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w1 [H, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w2 [I, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // ws [I, O] or [0, O]
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("output_size")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dx [R, I]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dg [R, 2 O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // de1 [R, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // da2 [R, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dz [R, O]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // gb [ceil(R / 32), 2 O]
                              {xla::ffi::Traits::kCmdBufferCompatible});
