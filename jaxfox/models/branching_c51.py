"""Branching C51 Q-network (BDQ dueling architecture with C51 atoms) and the jitted DQN update of issue 4.

Network (:class:`BranchingC51`, flax.nnx), for observations x [B, 48]:

    h1 = relu(x @ W1 + b1)                 [B, 256]
    h2 = relu(h1 @ W2 + b2)                [B, 128]
    value = h2 @ Wv + bv                   [B, N]             (state-value logits per atom)
    adv   = reshape(h2 @ Wa + ba)          [B, D, A, N]       (per-branch advantage logits)
    logits = jaxfox.branching_dueling_logits(value, adv)     [B, D, A, N] float32
           = value[:, None, None] + adv - mean_a adv          (Tavakoli et al. 2018 eq. 1, per atom)

Defaults: D = 3 branches (the three instruments of :class:`jaxfox.envs.Trading`), A = 5 position levels,
N = 51 atoms (Bellemare et al. 2017). The support is ``linspace(-v_max, v_max, N)`` (:func:`support`).

Reward scale and V_max (the default of :mod:`examples.train_dqn`): rewards are daily log returns times
``reward_scale = 100`` (percent). The daily reward of a +-1 position in all three instruments has a std of
about 1.2 + 1.6 + 2.4 percent (the instruments' daily log-return stds 2000-2012, upper bound with full
correlation ~5 %), and with the discount gamma = 0.9 the std of the discounted return is about
std(r) / sqrt(1 - gamma^2) ~ 2.3 std(r) ~ 7-12 %; ``v_max = 25`` covers that at 2-3 sigma with an atom
spacing dz = 1 % (returns beyond +-25 % are projected onto the end atoms).

Precision: master parameters are float32 (held as one flat buffer :class:`jaxfox.FlatParams`); the forward
pass (:func:`forward`) casts the flat buffer once with :func:`jaxfox.cast_bf16` (straight-through gradient:
d/dx of the cast is taken as the identity, the bfloat16 cotangent is widened to float32) and runs the trunk
matmuls in bfloat16; the two head matmuls take bfloat16 inputs and accumulate into float32
(``preferred_element_type``), and the dueling aggregation and the loss run in float32.

Agent pieces: :func:`init_agent` (online/target FlatParams, fused AdamW state, PER buffer with item storage),
:func:`make_update` (ONE jitted step: PER sample -> online/target forward -> categorical double-Q loss with
IS weights -> grad -> fused AdamW -> EMA target -> priority update), :func:`greedy_actions`,
:func:`epsilon_greedy`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxfox
from jaxfox import per
from jaxfox._validate import check_rngs, is_concrete, positive_int, real_scalar
from jaxfox.sharding import batch_axis, batch_mesh, check_divisible

__all__ = [
    "BranchingC51", "support", "forward", "q_values", "greedy_actions", "epsilon_greedy", "AgentState",
    "init_agent", "make_update", "Transition",
]


def _lecun(key, fan_in, fan_out):
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / float(np.sqrt(fan_in))  # weak: float32 under x64


class BranchingC51(nnx.Module):
    """Trunk 48 -> 256 -> 128 (ReLU), value head 128 -> N, advantage head 128 -> D*A*N (module docstring).

    Args:
      obs_dim: input features (48).  num_branches: D.  num_actions: A.  num_atoms: N (>= 2).
      hidden: trunk widths (256, 128).  rngs: ``nnx.Rngs`` (stream ``params``).

    Initialisation: LeCun-normal weights (std 1/sqrt(fan_in)), zero biases; the advantage head's weights are
    scaled by 0.1 so that initial logits are close to the shared value logits.

    Calling ``model(x)`` with x [B, obs_dim] returns logits [B, D, A, N] float32, computed in the dtype of
    the parameters (float32 as initialised; bfloat16 params, see :func:`forward`, give bfloat16 trunk
    matmuls with float32 head accumulation).

    Raises:
      ValueError: a size is not a positive int (N >= 2), ``hidden`` is not a pair of them; x is not
        [B, obs_dim] (on call).
      TypeError: x is not an array (on call).
    """

    def __init__(self, obs_dim: int = 48, num_branches: int = 3, num_actions: int = 5, num_atoms: int = 51,
                 hidden: tuple[int, int] = (256, 128), *, rngs: nnx.Rngs):
        check_rngs(rngs)
        if not isinstance(hidden, (tuple, list)) or len(hidden) != 2:
            raise ValueError(f"hidden must be a pair (h1, h2) of the two trunk widths, got {hidden!r}")
        for name, v, lo in (("obs_dim", obs_dim, 1), ("num_branches", num_branches, 1),
                            ("num_actions", num_actions, 1), ("num_atoms", num_atoms, 2),
                            ("hidden[0]", hidden[0], 1), ("hidden[1]", hidden[1], 1)):
            positive_int(name, v, lo)
        self.obs_dim, self.D, self.A, self.N = int(obs_dim), int(num_branches), int(num_actions), int(num_atoms)
        h1, h2 = hidden
        k = rngs.params
        self.w1 = nnx.Param(_lecun(k(), obs_dim, h1))
        self.b1 = nnx.Param(jnp.zeros((h1,), jnp.float32))
        self.w2 = nnx.Param(_lecun(k(), h1, h2))
        self.b2 = nnx.Param(jnp.zeros((h2,), jnp.float32))
        self.wv = nnx.Param(_lecun(k(), h2, num_atoms))
        self.bv = nnx.Param(jnp.zeros((num_atoms,), jnp.float32))
        self.wa = nnx.Param(0.1 * _lecun(k(), h2, num_branches * num_actions * num_atoms))
        self.ba = nnx.Param(jnp.zeros((num_branches * num_actions * num_atoms,), jnp.float32))

    def __call__(self, x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"x must be an array [B, obs_dim] = [?, {self.obs_dim}], got {type(x).__name__}")
        if len(x.shape) != 2 or x.shape[1] != self.obs_dim:
            raise ValueError(f"x must have shape [B, obs_dim] = [?, {self.obs_dim}], got {tuple(x.shape)}")
        return apply(nnx.state(self, nnx.Param), x, (self.D, self.A, self.N))


def apply(params, x, dan):
    """The network as a pure function of a params pytree (leaves w1, b1, w2, b2, wv, bv, wa, ba).

    x [B, F] is cast to the params' dtype; trunk in that dtype; heads accumulate in float32.
    Returns logits [B, D, A, N] float32.

    Raises:
      ValueError: x is not [B, F] with F the rows of params["w1"]; dan is not three ints (D, A, N) with
        D * A * N the columns of params["wa"] and N those of params["wv"]. The params record only D * A, so a dan
        with D and A swapped cannot be detected: pass the dan that :func:`init_agent` returned.
    """
    g = lambda name: params[name][...] if hasattr(params[name], "__getitem__") else params[name]  # noqa: E731
    w1, b1, w2, b2, wv, bv, wa, ba = (jnp.asarray(g(n)) for n in ("w1", "b1", "w2", "b2", "wv", "bv", "wa", "ba"))
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 2 or shape[1] != w1.shape[0]:
        raise ValueError(f"obs must have shape [B, F] = [?, {w1.shape[0]}] (F from the params), got "
                         f"{shape if hasattr(x, 'shape') else type(x).__name__}")
    if not (isinstance(dan, (tuple, list)) and len(dan) == 3 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in dan)
            and dan[0] * dan[1] * dan[2] == wa.shape[-1] and dan[2] == wv.shape[-1]):
        raise ValueError(f"dan must be (D, A, N), ints with D * A * N = {wa.shape[-1]} and N = {wv.shape[-1]} "
                         f"(the params' advantage and value heads), got {dan!r}")
    D, A, N = (int(v) for v in dan)
    dt = w1.dtype
    h = jax.nn.relu(jnp.dot(x.astype(dt), w1) + b1)
    h = jax.nn.relu(jnp.dot(h, w2) + b2)
    f32 = jnp.float32
    value = jnp.dot(h, wv, preferred_element_type=f32) + bv.astype(f32)
    adv = (jnp.dot(h, wa, preferred_element_type=f32) + ba.astype(f32)).reshape(x.shape[0], D, A, N)
    return jaxfox.branching_dueling_logits(value, adv)


def support(num_atoms: int = 51, v_max: float = 25.0):
    """z [N] float32 = linspace(-v_max, v_max, N) (module docstring for the choice of v_max).

    Raises:
      ValueError: ``num_atoms`` is not an int >= 2 (the network's N), or ``v_max`` is not finite and > 0, or above
        float32's max / 2 (the span 2 v_max must be a finite float32, as :func:`jaxfox.categorical_double_q_loss`
        requires).
      TypeError: ``v_max`` is not a real scalar (bools are refused; NumPy scalars and 0-d arrays are accepted).
    """
    num_atoms = positive_int("num_atoms", num_atoms, 2)
    v_max = real_scalar("v_max", v_max, 0.0, lo_open=True, traced=False)
    if not v_max <= float(np.finfo(np.float32).max) / 2:  # 1e39 is inf in float32: a support of NaN
        raise ValueError(f"v_max must be at most float32's max / 2 (about 1.7e38: the support's span 2 v_max must be "
                         f"a finite float32), got {v_max!r}")
    return jnp.linspace(-v_max, v_max, num_atoms, dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
@jax.custom_vjp
def _cast_bf16_st(x):
    return jaxfox.cast_bf16(x)


def _cast_fwd(x):
    return jaxfox.cast_bf16(x), None


def _cast_bwd(_, g):
    return (g.astype(jnp.float32),)


_cast_bf16_st.defvjp(_cast_fwd, _cast_bwd)


def _bf16_tree(fp: jaxfox.FlatParams):
    """One cast of the flat float32 buffer to bfloat16, then the pytree view as bfloat16 slices."""
    flat = _cast_bf16_st(fp.flat)
    lay = fp.layout
    leaves, off = [], 0
    for shape, n in zip(lay.shapes, lay.sizes):
        leaves.append(flat[off:off + n].reshape(shape))
        off += n
    return jax.tree.unflatten(lay.treedef, leaves)


def forward(fp: jaxfox.FlatParams, obs, dan, *, bf16: bool = True):
    """Logits [B, D, A, N] float32 of obs [B, F] under master params ``fp`` (float32 FlatParams).

    bf16=True: the forward weights are ``cast_bf16(fp.flat)`` (straight-through gradient to the float32
    master buffer); bf16=False: float32 throughout.

    Raises:
      ValueError: obs is not [B, F] or dan does not match the params (:func:`apply`).
      TypeError: fp is not a :class:`jaxfox.FlatParams` (e.g. the params tree itself: use :func:`apply`).
    """
    if not isinstance(fp, jaxfox.FlatParams):
        raise TypeError(f"fp must be a jaxfox.FlatParams (the agent's online or target params), got "
                        f"{type(fp).__name__}; a params tree goes to apply()")
    tree = _bf16_tree(fp) if bf16 else fp.tree
    return apply(tree, obs, dan)


def q_values(logits, z):
    """Q [B, D, A] float32 = sum_i z_i softmax(logits)_i.

    Raises:
      ValueError: z is not [N] with N = logits' last axis (a length-1 z would broadcast to the same Q for
        every action).
      TypeError: logits is not an array.
    """
    if not (hasattr(logits, "shape") and hasattr(logits, "dtype")):
        raise TypeError(f"logits must be an array [..., N], got {type(logits).__name__}")
    n = logits.shape[-1] if len(logits.shape) else None
    if tuple(np.shape(z)) != (n,):
        raise ValueError(f"z must have shape [N] = [{n}] (N from the logits' last axis), got {tuple(np.shape(z))}")
    return jnp.sum(jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * z, axis=-1)


def greedy_actions(fp, obs, dan, z, *, bf16=True):
    """argmax_a Q per branch: [B, D] int32 (ties -> first index).

    Raises:
      ValueError: obs is not [B, F], dan does not match the params (:func:`apply`), z is not [N].
    """
    return jnp.argmax(q_values(forward(fp, obs, dan, bf16=bf16), z), axis=-1).astype(jnp.int32)


def epsilon_greedy(key, fp, obs, dan, z, epsilon, *, bf16=True):
    """Per branch independently: a uniform random action with probability epsilon, else greedy. [B, D] int32.

    Raises:
      TypeError: epsilon is not a real scalar (a bool, a non-numeric value or array).
      ValueError: epsilon is an array of shape other than [], or a concrete epsilon is not in [0, 1] (a traced
        one, e.g. a schedule under jit, is not checked); as :func:`greedy_actions`.
    """
    real_scalar("epsilon", epsilon, 0.0, 1.0)
    greedy = greedy_actions(fp, obs, dan, z, bf16=bf16)
    k1, k2 = jax.random.split(key)
    rand = jax.random.randint(k1, greedy.shape, 0, dan[1], dtype=jnp.int32)
    explore = jax.random.uniform(k2, greedy.shape) < epsilon
    return jnp.where(explore, rand, greedy)


# ----------------------------------------------------------------------------------------------
class Transition(NamedTuple):
    """One replay item: obs [F] f32, action [D] int32, reward [] f32 (scaled), discount [] f32, next_obs [F] f32."""

    obs: Any
    action: Any
    reward: Any
    discount: Any
    next_obs: Any


class AgentState(NamedTuple):
    """online, target: FlatParams (float32 master); opt: FusedAdamWState; buffer: PERState with Transition items;
    step: [] int32 updates done."""

    online: Any
    target: Any
    opt: Any
    buffer: Any
    step: Any


def init_agent(key, *, obs_dim=48, num_branches=3, num_actions=5, num_atoms=51, capacity=2 ** 17,
               lr=1e-4, weight_decay=1e-4, max_grad_norm=10.0):
    """Builds (AgentState, optimizer, dan) with a fresh network; target = online copy; empty PER buffer.

    Args:
      key: a ``jax.random`` key (the network's initialisation).
      obs_dim: F, observation width; num_branches: D action branches; num_actions: A actions a branch;
        num_atoms: N atoms of each return distribution (the network: :class:`BranchingC51`).
      capacity: replay slots (:func:`jaxfox.per.init`; items are :class:`Transition` of float32 obs [F],
        int32 action [D], float32 reward, discount and next_obs).
      lr, weight_decay, max_grad_norm: :func:`jaxfox.fused_adamw`'s learning rate, decoupled weight decay and
        global-norm clip.

    Returns:
      ``(state, opt, dan)``: an :class:`AgentState` (step 0), the optimizer for :func:`make_update`, and
      ``dan = (D, A, N)``.

    Raises:
      ValueError / TypeError: from :class:`BranchingC51` (sizes not ints >= 1; num_atoms >= 2),
        :func:`jaxfox.per.init` (capacity) or :func:`jaxfox.fused_adamw` (lr, weight_decay, max_grad_norm not
        finite and >= 0; ``lr`` is named ``learning_rate`` there), each naming the argument.
    """
    model = BranchingC51(obs_dim, num_branches, num_actions, num_atoms, rngs=nnx.Rngs(key))
    params = {k: v[...] for k, v in nnx.state(model, nnx.Param).items()}
    online = jaxfox.FlatParams.from_tree(params)
    target = jaxfox.FlatParams(jnp.copy(online.flat), online.layout)
    opt = jaxfox.fused_adamw(lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    spec = Transition(jax.ShapeDtypeStruct((obs_dim,), jnp.float32),
                      jax.ShapeDtypeStruct((num_branches,), jnp.int32),
                      jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32),
                      jax.ShapeDtypeStruct((obs_dim,), jnp.float32))
    buf = per.init(capacity, spec)
    state = AgentState(online, target, opt.init(online), buf, jnp.zeros((), jnp.int32))
    return state, opt, (num_branches, num_actions, num_atoms)


def batch_loss(online, target, batch: Transition, weights, dan, z, *, bf16=True):
    """(mean_b w_b loss_b, loss [B]) of the categorical double-Q loss on a batch (gradients into online)."""
    logits_tm1 = forward(online, batch.obs, dan, bf16=bf16)
    logits_t_online = jax.lax.stop_gradient(forward(online, batch.next_obs, dan, bf16=bf16))
    logits_t_target = jax.lax.stop_gradient(forward(target, batch.next_obs, dan, bf16=bf16))
    loss = jaxfox.categorical_double_q_loss(logits_tm1, batch.action, batch.reward, batch.discount,
                                            logits_t_target, logits_t_online, z)
    return jnp.mean(weights * loss), loss


def make_update(opt, dan, z, *, batch_size=1024, alpha=0.5, tau=0.005, priority_eps=1e-3, bf16=True, mesh=None):
    """The full DQN update as ONE pure function ``update(state, key, beta) -> (state, info)``; jit it.

    ``state``: an :class:`AgentState` (from :func:`init_agent`); ``key``: a ``jax.random`` key (the PER draw);
    ``beta``: the importance-weight exponent in [0, 1] (a float or a 0-d array, e.g. a
    :func:`jaxfox.per.beta_schedule` value; checked when concrete, as ``alpha`` and ``tau`` are here).

    Steps: (idx, w) = per.sample(buffer, key, B, alpha, beta); batch = per.sample_items(buffer, idx);
    loss = mean(w * categorical_double_q_loss(...)) with online (bf16 forward) and target logits; grads by
    autodiff into the float32 master buffer; fused AdamW (``opt.step`` when the optimizer has it, else
    ``opt.update`` + ``optax.apply_updates``); target <- ema_update(target, online, tau)
    (tau = weight of the online params); priorities of the sampled slots <- loss_b + priority_eps.
    info = {"loss": weighted mean loss, "loss_unweighted": mean loss_b, "indices": [B] sampled slots,
    "loss_b": [B] per-sample loss}.

    An empty replay buffer (size 0) has nothing to learn from: called with a concrete state, ``update`` raises;
    under jit (a traced size) it returns the state unchanged (optimizer count, EMA, priorities included) and
    info with NaN losses, instead of an AdamW step on zero-weight placeholder items.

    Data parallel over ``mesh`` (default: all local devices, :func:`jaxfox.sharding.batch_mesh`; the batch is split
    over :func:`jaxfox.sharding.batch_axis`: the only axis of a one-axis mesh, else "batch"): the whole update runs
    in one ``jax.shard_map`` in which every device holds the whole (replicated) agent state and draws the same B
    indices; device i then computes the loss and gradient of rows [i B / N, (i + 1) B / N) only, and exactly one
    collective follows: an all-reduce of the gradient, the loss and the per-sample losses [B] (each device
    contributes its rows, zeros elsewhere), which the priority update needs. The optimizer, EMA and priority
    updates then run identically on every device, so the state stays replicated. No observation is gathered: each
    device reads its rows from its own copy.

    Raises:
      ValueError: ``batch_size`` is not an int >= 1 or not divisible by the number of devices on the batch axis,
        ``priority_eps`` is not finite and >= 0 (under jit a negative priority would be stored as 0, so
        the slot would never be sampled again), ``alpha`` is not finite and >= 0, ``tau`` is not in [0, 1], or
        the mesh has several axes and none is named "batch"; ``update`` called on a concrete empty buffer or
        with a concrete ``beta`` outside [0, 1] (or NaN: inside the update's ``shard_map`` it is traced, where
        :func:`jaxfox.per.sample` cannot check it, and a NaN beta made the parameters NaN).
      TypeError: ``priority_eps``, ``alpha`` or ``tau`` is not a real scalar (a bool, a string; ``priority_eps``
        traced), or ``beta`` is not a real scalar.
    """
    batch_size = positive_int("batch_size", batch_size)
    priority_eps = real_scalar("priority_eps", priority_eps, 0.0, traced=False)
    real_scalar("alpha", alpha, 0.0)
    real_scalar("tau", tau, 0.0, 1.0)
    mesh = batch_mesh() if mesh is None else mesh
    axis = batch_axis(mesh)
    check_divisible("batch_size", batch_size, mesh, axis_name=axis)
    n_dev = mesh.shape[axis]
    local = batch_size // n_dev

    def body(state: AgentState, key, beta):
        idx, w = per.sample(state.buffer, key, batch_size, alpha=alpha, beta=beta)
        start = jax.lax.axis_index(axis) * local
        idx_l = jax.lax.dynamic_slice_in_dim(idx, start, local)
        w_l = jax.lax.dynamic_slice_in_dim(w, start, local)
        batch = per.sample_items(state.buffer, idx_l)
        (lw, loss_l), grads = jax.value_and_grad(
            lambda p: batch_loss(p, state.target, batch, w_l, dan, z, bf16=bf16), has_aux=True)(state.online)
        # ONE all-reduce carries the gradient, the loss and the per-sample losses: each device writes its
        # rows' losses into a zero [B] vector, and the sum over devices is the whole batch's [B] losses.
        loss_rows = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((batch_size,), loss_l.dtype), loss_l, start, 0)
        grads, lw, loss_b = jax.lax.psum((grads, lw, loss_rows), axis)
        grads = jax.tree.map(lambda g: g / n_dev, grads)
        lw = lw / n_dev
        if hasattr(opt, "step"):  # jaxfox.fused_adamw: update + apply in one call (one kernel when opted in)
            online, opt_state = opt.step(grads, state.opt, state.online)
        else:
            updates, opt_state = opt.update(grads, state.opt, state.online)
            online = optax.apply_updates(state.online, updates)
        target = jaxfox.ema_update(state.target, online, tau)
        buf = per.update(state.buffer, idx, loss_b + priority_eps)
        new = AgentState(online, target, opt_state, buf, state.step + 1)
        info = {"loss": lw, "loss_unweighted": jnp.mean(loss_b), "indices": idx, "loss_b": loss_b}
        # An empty buffer (traced size 0): per.sample gave placeholder slots of weight 0; keep the old state.
        empty = state.buffer.size == 0
        # (leaves the update passes through, the buffer's items, are not selected: no copy of the buffer)
        new = jax.tree.map(lambda old, upd: upd if upd is old else jnp.where(empty, old, upd), state, new)
        info = {k: jnp.where(empty, jnp.nan, v) if k != "indices" else v for k, v in info.items()}
        return new, info

    # check_vma=False: everything but the rows is replicated by construction (same inputs, same key, and the
    # gradient and losses made identical by the collectives above).
    sharded = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)

    def update(state: AgentState, key, beta):
        real_scalar("beta", beta, 0.0, 1.0)
        if is_concrete(state.buffer.size) and int(np.asarray(state.buffer.size)) == 0:
            raise ValueError("update: the replay buffer is empty (state.buffer.size == 0); add transitions first")
        return sharded(state, key, beta)

    return update
