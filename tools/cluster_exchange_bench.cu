// Latency of one all-gather step between the CTAs of a thread-block cluster, by exchange mechanism
// (a diagnosis tool for the CfC kernels' per-step exchanges, not part of the package).
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/xbench tools/cluster_exchange_bench.cu
//   /tmp/xbench            # prints one line per variant: us per step, and a checksum
//
// Each cluster of C = 4 CTAs (256 threads each; 32 clusters, as the CfC kernels at B = 32) runs STEPS
// dependent steps: every CTA sends W = 32 floats (its slice) to every CTA of the cluster (itself
// included), waits for the 4 W floats of the step, and derives its next slice from them (so each step
// depends on the last one's data). Variants:
//   0 block barrier only (no exchange): the floor
//   1 st.async 4 B a value, every thread polls the mbarrier, then __syncthreads (as cfc.cu now)
//   2 st.async 4 B, warp 0 alone polls, then __syncthreads
//   3 st.async.v4 (16 B a store), every thread polls, then __syncthreads
//   4 cp.async.bulk of the 128-byte slice from a staging buffer (one thread, one copy per receiver)
//   5 plain remote stores + barrier.cluster.arrive.release / wait
//   6 plain remote stores + remote mbarrier.arrive.release.cluster (one per sending warp and receiver)
//   7 st.async.v4, warp 0 alone polls, then __syncthreads
//
// H200, 2026-12-04 (us per step): 0 0.034, 1 0.172, 2 0.168, 3 0.182, 7 0.176, 4 0.304, 5 0.368, 6 0.413.
// So an exchange of this size costs ~0.17 us: two a step are ~0.35 of the ~2.8-3.1 us of a CfC forward step.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

namespace cg = cooperative_groups;

constexpr int C = 4, NT = 256, W = 32, STEPS = 2048, CLUSTERS = 32;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint32_t MapRank(uint32_t a, int r) {
  uint32_t o;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
  return o;
}
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Acquire at CTA scope (cfc.cu's waits) or, for data released by remote arrives, at cluster scope.
template <bool kClusterScope = false>
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    if constexpr (kClusterScope) {
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } else {
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
  } while (!done);
}
__device__ __forceinline__ void StAsync(uint32_t raddr, float v, uint32_t rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(raddr),
               "r"(__float_as_uint(v)), "r"(rbar) : "memory");
}
__device__ __forceinline__ void StAsync4(uint32_t raddr, float4 v, uint32_t rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(raddr),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)),
               "r"(rbar) : "memory");
}
__device__ __forceinline__ void BulkToCluster(uint32_t rdst, uint32_t src, uint32_t bytes, uint32_t rbar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(rdst), "r"(src), "r"(bytes), "r"(rbar) : "memory");
}
__device__ __forceinline__ void StCluster(uint32_t raddr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(raddr), "f"(v) : "memory");
}
__device__ __forceinline__ void RemoteArrive(uint32_t rbar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(rbar) : "memory");
}

template <int V>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NT, 1) xkernel(float* out) {
  __shared__ __align__(16) float buf[2][C * W];   // receive buffers, by step parity
  __shared__ __align__(16) float stage[2][W];     // variant 4: the slice to send
  __shared__ __align__(8) unsigned long long bar[2];
  const int tid = threadIdx.x, c = int(blockIdx.x % C);
  const uint32_t base = SmemAddr(&buf[0][0]);
  uint32_t rb[C];
  for (int r = 0; r < C; ++r) rb[r] = MapRank(SmemAddr(&buf[0][0]), r);
  const uint32_t bar0 = SmemAddr(&bar[0]);
  const uint32_t bytes = 4 * C * W;
  if (tid == 0) {
    const int count = V == 6 ? C * (W / 32) : 1;
    for (int p = 0; p < 2; ++p) {
      MbarInit(bar0 + 8 * p, count);
      if (V != 6 && V != 5) MbarExpect(bar0 + 8 * p, bytes);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  float mine = float(tid + c);
  cg::this_cluster().sync();
  float acc = 0.f;
  for (int t = 0; t < STEPS; ++t) {
    const int par = t & 1;
    const uint32_t boff = uint32_t(par * C * W * 4 + c * W * 4);  // this CTA's slot in the receiver's buf[par]
    const uint32_t bar_p = bar0 + 8 * par;
    if constexpr (V == 0) {
      if (tid < W) buf[par][c * W + tid] = mine;
      __syncthreads();
    } else if constexpr (V == 1 || V == 2) {
      if (tid < C * W) {  // thread (r, i): value i to rank r
        const int r = tid / W, i = tid % W;
        StAsync(rb[r] + boff + 4 * i, mine + float(i), MapRank(bar_p, r));
      }
      if (V == 1 || tid < 32) MbarWait(bar_p, (t >> 1) & 1);
      if (tid == 0) MbarExpect(bar_p, bytes);
      __syncthreads();
    } else if constexpr (V == 3 || V == 7) {
      if (tid < C * W / 4) {
        const int r = tid / (W / 4), i = tid % (W / 4);
        StAsync4(rb[r] + boff + 16 * i, make_float4(mine, mine + 1, mine + 2, mine + 3), MapRank(bar_p, r));
      }
      if (V == 3 || tid < 32) MbarWait(bar_p, (t >> 1) & 1);
      if (tid == 0) MbarExpect(bar_p, bytes);
      __syncthreads();
    } else if constexpr (V == 4) {
      if (tid < W) {
        stage[par][tid] = mine + float(tid);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      }
      __syncwarp();
      if (tid < C) BulkToCluster(rb[tid] + boff, SmemAddr(&stage[par][0]), 4 * W, MapRank(bar_p, tid));
      if (tid < 32) MbarWait(bar_p, (t >> 1) & 1);
      if (tid == 0) MbarExpect(bar_p, bytes);
      __syncthreads();
    } else if constexpr (V == 5) {
      if (tid < C * W) {
        const int r = tid / W, i = tid % W;
        StCluster(rb[r] + boff + 4 * i, mine + float(i));
      }
      asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else if constexpr (V == 6) {
      if (tid < C * W) {
        const int r = tid / W, i = tid % W;
        StCluster(rb[r] + boff + 4 * i, mine + float(i));
        __syncwarp();
        if ((tid & 31) == 0) RemoteArrive(MapRank(bar_p, r));
      }
      if (tid < 32) MbarWait<true>(bar_p, (t >> 1) & 1);
      __syncthreads();
    }
    // the next slice depends on this step's data
    const float* r = &buf[par][0];
    acc += r[(tid * 7) % (C * W)] * 1e-6f;
    mine = acc + float(c);
    (void)base;
  }
  out[blockIdx.x * NT + tid] = acc;
  cg::this_cluster().sync();
}

template <int V>
void Run(float* d_out, std::vector<float>& h) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  xkernel<V><<<CLUSTERS * C, NT>>>(d_out);  // warm-up
  cudaEventRecord(e0);
  const int reps = 5;
  for (int i = 0; i < reps; ++i) xkernel<V><<<CLUSTERS * C, NT>>>(d_out);
  cudaEventRecord(e1);
  cudaError_t err = cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaMemcpy(h.data(), d_out, h.size() * 4, cudaMemcpyDeviceToHost);
  double s = 0;
  for (float v : h) s += v;
  std::printf("variant %d: %8.3f us per step  (%s, checksum %.6g)\n", V, 1e3 * ms / reps / STEPS,
              err == cudaSuccess ? "ok" : cudaGetErrorString(err), s);
}

int main() {
  float* d_out;
  cudaMalloc(&d_out, CLUSTERS * C * NT * 4);
  std::vector<float> h(CLUSTERS * C * NT);
  Run<0>(d_out, h);
  Run<1>(d_out, h);
  Run<2>(d_out, h);
  Run<3>(d_out, h);
  Run<7>(d_out, h);
  Run<4>(d_out, h);
  Run<5>(d_out, h);
  Run<6>(d_out, h);
  return 0;
}
