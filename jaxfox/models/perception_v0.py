"""Perception model v0: per-variable linear embedding -> CfC (:class:`jaxfox.nn.CfC`) -> last state -> logit.

    x [B, T, m]  (m scalar features per day, z-scored)
    e[b, t, j, :] = x[b, t, j] * embed_w[j] + embed_b[j]            [B, T, m, d]   (one d-vector per variable)
    z = reshape(e, [B, T, m * d])                                     CfC input, I = m * d
    (optional, proj_size = P: z = z @ proj_w + proj_b                 CfC input, I = P)
    hs = cfc_scan(z, ts)                                              [B, T, H]
    logit = hs[:, -1] @ head_w + head_b                               [B]

Trained with binary cross-entropy on the logit (``optax.sigmoid_binary_cross_entropy``) and AdamW
(``optax.adamw``, global-norm gradient clipping first). The per-variable embedding is the input stage of
the Temporal Fusion Transformer (Lim et al. 2021, variable selection networks: "linear transformations for
continuous variables"); issue 3 replaces the flatten with a variable selection network and the last-state read-out
with attention pooling and a GRN head.

Training-loop pieces: :func:`make_model`, :func:`make_optimizer`, :func:`loss_fn`, :func:`train_step`
(``nnx.jit``, updates model and optimizer in place), :func:`train_epoch` (a whole epoch of steps in one
compiled call), :func:`predict_logits`, :func:`evaluate`, and
:func:`benchmark_step` (a pure ``(state, batch) -> (state, loss)`` function for ``jaxfox.bench``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxfox._validate import check_rngs, positive_int
from jaxfox.nn import CfC, Optimizer
from jaxfox.optim import fused_adamw
from jaxfox.sharding import batch_mesh, batch_sharding, check_divisible, data_parallel_value_and_grad

__all__ = [
    "DEFAULTS", "PerceptionV0", "make_model", "make_optimizer", "loss_fn", "train_step", "predict_logits", "evaluate",
    "benchmark_step", "make_benchmark_step", "data_parallel_step", "train_epoch", "data_parallel_epoch",
    "check_epoch_args",
]


DEFAULTS = {"hidden": 32, "embed_dim": 2, "backbone_units": 64, "lr": 1e-3, "weight_decay": 1.0}
"""Defaults of :func:`make_model` / :func:`make_optimizer`, the main job's ``--model v0`` and
:func:`benchmark_step`: chosen by validation AUC (2013-2015) of the main job (examples/train_perception.py
--model v0, with its input noise 0.6, 15 epochs, batch 32) over 6 seeds; larger models (H = 64, d = 4,
U = 128) and lower rates scored lower on validation."""


def check_window_batch(x, num_features: int | None, rows: str = "B") -> None:
    """Checks windows x [rows, T, m]: ValueError unless 3-D with m = num_features (any m when None) and T >= 1 (the
    models read the last state hs[:, -1]), TypeError unless float32. ``rows`` names the leading axis in the message
    ("B" for a batch, "N" for a data set)."""
    if not hasattr(x, "shape") or len(x.shape) != 3 or (num_features is not None and x.shape[-1] != num_features):
        raise ValueError(f"x must have shape [{rows}, T, {'m' if num_features is None else num_features}], "
                         f"got {getattr(x, 'shape', type(x))}")
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one time step (T >= 1: the model reads the last CfC state), got "
                         f"shape {tuple(x.shape)}")
    if x.dtype != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")


def _check_labels(y, n, rows: str) -> None:
    """y must be [n] float32, one label per window (a [n, 1] y would broadcast the BCE to [n, n])."""
    if not hasattr(y, "shape") or tuple(y.shape) != (n,):
        raise ValueError(f"y must have shape [{rows}] = [{n}] (one label per window of x), got "
                         f"{getattr(y, 'shape', type(y))}")
    if y.dtype != jnp.float32:
        raise TypeError(f"y must be float32, got {y.dtype}")


def _check_windows_and_labels(x, y, num_features: int | None, rows: str = "B") -> None:
    """:func:`check_window_batch` for x, then :func:`_check_labels` for y against x's leading size: x first, since y's
    expected size is read off it (a bad x was reported as a bad y, sized off the wrong axis)."""
    check_window_batch(x, num_features, rows=rows)
    _check_labels(y, x.shape[0], rows)


def _map_padded_chunks(fn, x: np.ndarray, batch_size: int) -> tuple[np.ndarray, ...]:
    """``fn`` (jitted: x chunk [batch_size, ...] -> tuple of [batch_size, ...] arrays) over x [N, ...] in chunks of
    ``batch_size`` rows, the last one zero-padded so that any N reuses one compilation; the outputs' rows
    concatenated as NumPy arrays ([N, ...] each, the padding rows dropped). N = 0 runs one all-padding chunk, so that
    the empty outputs have fn's trailing shapes and dtypes (jax.eval_shape cannot trace an nnx model's call)."""
    parts = []
    for i in range(0, max(x.shape[0], 1), batch_size):
        chunk = x[i:i + batch_size]
        k = chunk.shape[0]
        if k < batch_size:
            chunk = np.concatenate([chunk, np.zeros((batch_size - k, *chunk.shape[1:]), chunk.dtype)])
        parts.append(tuple(np.asarray(o)[:k] for o in fn(jnp.asarray(chunk))))
    return tuple(np.concatenate(cols) for cols in zip(*parts))


class PerceptionV0(nnx.Module):
    """Embedding -> CfC -> last state -> linear head (module docstring for the equations).

    Args:
      num_features: m, scalar features per time step.
      embed_dim: d, width of each variable's embedding (CfC input I = m * d).
      proj_size: None (the flattened embeddings are the CfC input) or P: a linear projection
        [m * d] -> [P] (``nnx.Linear``) in between, CfC input I = P.
      hidden: H, CfC state size.  backbone_units / backbone_layers / mode: passed to :class:`jaxfox.nn.CfC`.
      rngs: ``nnx.Rngs`` (stream ``params``).

    Initialisation: ``embed_w`` ~ N(0, 1) (a linear map with fan-in 1, LeCun-normal), ``embed_b`` = 0;
    CfC as ncps; head ``nnx.Linear`` defaults (LeCun-normal kernel, zero bias).

    Raises:
      ValueError: num_features, embed_dim, hidden or proj_size is not an int >= 1; backbone_units, backbone_layers
        or mode invalid (as :func:`jaxfox.cfc_init`).
    """

    def __init__(self, num_features: int, *, embed_dim: int = DEFAULTS["embed_dim"], hidden: int = DEFAULTS["hidden"],
                 backbone_units: int = DEFAULTS["backbone_units"],
                 backbone_layers: int = 1, mode: str = "default", proj_size: int | None = None, rngs: nnx.Rngs):
        check_rngs(rngs)
        for name, v in (("num_features", num_features), ("embed_dim", embed_dim), ("hidden", hidden),
                        ("proj_size", 1 if proj_size is None else proj_size)):
            positive_int(name, v)
        self.num_features = int(num_features)
        self.embed_dim = int(embed_dim)
        self.embed_w = nnx.Param(jax.random.normal(rngs.params(), (num_features, embed_dim), jnp.float32))
        self.embed_b = nnx.Param(jnp.zeros((num_features, embed_dim), jnp.float32))
        flat = num_features * embed_dim
        self.proj = None if proj_size is None else nnx.Linear(flat, proj_size, rngs=rngs)
        self.cfc = CfC(flat if proj_size is None else proj_size, hidden, backbone_units=backbone_units,
                       backbone_layers=backbone_layers, mode=mode, rngs=rngs)
        self.head = nnx.Linear(hidden, 1, rngs=rngs)

    def embed(self, x):
        """x [B, T, m] -> CfC input [B, T, m * d] (or [B, T, P] with a projection)."""
        e = x[..., None] * self.embed_w[...] + self.embed_b[...]
        z = e.reshape(*x.shape[:-1], self.num_features * self.embed_dim)
        return z if self.proj is None else self.proj(z)

    def __call__(self, x, ts=1.0):
        """x [B, T, m] float32 (ts: elapsed bars per step, see :func:`jaxfox.cfc_scan`) -> logits [B] float32.

        Raises:
          ValueError: x is not [B, T, m] with m = num_features and T >= 1.  TypeError: x is not float32.
        """
        check_window_batch(x, self.num_features)
        hs = self.cfc(self.embed(x), ts)
        return self.head(hs[:, -1])[:, 0]


def make_model(num_features: int, *, hidden: int = DEFAULTS["hidden"], embed_dim: int = DEFAULTS["embed_dim"],
               backbone_units: int = DEFAULTS["backbone_units"], backbone_layers: int = 1, mode: str = "default",
               proj_size: int | None = None, rngs: nnx.Rngs) -> PerceptionV0:
    """A :class:`PerceptionV0` for ``num_features`` inputs (keyword arguments and errors as the class)."""
    return PerceptionV0(num_features, embed_dim=embed_dim, hidden=hidden, backbone_units=backbone_units,
                        backbone_layers=backbone_layers, mode=mode, proj_size=proj_size, rngs=rngs)


def make_optimizer(model: nnx.Module, *, lr: float = DEFAULTS["lr"], weight_decay: float = DEFAULTS["weight_decay"],
                   clip_norm: float = 1.0) -> Optimizer:
    """Optimizer over the model's ``nnx.Param``s: clip by global norm (Pascanu et al. 2013), then AdamW
    (Loshchilov & Hutter 2019; b1 0.9, b2 0.999, eps 1e-8, bias-corrected, every parameter decayed):
    :func:`jaxfox.fused_adamw` with ``flatten_moments=True`` in a :class:`jaxfox.nn.Optimizer`.

    The math and the operations of the reference path are those of ``optax.flatten(optax.chain(
    optax.clip_by_global_norm(clip_norm), optax.adamw(lr, weight_decay=weight_decay)))``: the gradient and
    parameter trees are raveled into one float32 vector [P] (P = number of parameters) before the clip and
    AdamW, so XLA fuses the norm and the moment updates into a few kernels over one buffer instead of one set
    of tiny kernels per parameter leaf (GPU profile, BENCHMARKS.md "sixth session": the per-leaf chain cost
    ~127 us of the ~946 us full-model training step on the H200, in ~82 launches); the update is then split
    back into the leaves and added to each, one XLA kernel per leaf. On a GPU with the kernels, the whole step
    (norm, moments, update and apply on every leaf) is the fused kernel of ``ffi/optim.cu`` instead
    (:meth:`jaxfox.optim.FusedAdamW.step`), reading each leaf in place.

    State (``optimizer.opt_state``): a :class:`jaxfox.optim.FusedAdamWState` ``(count, mu, nu)`` whose moments are
    :class:`jaxfox.FlatParams` [P] float32, in the order of ``jax.tree.leaves`` of ``nnx.state(model, nnx.Param)``.
    """
    tx = fused_adamw(lr, weight_decay=weight_decay, mask=True, max_grad_norm=clip_norm, flatten_moments=True)
    return Optimizer(model, tx, wrt=nnx.Param)


def _check_model(model, fn: str, cls: type, whose: str, other: str, other_fn: str) -> None:
    """TypeError unless ``model`` is a ``cls``: the training functions of one perception model fail deep inside, or
    (B = 2) silently compute a wrong loss, on the other (v0's call returns logits, the full model's (logits,
    weights)); when it is the ``other`` model, the message names ``other_fn``, the function to use for it."""
    if not isinstance(model, cls):
        hint = f"; for jaxfox.models.{other} use {other_fn}" if type(model).__name__ == other else ""
        raise TypeError(f"{fn}: model must be a jaxfox.models.{cls.__name__} (these are {whose} training functions), "
                        f"got {type(model).__name__}{hint}")


def _check_v0(model, fn: str) -> None:
    """:func:`_check_model` for ``jaxfox.models.train_step`` and its siblings (model v0's)."""
    full = {"predict_logits": "predict"}.get(fn, fn)
    _check_model(model, fn, PerceptionV0, "model v0's", "Perception", f"jaxfox.models.perception.{full}")


def loss_fn(model: PerceptionV0, x, y):
    """Mean binary cross-entropy of ``model(x)`` logits [B] against labels y [B] in {0, 1} (float32).

    Raises:
      TypeError: model is not a :class:`PerceptionV0` (the full model's is :func:`jaxfox.models.perception.loss_fn`),
        or x or y is not float32.
      ValueError: x is not [B, T, m] with m = ``model.num_features`` and T >= 1 (checked first); y is not [B] (one
        label per window of x; a [B, 1] y would broadcast the BCE to [B, B]).
    """
    _check_v0(model, "loss_fn")
    _check_windows_and_labels(x, y, model.num_features)
    return optax.sigmoid_binary_cross_entropy(model(x), y).mean()


def data_parallel_step(model: nnx.Module, optimizer: nnx.Optimizer, x, y, mesh=None, loss=None):
    """One optimizer step, data parallel over ``mesh`` (default: all local devices); call it inside ``nnx.jit``.

    Every device computes ``loss(model, x_shard, y_shard)`` (a batch mean) and its gradient on batch / N rows
    (``jaxfox.sharding.data_parallel_value_and_grad``: one all-reduce of the loss and of the gradient, no
    gather of the batch); the averaged gradient updates ``model`` and ``optimizer`` in place, identically on
    every device. Returns the global mean loss before the update. ``loss`` defaults to :func:`loss_fn`.

    Raises:
      ValueError: x is not [B, T, m] (m = ``model.num_features``) with T >= 1 (checked first); y is not [B] (one label
        per window of x; a [B, 1] y would broadcast the BCE to [B, B]), or the batch (x's leading axis) is not
        divisible by the number of devices in ``mesh``.
      TypeError: x or y is not float32.
    """
    _check_windows_and_labels(x, y, getattr(model, "num_features", None))
    loss = loss_fn if loss is None else loss
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def local(params, rest, x, y):
        return loss(nnx.merge(graphdef, params, rest), x, y)

    value, grads = data_parallel_value_and_grad(local, mesh, batch_argnums=(2, 3))(params, rest, x, y)
    optimizer.update(model, grads)
    return value


@nnx.jit(static_argnames=("mesh",))
def train_step(model: PerceptionV0, optimizer: nnx.Optimizer, x, y, *, mesh=None):
    """One AdamW step on a batch x [B, T, m], y [B]; updates ``model`` and ``optimizer`` in place.

    Data parallel over ``mesh`` (a ``jax.sharding.Mesh``; default: all local devices,
    :func:`jaxfox.sharding.batch_mesh`; the batch is split over :func:`jaxfox.sharding.batch_axis`), see
    :func:`data_parallel_step`. Returns the batch's mean BCE before the update (float32 scalar).

    Raises:
      ValueError: B is not divisible by the number of devices in the mesh; x is not [B, T, m] (m =
        ``model.num_features``, T >= 1) or y not [B] (as :func:`loss_fn`).
      TypeError: model is not a :class:`PerceptionV0` (the full model's is :func:`jaxfox.models.perception.train_step`);
        x or y is not float32.
    """
    _check_v0(model, "train_step")
    return data_parallel_step(model, optimizer, x, y, mesh)


def check_epoch_args(model: nnx.Module, x, y, key, *, batch_size, input_noise, mesh=None) -> tuple[int, float]:
    """Checks the arguments of :func:`train_epoch` / :func:`data_parallel_epoch` (works on concrete arrays and
    on tracers: it reads shapes and dtypes only) and returns ``(batch_size, input_noise)`` as a Python int and
    float (so that equal values hit the same compiled epoch).

    Raises:
      TypeError: batch_size is not an int (bools are refused), input_noise is not a real number, x or y is
        not float32, key is not a ``jax.random`` key.
      ValueError: batch_size < 1, input_noise < 0 or not finite, x is not [N, T, m] (m = ``model.num_features``
        when the model has it), y is not [N], N < batch_size, key is not a single key, or batch_size is not
        divisible by the number of devices of ``mesh``'s batch axis (default mesh: all local devices).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__} {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(input_noise, bool) or not isinstance(input_noise, (int, float, np.integer, np.floating)):
        raise TypeError(f"input_noise must be a Python float (a static argument: one compilation per value), got "
                        f"{type(input_noise).__name__} {input_noise!r}")
    if not (np.isfinite(input_noise) and input_noise >= 0):
        raise ValueError(f"input_noise must be a finite std >= 0, got {input_noise!r}")
    _check_windows_and_labels(x, y, getattr(model, "num_features", None), rows="N")
    n = x.shape[0]
    if n < batch_size:
        raise ValueError(f"x: an epoch needs at least batch_size={batch_size} windows, got {n}")
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if tuple(shape) != ():
            raise ValueError(f"key must be a single jax.random key (shape ()), got a key array of shape {shape}")
    elif not (dtype == jnp.uint32 and len(shape) == 1):  # a raw key of jax.random.PRNGKey(seed)
        raise TypeError(f"key must be a jax.random key (jax.random.key(seed)), got {type(key).__name__}"
                        + ("" if dtype is None else f" {dtype}{list(shape)}"))
    check_divisible("batch_size", int(batch_size), batch_mesh() if mesh is None else mesh)
    return int(batch_size), float(input_noise)


def data_parallel_epoch(model: nnx.Module, optimizer: nnx.Optimizer, x, y, key, *, batch_size: int,
                        input_noise: float = 0.0, mesh=None, loss=None):
    """One pass over x [N, T, m], y [N] in ``N // batch_size`` optimizer steps, as one ``lax.scan``; call it
    inside ``nnx.jit`` (see :func:`train_epoch`).

    The windows are visited in the order of ``jax.random.permutation`` (the last ``N % batch_size`` of the
    permutation are left out this epoch); each batch gets i.i.d. Gaussian input noise of standard deviation
    ``input_noise`` (0: none) drawn from ``key``; each step is :func:`data_parallel_step`. Updates ``model``
    and ``optimizer`` in place and returns the steps' losses [N // batch_size] float32.

    Raises:
      what :func:`check_epoch_args` raises, at trace time.
    """
    batch_size, input_noise = check_epoch_args(model, x, y, key, batch_size=batch_size, input_noise=input_noise,
                                               mesh=mesh)
    n = x.shape[0]
    steps = n // batch_size
    k_perm, k_noise = jax.random.split(key)
    order = jax.random.permutation(k_perm, n)[:steps * batch_size].reshape(steps, batch_size)
    graphdef, state = nnx.split((model, optimizer))

    def body(state, step):
        idx, k = step
        model, optimizer = nnx.merge(graphdef, state)
        xb = jnp.take(x, idx, axis=0)
        if input_noise:
            xb = xb + jnp.asarray(input_noise, xb.dtype) * jax.random.normal(k, xb.shape, xb.dtype)
        value = data_parallel_step(model, optimizer, xb, jnp.take(y, idx, axis=0), mesh, loss=loss)
        return nnx.state((model, optimizer)), value

    state, losses = jax.lax.scan(body, state, (order, jax.random.split(k_noise, steps)))
    nnx.update((model, optimizer), state)
    return losses


@nnx.jit(static_argnames=("batch_size", "input_noise", "mesh", "loss"))
def _jit_epoch(model, optimizer, x, y, key, *, batch_size, input_noise, mesh, loss):
    return data_parallel_epoch(model, optimizer, x, y, key, batch_size=batch_size, input_noise=input_noise,
                               mesh=mesh, loss=loss)


def _run_epoch(model, optimizer, x, y, key, *, batch_size, input_noise, mesh, loss):
    """:func:`check_epoch_args`, then the state of (model, optimizer) replicated on the mesh, then the compiled
    epoch. The placement is what the compiled epoch returns the state as (replicated over the mesh), so every
    epoch, the first included, sees the same input shardings: without it the second call compiled again."""
    batch_size, input_noise = check_epoch_args(model, x, y, key, batch_size=batch_size, input_noise=input_noise,
                                               mesh=mesh)
    replicated = NamedSharding(batch_mesh() if mesh is None else mesh, PartitionSpec())
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))  # no copy once there
    return _jit_epoch(model, optimizer, x, y, key, batch_size=batch_size, input_noise=input_noise, mesh=mesh,
                      loss=loss)


def train_epoch(model: PerceptionV0, optimizer: nnx.Optimizer, x, y, key, *, batch_size: int,
                input_noise: float = 0.0, mesh=None):
    """One epoch of :func:`train_step`s on the device, in one compiled call (a ``lax.scan`` over the steps,
    batches gathered on the device), so that the host does not dispatch every step. Updates ``model`` and
    ``optimizer`` in place (their state is first placed replicated on ``mesh``).

    Args:
      x: [N, T, m] float32 windows (m = ``model.num_features``); y: [N] float32 labels in {0, 1}. Best a
        ``jax.Array`` made once (``jnp.asarray``): a NumPy array is copied to the device at every call.
      key: a ``jax.random`` key (``jax.random.key(seed)``; a raw ``jax.random.PRNGKey`` works too, compiled
        apart): the epoch's order (``jax.random.permutation`` over N; its last ``N % batch_size`` windows are
        left out) and its input noise (:func:`data_parallel_epoch`).
      batch_size: windows per step (static: one compilation per value), divisible by the mesh's devices.
      input_noise: std of the i.i.d. Gaussian noise added to each batch's x (0: none; static).
      mesh: as :func:`train_step` (default: all local devices).

    Returns:
      the steps' batch-mean BCE losses [N // batch_size] float32, each before its update.

    Raises:
      TypeError / ValueError naming the argument, before anything runs: see :func:`check_epoch_args`; TypeError:
        model is not a :class:`PerceptionV0` (the full model's is :func:`jaxfox.models.perception.train_epoch`).
    """
    _check_v0(model, "train_epoch")
    return _run_epoch(model, optimizer, x, y, key, batch_size=batch_size, input_noise=input_noise, mesh=mesh,
                      loss=loss_fn)


@nnx.jit
def _logits(model, x):
    return model(x)


def predict_logits(model: PerceptionV0, x, *, batch_size: int = 256) -> np.ndarray:
    """Logits [N] (NumPy float32) for x [N, T, m], in fixed-size chunks (the last one zero-padded) so that
    any N reuses one compiled function.

    Raises:
      ValueError: ``batch_size`` is not an int >= 1; x is not [N, T, m] (m = ``model.num_features``) with T >= 1.
      TypeError: model is not a :class:`PerceptionV0` (the full model's is :func:`jaxfox.models.perception.predict`).
    """
    _check_v0(model, "predict_logits")
    batch_size = positive_int("batch_size", batch_size)  # a negative one made range() skip every window
    x = np.asarray(x, np.float32)
    # checked on the whole x: the model sees only zero-padded chunks (an error would report the chunk's shape),
    # and none at all when N = 0
    check_window_batch(x, model.num_features, rows="N")
    (logits,) = _map_padded_chunks(lambda c: (_logits(model, c),), x, batch_size)
    return logits


def evaluate(model: PerceptionV0, x, y, *, batch_size: int = 256) -> tuple[float, float]:
    """(mean BCE, ROC AUC) of the model on x [N, T, m], y [N] (AUC by :func:`jaxfox.data.market.auc`).

    Raises:
      ValueError: y is not [N] (a [N, 1] y would broadcast the BCE to [N, N] and report a wrong loss), as
        :func:`predict_logits`, and as :func:`jaxfox.data.market.auc` (y not 0/1 labels of both classes).
      TypeError: model is not a :class:`PerceptionV0` (the full model's is :func:`jaxfox.models.perception.evaluate`).
    """
    from jaxfox.data.market import auc

    _check_v0(model, "evaluate")
    x = np.asarray(x, np.float32)
    check_window_batch(x, model.num_features, rows="N")  # before y, whose expected size is read off x
    y = np.asarray(y, np.float32)
    _check_labels(y, len(x), "N")
    logits = predict_logits(model, x, batch_size=batch_size)
    loss = float(np.asarray(optax.sigmoid_binary_cross_entropy(jnp.asarray(logits), jnp.asarray(y)).mean()))
    return loss, auc(logits, y)


def benchmark_step(batch: int = 32, window: int = 64, num_features: int = 48, *, hidden: int = DEFAULTS["hidden"],
                   embed_dim: int = DEFAULTS["embed_dim"], backbone_units: int = DEFAULTS["backbone_units"],
                   seed: int = 0, mesh=None):
    """A whole training step as a pure function, for the benchmark harness (which jits and loops it).

    The model and optimizer are the main job's ``--model v0`` (:data:`DEFAULTS`); the main job also adds input
    noise to each batch on the host, which is not part of this step. The step is data parallel over ``mesh``
    (default: all local devices; see :func:`data_parallel_step`): the batch is placed split over the mesh's
    batch axis (:func:`jaxfox.sharding.batch_axis`) and the state replicated, so ``batch`` is the global batch
    (divisible by the mesh size).

    Returns:
      ``(step_fn, state, batch)``: ``step_fn(state, batch) -> (state, loss)`` is un-jitted and pure;
      ``state`` is the ``nnx.State`` of (model, optimizer) (a pytree of arrays); ``batch`` is
      ``(x [batch, window, num_features] float32 ~ N(0, 1), y [batch] float32 in {0, 1})``.

    Raises:
      ValueError: ``batch`` or ``window`` is not an int >= 1, ``seed`` not an int >= 0, ``batch`` not divisible by
        the mesh size, or a model size invalid (as :class:`PerceptionV0`).
    """
    seed = positive_int("seed", seed, minimum=0)  # before nnx.Rngs, whose error does not name it
    rngs = nnx.Rngs(seed)
    model = make_model(num_features, hidden=hidden, embed_dim=embed_dim, backbone_units=backbone_units, rngs=rngs)
    return make_benchmark_step(model, make_optimizer(model), batch=batch, window=window, seed=seed, mesh=mesh)


def make_benchmark_step(model, optimizer: nnx.Optimizer, *, batch: int, window: int, seed: int = 0, mesh=None,
                        loss=None):
    """``(step_fn, state, batch)`` of :func:`benchmark_step` for any perception model and its optimizer
    (``loss(model, x, y)``, default this module's :func:`loss_fn`; the model's input width is read from
    ``model.num_features``); the errors of :func:`benchmark_step` for ``batch``, ``window`` and ``seed``, raised
    before anything is built (a negative batch failed in MLIR, a float window in ``jax.random.normal``)."""
    batch, window = positive_int("batch", batch), positive_int("window", window)
    seed = positive_int("seed", seed, minimum=0)
    graphdef, state = nnx.split((model, optimizer))
    kx, ky = jax.random.split(jax.random.key(seed + 1))
    data = (jax.random.normal(kx, (batch, window, model.num_features), jnp.float32),
            jax.random.bernoulli(ky, 0.5, (batch,)).astype(jnp.float32))
    mesh = batch_mesh() if mesh is None else mesh
    check_divisible("batch", batch, mesh)
    data = jax.device_put(data, batch_sharding(mesh))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

    def step_fn(state, batch):
        model, optimizer = nnx.merge(graphdef, state, copy=True)  # copy: never mutate the caller's state
        value = data_parallel_step(model, optimizer, *batch, mesh, loss=loss)
        return nnx.state((model, optimizer)), value

    return step_fn, state, data
