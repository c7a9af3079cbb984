"""GPU tests of the fused C51 loss kernel (``ffi/c51.cu``, target jaxfox_c51_loss); ``pytest -m gpu``.

The kernel path (traced outside ``jaxfox.use_reference()``) is compared with the pure-JAX reference
path on the same GPU (traced inside it) and with the float64 NumPy oracle of tests/test_c51.py
(``np_loss``: softmax expectation, first-index argmax, hat projection, cross-entropy, written from
the equations). The gradient oracle: d loss[b] / d logits_tm1[b, d, a_tm1] = (softmax - m) / D.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfox
from conftest import assert_command_buffers_identical, rel_err
from test_c51 import Z11, make_inputs, min_argmax_gap, np_loss, np_softmax

if not jaxfox.kernels_available():
    pytest.skip(f"jaxfox CUDA kernels unavailable: {jaxfox.kernels_unavailable_reason()}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu

ORDER = ("logits_tm1", "a_tm1", "r_t", "discount_t", "logits_t_target", "logits_t_online", "support")


def _fn():
    """A fresh function (inputs..., cot) -> (loss [B], dlogits_tm1 [B, D, A, N])."""
    def f(lt, a, r, disc, tg, on, z, cot):
        loss, vjp = jax.vjp(lambda x: jaxfox.categorical_double_q_loss(x, a, r, disc, tg, on, z), lt)
        return loss, vjp(cot)[0]
    return f


def run_kernel(inp, cot):
    assert jaxfox.kernels_available()
    return jax.device_get(jax.jit(_fn())(*(jnp.asarray(inp[k]) for k in ORDER), jnp.asarray(cot)))


def run_reference(inp, cot):
    with jaxfox.use_reference():
        return jax.device_get(jax.jit(_fn())(*(jnp.asarray(inp[k]) for k in ORDER), jnp.asarray(cot)))


def np_grad(inp, cot):
    """float64 (softmax(logits_tm1[a_tm1]) sum(m) - m) cot / D at a_tm1, 0 elsewhere."""
    _, m = np_loss(*(inp[k] for k in ORDER))
    lt = np.asarray(inp["logits_tm1"], np.float64)
    B, D, A, N = lt.shape
    g = np.zeros_like(lt)
    for b in range(B):
        for d in range(D):
            a = inp["a_tm1"][b, d]
            g[b, d, a] = (np_softmax(lt[b, d, a]) * m[b, d].sum() - m[b, d]) * cot[b] / D
    return g


def check_case(inp, tol=1e-5, atol=1e-6):
    B = inp["a_tm1"].shape[0]
    cot = np.random.default_rng(7).uniform(0.5, 2.0, B).astype(np.float32)
    loss_k, g_k = run_kernel(inp, cot)
    loss_r, g_r = run_reference(inp, cot)
    loss_o, _ = np_loss(*(inp[k] for k in ORDER))
    g_o = np_grad(inp, cot)
    assert loss_k.dtype == np.float32 and g_k.dtype == np.float32
    np.testing.assert_allclose(loss_k, loss_r, rtol=tol, atol=atol)
    np.testing.assert_allclose(g_k, g_r, rtol=tol, atol=atol)
    assert rel_err(loss_k, loss_o) <= tol and rel_err(g_k, g_o) <= tol
    # Only the taken action's row carries gradient.
    mask = np.zeros(g_k.shape, bool)
    bb, dd = np.meshgrid(np.arange(B), np.arange(inp["a_tm1"].shape[1]), indexing="ij")
    mask[bb, dd, inp["a_tm1"]] = True
    assert (g_k[~mask] == 0).all()
    return loss_k, g_k


@pytest.mark.parametrize("B,D,A,N,seed", [(1024, 4, 5, 51, 0), (3, 1, 2, 51, 1), (17, 7, 3, 11, 2),
                                          (5, 2, 4, 33, 3), (9, 3, 5, 200, 4), (4, 2, 3, 1024, 5),
                                          (2, 1, 1, 2, 6)])
def test_kernel_matches_reference_and_float64_oracle(B, D, A, N, seed):
    inp = make_inputs(B, D, A, N, seed=seed, support=None if N == 51 else np.linspace(-10, 10, N).astype(np.float32))
    assert A == 1 or min_argmax_gap(inp["logits_t_online"], inp["support"]) > 1e-5  # no near-ties
    # The projection position b = (Tz - v_min) / dz is float32 with b up to N - 1, so its rounding
    # (about N * 2^-24 absolute) moves up to that much mass between neighbouring atoms, differently in
    # the kernel and in XLA: at N = 1024 that is ~6e-5 (seen on the H200), at N = 51 below 1e-6.
    check_case(inp, tol=max(1e-5, 4 * N * 2.0 ** -24), atol=max(1e-6, 4 * N * 2.0 ** -24))


def test_edge_cases_on_exact_support_beyond_support_done_and_gamma0():
    inp = make_inputs(8, 3, 4, 11, seed=8, support=Z11)
    # r = +-dz with discount 1 (atoms exactly on support points), far beyond +-Vmax, done, gamma 0.
    inp["r_t"] = np.array([1.0, -1.0, 100.0, -100.0, 2.5, 0.0, 3.0, -7.0], np.float32)
    inp["discount_t"] = np.array([1.0, 1.0, 0.99, 0.99, 0.0, 0.0, 1.0, 0.5], np.float32)
    check_case(inp)


def test_argmax_ties_take_the_first_index():
    inp = make_inputs(16, 2, 4, 51, seed=9)
    on = inp["logits_t_online"]
    on[:, :, 2] = on[:, :, 1]  # exact ties between actions 1 and 2 ...
    on[:, :, 3] = on[:, :, 1]  # ... and 3
    on[:, :, 0] = on[:, :, 1] - 5.0 * (np.asarray(inp["support"]) > 0)  # action 0 clearly worse
    inp["logits_t_online"] = on
    tg = inp["logits_t_target"]
    tg[:, :, 2] += 3.0 * np.linspace(-1, 1, 51, dtype=np.float32)  # a wrong tie-break changes the target
    tg[:, :, 3] -= 3.0 * np.linspace(-1, 1, 51, dtype=np.float32)
    check_case(inp)


def test_bf16_logits_and_vmap():
    inp = make_inputs(6, 2, 3, 51, seed=10)
    args = [jnp.asarray(inp[k]) for k in ORDER]
    args[0] = args[0].astype(jnp.bfloat16)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jaxfox.categorical_double_q_loss(x, *args[1:]))))(args[0])
    with jaxfox.use_reference():
        g_r = jax.jit(jax.grad(lambda x: jnp.sum(jaxfox.categorical_double_q_loss(x, *args[1:]))))(args[0])
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_r, np.float32), rtol=1e-2, atol=1e-3)
    # vmap over a leading axis: every operand batched (support too).
    stacked = [jnp.stack([jnp.asarray(inp[k]), jnp.asarray(make_inputs(6, 2, 3, 51, seed=11)[k])]) for k in ORDER]
    got = jax.jit(jax.vmap(jaxfox.categorical_double_q_loss))(*stacked)
    with jaxfox.use_reference():
        want = jax.jit(jax.vmap(jaxfox.categorical_double_q_loss))(*stacked)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_kernel_is_in_the_program():
    inp = make_inputs(4, 2, 3, 51, seed=12)
    args = [jnp.asarray(inp[k]) for k in ORDER] + [jnp.ones(4, jnp.float32)]
    txt = jax.jit(_fn()).lower(*args).compile().as_text()
    assert "jaxfox_c51_loss" in txt
    with jaxfox.use_reference():
        assert "jaxfox_c51_loss" not in jax.jit(_fn()).lower(*args).compile().as_text()


def test_bitwise_deterministic_over_runs():
    inp = make_inputs(1024, 4, 5, 51, seed=13)
    cot = np.ones(1024, np.float32)
    first = run_kernel(inp, cot)
    f = jax.jit(_fn())
    args = [jnp.asarray(inp[k]) for k in ORDER] + [jnp.asarray(cot)]
    for _ in range(9):  # 10 runs in all, as the issue asks
        again = jax.device_get(f(*args))
        for x, y in zip(first, again):
            assert np.array_equal(x, y)


def test_command_buffers_on_and_off_identical(tmp_path):
    script = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp, numpy as np
        import jaxfox
        rng = np.random.default_rng(0)
        B, D, A, N = 256, 4, 5, 51
        f = lambda: jnp.asarray(rng.standard_normal((B, D, A, N)), jnp.float32)
        lt, tg, on = f(), f(), f()
        a = jnp.asarray(rng.integers(0, A, (B, D)), jnp.int32)
        r = jnp.asarray(rng.uniform(-3, 3, B), jnp.float32)
        disc = jnp.asarray(0.99 * (rng.uniform(size=B) > 0.2), jnp.float32)
        z = jnp.linspace(-10.0, 10.0, N, dtype=jnp.float32)
        step = jax.jit(lambda x: jax.value_and_grad(
            lambda y: jnp.mean(jaxfox.categorical_double_q_loss(y, a, r, disc, tg, on, z)))(x))
        # the kernel, not the reference compared with itself
        assert "jaxfox_c51_loss" in step.lower(lt).compile().as_text(), "kernel path not taken"
        out = {}
        for i in range(3):
            v, g = step(lt)
            out[f"loss_run{i}"] = np.asarray(v)
            out[f"grad_run{i}"] = np.asarray(g)
        np.savez(sys.argv[1], **out)
        print("DONE")
    """)
    assert_command_buffers_identical(script, tmp_path)
