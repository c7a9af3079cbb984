"""flax.nnx modules: thin parameter holders over jaxfox's functional ops (:mod:`jaxfox.cfc` ...)."""

from jaxfox.nn.cfc import CfC
from jaxfox.nn.tft import GRN, VSN, AttentionPool

__all__ = ["CfC", "GRN", "VSN", "AttentionPool"]
