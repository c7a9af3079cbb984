"""jaxfox: fused CUDA kernels for JAX (XLA FFI + custom_vjp) for recurrent perception and distributional RL.

Every op runs its CUDA kernels on a GPU and a pure-JAX reference elsewhere (see ``jaxfox._ffi``).
"""

from jaxfox._ffi import kernels_available, kernels_unavailable_reason, use_reference
from jaxfox.attention import attention_pool, attention_pool_init
from jaxfox.c51 import branching_dueling_logits, categorical_double_q_loss, categorical_projection
from jaxfox.cfc import cfc_cell, cfc_init, cfc_scan, lecun_tanh
from jaxfox import optim, per, sharding
from jaxfox.optim import FlatParams, cast_bf16, ema_update, fused_adamw
from jaxfox.gemm import grouped_matmul, grouped_matmul_stacked
from jaxfox.grn import grn, grn_init
from jaxfox.iqn import iqn_head, iqn_head_init, iqn_quantile_huber_loss
from jaxfox.iql import iql_value_loss
from jaxfox.losses import cql_penalty, expectile_loss, quantile_embedding, quantile_huber_loss
from jaxfox.concurrency import concurrent_command_buffers_enabled, enable_concurrent_command_buffers
from jaxfox.reduce import reduce_axis0
from jaxfox.vsn import vsn, vsn_init

__version__ = "0.1.0"

__all__ = [
    "kernels_available", "kernels_unavailable_reason", "use_reference",
    "reduce_axis0",
    "cfc_init", "cfc_cell", "cfc_scan", "lecun_tanh",
    "attention_pool_init", "attention_pool",
    "branching_dueling_logits", "categorical_double_q_loss", "categorical_projection",
    "per", "optim", "sharding", "FlatParams", "fused_adamw", "ema_update", "cast_bf16",
    "grn_init", "grn", "vsn_init", "vsn",
    "iqn_head_init", "iqn_head", "iqn_quantile_huber_loss", "iql_value_loss",
    "grouped_matmul", "grouped_matmul_stacked",
    "expectile_loss", "quantile_huber_loss", "quantile_embedding", "cql_penalty",
    "enable_concurrent_command_buffers", "concurrent_command_buffers_enabled",
]


def __getattr__(name):
    """Lazy submodules: ``jaxfox.nn``, ``jaxfox.models``, ``jaxfox.data``, ``jaxfox.envs`` (flax/pandas load on
    first use)."""
    if name in ("nn", "models", "data", "envs"):
        import importlib

        return importlib.import_module(f"jaxfox.{name}")
    raise AttributeError(f"module 'jaxfox' has no attribute {name!r}")
