// Tensor-core helpers shared by the kernels that run float32 products in TF32 on mma.sync (ffi/iqn.cu,
// ffi/iql.cu): operand rounding, the m16n8k8 MMA, a warp's accumulator fragments, warp tilings of an output
// over the 8 warps of a 256-thread block, and a warp's product from shared-memory operands.
// Habits behind them (notes/CONTEXT.md): inline PTX mma.sync with plain indexed LDS fragment loads, not
// nvcuda::wmma (whose tf32 fragment loads compiled to generic LD.E); operands rounded to TF32 once, when written.
#pragma once

#include <cstdint>

namespace jaxfox {

constexpr int kMmaWarps = 8;  // warps of the blocks that use WarpTile

__device__ __forceinline__ float Tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// Warp tiling of an output of RB x CB fragments (16 x 16) over the 8 warps: a grid of (8 / WCW) x WCW warps,
// each owning FR x FC fragments (WCW: warps along the columns, min(CB, 4) unless given).
template <int RB, int CB, int WCW = (CB < 4 ? CB : 4)>
struct WarpTile {
  static constexpr int kWcw = WCW;
  static constexpr int kWrw = kMmaWarps / kWcw;
  static constexpr int kFR = RB / kWrw;
  static constexpr int kFC = CB / kWcw;
  static_assert(kWcw * kWrw == kMmaWarps && kFR * kWrw == RB && kFC * kWcw == CB && kFR >= 1 && kFC >= 1,
                "output does not tile over 8 warps");
  __device__ static int Row0(int warp) { return (warp / kWcw) * kFR; }
  __device__ static int Col0(int warp) { return (warp % kWcw) * kFC; }
  __device__ static int ColWarp(int warp) { return warp % kWcw; }
};

// A warp's accumulators for FR x FC output fragments of 16 x 16, held as the m16n8k8 MMA's C fragments
// (two 16 x 8 halves per 16 x 16 fragment): lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8,
// columns 2t and 2t + 1 of each half (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32).
template <int FR, int FC>
struct Frags {
  float c[FR][2 * FC][4];
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < FR; ++i)
#pragma unroll
      for (int j = 0; j < 2 * FC; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) c[i][j][q] = 0.f;
  }
};

__device__ __forceinline__ void Mma1688(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// acc += sum over k < 8 ksteps of A(16 (r0 + i) + ., k) B(k, 16 (c0 + j) + .) for the row fragments
// r0 + i < row_frags. A(row, k) is A[row * lda + k] (kARow) or A[k * lda + row]; B(k, col) is B[k * ldb + col]
// (kBRow) or B[col * ldb + k]. A and B point into shared memory (plain indexed loads: LDS with immediate
// offsets); the operands are TF32 values already (rounded when they were written). Lane (g, t) loads
// A(g | g + 8, t | t + 4) and B(t | t + 4, g) of each fragment, as the m16n8k8 MMA expects.
template <int FR, int FC, bool kARow, bool kBRow>
__device__ __forceinline__ void WarpMma(Frags<FR, FC>& acc, const float* A, int lda, const float* B, int ldb,
                                        int r0, int c0, int ksteps, int row_frags, int lane) {
  const int g = lane >> 2, t = lane & 3;
  auto a_at = [&](int row, int k) { return __float_as_uint(kARow ? A[row * lda + k] : A[k * lda + row]); };
  auto b_at = [&](int k, int col) { return __float_as_uint(kBRow ? B[k * ldb + col] : B[col * ldb + k]); };
#pragma unroll 2
  for (int ks = 0; ks < ksteps; ++ks) {
    const int k = 8 * ks + t;
    uint32_t a[FR][4], b[2 * FC][2];
#pragma unroll
    for (int i = 0; i < FR; ++i) {
      const int row = 16 * (r0 + i) + g;
      if (r0 + i < row_frags) {
        a[i][0] = a_at(row, k);
        a[i][1] = a_at(row + 8, k);
        a[i][2] = a_at(row, k + 4);
        a[i][3] = a_at(row + 8, k + 4);
      }
    }
#pragma unroll
    for (int j = 0; j < 2 * FC; ++j) {
      const int col = 16 * c0 + 8 * j + g;
      b[j][0] = b_at(k, col);
      b[j][1] = b_at(k + 4, col);
    }
#pragma unroll
    for (int i = 0; i < FR; ++i) {
      if (r0 + i < row_frags) {
#pragma unroll
        for (int j = 0; j < 2 * FC; ++j) Mma1688(acc.c[i][j], a[i], b[j]);
      }
    }
  }
}

// Calls f(row, col, v0, v1) for every pair of adjacent accumulator values (v0 at column col, even; v1 at col + 1)
// of the row fragments r0 + i < row_frags (row and column in the output).
template <int FR, int FC, typename F>
__device__ __forceinline__ void ForEachAccPair(const Frags<FR, FC>& acc, int r0, int c0, int row_frags, int lane,
                                               F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < FR; ++i) {
    if (r0 + i < row_frags) {
      const int row = 16 * (r0 + i) + g;
#pragma unroll
      for (int j = 0; j < 2 * FC; ++j) {
        const int col = 16 * c0 + 8 * j + 2 * t;
        f(row, col, acc.c[i][j][0], acc.c[i][j][1]);
        f(row + 8, col, acc.c[i][j][2], acc.c[i][j][3]);
      }
    }
  }
}

// Stores the row fragments r0 + i < row_frags of acc to dst (row-major, row stride ld; shared or global).
template <int FR, int FC>
__device__ __forceinline__ void StoreRows(float* dst, int ld, const Frags<FR, FC>& acc, int r0, int c0,
                                          int row_frags, int lane) {
  ForEachAccPair(acc, r0, c0, row_frags, lane, [&](int row, int col, float v0, float v1) {
    *reinterpret_cast<float2*>(dst + row * ld + col) = make_float2(v0, v1);
  });
}

}  // namespace jaxfox
