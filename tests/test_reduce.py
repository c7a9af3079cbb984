"""CPU tests of jaxfox.reduce_axis0 / reduce_chunks against float64 NumPy sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfox import reduce_axis0
from jaxfox.reduce import reduce_chunks

from conftest import assert_sum_close

SHAPES = [(1, 1), (1, 7), (2, 3), (3, 5), (4, 256), (5, 1027), (63, 33), (65, 1), (257, 3), (1000, 7),
          (4097, 5), (31, 1025), (130, 4096)]


def _random(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_integer_valued_sums_are_exact(shape):
    x = np.random.default_rng(1).integers(-1000, 1001, size=shape).astype(np.float32)
    got = reduce_axis0(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got, np.float64), x.astype(np.float64).sum(axis=0))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_sums_close(shape):
    x = _random(shape, seed=2)
    assert_sum_close(reduce_axis0(jnp.asarray(x)), x)
    assert_sum_close(jax.jit(reduce_axis0)(x), x)


def test_batch_one_is_identity():
    x = _random((1, 513), seed=3)
    np.testing.assert_array_equal(np.asarray(reduce_axis0(x)), x[0])


def test_nan_and_inf_propagate():
    x = _random((70, 9), seed=4)
    x[13, 0] = np.nan
    x[0, 1] = np.inf
    x[69, 2] = -np.inf
    x[5, 3], x[6, 3] = np.inf, -np.inf      # inf - inf = nan
    x[:, 4] = np.nan
    x[3, 5], x[60, 5] = np.inf, np.inf
    got = np.asarray(reduce_axis0(x))
    assert np.isnan(got[0]) and np.isnan(got[3]) and np.isnan(got[4])
    assert got[1] == np.inf and got[2] == -np.inf and got[5] == np.inf
    assert_sum_close(got[6:], x[:, 6:])     # other columns unaffected


def test_grad_is_broadcast():
    x = _random((6, 11), seed=5)
    w = _random((11,), seed=6)
    g = jax.grad(lambda x: jnp.sum(reduce_axis0(x) * w))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(w, (6, 11)))
    y, vjp = jax.vjp(reduce_axis0, jnp.asarray(x))
    (gx,) = vjp(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(gx), np.broadcast_to(w, (6, 11)))
    assert_sum_close(y, x)
    # second application: grad of a grad-using loss stays exact
    gg = jax.jit(jax.grad(lambda x: jnp.sum(reduce_axis0(x * x))))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(gg), 2 * x, rtol=1e-6)


def test_forward_mode_and_higher_order():
    """The op is linear: jvp / jacfwd give the sum of the tangents, the Hessian of a quadratic is exact."""
    x, t = _random((5, 7), seed=8), _random((5, 7), seed=9)
    y, ty = jax.jvp(reduce_axis0, (jnp.asarray(x),), (jnp.asarray(t),))
    assert_sum_close(y, x)
    assert_sum_close(ty, t)
    jac = np.asarray(jax.jacfwd(reduce_axis0)(jnp.asarray(x)))            # [P, B, P]
    np.testing.assert_array_equal(jac, np.broadcast_to(np.eye(7)[:, None, :], (7, 5, 7)))
    hess = np.asarray(jax.hessian(lambda x: jnp.sum(reduce_axis0(x) ** 2))(jnp.asarray(x)))  # [B, P, B, P]
    want = 2.0 * np.einsum("pq,bc->bpcq", np.eye(7), np.ones((5, 5)))
    np.testing.assert_array_equal(hess, want)


def test_vmap_and_jit():
    x = _random((3, 70, 13), seed=7)
    got = jax.jit(jax.vmap(reduce_axis0))(x)
    assert got.shape == (3, 13)
    for v in range(3):
        assert_sum_close(got[v], x[v])
    got = jax.vmap(reduce_axis0, in_axes=2, out_axes=1)(x.transpose(1, 2, 0))
    assert got.shape == (13, 3)
    for v in range(3):
        assert_sum_close(got[:, v], x[v])


@pytest.mark.parametrize("bad", [np.zeros((3,), np.float32), np.zeros((2, 3, 4), np.float32), np.float32(1.0)],
                         ids=["rank1", "rank3", "rank0"])
def test_rank_errors(bad):
    with pytest.raises(ValueError, match=r"2-D"):
        reduce_axis0(bad)


@pytest.mark.parametrize("dtype", ["int32", "bfloat16", "float16"])
def test_dtype_errors(dtype):
    with pytest.raises(TypeError, match="float32"):
        reduce_axis0(jnp.zeros((3, 4), dtype))


def test_float64_numpy_input_rejected():
    """A float64 NumPy array is not float32 (it must not be silently rounded, as cfc_scan also refuses)."""
    with pytest.raises(TypeError, match="float32"):
        reduce_axis0(np.zeros((3, 4), np.float64))


@pytest.mark.parametrize("batch", [1, 2, 63, 64, 65, 100, 1000, 4097, 100_000, 10 ** 7])
@pytest.mark.parametrize("size", [1, 3, 1024, 1025, 100_000, 2 ** 20, 2 ** 28])
def test_reduce_chunks(batch, size):
    c = reduce_chunks(batch, size)
    assert isinstance(c, int)
    assert 1 <= c <= batch
    assert c <= 65535
    assert reduce_chunks(batch, size) == c  # a fixed function of the shape
    if batch <= 64:
        assert c == 1


def test_reduce_chunks_splits_narrow_tall_inputs():
    # narrow and tall inputs use several row ranges to fill the GPU; wide ones a single range
    assert reduce_chunks(100_000, 8) > 1
    assert reduce_chunks(32, 2 ** 20) == 1
    assert reduce_chunks(10 ** 6, 2 ** 20) == 1
