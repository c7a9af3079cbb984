"""Data parallelism with the CUDA kernels on several GPUs (issue 6): run on a machine with >= 2 GPUs.

The CPU versions (reference path, forced host devices) are in test_sharding.py; these repeat the
checks where the FFI kernels actually run: ops on Explicit batch-sharded inputs and under shard_map
equal the one-GPU result with no gather of the batch, and the perception and DQN steps on 2 GPUs equal
one GPU's up to reduction order and repeat bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfox
from jaxfox.sharding import batch_mesh, batch_sharding

from conftest import rel_err, module_opt_in
from test_sharding import OPS, _all_gathers, _grad_argnums, _loss

pytestmark = pytest.mark.gpu
_opt_in = module_opt_in("all")  # exercise attention_pool's (opt-in) kernel too


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


needs_two = pytest.mark.skipif(not jaxfox.kernels_available() or len(_gpus()) < 2,
                               reason="needs the CUDA kernels and at least 2 GPUs")


@needs_two
@pytest.mark.parametrize("name", ["cfc_scan", "attention_pool", "categorical_double_q_loss"])
def test_op_on_explicit_sharding_uses_kernels_per_shard(name):
    n = len(_gpus())
    fn, params, batch = OPS[name](8 * n)
    argnums = _grad_argnums(name, batch)
    f = jax.jit(lambda p, *b: (fn(p, *b), jax.grad(_loss(fn), argnums=argnums)(p, *b)))
    with jax.default_matmul_precision("highest"):
        ref = f(jax.device_put(params, _gpus()[0]), *jax.device_put(batch, _gpus()[0]))
        mesh = jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Explicit,), devices=_gpus())
        args = (jax.device_put(params, NamedSharding(mesh, P())), *jax.device_put(batch, batch_sharding(mesh)))
        out = f(*args)
        hlo = f.lower(*args).compile().as_text()
    assert "jaxfox_" in hlo and _all_gathers(hlo) == [], _all_gathers(hlo)
    outs, refs = jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])
    for a, b in zip(outs, refs):  # per-sample outputs: the same kernel on the same rows
        assert rel_err(a, b) <= 1e-6
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1])):  # parameter gradients: another sum order
        assert rel_err(a, b) <= 1e-5


def _perception(n, steps=5):
    from flax import nnx

    from jaxfox.models import make_model, make_optimizer, train_step

    model = make_model(48, rngs=nnx.Rngs(0))
    opt = make_optimizer(model)
    x = jax.random.normal(jax.random.key(0), (64, 64, 48))
    y = (x[:, -1, 0] > 0).astype(jnp.float32)
    mesh = batch_mesh(_gpus()[:n])
    losses = [float(train_step(model, opt, x, y, mesh=mesh)) for _ in range(steps)]
    return np.array(losses), np.concatenate([np.ravel(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))])


@needs_two
def test_perception_step_two_gpus_equals_one_and_repeats():
    n = len(_gpus())
    l1, p1 = _perception(1)
    ln, pn = _perception(n)
    np.testing.assert_allclose(ln, l1, rtol=1e-5)
    np.testing.assert_allclose(pn, p1, rtol=1e-4, atol=1e-6)
    ln2, pn2 = _perception(n)
    np.testing.assert_array_equal(ln2, ln)
    np.testing.assert_array_equal(pn2, pn)


@needs_two
def test_dqn_update_two_gpus_equals_one_and_repeats():
    from test_sharding import _dqn_run

    import test_sharding

    real_mesh = test_sharding._mesh
    try:
        test_sharding._mesh = lambda n: batch_mesh(_gpus()[:n])
        l1, p1, pr1, _ = _dqn_run(1)
        n = len(_gpus())
        ln, pn, prn, hlo = _dqn_run(n)
        again = _dqn_run(n)
    finally:
        test_sharding._mesh = real_mesh
    np.testing.assert_allclose(ln, l1, rtol=1e-5)
    # AdamW's first steps move each weight by about lr whatever its gradient's size, so gradients that
    # differ by rounding (another sum order) can move a weight by ~1e-6-1e-5 differently (H200: 3 of 117809)
    np.testing.assert_allclose(pn, p1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(prn, pr1, rtol=1e-4, atol=1e-5)
    assert "jaxfox_" in hlo
    assert again[0] == ln and np.array_equal(again[1], pn)
