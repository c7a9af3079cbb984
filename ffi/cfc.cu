// CfC scan: forward and backward kernels with the whole time loop inside one launch, and their
// XLA FFI handlers (targets jaxfox_cfc_fwd, jaxfox_cfc_bwd). Math: jaxfox/cfc.py and OPS.md.
//
// Work split. One sample is processed by a thread-block cluster of C CTAs (C in {1, 2, 4, 8};
// C > 1 needs sm_90). CTA c owns a slice of the hidden units (and of the backbone units and of
// the input features) and keeps only its slice of every weight matrix in shared memory, so the
// weights of a [I+H -> U -> 4H] cell (350 KB for I=48, H=U=128) are spread over the cluster and
// read from shared memory at every step instead of from L2. Each step is a chain of matrix-vector
// products; after each one the CTAs exchange the slices they produced through distributed shared
// memory (st.async remote stores completing on the receiver's mbarrier; no cluster barrier or
// fence per step). All sums are in a fixed order, so results do not
// depend on timing, and a sample gives the same bits whatever the batch around it.
//
// Two forward kernels: cfc_fwd_kernel (weights in shared memory or L2, any backbone depth) and, for
// depth <= 1 when each thread's dot products are long enough (UseRegForward), cfc_fwd_reg_kernel
// (weights in registers, k-splits summed with warp shuffles; 777 against 856 us at B=32 T=256 I=48
// H=U=128 on the H200). Both register kernels are compiled with fixed trip counts for the benchmark's and
// the main job's geometries (ByForwardGeometry / ByBackwardGeometry): forward 713 -> 513 us there.
//
// Backward: one reverse-time launch computes input gradients and the pre-activation gradients of
// every step (workspace outputs): cfc_bwd_reg_kernel (one backbone layer, when RegBackwardPlan fits:
// weights in registers, slices all-gathered; fwd+bwd 1.343 ms at the bench shape with the fixed geometries, 1.895 ms
// with cfc_bwd_kernel and the run-time ones, on the H200) or cfc_bwd_kernel (any depth). A tiled
// kernel then forms each sample's parameter-gradient partial sum_t input_t^T dpre_t (fixed t order)
// into [B, P], and reduce_axis0 sums those over B.
//
// At the benchmark's geometry the recurrences run cfc_fwd_ar_kernel / cfc_bwd_ar_kernel instead (UseArForward /
// UseArBackward: one backbone layer of U = 128 units, a cluster of C = 4, at most 32 hidden units and 16 inputs a CTA,
// modes default / no_gate; with ChooseCluster's rule that is H = 125 .. 128 and I <= 64): one cluster exchange a
// step, an all-reduce of partial sums, in place of the register kernels' two all-gathers; fwd+bwd 1.319 -> 1.018 ms
// at B=32 T=256 I=48 H=U=128 on the H100 (JAXFOX_CFC_ALLREDUCE=0 runs the register kernels there, for A/B timing and
// tests). Other sizes keep the register kernels: the one-exchange kernels' thread layout is compiled for U = 128.
#include <cooperative_groups.h>

#include <cstdlib>
#include <type_traits>

#include "common.h"
#include "tensor_core.h"

namespace cg = cooperative_groups;

namespace jaxfox {
namespace {

constexpr int kNT = 256;         // threads per CTA of the recurrent kernels
constexpr int kMaxLayers = 4;    // backbone depth handled by the kernels (jaxfox/cfc.py agrees)
constexpr float kLecunA = 1.7159f;
constexpr float kLecunB = 0.666f;

enum Mode : int { kDefault = 0, kNoGate = 1, kPure = 2 };

struct CfcDims {
  int I, H, U, L, mode, nh;  // nh: number of heads (4, or 1 in pure mode)
  int K0, Kh, NH;            // K0 = I + H; Kh = heads fan-in (U, or K0 when L = 0); NH = nh * H
  int64_t off_w[kMaxLayers], off_b[kMaxLayers], off_hw, off_hb, off_tau, off_A, P;
  int C, Hc, Uc, Ic;         // cluster size and slice widths (ceil(H / C) ...)
  int smem_w;                // 1: weight slices live in shared memory; 0: read from global (L2)
  // Register forward (reg_f = 1: it runs; RegForwardPlan fills the rest, UseRegForward decides): each
  // thread holds its slice of the weights in registers; an output's Sb (backbone) or Sh (heads) k-splits
  // sit in adjacent lanes, kcb / kch inputs each (multiples of 4), and are summed with warp shuffles.
  int reg_f, Sb, kcb, Sh, kch, zld, ald;
  // Split layout of the vectors the register kernels read (SplitStride): z is read in splits of zkc floats
  // placed zs apart, act (the backbone output) in splits of kch placed as_ apart.
  int zkc, zs, as_;
  // Register backward (reg_b = 1: it runs; RegBackwardPlan fills the rest): the heads' transposed product
  // has U outputs (this CTA's Uc) in S1 splits of k1 inputs (over NH), the backbone's has Ic + Hc outputs
  // (this CTA's inputs, then its hidden units) in S2 splits of k2 (over U); s1 / s2 their split strides.
  int reg_b, S1, k1, s1, S2, k2, s2, ph_ld, pb_ld, ts_ld;
  int64_t B, T, V;           // samples per instance, steps, vmapped instances
  __host__ __device__ int Kl(int l) const { return l == 0 ? K0 : U; }
};

// Shared-memory layout (offsets in floats), computed once on the host and passed to the kernels
// as a parameter (so every buffer address is `sm + constant`, which the compiler turns into
// 32-bit shared-memory loads). Weight slices first, padded to an odd row length so that both
// row-wise (forward) and column-wise (backward) walks are free of bank conflicts.
struct Layout {
  int wb[kMaxLayers], bb[kMaxLayers], wh, bh;  // weight slices (when smem_w)
  int red;                                     // partial sums of one product
  int task, task_ld;                           // per-product work tables (int4), task_ld int4 per product
  int mbar;                                    // 2 mbarriers per exchange kind (C > 1)
  int z, act;                                  // forward buffers
  int recv, dph, dpb, dts, tok, actb;          // backward buffers
  int total;
  int ldb, ldh, recv_slot;
};

__host__ __device__ inline int Align4(int n) { return (n + 3) & ~3; }

// Number of k-splits of a forward product with n_out outputs and reduction length K.
__host__ __device__ inline int Splits(int n_out, int K) {
  if (n_out <= 0) return 1;
  int s = kNT / n_out;
  int cap = K / 4;
  if (s > cap) s = cap;
  return s < 1 ? 1 : s;
}

// Number of splits of each column group of a transposed (backward) product.
__host__ __device__ inline int TransposedSplits(int K, int G, int Wg) {
  int s2 = kNT / (K * G > 0 ? K * G : 1);
  if (s2 > Wg / 8) s2 = Wg / 8;
  return s2 < 1 ? 1 : s2;
}

inline Layout MakeLayout(const CfcDims& d, bool bwd) {
  Layout s{};
  s.ldb = d.Uc + 1;
  s.ldh = d.nh * d.Hc + 1;
  int o = 0;
  if (d.smem_w) {
    for (int l = 0; l < d.L; ++l) {
      s.wb[l] = o; o += Align4(d.Kl(l) * s.ldb);
      s.bb[l] = o; o += Align4(d.Uc);
    }
    s.wh = o; o += Align4(d.Kh * s.ldh);
    s.bh = o; o += Align4(d.nh * d.Hc);
  }
  int red = kNT;  // most items of any product (forward: n_out * S; backward: K * G * S2)
  for (int v : {d.K0, d.U, d.nh * d.Hc, d.Kh * d.nh}) red = v > red ? v : red;
  s.red = o; o += Align4(red);
  s.task_ld = red + 1;  // one header + the items
  s.task = o; o += 4 * (d.L + 1) * s.task_ld;
  s.mbar = o; o += Align4(2 * 2 * (d.L + 1));  // 8-byte mbarriers, 2 per exchange kind
  if (!bwd) {
    s.z = o; o += Align4(2 * d.K0);
    s.act = o; o += Align4(d.L * d.U);
  } else {
    s.recv_slot = d.Uc > d.Ic + d.Hc ? d.Uc : d.Ic + d.Hc;
    s.recv = o; o += Align4((d.L + 1) * 2 * d.C * s.recv_slot);
    s.dph = o; o += Align4(d.nh * d.Hc);
    s.dpb = o; o += Align4(d.Uc);
    s.dts = o; o += Align4(2 * d.C);
    s.tok = o; o += Align4(2 * d.C);
    s.actb = o; o += Align4(d.L * d.Uc);
  }
  s.total = o;
  return s;
}

// ---- cluster helpers (C == 1: a plain block, no cluster API; C > 1 needs sm_90) -------------
template <int C>
__device__ __forceinline__ void ClusterSync() {
  if constexpr (C == 1) {
    __syncthreads();
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::this_cluster().sync();
#else
    __trap();
#endif
  }
}

// Exchanges between the CTAs of a cluster go through distributed shared memory with st.async: each
// remote 4-byte store signals the receiver's mbarrier (complete_tx), and the receiver waits on its
// own mbarrier for the bytes it expects. No cluster-wide barrier and no memory fence sits on the
// step-to-step path (the cluster barrier's release fence waited for every earlier global store).
// Every exchange kind has two mbarriers used on alternate steps (a CTA can be at most one exchange
// of a kind ahead of any receiver, so the bytes of step n + 1 never land in step n's phase).
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t MapRank(uint32_t addr, int rank) {
  uint32_t r = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
#endif
  return r;
}

__device__ __forceinline__ void MbarInit(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void MbarInitFence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The receiver's own arrival for a phase, with the bytes that phase must receive.
__device__ __forceinline__ void MbarExpect(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// Acquire at CTA scope, as for TMA multicast: the data sits in this CTA's shared memory and the
// phase completes only after every st.async that counts towards it has landed. (A cluster-scope
// acquire also invalidated the L1 cache at every wait: CCTL.IVALL, the top stall in ncu.)
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}

// 4-byte store into the shared memory of a cluster CTA (cluster address), completing 4 bytes of
// the transaction count of the mbarrier at cluster address rbar in that CTA.
__device__ __forceinline__ void StAsync(uint32_t raddr, float v, uint32_t rbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(raddr),
               "r"(__float_as_uint(v)), "r"(rbar)
               : "memory");
#else
  __trap();
#endif
}

// The same for 16 bytes (raddr 16-byte aligned).
__device__ __forceinline__ void StAsync4(uint32_t raddr, float4 v, uint32_t rbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(raddr),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)),
               "r"(rbar)
               : "memory");
#else
  __trap();
#endif
}

// A kernel's cluster exchanges: `kinds` of them, each with two mbarriers (one a step parity) at Bar(kind, par) in
// every CTA, and every rank's shared-memory base. Thread 0 initialises the mbarriers and arms the first two steps of
// each kind (the caller's ClusterSync publishes that); Wait re-arms a parity's mbarrier for step n + 2 once step n's
// bytes are in. C = 1: sends are local stores and Wait does nothing (the caller's block barrier orders them).
template <int C>
struct ClusterExchange {
  uint32_t mbar0, bar_off;
  uint32_t rbase[C];
  __device__ __forceinline__ ClusterExchange(float* sm, int mbar_off) {
    mbar0 = SmemAddr(sm + mbar_off);
    bar_off = mbar0 - SmemAddr(sm);
#pragma unroll
    for (int r = 0; r < C; ++r) rbase[r] = MapRank(SmemAddr(sm), r);
  }
  __device__ __forceinline__ uint32_t Bar(int kind, int par) const { return mbar0 + 8 * (2 * kind + par); }
  // bytes(kind): what a step of that kind brings to this CTA (0: the kind is never waited for); steps(kind): how
  // many steps run it.
  template <class Bytes, class Steps>
  __device__ __forceinline__ void Init(int kinds, Bytes bytes, Steps steps) const {
    if constexpr (C > 1) {
      if (threadIdx.x == 0) {
        for (int kind = 0; kind < kinds; ++kind)
          for (int par = 0; par < 2; ++par) {
            MbarInit(Bar(kind, par));
            if (par < steps(kind) && bytes(kind) > 0) MbarExpect(Bar(kind, par), bytes(kind));
          }
        MbarInitFence();
      }
    }
  }
  // v into element e (float offset) of rank r's shared memory, counted on its mbarrier (kind, par).
  __device__ __forceinline__ void Put(float* sm, int r, int e, float v, int kind, int par) const {
    if constexpr (C == 1) {
      sm[e] = v;
    } else {
      StAsync(rbase[r] + 4 * e, v, rbase[r] + bar_off + 8 * (2 * kind + par));
    }
  }
  // The same into every rank.
  __device__ __forceinline__ void Send(float* sm, int e, float v, int kind, int par) const {
#pragma unroll
    for (int r = 0; r < C; ++r) Put(sm, r, e, v, kind, par);
  }
  // Four floats (e 16-byte aligned) into every rank.
  __device__ __forceinline__ void Send4(float* sm, int e, float4 v, int kind, int par) const {
    if constexpr (C == 1) {
      *reinterpret_cast<float4*>(sm + e) = v;
    } else {
#pragma unroll
      for (int r = 0; r < C; ++r) StAsync4(rbase[r] + 4 * e, v, rbase[r] + bar_off + 8 * (2 * kind + par));
    }
  }
  // Until step n's bytes of exchange `kind` (parity par = n & 1) are in; `bytes` and `steps` as for Init.
  __device__ __forceinline__ void Wait(int kind, int n, int par, uint32_t bytes, int steps) const {
    if constexpr (C > 1) {
      MbarWait(Bar(kind, par), (n >> 1) & 1);
      if (threadIdx.x == 0 && n + 2 < steps) MbarExpect(Bar(kind, par), bytes);
    }
  }
};

__device__ __forceinline__ float LecunTanh(float x) { return kLecunA * tanhf(kLecunB * x); }
__device__ __forceinline__ float LecunTanhGradFromOut(float y) {
  const float t = y / kLecunA;
  return kLecunA * kLecunB * (1.f - t * t);
}
__device__ __forceinline__ float Sign(float x) { return float((x > 0.f) - (x < 0.f)); }

// This CTA's slice of the hidden units, backbone units and inputs.
struct Slice {
  int c, j0, Hce, u0, Uce, x0, Ice;
};

__device__ __forceinline__ Slice MakeSlice(const CfcDims& d, int c) {
  Slice s;
  s.c = c;
  s.j0 = c * d.Hc;
  s.Hce = max(0, min(d.H, s.j0 + d.Hc) - s.j0);
  s.u0 = c * d.Uc;
  s.Uce = d.L > 0 ? max(0, min(d.U, s.u0 + d.Uc) - s.u0) : 0;
  s.x0 = c * d.Ic;
  s.Ice = max(0, min(d.I, s.x0 + d.Ic) - s.x0);
  return s;
}

// Copies this CTA's weight slices into shared memory (SmemW), or does nothing.
template <bool SmemW>
__device__ void StageWeights(const CfcDims& d, const Layout& lay, const Slice& s, float* sm, const float* w) {
  if constexpr (SmemW) {
    const int tid = threadIdx.x;
    for (int l = 0; l < d.L; ++l) {
      const int K = d.Kl(l);
      float* ws = sm + lay.wb[l];
      for (int idx = tid; idx < K * s.Uce; idx += kNT) {
        const int k = idx / s.Uce, o = idx - k * s.Uce;
        ws[k * lay.ldb + o] = w[d.off_w[l] + int64_t(k) * d.U + s.u0 + o];
      }
      for (int o = tid; o < s.Uce; o += kNT) sm[lay.bb[l] + o] = w[d.off_b[l] + s.u0 + o];
    }
    const int nhe = d.nh * s.Hce;
    float* wsh = sm + lay.wh;
    for (int idx = tid; idx < d.Kh * nhe; idx += kNT) {
      const int k = idx / nhe, n = idx - k * nhe, q = n / s.Hce, jj = n - q * s.Hce;
      wsh[k * lay.ldh + q * d.Hc + jj] = w[d.off_hw + int64_t(k) * d.NH + q * d.H + s.j0 + jj];
    }
    for (int n = tid; n < nhe; n += kNT) {
      const int q = n / s.Hce, jj = n - q * s.Hce;
      sm[lay.bh + q * d.Hc + jj] = w[d.off_hb + q * d.H + s.j0 + jj];
    }
  }
}

// Weight views of the slices: element (k, col) at base[k * ld + col]; head q's column jj is
// col = q * qs + jj. In shared memory (SmemW) or the parameter vector in global memory.
template <bool SmemW>
struct Weights {
  const float* base;
  int ld, qs;
};

template <bool SmemW>
__device__ __forceinline__ Weights<SmemW> BackboneW(const CfcDims& d, const Layout& lay, const Slice& s,
                                                    const float* sm, const float* w, int l) {
  if constexpr (SmemW) return {sm + lay.wb[l], lay.ldb, 0};
  else return {w + d.off_w[l] + s.u0, d.U, 0};
}

template <bool SmemW>
__device__ __forceinline__ Weights<SmemW> HeadsW(const CfcDims& d, const Layout& lay, const Slice& s,
                                                 const float* sm, const float* w) {
  if constexpr (SmemW) return {sm + lay.wh, lay.ldh, d.Hc};
  else return {w + d.off_hw + s.j0, d.NH, d.H};
}

template <bool SmemW>
__device__ __forceinline__ float BackboneBias(const CfcDims& d, const Layout& lay, const Slice& s, const float* sm,
                                              const float* w, int l, int o) {
  if constexpr (SmemW) return sm[lay.bb[l] + o];
  else return w[d.off_b[l] + s.u0 + o];
}

template <bool SmemW>
__device__ __forceinline__ float HeadBias(const CfcDims& d, const Layout& lay, const Slice& s, const float* sm,
                                          const float* w, int q, int jj) {
  if constexpr (SmemW) return sm[lay.bh + q * d.Hc + jj];
  else return w[d.off_hb + q * d.H + s.j0 + jj];
}

// Work tables, built once per launch so the time loop does no index arithmetic (no integer
// divisions): product p's header task[p * ld] = (items, n_sum, n_split, 0) and item i's entry
// task[p * ld + 1 + i]. Item i is computed by thread i % kNT and its partial sum goes to red[i];
// output o of the product is red[o] + red[n_sum + o] + ... (n_split terms, fixed order).
//
// Forward product (out[o] = sum_k in[k] W[k, col(o)], n_out outputs, K-range split S ways):
// entry = (col(o), k0, k1, 0) for item i = s * n_out + o.
__device__ void BuildForwardTable(int4* tab, int n_out, int K, int Hce, int qs, bool heads) {
  const int S = Splits(n_out, K), kc = (K + S - 1) / S, items = n_out * S;
  if (threadIdx.x == 0) tab[0] = make_int4(items, n_out, S, 0);
  for (int i = threadIdx.x; i < items; i += kNT) {
    const int s = i / n_out, o = i - s * n_out;
    const int k0 = s * kc, k1 = min(K, k0 + kc);
    int col = o;
    if (heads) {
      const int q = o / Hce;
      col = q * qs + (o - q * Hce);
    }
    tab[1 + i] = make_int4(col, k0, max(k0, k1), 0);
  }
}

// Transposed product over G column groups of width Wg (dIn[k] = sum_g sum_jj W[k, g * qs + jj]
// v[g * Wg + jj]), each group's columns split S2 ways: item i = (g * S2 + s2) * K + k has entry
// (k * ld + g * qs, g * Wg, j0, j1).
__device__ void BuildTransposedTable(int4* tab, int K, int G, int Wg, int ld, int qs) {
  const int S2 = TransposedSplits(K, G, Wg), wc = (Wg + S2 - 1) / S2, items = K * G * S2;
  if (threadIdx.x == 0) tab[0] = make_int4(items, K, G * S2, 0);
  for (int i = threadIdx.x; i < items; i += kNT) {
    const int split = i / K, k = i - split * K;
    const int g = split / S2, s2 = split - g * S2;
    const int j0 = min(Wg, s2 * wc), j1 = min(Wg, j0 + wc);
    tab[1 + i] = make_int4(k * ld + g * qs, g * Wg, j0, j1);
  }
}

// red[i] = partial of item i. Four interleaved partial sums break the FMA dependency chain; they
// are added as (a0 + a1) + (a2 + a3): a fixed order.
__device__ __forceinline__ void ForwardPartials(const int4* tab, const float* in, const float* wbase, int ld,
                                                float* red) {
  const int items = tab[0].x;
  for (int i = threadIdx.x; i < items; i += kNT) {
    const int4 e = tab[1 + i];
    const float* wc = wbase + e.x + e.y * ld;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int k = e.y;
    for (; k + 4 <= e.z; k += 4, wc += 4 * ld) {
      a0 = fmaf(in[k], wc[0], a0);
      a1 = fmaf(in[k + 1], wc[ld], a1);
      a2 = fmaf(in[k + 2], wc[2 * ld], a2);
      a3 = fmaf(in[k + 3], wc[3 * ld], a3);
    }
    for (; k < e.z; ++k, wc += ld) a0 = fmaf(in[k], wc[0], a0);
    red[i] = (a0 + a1) + (a2 + a3);
  }
}

__device__ __forceinline__ void TransposedPartials(const int4* tab, const float* v, const float* wbase,
                                                   float* red) {
  const int items = tab[0].x;
  for (int i = threadIdx.x; i < items; i += kNT) {
    const int4 e = tab[1 + i];
    const float* wr = wbase + e.x;
    const float* vg = v + e.y;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int jj = e.z;
    for (; jj + 4 <= e.w; jj += 4) {
      a0 = fmaf(wr[jj], vg[jj], a0);
      a1 = fmaf(wr[jj + 1], vg[jj + 1], a1);
      a2 = fmaf(wr[jj + 2], vg[jj + 2], a2);
      a3 = fmaf(wr[jj + 3], vg[jj + 3], a3);
    }
    for (; jj < e.w; ++jj) a0 = fmaf(wr[jj], vg[jj], a0);
    red[i] = (a0 + a1) + (a2 + a3);
  }
}

__device__ __forceinline__ float SumSplits(const float* red, int n_sum, int n_split, int o) {
  float v = red[o];
  for (int s = 1; s < n_split; ++s) v += red[s * n_sum + o];
  return v;
}

// ---------------------------------------------------------------------------------------------
// Forward: hs [S, T, H]; residuals acts [S, T, L*U] (post-activation), pre [S, T, NH] (head
// pre-activations), S = V * B samples. Exchange kinds: backbone layer l (kind l, every CTA sends
// its U-slice to every CTA: 4 U bytes per receiver) and the new hidden state (kind L, 4 H bytes).
template <int C, bool SmemW>
__global__ void __launch_bounds__(kNT, 1)
cfc_fwd_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ Layout lay, const float* __restrict__ xs, const float* __restrict__ ts,
               const float* __restrict__ h0, const float* __restrict__ wflat, float* __restrict__ hs,
               float* __restrict__ acts, float* __restrict__ pre) {
  extern __shared__ __align__(16) float sm[];
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, L = d.L, K0 = d.K0;
  const int Hce = s.Hce, nhe = d.nh * Hce;
  float* z = sm + lay.z;  // z[par * K0 + k]: x_t then h_{t-1}
  float* act = sm + lay.act;
  float* red = sm + lay.red;
  int4* task = reinterpret_cast<int4*>(sm + lay.task);

  StageWeights<SmemW>(d, lay, s, sm, w);
  for (int l = 0; l < L; ++l) BuildForwardTable(task + l * lay.task_ld, s.Uce, d.Kl(l), 1, 0, false);
  BuildForwardTable(task + L * lay.task_ld, nhe, d.Kh, Hce, HeadsW<SmemW>(d, lay, s, sm, w).qs, true);
  for (int j = tid; j < H; j += kNT) z[I + j] = h0[sb * H + j];

  // Exchange kind l < L: backbone layer l's activations (U floats, T steps); kind L: h_t (H floats, T - 1 steps).
  const ClusterExchange<C> ex(sm, lay.mbar);
  auto kind_bytes = [&](int kind) { return uint32_t(4 * (kind < L ? U : H)); };
  auto kind_steps = [&](int kind) { return kind < L ? T : T - 1; };
  ex.Init(L + 1, kind_bytes, kind_steps);
  // Sends v to element `e` (float offset in shared memory) of every CTA of the cluster.
  auto broadcast = [&](int e, float v, int kind, int t) { ex.Send(sm, e, v, kind, t & 1); };
  // Waits for exchange `kind` of step t and holds every thread until the whole CTA is past the exchange, so `red`
  // can be overwritten. (The exchange alone orders that too, since every reader of `red` sends to this CTA after
  // reading it, but compute-sanitizer's racecheck only knows block barriers.)
  auto receive = [&](int kind, int t) {
    ex.Wait(kind, t, t & 1, kind_bytes(kind), kind_steps(kind));
    __syncthreads();
  };

  float wtau = 0.f, Ap = 0.f;
  if (d.mode == kPure && tid < Hce) {
    wtau = fabsf(w[d.off_tau + s.j0 + tid]);
    Ap = w[d.off_A + s.j0 + tid];
  }
  const float* xrow = xs + sb * T * I;
  float xnext = tid < I ? xrow[tid] : 0.f;
  float tsnext = ts[sb * T];
  ClusterSync<C>();  // weights and tables staged, mbarriers initialised, every CTA running

  const Weights<SmemW> wh = HeadsW<SmemW>(d, lay, s, sm, w);
  for (int t = 0; t < T; ++t) {
    float* zt = z + (t & 1) * K0;
    const int zn_off = lay.z + ((t + 1) & 1) * K0;
    const float tst = tsnext;
    if (tid < I) zt[tid] = xnext;
    for (int i = tid + kNT; i < I; i += kNT) zt[i] = xrow[t * I + i];  // inputs past the first kNT (no prefetch)
    if (t + 1 < T) {
      if (tid < I) xnext = xrow[(t + 1) * I + tid];
      tsnext = ts[sb * T + t + 1];
    }
    if (t > 0) {
      receive(L, t - 1);  // h_{t-1}, and the x_t stores above
    } else {
      __syncthreads();
    }
    const int64_t row = sb * T + t;
    // Backbone layers.
    for (int l = 0; l < L; ++l) {
      const float* in = l == 0 ? zt : act + (l - 1) * U;
      const Weights<SmemW> wv = BackboneW<SmemW>(d, lay, s, sm, w, l);
      const int4* tab = task + l * lay.task_ld;
      ForwardPartials(tab, in, wv.base, wv.ld, red);
      __syncthreads();
      const int S = tab[0].z;
      for (int o = tid; o < s.Uce; o += kNT) {
        const float a = LecunTanh(SumSplits(red, s.Uce, S, o) + BackboneBias<SmemW>(d, lay, s, sm, w, l, o));
        broadcast(lay.act + l * U + s.u0 + o, a, l, t);
        acts[row * L * U + l * U + s.u0 + o] = a;
      }
      receive(l, t);
    }
    // Heads: local column o = q * Hce + jj.
    {
      const float* in = L > 0 ? act + (L - 1) * U : zt;
      const int4* tab = task + L * lay.task_ld;
      ForwardPartials(tab, in, wh.base, wh.ld, red);
      __syncthreads();
      const int S = tab[0].z;
      // Thread jj adds up the nh head pre-activations of its hidden unit and applies the gate.
      for (int jj = tid; jj < Hce; jj += kNT) {
        float hv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (q < d.nh) {
            hv[q] = SumSplits(red, nhe, S, q * Hce + jj) + HeadBias<SmemW>(d, lay, s, sm, w, q, jj);
            pre[row * d.NH + q * H + s.j0 + jj] = hv[q];
          }
        }
        float h;
        if (d.mode == kPure) {
          const float f = hv[0];
          const float A = jj == tid ? Ap : w[d.off_A + s.j0 + jj];
          const float wt = jj == tid ? wtau : fabsf(w[d.off_tau + s.j0 + jj]);
          h = -A * expf(-tst * (wt + fabsf(f))) * f + A;
        } else {
          const float f1 = tanhf(hv[0]), f2 = tanhf(hv[1]);
          const float g = Sigmoid(hv[2] * tst + hv[3]);
          h = d.mode == kNoGate ? f1 + g * f2 : f1 * (1.f - g) + g * f2;
        }
        hs[row * H + s.j0 + jj] = h;
        if (t + 1 < T) broadcast(zn_off + I + s.j0 + jj, h, L, t);
      }
    }
  }
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// ---------------------------------------------------------------------------------------------
// Register forward (backbone depth L <= 1, used when RegForwardPlan fits): the same recurrence and
// outputs as cfc_fwd_kernel, but every thread keeps its weights in registers for the whole scan
// (up to kRegB backbone and kRegH head weights), reads its inputs as float4 broadcasts, and the
// k-splits of one output sit in adjacent lanes and are summed with xor shuffles (a fixed tree,
// the same in every lane), so no partial-sum buffer and no block barrier sits between a product and
// its activation; all warps apply activations and gates. Lane layout: backbone output o = tid / Sb,
// split tid % Sb; hidden unit jj's heads at tid = jj * Sh + split, each lane computing all nh heads of its unit
// over its split (so each float4 read feeds nh products: a quarter of the shared-memory wavefronts of one head a
// lane); QuadSum leaves head q's total in lanes q Sh / 4 .. (q + 1) Sh / 4 - 1 of the unit, and the gate needs only
// shuffles. Activations are double-buffered
// by step parity, so remote stores of step t + 1 never land in the buffer step t still reads.
constexpr int kRegB = 32, kRegH = 64;

__host__ __device__ inline int FloorPow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// The register kernels read a vector in S splits of kc floats (kc a multiple of 4), one float4 at a time,
// the lanes of a quarter-warp reading up to 8 different splits at once. Split s starts at s * stride, with the
// stride an odd number of float4s, so those 8 float4s lie in 8 different groups of 4 banks (kc = 24 or 64
// unpadded put two splits in one group: twice the shared-memory wavefronts, ncu on the H200).
__host__ __device__ constexpr int SplitStride(int kc) { return (kc / 4) % 2 ? kc : kc + 4; }
// Position of element k of such a vector.
__host__ __device__ inline int SplitPos(int k, int kc, int stride) { return k + (k / kc) * (stride - kc); }

// Number of k-splits of a register product with `outputs` outputs of K inputs: a power of 2 <= group_max
// (its lanes are adjacent, summed by xor shuffles) with outputs * S <= kNT and no split shorter than 4.
inline int RegSplits(int outputs, int K, int group_max) {
  int S = FloorPow2(std::max(1, kNT / std::max(1, outputs)));
  S = std::min(S, group_max);
  S = std::min(S, FloorPow2(std::max(1, (K + 3) / 4)));
  return S;
}

// Fills the register forward's lane layout; false when the sizes need more than its register budget. (CTAs
// of 512 threads holding half the weights each measured slower: 877 against 704 us at the bench shape.)
bool RegForwardPlan(CfcDims* d) {
  if (d->L > 1) return false;
  if (d->L == 1) {
    d->Sb = RegSplits(d->Uc, d->K0, 32);
    d->kcb = Align4(int(CeilDiv(d->K0, d->Sb)));
    if (d->kcb > kRegB || d->Uc * d->Sb > kNT) return false;
  } else {
    d->Sb = 1; d->kcb = 0;
  }
  // Heads: each lane all nh heads of a unit over kch inputs (nh kch weights); four heads need >= 4 splits (QuadSum).
  d->Sh = RegSplits(d->Hc, d->Kh, 32);
  if (d->nh == 4) d->Sh = std::max(d->Sh, 4);
  d->kch = Align4(int(CeilDiv(d->Kh, d->Sh)));
  if (d->nh * d->kch > kRegH || d->Hc * d->Sh > kNT) return false;
  d->zkc = d->L > 0 ? d->kcb : d->kch;
  d->zs = SplitStride(d->zkc);
  // Whole splits for every lane that reads the vector (Sb or Sh of them), zero-padded: a lane may read its whole
  // split (cfc_fwd_reg_kernel's fixed geometries), whatever its share of the inputs.
  d->zld = std::max(int(CeilDiv(d->K0, d->zkc)), d->L > 0 ? d->Sb : d->Sh) * d->zs;
  d->as_ = SplitStride(d->kch);
  d->ald = d->L > 0 ? std::max(int(CeilDiv(d->U, d->kch)), d->Sh) * d->as_ : 0;
  return true;
}

inline Layout MakeRegForwardLayout(const CfcDims& d) {
  Layout s{};
  int o = 0;
  s.z = o; o += 2 * d.zld;
  s.act = o; o += d.L > 0 ? 2 * d.ald : 0;
  s.mbar = o; o += Align4(2 * 2 * (d.L + 1));
  s.total = o;
  return s;
}

// out = sum_k in[k] w[k] over n <= N inputs (n a multiple of 4 except for the last split, whose tail
// reads the zero padding of the input buffer), four interleaved partial sums added as (a0 + a1) + (a2 + a3).
template <int N>
__device__ __forceinline__ float RegDot(const float* __restrict__ in, const float (&w)[N], int n) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
  for (int c = 0; c < N; c += 4) {
    if (c < n) {
      const float4 v = *reinterpret_cast<const float4*>(in + c);
      a0 = fmaf(v.x, w[c], a0);
      a1 = fmaf(v.y, w[c + 1], a1);
      a2 = fmaf(v.z, w[c + 2], a2);
      a3 = fmaf(v.w, w[c + 3], a3);
    }
  }
  return (a0 + a1) + (a2 + a3);
}

__device__ __forceinline__ float GroupSum(float v, int group) {  // xor tree over `group` adjacent lanes
  for (int m = group >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// a[q] = sum_k in[k] w[q * QS + k] over n <= N inputs for the four heads q (as RegDot: the tail of the last split
// reads zero padding), one partial sum a head.
template <int N, int QS, int NW>
__device__ __forceinline__ void QuadDot(const float* __restrict__ in, const float (&w)[NW], int n, float (&a)[4]) {
  static_assert(N <= QS && 4 * QS <= NW, "quad layout");
#pragma unroll
  for (int q = 0; q < 4; ++q) a[q] = 0.f;
#pragma unroll
  for (int c = 0; c < N; c += 4) {
    if (c < n) {
      const float4 v = *reinterpret_cast<const float4*>(in + c);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        a[q] = fmaf(v.x, w[q * QS + c], a[q]);
        a[q] = fmaf(v.y, w[q * QS + c + 1], a[q]);
        a[q] = fmaf(v.z, w[q * QS + c + 2], a[q]);
        a[q] = fmaf(v.w, w[q * QS + c + 3], a[q]);
      }
    }
  }
}

// Sums four values over a group of S >= 4 adjacent lanes (split index sp = lane % S): two halving exchanges (lanes
// whose bit S / 2 is set keep heads 2, 3, the others 0, 1; then bit S / 4 picks one of the two), then an xor tree.
// Returns head sp / (S / 4)'s total, the same in each of its lanes (a fixed order of additions).
__device__ __forceinline__ float QuadSum(const float (&a)[4], int sp, int S) {
  const int m1 = S >> 1, m2 = S >> 2;
  const bool hi1 = sp & m1, hi2 = sp & m2;
  float k0 = hi1 ? a[2] : a[0], k1 = hi1 ? a[3] : a[1];
  const float s0 = hi1 ? a[0] : a[2], s1 = hi1 ? a[1] : a[3];
  k0 += __shfl_xor_sync(0xffffffffu, s0, m1);
  k1 += __shfl_xor_sync(0xffffffffu, s1, m1);
  float k = hi2 ? k1 : k0;
  k += __shfl_xor_sync(0xffffffffu, hi2 ? k0 : k1, m2);
  for (int m = m2 >> 1; m > 0; m >>= 1) k += __shfl_xor_sync(0xffffffffu, k, m);
  return k;
}

// A hidden unit's next state in modes default / no_gate from its four head values, one a lane: lane q of the unit's
// group (q = lane / hq within it) holds head q's value hv. Heads 0 and 1 take tanh of their value, head 2 the gate
// sigmoid(v2 ts + v3) = (1 + tanh((v2 ts + v3) / 2)) / 2 (head 3's value comes from the lane hq above); the result
// is valid in the q = 0 lanes. Every lane of the warp must call it (shuffles).
__device__ __forceinline__ float GatedState(float hv, float tst, int q, int hq, int mode) {
  const float v3 = __shfl_down_sync(0xffffffffu, hv, hq);
  const bool gate = q == 2;
  const float th = tanhf(gate ? 0.5f * (hv * tst + v3) : hv);
  const float f = gate ? fmaf(0.5f, th, 0.5f) : th;
  const float f2 = __shfl_down_sync(0xffffffffu, f, hq);
  const float g = __shfl_down_sync(0xffffffffu, f, 2 * hq);
  return mode == kNoGate ? f + g * f2 : f * (1.f - g) + g * f2;
}

// Geometry fixed at compile time (ByForwardGeometry picks it; KH = 0: read from CfcDims at run time). With it the register
// products are straight-line code: fixed trip counts, unpredicated loads (RegForwardPlan pads the split layouts
// with zeros to whole splits for every lane, and a lane's weights past its inputs are 0) and unrolled shuffle trees.
template <int C, int KB = 0, int SB = 0, int KH = 0, int SH = 0>
__global__ void __launch_bounds__(kNT, 1)
cfc_fwd_reg_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ Layout lay, const float* __restrict__ xs,
                   const float* __restrict__ ts, const float* __restrict__ h0, const float* __restrict__ wflat,
                   float* __restrict__ hs, float* __restrict__ acts, float* __restrict__ pre) {
  static_assert((KB > 0) == (KH > 0) && (SB > 0) == (KH > 0) && (SH > 0) == (KH > 0), "all fixed or none");
  extern __shared__ __align__(16) float sm[];
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, L = d.L;
  const int Hce = s.Hce, nh = d.nh;
  const int Sb = SB ? SB : d.Sb, kcb = KB ? KB : d.kcb, Sh = SH ? SH : d.Sh, kch = KH ? KH : d.kch;
  float* z = sm + lay.z;  // z[par * zld + k]: x_t then h_{t-1}, zero padding up to zld
  float* act = sm + lay.act;
  for (int i = tid; i < 2 * d.zld; i += kNT) z[i] = 0.f;
  if (L > 0) for (int i = tid; i < 2 * d.ald; i += kNT) act[i] = 0.f;
  __syncthreads();
  for (int j = tid; j < H; j += kNT) z[SplitPos(I + j, d.zkc, d.zs)] = h0[sb * H + j];

  // This thread's backbone item (output ob, inputs kb0 .. kb0 + nb) and head item (head q of unit jj); the
  // splits start at pb0 / ph0 in the split layouts of z and of the heads' input.
  const int ob = tid / Sb, spb = tid - ob * Sb;
  const bool has_b = L > 0 && ob < s.Uce;
  const int kb0 = spb * kcb, nb = has_b ? max(0, min(kcb, d.K0 - kb0)) : 0, pb0 = spb * d.zs;
  float wb[KB ? KB : kRegB];
#pragma unroll
  for (int k = 0; k < (KB ? KB : kRegB); ++k) wb[k] = k < nb ? w[d.off_w[0] + int64_t(kb0 + k) * U + s.u0 + ob] : 0.f;
  const float bias_b = has_b ? w[d.off_b[0] + s.u0 + ob] : 0.f;
  // Heads: lane sph of unit jj, all nh heads over inputs kh0 .. kh0 + nhk; with four heads its total is head q's
  // (QuadSum), whose lanes are hq = Sh / 4 apart.
  const bool quad = KH ? true : nh == 4;
  const int jj = tid / Sh, sph = tid - jj * Sh, hq = quad ? Sh >> 2 : 1, q = quad ? sph / hq : 0;
  const bool has_h = jj < Hce;
  const int kh0 = sph * kch, nhk = has_h ? max(0, min(kch, d.Kh - kh0)) : 0;
  const int ph0 = sph * (L > 0 ? d.as_ : d.zs);
  // Where this thread's stores land in the split layouts: its input x_tid, backbone output and hidden unit.
  const int px = SplitPos(tid, d.zkc, d.zs);
  const int pa = L > 0 ? SplitPos(s.u0 + ob, kch, d.as_) : 0;
  const int pz = SplitPos(I + s.j0 + jj, d.zkc, d.zs);
  constexpr int QS = KH ? KH : kRegH / 4, NWH = KH ? 4 * KH : kRegH;  // head stride in wh (quad), wh's size
  float wh[NWH];
  if (quad) {
#pragma unroll
    for (int qq = 0; qq < 4; ++qq)
#pragma unroll
      for (int k = 0; k < QS; ++k)
        wh[qq * QS + k] = k < nhk ? w[d.off_hw + int64_t(kh0 + k) * d.NH + qq * H + s.j0 + jj] : 0.f;
  } else {
#pragma unroll
    for (int k = 0; k < NWH; ++k) wh[k] = k < nhk ? w[d.off_hw + int64_t(kh0 + k) * d.NH + s.j0 + jj] : 0.f;
  }
  const float bias_h = has_h ? w[d.off_hb + q * H + s.j0 + jj] : 0.f;
  float wtau = 0.f, Ap = 0.f;
  if (d.mode == kPure && has_h) {
    wtau = fabsf(w[d.off_tau + s.j0 + jj]);
    Ap = w[d.off_A + s.j0 + jj];
  }

  // Exchange kind l < L: the backbone activations (U floats, T steps); kind L: h_t (H floats, T - 1 steps).
  const ClusterExchange<C> ex(sm, lay.mbar);
  auto kind_bytes = [&](int kind) { return uint32_t(4 * (kind < L ? U : H)); };
  auto kind_steps = [&](int kind) { return kind < L ? T : T - 1; };
  ex.Init(L + 1, kind_bytes, kind_steps);
  auto broadcast = [&](int e, float v, int kind, int t) { ex.Send(sm, e, v, kind, t & 1); };
  // Every thread waits for the bytes of exchange `kind` of step t itself (C > 1).
  auto wait = [&](int kind, int t) { ex.Wait(kind, t, t & 1, kind_bytes(kind), kind_steps(kind)); };

  // Per-step global addresses, advanced by one row a step.
  const float* xrow = xs + sb * T * I;
  const float* tsp = ts + sb * T;
  float* actp = acts + (sb * T) * U + s.u0 + ob;
  float* prep = pre + (sb * T) * d.NH + q * H + s.j0 + jj;
  float* hsp = hs + (sb * T) * H + s.j0 + jj;
  float xnext = tid < I ? xrow[tid] : 0.f;
  float tsnext = tsp[0];
  ClusterSync<C>();  // buffers zeroed, h0 staged, mbarriers initialised, every CTA running

  for (int t = 0; t < T; ++t) {
    const int par = t & 1;
    float* zt = z + par * d.zld;
    const int zn_off = lay.z + (par ^ 1) * d.zld;
    const float tst = tsnext;
    if (tid < I) zt[px] = xnext;
    for (int i = tid + kNT; i < I; i += kNT) zt[SplitPos(i, d.zkc, d.zs)] = xrow[t * I + i];  // past the first kNT
    if (t + 1 < T) {
      if (tid < I) xnext = xrow[(t + 1) * I + tid];
      tsnext = tsp[t + 1];
    }
    if (t > 0) wait(L, t - 1);  // h_{t-1}
    __syncthreads();            // and the x_t stores above (and, for C == 1, the h stores)
    const float* hin = zt;
    if (L > 0) {
      const float p = GroupSum(RegDot(zt + pb0, wb, KB ? KB : nb), Sb);
      if (has_b && spb == 0) {
        const float a = LecunTanh(p + bias_b);
        broadcast(lay.act + par * d.ald + pa, a, 0, t);
        *actp = a;
      }
      wait(0, t);
      if constexpr (C == 1) __syncthreads();
      hin = act + par * d.ald;
    }
    float hv;
    if (quad) {
      float a[4];
      QuadDot<QS, QS>(hin + ph0, wh, KH ? KH : nhk, a);
      hv = QuadSum(a, sph, Sh) + bias_h;
    } else {
      hv = GroupSum(RegDot(hin + ph0, wh, nhk), Sh) + bias_h;
    }
    if (has_h && (quad ? sph % hq == 0 : sph == 0)) *prep = hv;  // one lane a head
    float h;
    if (d.mode == kPure) {  // one head: this lane holds the unit's pre-activation
      h = -Ap * expf(-tst * (wtau + fabsf(hv))) * hv + Ap;
    } else {
      h = GatedState(hv, tst, q, hq, d.mode);
    }
    if (has_h && q == 0 && sph == 0) {
      *hsp = h;
      if (t + 1 < T) broadcast(zn_off + pz, h, L, t);
    }
    actp += U;
    prep += d.NH;
    hsp += H;
  }
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// ---------------------------------------------------------------------------------------------
// Register forward with ONE cluster exchange a step (the bench geometry: L = 1, four heads, U = kNT / 2 backbone
// units, this CTA's rows of z = [x_t, h_{t-1}] at most 2 kArRows, heads over KH x SH as cfc_fwd_reg_kernel<C, *, *,
// KH, SH>). cfc_fwd_reg_kernel all-gathers z, computes its slice of the backbone units, all-gathers them and computes
// its hidden units' heads: two exchanges a step. Here each CTA computes PARTIAL sums of ALL U backbone units from its
// OWN rows of z (its inputs x0 .. x0 + Ic and its hidden units j0 .. j0 + Hc, which it computed itself the step
// before), sends the partial vector to every rank (slot c of each rank's buffer), and every CTA adds the C partials in
// rank order, forms all U activations itself, and computes its hidden units' heads: one exchange a step, the same
// products. Thread (u, sp) = (tid / 2, tid % 2) holds W_1[row, u] for its split's kArRows rows. Buffers by step
// parity: a CTA sends step t + 1's partial only after the barrier that follows its reads of step t's, and no CTA can
// form step t + 2's partial before it has every CTA's step t + 1 partial, so two suffice.
constexpr int kArRows = 24;  // own rows a split (two splits: Ic + Hc <= 48)

struct ArLayout {
  int zo, zo_ld;     // own rows of z by step parity, two splits of kArRows at SplitStride(kArRows)
  int part;          // [2][C][U] partial vectors by step parity, slot = sender's rank
  int act, act_s, act_ld;  // all U activations by step parity, in the heads' split layout (KH, act_s = SplitStride(KH))
  int mbar;          // one mbarrier per step parity
  int total;
};

template <int C, int KH, int SH>
__global__ void __launch_bounds__(kNT, 1)
cfc_fwd_ar_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ ArLayout lay, const float* __restrict__ xs,
                  const float* __restrict__ ts, const float* __restrict__ h0, const float* __restrict__ wflat,
                  float* __restrict__ hs, float* __restrict__ acts, float* __restrict__ pre) {
  extern __shared__ __align__(16) float sm[];
  constexpr int kS = SplitStride(kArRows);  // the own-row splits' stride
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, NH = d.NH;
  for (int i = tid; i < lay.mbar; i += kNT) sm[i] = 0.f;  // padding rows and splits read as 0
  __syncthreads();
  // Own row r of z: r < Ic is input x0 + r, Ic <= r < Ic + Hc hidden unit j0 + r - Ic (rows past this CTA's share
  // stay 0 and have weight 0).
  auto row_pos = [&](int r) { return r + (r / kArRows) * (kS - kArRows); };
  auto z_row = [&](int r) { return r < d.Ic ? (r < s.Ice ? s.x0 + r : -1) : (r - d.Ic < s.Hce ? I + s.j0 + r - d.Ic : -1); };
  for (int j = tid; j < s.Hce; j += kNT) sm[lay.zo + row_pos(d.Ic + j)] = h0[sb * H + s.j0 + j];  // parity 0

  // Backbone item: unit u over the rows of split sp.
  const int u = tid >> 1, sp = tid & 1;
  float wb[kArRows];
#pragma unroll
  for (int k = 0; k < kArRows; ++k) {
    const int zr = z_row(sp * kArRows + k);
    wb[k] = zr >= 0 ? w[d.off_w[0] + int64_t(zr) * U + u] : 0.f;
  }
  const float bias_b = tid < U ? w[d.off_b[0] + tid] : 0.f;  // the act phase: thread u forms unit u
  // Heads item, as cfc_fwd_reg_kernel's fixed geometry: lane sph of unit jj, four heads over inputs kh0 .. kh0 + KH.
  const int jj = tid / SH, sph = tid - jj * SH, hq = SH >> 2, q = sph / hq;
  const bool has_h = jj < s.Hce;
  const int kh0 = sph * KH;
  float wh[4 * KH];
#pragma unroll
  for (int qq = 0; qq < 4; ++qq)
#pragma unroll
    for (int k = 0; k < KH; ++k)
      wh[qq * KH + k] = has_h && kh0 + k < U ? w[d.off_hw + int64_t(kh0 + k) * NH + qq * H + s.j0 + jj] : 0.f;
  const float bias_h = has_h ? w[d.off_hb + q * H + s.j0 + jj] : 0.f;
  const int pa = SplitPos(tid, KH, lay.act_s);  // where unit tid's activation lands (tid < U)
  const int ph0 = sph * lay.act_s;
  const int pz = row_pos(d.Ic + jj);                 // where this unit's h lands among the own rows

  const ClusterExchange<C> ex(sm, lay.mbar);  // one exchange a step: every rank's partials of all U units
  const uint32_t part_bytes = uint32_t(4 * C * U);
  ex.Init(1, [&](int) { return part_bytes; }, [&](int) { return T; });

  const float* xrow = xs + sb * T * I + s.x0;
  const float* tsp = ts + sb * T;
  float* actp = acts + (sb * T) * U + tid;
  float* prep = pre + (sb * T) * NH + q * H + s.j0 + jj;
  float* hsp = hs + (sb * T) * H + s.j0 + jj;
  float xnext = tid < s.Ice ? xrow[tid] : 0.f;
  float tsnext = tsp[0];
  const bool own_act = tid >= s.u0 && tid < s.u0 + s.Uce;  // the CTA that writes unit tid's activation
  ClusterSync<C>();  // buffers zeroed, h0 staged, mbarriers initialised, every CTA running

  // One step; parc is the step's parity as a compile-time constant (the loop below runs two steps a trip), so every
  // parity-dependent buffer offset folds: 2-3 % faster than a run-time parity (H100, this kernel and the backward).
  auto step = [&](const int t, auto parc) {
    const int par = int(parc);
    float* zo = sm + lay.zo + par * lay.zo_ld;
    const float tst = tsnext;
    if (tid < s.Ice) zo[row_pos(tid)] = xnext;
    if (t + 1 < T) {
      if (tid < s.Ice) xnext = xrow[(t + 1) * I + tid];
      tsnext = tsp[t + 1];
    }
    __syncthreads();  // own rows of z complete (x_t above, h_{t-1} at the end of the last step)
    // Partial sums of all U units over this CTA's rows; lane sp == 0 sends the unit's to every rank.
    float p = RegDot(zo + sp * kS, wb, kArRows);
    p += __shfl_xor_sync(0xffffffffu, p, 1);
    const int e = lay.part + (par * C + c) * U + u;
    if (sp == 0) ex.Send(sm, e, p, 0, par);
    ex.Wait(0, t, par, part_bytes, T);
    if constexpr (C == 1) __syncthreads();
    // Every unit's activation, the C partials added in rank order.
    if (tid < U) {
      const float* pp = sm + lay.part + par * C * U + tid;
      float acc = bias_b;
#pragma unroll
      for (int r = 0; r < C; ++r) acc += pp[r * U];
      const float a = LecunTanh(acc);
      sm[lay.act + par * lay.act_ld + pa] = a;
      if (own_act) *actp = a;
    }
    __syncthreads();  // all U activations in place
    float a4[4];
    QuadDot<KH, KH>(sm + lay.act + par * lay.act_ld + ph0, wh, KH, a4);
    const float hv = QuadSum(a4, sph, SH) + bias_h;
    if (has_h && sph % hq == 0) *prep = hv;  // one lane a head
    const float h = GatedState(hv, tst, q, hq, d.mode);
    if (has_h && q == 0 && sph == 0) {
      *hsp = h;
      if (t + 1 < T) sm[lay.zo + (par ^ 1) * lay.zo_ld + pz] = h;  // the next step's own row (read after its first barrier)
    }
    actp += U;
    prep += NH;
    hsp += H;
  };
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  int t = 0;
  for (; t + 1 < T; t += 2) {
    step(t, P0{});
    step(t + 1, P1{});
  }
  if (t < T) step(t, P0{});
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// End of a backward scan, for hidden unit j of sample sb: dh0, and in pure mode the partials of A and w_tau
// (the unit's sums over the steps).
__device__ __forceinline__ void StoreUnitResults(const CfcDims& d, int64_t sb, int j, float dh_carry, float gA, float gtau,
                                                 float* __restrict__ dh0, float* __restrict__ partials) {
  dh0[sb * d.H + j] = dh_carry;
  if (d.mode == kPure) {
    partials[sb * d.P + d.off_A + j] = gA;
    partials[sb * d.P + d.off_tau + j] = gtau;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward through time. Writes dxs, dts, dh0, the pre-activation gradients dpre_bb [S, T, L*U]
// and dpre_h [S, T, NH] (for the weight-gradient kernel), and in pure mode the w_tau / A entries
// of the per-sample partials. Exchange kinds, in step order: 0 = the heads' input gradient (plus
// each CTA's dts partial, sent to rank 0), 1 + i = backbone layer L - 1 - i's input gradient.
// Each CTA sends the partial sum over its own columns of every input gradient entry to the CTA
// that owns the entry, which adds the C partials in rank order.
template <int C, bool SmemW>
__global__ void __launch_bounds__(kNT, 1)
cfc_bwd_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ Layout lay, const float* __restrict__ xs, const float* __restrict__ ts,
               const float* __restrict__ wflat, const float* __restrict__ acts,
               const float* __restrict__ pre, const float* __restrict__ dhs, float* __restrict__ dxs,
               float* __restrict__ dts, float* __restrict__ dh0, float* __restrict__ dpre_bb,
               float* __restrict__ dpre_h, float* __restrict__ partials) {
  extern __shared__ __align__(16) float sm[];
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, L = d.L;
  const int Hce = s.Hce, slot = lay.recv_slot, nq = d.nh;
  float* dph = sm + lay.dph;
  float* dpb = sm + lay.dpb;
  float* red = sm + lay.red;
  int4* task = reinterpret_cast<int4*>(sm + lay.task);

  StageWeights<SmemW>(d, lay, s, sm, w);
  const Weights<SmemW> wh = HeadsW<SmemW>(d, lay, s, sm, w);
  BuildTransposedTable(task, d.Kh, nq, Hce, wh.ld, wh.qs);
  for (int i = 0; i < L; ++i) {
    const int l = L - 1 - i;
    const Weights<SmemW> wv = BackboneW<SmemW>(d, lay, s, sm, w, l);
    BuildTransposedTable(task + (1 + i) * lay.task_ld, d.Kl(l), 1, s.Uce, wv.ld, 0);
  }

  // Per-thread state of hidden unit j = j0 + tid (tid < Hce).
  const bool own_h = tid < Hce;
  const int j = s.j0 + tid;
  float dh_carry = 0.f, gA = 0.f, gtau = 0.f, Ap = 0.f, wt = 0.f;
  if (d.mode == kPure && own_h) {
    Ap = w[d.off_A + j];
    wt = w[d.off_tau + j];
  }

  // Exchange kind e lands in recv(e, par, src, idx) = sm[lay.recv + ((e * 2 + par) * C + src) * slot + idx].
  auto zspace = [&](int e) { return e == L; };  // the last exchange of a step is the input layer's
  // Bytes exchange e brings to this CTA: C partials of each entry it owns, the C dts partials at rank 0
  // (e = 0), and in the z-space exchange one token from every CTA. The tokens keep the cluster in
  // lockstep: a CTA that owns no entry at all (empty slices when C > H, U or I) would otherwise wait for
  // nothing, run steps ahead and overwrite receive buffers (and mbarrier phases) still in use elsewhere
  // (a hang, seen with C = 8, H = 33, U = 17, I = 7). Every other exchange is then behind a full exchange
  // of the previous step, so one that brings a CTA no bytes is skipped (a zero-byte phase would complete
  // at its own re-arm, two phases back to back, and a thread still polling the first parity would hang).
  auto kind_bytes = [&](int e) {
    const int owned = zspace(e) ? s.Ice + Hce : s.Uce;
    return uint32_t(4 * (C * owned + (e == 0 && c == 0 ? C : 0) + (zspace(e) ? C : 0)));
  };
  const ClusterExchange<C> ex(sm, lay.mbar);
  ex.Init(L + 1, kind_bytes, [&](int) { return T; });
  // The owner rank is known at run time only, so its addresses are mapped at each store (not ex.Put's table).
  auto put = [&](int rank, int e_off, float v, int e, int par) {  // e_off: float offset in sm
    if constexpr (C == 1) {
      sm[e_off] = v;
    } else {
      StAsync(MapRank(SmemAddr(sm + e_off), rank), v, MapRank(ex.Bar(e, par), rank));
    }
  };
  // Owner CTA and slot index (x = owner, y = idx) of entry k of the z vector (width K0) or of U.
  auto dest = [&](bool zs, int k) {
    int owner, idx;
    if (!zs) {
      owner = k / d.Uc; idx = k - owner * d.Uc;
    } else if (k < I) {
      owner = k / d.Ic; idx = k - owner * d.Ic;
    } else {
      const int jj = k - I;
      owner = jj / d.Hc; idx = d.Ic + jj - owner * d.Hc;
    }
    return make_int2(owner, idx);
  };
  // A thread sends entries k = tid, tid + kNT, ...; the first two destinations of each space are
  // computed once here (no integer division in the time loop for K <= 2 kNT).
  const int2 dst_u0 = L > 0 ? dest(false, tid) : make_int2(0, 0), dst_u1 = L > 0 ? dest(false, tid + kNT) : make_int2(0, 0);
  const int2 dst_z0 = dest(true, tid), dst_z1 = dest(true, tid + kNT);
  // Sends the partial out[k] of exchange e (k over the z vector of width K0, or over U) to its owner.
  auto send = [&](int k, float v, int e, int par) {
    const bool zs = zspace(e);
    const int2 od = k == tid ? (zs ? dst_z0 : dst_u0) : k == tid + kNT ? (zs ? dst_z1 : dst_u1) : dest(zs, k);
    put(od.x, lay.recv + ((e * 2 + par) * C + c) * slot + od.y, v, e, par);
  };
  auto send_tokens = [&](int par) {  // this CTA's token of the z-space exchange to every CTA (kind_bytes)
    if constexpr (C > 1) {
      if (tid < C) put(tid, lay.tok + par * C + c, 0.f, L, par);
    }
  };
  auto gather = [&](int e, int par, int idx) {  // fixed order over source CTAs
    const float* r = sm + lay.recv + (e * 2 + par) * C * slot + idx;
    float v = r[0];
#pragma unroll
    for (int src = 1; src < C; ++src) v += r[src * slot];
    return v;
  };
  // Waits for exchange e of step n (n counts steps from the end), re-arms its mbarrier for step
  // n + 2, and holds every thread until the whole CTA is past the exchange (so `red` and the
  // vectors the partials were computed from can be overwritten). See kind_bytes for the skip.
  auto receive = [&](int e, int n) {
    if (kind_bytes(e) > 0) ex.Wait(e, n, n & 1, kind_bytes(e), T);
    __syncthreads();
  };

  // Register prefetch of the next (earlier) step's per-thread inputs: the loads are issued one
  // step ahead, so their latency overlaps the current step's products and exchanges.
  float n_ts = 0.f, n_dh = 0.f, n_pre[4] = {0.f, 0.f, 0.f, 0.f}, n_act[kMaxLayers] = {0.f, 0.f, 0.f, 0.f};
  auto prefetch = [&](int tt) {
    if (tt < 0) return;
    const int64_t r = sb * T + tt;
    if (own_h) {
      n_ts = ts[r];
      n_dh = dhs[r * H + j];
#pragma unroll
      for (int q = 0; q < 4; ++q) if (q < nq) n_pre[q] = pre[r * d.NH + q * H + j];
    }
    if (tid < s.Uce) {
#pragma unroll
      for (int l = 0; l < kMaxLayers; ++l) if (l < L) n_act[l] = acts[r * L * U + l * U + s.u0 + tid];
    }
  };
  float* actb = sm + lay.actb;  // this step's activations of the owned backbone units, [L][Uc]
  prefetch(T - 1);
  ClusterSync<C>();  // weights and tables staged, mbarriers initialised, every CTA running

  for (int t = T - 1; t >= 0; --t) {
    const int n = T - 1 - t, par = n & 1;
    const int64_t row = sb * T + t;
    const float tst = n_ts, dhs_t = n_dh;
    const float p0 = n_pre[0], p1 = n_pre[1], p2 = n_pre[2], p3 = n_pre[3];
    if (tid < s.Uce) {
#pragma unroll
      for (int l = 0; l < kMaxLayers; ++l) if (l < L) actb[l * d.Uc + tid] = n_act[l];
    }
    prefetch(t - 1);
    // 1. Head nonlinearity, elementwise over own hidden units.
    float dts_part = 0.f;
    if (own_h) {
      const float dh = dhs_t + dh_carry;
      if (d.mode == kPure) {
        const float f = p0;
        const float awt = fabsf(wt);
        const float e = expf(-tst * (awt + fabsf(f)));
        // e (1 - ts |f|) as e - (e ts) |f|: for a huge finite ts, ts |f| overflows to inf while e underflows to 0,
        // and 0 * inf was NaN (the reference's autodiff gives 0 there)
        const float df = dh * (-Ap * (e - (e * tst) * fabsf(f)));
        gA += dh * (1.f - e * f);
        gtau += dh * (Ap * f * e * tst * Sign(wt));
        dts_part = dh * Ap * f * e * (awt + fabsf(f));
        dph[tid] = df;
      } else {
        const float f1 = tanhf(p0), f2 = tanhf(p1);
        const float ta = p2, tb = p3;
        const float g = Sigmoid(ta * tst + tb);
        float df1, df2, dg;
        if (d.mode == kNoGate) {
          df1 = dh;
          df2 = dh * g;
          dg = dh * f2;
        } else {
          df1 = dh * (1.f - g);
          df2 = dh * g;
          dg = dh * (f2 - f1);
        }
        const float dgp = dg * g * (1.f - g);
        const float d1 = df1 * (1.f - f1 * f1), d2 = df2 * (1.f - f2 * f2);
        dph[tid] = d1;
        dph[Hce + tid] = d2;
        dph[2 * Hce + tid] = dgp * tst;
        dph[3 * Hce + tid] = dgp;
        dts_part = dgp * ta;
      }
    }
    // dts partial of this CTA: warp 0 sums the Hce unit terms in a fixed shuffle order and sends it
    // to rank 0. With Hce <= 32 the terms are already in warp 0's registers (no block barrier);
    // otherwise they go through red (red[i] summed over i = lane mod 32 first; the same order).
    if (Hce <= 32) {
      if (tid < 32) {
        float v = dts_part;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (tid == 0) put(0, lay.dts + par * C + c, v, 0, par);
      }
    } else {
      red[tid] = dts_part;  // red is free: every thread passed the last exchange's barrier
      __syncthreads();
      if (tid < 32) {
        float v = 0.f;
        for (int i = tid; i < Hce; i += 32) v += red[i];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (tid == 0) put(0, lay.dts + par * C + c, v, 0, par);
      }
    }
    __syncthreads();  // dph complete
    // 2. Heads transposed: partial dIn[k] = sum_{own cols} Wh[k, col] * dph[col], one column
    //    group per head.
    {
      const int4* tab = task;
      TransposedPartials(tab, dph, wh.base, red);
      __syncthreads();
      const int K = d.Kh, nsplit = tab[0].z;
      for (int k = tid; k < K; k += kNT) send(k, SumSplits(red, K, nsplit, k), 0, par);
      if (L == 0) send_tokens(par);
      if (own_h) {
#pragma unroll
        for (int q = 0; q < 4; ++q) if (q < nq) dpre_h[row * d.NH + q * H + j] = dph[q * Hce + tid];
      }
      receive(0, n);
      if (c == 0 && tid == 0) {
        const float* r = sm + lay.dts + par * C;
        float v = r[0];
#pragma unroll
        for (int src = 1; src < C; ++src) v += r[src];
        dts[row] = v;
      }
    }
    // 3. Backbone layers, last to first.
    for (int i = 0; i < L; ++i) {
      const int l = L - 1 - i;
      for (int o = tid; o < s.Uce; o += kNT) {
        const float a = o < kNT ? actb[l * d.Uc + o] : acts[row * L * U + l * U + s.u0 + o];
        dpb[o] = gather(i, par, o) * LecunTanhGradFromOut(a);
      }
      __syncthreads();
      const int4* tab = task + (1 + i) * lay.task_ld;
      const Weights<SmemW> wv = BackboneW<SmemW>(d, lay, s, sm, w, l);
      TransposedPartials(tab, dpb, wv.base, red);
      __syncthreads();
      const int K = d.Kl(l), nsplit = tab[0].z;
      for (int k = tid; k < K; k += kNT) send(k, SumSplits(red, K, nsplit, k), 1 + i, par);
      if (1 + i == L) send_tokens(par);
      for (int o = tid; o < s.Uce; o += kNT) dpre_bb[row * L * U + l * U + s.u0 + o] = dpb[o];
      receive(1 + i, n);
    }
    // 4. z-space gradients: dx_t for own inputs, dh_{t-1} for own hidden units.
    for (int i = tid; i < s.Ice; i += kNT) dxs[row * I + s.x0 + i] = gather(L, par, i);
    if (own_h) dh_carry = gather(L, par, d.Ic + tid);
  }
  if (own_h) StoreUnitResults(d, sb, j, dh_carry, gA, gtau, dh0, partials);
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// ---------------------------------------------------------------------------------------------
// Register backward (one backbone layer, used when RegBackwardPlan fits and every CTA of the cluster owns
// hidden and backbone units): the same outputs as cfc_bwd_kernel, computed as the register forward computes
// the forward. Each CTA produces whole outputs of its own slices, so its products need the whole input
// vectors, which the CTAs all-gather (every CTA sends its slice to every CTA, itself included) instead of
// reduce-scattering partial sums; the weights of both transposed products stay in registers for the scan:
//   (a) hidden unit j (thread (Ic + jj) * S2 of its owner): dh = dhs_t + dh_carry and the heads' nh
//       pre-activation gradients, all-gathered (exchange kind 0) unit-major (entry j nh + q, so a unit's
//       four values travel as one 16-byte store), and its dts term, sent to rank 0 alone. The unit's
//       nonlinearities do not depend on dh: they are computed a step ahead (UnitCoef), off the chain;
//   (b) backbone unit u (lanes u * S1 ..): dpb[u] = lecun'(act) * sum_n W_heads[u, col(n)] dph[n] over all
//       NH entries, all-gathered (exchange kind 1);
//   (c) input row k of the CTA's inputs and hidden units: sum_u W_1[k, u] dpb[u], which is dx_t or the
//       next (earlier) step's dh_carry, landing in the lane that owns the unit in (a).
// dts_t = sum_j of the units' dts terms, summed by one warp of rank 0 in a fixed order. The k-splits of an
// output sit in adjacent lanes and are summed with xor shuffles (a fixed tree), so every sum has a fixed
// order and a sample's results do not depend on the batch. One block barrier a step bounds how far the
// warps of a CTA drift apart, so no buffer of step n is overwritten (at step n + 2) while still read.
constexpr int kRegB1 = 64, kRegB2 = 32;

bool RegBackwardPlan(CfcDims* d) {
  if (d->L != 1) return false;
  // Every CTA must send in both exchanges of every step (that keeps the cluster in lockstep).
  if ((d->C - 1) * d->Hc >= d->H || (d->C - 1) * d->Uc >= d->U) return false;
  d->S1 = RegSplits(d->Uc, d->NH, 32);
  d->k1 = Align4(int(CeilDiv(d->NH, d->S1)));
  if (d->k1 > kRegB1 || d->Uc * d->S1 > kNT) return false;
  const int n2 = d->Ic + d->Hc;
  d->S2 = RegSplits(n2, d->U, 32);
  d->k2 = Align4(int(CeilDiv(d->U, d->S2)));
  if (d->k2 > kRegB2 || n2 * d->S2 > kNT) return false;
  d->s1 = SplitStride(d->k1);
  d->s2 = SplitStride(d->k2);
  // Whole zero-padded splits for every lane (S1, S2 of them), as in RegForwardPlan.
  d->ph_ld = std::max(int(CeilDiv(d->NH, d->k1)), d->S1) * d->s1;
  d->pb_ld = std::max(int(CeilDiv(d->U, d->k2)), d->S2) * d->s2;
  d->ts_ld = Align4(d->H);
  return true;
}

inline Layout MakeRegBackwardLayout(const CfcDims& d) {
  Layout s{};
  int o = 0;
  s.dph = o; o += 2 * d.ph_ld;  // dph by step parity, unit-major, split layout (k1, s1)
  s.dpb = o; o += 2 * d.pb_ld;  // dpb by step parity, split layout (k2, s2)
  s.dts = o; o += 2 * d.ts_ld;  // the units' dts terms by step parity (used at rank 0)
  s.mbar = o; o += Align4(2 * 2 * 2);
  s.total = o;
  return s;
}

// A hidden unit's step coefficients (its pre-activations' nonlinearities), so that its gradients are a few
// products with dh. Modes default / no_gate: a1 = 1 - f1^2, a2 = 1 - f2^2, m1 (1 - g, or 1), g, dd (f2 - f1, or
// f2), om = 1 - g, ts, ta. Mode pure: a1 = d h / d ff1 over dh, a2 = d A, m1 = d w_tau, dd = the dts term
// (each over dh). The products are formed in the same order as in cfc_bwd_kernel, but for pure mode's dts
// term (dh times its coefficient here, ((dh Ap) f) e (...) there) and dts_t's sum over units (one lane-strided
// sum over H here, per-CTA sums added in rank order there): the two kernels' dts and the gradients that
// depend on it differ in the last bits.
struct UnitCoef {
  float a1, a2, m1, g, dd, om, ts, ta;
};

__device__ __forceinline__ UnitCoef MakeUnitCoef(int mode, float tst, float p0, float p1, float p2, float p3, float Ap,
                                                 float wt) {
  UnitCoef c;
  if (mode == kPure) {
    const float f = p0, awt = fabsf(wt);
    const float e = expf(-tst * (awt + fabsf(f)));
    c.a1 = -Ap * (e - (e * tst) * fabsf(f));  // not e (1 - ts |f|): 0 * inf for a huge finite ts (see cfc_bwd_kernel)
    c.a2 = 1.f - e * f;
    c.m1 = Ap * f * e * tst * Sign(wt);
    c.dd = Ap * f * e * (awt + fabsf(f));
    c.g = c.om = c.ts = c.ta = 0.f;
  } else {
    const float f1 = tanhf(p0), f2 = tanhf(p1);
    const float g = Sigmoid(p2 * tst + p3);
    c.a1 = 1.f - f1 * f1;
    c.a2 = 1.f - f2 * f2;
    c.m1 = mode == kNoGate ? 1.f : 1.f - g;
    c.g = g;
    c.dd = mode == kNoGate ? f2 : f2 - f1;
    c.om = 1.f - g;
    c.ts = tst;
    c.ta = p2;
  }
  return c;
}

// A unit's four head gradients (ff1, ff2, time_a, time_b) in modes default / no_gate from d h and its step
// coefficients; *dts_term gets its term of d ts.
__device__ __forceinline__ float4 HeadGrads(float dh, const UnitCoef& uc, float* dts_term) {
  const float df1 = dh * uc.m1, df2 = dh * uc.g, dg = dh * uc.dd;
  const float dgp = dg * uc.g * uc.om;
  *dts_term = dgp * uc.ta;
  return make_float4(df1 * uc.a1, df2 * uc.a2, dgp * uc.ts, dgp);
}

// K1 .. S2: the geometry fixed at compile time, as cfc_fwd_reg_kernel's (0: read from CfcDims at run time).
template <int C, int K1 = 0, int S1 = 0, int K2 = 0, int S2 = 0>
__global__ void __launch_bounds__(kNT, 1)
cfc_bwd_reg_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ Layout lay, const float* __restrict__ ts,
                   const float* __restrict__ wflat, const float* __restrict__ acts, const float* __restrict__ pre,
                   const float* __restrict__ dhs, float* __restrict__ dxs, float* __restrict__ dts,
                   float* __restrict__ dh0, float* __restrict__ dpre_bb, float* __restrict__ dpre_h,
                   float* __restrict__ partials) {
  extern __shared__ __align__(16) float sm[];
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  static_assert((K1 > 0) == (K2 > 0) && (S1 > 0) == (K1 > 0) && (S2 > 0) == (K1 > 0), "all fixed or none");
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, NH = d.NH, nh = d.nh;
  const int s1n = S1 ? S1 : d.S1, k1 = K1 ? K1 : d.k1, s2n = S2 ? S2 : d.S2, k2 = K2 ? K2 : d.k2;
  for (int i = tid; i < lay.mbar; i += kNT) sm[i] = 0.f;  // the padding of the split layouts reads as 0

  // (b) item: backbone unit u0 + o1, entries n1 .. n1 + m1 of dph (split sp1); entry n is head n % nh of
  // unit n / nh, column (n % nh) H + n / nh of W_heads.
  const int o1 = tid / s1n, sp1 = tid - o1 * s1n;
  const bool has1 = o1 < s.Uce;
  const int n1 = sp1 * k1, m1 = has1 ? max(0, min(k1, NH - n1)) : 0;
  float w1[K1 ? K1 : kRegB1];
#pragma unroll
  for (int k = 0; k < (K1 ? K1 : kRegB1); ++k) {
    const int n = n1 + k, col = (n % nh) * H + n / nh;
    w1[k] = k < m1 ? w[d.off_hw + int64_t(s.u0 + o1) * NH + col] : 0.f;
  }
  // (c) item: row r2 of this CTA's rows (r2 < Ic: input x0 + r2; else hidden unit r2 - Ic), inputs
  // n2 .. n2 + m2 of dpb (split sp2).
  const int r2 = tid / s2n, sp2 = tid - r2 * s2n;
  const bool row_x = r2 < d.Ic && r2 < s.Ice, row_h = r2 >= d.Ic && r2 - d.Ic < s.Hce;
  const int zrow = r2 < d.Ic ? s.x0 + r2 : I + s.j0 + (r2 - d.Ic);
  const int n2 = sp2 * k2, m2 = (row_x || row_h) ? max(0, min(k2, U - n2)) : 0;
  float w2[K2 ? K2 : kRegB2];
#pragma unroll
  for (int k = 0; k < (K2 ? K2 : kRegB2); ++k) w2[k] = k < m2 ? w[d.off_w[0] + int64_t(zrow) * U + n2 + k] : 0.f;

  // (a) hidden unit jj = r2 - Ic, handled by the lane that receives its dh_carry in (c).
  const bool own_unit = row_h && sp2 == 0;
  const int jj = r2 - d.Ic, j = s.j0 + jj;
  float dh_carry = 0.f, gA = 0.f, gtau = 0.f, Ap = 0.f, wt = 0.f;
  if (d.mode == kPure && own_unit) {
    Ap = w[d.off_A + j];
    wt = w[d.off_tau + j];
  }
  const int pj = SplitPos(j * nh, d.k1, d.s1);      // the unit's nh entries of dph (16-byte aligned when nh = 4)
  const int pu = SplitPos(s.u0 + o1, d.k2, d.s2);  // where this lane's dpb lands (lane sp1 == 0)

  // Exchange 0: the heads' gradients (NH floats, and rank 0 the H dts terms); 1: the backbone gradients (U floats).
  const ClusterExchange<C> ex(sm, lay.mbar);
  auto kind_bytes = [&](int kind) { return uint32_t(4 * (kind == 0 ? NH + (c == 0 ? H : 0) : U)); };
  ex.Init(2, kind_bytes, [&](int) { return T; });
  auto put = [&](int r, int e, float v, int kind, int n) { ex.Put(sm, r, e, v, kind, n & 1); };  // element e of rank r
  auto wait = [&](int kind, int n) {
    ex.Wait(kind, n, n & 1, kind_bytes(kind), T);
    if constexpr (C == 1) __syncthreads();
  };

  // One step ahead in registers: the unit's inputs (ts, dhs, pre) and the backbone unit's activation.
  float n_ts = 0.f, n_dh = 0.f, n_pre[4] = {0.f, 0.f, 0.f, 0.f}, n_act = 0.f;
  // Global addresses of row sb T + t, stepped back one row a step (in_r: the prefetched row's).
  const int64_t last = sb * T + T - 1;
  const float *ts_r = ts + last, *dhs_r = dhs + last * H + j, *pre_r = pre + last * NH + j;
  const float* act_r = acts + last * U + s.u0 + o1;
  float *dph_r = dpre_h + last * NH + j, *dpb_r = dpre_bb + last * U + s.u0 + o1, *dx_r = dxs + last * I + s.x0 + r2;
  float* dts_r = dts + last;
  auto prefetch = [&]() {
    if (own_unit) {
      n_ts = *ts_r;
      n_dh = *dhs_r;
#pragma unroll
      for (int q = 0; q < 4; ++q) if (q < nh) n_pre[q] = pre_r[q * H];
    }
    if (has1 && sp1 == 0) n_act = *act_r;
    ts_r -= 1;
    dhs_r -= H;
    pre_r -= NH;
    act_r -= U;
  };
  prefetch();
  UnitCoef uc = MakeUnitCoef(d.mode, n_ts, n_pre[0], n_pre[1], n_pre[2], n_pre[3], Ap, wt);
  float dhs_t = n_dh, act_t = n_act;
  ClusterSync<C>();  // buffers zeroed, mbarriers initialised, every CTA running

  const int lane = tid & 31, warp = tid >> 5;
  for (int t = T - 1; t >= 0; --t) {
    const int n = T - 1 - t, par = n & 1;
    if (t > 0) prefetch();
    const float* ph = sm + lay.dph + par * d.ph_ld;
    const float* pb = sm + lay.dpb + par * d.pb_ld;
    // (a) the unit's head gradients and dts term.
    if (own_unit) {
      const float dh = dhs_t + dh_carry;
      const int e = lay.dph + par * d.ph_ld + pj;
      float dts_term;
      if (d.mode == kPure) {
        const float g0 = dh * uc.a1;
        gA += dh * uc.a2;
        gtau += dh * uc.m1;
        dts_term = dh * uc.dd;
#pragma unroll
        for (int r = 0; r < C; ++r) put(r, e, g0, 0, n);
        *dph_r = g0;
      } else {
        const float4 g = HeadGrads(dh, uc, &dts_term);
        ex.Send4(sm, e, g, 0, n & 1);
        dph_r[0] = g.x;
        dph_r[H] = g.y;
        dph_r[2 * H] = g.z;
        dph_r[3 * H] = g.w;
      }
      put(0, lay.dts + par * d.ts_ld + j, dts_term, 0, n);
    }
    wait(0, n);
    if constexpr (C > 1) __syncthreads();  // bounds the drift between warps (see the header)
    // (b) backbone unit gradients.
    {
      const float v = GroupSum(RegDot(ph + sp1 * d.s1, w1, K1 ? K1 : m1), s1n);
      if (has1 && sp1 == 0) {
        const float g = v * LecunTanhGradFromOut(act_t);
#pragma unroll
        for (int r = 0; r < C; ++r) put(r, lay.dpb + par * d.pb_ld + pu, g, 1, n);
        *dpb_r = g;
      }
    }
    // dts_t: the last warp of rank 0 sums the H unit terms (lane-strided, then an xor tree).
    if (c == 0 && warp == kNT / 32 - 1) {
      const float* tv = sm + lay.dts + par * d.ts_ld;
      float v = 0.f;
      for (int i = lane; i < H; i += 32) v += tv[i];
      v = WarpSum(v);
      if (lane == 0) *dts_r = v;
    }
    // The next (earlier) step's coefficients, off the chain while exchange 1 is in flight.
    if (t > 0) {
      if (own_unit) uc = MakeUnitCoef(d.mode, n_ts, n_pre[0], n_pre[1], n_pre[2], n_pre[3], Ap, wt);
      dhs_t = n_dh;
      act_t = n_act;
    }
    wait(1, n);
    // (c) input gradients: dx_t, and dh_carry for step t - 1.
    {
      const float v = GroupSum(RegDot(pb + sp2 * d.s2, w2, K2 ? K2 : m2), s2n);
      if (sp2 == 0) {
        if (row_x) *dx_r = v;
        if (row_h) dh_carry = v;
      }
    }
    dph_r -= NH;
    dpb_r -= U;
    dx_r -= I;
    dts_r -= 1;
  }
  if (own_unit) StoreUnitResults(d, sb, j, dh_carry, gA, gtau, dh0, partials);
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// ---------------------------------------------------------------------------------------------
// Register backward with ONE cluster exchange a step (the bench geometry of cfc_bwd_reg_kernel<C, *, *, K2, S2>:
// L = 1, four heads, U = kNT / 2, modes default / no_gate). cfc_bwd_reg_kernel all-gathers the heads' gradients dph
// (all NH entries) before its product (b) and the backbone gradients dpb before (c). Here each CTA forms PARTIAL sums
// of (b) for ALL U backbone units from its OWN 4 Hc entries of dph (its hidden units' four heads, which it computed
// itself), sends the partial vector (U floats, then its units' dts terms summed in unit order) to every rank, and every
// CTA adds the C partials in rank order and forms dpb for all U units itself, so (c) reads a local dpb: one exchange
// a step. Thread (u, sp) = (tid / 2, tid % 2) holds W_heads[u, col(n)] for its split's kArEnt own entries
// (entry n = 4 jj + q: head q of unit j0 + jj). Buffers by step parity, as cfc_fwd_ar_kernel (the same argument).
constexpr int kArEnt = 64;  // own dph entries a split (two splits: 4 Hc <= 128)

struct ArBwdLayout {
  int dph;           // [2][2 splits at SplitStride(kArEnt)] own heads' gradients, entry 4 jj + q
  int dts;           // [2][32] this CTA's units' dts terms
  int part, part_ld; // [2][C][part_ld] partial vectors (U floats, then the dts partial), slot = sender's rank
  int dpb;           // [2][pb_ld] all U backbone gradients, split layout (k2, s2) of product (c)
  int mbar;
  int total;
};

template <int C, int K2, int S2>
__global__ void __launch_bounds__(kNT, 1)
cfc_bwd_ar_kernel(const __grid_constant__ CfcDims d, const __grid_constant__ ArBwdLayout lay,
                  const float* __restrict__ ts, const float* __restrict__ wflat, const float* __restrict__ acts,
                  const float* __restrict__ pre, const float* __restrict__ dhs, float* __restrict__ dxs,
                  float* __restrict__ dts, float* __restrict__ dh0, float* __restrict__ dpre_bb,
                  float* __restrict__ dpre_h, float* __restrict__ partials) {
  extern __shared__ __align__(16) float sm[];
  constexpr int kS = SplitStride(kArEnt);
  const int c = C == 1 ? 0 : int(blockIdx.x % C);
  const int64_t sb = blockIdx.x / C;
  const float* w = wflat + (sb / d.B) * d.P;
  const Slice s = MakeSlice(d, c);
  const int tid = threadIdx.x, T = int(d.T), I = d.I, H = d.H, U = d.U, NH = d.NH;
  for (int i = tid; i < lay.mbar; i += kNT) sm[i] = 0.f;  // padding entries and splits read as 0
  auto ent_pos = [&](int n) { return n + (n / kArEnt) * (kS - kArEnt); };

  // (b') item: backbone unit u over own entries sp kArEnt .. + kArEnt (entry n: head n % 4 of unit j0 + n / 4).
  const int u = tid >> 1, sp = tid & 1;
  float w1[kArEnt];
#pragma unroll
  for (int k = 0; k < kArEnt; ++k) {
    const int n = sp * kArEnt + k, jn = n >> 2, qn = n & 3;
    w1[k] = jn < s.Hce ? w[d.off_hw + int64_t(u) * NH + qn * H + s.j0 + jn] : 0.f;
  }
  // (c) item, as cfc_bwd_reg_kernel: row r2 of this CTA's rows (r2 < Ic: input x0 + r2; else hidden unit r2 - Ic),
  // inputs n2 .. n2 + K2 of dpb (split sp2).
  const int r2 = tid / S2, sp2 = tid - r2 * S2;
  const bool row_x = r2 < d.Ic && r2 < s.Ice, row_h = r2 >= d.Ic && r2 - d.Ic < s.Hce;
  const int zrow = r2 < d.Ic ? s.x0 + r2 : I + s.j0 + (r2 - d.Ic);
  const int n2 = sp2 * K2, m2 = (row_x || row_h) ? max(0, min(K2, U - n2)) : 0;
  float w2[K2];
#pragma unroll
  for (int k = 0; k < K2; ++k) w2[k] = k < m2 ? w[d.off_w[0] + int64_t(zrow) * U + n2 + k] : 0.f;
  // (a) hidden unit jj = r2 - Ic, handled by the lane that receives its dh_carry in (c).
  const bool own_unit = row_h && sp2 == 0;
  const int jj = r2 - d.Ic, j = s.j0 + jj;
  float dh_carry = 0.f;
  const int pdb = SplitPos(tid, d.k2, d.s2);  // where unit tid's dpb lands (tid < U)
  constexpr int kS2 = SplitStride(K2);        // = d.s2 (UseArBackward: d.k2 == K2), folded into (c)'s split offset

  const ClusterExchange<C> ex(sm, lay.mbar);  // one exchange a step: every rank's partials of all U units and dts
  const uint32_t part_bytes = uint32_t(4 * C * (U + 1));
  ex.Init(1, [&](int) { return part_bytes; }, [&](int) { return T; });

  // One step ahead in registers: the unit's inputs (ts, dhs, pre) and unit tid's backbone activation.
  float n_ts = 0.f, n_dh = 0.f, n_pre[4] = {0.f, 0.f, 0.f, 0.f}, n_act = 0.f;
  const int64_t last = sb * T + T - 1;
  const float *ts_r = ts + last, *dhs_r = dhs + last * H + j, *pre_r = pre + last * NH + j;
  const float* act_r = acts + last * U + tid;
  float *dph_r = dpre_h + last * NH + j, *dpb_r = dpre_bb + last * U + tid, *dx_r = dxs + last * I + s.x0 + r2;
  float* dts_r = dts + last;
  const bool own_u = tid >= s.u0 && tid < s.u0 + s.Uce;  // the CTA that writes unit tid's dpre_bb
  auto prefetch = [&]() {
    if (own_unit) {
      n_ts = *ts_r;
      n_dh = *dhs_r;
#pragma unroll
      for (int q = 0; q < 4; ++q) n_pre[q] = pre_r[q * H];
    }
    if (tid < U) n_act = *act_r;
    ts_r -= 1;
    dhs_r -= H;
    pre_r -= NH;
    act_r -= U;
  };
  prefetch();
  UnitCoef uc = MakeUnitCoef(d.mode, n_ts, n_pre[0], n_pre[1], n_pre[2], n_pre[3], 0.f, 0.f);
  float dhs_t = n_dh, act_t = n_act;
  ClusterSync<C>();  // buffers zeroed, mbarriers initialised, every CTA running

  const int lane = tid & 31, warp = tid >> 5;
  // One step (t = T - 1 - n); parc is n's parity as a compile-time constant, as in cfc_fwd_ar_kernel.
  auto step = [&](const int t, auto parc) {
    const int n = T - 1 - t, par = int(parc);
    if (t > 0) prefetch();
    // (a) the unit's head gradients (local) and dts term.
    if (own_unit) {
      const float dh = dhs_t + dh_carry;
      float dts_term;
      const float4 g = HeadGrads(dh, uc, &dts_term);
      *reinterpret_cast<float4*>(sm + lay.dph + par * 2 * kS + ent_pos(4 * jj)) = g;
      sm[lay.dts + par * 32 + jj] = dts_term;
      dph_r[0] = g.x;
      dph_r[H] = g.y;
      dph_r[2 * H] = g.z;
      dph_r[3 * H] = g.w;
    }
    __syncthreads();  // the CTA's own entries of dph in place
    // (b') partial sums of every backbone unit's gradient over the own entries; warp 0 also sums the dts terms.
    {
      float p = RegDot(sm + lay.dph + par * 2 * kS + sp * kS, w1, kArEnt);
      p += __shfl_xor_sync(0xffffffffu, p, 1);
      if (sp == 0) ex.Send(sm, lay.part + (par * C + c) * lay.part_ld + u, p, 0, par);
      if (warp == 0) {
        float v = lane < s.Hce ? sm[lay.dts + par * 32 + lane] : 0.f;
        v = WarpSum(v);
        if (lane == 0) ex.Send(sm, lay.part + (par * C + c) * lay.part_ld + U, v, 0, par);
      }
    }
    // The next (earlier) step's coefficients, off the chain while the exchange is in flight.
    if (t > 0) {
      if (own_unit) uc = MakeUnitCoef(d.mode, n_ts, n_pre[0], n_pre[1], n_pre[2], n_pre[3], 0.f, 0.f);
    }
    ex.Wait(0, n, par, part_bytes, T);
    if constexpr (C == 1) __syncthreads();
    // Every backbone unit's gradient, the C partials added in rank order; rank 0's last warp forms dts_t.
    const float* pp = sm + lay.part + par * C * lay.part_ld;
    if (tid < U) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < C; ++r) acc += pp[r * lay.part_ld + tid];
      const float g = acc * LecunTanhGradFromOut(act_t);
      sm[lay.dpb + par * d.pb_ld + pdb] = g;
      if (own_u) *dpb_r = g;
    }
    if (c == 0 && tid == kNT - 1) {
      float v = 0.f;
#pragma unroll
      for (int r = 0; r < C; ++r) v += pp[r * lay.part_ld + U];
      *dts_r = v;
    }
    if (t > 0) {
      dhs_t = n_dh;
      act_t = n_act;
    }
    __syncthreads();  // all U backbone gradients in place
    // (c) input gradients: dx_t, and dh_carry for step t - 1.
    {
      const float v = GroupSum(RegDot(sm + lay.dpb + par * d.pb_ld + sp2 * kS2, w2, K2), S2);
      if (sp2 == 0) {
        if (row_x) *dx_r = v;
        if (row_h) dh_carry = v;
      }
    }
    dph_r -= NH;
    dpb_r -= U;
    dx_r -= I;
    dts_r -= 1;
  };
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  int n = 0;
  for (; n + 1 < T; n += 2) {
    step(T - 1 - n, P0{});
    step(T - 2 - n, P1{});
  }
  if (n < T) step(T - 1 - n, P0{});
  if (own_unit) StoreUnitResults(d, sb, j, dh_carry, 0.f, 0.f, dh0, partials);
  ClusterSync<C>();  // no CTA leaves while others may still write into its shared memory
}

// ---------------------------------------------------------------------------------------------
// Per-sample weight gradient: partials[sb, out_off + k * N + n] = sum_t A(t, k) D(t, n) for k in [0, K), and
// row K the bias gradient sum_t D(t, n) (plain float32 adds, t in increasing order).
struct GradGemm {
  int K, N;
  int a_layer;      // -1: A = z_t = [x_t, h_{t-1}]; else acts of that layer
  int d_ld, d_off;  // D(t, n) = dsrc[row * d_ld + d_off + n]
  int64_t out_off;
  int vec;          // 1: every row offset and width is a multiple of 4 (16-byte copies)
};

// The products run on the tensor cores in 3xTF32 (each operand split into a TF32 high part and a TF32 low
// part, acc += a_lo b_hi + a_hi b_lo + a_hi b_hi, float32 accumulate; the dropped a_lo b_lo term is ~2^-22 of
// a product: float32-class accuracy, as CUTLASS's 3xTF32 GEMMs), one CTA a sample and a kWgK x TN output tile;
// 8 warps as 2 x 4, a warp 32 rows (k) x TN / 4 columns (n). Time steps are staged kWgTT at a time by cp.async
// into a ring of kWgStages buffers (two chunks' copies in flight while one is multiplied, one barrier a chunk);
// the row strides kWgK + 8 and TN + 8 = 8 (mod 32) make the fragment reads (A column-major, B row-major)
// conflict-free.
constexpr int kWgK = 64, kWgTT = 32, kWgStages = 3;

template <int TN>
struct WgradSmem {
  static constexpr int kLdA = kWgK + 8, kLdD = TN + 8;
  static constexpr int kA = kWgTT * kLdA, kD = kWgTT * kLdD;  // floats of one buffer
  static constexpr int kBytes = kWgStages * (kA + kD) * int(sizeof(float));
};

template <int TN>
__global__ void __launch_bounds__(256)
cfc_wgrad_kernel(CfcDims d, GradGemm g, const float* __restrict__ xs, const float* __restrict__ h0,
                 const float* __restrict__ hs, const float* __restrict__ acts, const float* __restrict__ dsrc,
                 float* __restrict__ partials) {
  using L = WgradSmem<TN>;
  extern __shared__ __align__(16) float wsm[];  // [kWgStages][kA] then [kWgStages][kD]
  constexpr int kWN = TN / 4, kFN = kWN / 8;     // a warp's columns and n8 fragments
  constexpr int kQa = kWgK / 4, kQd = TN / 4;    // column quads of a staged row
  constexpr int kRa = kWgTT * kQa / 256, kRd = kWgTT * kQd / 256;  // quads a thread stages a chunk
  static_assert(kRa * 256 == kWgTT * kQa && kRd * 256 == kWgTT * kQd, "staging does not tile over 256 threads");
  const int64_t sb = blockIdx.x;  // samples on x (up to 2^31 - 1), output tiles on y
  const int ntn = (g.N + TN - 1) / TN;
  const int k_base = (blockIdx.y / ntn) * kWgK, n_base = (blockIdx.y % ntn) * TN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp >> 2, wc = warp & 3, gq = lane >> 2, t4 = lane & 3;
  const int T = int(d.T), I = d.I, H = d.H;
  // A(t, k) for k < K: the source address (valid t and k only).
  auto a_src = [&](int64_t row, int t, int k) -> const float* {
    if (g.a_layer < 0) return k < I ? xs + row * I + k : (t > 0 ? hs + (row - 1) * H + (k - I) : h0 + sb * H + (k - I));
    return acts + row * d.L * d.U + g.a_layer * d.U + k;
  };
  auto d_src = [&](int64_t row, int n) { return dsrc + row * g.d_ld + g.d_off + n; };
  // One staged quad: 4 columns from col of row t (zeros outside the matrix).
  auto copy_quad = [&](float* dst, int t, int col, int lim, bool is_a) {
    const int64_t row = sb * T + t;
    if (g.vec) {
      const bool ok = t < T && col < lim;
      CpAsync16(dst, !ok ? dsrc : is_a ? a_src(row, t, col) : d_src(row, col), ok);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool ok = t < T && col + i < lim;
        CpAsync4(dst + i, !ok ? dsrc : is_a ? a_src(row, t, col + i) : d_src(row, col + i), ok);
      }
    }
  };
  auto stage = [&](int chunk) {
    const int buf = chunk % kWgStages, t0 = chunk * kWgTT;
    float* As = wsm + buf * L::kA;
    float* Ds = wsm + kWgStages * L::kA + buf * L::kD;
#pragma unroll
    for (int r = 0; r < kRa; ++r) {
      const int e = tid + r * 256, tt = e / kQa, c = 4 * (e % kQa);
      copy_quad(As + tt * L::kLdA + c, t0 + tt, k_base + c, g.K, true);
    }
#pragma unroll
    for (int r = 0; r < kRd; ++r) {
      const int e = tid + r * 256, tt = e / kQd, c = 4 * (e % kQd);
      copy_quad(Ds + tt * L::kLdD + c, t0 + tt, n_base + c, g.N, false);
    }
  };
  float acc[2][kFN][4] = {};
  float bacc = 0.f;
  const bool bias = k_base == 0 && tid < TN;  // the bias row: thread n of the first k-tile sums column n
  const int chunks = (T + kWgTT - 1) / kWgTT;
  // Prologue: chunks 0 .. kWgStages - 2 in flight, one commit group each (empty groups past the end keep the
  // group count, and so the wait below, the same for every chunk).
#pragma unroll
  for (int c = 0; c < kWgStages - 1; ++c) {
    if (c < chunks) stage(c);
    CpAsyncCommit();
  }
  for (int c = 0; c < chunks; ++c) {
    CpAsyncWaitGroup<kWgStages - 2>();  // chunk c has landed (this thread's copies) ...
    __syncthreads();                    // ... everyone's; and every warp is done with chunk c - 1's buffer
    if (c + kWgStages - 1 < chunks) stage(c + kWgStages - 1);  // into chunk c - 1's buffer
    CpAsyncCommit();
    const int buf = c % kWgStages;
    const float* As = wsm + buf * L::kA;
    const float* Ds = wsm + kWgStages * L::kA + buf * L::kD;
#pragma unroll
    for (int ks = 0; ks < kWgTT / 8; ++ks) {
      const int r0 = 8 * ks + t4, r1 = r0 + 4;
      uint32_t ah[2][4], al[2][4], bh[kFN][2], bl[kFN][2];
      auto split = [](float x, uint32_t& hi, uint32_t& lo) {
        const float h = Tf32(x);
        hi = __float_as_uint(h);
        lo = __float_as_uint(Tf32(x - h));
      };
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = wr * 32 + i * 16 + gq;
        split(As[r0 * L::kLdA + k], ah[i][0], al[i][0]);
        split(As[r0 * L::kLdA + k + 8], ah[i][1], al[i][1]);
        split(As[r1 * L::kLdA + k], ah[i][2], al[i][2]);
        split(As[r1 * L::kLdA + k + 8], ah[i][3], al[i][3]);
      }
#pragma unroll
      for (int j = 0; j < kFN; ++j) {
        const int n = wc * kWN + j * 8 + gq;
        split(Ds[r0 * L::kLdD + n], bh[j][0], bl[j][0]);
        split(Ds[r1 * L::kLdD + n], bh[j][1], bl[j][1]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kFN; ++j) {
          Mma1688(acc[i][j], al[i], bh[j]);
          Mma1688(acc[i][j], ah[i], bl[j]);
          Mma1688(acc[i][j], ah[i], bh[j]);
        }
    }
    if (bias) {
#pragma unroll 8
      for (int tt = 0; tt < kWgTT; ++tt) bacc += Ds[tt * L::kLdD + tid];
    }
  }
  CpAsyncWaitAll();  // only empty groups are left; no copy outlives the kernel
  float* out = partials + sb * d.P + g.out_off;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < kFN; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k = k_base + wr * 32 + i * 16 + gq + (q >> 1) * 8;
        const int n = n_base + wc * kWN + j * 8 + 2 * t4 + (q & 1);
        if (k < g.K && n < g.N) out[int64_t(k) * g.N + n] = acc[i][j][q];
      }
  if (bias && n_base + tid < g.N) out[int64_t(g.K) * g.N + n_base + tid] = bacc;
}

// The weight-gradient tile's width: 128 columns for the wide heads matrix (4 H columns; H100 at B=32 T=256 H=128,
// NH = 512: 32.0 us against 39.2 us with 64) halve its A operand's reads; 64 otherwise (more CTAs).
int WgradTileN(int N) { return N >= 512 ? 128 : 64; }

// ---------------------------------------------------------------------------------------------
// Host side.

ffi::Error MakeDims(int64_t I, int64_t H, int64_t U, int64_t L, int64_t mode, int64_t P, CfcDims* d) {
  if (I < 1 || H < 1 || L < 0 || L > kMaxLayers || (L > 0 && U < 1) || (L == 0 && U != 0) || mode < 0 || mode > 2) {
    return InvalidArgument("cfc: bad attributes (input_size " + std::to_string(I) + ", hidden_size " +
                           std::to_string(H) + ", units " + std::to_string(U) + ", layers " + std::to_string(L) +
                           ", mode " + std::to_string(mode) + ")");
  }
  *d = CfcDims{};
  d->I = int(I); d->H = int(H); d->U = int(U); d->L = int(L); d->mode = int(mode);
  d->nh = mode == kPure ? 1 : 4;
  d->K0 = d->I + d->H;
  d->Kh = L > 0 ? d->U : d->K0;
  d->NH = d->nh * d->H;
  int64_t o = 0;
  for (int l = 0; l < L; ++l) {
    d->off_w[l] = o; o += int64_t(d->Kl(l)) * d->U;
    d->off_b[l] = o; o += d->U;
  }
  d->off_hw = o; o += int64_t(d->Kh) * d->NH;
  d->off_hb = o; o += d->NH;
  if (mode == kPure) {
    d->off_tau = o; o += d->H;
    d->off_A = o; o += d->H;
  }
  d->P = o;
  if (P != o) {
    return InvalidArgument("cfc: flat parameter vector has " + std::to_string(P) + " elements, expected " +
                           std::to_string(o) + " for these sizes");
  }
  return ffi::Error::Success();
}

void SetSlices(CfcDims* d, int C) {
  d->C = C;
  d->Hc = int(CeilDiv(d->H, C));
  d->Uc = d->L > 0 ? int(CeilDiv(d->U, C)) : 0;
  d->Ic = int(CeilDiv(d->I, C));
}

int64_t SmemBytes(const CfcDims& d) {
  return std::max(MakeLayout(d, false).total, MakeLayout(d, true).total) * int64_t(sizeof(float));
}

// Cluster size, a function of the sizes and the device only (never of the batch), so a sample's
// result is bitwise the same whatever batch it is in: the smallest C whose weight slices fit in
// shared memory, raised towards kPreferredCluster (shorter per-step chains; C = 4 measured fastest for
// I=48, H=U=128 on the H200: 2.69 ms fwd+bwd at B=32, T=256, against 4.76 ms for C = 2 and 3.51 ms
// for C = 8) while each CTA keeps at least kMinSliceHidden hidden units: below that the cluster
// exchanges cost more than the shorter chains save (tools/cfc_cluster_sweep.py, B=32 T=64 I=32 U=64,
// fwd+bwd us for C = 1 / 2 / 4: H=32 288 / 361 / 377, H=64 317 / 327 / 394, H=128 526 / 363 / 440; the
// rule picks 1, 2, 4: H=128 gets C=4, the bench shape's best, not this sweep's C=2, and H=64 C=2, 3 %
// slower than C=1; a threshold of 64 would flip both). JAXFOX_CFC_CLUSTER=1|2|4|8 overrides (tuning).
constexpr int kPreferredCluster = 4;
constexpr int kMinSliceHidden = 32;

ffi::Error ChooseCluster(CfcDims* d) {
  const DeviceInfo info = GetDeviceInfo();
  const int cmax = info.cc_major >= 9 ? 8 : 1;
  static const int forced = [] {
    const char* e = std::getenv("JAXFOX_CFC_CLUSTER");
    return e ? std::atoi(e) : 0;
  }();
  auto limit_ok = [&](int C) {
    return C <= cmax && C <= d->H && (d->L == 0 || C <= d->U) && CeilDiv(d->H, C) <= kNT;
  };
  int cmin = 1;
  while (CeilDiv(d->H, cmin) > kNT) cmin *= 2;
  if (cmin > cmax) {
    return InvalidArgument("cfc: hidden_size " + std::to_string(d->H) + " needs clusters of " + std::to_string(cmin) +
                           " CTAs, more than this device supports (" + std::to_string(cmax) + ")");
  }
  int chosen = 0;
  if (forced == 1 || forced == 2 || forced == 4 || forced == 8) {
    if (!limit_ok(forced)) return InvalidArgument("JAXFOX_CFC_CLUSTER is not usable for these sizes/device");
    chosen = forced;
    SetSlices(d, chosen);
    d->smem_w = 1;
    if (SmemBytes(*d) > info.max_smem_optin) d->smem_w = 0;
  } else {
    for (int C = cmin; C <= cmax && limit_ok(C); C *= 2) {
      SetSlices(d, C);
      d->smem_w = 1;
      if (SmemBytes(*d) <= info.max_smem_optin) { chosen = C; break; }
    }
    if (chosen == 0) {  // weights do not fit anywhere: read them from global memory
      chosen = cmin;
      while (limit_ok(chosen * 2)) chosen *= 2;
      SetSlices(d, chosen);
      d->smem_w = 0;
    } else {
      while (chosen < kPreferredCluster && CeilDiv(d->H, chosen * 2) >= kMinSliceHidden && limit_ok(chosen * 2)) {
        chosen *= 2;
      }
      SetSlices(d, chosen);
      d->smem_w = 1;
    }
  }
  if (SmemBytes(*d) > info.max_smem_optin) {
    return InvalidArgument("cfc: sizes too large for the kernel's shared-memory buffers (" +
                           std::to_string(SmemBytes(*d)) + " bytes)");
  }
  return ffi::Error::Success();
}

template <typename Kernel, typename... Args>
ffi::Error LaunchCluster(Kernel kernel, int C, int64_t samples, int64_t smem, cudaStream_t stream, Args... args) {
  if (samples * C > 0x7fffffff) {
    return InvalidArgument("cfc: " + std::to_string(samples) + " samples exceed the grid (at most 2^31 - 1 CTAs)");
  }
  if (smem > 48 * 1024) JAXFOX_RETURN_IF_ERROR(AllowLargeSmem(reinterpret_cast<const void*>(kernel)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(samples * C));
  cfg.blockDim = dim3(kNT);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = C > 1 ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("cfc launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Which forward kernel runs, given that RegForwardPlan fits. The register forward is used where each thread's
// dot products are at least kRegMinInputs long (kcb + nh kch); shorter ones do not pay for the shuffle
// trees. Measured on the H200 (BENCHMARKS.md, seventh session): I=48 H=U=128 C=4 (24 + 64 inputs a
// thread) forward 777 us against 856 us for cfc_fwd_kernel at B=32 T=256; the main job's I=32 H=32
// U=64 C=4 (4 + 8) perception step 829 us against 811 us. JAXFOX_CFC_REG=0 never uses it,
// JAXFOX_CFC_REG=1 uses it wherever it fits (A/B timing, sanitizer runs); read once per process.
constexpr int kRegMinInputs = 32;

bool UseRegForward(const CfcDims& d) {
  static const int forced = [] {
    const char* e = std::getenv("JAXFOX_CFC_REG");
    return e && (e[0] == '0' || e[0] == '1') ? e[0] - '0' : -1;
  }();
  if (forced == 0) return false;
  return forced == 1 || d.kcb + d.nh * d.kch >= kRegMinInputs;
}

// An on-by-default switch: false only when the environment variable `name` starts with '0'.
bool EnvSwitchOn(const char* name) {
  const char* e = std::getenv(name);
  return !(e && e[0] == '0');
}

// Whether the backward uses cfc_bwd_reg_kernel where RegBackwardPlan fits (default) or always cfc_bwd_kernel
// (JAXFOX_CFC_REG_BWD=0, for A/B timing); read once per process.
bool UseRegBackward() {
  static const bool on = EnvSwitchOn("JAXFOX_CFC_REG_BWD");
  return on;
}

// Calls f(std::integral_constant<int, C>) for the cluster size ChooseCluster picked.
template <typename F>
ffi::Error ByCluster(const CfcDims& d, F&& f) {
  switch (d.C) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Calls f(std::integral_constant<int, C>, std::integral_constant<bool, smem_w>) for the kernel
// variant ChooseCluster picked.
template <typename F>
ffi::Error ByVariant(const CfcDims& d, F&& f) {
  return ByCluster(d, [&](auto C) { return d.smem_w ? f(C, std::true_type{}) : f(C, std::false_type{}); });
}

// The register kernels' geometries compiled with fixed trip counts (cfc_fwd_reg_kernel<C, KB, SB, KH, SH>,
// cfc_bwd_reg_kernel<C, K1, S1, K2, S2>): the benchmark's I=48 H=U=128 at C=4 and the main job's I=32 H=32 U=64
// at C=1 (modes default and no_gate; the backward's also any mode whose plan gives the same numbers). Other sizes
// run the same kernels with the geometry read at run time. JAXFOX_CFC_FIXED=0 runs the run-time geometry everywhere
// (A/B timing, tests); read once per process.
bool UseFixedGeometry() {
  static const bool on = EnvSwitchOn("JAXFOX_CFC_FIXED");
  return on;
}

// Calls f(kernel) with the register forward for d's geometry.
template <typename F>
ffi::Error ByForwardGeometry(const CfcDims& d, F&& f) {
  if (UseFixedGeometry() && d.L == 1) {
    // (the fixed instances compute four heads a lane: nh = 4)
    if (d.nh == 4 && d.C == 4 && d.kcb == 24 && d.Sb == 8 && d.kch == 16 && d.Sh == 8)
      return f(cfc_fwd_reg_kernel<4, 24, 8, 16, 8>);
    if (d.nh == 4 && d.C == 1 && d.kcb == 16 && d.Sb == 4 && d.kch == 8 && d.Sh == 8)
      return f(cfc_fwd_reg_kernel<1, 16, 4, 8, 8>);
  }
  return ByCluster(d, [&](auto C) { return f(cfc_fwd_reg_kernel<C()>); });
}

// Calls f(kernel) with the register backward for d's geometry.
template <typename F>
ffi::Error ByBackwardGeometry(const CfcDims& d, F&& f) {
  if (UseFixedGeometry()) {
    if (d.C == 4 && d.k1 == 64 && d.S1 == 8 && d.k2 == 32 && d.S2 == 4) return f(cfc_bwd_reg_kernel<4, 64, 8, 32, 4>);
    if (d.C == 1 && d.k1 == 32 && d.S1 == 4 && d.k2 == 16 && d.S2 == 4) return f(cfc_bwd_reg_kernel<1, 32, 4, 16, 4>);
  }
  return ByCluster(d, [&](auto C) { return f(cfc_bwd_reg_kernel<C()>); });
}

// cfc_fwd_ar_kernel (one exchange a step) where it applies: the compiled geometry <C = 4, KH = 16, SH = 8> of
// modes default / no_gate at L = 1 with U = kNT / 2 and at most 2 kArRows own rows a CTA (the benchmark's I=48
// H=U=128 at C=4). JAXFOX_CFC_ALLREDUCE=0 turns it off (A/B timing, tests: the register forward runs instead); read
// once per process. It replaces the register forward's compiled geometry, so whatever turns that off (UseRegForward,
// JAXFOX_CFC_REG=0; UseFixedGeometry, JAXFOX_CFC_FIXED=0) turns this off too.
// What both one-exchange kernels need (UseArForward / UseArBackward add their own geometry): the switch on, compiled
// geometries allowed, one backbone layer of U = kNT / 2 units, four heads (modes default / no_gate), C = 4.
bool UseAllReduce(const CfcDims& d) {
  static const bool on = EnvSwitchOn("JAXFOX_CFC_ALLREDUCE");
  return on && UseFixedGeometry() && d.L == 1 && d.nh == 4 && d.mode != kPure && d.C == 4 && 2 * d.U == kNT;
}

bool UseArForward(const CfcDims& d) {
  return UseAllReduce(d) && d.reg_f && d.Ic + d.Hc <= 2 * kArRows && d.kch == 16 && d.Sh == 8 && CeilDiv(d.U, 16) == 8;
}

ArLayout MakeArLayout(const CfcDims& d) {
  ArLayout s{};
  int o = 0;
  s.zo = o; s.zo_ld = 2 * SplitStride(kArRows); o += 2 * s.zo_ld;
  s.part = o; o += 2 * d.C * d.U;
  s.act = o; s.act_s = SplitStride(d.kch); s.act_ld = std::max(int(CeilDiv(d.U, d.kch)), d.Sh) * s.act_s;
  o += 2 * s.act_ld;
  s.mbar = Align4(o); o = s.mbar + 4;
  s.total = o;
  return s;
}

// cfc_bwd_ar_kernel (one exchange a step) where it applies: the compiled geometry <C = 4, K2 = 32, S2 = 4> of modes
// default / no_gate at L = 1 with U = kNT / 2 and at most 32 hidden units a CTA; JAXFOX_CFC_ALLREDUCE=0 turns it off
// as the forward's. It replaces the register backward's compiled geometry, so JAXFOX_CFC_REG_BWD=0 and
// JAXFOX_CFC_FIXED=0 turn it off too. (Ranks other than 0 receive the dts partials and ignore them: one uniform byte
// count per phase.)
bool UseArBackward(const CfcDims& d) {
  return UseAllReduce(d) && d.reg_b && d.Hc <= 32 && 4 * d.Hc <= 2 * kArEnt && d.k2 == 32 && d.S2 == 4;
}

ArBwdLayout MakeArBwdLayout(const CfcDims& d) {
  ArBwdLayout s{};
  const int kS = SplitStride(kArEnt);
  int o = 0;
  s.dph = o; o += 2 * 2 * kS;
  s.dts = o; o += 2 * 32;
  s.part = o; s.part_ld = Align4(d.U + 1); o += 2 * d.C * s.part_ld;
  s.dpb = o; o += 2 * d.pb_ld;
  s.mbar = Align4(o); o = s.mbar + 4;
  s.total = o;
  return s;
}

ffi::Error CheckInputs(const CfcDims& d, ffi::Buffer<ffi::F32>& xs, ffi::Buffer<ffi::F32>& ts,
                       ffi::Buffer<ffi::F32>& h0, ffi::Buffer<ffi::F32>& w, int64_t* V, int64_t* B, int64_t* T) {
  auto xd = xs.dimensions();
  if (xd.size() < 3) return InvalidArgument("cfc: xs must be [..., B, T, I], got " + DimsToString(xd));
  *B = xd[xd.size() - 3];
  *T = xd[xd.size() - 2];
  *V = -1;
  JAXFOX_RETURN_IF_ERROR(CheckShape(xs, "xs", {*B, *T, d.I}, V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(ts, "ts", {*B, *T}, V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(h0, "h0", {*B, d.H}, V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(w, "params", {d.P}, V));
  return ffi::Error::Success();
}

int64_t WParamCount(ffi::Buffer<ffi::F32>& w) {
  auto wd = w.dimensions();
  return wd.size() ? wd[wd.size() - 1] : 0;
}

ffi::Error CfcFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::F32> ts,
                      ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> w, int64_t input_size, int64_t hidden_size,
                      int64_t units, int64_t layers, int64_t mode, ffi::ResultBuffer<ffi::F32> hs,
                      ffi::ResultBuffer<ffi::F32> acts, ffi::ResultBuffer<ffi::F32> pre) {
  ClearStaleCudaError();
  CfcDims d;
  JAXFOX_RETURN_IF_ERROR(MakeDims(input_size, hidden_size, units, layers, mode, WParamCount(w), &d));
  int64_t V, B, T;
  JAXFOX_RETURN_IF_ERROR(CheckInputs(d, xs, ts, h0, w, &V, &B, &T));
  const int64_t S = V * B;
  if (int64_t(hs->element_count()) != S * T * d.H || int64_t(acts->element_count()) != S * T * d.L * d.U ||
      int64_t(pre->element_count()) != S * T * d.NH) {
    return InvalidArgument("cfc_fwd: output buffer sizes do not match the inputs");
  }
  if (S == 0 || T == 0) return ffi::Error::Success();
  d.B = B; d.T = T; d.V = V;
  JAXFOX_RETURN_IF_ERROR(ChooseCluster(&d));
  d.reg_f = RegForwardPlan(&d) && UseRegForward(d) ? 1 : 0;
  const Layout lay = d.reg_f ? MakeRegForwardLayout(d) : MakeLayout(d, false);
  const int64_t smem = int64_t(lay.total) * sizeof(float);
  const float *px = xs.typed_data(), *pt = ts.typed_data(), *ph = h0.typed_data(), *pw = w.typed_data();
  float *o1 = hs->typed_data(), *o2 = acts->typed_data(), *o3 = pre->typed_data();
  auto launch = [&](auto kernel) { return LaunchCluster(kernel, d.C, S, smem, stream, d, lay, px, pt, ph, pw, o1, o2, o3); };
  if (UseArForward(d)) {
    const ArLayout alay = MakeArLayout(d);
    JAXFOX_RETURN_IF_ERROR(LaunchCluster(cfc_fwd_ar_kernel<4, 16, 8>, d.C, S, int64_t(alay.total) * sizeof(float),
                                         stream, d, alay, px, pt, ph, pw, o1, o2, o3));
    return LastCudaError("cfc_fwd (one exchange a step)");
  }
  const ffi::Error e = d.reg_f ? ByForwardGeometry(d, launch)
                               : ByVariant(d, [&](auto C, auto smem_w) { return launch(cfc_fwd_kernel<C(), smem_w()>); });
  JAXFOX_RETURN_IF_ERROR(e);
  return LastCudaError("cfc_fwd");
}

ffi::Error CfcBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::F32> ts,
                      ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> hs,
                      ffi::Buffer<ffi::F32> acts, ffi::Buffer<ffi::F32> pre, ffi::Buffer<ffi::F32> dhs,
                      int64_t chunks, int64_t input_size, int64_t hidden_size, int64_t units, int64_t layers,
                      int64_t mode, ffi::ResultBuffer<ffi::F32> dw, ffi::ResultBuffer<ffi::F32> dxs,
                      ffi::ResultBuffer<ffi::F32> dts, ffi::ResultBuffer<ffi::F32> dh0,
                      ffi::ResultBuffer<ffi::F32> dpre_bb, ffi::ResultBuffer<ffi::F32> dpre_h,
                      ffi::ResultBuffer<ffi::F32> partials, ffi::ResultBuffer<ffi::F32> reduce_ws) {
  ClearStaleCudaError();
  CfcDims d;
  JAXFOX_RETURN_IF_ERROR(MakeDims(input_size, hidden_size, units, layers, mode, WParamCount(w), &d));
  int64_t V, B, T;
  JAXFOX_RETURN_IF_ERROR(CheckInputs(d, xs, ts, h0, w, &V, &B, &T));
  JAXFOX_RETURN_IF_ERROR(CheckShape(hs, "hs", {B, T, d.H}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(acts, "acts", {B, T, int64_t(d.L) * d.U}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(pre, "pre", {B, T, d.NH}, &V));
  JAXFOX_RETURN_IF_ERROR(CheckShape(dhs, "dhs", {B, T, d.H}, &V));
  const int64_t S = V * B;
  if (int64_t(dw->element_count()) != V * d.P || int64_t(dxs->element_count()) != S * T * d.I ||
      int64_t(dts->element_count()) != S * T || int64_t(dh0->element_count()) != S * d.H ||
      int64_t(dpre_bb->element_count()) != S * T * d.L * d.U ||
      int64_t(dpre_h->element_count()) != S * T * d.NH || int64_t(partials->element_count()) != S * d.P) {
    return InvalidArgument("cfc_bwd: output buffer sizes do not match the inputs");
  }
  if (chunks < 1 || (chunks > 1 && int64_t(reduce_ws->element_count()) < V * chunks * d.P)) {
    return InvalidArgument("cfc_bwd: reduce workspace too small for chunks = " + std::to_string(chunks));
  }
  if (S == 0) {
    cudaMemsetAsync(dw->typed_data(), 0, sizeof(float) * V * d.P, stream);
    return LastCudaError("cfc_bwd (empty batch)");
  }
  if (T == 0) {
    cudaMemsetAsync(dw->typed_data(), 0, sizeof(float) * V * d.P, stream);
    cudaMemsetAsync(dh0->typed_data(), 0, sizeof(float) * S * d.H, stream);
    return LastCudaError("cfc_bwd (T = 0)");
  }
  // Weight-gradient partials, one launch per matrix (backbone layers, then the heads; its bias is the extra
  // row K), samples on grid x and output tiles on grid y (<= 65535): the grids are checked before any launch.
  GradGemm wg[kMaxLayers + 1];
  for (int l = 0; l < d.L; ++l) wg[l] = GradGemm{d.Kl(l), d.U, l - 1, d.L * d.U, l * d.U, d.off_w[l], 0};
  wg[d.L] = GradGemm{d.Kh, d.NH, d.L - 1, d.NH, 0, d.off_hw, 0};
  const bool aligned16 = Aligned(xs.typed_data(), 16) && Aligned(h0.typed_data(), 16) && Aligned(hs.typed_data(), 16) &&
                         Aligned(acts.typed_data(), 16) && Aligned(dpre_bb->typed_data(), 16) &&
                         Aligned(dpre_h->typed_data(), 16);
  for (int l = 0; l <= d.L; ++l) {
    // 16-byte copies when every row start and width the kernel reads is a multiple of 4 floats.
    const bool a4 = wg[l].a_layer < 0 ? d.I % 4 == 0 && d.H % 4 == 0 : (d.L * d.U) % 4 == 0 && d.U % 4 == 0;
    wg[l].vec = a4 && aligned16 && wg[l].K % 4 == 0 && wg[l].N % 4 == 0 && wg[l].d_ld % 4 == 0 && wg[l].d_off % 4 == 0;
  }
  auto wgrad_tiles = [](const GradGemm& g) { return CeilDiv(g.K, kWgK) * CeilDiv(g.N, WgradTileN(g.N)); };
  for (int l = 0; l <= d.L; ++l) {
    if (wgrad_tiles(wg[l]) > 65535) {
      return InvalidArgument("cfc_bwd: weight matrix " + std::to_string(wg[l].K) + " x " + std::to_string(wg[l].N) +
                             " too large for the weight-gradient grid");
    }
  }
  d.B = B; d.T = T; d.V = V;
  JAXFOX_RETURN_IF_ERROR(ChooseCluster(&d));
  const Layout lay = MakeLayout(d, true);
  const int64_t smem = int64_t(lay.total) * sizeof(float);
  const float *px = xs.typed_data(), *pt = ts.typed_data(), *pw = w.typed_data(), *pa = acts.typed_data(),
              *pp = pre.typed_data(), *pd = dhs.typed_data();
  float *gx = dxs->typed_data(), *gt = dts->typed_data(), *gh = dh0->typed_data(), *gbb = dpre_bb->typed_data(),
        *gph = dpre_h->typed_data(), *part = partials->typed_data();
  auto launch = [&](auto kernel) {
    return LaunchCluster(kernel, d.C, S, smem, stream, d, lay, px, pt, pw, pa, pp, pd, gx, gt, gh, gbb, gph, part);
  };
  d.reg_b = RegBackwardPlan(&d) && UseRegBackward() ? 1 : 0;
  ffi::Error e = ffi::Error::Success();
  if (UseArBackward(d)) {
    const ArBwdLayout alay = MakeArBwdLayout(d);
    e = LaunchCluster(cfc_bwd_ar_kernel<4, 32, 4>, d.C, S, int64_t(alay.total) * sizeof(float), stream, d, alay, pt, pw,
                      pa, pp, pd, gx, gt, gh, gbb, gph, part);
  } else if (d.reg_b) {
    const Layout rlay = MakeRegBackwardLayout(d);
    e = ByBackwardGeometry(d, [&](auto kernel) {
      return LaunchCluster(kernel, d.C, S, int64_t(rlay.total) * sizeof(float), stream, d, rlay, pt, pw, pa, pp, pd, gx,
                           gt, gh, gbb, gph, part);
    });
  } else {
    e = ByVariant(d, [&](auto C, auto smem_w) { return launch(cfc_bwd_kernel<C(), smem_w()>); });
  }
  JAXFOX_RETURN_IF_ERROR(e);
  JAXFOX_RETURN_IF_ERROR(LastCudaError("cfc_bwd recurrence"));
  for (int l = 0; l <= d.L; ++l) {
    dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(wgrad_tiles(wg[l])));
    auto launch = [&](auto tn) {
      constexpr int TN = decltype(tn)::value;
      JAXFOX_RETURN_IF_ERROR(PrepareSmem("cfc_bwd weight gradients", cfc_wgrad_kernel<TN>, WgradSmem<TN>::kBytes));
      cfc_wgrad_kernel<TN><<<grid, 256, WgradSmem<TN>::kBytes, stream>>>(d, wg[l], px, h0.typed_data(), hs.typed_data(),
                                                                         pa, l < d.L ? gbb : gph, part);
      return ffi::Error::Success();
    };
    JAXFOX_RETURN_IF_ERROR(WgradTileN(wg[l].N) == 128 ? launch(std::integral_constant<int, 128>{})
                                                      : launch(std::integral_constant<int, 64>{}));
  }
  JAXFOX_RETURN_IF_ERROR(LastCudaError("cfc_bwd weight gradients"));
  return LaunchReduceAxis0(stream, part, V, B, d.P, chunks, reduce_ws->typed_data(), dw->typed_data());
}

}  // namespace
}  // namespace jaxfox

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_cfc_fwd, jaxfox::CfcFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // xs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ts
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // flat params
                                  .Attr<int64_t>("input_size")
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("layers")
                                  .Attr<int64_t>("mode")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // hs
                                  .Ret<ffi::Buffer<ffi::F32>>()   // acts
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // pre
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfox_cfc_bwd, jaxfox::CfcBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // xs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ts
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // flat params
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // acts
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pre
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dhs
                                  .Attr<int64_t>("chunks")
                                  .Attr<int64_t>("input_size")
                                  .Attr<int64_t>("hidden_size")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("layers")
                                  .Attr<int64_t>("mode")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dw
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dxs
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dts
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dh0
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dpre_bb (workspace)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dpre_h (workspace)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // partials (workspace)
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // reduce_axis0 workspace
                              {ffi::Traits::kCmdBufferCompatible});
