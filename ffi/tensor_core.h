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

// ---- Hopper warpgroup MMA (wgmma, sm_90a only: compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined, i.e. for
// -gencode arch=compute_90a,code=sm_90a; CMakeLists.txt builds 90a-real and defines JAXFOX_SM90A_BUILD for the
// host). Operands in shared memory, K-major (each row of a tile holds K contiguous floats), in 128-byte swizzled
// rows: 32 floats of K a row, the 16-byte chunk c of row r stored at chunk c ^ (r % 8), 8-row atoms of 1024 bytes
// (aligned to 1024). PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" (matrix descriptors,
// shared-memory layouts); TF32 operands must be K-major, and the tensor cores read only their TF32 bits
// (truncation of the float32 inputs, as XLA's Hopper TF32 GEMMs that load their tiles with the copy engine).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXFOX_HAS_WGMMA 1

// Descriptor of a K-major, 128-byte-swizzled tile at shared address `saddr` (its 8-row atoms 1024 bytes apart);
// the k-th 8-float step inside a 32-float row is saddr + 32 k.
__device__ __forceinline__ uint64_t WgmmaDescSw128(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaWaitAll() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins the accumulators in place around wgmma: the compiler may not move their reads or writes across this point
// (wgmma.wait_group names no registers; CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void WgmmaFenceOperand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's generic-proxy writes to shared memory (plain stores, cp.async) visible to the async proxy
// (wgmma's operand reads): each writing thread, before the barrier that precedes the wgmma.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d (64 x 128, float32) = A (64 x 8) B^T (B: 128 x 8) + (scale_d ? d : 0), over a warpgroup (128 threads).
// Thread (warp w of the warpgroup, lane l) holds rows 16 w + l / 4 (d[4 j], d[4 j + 1]) and 16 w + l / 4 + 8
// (d[4 j + 2], d[4 j + 3]), columns 8 j + 2 (l % 4) and + 1, for j < 16.
__device__ __forceinline__ void WgmmaM64N128K8Tf32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// d = A B^T over KB 32-float K blocks (KB x 4 wgmma k-steps, issued in k order; the first overwrites d): A is a
// 64-row swizzled tile at shared address a_base, B a 128-row one at b_base, their K blocks a_block / b_block bytes
// apart. The caller fences d and commits / waits (WgmmaFence before, WgmmaCommit and WgmmaWaitAll after).
template <int KB>
__device__ __forceinline__ void WgmmaSw128Product(float (&d)[64], uint32_t a_base, uint32_t a_block, uint32_t b_base,
                                                  uint32_t b_block) {
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      WgmmaM64N128K8Tf32(d, WgmmaDescSw128(a_base + kb * a_block + 32 * kk),
                         WgmmaDescSw128(b_base + kb * b_block + 32 * kk), (kb | kk) != 0);
    }
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace jaxfox
