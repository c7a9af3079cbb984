"""The auxiliary trainers of the stack (issue 5), functional, and their one-jitted-step update.

Three independent trainers run beside the DQN step. Each has its own parameters, optimizer
(:func:`jaxfox.fused_adamw`, decay on weight matrices only) and step function, so it can be timed alone;
:func:`AuxTrainers.aux_step` runs all of them in ONE function (jit it) with no data dependence between
them, so that XLA can run them concurrently on the GPU (with
:func:`jaxfox.enable_concurrent_command_buffers`, see :mod:`jaxfox.concurrency`).

* **IQL value pair** (Kostrikov et al. 2021): G = 2 value networks of identical shapes
  ``F -> hidden... -> 1`` (ReLU; 256 -> 128 -> 1 in the issue's benchmark) with expectiles (0.7, 0.9),
  each trained with ``mean_b expectile_loss(q_b - V_g(s_b), tau_g)`` (:func:`jaxfox.expectile_loss`), where
  q is the target value of the data action (in ``examples/train_aux.py``: the DQN target network's
  Q(s, a_data), averaged over branches). With ``iql_impl="fused"`` (default) the losses of all G networks
  and their parameter gradients are :func:`jaxfox.iql_value_loss` (one hidden layer: one GEMM for every first
  layer, one kernel for the rest, by default for hidden widths >= 128, else with ``JAXFOX_OPT_IN_KERNELS=iql``;
  deeper networks fall back to "vmap"). With ``iql_impl="grouped"`` every layer of BOTH
  networks is ONE :func:`jaxfox.grouped_matmul_stacked` call (groups = networks, stacked weights, the
  first layer's shared input passed once; forward and backward grouped; ``"grouped_list"`` uses the list
  form :func:`jaxfox.grouped_matmul`);
  ``iql_impl="vmap"`` is the pure-JAX baseline (``jax.vmap`` over the stacked weights: batched GEMMs).
  Parameters are stacked, ``{"w": [W_l [G, in, out]], "b": [b_l [G, out]]}``.
* **IQN head** (Dabney et al. 2018): the return distribution of the state under the data (behaviour)
  policy, Z_tau(s) = f(psi(s) (.) phi(tau)) with psi(s) = ReLU(s W_s + b_s) [B, H],
  phi(tau) = ReLU(quantile_embedding(tau, n_cos) W_phi + b_phi) [B, N, H] (IQN eq. 4) and
  f = Linear(H, H) -> ReLU -> Linear(H, 1). Loss :func:`jaxfox.quantile_huber_loss` between N online
  quantiles at tau ~ U[0, 1) and N' target samples r + discount * Z_target(s', tau'), tau' ~ U[0, 1),
  from an EMA target network (:func:`jaxfox.ema_update`, weight ``target_tau`` on the online params). The online
  head and its loss are :func:`jaxfox.iqn_quantile_huber_loss` (one fused kernel for the loss and its gradient),
  the target head :func:`jaxfox.iqn_head`.
* **Attention trainer**: :func:`jaxfox.attention_pool` over a sequence [B, T, H] followed by a linear
  head H -> 1, mean squared error against a scalar target y [B] (in the example: the scaled reward of
  the transition from the window of the last T observations).

Batch layout (a dict; each trainer has its OWN input arrays, even when the data are the same: XLA
treats every operand of a custom call as possibly written, so a buffer shared by an FFI call of one
trainer and ops of another can serialise them; separate buffers leave the trainers independent)::

    {"iql":  {"obs": [B, F] f32, "q": [B] f32},
     "iqn":  {"obs": [B, F] f32, "reward": [B] f32, "discount": [B] f32, "next_obs": [B, F] f32},
     "attn": {"seq": [B, T, H] f32, "y": [B] f32}}

State: :class:`AuxState` of three :class:`TrainerState` (params, opt state, target params or None,
PRNG key or None, step count).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfox
from jaxfox._validate import check_key, in_open_unit_float32, positive_int, real_scalar
from jaxfox.losses import _huber_kappa

__all__ = ["AuxConfig", "TrainerState", "AuxState", "AuxTrainers", "make_aux", "iql_init", "iql_values",
           "iqn_init", "iqn_quantiles", "attention_init", "attention_predict", "synthetic_batch"]


class AuxConfig(NamedTuple):
    """Sizes and hyperparameters of the auxiliary trainers.

    obs_dim: F, state features of IQL and IQN.  iql_hidden: hidden widths of each IQL value network
    (F -> *iql_hidden -> 1).  expectiles: one tau per IQL network (G = len, all in (0, 1)).
    iql_impl: "fused" (the losses and their gradient by :func:`jaxfox.iql_value_loss`; networks with one
    hidden layer, else as "vmap"), "grouped" (one grouped_matmul_stacked per layer for all G networks),
    "grouped_list" (one list-form grouped_matmul per layer) or "vmap" (the batched-GEMM baseline).
    iqn_hidden: H of the IQN head.  n_quantiles: N online samples.  n_target_quantiles: N'.
    n_cos: cosine features.  kappa: Huber threshold.  seq_len, seq_dim, num_heads: the attention
    trainer's T, H and heads.  lr, weight_decay, max_grad_norm: fused AdamW of every trainer.
    target_tau: EMA weight of the online params in the IQN target update.
    """

    obs_dim: int = 256
    iql_hidden: tuple = (128,)
    expectiles: tuple = (0.7, 0.9)
    iql_impl: str = "fused"
    iqn_hidden: int = 128
    n_quantiles: int = 32
    n_target_quantiles: int = 32
    n_cos: int = 64
    kappa: float = 1.0
    seq_len: int = 16
    seq_dim: int = 64
    num_heads: int = 4
    lr: float = 3e-4
    weight_decay: float = 1e-4
    max_grad_norm: float | None = 10.0
    target_tau: float = 0.005


class TrainerState(NamedTuple):
    """params: pytree; opt: FusedAdamWState; target: pytree or None; key: PRNG key or None; step: [] int32."""

    params: Any
    opt: Any
    target: Any
    key: Any
    step: Any


class AuxState(NamedTuple):
    """The three trainers' states."""

    iql: TrainerState
    iqn: TrainerState
    attn: TrainerState


def _check_config(cfg: AuxConfig):
    if not isinstance(cfg, AuxConfig):  # a dict failed with "'dict' object has no attribute '_replace'"
        raise TypeError(f"config must be a jaxfox.models.aux.AuxConfig, got {type(cfg).__name__}")
    for name in ("obs_dim", "iqn_hidden", "n_quantiles", "n_target_quantiles", "n_cos", "seq_len", "seq_dim",
                 "num_heads"):
        positive_int(f"config.{name}", getattr(cfg, name))
    if not isinstance(cfg.iql_hidden, (tuple, list)):
        raise ValueError(f"config.iql_hidden must be a tuple of ints >= 1 (the hidden widths), "
                         f"got {cfg.iql_hidden!r}")
    for i, h in enumerate(cfg.iql_hidden):
        positive_int(f"config.iql_hidden[{i}]", h)
    if not isinstance(cfg.expectiles, (tuple, list)) or len(cfg.expectiles) < 1 or not all(
            isinstance(t, (int, float, np.floating)) and not isinstance(t, bool) and in_open_unit_float32(t)
            for t in cfg.expectiles):
        raise ValueError(f"config.expectiles must be a non-empty tuple of floats in (0, 1) (also when rounded to "
                         f"float32, and not subnormal there), got {cfg.expectiles!r}")
    if cfg.iql_impl not in ("fused", "grouped", "grouped_list", "vmap"):
        raise ValueError(f"config.iql_impl must be 'fused', 'grouped', 'grouped_list' or 'vmap', got {cfg.iql_impl!r}")
    if cfg.seq_dim % cfg.num_heads:
        raise ValueError(f"config.num_heads={cfg.num_heads} must divide config.seq_dim={cfg.seq_dim}")

    for name, lo, hi, lo_open in (("target_tau", 0.0, 1.0, False), ("kappa", 0.0, None, True), ("lr", 0.0, None, False),
                                  ("weight_decay", 0.0, None, False), ("max_grad_norm", 0.0, None, False)):
        v = getattr(cfg, name)
        if name == "kappa":  # as the IQN loss checks it (jaxfox.losses._huber_kappa)
            _huber_kappa(v, "config.kappa")
        elif not (name == "max_grad_norm" and v is None):
            real_scalar(f"config.{name}", v, lo, hi, lo_open=lo_open, traced=False)


def _check_batch(trainer, batch, spec):
    """Shapes of a trainer's batch (trace time): spec {key: dims}, dims of ints, "B" (the rows of the first key)
    or another name (any size). A [B, 1] label would broadcast against the [B] predictions into a [B, B] loss."""
    B = None
    for key, dims in spec.items():
        x = batch[key]
        shape = tuple(x.shape) if hasattr(x, "shape") else None
        if B is None and shape:
            B = shape[0]
        want = [B if d == "B" else None if isinstance(d, str) else d for d in dims]
        if shape is None or len(shape) != len(dims) or any(w is not None and w != n for w, n in zip(want, shape)):
            names = ", ".join(str(d) for d in dims)
            sizes = ", ".join("?" if w is None else str(w) for w in want)
            raise ValueError(f"{trainer} batch[{key!r}] must have shape [{names}] = [{sizes}], got "
                             f"{shape if shape is not None else type(x).__name__}")
        if x.dtype != jnp.float32:  # an integer reward or discount was accepted and promoted silently
            raise TypeError(f"{trainer} batch[{key!r}] must be float32, got {x.dtype}")


def _dense(key, fan_in, fan_out, lead=()):
    """He-normal weights (ReLU nets), std sqrt(2 / fan_in)."""
    # a Python float scale (weakly typed): an np.float64 one made the weights float64 under jax_enable_x64
    return jax.random.normal(key, (*lead, fan_in, fan_out), jnp.float32) * float(np.sqrt(2.0 / fan_in))


def _decay_mask(params):
    """Decay the weight matrices (leaves under a key starting with 'w' and with ndim >= 2), not biases."""
    def is_w(path, leaf):
        name = next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), "")
        return str(name).startswith("w") and np.ndim(leaf) >= 2

    return jax.tree_util.tree_map_with_path(is_w, params)


# ----------------------------------------------------------------------------------------------
# IQL value pair.
def iql_init(key, obs_dim, hidden=(128,), num_networks=2):
    """Stacked params of G value networks obs_dim -> *hidden -> 1: ``{"w": [[G, in, out]...], "b": [[G, out]...]}``.

    He-normal weights, zero biases; each network gets its own random weights. float32.

    Raises:
      ValueError: obs_dim, a hidden width or num_networks is not an int >= 1, hidden is not a tuple/list, or key
        is a batch of keys.
      TypeError: key is not a jax.random key.
    """
    check_key(key, "iql_init: ")
    obs_dim = positive_int("obs_dim", obs_dim)
    if not isinstance(hidden, (tuple, list)):
        raise ValueError(f"hidden must be a tuple of ints >= 1 (the hidden widths), got {hidden!r}")
    hidden = [positive_int(f"hidden[{i}]", h) for i, h in enumerate(hidden)]
    num_networks = positive_int("num_networks", num_networks)
    widths = (obs_dim, *hidden, 1)
    keys = jax.random.split(key, len(widths) - 1)
    return {"w": [_dense(k, a, b, (num_networks,)) for k, a, b in zip(keys, widths[:-1], widths[1:])],
            "b": [jnp.zeros((num_networks, b), jnp.float32) for b in widths[1:]]}


def iql_values(params, obs, impl="grouped"):
    """V_g(s) of the G networks: obs [B, F] float32 -> [B, G] float32.

    impl "grouped": every layer is ONE ``jaxfox.grouped_matmul_stacked`` call over the G networks (stacked
    weights, no slicing copies; the first layer's groups share obs). impl "grouped_list": the same with the
    list form ``jaxfox.grouped_matmul`` (weights sliced per network). impl "vmap": ``jax.vmap`` over the
    stacked weights (batched GEMMs), the pure-JAX baseline.
    """
    ws, bs = params["w"], params["b"]
    G = ws[0].shape[0]
    if obs.ndim != 2 or obs.shape[1] != ws[0].shape[1]:
        raise ValueError(f"obs must have shape [B, F] = [?, {ws[0].shape[1]}], got {tuple(obs.shape)}")
    L = len(ws)
    if impl == "grouped":
        h = obs
        for l in range(L):
            h = jaxfox.grouped_matmul_stacked(h, ws[l], bs[l])                        # [G, B, out]
            h = h if l == L - 1 else jax.nn.relu(h)
        return h[:, :, 0].T
    if impl == "grouped_list":
        hs = [obs] * G
        for l in range(L):
            ys = jaxfox.grouped_matmul(hs, [ws[l][g] for g in range(G)], [bs[l][g] for g in range(G)])
            hs = ys if l == L - 1 else [jax.nn.relu(y) for y in ys]
        return jnp.concatenate(hs, axis=1)
    if impl == "vmap":
        def one(w_list, b_list):
            h = obs
            for l in range(L):
                h = jnp.dot(h, w_list[l]) + b_list[l]
                h = h if l == L - 1 else jax.nn.relu(h)
            return h[:, 0]

        return jax.vmap(one, out_axes=1)(ws, bs)
    raise ValueError(f"impl must be 'grouped', 'grouped_list' or 'vmap', got {impl!r}")


def iql_loss(params, batch, expectiles, impl="fused"):
    """(sum_g mean_b expectile_loss(q - V_g, tau_g), per-network losses [G])."""
    if impl == "fused" and len(params["w"]) == 2:
        per_net = jaxfox.iql_value_loss(params, batch["obs"], batch["q"], tuple(expectiles))
        return jnp.sum(per_net), per_net
    v = iql_values(params, batch["obs"], "vmap" if impl == "fused" else impl)
    u = batch["q"][:, None] - v
    per_net = jnp.mean(jaxfox.expectile_loss(u, jnp.asarray(expectiles, jnp.float32)), axis=0)
    return jnp.sum(per_net), per_net


# ----------------------------------------------------------------------------------------------
# IQN head.
def iqn_init(key, obs_dim, hidden=128, n_cos=64):
    """IQN head params: w_s [F, H], b_s [H], w_phi [n_cos, H], b_phi [H], w_h [H, H], b_h [H], w_out [H, 1], b_out [1].

    He-normal weights (w_out scaled by 0.1), zero biases, float32. F = obs_dim, H = hidden.

    Raises:
      ValueError: obs_dim, hidden or n_cos is not an int >= 1, or key is a batch of keys.
      TypeError: key is not a jax.random key.
    """
    check_key(key, "iqn_init: ")
    obs_dim = positive_int("obs_dim", obs_dim)
    H = positive_int("hidden", hidden)
    n_cos = positive_int("n_cos", n_cos)
    k = jax.random.split(key, 4)
    return {"w_s": _dense(k[0], obs_dim, H), "b_s": jnp.zeros((H,), jnp.float32),
            "w_phi": _dense(k[1], n_cos, H), "b_phi": jnp.zeros((H,), jnp.float32),
            "w_h": _dense(k[2], H, H), "b_h": jnp.zeros((H,), jnp.float32),
            "w_out": _dense(k[3], H, 1) * 0.1, "b_out": jnp.zeros((1,), jnp.float32)}


def iqn_quantiles(params, obs, taus, n_cos=64):
    """Z_tau(s): obs [B, F], taus [B, N] -> [B, N] float32 (module docstring for the network).

    psi(s) is one XLA matmul; the rest is :func:`jaxfox.iqn_head` (fused kernels on CUDA, which never
    write the [B, N, H] activations).

    Raises:
      ValueError: n_cos does not match ``params["w_phi"]``; obs is not [B, F] with F the rows of
        ``params["w_s"]`` (taus are checked by :func:`jaxfox.iqn_head`).
    """
    if params["w_phi"].shape[0] != n_cos:
        raise ValueError(f"n_cos={n_cos} does not match params['w_phi'] of shape {tuple(params['w_phi'].shape)}")
    F = params["w_s"].shape[0]
    if getattr(obs, "ndim", None) != 2 or obs.shape[1] != F:
        raise ValueError(f"obs must have shape [B, F] = [?, {F}] (F from params['w_s']), got "
                         f"{tuple(obs.shape) if hasattr(obs, 'shape') else type(obs).__name__}")
    return jaxfox.iqn_head(*_head_and_psi(params, obs), taus)


def _head_and_psi(params, obs):
    """The iqn_head parameters and psi(s) = ReLU(s W_s + b_s) [B, H] (one XLA matmul)."""
    psi = jax.nn.relu(obs @ params["w_s"] + params["b_s"])
    return {k: params[k] for k in ("w_phi", "b_phi", "w_h", "b_h", "w_out", "b_out")}, psi


def iqn_loss(params, target, batch, key, cfg: AuxConfig):
    B = batch["obs"].shape[0]
    k1, k2 = jax.random.split(key)
    taus = jax.random.uniform(k1, (B, cfg.n_quantiles), jnp.float32)
    taus_t = jax.random.uniform(k2, (B, cfg.n_target_quantiles), jnp.float32)
    z_next = iqn_quantiles(target, batch["next_obs"], taus_t, cfg.n_cos)
    y = jax.lax.stop_gradient(batch["reward"][:, None] + batch["discount"][:, None] * z_next)
    # = quantile_huber_loss(iqn_quantiles(params, obs, taus), taus, y, kappa); on CUDA its gradient is ONE kernel
    # launch (no separate forward for z)
    return jaxfox.iqn_quantile_huber_loss(*_head_and_psi(params, batch["obs"]), taus, y, cfg.kappa)


# ----------------------------------------------------------------------------------------------
# Attention trainer.
def attention_init(key, seq_dim, num_heads=4):
    """{"pool": attention_pool_init(H, num_heads), "w": [H, 1], "b": [1]}."""
    check_key(key, "attention_init: ")
    k1, k2 = jax.random.split(key)
    return {"pool": jaxfox.attention_pool_init(k1, seq_dim, num_heads=num_heads),
            "w": _dense(k2, seq_dim, 1) * 0.5, "b": jnp.zeros((1,), jnp.float32)}


def attention_predict(params, seq, num_heads=4):
    """seq [B, T, H] -> prediction [B] float32 (attention pool, then linear head)."""
    pooled, _ = jaxfox.attention_pool(params["pool"], seq, num_heads=num_heads)
    return (pooled @ params["w"] + params["b"])[:, 0]


def attention_loss(params, batch, num_heads=4):
    err = attention_predict(params, batch["seq"], num_heads) - batch["y"]
    return jnp.mean(err * err)


# ----------------------------------------------------------------------------------------------
class AuxTrainers(NamedTuple):
    """What :func:`make_aux` returns: pure functions (jit them; ``aux_step`` is the one jitted step).

    init(key) -> AuxState.
    iql_step / iqn_step / attention_step(trainer_state, trainer_batch) -> (trainer_state, info):
      one trainer alone (``batch["iql"]`` etc.).
    aux_step(state, batch) -> (state, info): all three, independent (concurrent on the GPU).
    aux_step_sequential(state, batch) -> (state, info): the same, but each trainer's first input element
      depends (through ``+ 0 * loss``) on the previous trainer's loss, so they cannot overlap -- the
      "in sequence" baseline of the benchmark.
    info: {"iql": total, "iql_per_net": [G], "iqn": loss, "attn": loss} (float32 scalars).
    """

    config: AuxConfig
    init: Callable
    iql_step: Callable
    iqn_step: Callable
    attention_step: Callable
    aux_step: Callable
    aux_step_sequential: Callable


def make_aux(config: AuxConfig | None = None, **overrides) -> AuxTrainers:
    """Builds the auxiliary trainers of ``config`` (fields can be overridden by keyword).

    Raises:
      ValueError: a config field out of range (message names the field).
      TypeError: config is not an :class:`AuxConfig` (or None), or a number field (target_tau, kappa, lr,
        weight_decay, max_grad_norm) is not a real scalar.
    """
    cfg = AuxConfig() if config is None else config
    if isinstance(cfg, AuxConfig):
        cfg = cfg._replace(**overrides)
    _check_config(cfg)
    taus = tuple(float(t) for t in cfg.expectiles)
    G = len(taus)

    def opt_for(params):
        return jaxfox.fused_adamw(cfg.lr, weight_decay=cfg.weight_decay, mask=_decay_mask(params),
                                  max_grad_norm=cfg.max_grad_norm)

    def init(key) -> AuxState:
        k_iql, k_iqn, k_attn, k_rng = jax.random.split(key, 4)
        p_iql = iql_init(k_iql, cfg.obs_dim, cfg.iql_hidden, G)
        p_iqn = iqn_init(k_iqn, cfg.obs_dim, cfg.iqn_hidden, cfg.n_cos)
        p_attn = attention_init(k_attn, cfg.seq_dim, cfg.num_heads)
        zero = jnp.zeros((), jnp.int32)
        return AuxState(
            TrainerState(p_iql, opt_for(p_iql).init(p_iql), None, None, zero),
            TrainerState(p_iqn, opt_for(p_iqn).init(p_iqn), jax.tree.map(jnp.copy, p_iqn), k_rng, zero),
            TrainerState(p_attn, opt_for(p_attn).init(p_attn), None, None, zero))

    def apply(ts: TrainerState, grads):
        updates, opt = opt_for(ts.params).update(grads, ts.opt, ts.params)
        return optax.apply_updates(ts.params, updates), opt

    def iql_step(ts: TrainerState, batch):
        _check_batch("iql", batch, {"obs": ("B", cfg.obs_dim), "q": ("B",)})
        (loss, per_net), g = jax.value_and_grad(
            lambda p: iql_loss(p, batch, taus, cfg.iql_impl), has_aux=True)(ts.params)
        params, opt = apply(ts, g)
        return ts._replace(params=params, opt=opt, step=ts.step + 1), {"iql": loss, "iql_per_net": per_net}

    def iqn_step(ts: TrainerState, batch):
        _check_batch("iqn", batch, {"obs": ("B", cfg.obs_dim), "reward": ("B",), "discount": ("B",),
                                    "next_obs": ("B", cfg.obs_dim)})
        key, k = jax.random.split(ts.key)
        loss, g = jax.value_and_grad(lambda p: iqn_loss(p, ts.target, batch, k, cfg))(ts.params)
        params, opt = apply(ts, g)
        target = jaxfox.ema_update(ts.target, params, cfg.target_tau)
        return TrainerState(params, opt, target, key, ts.step + 1), {"iqn": loss}

    def attention_step(ts: TrainerState, batch):
        _check_batch("attn", batch, {"seq": ("B", "T", cfg.seq_dim), "y": ("B",)})
        loss, g = jax.value_and_grad(lambda p: attention_loss(p, batch, cfg.num_heads))(ts.params)
        params, opt = apply(ts, g)
        return ts._replace(params=params, opt=opt, step=ts.step + 1), {"attn": loss}

    def aux_step(state: AuxState, batch):
        s1, i1 = iql_step(state.iql, batch["iql"])
        s2, i2 = iqn_step(state.iqn, batch["iqn"])
        s3, i3 = attention_step(state.attn, batch["attn"])
        return AuxState(s1, s2, s3), {**i1, **i2, **i3}

    def _after(batch, loss):
        """batch with its first leaf's first element + 0 * loss (a data dependency, value unchanged)."""
        leaves, tree = jax.tree.flatten(batch)
        first = leaves[0]
        c = jnp.nan_to_num(loss * 0.0, nan=0.0, posinf=0.0, neginf=0.0).astype(first.dtype)
        idx = (0,) * first.ndim
        leaves[0] = first.at[idx].add(c)
        return jax.tree.unflatten(tree, leaves)

    def aux_step_sequential(state: AuxState, batch):
        s1, i1 = iql_step(state.iql, batch["iql"])
        s2, i2 = iqn_step(state.iqn, _after(batch["iqn"], i1["iql"]))
        s3, i3 = attention_step(state.attn, _after(batch["attn"], i2["iqn"]))
        return AuxState(s1, s2, s3), {**i1, **i2, **i3}

    return AuxTrainers(cfg, init, iql_step, iqn_step, attention_step, aux_step, aux_step_sequential)


def synthetic_batch(key, config: AuxConfig, batch_size: int):
    """A learnable synthetic batch in the layout of the module docstring (tests, benchmarks).

    iql: q = 2 tanh(obs[:, 0]) + 0.5 obs[:, 1]^2 - 0.5 + 0.3 noise; iqn: reward = obs[:, 0] + 0.5 noise,
    discount 0.9, next_obs = independent normal; attn: y = mean_t seq[:, t, 0] * 3 + 0.1 noise. float32.

    Raises:
      ValueError: batch_size is not an int >= 1, config.obs_dim < 2 (q reads obs[:, 1]; JAX would clamp the index
        to obs[:, 0] and give another q than the formula), or the config is invalid (as :func:`make_aux`).
      TypeError: config is not an :class:`AuxConfig`.
    """
    cfg = config
    _check_config(cfg)
    if cfg.obs_dim < 2:
        raise ValueError(f"config.obs_dim must be >= 2 for synthetic_batch (q reads obs[:, 1]), got {cfg.obs_dim}")
    B, F, T, H = positive_int("batch_size", batch_size), cfg.obs_dim, cfg.seq_len, cfg.seq_dim
    k = jax.random.split(key, 8)
    n = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32)  # noqa: E731
    obs = n(k[0], (B, F))
    q = 2.0 * jnp.tanh(obs[:, 0]) + 0.5 * obs[:, 1] ** 2 - 0.5 + 0.3 * n(k[1], (B,))
    obs2 = n(k[2], (B, F))
    seq = n(k[4], (B, T, H))
    return {
        "iql": {"obs": obs, "q": q},
        "iqn": {"obs": jnp.copy(obs2), "reward": obs2[:, 0] + 0.5 * n(k[3], (B,)),
                "discount": jnp.full((B,), 0.9, jnp.float32), "next_obs": n(k[5], (B, F))},
        "attn": {"seq": seq, "y": 3.0 * jnp.mean(seq[:, :, 0], axis=1) + 0.1 * n(k[6], (B,))},
    }
