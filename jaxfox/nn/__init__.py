"""flax.nnx modules: thin parameter holders over jaxfox's functional ops (:mod:`jaxfox.cfc` ...)."""

from jaxfox.nn.cfc import CfC

__all__ = ["CfC"]
