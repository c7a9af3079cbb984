// Every FFI handler symbol the extension exports. One line per target; the name is the
// XLA custom-call target name used by jax.ffi.ffi_call in jaxfox/<family>.py.
#pragma once
#include "xla/ffi/api/c_api.h"

#define JAXFOX_TARGETS(X)   \
  X(jaxfox_reduce_axis0)    \
  X(jaxfox_grouped_gemm)    \
  X(jaxfox_grouped_wgrad)   \
  X(jaxfox_cfc_fwd)         \
  X(jaxfox_c51_loss)        \
  X(jaxfox_prefix_sum)      \
  X(jaxfox_per_sample)      \
  X(jaxfox_cfc_bwd)         \
  X(jaxfox_attention_pool_fwd) \
  X(jaxfox_attention_pool_bwd) \
  X(jaxfox_adamw_apply)     \
  X(jaxfox_grn_fwd)         \
  X(jaxfox_grn_bwd)         \
  X(jaxfox_grn_tc_fwd)      \
  X(jaxfox_grn_tc_bwd)      \
  X(jaxfox_vsn_grn_fwd)     \
  X(jaxfox_vsn_grn_bwd)     \
  X(jaxfox_iqn_head_fwd)    \
  X(jaxfox_iqn_head_bwd)    \
  X(jaxfox_iqn_loss)        \
  X(jaxfox_iql_head)         \
  JAXFOX_SM90A_TARGETS(X)

// Targets whose kernels exist only as sm_90a machine code (wgmma): registered by builds for 90a-real
// (CMakeLists.txt defines JAXFOX_SM90A_BUILD), absent otherwise (jaxfox/_ffi.py has_target).
#if defined(JAXFOX_SM90A_BUILD)
#define JAXFOX_SM90A_TARGETS(X) X(jaxfox_iql_fused)
#else
#define JAXFOX_SM90A_TARGETS(X)
#endif

#define JAXFOX_DECLARE(name) extern "C" XLA_FFI_Error* name(XLA_FFI_CallFrame*);
JAXFOX_TARGETS(JAXFOX_DECLARE)
#undef JAXFOX_DECLARE
