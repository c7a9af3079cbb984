// Grouped GEMM (OPS.md "Grouped GEMM"): C_g = A_g B_g (+ bias_g) for many groups in one launch,
// and the weight gradient dW_g = X_g^T dY_g, db_g = sum_m dY_g with a deterministic split-K.
//
// Targets:
//   jaxfox_grouped_gemm   C[M, N] = A[M, K] @ B (+ bias[N]), B stored [K, N] (transpose_b = 0) or
//                         [N, K] read transposed (transpose_b = 1; the dx = dy w^T of the backward).
//   jaxfox_grouped_wgrad  C[K, N] = A^T B with A [M, K], B [M, N] (the reduction over the long M is
//                         split into `splits` row ranges of `split_len`), D[N] = sum_m B[m, :] as an
//                         extra output row (a row of ones appended to A^T). The last result is a
//                         float32 workspace [sum_g splits_g (K_g + has_db_g) N_g] of split partials,
//                         summed in split order by a second kernel (no atomics: bitwise reproducible).
//
// Operands: the groups' buffers arrive as separate FFI buffers (RemainingArgs / RemainingRets); the
// int64 attribute `table` (13 columns per group, built in jaxfox/gemm.py from the static shapes) says
// which buffer and element offset each group's A, B, C and D use, and M, N, K, splits, split_len.
// The handler turns that into device pointers and passes them BY VALUE in the kernel's parameter
// struct (kMaxGroups groups per launch, < 4 KB of parameters): no device copies, no allocation, no
// host sync, command-buffer safe. vmap (broadcast_all): leading dims beyond each buffer's rank
// (attrs arg_ranks / ret_ranks) form V instances; each (group, instance) is one entry of the struct.
//
// Tile scheduler: blockIdx.x -> (group, split, tile_m, tile_n) by a scan of the per-group
// tile_start prefix table (tile_n fastest, so consecutive blocks reuse the same A rows from L2).
// Tiles are 64 x 64 with K steps of 32. Paths:
//   SIMT  (float32 under "highest" precision): 256 threads, 4 x 4 outputs per thread (rows ty + 16 i,
//         cols tx + 16 j), fmaf in ascending k order, register prefetch + double-buffered shared memory.
//         (bfloat16 instantiations exist but the handler sends bfloat16 to the MMA path.)
//   MMA   (float32 as TF32, bfloat16): WMMA 16x16x8 tf32 / 16x16x16 bf16 tensor cores with float32
//         accumulators, 128 threads = 4 warps of 32 x 32, same double buffering.
// Each output element is written by one thread of one block: results are deterministic.
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace jaxfox {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kSimtThreads = 256;
constexpr int kMmaThreads = 128;
constexpr int kMaxGroups = 40;   // 40 x 80 B + header < 4 KB of kernel parameters
constexpr int kTableCols = 13;
constexpr int kReduceThreads = 256;

// One (group, vmap instance) of a launch.
struct GroupDesc {
  const void* a;      // A [M, K] (gemm) / X [M, K] (wgrad)
  const void* b;      // B [K, N] or [N, K] (gemm) / dY [M, N] (wgrad)
  void* c;            // C [M, N] (gemm) / dW [K, N] (wgrad: only the reduce kernel writes it)
  void* d;            // bias [N] (gemm, read) / db [N] (wgrad, reduce kernel), or nullptr
  float* ws;          // wgrad: this group's partials [splits, Mo, No]
  int m, n, k;        // output rows Mo, output cols No, reduction length (gemm) / rows M (wgrad)
  int lda;            // row stride of A's storage
  int ldb;            // row stride of B's storage
  int ones_row;       // wgrad: output row that holds db (A^T row of ones), else -1
  int tiles_n;        // output tiles along N
  int tiles_mn;       // output tiles per split
  int split_len;      // rows of the reduction per split (wgrad); K for gemm
  int tile_start;     // first block of this group
};

struct Groups {
  GroupDesc g[kMaxGroups];
  int count;
  int total;  // blocks of the launch
};

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(bf16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 FromFloat<bf16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ int FindGroup(const Groups& gs, int block) {
  int g = 0;
  for (int i = 1; i < gs.count; ++i) g = (gs.g[i].tile_start <= block) ? i : g;
  return g;
}


// Global -> register loads of one operand tile, kLoads elements per thread. A thread keeps one
// coordinate fixed for all its loads (the storage-contiguous one, so a warp reads consecutive
// addresses) and steps the other by kMovingStep: one pointer advanced by one K tile per step, a
// constant pointer step between loads, and the validity of the non-k coordinate precomputed
// (a bit mask over the loads, or one flag): few registers and no per-load index arithmetic.
//   kOperandA: tile element (r, c) = A(m0 + r, k0 + c), r < kTileM, c < kTileK; kContig = kAKContig.
//   else:      tile element (r, c) = B(k0 + r, n0 + c), r < kTileK, c < kTileN; kContig = kBNContig.
template <typename T, bool kOperandA, bool kContig, int kThreads>
struct TileLoader {
  static constexpr int kRows = kOperandA ? kTileM : kTileK;
  static constexpr int kCols = kOperandA ? kTileK : kTileN;
  // The fixed coordinate is the column index c when the storage runs along c (A k-contiguous,
  // B n-contiguous), else the row index r.
  static constexpr bool kFixedIsCol = kContig;
  static constexpr int kFixedExt = kFixedIsCol ? kCols : kRows;
  static constexpr int kMovingStep = kThreads / kFixedExt;
  static constexpr int kLoads = kRows * kCols / kThreads;
  // Whether the fixed coordinate is k (A: column; B: row).
  static constexpr bool kFixedIsK = kOperandA ? kFixedIsCol : !kFixedIsCol;
  static_assert(kLoads <= 32 && kThreads % kFixedExt == 0, "tile/thread configuration");

  const T* ptr;
  int64_t step;       // pointer step between consecutive loads of this thread
  int64_t tile_step;  // pointer step per K tile
  int fixed;          // this thread's fixed coordinate (tile-relative)
  int moving0;        // its first moving coordinate (tile-relative)
  uint32_t mn_valid;  // kFixedIsK: bit i = load i's m (A) / n (B) inside the output; else all bits = one flag
  int ones;           // A^T with a ones row and the fixed coordinate m: 1 when it is the ones row

  // mn0: m0 (A) or n0 (B); mn_lim: rows (A: Mo) / cols (B: No) of the output; ld: row stride of the
  // storage; k_begin: first k of this block. ones_row: A's ones row (or -1).
  __device__ __forceinline__ void Init(const void* base, int mn0, int mn_lim, int64_t ld, int k_begin,
                                       int ones_row) {
    const int tid = threadIdx.x;
    fixed = tid % kFixedExt;
    moving0 = tid / kFixedExt;
    // (k, mn) of load 0 and the step of the moving coordinate.
    const int k = kFixedIsK ? k_begin + fixed : k_begin + moving0;
    const int mn = kFixedIsK ? mn0 + moving0 : mn0 + fixed;
    // Storage: contiguous along the fixed coordinate; the moving one strides by ld.
    // A k-contig: a[m * ld + k]; A m-contig: a[k * ld + m]; B n-contig: b[k * ld + n]; B k-contig: b[n * ld + k].
    const bool k_is_row_of_storage = kOperandA ? !kContig : kContig;
    const int64_t off = k_is_row_of_storage ? static_cast<int64_t>(k) * ld + mn : static_cast<int64_t>(mn) * ld + k;
    ptr = static_cast<const T*>(base) + off;
    step = static_cast<int64_t>(kMovingStep) * ld;
    tile_step = k_is_row_of_storage ? static_cast<int64_t>(kTileK) * ld : kTileK;
    ones = 0;
    mn_valid = 0;
    if (kFixedIsK) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) mn_valid |= (mn + i * kMovingStep < mn_lim ? 1u : 0u) << i;
    } else {
      const bool real = kOperandA && mn == ones_row;
      ones = real ? 1 : 0;
      mn_valid = (mn < mn_lim && !real) ? 0xffffffffu : 0u;
    }
  }

  // Loads the tile at k0 (k_end: end of this block's reduction range), then advances one tile.
  __device__ __forceinline__ void Load(int k0, int k_end, float (&r)[kLoads]) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int k = kFixedIsK ? k0 + fixed : k0 + moving0 + i * kMovingStep;
      const bool ok = k < k_end && ((mn_valid >> i) & 1u);
      float v = ok ? ToFloat(ptr[i * step]) : 0.f;
      if (!kFixedIsK && ones && k < k_end) v = 1.f;
      r[i] = v;
    }
    ptr += tile_step;
  }

  // Tile-relative (row, col) of load i.
  __device__ __forceinline__ int Row(int i) const {
    return kFixedIsCol ? moving0 + i * kMovingStep : fixed;
  }
  __device__ __forceinline__ int Col(int i) const {
    return kFixedIsCol ? fixed : moving0 + i * kMovingStep;
  }
};

struct TileCoord {
  int g, split, m0, n0, k_begin, k_end;
};

__device__ __forceinline__ TileCoord Locate(const Groups& gs, bool wgrad) {
  TileCoord t;
  const int block = blockIdx.x;
  t.g = FindGroup(gs, block);
  const GroupDesc& d = gs.g[t.g];
  const int local = block - d.tile_start;
  t.split = local / d.tiles_mn;
  const int rem = local - t.split * d.tiles_mn;
  t.m0 = (rem / d.tiles_n) * kTileM;
  t.n0 = (rem % d.tiles_n) * kTileN;
  if (wgrad) {
    t.k_begin = t.split * d.split_len;
    t.k_end = min(d.k, t.k_begin + d.split_len);
  } else {
    t.k_begin = 0;
    t.k_end = d.k;
  }
  return t;
}

// Writes one accumulator value: gemm -> C (+ bias) in T; wgrad -> the split's float32 partial.
template <typename T, bool kWgrad>
__device__ __forceinline__ void StoreOut(const GroupDesc& d, const TileCoord& t, int m, int n, float v) {
  if (m >= d.m || n >= d.n) return;
  if (kWgrad) {
    d.ws[(static_cast<int64_t>(t.split) * d.m + m) * d.n + n] = v;
  } else {
    if (d.d != nullptr) v += ToFloat(static_cast<const T*>(d.d)[n]);
    static_cast<T*>(d.c)[static_cast<int64_t>(m) * d.n + n] = FromFloat<T>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// SIMT float32 path. Shared memory As[k][m], Bs[k][n] (float), two buffers.

template <typename T, bool kAKContig, bool kBNContig, bool kWgrad>
__global__ void __launch_bounds__(kSimtThreads, 2)
grouped_gemm_simt(const __grid_constant__ Groups gs) {
  __shared__ float As[2][kTileK][kTileM + 1];  // +1: conflict-free stores along k
  __shared__ float Bs[2][kTileK][kTileN + 1];
  const TileCoord t = Locate(gs, kWgrad);
  const GroupDesc& d = gs.g[t.g];
  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;

  using LA = TileLoader<T, true, kAKContig, kSimtThreads>;
  using LB = TileLoader<T, false, kBNContig, kSimtThreads>;
  LA la;
  LB lb;
  la.Init(d.a, t.m0, d.m, d.lda, t.k_begin, d.ones_row);
  lb.Init(d.b, t.n0, d.n, d.ldb, t.k_begin, -1);
  float ra[LA::kLoads], rb[LB::kLoads];
  auto load = [&](int k0) {
    la.Load(k0, t.k_end, ra);
    lb.Load(k0, t.k_end, rb);
  };
  auto store = [&](int buf) {
#pragma unroll
    for (int i = 0; i < LA::kLoads; ++i) As[buf][la.Col(i)][la.Row(i)] = ra[i];
#pragma unroll
    for (int i = 0; i < LB::kLoads; ++i) Bs[buf][lb.Row(i)][lb.Col(i)] = rb[i];
  };

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  int buf = 0;
  if (t.k_begin < t.k_end) {
    load(t.k_begin);
    store(0);
    __syncthreads();
    for (int k0 = t.k_begin; k0 < t.k_end; k0 += kTileK) {
      const bool more = k0 + kTileK < t.k_end;
      if (more) load(k0 + kTileK);
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[buf][kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[buf][kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
      if (more) store(buf ^ 1);
      __syncthreads();
      buf ^= 1;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) StoreOut<T, kWgrad>(d, t, t.m0 + ty + 16 * i, t.n0 + tx + 16 * j, acc[i][j]);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path (WMMA). T = float: TF32 m16n16k8 (inputs rounded to TF32 when staged);
// T = bf16: m16n16k16. Shared memory As[m][k], Bs[k][n] in the staging type, two buffers; the
// accumulators go through shared memory (Cs) for the bounds-checked, bias-adding epilogue.
template <typename T> struct MmaTraits;
template <> struct MmaTraits<float> {
  using Stage = float;
  using FragIn = nvcuda::wmma::precision::tf32;
  static constexpr int kK = 8;
  static constexpr int kPadA = 4;
  static constexpr int kPadB = 4;
  __device__ static float Convert(float v) { return nvcuda::wmma::__float_to_tf32(v); }
};
template <> struct MmaTraits<bf16> {
  using Stage = bf16;
  using FragIn = bf16;
  static constexpr int kK = 16;
  static constexpr int kPadA = 8;
  static constexpr int kPadB = 8;
  __device__ static bf16 Convert(float v) { return __float2bfloat16_rn(v); }  // exact: v came from bf16
};

constexpr int kCsLd = kTileN + 4;

template <typename T>
struct MmaSmem {
  using S = typename MmaTraits<T>::Stage;
  static constexpr int kLdA = kTileK + MmaTraits<T>::kPadA;
  static constexpr int kLdB = kTileN + MmaTraits<T>::kPadB;
  static constexpr int kBytesAB = 2 * (kTileM * kLdA + kTileK * kLdB) * static_cast<int>(sizeof(S));
  static constexpr int kBytesC = kTileM * kCsLd * static_cast<int>(sizeof(float));
  static constexpr int kBytes = kBytesAB > kBytesC ? kBytesAB : kBytesC;
};

template <typename T, bool kAKContig, bool kBNContig, bool kWgrad>
__global__ void __launch_bounds__(kMmaThreads, 3)
grouped_gemm_mma(const __grid_constant__ Groups gs) {
  namespace wmma = nvcuda::wmma;
  using Tr = MmaTraits<T>;
  using S = typename Tr::Stage;
  using Sm = MmaSmem<T>;
  constexpr int kLdA = Sm::kLdA, kLdB = Sm::kLdB;
  __shared__ __align__(128) unsigned char smem[Sm::kBytes];
  S* As = reinterpret_cast<S*>(smem);                       // [2][kTileM][kLdA]
  S* Bs = As + 2 * kTileM * kLdA;                           // [2][kTileK][kLdB]
  float* Cs = reinterpret_cast<float*>(smem);               // [kTileM][kCsLd] (after the main loop)

  const TileCoord t = Locate(gs, kWgrad);
  const GroupDesc& d = gs.g[t.g];
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;

  using LA = TileLoader<T, true, kAKContig, kMmaThreads>;
  using LB = TileLoader<T, false, kBNContig, kMmaThreads>;
  LA la;
  LB lb;
  la.Init(d.a, t.m0, d.m, d.lda, t.k_begin, d.ones_row);
  lb.Init(d.b, t.n0, d.n, d.ldb, t.k_begin, -1);
  float ra[LA::kLoads], rb[LB::kLoads];
  auto load = [&](int k0) {
    la.Load(k0, t.k_end, ra);
    lb.Load(k0, t.k_end, rb);
  };
  auto store = [&](int buf) {
    S* as = As + buf * kTileM * kLdA;
    S* bs = Bs + buf * kTileK * kLdB;
#pragma unroll
    for (int i = 0; i < LA::kLoads; ++i) as[la.Row(i) * kLdA + la.Col(i)] = Tr::Convert(ra[i]);
#pragma unroll
    for (int i = 0; i < LB::kLoads; ++i) bs[lb.Row(i) * kLdB + lb.Col(i)] = Tr::Convert(rb[i]);
  };

  wmma::fragment<wmma::accumulator, 16, 16, Tr::kK, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  int buf = 0;
  if (t.k_begin < t.k_end) {
    load(t.k_begin);
    store(0);
    __syncthreads();
    for (int k0 = t.k_begin; k0 < t.k_end; k0 += kTileK) {
      const bool more = k0 + kTileK < t.k_end;
      if (more) load(k0 + kTileK);
      const S* as = As + buf * kTileM * kLdA;
      const S* bs = Bs + buf * kTileK * kLdB;
#pragma unroll 2
      for (int kk = 0; kk < kTileK; kk += Tr::kK) {
        wmma::fragment<wmma::matrix_a, 16, 16, Tr::kK, typename Tr::FragIn, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, Tr::kK, typename Tr::FragIn, wmma::row_major> fb[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], as + (wm + 16 * i) * kLdA + kk, kLdA);
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], bs + kk * kLdB + wn + 16 * j, kLdB);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
      if (more) store(buf ^ 1);
      __syncthreads();
      buf ^= 1;
    }
  }
  // Epilogue through shared memory (the loop ended with a barrier, so the staging area is free).
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(Cs + (wm + 16 * i) * kCsLd + wn + 16 * j, acc[i][j], kCsLd, wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < kTileM * kTileN; idx += kMmaThreads) {
    const int m = idx / kTileN, n = idx % kTileN;
    StoreOut<T, kWgrad>(d, t, t.m0 + m, t.n0 + n, Cs[m * kCsLd + n]);
  }
}

// ---------------------------------------------------------------------------------------------
// wgrad reduction: out(m, n) = sum over splits s = 0, 1, ... (in order) of ws[s][m][n]; rows m < K go
// to dW [K, N] (T), the ones row to db [N] (T). tile_start / tiles_mn count kReduceThreads-element
// chunks of the group's Mo x No outputs here.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
grouped_wgrad_reduce(const __grid_constant__ Groups gs) {
  const int g = FindGroup(gs, blockIdx.x);
  const GroupDesc& d = gs.g[g];
  const int64_t e = static_cast<int64_t>(blockIdx.x - d.tile_start) * kReduceThreads + threadIdx.x;
  const int64_t count = static_cast<int64_t>(d.m) * d.n;
  if (e >= count) return;
  const int splits = d.tiles_mn;  // (the reduce launch stores the split count here)
  float acc = d.ws[e];
  for (int s = 1; s < splits; ++s) acc += d.ws[static_cast<int64_t>(s) * count + e];
  const int m = static_cast<int>(e / d.n), n = static_cast<int>(e % d.n);
  if (m == d.ones_row) {
    static_cast<T*>(d.d)[n] = FromFloat<T>(acc);
  } else {
    static_cast<T*>(d.c)[e] = FromFloat<T>(acc);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
struct Buf {
  char* ptr = nullptr;
  int64_t inst_elems = 0;  // elements of one vmap instance
  int64_t lead = 1;        // V
  ffi::DataType dtype;
};

template <typename B>
ffi::Error Describe(const B& buf, int64_t rank, const char* what, size_t i, Buf* out) {
  auto dims = buf.dimensions();
  if (rank < 0 || static_cast<size_t>(rank) > dims.size()) {
    return InvalidArgument(std::string("grouped_gemm: ") + what + " " + std::to_string(i) + " has shape " +
                           DimsToString(dims) + ", rank below the declared " + std::to_string(rank));
  }
  const size_t nl = dims.size() - static_cast<size_t>(rank);
  out->lead = DimProduct(dims, 0, nl);
  out->inst_elems = DimProduct(dims, nl, dims.size());
  out->ptr = static_cast<char*>(buf.untyped_data());
  out->dtype = buf.element_type();
  return ffi::Error::Success();
}

size_t ElemSize(ffi::DataType t) { return t == ffi::DataType::BF16 ? 2 : 4; }

// Checks [off, off + extent) lies inside one instance of `b`.
ffi::Error CheckExtent(const Buf& b, int64_t off, int64_t extent, const char* what, int64_t g) {
  if (off < 0 || extent < 0 || off + extent > b.inst_elems) {
    return InvalidArgument("grouped_gemm: group " + std::to_string(g) + ": " + what + " range [" +
                           std::to_string(off) + ", " + std::to_string(off + extent) +
                           ") exceeds its buffer of " + std::to_string(b.inst_elems) + " elements");
  }
  return ffi::Error::Success();
}

template <typename T, bool kWgrad>
ffi::Error LaunchChunk(cudaStream_t stream, Groups& gs, bool use_mma, bool transpose_b) {
  if (gs.total == 0) return ffi::Error::Success();
  dim3 grid(static_cast<unsigned>(gs.total));
  // A: row-major (k-contiguous) for gemm, transposed X for wgrad. B: n-contiguous except dx.
  if (kWgrad) {
    if (use_mma) grouped_gemm_mma<T, false, true, true><<<grid, kMmaThreads, 0, stream>>>(gs);
    else grouped_gemm_simt<T, false, true, true><<<grid, kSimtThreads, 0, stream>>>(gs);
  } else if (transpose_b) {
    if (use_mma) grouped_gemm_mma<T, true, false, false><<<grid, kMmaThreads, 0, stream>>>(gs);
    else grouped_gemm_simt<T, true, false, false><<<grid, kSimtThreads, 0, stream>>>(gs);
  } else {
    if (use_mma) grouped_gemm_mma<T, true, true, false><<<grid, kMmaThreads, 0, stream>>>(gs);
    else grouped_gemm_simt<T, true, true, false><<<grid, kSimtThreads, 0, stream>>>(gs);
  }
  return LastCudaError("grouped_gemm launch");
}

template <typename T>
ffi::Error LaunchReduceChunk(cudaStream_t stream, Groups& gs) {
  if (gs.total == 0) return ffi::Error::Success();
  grouped_wgrad_reduce<T><<<static_cast<unsigned>(gs.total), kReduceThreads, 0, stream>>>(gs);
  return LastCudaError("grouped_gemm wgrad reduce");
}

// Shared by both targets. kWgrad: C = A^T B with split-K + reduce; else C = A B (+ bias).
template <bool kWgrad>
ffi::Error GroupedImpl(cudaStream_t stream, ffi::Span<const int64_t> table, ffi::Span<const int64_t> arg_ranks,
                       ffi::Span<const int64_t> ret_ranks, int64_t transpose_b, int64_t tf32,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  ClearStaleCudaError();
  const size_t nargs = args.size(), nrets = rets.size();
  if (arg_ranks.size() != nargs || ret_ranks.size() != nrets) {
    return InvalidArgument("grouped_gemm: arg_ranks/ret_ranks do not match the number of operands/results");
  }
  if (table.size() % kTableCols != 0) return InvalidArgument("grouped_gemm: table size is not a multiple of 13");
  const int64_t G = static_cast<int64_t>(table.size()) / kTableCols;
  std::vector<Buf> in(nargs), out(nrets);
  for (size_t i = 0; i < nargs; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    JAXFOX_RETURN_IF_ERROR(Describe(*b, arg_ranks[i], "operand", i, &in[i]));
  }
  for (size_t i = 0; i < nrets; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    JAXFOX_RETURN_IF_ERROR(Describe(**b, ret_ranks[i], "result", i, &out[i]));
  }
  // The data dtype (all operands, and all results but the wgrad workspace).
  const size_t ndata_rets = kWgrad ? nrets - 1 : nrets;
  if (kWgrad && (nrets == 0 || out[nrets - 1].dtype != ffi::DataType::F32)) {
    return InvalidArgument("grouped_gemm: the last result of the wgrad target must be the float32 workspace");
  }
  if (nargs == 0) return InvalidArgument("grouped_gemm: no operands");
  const ffi::DataType dt = in[0].dtype;
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) {
    return InvalidArgument("grouped_gemm: operands must be float32 or bfloat16");
  }
  int64_t V = in[0].lead;
  for (size_t i = 0; i < nargs; ++i) {
    if (in[i].dtype != dt) return InvalidArgument("grouped_gemm: operands have different dtypes");
    if (in[i].lead != V) return InvalidArgument("grouped_gemm: operands have different leading (vmap) dims");
  }
  for (size_t i = 0; i < nrets; ++i) {
    if (i < ndata_rets && out[i].dtype != dt) return InvalidArgument("grouped_gemm: results have another dtype");
    if (out[i].lead != V) return InvalidArgument("grouped_gemm: results have different leading (vmap) dims");
  }
  if (V == 0) return ffi::Error::Success();
  const size_t es = ElemSize(dt);

  // Validate every group once and compute the wgrad workspace offsets (per instance).
  struct Row { int64_t a, ao, b, bo, c, co, d, dob, M, N, K, S, L, ws_off; };
  std::vector<Row> rows(G);
  int64_t ws_elems = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* r = table.begin() + g * kTableCols;
    Row& w = rows[g];
    w = Row{r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], 0};
    auto bad_index = [&](int64_t idx, size_t n) { return idx < 0 || idx >= static_cast<int64_t>(n); };
    if (bad_index(w.a, nargs) || bad_index(w.b, nargs) || bad_index(w.c, ndata_rets) ||
        (w.d >= 0 && bad_index(w.d, kWgrad ? ndata_rets : nargs))) {
      return InvalidArgument("grouped_gemm: group " + std::to_string(g) + " names a buffer index out of range");
    }
    const int64_t lim = (int64_t{1} << 31) - 1;
    if (w.M < 0 || w.N < 0 || w.K < 0 || w.M > lim || w.N > lim || w.K > lim) {
      return InvalidArgument("grouped_gemm: group " + std::to_string(g) + " has an invalid M, N or K");
    }
    if (kWgrad) {  // A = X [M, K], B = dY [M, N], C = dW [K, N], D = db [N]
      JAXFOX_RETURN_IF_ERROR(CheckExtent(in[w.a], w.ao, w.M * w.K, "x", g));
      JAXFOX_RETURN_IF_ERROR(CheckExtent(in[w.b], w.bo, w.M * w.N, "dy", g));
      JAXFOX_RETURN_IF_ERROR(CheckExtent(out[w.c], w.co, w.K * w.N, "dw", g));
      if (w.d >= 0) JAXFOX_RETURN_IF_ERROR(CheckExtent(out[w.d], w.dob, w.N, "db", g));
      if (w.S < 1 || w.L < 1 || w.S > 65535 || (w.S - 1) * w.L >= std::max<int64_t>(w.M, 1) ||
          w.S * w.L < w.M || w.L > lim) {
        return InvalidArgument("grouped_gemm: group " + std::to_string(g) + ": splits/split_len do not cover M");
      }
      w.ws_off = ws_elems;
      ws_elems += w.S * (w.K + (w.d >= 0 ? 1 : 0)) * w.N;
    } else {       // A [M, K], B [K, N] or [N, K], C [M, N], D = bias [N]
      JAXFOX_RETURN_IF_ERROR(CheckExtent(in[w.a], w.ao, w.M * w.K, "a", g));
      JAXFOX_RETURN_IF_ERROR(CheckExtent(in[w.b], w.bo, w.K * w.N, "b", g));
      JAXFOX_RETURN_IF_ERROR(CheckExtent(out[w.c], w.co, w.M * w.N, "c", g));
      if (w.d >= 0) JAXFOX_RETURN_IF_ERROR(CheckExtent(in[w.d], w.dob, w.N, "bias", g));
      if (w.S != 1) return InvalidArgument("grouped_gemm: the forward target takes splits = 1");
    }
  }
  float* ws_base = nullptr;
  if (kWgrad) {
    if (out[nrets - 1].inst_elems < ws_elems) {
      return InvalidArgument("grouped_gemm: workspace holds " + std::to_string(out[nrets - 1].inst_elems) +
                             " floats per instance, needs " + std::to_string(ws_elems));
    }
    ws_base = reinterpret_cast<float*>(out[nrets - 1].ptr);
  }
  const bool use_mma = (dt == ffi::DataType::BF16) || tf32 != 0;

  // Build launches of up to kMaxGroups (group, instance) entries.
  Groups gs{}, rs{};
  auto flush = [&]() -> ffi::Error {
    if (dt == ffi::DataType::BF16) {
      JAXFOX_RETURN_IF_ERROR((LaunchChunk<bf16, kWgrad>(stream, gs, use_mma, transpose_b != 0)));
      if (kWgrad) JAXFOX_RETURN_IF_ERROR(LaunchReduceChunk<bf16>(stream, rs));
    } else {
      JAXFOX_RETURN_IF_ERROR((LaunchChunk<float, kWgrad>(stream, gs, use_mma, transpose_b != 0)));
      if (kWgrad) JAXFOX_RETURN_IF_ERROR(LaunchReduceChunk<float>(stream, rs));
    }
    gs = Groups{};
    rs = Groups{};
    return ffi::Error::Success();
  };
  for (int64_t v = 0; v < V; ++v) {
    for (int64_t g = 0; g < G; ++g) {
      const Row& w = rows[g];
      const int64_t Mo = kWgrad ? w.K + (w.d >= 0 ? 1 : 0) : w.M;
      const int64_t No = w.N;
      const int64_t tiles_mn = CeilDiv(Mo, kTileM) * CeilDiv(No, kTileN);
      const int64_t blocks = tiles_mn * (kWgrad ? w.S : 1);
      if (blocks == 0) continue;
      const int64_t rblocks = kWgrad ? CeilDiv(Mo * No, kReduceThreads) : 0;
      if (static_cast<int64_t>(gs.total) + blocks > 0x7fffffff ||
          static_cast<int64_t>(rs.total) + rblocks > 0x7fffffff) {
        return InvalidArgument("grouped_gemm: too many tiles for one launch");
      }
      if (gs.count == kMaxGroups) JAXFOX_RETURN_IF_ERROR(flush());
      GroupDesc& e = gs.g[gs.count];
      const Buf &A = in[w.a], &B = in[w.b], &C = out[w.c];
      e.a = A.ptr + (v * A.inst_elems + w.ao) * es;
      e.b = B.ptr + (v * B.inst_elems + w.bo) * es;
      e.c = C.ptr + (v * C.inst_elems + w.co) * es;
      e.d = nullptr;
      if (w.d >= 0) {
        const Buf& D = kWgrad ? out[w.d] : in[w.d];
        e.d = D.ptr + (v * D.inst_elems + w.dob) * es;
      }
      e.ws = kWgrad ? ws_base + v * out[nrets - 1].inst_elems + w.ws_off : nullptr;
      e.m = static_cast<int>(Mo);
      e.n = static_cast<int>(No);
      e.k = static_cast<int>(kWgrad ? w.M : w.K);
      e.lda = static_cast<int>(w.K);                              // X / A row stride
      e.ldb = static_cast<int>(kWgrad ? w.N : (transpose_b ? w.K : w.N));
      e.ones_row = (kWgrad && w.d >= 0) ? static_cast<int>(w.K) : -1;
      e.tiles_n = static_cast<int>(CeilDiv(No, kTileN));
      e.tiles_mn = static_cast<int>(tiles_mn);
      e.split_len = static_cast<int>(kWgrad ? w.L : w.K);
      e.tile_start = gs.total;
      gs.total += static_cast<int>(blocks);
      ++gs.count;
      if (kWgrad) {
        GroupDesc& r = rs.g[rs.count];
        r = e;
        r.tiles_mn = static_cast<int>(w.S);  // the reduce kernel reads the split count here
        r.tile_start = rs.total;
        rs.total += static_cast<int>(rblocks);
        ++rs.count;
      }
    }
  }
  if (gs.count > 0) JAXFOX_RETURN_IF_ERROR(flush());
  return LastCudaError("grouped_gemm");
}

static_assert(sizeof(Groups) <= 4000, "kernel parameters must stay under 4 KB");

}  // namespace

static ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::Span<const int64_t> table,
                                  ffi::Span<const int64_t> arg_ranks, ffi::Span<const int64_t> ret_ranks,
                                  int64_t transpose_b, int64_t tf32, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets) {
  return GroupedImpl<false>(stream, table, arg_ranks, ret_ranks, transpose_b, tf32, args, rets);
}

static ffi::Error GroupedWgradImpl(cudaStream_t stream, ffi::Span<const int64_t> table,
                                   ffi::Span<const int64_t> arg_ranks, ffi::Span<const int64_t> ret_ranks,
                                   int64_t tf32, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return GroupedImpl<true>(stream, table, arg_ranks, ret_ranks, 0, tf32, args, rets);
}

}  // namespace jaxfox

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grouped_gemm, jaxfox::GroupedGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<xla::ffi::Span<const int64_t>>("table")
                                  .Attr<xla::ffi::Span<const int64_t>>("arg_ranks")
                                  .Attr<xla::ffi::Span<const int64_t>>("ret_ranks")
                                  .Attr<int64_t>("transpose_b")
                                  .Attr<int64_t>("tf32")
                                  .RemainingArgs()    // the groups' A, B (and bias) buffers
                                  .RemainingRets(),   // the groups' C buffers
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_grouped_wgrad, jaxfox::GroupedWgradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<xla::ffi::Span<const int64_t>>("table")
                                  .Attr<xla::ffi::Span<const int64_t>>("arg_ranks")
                                  .Attr<xla::ffi::Span<const int64_t>>("ret_ranks")
                                  .Attr<int64_t>("tf32")
                                  .RemainingArgs()    // X and dY buffers
                                  .RemainingRets(),   // dW (and db) buffers, then the workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
