"""flax.nnx modules: thin parameter holders over jaxfox's functional ops (:mod:`jaxfox.cfc` ...), and an
``nnx.Optimizer`` that applies :func:`jaxfox.fused_adamw` in one step (:class:`Optimizer`)."""

from jaxfox.nn.cfc import CfC
from jaxfox.nn.optim import Optimizer
from jaxfox.nn.tft import GRN, VSN, AttentionPool

__all__ = ["CfC", "GRN", "VSN", "AttentionPool", "Optimizer"]
