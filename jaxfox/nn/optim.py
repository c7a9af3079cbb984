"""``jaxfox.nn.Optimizer``: a ``flax.nnx.Optimizer`` that applies :meth:`jaxfox.optim.FusedAdamW.step`.

``nnx.Optimizer.update`` calls ``tx.update`` and then ``optax.apply_updates``: XLA then writes the update
and adds it to every parameter leaf in kernels of its own (one per leaf for a flattened update). With a
:func:`jaxfox.fused_adamw` transformation, this subclass calls its ``step`` instead (update and apply in one
call: ONE fused CUDA kernel over all leaves on a GPU, by the rule of :func:`jaxfox.fused_adamw`; the same
operations as ``update`` + ``apply_updates`` on the reference path). Any other transformation behaves
exactly as in ``nnx.Optimizer``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Optimizer"]


class Optimizer(nnx.Optimizer):
    """``flax.nnx.Optimizer`` whose :meth:`update` runs ``tx.step(grads, opt_state, params)`` when ``tx``
    has one (a :class:`jaxfox.optim.FusedAdamW`), else ``nnx.Optimizer.update``.

    Args: as ``nnx.Optimizer`` (model, tx, wrt=...). The state (``opt_state``, ``step``) is nnx.Optimizer's.
    """

    def update(self, model, grads, /, **kwargs):
        """One step: updates ``model``'s parameters (the ``wrt`` variables) and the optimizer state in place.

        Args:
          model: the module the optimizer was made for.
          grads: gradients of the ``wrt`` variables (``nnx.grad`` of a loss), float32, shaped as the params.
          **kwargs: passed to ``tx.update`` (transformations with extra arguments); with any, the
            ``nnx.Optimizer`` path (``update`` then ``apply_updates``) runs.

        Returns:
          The change applied to each parameter (new - old, a pytree like the params; unused results cost
          nothing under jit).

        Raises:
          The errors of ``tx.step`` / ``tx.update`` (mismatched gradients, non-float32 leaves).
        """
        step = getattr(self.tx, "step", None)
        if step is None or kwargs:
            return super().update(model, grads, **kwargs)
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        new_params, new_opt_state = step(grad_arrays, nnx.as_pure(self.opt_state), params)
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] += 1
        return jax.tree.map(jnp.subtract, new_params, params)
