"""``jaxfox.nn.CfC``: a flax.nnx module over :func:`jaxfox.cfc_scan`.

The module only holds the parameters (as ``nnx.Param``, initialised by :func:`jaxfox.cfc_init`) and
calls the functional op, so it runs the CUDA kernels on a GPU and the pure-JAX reference elsewhere,
exactly like ``cfc_scan``. Semantics: ncps's PyTorch ``CfC`` with ``batch_first=True`` and
``return_sequences=True`` (no wiring, no output projection); see :mod:`jaxfox.cfc` and OPS.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxfox._validate import check_rngs
from jaxfox.cfc import cfc_init, cfc_scan

__all__ = ["CfC"]


class CfC(nnx.Module):
    """Closed-form continuous-time recurrent layer (Hasani et al. 2022), batch-major.

    Args:
      input_size: I, features per step.  hidden_size: H.
      backbone_units: U, width of each backbone layer.  backbone_layers: L >= 0.
      mode: "default", "no_gate" or "pure" (see :mod:`jaxfox.cfc`).
      rngs: ``nnx.Rngs``; the ``params`` stream seeds :func:`jaxfox.cfc_init`.

    Attributes (all ``nnx.Param``, float32, the arrays of :func:`jaxfox.cfc_init`):
      backbone: ``nnx.List`` of L ``nnx.Dict(w=[in, U], b=[U])``; heads_w [K, 4H] (mode "pure": [K, H]);
      heads_b [4H] ([H]); mode "pure" also w_tau [H] and A [H].

    Raises:
      ValueError: as :func:`jaxfox.cfc_init` (a size that is not a positive int, an unknown mode).
      TypeError: rngs is not an ``nnx.Rngs``.
    """

    def __init__(self, input_size: int, hidden_size: int, *, backbone_units: int = 128,
                 backbone_layers: int = 1, mode: str = "default", rngs: nnx.Rngs):
        check_rngs(rngs)
        p = cfc_init(rngs.params(), input_size, hidden_size, backbone_units=backbone_units,
                     backbone_layers=backbone_layers, mode=mode, dtype=jnp.float32)
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        self.mode = mode
        self.backbone = nnx.List([nnx.Dict(w=nnx.Param(layer["w"]), b=nnx.Param(layer["b"]))
                                  for layer in p["backbone"]])
        self.heads_w = nnx.Param(p["heads_w"])
        self.heads_b = nnx.Param(p["heads_b"])
        if mode == "pure":
            self.w_tau = nnx.Param(p["w_tau"])
            self.A = nnx.Param(p["A"])

    @property
    def params(self) -> dict:
        """The current parameter values as the plain dict pytree that :func:`jaxfox.cfc_scan` takes."""
        out = {"backbone": [{"w": layer["w"][...], "b": layer["b"][...]} for layer in self.backbone],
               "heads_w": self.heads_w[...], "heads_b": self.heads_b[...]}
        if self.mode == "pure":
            out["w_tau"] = self.w_tau[...]
            out["A"] = self.A[...]
        return out

    def __call__(self, xs, ts=1.0, h0=None):
        """xs [B, T, I] float32, ts (bars; scalar, [B] or [B, T], >= 0), h0 [B, H] or None -> hs [B, T, H].

        Raises:
          ValueError: xs is not [B, T, input_size] (checked here, so the message names xs rather than a
            parameter); otherwise what :func:`jaxfox.cfc_scan` raises (errors name the argument).
        """
        shape = getattr(xs, "shape", None)
        if shape is not None and (len(shape) != 3 or shape[-1] != self.input_size):
            raise ValueError(f"xs must have shape [B, T, {self.input_size}], got {tuple(shape)}")
        return cfc_scan(self.params, xs, ts, h0, mode=self.mode)
