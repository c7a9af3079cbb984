"""CPU tests of jaxfox.vsn (vsn_init, vsn).

Oracle: ``np_vsn`` below, float64 NumPy written from OPS.md "GRN, GLU, VSN" (TFT eqs. 6-8): the
selection GRN on the flattened variables, a softmax over the m variables, one GRN per variable,
the weighted sum. It reuses only the float64 GRN oracle of test_grn.py (itself independent of the
library). Gradients are checked against float64 central differences of it.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox
from conftest import assert_raises_naming as _bad, central_diff_grad, cuda_custom_calls, rel_err
from jaxfox import vsn, vsn_init
from test_grn import assert_f32_close, assert_tree_close, fd_grads, np_grn, tf32_weights
from test_grn import TC_BWD, TC_FWD, REDUCE, tc_emulated  # noqa: F401 (tc_emulated: a fixture)


# ----------------------------------------------------------------------------------------------
# Float64 oracle.
def np_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_vsn(params, xs, c=None, eps=1e-5):
    """(out [..., O], weights [..., m]) in float64."""
    xs = np.asarray(xs, np.float64)
    m, d = xs.shape[-2:]
    v = np_softmax(np_grn(params["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c, eps))
    var = params["variables"]
    ys = np.stack([np_grn({k: np.asarray(x)[j] for k, x in var.items()}, xs[..., j, :], None, eps)
                   for j in range(m)], axis=-2)
    return np.sum(v[..., None] * ys, axis=-2), v


def random_vsn_params(m, d, H, O, C=None, seed=0, scale=0.3):
    p = vsn_init(jax.random.key(seed), m, d, H, O, context_size=C)
    rng = np.random.default_rng(seed + 1000)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32), p)


def _inputs(m, d, C, lead, seed=0):
    rng = np.random.default_rng(seed + 2000)
    xs = rng.standard_normal(lead + (m, d)).astype(np.float32)
    c = None if C is None else rng.standard_normal(lead + (C,)).astype(np.float32)
    return xs, c


def _call(p, xs, c, eps=1e-5):
    return vsn(p, jnp.asarray(xs), None if c is None else jnp.asarray(c), eps=eps)


CONFIGS = [  # (m, d, H, O, C, lead)
    (3, 2, 5, 4, None, (4,)),
    (4, 3, 6, 3, 2, (2, 3)),      # context; per-variable skip Dense (d != O)
    (2, 4, 3, 4, None, (3,)),     # d = O: identity skip in the per-variable GRNs
    (5, 1, 4, 2, 3, (2,)),        # d = 1: identity skip in the selection GRN (m*d = m)
]


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,d,H,O,C,lead", CONFIGS)
def test_matches_float64_oracle(m, d, H, O, C, lead):
    p = random_vsn_params(m, d, H, O, C, seed=m + d)
    xs, c = _inputs(m, d, C, lead, seed=H)
    out, w = _call(p, xs, c)
    assert out.shape == lead + (O,) and w.shape == lead + (m,)
    want_out, want_w = np_vsn(p, xs, c)
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    out, w = jax.jit(functools.partial(vsn, eps=1e-3))(p, jnp.asarray(xs), None if c is None else jnp.asarray(c))
    assert_f32_close(out, np_vsn(p, xs, c, 1e-3)[0])


@pytest.mark.parametrize("m,d,H,O,C,lead", CONFIGS[:2] + CONFIGS[3:])
def test_grads_match_oracle_finite_differences(m, d, H, O, C, lead):
    p = random_vsn_params(m, d, H, O, C, seed=2 * m + d)
    xs, c = _inputs(m, d, C, lead, seed=3 + H)
    rng = np.random.default_rng(5)
    r1, r2 = rng.standard_normal(lead + (O,)), rng.standard_normal(lead + (m,))

    def loss(p, xs, c=None):
        out, w = vsn(p, xs, c)
        return jnp.sum(out * jnp.asarray(r1, jnp.float32)) + jnp.sum(w * jnp.asarray(r2, jnp.float32))

    args = (p, jnp.asarray(xs)) + (() if c is None else (jnp.asarray(c),))
    g = jax.grad(loss, argnums=tuple(range(len(args))))(*args)

    def np_loss(t):
        out, w = np_vsn(t[0], t[1], t[2] if c is not None else None)
        return float(np.sum(out * r1) + np.sum(w * r2))

    want = fd_grads(np_loss, (p, xs) + (() if c is None else (c,)))
    # A float32 backward against float64 truth: leaves whose contributions cancel (skip_w here) reach
    # ~1e-4 relative (CI saw 1.04e-4), hence 3e-4.
    assert_tree_close(g[0]["selection"], want[0]["selection"], 3e-4)
    assert_tree_close(g[0]["variables"], want[0]["variables"], 3e-4)
    assert_f32_close(g[1], want[1], 3e-4)
    if c is not None:
        assert_f32_close(g[2], want[2], 3e-4)


def test_check_grads():
    p = random_vsn_params(3, 2, 4, 3, 2, seed=11)
    xs, c = _inputs(3, 2, 2, (2,), seed=12)
    check_grads(lambda p, x, c: vsn(p, x, c), (p, jnp.asarray(xs), jnp.asarray(c)), order=1, modes=("rev",),
                atol=2e-2, rtol=2e-2, eps=1e-2)


def test_single_variable_weight_is_exactly_one():
    p = random_vsn_params(1, 4, 5, 3, 2, seed=13)
    xs, c = _inputs(1, 4, 2, (3, 5), seed=14)
    xs[0, 0] = 1e4                     # extreme logits make no difference
    out, w = _call(p, xs, c)
    np.testing.assert_array_equal(np.asarray(w), np.ones((3, 5, 1), np.float32))
    assert_f32_close(out, np_vsn(p, xs, c)[0])
    # the output is the variable's GRN alone; nothing flows into the selection network
    gp = jax.grad(lambda p: jnp.sum(vsn(p, jnp.asarray(xs), jnp.asarray(c))[0]))(p)
    for leaf in jax.tree.leaves(gp["selection"]):
        assert np.all(np.asarray(leaf) == 0.0)
    assert any(np.any(np.asarray(leaf) != 0.0) for leaf in jax.tree.leaves(gp["variables"]))


def test_tiny_eps_zero_padding_row_has_finite_gradients():
    """A zero row of xs (padding) of freshly initialised params (zero biases) makes every LayerNorm row of that
    sample constant; with a small valid eps (1e-30, a normal float32) autodiff of rsqrt(var + eps) gave 0 * inf =
    NaN there, and so NaN in every parameter gradient. They are finite, and the padding row's input gradient
    (~rsqrt(eps) = 1e15) matches float64 central differences of the oracle (step 1e-20: var << eps, linear)."""
    m, d, H, O, eps = 3, 2, 4, 5, 1e-30
    p = vsn_init(jax.random.key(24), m, d, H, O)
    rng = np.random.default_rng(25)
    xs = rng.standard_normal((3, m, d)).astype(np.float32)
    xs[1] = 0.0
    r1, r2 = rng.standard_normal((3, O)), rng.standard_normal((3, m))

    def loss(q, x):
        out, w = vsn(q, x, eps=eps)
        return jnp.sum(out * jnp.asarray(r1, jnp.float32)) + jnp.sum(w * jnp.asarray(r2, jnp.float32))

    gp, gx = jax.grad(loss, argnums=(0, 1))(p, jnp.asarray(xs))
    for leaf in jax.tree.leaves((gp, gx)):
        assert np.isfinite(np.asarray(leaf)).all()

    def np_loss_row1(x1):
        x = xs.astype(np.float64)
        x[1] = x1
        out, w = np_vsn(p, x, None, eps)
        return float(np.sum(out[1] * r1[1]) + np.sum(w[1] * r2[1]))

    want = central_diff_grad(np_loss_row1, np.zeros((m, d)), 1e-20)
    assert np.abs(want).max() > 1e13
    assert rel_err(gx[1], want) <= 1e-5


def test_context_broadcasts_over_time():
    m, d, H, O, C = 3, 2, 4, 5, 3
    p = random_vsn_params(m, d, H, O, C, seed=15)
    rng = np.random.default_rng(16)
    xs = rng.standard_normal((2, 6, m, d)).astype(np.float32)
    c = rng.standard_normal((2, 1, C)).astype(np.float32)
    out, w = vsn(p, jnp.asarray(xs), jnp.asarray(c))
    want_out, want_w = np_vsn(p, xs, np.broadcast_to(c, (2, 6, C)))
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)


def test_bfloat16_inputs_keep_float32_statistics():
    m, d, H, O = 3, 4, 5, 4
    p = random_vsn_params(m, d, H, O, seed=17)
    rng = np.random.default_rng(18)
    xs16 = jnp.asarray((150.0 + rng.integers(-4, 5, size=(4, m, d))).astype(np.float32), jnp.bfloat16)
    xs = np.asarray(xs16.astype(jnp.float32))
    out, w = vsn(p, xs16)
    assert out.dtype == jnp.float32 and w.dtype == jnp.float32
    want_out, want_w = np_vsn(p, xs)
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)
    r = rng.standard_normal((4, O)).astype(np.float32)
    g16 = jax.grad(lambda x: jnp.sum(vsn(p, x)[0] * r))(xs16)
    g32 = jax.grad(lambda x: jnp.sum(vsn(p, x)[0] * r))(xs16.astype(jnp.float32))
    assert g16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g16), np.asarray(g32.astype(jnp.bfloat16)))


def test_bfloat16_broadcast_context_gradient_rounded_once():
    """A bfloat16 static context [B, 1, C] for xs [B, T, m, d]: its gradient is the float32 gradient (summed over
    T in float32) rounded once, as the docstring says, not a bfloat16 sum over T."""
    m, d, H, O, C = 3, 2, 4, 5, 2
    p = random_vsn_params(m, d, H, O, C, seed=19)
    rng = np.random.default_rng(20)
    B, T = 8, 4096
    xs16 = jnp.asarray(rng.standard_normal((B, T, m, d)), jnp.bfloat16)
    c16 = jnp.asarray(rng.standard_normal((B, 1, C)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((B, T, O)), jnp.float32)
    gc = jax.grad(lambda c: jnp.sum(vsn(p, xs16, c)[0] * r))(c16)
    fc = jax.grad(lambda c: jnp.sum(vsn(p, xs16.astype(jnp.float32), c)[0] * r))(c16.astype(jnp.float32))
    assert gc.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gc), np.asarray(fc.astype(jnp.bfloat16)))


def test_errors():
    m, d, H, O, C = 3, 2, 4, 5, 2
    p = random_vsn_params(m, d, H, O, C)
    xs = jnp.ones((4, m, d))
    c = jnp.ones((4, C))
    _bad(lambda: vsn(p, xs.astype(jnp.int32), c), TypeError, "xs", "int32")
    _bad(lambda: vsn(p, xs.astype(jnp.float16), c), TypeError, "xs", "float16")
    _bad(lambda: vsn(p, xs[:, :2], c), ValueError, "xs", "[..., 3, 2]", "(4, 2, 2)")
    _bad(lambda: vsn(p, xs[..., :1], c), ValueError, "xs", "[..., 3, 2]")
    _bad(lambda: vsn(p, jnp.ones((2,)), c), ValueError, "xs")
    _bad(lambda: vsn(p, xs), ValueError, "context", "required")
    # the message gives what was passed: a Mapping that is not a dict (flax FrozenDict, nnx.State) has the keys
    import types

    _bad(lambda: vsn(types.MappingProxyType(p), xs, c), ValueError, "params", "vsn_init", "got mappingproxy")
    _bad(lambda: vsn({"selection": p["selection"]}, xs, c), ValueError, "params", "got ['selection']")
    _bad(lambda: vsn(p, xs, c[:, :1]), ValueError, "context", "[..., 2]")
    _bad(lambda: vsn(p, xs, jnp.ones((3, C))), ValueError, "context")
    # rank promotion: a [B, C] context of [B, T, m, d] inputs would be aligned with T (accepted when B == T)
    xs4 = jnp.ones((4, 4) + xs.shape[1:])
    _bad(lambda: vsn(p, xs4, c), ValueError, "context", "rank 3", "context[:, None]")
    q = random_vsn_params(m, d, H, O)
    _bad(lambda: vsn(q, xs, c), ValueError, "context", "w3")
    _bad(lambda: vsn({"selection": q["selection"]}, xs), ValueError, "params", "variables")
    _bad(lambda: vsn({**q, "selection": random_vsn_params(m + 1, d, H, O)["selection"]}, xs), ValueError,
         "params['selection']")
    bad_var = {**q["variables"], "w1": q["variables"]["w1"][:, :, :3]}
    _bad(lambda: vsn({**q, "variables": bad_var}, xs), ValueError, "params['variables']['w1']")
    bad_var = {k: v for k, v in q["variables"].items() if k != "gamma"}
    _bad(lambda: vsn({**q, "variables": bad_var}, xs), ValueError, "params['variables']", "gamma", "vsn_init")
    bad_var = {**q["variables"], "b4": q["variables"]["b4"][:2]}
    _bad(lambda: vsn({**q, "variables": bad_var}, xs), ValueError, "params['variables']['b4']")
    _bad(lambda: vsn(q, xs, eps=0.0), ValueError, "eps")
    _bad(lambda: vsn(q, xs, eps=1e-46), ValueError, "eps", "float32")  # the kernels' float32 eps attribute would be 0
    _bad(lambda: vsn_init(jax.random.key(0), 0, 2, 4, 5), ValueError, "num_vars")
    _bad(lambda: vsn_init(jax.random.key(0), 3, 2, 4, 5, context_size=-1), ValueError, "context_size")


def test_init():
    m, d, H, O, C = 4, 3, 8, 6, 5
    p = vsn_init(jax.random.key(1), m, d, H, O, context_size=C)
    sel, var = p["selection"], p["variables"]
    assert sel["w2"].shape == (m * d, H) and sel["w3"].shape == (C, H) and sel["w4"].shape == (H, m)
    assert sel["skip_w"].shape == (m * d, m)
    assert var["w2"].shape == (m, d, H) and var["w1"].shape == (m, H, H) and var["w5"].shape == (m, H, O)
    assert var["skip_w"].shape == (m, d, O) and var["gamma"].shape == (m, O) and "w3" not in var
    w2 = np.asarray(var["w2"])
    bound = math.sqrt(6.0 / (d + H))
    assert np.abs(w2).max() <= bound
    assert not np.array_equal(w2[0], w2[1])              # every variable has its own weights
    assert np.all(np.asarray(var["gamma"]) == 1.0) and np.all(np.asarray(var["b1"]) == 0.0)
    assert "skip_w" not in vsn_init(jax.random.key(1), m, 4, H, 4)["variables"]
    assert "skip_w" not in vsn_init(jax.random.key(1), m, 1, H, 4)["selection"]


def test_jit_vmap_grad():
    m, d, H, O, C = 3, 2, 4, 3, 2
    p = random_vsn_params(m, d, H, O, C, seed=21)
    xs, c = _inputs(m, d, C, (3, 4), seed=22)
    eager = _call(p, xs, c)
    jitted = jax.jit(vsn)(p, jnp.asarray(xs), jnp.asarray(c))
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    out, w = jax.vmap(lambda x, z: vsn(p, x, z))(jnp.asarray(xs), jnp.asarray(c))
    assert_f32_close(out, np_vsn(p, xs, c)[0])
    ps = [random_vsn_params(m, d, H, O, C, seed=30 + s) for s in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *ps)
    outs, _ = jax.vmap(lambda q: vsn(q, jnp.asarray(xs), jnp.asarray(c)))(stacked)
    for s in range(2):
        assert_f32_close(outs[s], np_vsn(ps[s], xs, c)[0])
    r = np.random.default_rng(23).standard_normal((3, 4, O)).astype(np.float32)
    g = jax.jit(jax.grad(lambda q, x: jnp.sum(vsn(q, x, jnp.asarray(c))[0] * r), argnums=(0, 1)))(p, jnp.asarray(xs))
    want = fd_grads(lambda t: float(np.sum(np_vsn(t[0], t[1], c)[0] * r)), (p, xs))
    assert_tree_close(g[0]["variables"], want[0]["variables"], 1e-4)
    assert_f32_close(g[1], want[1], 1e-4)


def test_symbolic_leading_dims_export():
    """xs [..., m, d] with symbolic leading dims (``jax.export`` shape polymorphism): vsn counted the rows with
    int(np.prod(lead)), which raised InconclusiveDimensionOperation."""
    from jax import export

    m, d, H, O, C = 3, 2, 4, 5, 2
    p = random_vsn_params(m, d, H, O, C, seed=26)
    b, t = export.symbolic_shape("b, t")
    f32 = jnp.float32
    exp = export.export(jax.jit(lambda x, c: vsn(p, x, c)))(
        jax.ShapeDtypeStruct((b, t, m, d), f32), jax.ShapeDtypeStruct((b, 1, C), f32))
    assert [a.shape for a in exp.out_avals] == [(b, t, O), (b, t, m)]
    for B, T in ((2, 3), (1, 5)):
        rng = np.random.default_rng(B + T)
        xs = rng.standard_normal((B, T, m, d)).astype(np.float32)
        c = rng.standard_normal((B, 1, C)).astype(np.float32)
        out, w = exp.call(jnp.asarray(xs), jnp.asarray(c))
        want_out, want_w = np_vsn(p, xs, np.broadcast_to(c, (B, T, C)))
        assert_f32_close(out, want_out)
        assert_f32_close(w, want_w)


def test_zero_rows():
    p = random_vsn_params(3, 2, 4, 5)
    out, w = vsn(p, jnp.zeros((0, 7, 3, 2)))
    assert out.shape == (0, 7, 5) and w.shape == (0, 7, 3)


# ----------------------------------------------------------------------------------------------
# The CUDA kernel path (ffi/vsn.cu), traced and lowered for CUDA on this CPU machine with the kernels
# forced on: which FFI calls the program makes, with which operand shapes and attributes.
def _grad_fn(eps=1e-5):
    def loss(p, x, c=None):
        out, w = vsn(p, x, c, eps=eps)
        return jnp.sum(out * out) + jnp.sum(w * jnp.arange(w.shape[-1], dtype=jnp.float32))

    return jax.grad(loss, argnums=(0, 1))


FWD, BWD = "jaxfox_vsn_grn_fwd", "jaxfox_vsn_grn_bwd"
SEL_FWD, SEL_BWD = "jaxfox_grn_fwd", "jaxfox_grn_bwd"   # the selection GRN (ffi/grn.cu, softmax fused)


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "grn_opted_in"])
def test_kernel_path_lowers_for_cuda(kernels_on, monkeypatch, opt_in):
    """The per-variable GRNs run ffi/vsn.cu's kernels; the selection GRN runs ffi/grn.cu's only when opted in
    (JAXFOX_OPT_IN_KERNELS=grn), else XLA code."""
    from jaxfox.reduce import reduce_chunks
    from jaxfox.vsn import _bwd_tiling

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn" if opt_in else "")
    sel = {SEL_FWD, SEL_BWD} if opt_in else set()

    m, d, H, O, R = 48, 4, 32, 32, 2048
    p = vsn_init(jax.random.key(0), m, d, H, O)
    P = d * H + H + H * H + H + 2 * (H * O + O) + d * O + O + 2 * O   # the flat row of one variable
    xs = jnp.zeros((32, 64, m, d))
    calls = cuda_custom_calls(_grad_fn(), p, xs)
    assert set(calls) == {FWD, BWD} | sel and all(len(c) == 1 for c in calls.values())
    fwd, bwd = calls[FWD][0], calls[BWD][0]
    if opt_in:  # the selection GRN: input m d, hidden H, output m, softmax fused; its backward takes d v [R, m]
        Ps = m * d * H + H + H * H + H + 2 * (H * m + m) + m * d * m + m + 2 * m
        Ws = 2 * H + 3 * m + 1   # the residuals a row that the selection GRN's forward saves for its backward
        assert (f"(tensor<{Ps}xf32>, tensor<{R}x{m * d}xf32>) -> (tensor<{R}x{m}xf32>, tensor<{R}x{Ws}xf32>)"
                in calls[SEL_FWD][0] and "softmax = 1 : i64" in calls[SEL_FWD][0])
        assert (f"(tensor<{Ps}xf32>, tensor<{R}x{m * d}xf32>, tensor<{R}x{m}xf32>, tensor<{R}x{Ws}xf32>) -> "
                f"(tensor<{Ps}xf32>, "
                f"tensor<{R}x{m * d}xf32>" in calls[SEL_BWD][0] and "softmax = 1 : i64" in calls[SEL_BWD][0])
    assert f"(tensor<{m}x{P}xf32>, tensor<{R}x{m}x{d}xf32>) -> tensor<{R}x{m}x{O}xf32>" in fwd
    assert f"hidden_size = {H} : i64" in fwd and f"output_size = {O} : i64" in fwd and "eps = 9.99999974E-6" in fwd
    per, blocks = _bwd_tiling(R, m)
    chunks = reduce_chunks(blocks, m * P)
    assert f"tiles_per_block = {per} : i64" in bwd and f"chunks = {chunks} : i64" in bwd
    ws = f"tensor<{chunks * m * P}xf32>" if chunks > 1 else "tensor<0xf32>"
    # the backward takes the selection weights v [R, m] and d out [R, O] (not the [R, m, O] cotangent of the GRNs)
    # and also returns d v [R, m]
    assert (f"(tensor<{m}x{P}xf32>, tensor<{R}x{m}x{d}xf32>, tensor<{R}x{m}xf32>, tensor<{R}x{O}xf32>) -> ") in bwd
    assert (f"-> (tensor<{m}x{P}xf32>, tensor<{R}x{m}x{d}xf32>, tensor<{R}x{m}xf32>, tensor<{blocks}x{m * P}xf32>, "
            f"{ws})") in bwd
    # eps reaches every kernel; a context (selection GRN only: it then runs the XLA reference) and bfloat16 xs
    # keep the per-variable kernel path, whose operands are float32
    calls = cuda_custom_calls(_grad_fn(eps=1e-3), p, xs.astype(jnp.bfloat16))
    assert set(calls) == {FWD, BWD} | sel and all("eps = 1.000000e-03" in c for v in calls.values() for c in v)
    assert f"tensor<{R}x{m}x{d}xf32>" in calls[FWD][0]
    pc = vsn_init(jax.random.key(0), m, d, H, O, context_size=5)
    assert set(cuda_custom_calls(jax.value_and_grad(lambda p, x, c: jnp.sum(vsn(p, x, c)[0])), pc, xs,
                                 jnp.zeros((32, 64, 5)))) == {FWD, BWD}
    # the gradient alone needs no forward kernel: the backward recomputes y and returns d v itself
    grad_only = jax.grad(lambda p, x, c: jnp.sum(vsn(p, x, c)[0]))
    assert set(cuda_custom_calls(grad_only, pc, xs, jnp.zeros((32, 64, 5)))) == {BWD}
    with jaxfox.use_reference():
        assert cuda_custom_calls(_grad_fn(), p, xs) == {}


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "grn_opted_in"])
def test_kernel_path_lowers_for_cuda_under_vmap(kernels_on, monkeypatch, opt_in):
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn" if opt_in else "")
    sel = {SEL_FWD, SEL_BWD} if opt_in else set()
    m, d, H, O, V = 3, 5, 17, 9, 4
    ps = jax.vmap(lambda k: vsn_init(k, m, d, H, O))(jax.random.split(jax.random.key(1), V))
    P = d * H + H + H * H + H + 2 * (H * O + O) + d * O + O + 2 * O
    xs = jnp.zeros((V, 6, 37, m, d))
    calls = cuda_custom_calls(jax.vmap(_grad_fn()), ps, xs)            # params and xs batched
    assert set(calls) == {FWD, BWD} | sel and len(calls[FWD]) == 1
    Ps = m * d * H + H + H * H + H + 2 * (H * m + m) + m * d * m + m + 2 * m   # the selection GRN's flat params
    for rest in calls.get(SEL_FWD, []) + calls.get(SEL_BWD, []):
        assert f"tensor<{V}x{Ps}xf32>" in rest and f"tensor<{V}x{6 * 37}x{m * d}xf32>" in rest
    for rest in calls[FWD] + calls[BWD]:                         # broadcast_all: one call over the V instances
        assert f"tensor<{V}x{m}x{P}xf32>" in rest and f"tensor<{V}x{6 * 37}x{m}x{d}xf32>" in rest
    p = jax.tree.map(lambda a: a[0], ps)
    calls = cuda_custom_calls(jax.vmap(_grad_fn(), in_axes=(None, 0)), p, xs)  # xs only: weights broadcast
    assert set(calls) == {FWD, BWD} | sel and f"tensor<{V}x{m}x{P}xf32>" in calls[FWD][0]


@pytest.mark.parametrize("m,d,H,O,lead", [(3, 4, 33, 32, (5,)), (3, 40, 32, 32, (5,)), (3, 4, 32, 33, (5,)),
                                          (3, 4, 32, 32, (0, 7))])
def test_wide_or_empty_shapes_lower_without_the_kernels(kernels_on, m, d, H, O, lead):
    """Hd, d or O > 32 (jaxfox.vsn.KERNEL_MAX_WIDTH), or no rows: the reference on CUDA too."""
    p = vsn_init(jax.random.key(2), m, d, H, O)
    calls = cuda_custom_calls(_grad_fn(), p, jnp.zeros(lead + (m, d)))
    assert FWD not in calls and BWD not in calls


@pytest.mark.parametrize("m", [1, 3, 48, 200])
@pytest.mark.parametrize("R", [1, 63, 64, 65, 1000, 2048, 12800, 100000, 1 << 20])
def test_bwd_tiling_covers_every_row_tile_once(R, m):
    from jaxfox.vsn import _TARGET_BWD_BLOCKS, _bwd_tiling

    tiles = -(-R // 64)
    per, blocks = _bwd_tiling(R, m)
    assert isinstance(per, int) and isinstance(blocks, int) and per >= 1 and blocks >= 1
    assert blocks * per >= tiles and (blocks - 1) * per < tiles   # every tile in one CTA, no CTA without a tile
    if tiles * m > _TARGET_BWD_BLOCKS:                             # about the targeted CTA count, not far above
        assert blocks * m <= _TARGET_BWD_BLOCKS + m
    else:
        assert per == 1 and blocks == tiles


# ----------------------------------------------------------------------------------------------
# Wider per-variable GRNs on jaxfox.grn's TF32 kernels (opt-in ``grn``), vmapped over the m variables.
def test_tc_path_lowers_for_cuda(kernels_on, monkeypatch):
    """m = 4, d = 16, Hd = O = 128 (the bench widths): one TF32 forward and backward call with a leading instance
    axis m and one reduce_axis0; the weight gradients, the selection GRN (Hd = 128, softmax) and everything else
    are XLA code."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn")
    m, d, H, O, R = 4, 16, 128, 128, 100
    p = vsn_init(jax.random.key(3), m, d, H, O)
    xs = jnp.zeros((4, 25, m, d))
    calls = cuda_custom_calls(_grad_fn(), p, xs)
    assert set(calls) == {TC_FWD, TC_BWD, REDUCE} and all(len(c) == 1 for c in calls.values()), set(calls)
    t = lambda *s: "tensor<" + "x".join(map(str, s)) + "xf32>"  # noqa: E731
    assert f"({t(m, R, d)}, {t(m, d, H)}, {t(m, H)}, {t(m, H, H)}, " in calls[TC_FWD][0]
    assert f"-> ({t(m, R, O)}, {t(m, R, H)}, " in calls[TC_FWD][0] and "save = 1 : i64" in calls[TC_FWD][0]
    assert f"-> ({t(m, R, d)}, {t(m, R, 2 * O)}, " in calls[TC_BWD][0]
    assert f"({t(m, 4, 2 * O)}) -> ({t(m, 2 * O)}, " in calls[REDUCE][0]   # ceil(100 / 32) row tiles
    with jaxfox.use_reference():
        assert cuda_custom_calls(_grad_fn(), p, xs) == {}


@pytest.mark.parametrize("case", ["opt_out", "highest", "d=48", "vsn_kernel"])
def test_tc_path_is_not_taken(kernels_on, monkeypatch, case):
    """Not opted in, "highest" precision, or d outside {16, 32, 64, 128}: XLA code; widths <= 32 keep the vsn
    kernels."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "" if case == "opt_out" else "grn")
    m, d, H, O = (4, 48, 128, 128) if case == "d=48" else (4, 16, 32, 32) if case == "vsn_kernel" else (4, 16, 128, 128)
    p = vsn_init(jax.random.key(4), m, d, H, O)
    xs = jnp.zeros((70, m, d))
    if case == "highest":
        with jax.default_matmul_precision("highest"):
            calls = cuda_custom_calls(_grad_fn(), p, xs)
    else:
        calls = cuda_custom_calls(_grad_fn(), p, xs)
    if case == "vsn_kernel":
        assert {FWD, BWD} <= set(calls) and TC_FWD not in calls, set(calls)
    else:
        assert calls == {}


@pytest.mark.usefixtures("tc_emulated")
def test_tc_wiring_matches_autodiff_emulated():
    """_combine_tc (jax.vmap of jaxfox.grn._grn_tc over m = 3 variables, then the weighted sum) with the FFI targets
    emulated in float64 NumPy (test_grn.py: they receive every operand with the leading instance axis m, as the
    handlers do under broadcast_all): value and gradients (every stacked parameter leaf, x, v) equal the stacked
    reference's autodiff at precision "highest" evaluated at the TF32-rounded weights (see test_grn.py's
    test_tc_wiring_matches_autodiff_emulated)."""
    from jaxfox.grn import _TcCfg
    from jaxfox.vsn import _combine_tc, _grn_stacked_reference, _weighted_sum

    m, d, H, O, R, eps = 3, 16, 32, 64, 70, 1e-5
    p = random_vsn_params(m, d, H, O, seed=8)["variables"]
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((R, m, d)), jnp.float32)
    v = jax.nn.softmax(jnp.asarray(rng.standard_normal((R, m)), jnp.float32))
    r = jnp.asarray(rng.standard_normal((R, O)), jnp.float32)
    cfg = _TcCfg(H, O, eps)
    y = jax.jit(lambda p, x, v: _combine_tc(cfg, p, x, v))(p, x, v)
    g = jax.jit(jax.grad(lambda p, x, v: jnp.sum(_combine_tc(cfg, p, x, v) * r), argnums=(0, 1, 2)))(p, x, v)
    pr = tf32_weights(p)

    def ref(p, x, v):
        return _weighted_sum(v, _grn_stacked_reference(p, x, eps))

    with jax.default_matmul_precision("highest"):
        y_ref = ref(pr, x, v)
        g_ref = jax.grad(lambda p, x, v: jnp.sum(ref(p, x, v) * r), argnums=(0, 1, 2))(pr, x, v)
    assert_f32_close(y, y_ref, 1e-5)
    assert_tree_close(g[0], g_ref[0], 1e-5)
    assert_f32_close(g[1], g_ref[1], 1e-5)
    assert_f32_close(g[2], g_ref[2], 1e-5)


def test_tc_path_takes_extra_variable_leaves(tc_emulated, kernels_on, monkeypatch):
    """jaxfox.vsn with its per-variable GRNs on the TF32 path (FFI targets emulated) and params["variables"] holding
    an extra leaf that is not stacked over m (a scalar): the reference takes it (zero gradient), and so must the
    jax.vmap over the variables (before the fix: a vmap rank error); the rest equals the plain params' run."""
    from test_grn import _kernel_branch

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn")
    vsn_mod = importlib.import_module("jaxfox.vsn")
    calls = _kernel_branch(monkeypatch, vsn_mod)
    m, d, H, O, R = 3, 16, 128, 128, 24
    p = random_vsn_params(m, d, H, O, seed=6)
    q = {**p, "variables": {**p["variables"], "version": jnp.float32(2.0)}}
    xs = jnp.asarray(np.random.default_rng(6).standard_normal((R, m, d)), jnp.float32)
    loss = lambda p: jnp.sum(vsn(p, xs)[0] ** 2)  # noqa: E731
    y_p, g_p = jax.value_and_grad(loss)(p)
    y_q, g_q = jax.value_and_grad(loss)(q)
    assert calls
    np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y_p))
    assert float(g_q["variables"].pop("version")) == 0.0
    assert jax.tree.structure(g_q) == jax.tree.structure(g_p)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_p)[0], jax.tree.leaves(g_q)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
