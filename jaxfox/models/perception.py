"""Perception model (issue 3): per-variable embedding -> VSN (every step) -> CfC -> attention pool -> GRN head.

    x [B, T, m]  (m scalar features per day, z-scored)
    e[b, t, j, :] = x[b, t, j] * embed_w[j] + embed_b[j]            [B, T, m, d]   one d-vector per variable
    z, v = VSN(e)                                                     z [B, T, O], v [B, T, m] (sum_j v = 1)
    hs = CfC(z, ts)                                                   [B, T, H]
    p, alpha = AttentionPool(hs)                                      p [B, H], alpha [B, n, T]
    u = concat(p, hs[:, -1])                                          [B, 2H]  pooled summary + last state
    logit = GRN_head(u) @ out_w + out_b                               [B]   (GRN 2H -> H, then Linear H -> 1)

The embedding is the TFT input stage ("linear transformations for continuous variables", Lim et al.
2021, sec. 4.1); the VSN is TFT eqs. (6)-(8) applied at every time step without static context; the
CfC replaces TFT's LSTM encoder; the attention pool (one learned query over time) replaces TFT's
decoder self-attention for a single-step classification target; the GRN head is TFT's position-wise
feed-forward GRN (eq. 2), followed by a linear read-out (a GRN of output width 1 would be constant:
its LayerNorm over one element returns beta). The head also sees the last CfC state hs[:, -1] (through
the GRN's learned skip Dense as well as its gated path), as TFT adds its temporal self-attention output
to the recurrent output at the forecast position through a gated skip connection: the learned query of
the pool carries no position, and with the pooled vector alone the model scored validation AUC ~0.50
against ~0.65 with the last state added (main job, 3 epochs, seed 0). Every block is a :mod:`jaxfox.nn` module over the
functional op (CUDA kernels on a GPU, pure-JAX reference elsewhere).

Training-loop pieces, as :mod:`jaxfox.models.perception_v0` (whose :func:`make_optimizer` is reused):
:func:`make_model`, :func:`loss_fn`, :func:`train_step`, :func:`train_epoch`, :func:`predict`, :func:`evaluate`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxfox._validate import check_rngs, positive_int
from jaxfox.models.perception_v0 import (_check_labels, _check_model, _check_windows_and_labels, _map_padded_chunks,
                                         _run_epoch, check_window_batch, data_parallel_step, make_benchmark_step,
                                         make_optimizer)
from jaxfox.nn.cfc import CfC
from jaxfox.nn.tft import GRN, VSN, AttentionPool

__all__ = ["FULL_DEFAULTS", "Perception", "make_model", "make_optimizer", "loss_fn", "train_step", "train_epoch",
           "predict", "evaluate", "benchmark_step"]


FULL_DEFAULTS = {"embed_dim": 4, "vsn_hidden": 32, "vsn_out": 32, "hidden": 32, "backbone_units": 64,
                 "num_heads": 4, "lr": 1e-3, "weight_decay": 1.0}
"""Defaults of :func:`make_model` and of the main job (``examples/train_perception.py``, whose default model
this is): sized so that its 15 epochs take a few minutes on a 2-core CPU (1.5 to 3 min, 4 to 10 s an epoch
with :func:`train_epoch`, measured 2026-12-01 .. 2026-12-03); at seed 0 they score validation AUC 0.6647 and test
AUC 0.6770 there."""


class Perception(nnx.Module):
    """Embedding -> VSN -> CfC -> attention pool -> GRN head -> logit (module docstring for the equations).

    Args:
      num_features: m, scalar features per time step.
      embed_dim: d, width of each variable's embedding.
      vsn_hidden: Hd of the VSN's GRNs.  vsn_out: O, the VSN output width (= CfC input).
      hidden: H, CfC state size (also the pooled width; the GRN head maps 2H -> H).
      backbone_units / backbone_layers / mode: passed to :class:`jaxfox.nn.CfC`.
      num_heads: n of the attention pool (must divide H).
      rngs: ``nnx.Rngs`` (stream ``params``).

    Initialisation: ``embed_w`` ~ N(0, 1), ``embed_b`` = 0 (as v0); VSN, GRN and attention pool by their
    ``*_init`` (Keras/PyTorch defaults); CfC as ncps; ``out`` an ``nnx.Linear`` (LeCun-normal, zero bias).

    Raises:
      ValueError: a size is not a positive int, or num_heads does not divide hidden.
    """

    def __init__(self, num_features: int, *, embed_dim: int = FULL_DEFAULTS["embed_dim"],
                 vsn_hidden: int = FULL_DEFAULTS["vsn_hidden"], vsn_out: int = FULL_DEFAULTS["vsn_out"],
                 hidden: int = FULL_DEFAULTS["hidden"], backbone_units: int = FULL_DEFAULTS["backbone_units"],
                 backbone_layers: int = 1, mode: str = "default", num_heads: int = FULL_DEFAULTS["num_heads"],
                 rngs: nnx.Rngs):
        check_rngs(rngs)
        for name, v in (("num_features", num_features), ("embed_dim", embed_dim), ("vsn_hidden", vsn_hidden),
                        ("vsn_out", vsn_out), ("hidden", hidden), ("num_heads", num_heads)):
            positive_int(name, v)
        if hidden % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide hidden={hidden}")
        self.num_features = int(num_features)
        self.embed_dim = int(embed_dim)
        self.embed_w = nnx.Param(jax.random.normal(rngs.params(), (num_features, embed_dim), jnp.float32))
        self.embed_b = nnx.Param(jnp.zeros((num_features, embed_dim), jnp.float32))
        self.vsn = VSN(num_features, embed_dim, vsn_hidden, vsn_out, rngs=rngs)
        self.cfc = CfC(vsn_out, hidden, backbone_units=backbone_units, backbone_layers=backbone_layers, mode=mode,
                       rngs=rngs)
        self.pool = AttentionPool(hidden, num_heads=num_heads, rngs=rngs)
        self.head = GRN(2 * hidden, hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def embed(self, x):
        """x [B, T, m] -> per-variable embeddings [B, T, m, d]."""
        return x[..., None] * self.embed_w[...] + self.embed_b[...]

    def __call__(self, x, ts=1.0):
        """x [B, T, m] float32 (ts: elapsed bars per step, see :func:`jaxfox.cfc_scan`) ->
        (logits [B] float32, vsn_weights [B, T, m] float32 summing to 1 over m).

        Raises:
          ValueError: x is not [B, T, m] with m = num_features and T >= 1.  TypeError: x is not float32.
        """
        check_window_batch(x, self.num_features)
        z, weights = self.vsn(self.embed(x))
        hs = self.cfc(z, ts)
        pooled, _ = self.pool(hs)
        u = jnp.concatenate([pooled, hs[:, -1]], axis=-1)
        return self.out(self.head(u))[:, 0], weights


def make_model(num_features: int, *, rngs: nnx.Rngs, **kwargs) -> Perception:
    """A :class:`Perception` for ``num_features`` inputs (keyword arguments as the class, defaults
    :data:`FULL_DEFAULTS`)."""
    return Perception(num_features, rngs=rngs, **kwargs)


def _check_full(model, fn: str) -> None:
    """:func:`jaxfox.models.perception_v0._check_model` for this module's functions (the full model's)."""
    v0 = {"predict": "predict_logits"}.get(fn, fn)
    _check_model(model, fn, Perception, "the full model's", "PerceptionV0", f"jaxfox.models.{v0}")


def loss_fn(model: Perception, x, y):
    """Mean binary cross-entropy of the logits of ``model(x)`` against labels y [B] in {0, 1} (float32).

    Raises:
      ValueError: y is not [B] (one label per window of x; a [B, 1] y would broadcast the BCE to [B, B]); x is not
        [B, T, m] with m = ``model.num_features`` and T >= 1.
      TypeError: model is not a :class:`Perception` (model v0's is :func:`jaxfox.models.loss_fn`); y or x is not
        float32.
    """
    _check_full(model, "loss_fn")
    _check_windows_and_labels(x, y, model.num_features)
    logits, _ = model(x)
    return optax.sigmoid_binary_cross_entropy(logits, y).mean()


@nnx.jit(static_argnames=("mesh",))
def train_step(model: Perception, optimizer: nnx.Optimizer, x, y, *, mesh=None):
    """One optimizer step on x [B, T, m], y [B]; updates model and optimizer in place; returns the
    batch's mean BCE before the update (float32 scalar).

    Data parallel over ``mesh`` (default: all local devices), as :func:`jaxfox.models.perception_v0.train_step`.

    Raises:
      ValueError: B is not divisible by the number of devices in the mesh; x or y of the wrong shape (as
        :func:`loss_fn`).
      TypeError: model is not a :class:`Perception` (model v0's is :func:`jaxfox.models.train_step`); x or y is
        not float32.
    """
    _check_full(model, "train_step")
    return data_parallel_step(model, optimizer, x, y, mesh, loss=loss_fn)


def train_epoch(model: Perception, optimizer: nnx.Optimizer, x, y, key, *, batch_size: int,
                input_noise: float = 0.0, mesh=None):
    """One epoch of :func:`train_step`s in one compiled call, as :func:`jaxfox.models.perception_v0.train_epoch`
    (same arguments, returns the steps' losses [N // batch_size] float32, same errors, raised before anything
    runs), with this module's :func:`loss_fn`; TypeError: model is not a :class:`Perception` (model v0's is
    :func:`jaxfox.models.train_epoch`)."""
    _check_full(model, "train_epoch")
    return _run_epoch(model, optimizer, x, y, key, batch_size=batch_size, input_noise=input_noise, mesh=mesh,
                      loss=loss_fn)


@nnx.jit
def _forward(model, x):
    logits, w = model(x)
    return logits, w.mean(axis=1)  # per-window mean over time: [B, m]


def predict(model: Perception, x, *, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(logits [N], vsn_weights [N, m]) as NumPy float32 for x [N, T, m]; the weights are each window's
    VSN weights averaged over its T steps. Fixed-size chunks (the last zero-padded): one compilation.

    Raises:
      ValueError: ``batch_size`` is not an int >= 1; x is not [N, T, m] (m = ``model.num_features``).
      TypeError: model is not a :class:`Perception` (model v0's is :func:`jaxfox.models.predict_logits`).
    """
    _check_full(model, "predict")
    batch_size = positive_int("batch_size", batch_size)
    x = np.asarray(x, np.float32)
    # checked here, on the whole x: the model sees only the zero-padded chunks (whose shape an error would report),
    # and none at all when N = 0
    check_window_batch(x, getattr(model, "num_features", None), rows="N")
    return _map_padded_chunks(lambda c: _forward(model, c), x, batch_size)


def evaluate(model: Perception, x, y, *, batch_size: int = 256) -> tuple[float, float, np.ndarray]:
    """(mean BCE, ROC AUC, mean VSN weights [m]) of the model on x [N, T, m], y [N].

    The mean weights average over all N windows and T steps (they sum to 1 over m).

    Raises:
      ValueError: y is not [N] (a [N, 1] y would broadcast the BCE to [N, N] and report a wrong loss), as
        :func:`predict`, and as :func:`jaxfox.data.market.auc` (y not 0/1 labels of both classes).
      TypeError: model is not a :class:`Perception` (model v0's is :func:`jaxfox.models.evaluate`).
    """
    from jaxfox.data.market import auc

    _check_full(model, "evaluate")
    x = np.asarray(x, np.float32)
    check_window_batch(x, model.num_features, rows="N")  # before y, whose expected size is read off x
    y = np.asarray(y, np.float32)
    _check_labels(y, len(x), "N")
    logits, w = predict(model, x, batch_size=batch_size)
    loss = float(np.asarray(optax.sigmoid_binary_cross_entropy(jnp.asarray(logits), jnp.asarray(y)).mean()))
    return loss, auc(logits, y), w.mean(axis=0)


def benchmark_step(batch: int = 32, window: int = 64, num_features: int = 48, *, seed: int = 0, mesh=None,
                   **model_kwargs):
    """The whole training step of the full model (:func:`make_model` with :data:`FULL_DEFAULTS` unless
    ``model_kwargs`` say otherwise, AdamW of :func:`make_optimizer`) as a pure function for the benchmark
    harness: ``(step_fn, state, batch)`` as :func:`jaxfox.models.perception_v0.benchmark_step`, with this
    module's :func:`loss_fn`. Data parallel over ``mesh`` (default: all local devices).

    Raises:
      ValueError: a model size is invalid; ``batch`` or ``window`` is not an int >= 1, ``seed`` not an int >= 0,
        or ``batch`` is not divisible by the mesh size.
    """
    seed = positive_int("seed", seed, minimum=0)  # before nnx.Rngs, whose error does not name it
    model = make_model(num_features, rngs=nnx.Rngs(seed), **model_kwargs)
    return make_benchmark_step(model, make_optimizer(model), batch=batch, window=window, seed=seed, mesh=mesh,
                               loss=loss_fn)
