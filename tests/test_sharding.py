"""Data parallelism (issue 6) on 4 and 8 forced host CPU devices (conftest.py forces 8).

* every batch-parallel op under ``jax.shard_map`` over the batch and under ``jax.jit`` with
  NamedSharding inputs: equal to the one-device result, and no all-gather in the compiled HLO;
* ``data_parallel_value_and_grad``: loss and gradient equal the one-device ones up to rounding,
  bitwise repeatable for a fixed device count, errors for an indivisible batch;
* the perception and DQN training steps over meshes of 1, 4 and 8 devices: the same losses and
  parameters after a few steps (up to float32 reduction order), and no gather of the batch.

On a machine with several GPUs the same checks with the CUDA kernels are in test_gpu_sharding.py.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfox
from jaxfox.sharding import batch_mesh, batch_sharding, data_parallel_value_and_grad

from conftest import rel_err


def _mesh(n):
    assert len(jax.devices()) >= 8, "conftest.py should force 8 host devices"
    return batch_mesh(jax.devices()[:n])


def _all_gathers(compiled_text):
    """The result shapes of every all-gather in an HLO module's text, e.g. ['f32[64]']."""
    return re.findall(r"=\s*(\w+\[[\d,]*\])[^=]*?\ball-gather(?:-start)?\(", compiled_text)


# ----------------------------------------------------------------------------------------------
# Ops: (name, make(B) -> (fn(params, *batch) -> pytree of outputs, params, batch tuple)).
def _cfc(B):
    params = jaxfox.cfc_init(jax.random.key(0), 5, 8, backbone_units=16)
    xs = jax.random.normal(jax.random.key(1), (B, 6, 5))
    return (lambda p, x: jaxfox.cfc_scan(p, x)), params, (xs,)


def _attention(B):
    params = jaxfox.attention_pool_init(jax.random.key(2), 8, num_heads=4)  # d u is [H n] = [32]: not 16 or 4
    hs = jax.random.normal(jax.random.key(3), (B, 6, 8))
    mask = jax.random.bernoulli(jax.random.key(4), 0.7, (B, 6))
    return (lambda p, h, m: jaxfox.attention_pool(p, h, m)), params, (hs, mask)


def _grn(B):
    params = jaxfox.grn_init(jax.random.key(5), 6, 8, 4)
    a = jax.random.normal(jax.random.key(6), (B, 6))
    return (lambda p, a: jaxfox.grn(p, a)), params, (a,)


def _vsn(B):
    params = jaxfox.vsn_init(jax.random.key(7), 3, 4, 8, 8)
    xs = jax.random.normal(jax.random.key(8), (B, 3, 4))
    return (lambda p, x: jaxfox.vsn(p, x)), params, (xs,)


def _c51(B):
    D, A, N = 2, 3, 11
    k = jax.random.split(jax.random.key(9), 6)
    batch = (jax.random.normal(k[0], (B, D, A, N)), jax.random.randint(k[1], (B, D), 0, A),
             jax.random.normal(k[2], (B,)), jnp.full((B,), 0.9), jax.random.normal(k[3], (B, D, A, N)),
             jax.random.normal(k[4], (B, D, A, N)))
    z = jnp.linspace(-5.0, 5.0, N)
    return (lambda z, *b: jaxfox.categorical_double_q_loss(*b, z)), z, batch


OPS = {"cfc_scan": _cfc, "attention_pool": _attention, "grn": _grn, "vsn": _vsn,
       "categorical_double_q_loss": _c51}


def _loss(fn):
    def loss(p, *batch):
        out = fn(p, *batch)
        return sum(jnp.mean(jnp.tanh(leaf.astype(jnp.float32)) ** 2) for leaf in jax.tree.leaves(out))

    return loss


def _grad_argnums(name, batch):
    # differentiate w.r.t. params and every float batch input (not masks, actions or the C51 targets)
    if name == "categorical_double_q_loss":
        return (1,)
    return (0,) + tuple(i + 1 for i, b in enumerate(batch) if jnp.issubdtype(b.dtype, jnp.floating))


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_under_shard_map(name, n):
    fn, params, batch = OPS[name](2 * n)
    mesh = _mesh(n)
    argnums = _grad_argnums(name, batch)
    loss = _loss(fn)
    out1 = jax.jit(fn)(params, *batch)
    g1 = jax.jit(jax.grad(loss, argnums=argnums))(params, *batch)

    def body(p, *b):
        pv = jax.lax.pcast(p, "batch", to="varying")
        g = jax.grad(loss, argnums=argnums)(pv, *b)
        # the loss is a batch mean: average the shard's parameter gradient, rescale the input gradients
        g = tuple(jax.lax.pmean(gi, "batch") if i == 0 else jax.tree.map(lambda t: t / n, gi)
                  for i, gi in zip(argnums, g))
        return fn(pv, *b), g

    specs = (P(),) + (P("batch"),) * len(batch)
    g_specs = tuple(P() if i == 0 else P("batch") for i in argnums)
    out, g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("batch"), g_specs)))(params, *batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out1)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
        assert rel_err(a, b) <= 2e-5, name


def _typed_mesh(n, axis_type):
    return jax.make_mesh((n,), ("batch",), axis_types=(axis_type,), devices=jax.devices()[:n])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_with_named_sharding_inputs(name, axis_type):
    """jax.jit over batch-sharded NamedSharding inputs: outputs stay batch-sharded, values and gradients
    equal the one-device ones, and the compiled program gathers nothing. (Explicit axes: the op runs
    under shard_map, see jaxfox._ffi.dispatch; Auto axes: XLA's partitioner splits the reference path.)"""
    n = 4
    fn, params, batch = OPS[name](4 * n)
    mesh = _typed_mesh(n, axis_type)
    argnums = _grad_argnums(name, batch)
    f = jax.jit(lambda p, *b: (fn(p, *b), jax.grad(_loss(fn), argnums=argnums)(p, *b)))
    ref = f(params, *batch)
    sharded = jax.device_put(batch, batch_sharding(mesh))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    out = f(replicated, *sharded)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5, atol=2e-6)
    first_out = jax.tree.leaves(out[0])[0]
    assert first_out.sharding.spec[:1] == P("batch")[:1] or first_out.sharding.is_equivalent_to(
        batch_sharding(mesh), first_out.ndim), first_out.sharding
    hlo = f.lower(replicated, *sharded).compile().as_text()
    assert _all_gathers(hlo) == [], _all_gathers(hlo)


@pytest.mark.parametrize("name", ["cfc_scan", "attention_pool", "categorical_double_q_loss"])
def test_kernel_path_lowers_per_shard_under_explicit_sharding(name, monkeypatch):
    """The CUDA lowering (made here without a GPU, kernels forced on) of an op on Explicit batch-sharded
    inputs: the FFI calls see the local batch (B / 4 rows) inside one shard_map and nothing is gathered."""
    import jaxfox._ffi
    import jaxfox.cfc

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setattr(jaxfox.cfc, "_kernel_hidden_limit", lambda: 256)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "all")  # attention_pool's kernel is opt-in
    fn, params, batch = OPS[name](16)
    mesh = _typed_mesh(4, AxisType.Explicit)
    argnums = _grad_argnums(name, batch)
    f = jax.jit(lambda p, *b: (fn(p, *b), jax.grad(_loss(fn), argnums=argnums)(p, *b)))
    sharded = jax.device_put(batch, batch_sharding(mesh))
    text = f.trace(jax.device_put(params, NamedSharding(mesh, P())), *sharded).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(jaxfox_\w+)\((.*)", text)
    assert calls, "no jaxfox FFI call in the CUDA lowering"
    for target, rest in calls:  # the global batch is 16 rows, a shard 4 (no other dimension is 16 or 4)
        signature = rest.split(" : (")[-1]
        assert "tensor<4x" in signature and "tensor<16x" not in signature, (target, signature)
    assert "all_gather" not in text and "sdy.manual_computation" in text


@pytest.mark.parametrize("style", ["pcast", "implicit"])
@pytest.mark.parametrize("name", ["cfc_scan", "attention_pool", "categorical_double_q_loss"])
def test_kernel_path_traces_inside_shard_map(name, style, monkeypatch):
    """The CUDA path (kernels forced on, lowered without a GPU) inside a checking shard_map: FFI results
    carry the varying type of their operands (jaxfox._ffi.ffi_call) and the custom_vjp cotangents of
    replicated inputs are summed over the devices (jaxfox._ffi.psum_to_match), whether the params are
    cast to varying first (as data_parallel_value_and_grad does) or left replicated."""
    import jaxfox._ffi
    import jaxfox.cfc

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setattr(jaxfox.cfc, "_kernel_hidden_limit", lambda: 256)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "all")  # attention_pool's kernel is opt-in
    fn, params, batch = OPS[name](16)
    argnums = _grad_argnums(name, batch)
    loss = _loss(fn)

    def body(p, *b):
        if style == "pcast":
            p = jax.lax.pcast(p, "batch", to="varying")
        g = jax.grad(loss, argnums=argnums)(p, *b)
        return tuple(jax.lax.psum(gi, "batch") if (i == 0 and style == "pcast") else gi for i, gi in zip(argnums, g))

    g_specs = tuple(P() if i == 0 else P("batch") for i in argnums)
    f = jax.shard_map(body, mesh=_mesh(4), in_specs=(P(),) + (P("batch"),) * len(batch), out_specs=g_specs)
    text = jax.jit(f).trace(params, *batch).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jaxfox_" in text and "all_gather" not in text
    if 0 in argnums:
        assert "all_reduce" in text  # the parameter gradient's sum over devices


def test_training_steps_trace_with_kernels_on_a_mesh(monkeypatch):
    """The whole perception step and DQN update, kernels forced on, lower for CUDA on a 4-device mesh."""
    import jaxfox._ffi
    import jaxfox.cfc
    from jaxfox.models.perception_v0 import benchmark_step

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setattr(jaxfox.cfc, "_kernel_hidden_limit", lambda: 256)
    step_fn, state, batch = benchmark_step(batch=16, window=8, num_features=5, hidden=8, mesh=_mesh(4))
    text = jax.jit(step_fn).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jaxfox_cfc_fwd" in text and "custom_call @jaxfox_cfc_bwd" in text

    from jaxfox.models.branching_c51 import init_agent, make_update, support

    agent, opt, dan = init_agent(jax.random.key(0), num_branches=2, capacity=128)
    update = make_update(opt, dan, support(), batch_size=32, mesh=_mesh(4))
    text = jax.jit(update).trace(agent, jax.random.key(1), 0.4).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jaxfox_c51_loss" in text and "custom_call @jaxfox_per_sample" in text


# ----------------------------------------------------------------------------------------------
def test_data_parallel_value_and_grad_matches_one_device_and_repeats():
    fn, params, (xs,) = _cfc(16)
    y = jax.random.normal(jax.random.key(11), (16, 8))

    def loss(p, xs, y):
        return jnp.mean((fn(p, xs)[:, -1] - y) ** 2)

    l1, g1 = jax.jit(jax.value_and_grad(loss))(params, xs, y)
    for n in (1, 4, 8):
        f = jax.jit(data_parallel_value_and_grad(loss, _mesh(n), batch_argnums=(1, 2)))
        l, g = f(params, xs, y)
        np.testing.assert_allclose(float(l), float(l1), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
            assert rel_err(a, b) <= 1e-5
        l_again, g_again = f(params, xs, y)
        assert float(l_again) == float(l)
        for a, b in zip(jax.tree.leaves(g_again), jax.tree.leaves(g)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert _all_gathers(f.lower(params, xs, y).compile().as_text()) == []


def test_data_parallel_aux_is_concatenated_in_batch_order():
    def loss(p, x):
        per_row = jnp.sum((x * p) ** 2, axis=1)
        return jnp.mean(per_row), per_row

    p = jnp.arange(3.0)
    x = jnp.arange(24.0).reshape(8, 3)
    (l, aux), g = jax.jit(data_parallel_value_and_grad(loss, _mesh(4), has_aux=True))(p, x)
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(aux), np.sum((x64 * np.arange(3.0)) ** 2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(float(l), np.mean(np.sum((x64 * np.arange(3.0)) ** 2, axis=1)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), np.mean(2 * x64 ** 2 * np.arange(3.0), axis=0), rtol=1e-6)


def test_indivisible_batch_is_an_error_naming_the_argument():
    f = data_parallel_value_and_grad(lambda p, x: jnp.mean(x * p), _mesh(4))
    with pytest.raises(ValueError, match=r"argument 1.*\(6\).*divisible by the 4 devices"):
        jax.jit(f)(jnp.float32(1.0), jnp.ones((6, 2)))
    with pytest.raises(ValueError, match="batch_argnums"):
        data_parallel_value_and_grad(lambda p, x: x, _mesh(4), batch_argnums=(0,))
    with pytest.raises(ValueError, match="at least one device"):
        batch_mesh([])


def test_batch_axis_is_the_only_axis_or_the_one_named():
    from jax.sharding import Mesh

    from jaxfox.sharding import batch_axis, check_divisible

    devs = np.array(jax.devices()[:4])
    assert batch_axis(Mesh(devs, ("data",))) == "data"
    assert batch_axis(Mesh(devs.reshape(2, 2), ("model", "batch"))) == "batch"
    two = Mesh(devs.reshape(2, 2), ("data", "model"))
    assert batch_axis(two, "data") == "data"
    with pytest.raises(ValueError, match=r"axes \('data', 'model'\).*axis_name="):
        batch_axis(two)
    with pytest.raises(ValueError, match=r"axis_name 'x' is not an axis.*\('data', 'model'\)"):
        batch_axis(two, "x")
    with pytest.raises(ValueError, match=r"x: the batch axis \(3\) must be divisible by the 2 devices of the mesh axis 'data'"):
        check_divisible("x", 3, two, axis_name="data")


def test_data_parallel_over_an_axis_of_any_name_and_on_a_two_axis_mesh():
    """A one-axis mesh named "data" (flax's habit) and a 2 x 2 mesh split over "data" (the "model" axis
    replicates the work): the loss and gradient equal the float64 values, no all-gather."""
    from jax.sharding import Mesh

    devs = np.array(jax.devices()[:4])
    x = np.arange(24.0, dtype=np.float32).reshape(8, 3) / 10
    p = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.sum((x * p) ** 2, axis=1))

    x64, p64 = x.astype(np.float64), np.asarray(p, np.float64)
    for mesh, axis_name in ((Mesh(devs, ("data",)), None), (Mesh(devs.reshape(2, 2), ("data", "model")), "data")):
        f = jax.jit(data_parallel_value_and_grad(loss, mesh, axis_name=axis_name))
        l, g = f(p, jnp.asarray(x))
        np.testing.assert_allclose(float(l), np.mean(np.sum((x64 * p64) ** 2, axis=1)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g), np.mean(2 * x64 ** 2 * p64, axis=0), rtol=1e-6)
        assert _all_gathers(f.lower(p, jnp.asarray(x)).compile().as_text()) == []
    with pytest.raises(ValueError, match="axis_name="):
        data_parallel_value_and_grad(loss, Mesh(devs.reshape(2, 2), ("data", "model")))


def test_training_steps_on_a_mesh_whose_axis_is_not_named_batch():
    """The perception and DQN steps on a 4-device mesh named "data": bitwise the results on the same 4 devices
    under the default axis name (the axis's name changes nothing but the collectives' labels)."""
    from jax.sharding import Mesh

    data = Mesh(np.array(jax.devices()[:4]), ("data",))
    l, p = _perception_run(4, mesh=data)
    l4, p4 = _perception_run(4)
    assert l == l4 and np.array_equal(p, p4)
    dl, dp, dpr, _ = _dqn_run(4, mesh=data)
    dl4, dp4, dpr4, _ = _dqn_run(4)
    assert dl == dl4 and np.array_equal(dp, dp4) and np.array_equal(dpr, dpr4)


# ----------------------------------------------------------------------------------------------
# Training steps.
def _perception_run(n, steps=3, mesh=None):
    from jaxfox.models import make_model, make_optimizer, train_step

    model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=1e-2)
    x = jax.random.normal(jax.random.key(0), (16, 10, 6))
    y = (x[:, -1, 0] > 0).astype(jnp.float32)
    mesh = _mesh(n) if mesh is None else mesh
    losses = [float(train_step(model, opt, x, y, mesh=mesh)) for _ in range(steps)]
    flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))])
    return losses, flat


def test_perception_train_step_on_1_4_8_devices():
    l1, p1 = _perception_run(1)
    for n in (4, 8):
        l, p = _perception_run(n)
        np.testing.assert_allclose(l, l1, rtol=1e-5)
        np.testing.assert_allclose(p, p1, rtol=1e-4, atol=1e-6)
    l8b, p8b = _perception_run(8)
    assert l8b == _perception_run(8)[0] and np.array_equal(p8b, _perception_run(8)[1])


def test_perception_step_hlo_gathers_nothing_and_default_mesh_is_all_devices():
    from jaxfox.models.perception_v0 import benchmark_step

    step_fn, state, batch = benchmark_step(batch=16, window=8, num_features=5, hidden=8)
    assert batch[0].sharding.num_devices == len(jax.local_devices())
    hlo = jax.jit(step_fn).lower(state, batch).compile().as_text()
    assert _all_gathers(hlo) == []
    assert "all-reduce" in hlo
    with pytest.raises(ValueError, match=r"batch.*divisible by the 8 devices"):
        benchmark_step(batch=12, window=8, num_features=5, hidden=8)


def _dqn_run(n, steps=3, bf16=False, mesh=None):
    from jaxfox.models.branching_c51 import Transition, init_agent, make_update, support

    cap, B = 256, 64
    state, opt, dan = init_agent(jax.random.key(0), num_branches=2, capacity=cap, lr=1e-3)
    r = np.random.default_rng(0)
    items = Transition(jnp.asarray(r.standard_normal((cap, 48)), jnp.float32),
                       jnp.asarray(r.integers(0, 5, (cap, 2)), jnp.int32),
                       jnp.asarray(r.standard_normal(cap), jnp.float32), jnp.full((cap,), 0.9, jnp.float32),
                       jnp.asarray(r.standard_normal((cap, 48)), jnp.float32))
    state = state._replace(buffer=jaxfox.per.add(state.buffer, items))
    mesh = _mesh(n) if mesh is None else mesh
    update = jax.jit(make_update(opt, dan, support(), batch_size=B, mesh=mesh, bf16=bf16))
    losses = []
    for i in range(steps):
        state, info = update(state, jax.random.key(i), 0.4)
        losses.append(float(info["loss"]))
    hlo = update.lower(state, jax.random.key(0), 0.4).compile().as_text()
    return losses, np.asarray(state.online.flat), np.asarray(state.buffer.priorities), hlo


def test_dqn_update_on_1_4_8_devices():
    """float32 forward: a few updates agree to rounding. (With the bfloat16 forward the weight cotangents are
    bfloat16 sums over each device's rows, so N devices round differently; AdamW's first steps move every
    weight by about +-lr whatever the gradient's size, so that rounding flips near-zero weights' updates:
    see test_dqn_bf16_gradient_on_4_devices for what is compared there.)"""
    l1, p1, pr1, _ = _dqn_run(1)
    for n in (4, 8):
        l, p, pr, hlo = _dqn_run(n)
        np.testing.assert_allclose(l, l1, rtol=1e-5)
        np.testing.assert_allclose(p, p1, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(pr, pr1, rtol=1e-4, atol=1e-6)
        # nothing is gathered: the per-sample losses travel in the gradient's all-reduce
        assert _all_gathers(hlo) == [] and hlo.count("all-reduce(") == 1, _all_gathers(hlo)
    again = _dqn_run(4)
    assert again[0] == _dqn_run(4)[0]


def test_dqn_bf16_gradient_on_4_devices():
    """The bf16-forward gradient on 4 devices against one device: within bfloat16 rounding of the sums."""
    from jaxfox.models.branching_c51 import Transition, batch_loss, init_agent, support

    state, _, dan = init_agent(jax.random.key(0), num_branches=2, capacity=64)
    r = np.random.default_rng(1)
    B = 64
    batch = Transition(jnp.asarray(r.standard_normal((B, 48)), jnp.float32),
                       jnp.asarray(r.integers(0, 5, (B, 2)), jnp.int32),
                       jnp.asarray(r.standard_normal(B), jnp.float32), jnp.full((B,), 0.9, jnp.float32),
                       jnp.asarray(r.standard_normal((B, 48)), jnp.float32))
    w = jnp.asarray(r.uniform(0.2, 1.0, B), jnp.float32)

    def loss(online, target, batch, w):
        return batch_loss(online, target, batch, w, dan, support(), bf16=True)

    (l1, lb1), g1 = jax.jit(data_parallel_value_and_grad(loss, _mesh(1), batch_argnums=(2, 3), has_aux=True))(
        state.online, state.target, batch, w)
    (l4, lb4), g4 = jax.jit(data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=(2, 3), has_aux=True))(
        state.online, state.target, batch, w)
    np.testing.assert_allclose(float(l4), float(l1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lb4), np.asarray(lb1), rtol=1e-5, atol=1e-6)
    assert rel_err(g4.flat, g1.flat) <= 2e-2  # bfloat16 has 8 significant bits


# ----------------------------------------------------------------------------------------------
# Regression tests for bugs found in review: jaxfox.sharding not reachable as an attribute;
# data_parallel_value_and_grad on a jax.make_mesh (Explicit axes) mesh with unsharded inputs.
def test_review_jaxfox_sharding_reachable_as_attribute():
    import subprocess
    import sys

    # a fresh interpreter: here another test may already have imported jaxfox.sharding
    code = "import jaxfox; print(jaxfox.sharding.batch_mesh)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]


def test_review_data_parallel_on_make_mesh_with_plain_inputs():
    mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])  # axis_types default: Explicit
    x = np.arange(24.0, dtype=np.float32).reshape(8, 3) / 10
    p = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.sum((x * p) ** 2, axis=1))

    l, g = jax.jit(data_parallel_value_and_grad(loss, mesh))(p, jnp.asarray(x))
    x64, p64 = x.astype(np.float64), np.asarray(p, np.float64)
    np.testing.assert_allclose(float(l), np.mean(np.sum((x64 * p64) ** 2, axis=1)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), np.mean(2 * x64 ** 2 * p64, axis=0), rtol=1e-6)


@pytest.mark.parametrize("form", ["list", "stacked"])
def test_grouped_matmul_kernel_path_traces_inside_shard_map(form, monkeypatch):
    """grouped_matmul's (opt-in) kernel path under shard_map with the rows split and the weights replicated:
    the weight and bias gradients are summed over the devices, the rows' gradients stay per device."""
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grouped_matmul")
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((16, 6)), jnp.float32)
    w = jnp.asarray(r.standard_normal((2, 6, 3)), jnp.float32)
    b = jnp.asarray(r.standard_normal((2, 3)), jnp.float32)

    def loss(w, b, x):
        if form == "stacked":
            y = jaxfox.grouped_matmul_stacked(x, w, b)
            return jnp.sum(jnp.tanh(y))
        ys = jaxfox.grouped_matmul([x, x[:, :4]], [w[0], w[1, :4]], [b[0], None])
        return sum(jnp.sum(jnp.tanh(y)) for y in ys)

    f = jax.shard_map(lambda w, b, x: jax.grad(loss, argnums=(0, 1, 2))(w, b, x), mesh=_mesh(4),
                      in_specs=(P(), P(), P("batch")), out_specs=(P(), P(), P("batch")))
    text = jax.jit(f).trace(w, b, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jaxfox_grouped_gemm" in text and "custom_call @jaxfox_grouped_wgrad" in text
    assert "all_reduce" in text and "all_gather" not in text


def test_batch_argnums_negative_or_beyond_the_arguments_is_an_error():
    """batch_argnums=(-1,) used to be accepted: nothing was split, every device ran the whole batch and the
    per-row aux came back N times over ([N * B] rows); a position past the arguments gave a bare IndexError."""
    x = jnp.asarray(np.arange(24.0, dtype=np.float32).reshape(8, 3) / 10)
    y = jnp.asarray(np.linspace(-1, 1, 8, dtype=np.float32))
    p = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def loss(p, x, y):
        e = x @ p - y
        return jnp.mean(e * e), e

    (l, aux), g = jax.jit(data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=(1, 2), has_aux=True))(p, x, y)
    x64, y64, p64 = np.asarray(x, np.float64), np.asarray(y, np.float64), np.asarray(p, np.float64)
    e64 = x64 @ p64 - y64
    assert aux.shape == (8,)
    np.testing.assert_allclose(np.asarray(aux), e64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(l), np.mean(e64 ** 2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), 2 * x64.T @ e64 / 8, rtol=1e-5, atol=1e-6)
    for bad in ((-1,), (1, -1), ()):
        with pytest.raises(ValueError, match="batch_argnums"):
            data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=bad, has_aux=True)
    with pytest.raises(ValueError, match=r"batch_argnums \(1, 3\) names position 3.* 2 argument"):
        data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=(1, 3), has_aux=True)(p, x, y)


def test_reshard_args_needs_one_spec_per_argument():
    """zip() used to drop the arguments without a spec silently."""
    from jaxfox.sharding import reshard_args

    mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
    x, y = jnp.ones((8, 2)), jnp.zeros((8,))
    with pytest.raises(ValueError, match="one PartitionSpec per argument"):
        reshard_args(mesh, (x, y), (P("batch"),))
    x2, y2 = reshard_args(mesh, (x, y), (P("batch"), P()))
    np.testing.assert_array_equal(np.asarray(x2), np.asarray(x))
    assert tuple(x2.sharding.spec)[0] == "batch" and all(a is None for a in tuple(y2.sharding.spec))


def test_batch_argnums_must_be_a_tuple_of_ints():
    """batch_argnums=(1.5,) was truncated to (1,) and (True,) taken as (1,) without an error; a bare int raised
    "'int' object is not iterable", naming nothing. Tuples (and lists) of ints still work: the value equals float64."""
    x = jnp.asarray(np.arange(24.0, dtype=np.float32).reshape(8, 3) / 10)
    p = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.sum((x * p) ** 2, axis=1))

    for bad in ((1.5,), (True,), 1, None, (1, "2")):
        with pytest.raises(TypeError, match=r"^batch_argnums must be a tuple of ints"):
            data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=bad)
    x64, p64 = np.asarray(x, np.float64), np.asarray(p, np.float64)
    for ok in ((1,), [1], (np.int64(1),)):
        l, g = jax.jit(data_parallel_value_and_grad(loss, _mesh(4), batch_argnums=ok))(p, x)
        np.testing.assert_allclose(float(l), np.mean(np.sum((x64 * p64) ** 2, axis=1)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g), np.mean(2 * x64 ** 2 * p64, axis=0), rtol=1e-6)


# ---------------------------------------------------------------------------------------------- XLA_FLAGS helper
def test_enable_concurrent_command_buffers_keeps_quoted_flags_verbatim(monkeypatch):
    """The user's other flags are kept as XLA tokenises them (xla/parse_flags_from_env.cc): a quoted value's inner
    whitespace used to be collapsed by str.split / " ".join ("/tmp/a  b" became "/tmp/a b"), and a quoted value of
    the scheduling flag itself was not recognised."""
    import jaxfox.concurrency as cc

    monkeypatch.setattr(cc, "_backends_initialized", lambda: False)
    flag = cc.COMMAND_BUFFER_SCHEDULING_FLAG
    monkeypatch.setenv("XLA_FLAGS", f'--xla_dump_to="/tmp/a  b"\t{flag}=SERIALIZE --xla_dump_hlo_as_text')
    cc.enable_concurrent_command_buffers()
    assert os.environ["XLA_FLAGS"] == f'--xla_dump_to="/tmp/a  b"\t --xla_dump_hlo_as_text {flag}=CONCURRENT'
    assert cc.concurrent_command_buffers_enabled()
    cc.enable_concurrent_command_buffers()  # idempotent: nothing changes
    assert os.environ["XLA_FLAGS"] == f'--xla_dump_to="/tmp/a  b"\t --xla_dump_hlo_as_text {flag}=CONCURRENT'
    monkeypatch.setenv("XLA_FLAGS", f'{flag}="CONCURRENT" --xla_dump_to=\'/x y\'')
    assert cc.concurrent_command_buffers_enabled()     # XLA reads the value without its quotes
    cc.enable_concurrent_command_buffers()
    assert os.environ["XLA_FLAGS"] == f'{flag}="CONCURRENT" --xla_dump_to=\'/x y\''
    monkeypatch.setenv("XLA_FLAGS", f'{flag}=CONCURRENT --xla_dump_to="/a {flag}=SERIALIZE"')
    assert cc.concurrent_command_buffers_enabled()     # text inside a quoted value is no flag


def test_enable_concurrent_command_buffers_with_xla_flags_naming_a_file(tmp_path):
    """XLA takes an XLA_FLAGS value that does not start with '-' as the name of a file of flags. Appending the flag
    to that name made XLA look for the file "<name> --xla_gpu_...=CONCURRENT" and stop the process at start-up
    (LOG(QFATAL) "Could not open file"); now the file's flags are inlined (the device count it sets still holds)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags_file = tmp_path / "flags.txt"
    flags_file.write_text("--xla_force_host_platform_device_count=3\n")
    code = ("import os, jaxfox; jaxfox.enable_concurrent_command_buffers(); "
            "assert jaxfox.concurrent_command_buffers_enabled(); "
            "import jax; print(len(jax.devices('cpu'))); print(os.environ['XLA_FLAGS'])")
    env = dict(os.environ, XLA_FLAGS=str(flags_file), PYTHONPATH=root, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "3"
    assert lines[1].split() == ["--xla_force_host_platform_device_count=3",
                                "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"]
    # a file that cannot be read: an error naming XLA_FLAGS, before anything is changed
    env["XLA_FLAGS"] = str(tmp_path / "missing.txt")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ValueError: XLA_FLAGS=" in out.stderr and "cannot be read" in out.stderr
