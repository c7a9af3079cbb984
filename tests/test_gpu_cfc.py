"""GPU tests of the CfC and reduce_axis0 CUDA kernels (``pytest -m gpu`` on the H200).

Every test here is marked ``gpu``; the whole module is skipped when the kernels are not available
(no CUDA device, extension not built, JAXFOX_DISABLE_KERNELS set). The kernel path is compared with
the pure-JAX reference path on the same GPU, and with the float64 NumPy oracle of conftest.py.

Kernel use is decided when a function is traced, so every comparison builds *fresh* functions: the
reference ones are traced and run inside ``jaxfox.use_reference()``, the kernel ones outside it.
Both run under ``jax.default_matmul_precision("highest")`` (no TF32 in the reference's GEMMs).
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox

from conftest import (assert_command_buffers_identical, assert_sum_close, np_cfc_scan, random_cfc_params, random_inputs,
                      rel_err, run_child_npz)

if not jaxfox.kernels_available():
    pytest.skip(f"jaxfox CUDA kernels unavailable: {jaxfox.kernels_unavailable_reason()}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu

MODES = ("default", "no_gate", "pure")
SIZES = {  # name: (B, T, I, H, U)
    "bench": (32, 256, 48, 128, 128),
    "odd": (3, 5, 7, 9, 13),
    "mid": (8, 33, 16, 64, 40),
}
CASES = [(m, L, s) for m in MODES for L in (0, 1, 2) for s in SIZES] + [("default", 4, "odd"), ("no_gate", 3, "mid")]
TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Helpers.
def _case(mode, L, size, seed=0, ts_kind="per_step"):
    B, T, I, H, U = SIZES[size] if isinstance(size, str) else size
    params = random_cfc_params(jax.random.key(seed), I, H, U, L, mode, scale=0.05, seed=seed)
    xs, ts, h0 = random_inputs(B, T, I, H, seed=seed + 1, ts_kind=ts_kind)
    cot = np.random.default_rng(seed + 2).standard_normal((B, T, H)).astype(np.float32)
    return params, xs, ts, h0, cot


def _fwd_bwd_fn(mode):
    """A fresh function (params, xs, ts, h0, cot) -> (hs, (dparams, dxs, dts, dh0))."""
    def f(params, xs, ts, h0, cot):
        hs, vjp = jax.vjp(lambda p, x, t, h: jaxfox.cfc_scan(p, x, t, h, mode=mode), params, xs, ts, h0)
        return hs, vjp(cot)
    return f


def run_kernel(fn, *args):
    """jit(fn)(*args) traced now (kernels available), fetched to host."""
    assert jaxfox.kernels_available()
    with jax.default_matmul_precision("highest"):
        return jax.device_get(jax.jit(fn)(*args))


def run_reference(fn, *args):
    """jit(fn)(*args) traced inside use_reference() (pure-JAX path on the GPU), fetched to host."""
    with jaxfox.use_reference(), jax.default_matmul_precision("highest"):
        return jax.device_get(jax.jit(fn)(*args))


def hlo(fn, *args, reference=False):
    if reference:
        with jaxfox.use_reference():
            return jax.jit(fn).lower(*args).as_text()
    return jax.jit(fn).lower(*args).as_text()


def assert_rel(got, want, tol, what):
    """Relative error per leaf (so a small leaf such as w_tau is not hidden by heads_w) and overall."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    errs = {p: rel_err(a, b) for p, a, b in zip(paths, gl, wl)}
    bad = {p: e for p, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: rel err > {tol}: {bad}"


def _arrays_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
                                      for x, y in zip(la, lb))


# ----------------------------------------------------------------------------------------------
# CfC kernel vs reference.
@pytest.mark.parametrize("mode", MODES)
def test_kernel_is_used(mode):
    params, xs, ts, h0, cot = _case(mode, 1, "odd")
    text = hlo(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    assert "jaxfox_cfc_fwd" in text and "jaxfox_cfc_bwd" in text
    ref = hlo(_fwd_bwd_fn(mode), params, xs, ts, h0, cot, reference=True)
    assert "jaxfox_cfc" not in ref


@pytest.mark.parametrize("mode,L,size", CASES, ids=lambda v: str(v))
def test_kernel_matches_reference(mode, L, size):
    params, xs, ts, h0, cot = _case(mode, L, size, seed=L)
    hs_k, (dp_k, dx_k, dt_k, dh_k) = run_kernel(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    hs_r, (dp_r, dx_r, dt_r, dh_r) = run_reference(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    for name, a in [("hs", hs_k), ("dxs", dx_k), ("dts", dt_k), ("dh0", dh_k)] + \
            [("dparams", x) for x in jax.tree.leaves(dp_k)]:
        assert np.isfinite(a).all(), name
    assert_rel(hs_k, hs_r, TOL, "hs")
    assert_rel(dp_k, dp_r, TOL, "dparams")
    assert_rel(dx_k, dx_r, TOL, "dxs")
    assert_rel(dt_k, dt_r, TOL, "dts")
    assert_rel(dh_k, dh_r, TOL, "dh0")
    # both agree with the float64 oracle
    want = np_cfc_scan(params, xs, ts, h0, mode)
    assert rel_err(hs_k, want) <= TOL and rel_err(hs_r, want) <= TOL


def test_more_than_65535_samples():
    # The weight-gradient grid holds the samples on its x axis (a y axis stops at 65535): a batch past that
    # limit gives the reference's gradients, and every sample's share reaches the parameter gradient.
    params, xs, ts, h0, cot = _case("default", 1, (65536 + 37, 3, 2, 3, 4), seed=5)
    hs_k, (dp_k, dx_k, dt_k, dh_k) = run_kernel(_fwd_bwd_fn("default"), params, xs, ts, h0, cot)
    hs_r, (dp_r, dx_r, dt_r, dh_r) = run_reference(_fwd_bwd_fn("default"), params, xs, ts, h0, cot)
    assert_rel(hs_k, hs_r, TOL, "hs")
    assert_rel(dp_k, dp_r, 1e-4, "dparams")  # sums over 65573 samples: summation order differs
    assert_rel(dx_k, dx_r, TOL, "dxs")
    assert_rel(dt_k, dt_r, TOL, "dts")
    assert_rel(dh_k, dh_r, TOL, "dh0")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ts_kind", ["zero", "scalar", "per_sample"])
def test_kernel_ts_forms(mode, ts_kind):
    kind = "per_sample" if ts_kind == "per_sample" else "scalar"
    params, xs, ts, h0, cot = _case(mode, 1, "mid", seed=3, ts_kind=kind)
    if ts_kind == "zero":
        ts = np.zeros((xs.shape[0], xs.shape[1]), np.float32)
    hs_k, g_k = run_kernel(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    hs_r, g_r = run_reference(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    assert_rel(hs_k, hs_r, TOL, "hs")
    assert_rel(g_k, g_r, TOL, "grads")
    np.testing.assert_allclose(hs_k, np_cfc_scan(params, xs, ts, h0, mode), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_huge_finite_ts_gives_finite_gradients(mode):
    """ts = FLT_MAX at some steps and large inputs (|ff1| well above 1): mode pure's backward formed
    e (1 - ts |f|) with ts |f| = inf and e = 0, a NaN (0 * inf) in every parameter gradient; the reference's
    autodiff gives finite values, and the kernel now forms e - (e ts) |f|."""
    params, xs, ts, h0, cot = _case(mode, 1, "mid", seed=6)
    xs = 20.0 * xs
    ts[:, ::7] = np.finfo(np.float32).max
    hs_k, g_k = run_kernel(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    hs_r, g_r = run_reference(_fwd_bwd_fn(mode), params, xs, ts, h0, cot)
    for name, a in [("hs", hs_r)] + [("reference grad", x) for x in jax.tree.leaves(g_r)]:
        assert np.isfinite(a).all(), name  # the comparison below is between finite values
    for name, a in [("hs", hs_k)] + [("kernel grad", x) for x in jax.tree.leaves(g_k)]:
        assert np.isfinite(a).all(), name
    assert_rel(hs_k, hs_r, TOL, "hs")
    assert_rel(g_k, g_r, TOL, "grads")


@pytest.mark.parametrize("mode", MODES)
def test_kernel_negative_traced_ts_gives_nan(mode):
    params, xs, ts, h0, _ = _case(mode, 1, "odd", seed=4)
    ts[1, 2] = -1.0
    with jax.default_matmul_precision("highest"):
        hs = np.asarray(jax.jit(lambda p, x, t, h: jaxfox.cfc_scan(p, x, t, h, mode=mode))(params, xs, ts, h0))
    bad = ts < 0
    assert np.isnan(hs[bad]).all() and np.isfinite(hs[~bad]).all()
    np.testing.assert_allclose(hs[[0, 2]], np_cfc_scan(params, xs, ts, h0, mode)[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_default_h0_and_cell(mode):
    params, xs, ts, h0, cot = _case(mode, 2, "odd", seed=5)

    def f(p, x, t):
        return jaxfox.cfc_scan(p, x, t, mode=mode), jaxfox.cfc_cell(p, jnp.asarray(h0), x[:, 0], t[:, 0], mode=mode)

    hs, h1 = run_kernel(f, params, xs, ts)
    np.testing.assert_allclose(hs, np_cfc_scan(params, xs, ts, None, mode), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h1, np_cfc_scan(params, xs[:, :1], ts[:, :1], h0, mode)[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", ["odd", (2, 9, 48, 128, 128)])  # the second: the one-exchange kernels' geometry
def test_kernel_vmap_ensemble(mode, size):
    """vmap over an ensemble axis of params and inputs (broadcast_all: the kernels see V instances)."""
    E = 3
    cases = [_case(mode, 1, size, seed=10 + e) for e in range(E)]
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *[c[k] for c in cases]) for k in range(5)]
    fn = jax.vmap(_fwd_bwd_fn(mode))
    text = hlo(fn, *stacked)
    assert "jaxfox_cfc_fwd" in text and "jaxfox_cfc_bwd" in text
    got = run_kernel(fn, *stacked)
    want = run_reference(jax.vmap(_fwd_bwd_fn(mode)), *stacked)
    assert_rel(got, want, TOL, "vmapped fwd+bwd")
    for e in range(E):
        one = run_kernel(_fwd_bwd_fn(mode), *cases[e])
        assert_rel(jax.tree.map(lambda a: a[e], got), one, 1e-6, f"member {e}")


@pytest.mark.parametrize("mode", MODES)
def test_kernel_check_grads(mode):
    """check_grads through the custom_vjp (kernel forward and backward), float32 numerical JVPs."""
    params, xs, ts, h0, _ = _case(mode, 1, (2, 3, 3, 4, 5), seed=6)
    f = jax.jit(lambda p, x, t, h: jaxfox.cfc_scan(p, x, t, h, mode=mode))
    with jax.default_matmul_precision("highest"):
        check_grads(f, (params, xs, ts + 0.5, h0), order=1, modes=["rev"], eps=1e-2,
                                  atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Batch independence and determinism.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("L", [0, 1, 2])
def test_single_sample_equals_batch_member(mode, L):
    params, xs, ts, h0, cot = _case(mode, L, "bench", seed=7)
    fn = _fwd_bwd_fn(mode)
    hs, (_, dx, dt, dh) = run_kernel(fn, params, xs, ts, h0, cot)
    for i in (0, 17, 31):
        s = slice(i, i + 1)
        hs1, (_, dx1, dt1, dh1) = run_kernel(fn, params, xs[s], ts[s], h0[s], cot[s])
        assert rel_err(hs1, hs[s]) <= 1e-6, i
        assert np.array_equal(hs1, hs[s]), f"hs of sample {i} alone differs bitwise from inside the batch"
        for name, a, b in (("dxs", dx1, dx[s]), ("dts", dt1, dt[s]), ("dh0", dh1, dh[s])):
            assert rel_err(a, b) <= 1e-6, (name, i)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", ["bench", "odd"])
@pytest.mark.parametrize("L", [1, 2])  # 1: the register / one-exchange kernels (cfc_init's default depth); 2: the others
def test_gradients_bitwise_repeatable(mode, size, L):
    params, xs, ts, h0, cot = _case(mode, L, size, seed=8)
    args = [jax.device_put(a) for a in (params, xs, ts, h0, cot)]
    with jax.default_matmul_precision("highest"):
        f = jax.jit(_fwd_bwd_fn(mode))
        first = jax.device_get(f(*args))
        for run in range(9):
            again = jax.device_get(f(*args))
            assert _arrays_equal(again, first), f"run {run + 2} differs"
        # a second compilation of the same computation gives the same bits
        other = jax.device_get(jax.jit(_fwd_bwd_fn(mode))(*args))
    assert _arrays_equal(other, first)
    for leaf in jax.tree.leaves(first[1][0]):
        assert np.isfinite(leaf).all() and np.any(leaf != 0)


_CMD_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfox
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {}
    for mode in ("default", "no_gate", "pure"):
        for (B, T, I, H, U, L) in ((32, 256, 48, 128, 128, 1), (32, 256, 48, 128, 128, 2), (3, 5, 7, 9, 13, 1),
                                   (3, 5, 7, 9, 13, 2)):
            params = jaxfox.cfc_init(jax.random.key(0), I, H, backbone_units=U, backbone_layers=L, mode=mode)
            rng = np.random.default_rng(1)
            params = jax.tree.map(lambda a: a + jnp.asarray(0.05 * rng.standard_normal(a.shape), jnp.float32), params)
            xs = rng.standard_normal((B, T, I)).astype(np.float32)
            ts = rng.uniform(0.1, 2.0, (B, T)).astype(np.float32)
            h0 = (0.5 * rng.standard_normal((B, H))).astype(np.float32)
            cot = rng.standard_normal((B, T, H)).astype(np.float32)

            def f(p, x, t, h, c):
                hs, vjp = jax.vjp(lambda *a: jaxfox.cfc_scan(*a, mode=mode), p, x, t, h)
                return [hs] + jax.tree.leaves(vjp(c))

            g = jax.jit(f)
            for run in range(3):  # command buffers are recorded / updated over the first executions
                res = jax.device_get(g(params, xs, ts, h0, cot))
                for k, a in enumerate(res):
                    out[f"cfc_{mode}_{B}_L{L}_{k}_run{run}"] = a
    for shape in ((32, 1 << 20), (100000, 8), (257, 1025)):
        x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
        r = jax.jit(lambda x: jaxfox.reduce_axis0(x * 2.0) + 1.0)
        for run in range(3):
            out[f"reduce_{shape[0]}_{shape[1]}_run{run}"] = np.asarray(r(x))
    np.savez(sys.argv[1], **out)
    print("DONE", len(out))
""")


def test_command_buffers_on_and_off_identical(tmp_path):
    assert_command_buffers_identical(_CMD_BUFFER_SCRIPT, tmp_path)


# ----------------------------------------------------------------------------------------------
# reduce_axis0 kernel.
REDUCE_SHAPES = [(32, 1 << 20), (1, 1), (1, 4099), (3, 5), (4, 256), (5, 1027), (65, 1), (257, 3),
                 (1000, 1025), (4097, 5), (31, 1025), (130, 4096), (100000, 8), (3000, 70000)]


def test_reduce_kernel_is_used():
    x = jnp.zeros((32, 1000), jnp.float32)
    assert "jaxfox_reduce_axis0" in hlo(jaxfox.reduce_axis0, x)
    assert "jaxfox_reduce_axis0" in hlo(jax.vmap(jaxfox.reduce_axis0), x[None])
    assert "jaxfox_reduce_axis0" not in hlo(jaxfox.reduce_axis0, x, reference=True)


@pytest.mark.parametrize("shape", REDUCE_SHAPES, ids=str)
def test_reduce_kernel_vs_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    f = jax.jit(jaxfox.reduce_axis0)
    assert_sum_close(f(x), x)
    xi = rng.integers(-1000, 1001, size=shape).astype(np.float32)  # exact in any order
    np.testing.assert_array_equal(np.asarray(f(xi), np.float64), xi.astype(np.float64).sum(axis=0))


@pytest.mark.parametrize("shape", [(32, 1 << 20), (100000, 8), (4097, 5), (257, 1025)], ids=str)
def test_reduce_kernel_bitwise_repeatable(shape):
    x = jax.device_put(np.random.default_rng(3).standard_normal(shape).astype(np.float32))
    f = jax.jit(jaxfox.reduce_axis0)
    first = np.asarray(f(x))
    for _ in range(9):
        assert np.array_equal(np.asarray(f(x)), first)
    assert np.array_equal(np.asarray(jax.jit(lambda x: jaxfox.reduce_axis0(x))(x)), first)


def test_reduce_kernel_nan_inf():
    x = np.random.default_rng(4).standard_normal((300, 2000)).astype(np.float32)
    x[13, 0] = np.nan
    x[0, 1] = np.inf
    x[299, 2] = -np.inf
    x[5, 3], x[250, 3] = np.inf, -np.inf
    x[:, 4] = np.nan
    x[100, 1999] = np.nan
    got = np.asarray(jax.jit(jaxfox.reduce_axis0)(x))
    assert np.isnan(got[[0, 3, 4, 1999]]).all()
    assert got[1] == np.inf and got[2] == -np.inf
    assert_sum_close(got[5:1999], x[:, 5:1999])


@pytest.mark.parametrize("shape", [(4, 32, 1000), (3, 1000, 7), (2, 1, 5), (5, 70, 4099)], ids=str)
def test_reduce_kernel_vmap(shape):
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(jaxfox.reduce_axis0))(x))
    for v in range(shape[0]):
        assert_sum_close(got[v], x[v])
    # each instance alone gives the same bits as inside the vmapped call
    for v in range(shape[0]):
        assert np.array_equal(np.asarray(jax.jit(jaxfox.reduce_axis0)(x[v])), got[v])


# ----------------------------------------------------------------------------------------------
# Training through the kernels.
def _leaky_sign_batch(rng, B, T, decay=0.8):
    """xs [B, T, 1] ~ N(0, 1); label y_t = [e_t > 0], e_t = decay * e_{t-1} + x_t (sign of a leaky running sum)."""
    x = rng.standard_normal((B, T, 1)).astype(np.float32)
    e = np.zeros(B)
    y = np.zeros((B, T), np.float32)
    for t in range(T):
        e = decay * e + x[:, t, 0]
        y[:, t] = e > 0
    return x, y


def test_training_loss_falls():
    import optax

    B, T, H, U = 32, 32, 32, 32
    params = {"cfc": jaxfox.cfc_init(jax.random.key(0), 1, H, backbone_units=U),
              "w": jnp.zeros((H, 1)), "b": jnp.zeros((1,))}
    opt = optax.adam(1e-2)
    state = opt.init(params)

    def loss_fn(p, x, y):
        logits = (jaxfox.cfc_scan(p["cfc"], x) @ p["w"] + p["b"])[..., 0]
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    x0, y0 = _leaky_sign_batch(np.random.default_rng(0), B, T)
    assert "jaxfox_cfc_bwd" in step.lower(params, state, x0, y0).as_text()
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(100):
        x, y = _leaky_sign_batch(rng, B, T)
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    first, last = np.mean(losses[:5]), np.mean(losses[-10:])
    assert last <= 0.5 * first, f"loss {first:.4f} -> {last:.4f}"



# ----------------------------------------------------------------------------------------------
# The kernel paths the default choice does not take at the sizes above: forced cluster sizes 1, 2 and
# 8 (JAXFOX_CFC_CLUSTER, read once per process, hence a child process each), hidden size 1 (cluster of
# 1 by default), and weights too large for shared memory at any cluster size (read from global memory);
# the register forward (cfc_fwd_reg_kernel) forced on, also at cluster sizes 1 and 8, and forced off
# (JAXFOX_CFC_REG), at backbone depths 0 and 1 (the depths it takes), including inputs wider than the
# 256 threads of a CTA (I = 270, 300) and the main job's sizes.
_PATH_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np, jaxfox
    from conftest import random_cfc_params, random_inputs
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {{}}
    for i, (mode, L, (B, T, I, H, U)) in enumerate({cases!r}):
        params = random_cfc_params(jax.random.key(i), I, H, U, L, mode, scale=0.05, seed=i)
        xs, ts, h0 = random_inputs(B, T, I, H, seed=i + 1)
        cot = np.random.default_rng(i + 2).standard_normal((B, T, H)).astype(np.float32)
        def f(params, xs, ts, h0, cot, mode=mode):
            hs, vjp = jax.vjp(lambda p, x, t, h: jaxfox.cfc_scan(p, x, t, h, mode=mode), params, xs, ts, h0)
            return hs, vjp(cot)
        with jax.default_matmul_precision("highest"):
            assert "jaxfox_cfc_bwd" in jax.jit(f).lower(params, xs, ts, h0, cot).as_text()
            got = jax.device_get(jax.jit(f)(params, xs, ts, h0, cot))
            with jaxfox.use_reference():
                want = jax.device_get(jax.jit(f)(params, xs, ts, h0, cot))
        for j, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            out[f"case{{i}}_leaf{{j}}_kernel"] = np.asarray(a)
            out[f"case{{i}}_leaf{{j}}_reference"] = np.asarray(b)
    np.savez(sys.argv[1], **out)
    print("DONE")
""")

_SMALL_CASES = [("default", 1, (4, 9, 16, 64, 40)), ("pure", 2, (3, 7, 7, 16, 24)), ("no_gate", 0, (2, 5, 5, 24, 8))]
_PATH_CASES = {
    "cluster1": ({"JAXFOX_CFC_CLUSTER": "1"}, _SMALL_CASES),
    "cluster2": ({"JAXFOX_CFC_CLUSTER": "2"}, _SMALL_CASES),
    "cluster8": ({"JAXFOX_CFC_CLUSTER": "8"}, _SMALL_CASES),
    # H = 1 (cluster of 1 by default), weights of ~5 MB (no cluster size fits them in shared memory), the main
    # job's CfC (I=32 H=32 U=64: one CTA per sample, register forward) and H=64 (a cluster of 2).
    "default_choice": ({}, [("default", 1, (3, 6, 4, 1, 5)), ("pure", 0, (2, 5, 3, 1, 8)),
                           ("default", 1, (2, 4, 16, 512, 512)), ("default", 1, (32, 64, 32, 32, 64)),
                           ("no_gate", 1, (5, 16, 32, 64, 64)), ("default", 1, (2, 1, 48, 128, 128)),
                           ("no_gate", 1, (3, 2, 48, 128, 128)),
                           # the one-exchange kernels with short last slices: I = 61 (16, 16, 16, 13 inputs a CTA),
                           # H = 125 (32, 32, 32, 29 hidden units)
                           ("default", 1, (3, 5, 61, 125, 128)), ("no_gate", 1, (2, 4, 61, 125, 128)),
                           # ... and with CTAs that own no inputs (I = 5: the last; I = 1: all but the first)
                           ("default", 1, (2, 3, 5, 128, 128)), ("no_gate", 1, (2, 3, 1, 128, 128))]),
    # the register kernels with their geometry read at run time (JAXFOX_CFC_FIXED=0) at the sizes whose geometry is
    # otherwise compiled in (the benchmark's C = 4, the main job's C = 1)
    "runtime_geometry": ({"JAXFOX_CFC_FIXED": "0"}, [("default", 1, (4, 17, 48, 128, 128)),
                                                     ("no_gate", 1, (3, 9, 48, 128, 128)),
                                                     ("default", 1, (5, 16, 32, 32, 64))]),
    # the register kernels' compiled bench geometry (<4, 24, 8, 16, 8> forward, <4, 64, 8, 32, 4> backward), which the
    # one-exchange kernels (cfc_fwd_ar_kernel / cfc_bwd_ar_kernel) replace by default
    "no_allreduce": ({"JAXFOX_CFC_ALLREDUCE": "0"}, [("default", 1, (4, 17, 48, 128, 128)),
                                                     ("no_gate", 1, (3, 9, 48, 128, 128))]),
}
_REG_CASES = [("default", 1, (4, 9, 16, 64, 40)), ("pure", 1, (3, 7, 7, 33, 17)), ("no_gate", 0, (2, 5, 300, 20, 8)),
              ("default", 1, (2, 5, 270, 16, 24)), ("default", 1, (8, 16, 32, 32, 64)), ("pure", 0, (3, 6, 5, 9, 8))]
_PATH_CASES.update({
    "register_forward": ({"JAXFOX_CFC_REG": "1"}, _REG_CASES),
    "register_forward_cluster1": ({"JAXFOX_CFC_REG": "1", "JAXFOX_CFC_CLUSTER": "1"}, _REG_CASES),
    "register_forward_cluster8": ({"JAXFOX_CFC_REG": "1", "JAXFOX_CFC_CLUSTER": "8"}, _REG_CASES[:4]),
    "smem_forward": ({"JAXFOX_CFC_REG": "0"}, _REG_CASES),
    # the shared-memory backward where the register backward would run (one backbone layer, slices non-empty)
    "smem_backward": ({"JAXFOX_CFC_REG_BWD": "0"}, _REG_CASES + _SMALL_CASES[:1]),
    "smem_backward_cluster2": ({"JAXFOX_CFC_REG_BWD": "0", "JAXFOX_CFC_CLUSTER": "2"}, _SMALL_CASES[:1]),
    # the register backward in a cluster at T = 1, 2, 3, with a partial last slice (H = 33, U = 34: 17 + 16), NH not a
    # multiple of the split width and U not a multiple of 4
    "register_backward_cluster2_short": ({"JAXFOX_CFC_CLUSTER": "2"}, [("default", 1, (2, 1, 7, 33, 34)),
                                                                      ("pure", 1, (3, 2, 7, 33, 34)),
                                                                      ("no_gate", 1, (2, 3, 7, 33, 34))]),
})


@pytest.mark.parametrize("path", sorted(_PATH_CASES))
def test_kernel_paths_match_reference(path, tmp_path):
    import os

    env, cases = _PATH_CASES[path]
    script = _PATH_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), cases=cases)
    arrays = run_child_npz(script, "", tmp_path / f"{path}.npz", env=env)
    keys = sorted(k for k in arrays if k.endswith("_kernel"))
    assert len(keys) >= 5 * len(cases)  # hs + 4 gradient leaves at least per case
    for k in keys:
        got, want = arrays[k], arrays[k[:-len("_kernel")] + "_reference"]
        assert np.isfinite(got).all(), k
        assert rel_err(got, want) <= TOL, f"{path} {k}: rel err {rel_err(got, want):.3g}"
