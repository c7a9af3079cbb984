"""GPU tests of the VSN CUDA kernels (ffi/vsn.cu: jaxfox_vsn_grn_fwd, jaxfox_vsn_grn_bwd), ``pytest -m gpu``.

The kernels compute the m per-variable GRNs of :func:`jaxfox.vsn` when d, Hd, O <= 32
(``jaxfox.vsn.KERNEL_MAX_WIDTH``); the selection GRN, the softmax and the weighted sum stay XLA code. Every
comparison is kernel path vs the pure-JAX reference path on the same GPU, both jitted, under
``jax.default_matmul_precision("highest")`` (the reference's matmuls in full float32); every kernel-path
program is first checked to call both FFI targets (and every reference one to call neither), so no test
compares the reference with itself by accident. The CPU tests (test_vsn.py) tie the reference to a float64
NumPy oracle; the forward here is also compared with that oracle (``np_vsn``). Errors are
``conftest.rel_err`` (||a - b|| / ||b||) per output and per gradient leaf.

The last section (``test_tensor_core_variables_*``) tests the wide per-variable GRNs (d = 16, Hd = O = 128) on
ffi/grn.cu's tensor-core (TF32) kernels, opted in per test (``grn_opted_in``) at the default matmul precision: there
the yardstick is the float64 oracle, each leaf within 3x the XLA reference's own TF32 error plus a small slack.
"""

from __future__ import annotations

import contextlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfox
from jaxfox import vsn, vsn_init
from jaxfox.reduce import reduce_chunks
from jaxfox.vsn import KERNEL_MAX_WIDTH, _bwd_tiling, _grn_combined
from conftest import assert_command_buffers_identical, assert_leaves_close, rel_err, run_child_npz

pytestmark = pytest.mark.gpu

if not jaxfox.kernels_available():
    pytest.skip(f"vsn kernels not available: {jaxfox.kernels_unavailable_reason()}", allow_module_level=True)

FWD, BWD = "jaxfox_vsn_grn_fwd", "jaxfox_vsn_grn_bwd"
TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Helpers.
def _params(m, d, H, O, C=None, seed=0, scale=0.3, kind="perturbed"):
    """vsn_init params plus scale * N(0, 1) on every leaf ("perturbed": biases and beta non-zero, gamma != 1),
    or every leaf scale * N(0, 1) ("normal", weights, biases, gamma and beta alike)."""
    p = vsn_init(jax.random.key(seed), m, d, H, O, context_size=C)
    rng = np.random.default_rng(seed + 100)

    def noise(a):
        return jnp.asarray(scale * rng.standard_normal(a.shape), jnp.float32)

    if kind == "normal":
        return jax.tree.map(noise, p)
    return jax.tree.map(lambda a: a + noise(a), p)


def _inputs(lead, m, d, C=None, seed=0):
    rng = np.random.default_rng(seed + 200)
    xs = rng.standard_normal(lead + (m, d)).astype(np.float32)
    c = None if C is None else rng.standard_normal(lead + (C,)).astype(np.float32)
    return xs, c


def _cotangents(lead, m, O, seed=0):
    rng = np.random.default_rng(seed + 300)
    return (jnp.asarray(rng.standard_normal(lead + (O,)), jnp.float32),
            jnp.asarray(rng.standard_normal(lead + (m,)), jnp.float32))


def _make_step(r1, r2, eps=1e-5):
    """step(p, xs, c) -> ((out, weights), grads of sum(out * r1) + sum(weights * r2) w.r.t. (p, xs[, c]))."""
    def loss(p, xs, c):
        out, w = vsn(p, xs, c, eps=eps)
        return jnp.sum(out * r1) + jnp.sum(w * r2)

    def step(p, xs, c=None):
        argnums = (0, 1) if c is None else (0, 1, 2)
        return vsn(p, xs, c, eps=eps), jax.grad(loss, argnums=argnums)(p, xs, c)

    return step


def _assert_kernel_calls(text, present=True):
    """The compiled program calls both vsn FFI targets (present) or neither (not present)."""
    if present:
        assert FWD in text and BWD in text, "the kernel path did not compile to the jaxfox_vsn_grn_* FFI calls"
    else:
        assert "jaxfox_vsn" not in text, "a jaxfox_vsn FFI call where the reference path was expected"


def _host(a):
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == jnp.bfloat16 else a


def _run(step, *args, reference=False, kernel=True):
    """A fresh jit of ``step`` compiled now and run on ``args``, fetched to host (bfloat16 leaves as float32).

    Kernel path (its compiled HLO must call both FFI targets; with kernel=False, neither: a shape routed to
    the reference), or with reference=True the reference path, traced inside ``jaxfox.use_reference()``."""
    with jax.default_matmul_precision("highest"):
        with jaxfox.use_reference() if reference else contextlib.nullcontext():
            compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile()
            _assert_kernel_calls(compiled.as_text(), present=kernel and not reference)
            out = compiled(*args)
    return jax.tree.map(_host, jax.device_get(out))


def _named(res):
    """((out, weights), grads) -> {name: array}, one entry per output and per gradient leaf."""
    (out, w), grads = res
    named = {"out": out, "weights": w, "d xs": grads[1]}
    if len(grads) > 2:
        named["d context"] = grads[2]
    for group in ("selection", "variables"):
        for k in sorted(grads[0][group]):
            named[f"d {group}.{k}"] = grads[0][group][k]
    return named


def _compare(got, want, tol=TOL, tols=None):
    """Every output and gradient leaf of the kernel run ``got`` is finite and within rel_err ``tol`` (or
    ``tols[name]``) of the reference run ``want``; the comparison is not vacuous (non-zero reference)."""
    g, w = _named(got), _named(want)
    errs = assert_leaves_close(g, w, tol, tols)
    assert np.abs(w["out"]).max() > 0
    assert any(np.abs(w[k]).max() > 0 for k in w if k.startswith("d variables."))
    return errs


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _stacked_fwd_bwd(p, x, v, dout):
    """The per-variable GRNs combined by weights v (jaxfox.vsn._grn_combined: the kernels on this path, then XLA's
    weighted sum) and their vjp: (out [R, O], (d params, d x, d v)). The gradients are the backward kernel's
    outputs alone; out passes XLA's weighted sum."""
    out, vjp = jax.vjp(lambda p, x, v: _grn_combined(p, x, v, 1e-5), p, x, v)
    return out, vjp(dout)


def _sel_weights(rng, shape):
    """Random selection weights [..., m] (positive, summing to 1 over m)."""
    e = np.exp(rng.standard_normal(shape))
    return jnp.asarray(e / e.sum(-1, keepdims=True), jnp.float32)


def _num_params(p):
    """P: floats per variable in the flat parameter rows the kernels read."""
    return sum(int(np.prod(a.shape[1:])) for a in p["variables"].values())


# ----------------------------------------------------------------------------------------------
# Kernel vs reference.
CASES = {  # name: (lead, m, d, Hd, O, C, eps)
    "main": ((32, 64), 48, 4, 32, 32, None, 1e-5),           # the main job's VSN: 2048 rows, 3 tiles per CTA
    "main_1000_rows": ((1000,), 48, 4, 32, 32, None, 1e-5),  # 16 row tiles, 2 per backward CTA, last one partial
    "r37_m3_d5_h17_o9": ((37,), 3, 5, 17, 9, None, 1e-5),
    "r3x13_m3_d3_h7_o1": ((3, 13), 3, 3, 7, 1, None, 1e-5),   # O = 1: a LayerNorm of one element (y = beta)
    "r37_m1_d1_h32_o9": ((37,), 1, 1, 32, 9, None, 1e-5),     # m = 1 (weight exactly 1), d = 1
    "r3x13_m1_d5_h17_o32": ((3, 13), 1, 5, 17, 32, None, 1e-5),
    "r130_m3_d3_h7_o32_eps1e-3": ((130,), 3, 3, 7, 32, None, 1e-3),  # 3 tiles, the last of 2 rows; eps passed
    "identity_skip_d8_o8": ((5, 41), 4, 8, 16, 8, None, 1e-5),       # d = O: no skip Dense
    "widest_d32_h32_o32": ((130,), 3, 32, 32, 32, None, 1e-5),       # the widest kernel case (identity skip)
    "widest_d31_h32_o32": ((130,), 3, 31, 32, 32, None, 1e-5),       # 5 x 64 dW tiles: two per thread
    "context5": ((4, 37), 6, 4, 32, 32, 5, 1e-5),                    # a selection context
    "chunked_12800_rows": ((100, 128), 3, 4, 32, 32, None, 1e-5),    # 100 backward CTAs, 2 reduction chunks
}


def _case(name, seed=0, kind="perturbed", scale=0.3):
    lead, m, d, H, O, C, eps = CASES[name]
    p = _params(m, d, H, O, C, seed=seed, kind=kind, scale=scale)
    xs, c = _inputs(lead, m, d, C, seed=seed)
    return p, xs, c, _make_step(*_cotangents(lead, m, O, seed), eps=eps), eps


def test_cases_cover_the_kernel_paths():
    """The tiling the cases above are meant to exercise (jaxfox.vsn._bwd_tiling and reduce_chunks)."""
    for name, (lead, m, d, H, O, C, _) in CASES.items():
        assert max(d, H, O) <= KERNEL_MAX_WIDTH, name
    R = lambda name: int(np.prod(CASES[name][0]))  # noqa: E731
    per, _ = _bwd_tiling(R("main"), 48)  # 32 tiles, 3 per CTA: the last CTA stops after 2
    assert per >= 2 and (-(-R("main") // 64)) % per != 0
    per, _ = _bwd_tiling(R("main_1000_rows"), 48)  # several tiles per CTA and a partial last tile
    assert per >= 2 and R("main_1000_rows") % 64 != 0
    lead, m, d, H, O, _, _ = CASES["chunked_12800_rows"]
    per, blocks = _bwd_tiling(R("chunked_12800_rows"), m)
    assert reduce_chunks(blocks, m * _num_params(_params(m, d, H, O))) > 1


# The float64 gradient oracle: the VSN equations (module docstring of jaxfox/vsn.py) in jax.numpy with x64 on the
# CPU of a child process (jaxfox's own code is float32 throughout), differentiated by JAX.
_F64_SCRIPT = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np
    z = dict(np.load(sys.argv[1] + ".in.npz"))
    eps = float(z.pop("eps"))
    xs, r1, r2 = z.pop("xs"), z.pop("r1"), z.pop("r2")
    c = z.pop("c") if "c" in z else None
    params = {"selection": {}, "variables": {}}
    for k, v in z.items():
        g, leaf = k.split(".")
        params[g][leaf] = jnp.asarray(v, jnp.float64)

    def ln(x, gamma, beta):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + eps) * gamma + beta

    def grn(p, a, c=None):
        h2 = a @ p["w2"] + p["b2"] + (c @ p["w3"] if c is not None else 0.0)
        e1 = jax.nn.elu(h2) @ p["w1"] + p["b1"]
        glu = (e1 @ p["w4"] + p["b4"]) * jax.nn.sigmoid(e1 @ p["w5"] + p["b5"])
        skip = a @ p["skip_w"] + p["skip_b"] if "skip_w" in p else a
        return ln(skip + glu, p["gamma"], p["beta"])

    def loss(p, xs, c):
        m, d = xs.shape[-2:]
        v = jax.nn.softmax(grn(p["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c), -1)
        ys = jnp.stack([grn({k: a[j] for k, a in p["variables"].items()}, xs[..., j, :]) for j in range(m)], -2)
        out = jnp.sum(v[..., None] * ys, -2)
        return jnp.sum(out * r1) + jnp.sum(v * r2)

    args = (params, jnp.asarray(xs, jnp.float64), None if c is None else jnp.asarray(c, jnp.float64))
    gp, gx = jax.grad(loss, argnums=(0, 1))(*args)
    out = {"d xs": np.asarray(gx)}
    for g in gp:
        for k, v in gp[g].items():
            out[f"d {g}.{k}"] = np.asarray(v)
    np.savez(sys.argv[1], **out)
    print("DONE")
""")


def _f64_grads(tmp_path, p, xs, c, cotangents, eps):
    """{"d xs", "d selection.<leaf>", "d variables.<leaf>": float64 gradients} of sum(out r1) + sum(weights r2)."""
    r1, r2 = cotangents
    arrays = {f"{g}.{k}": np.asarray(v) for g in p for k, v in p[g].items()}
    arrays.update(xs=np.asarray(xs), r1=np.asarray(r1), r2=np.asarray(r2), eps=np.float64(eps))
    if c is not None:
        arrays["c"] = np.asarray(c)
    np.savez(tmp_path / "f64.npz.in.npz", **arrays)
    return run_child_npz(_F64_SCRIPT, "", tmp_path / "f64.npz", env={"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name, tmp_path):
    """Kernel path vs reference path at 1e-5 for the outputs and the per-variable GRNs' gradients. The selection
    GRN's gradients and d xs (which they reach) pass the softmax backward and, for m = 3 selection outputs, a
    LayerNorm over 3 values whose d z rows sum to zero, so their column sums over the rows cancel: there the
    kernel path (the d v of ffi/vsn.cu's backward; with JAXFOX_OPT_IN_KERNELS=grn also ffi/grn.cu's selection GRN)
    and XLA's float32 differ by up to 5.2e-5 (H200, widest_d32_h32_o32, grn opted in: d selection.skip_b). Those leaves are held to a float64 oracle instead: the kernel's error at most twice the
    XLA reference's error, or 1e-5."""
    from test_vsn import np_vsn

    lead, m, d, H, O, C, eps = CASES[name]
    p, xs, c, step, eps = _case(name, seed=len(name))
    got = _run(step, p, xs, c)
    want = _run(step, p, xs, c, reference=True)
    oracle_leaves = [k for k in _named(want) if k.startswith("d selection.") or k == "d xs"]
    _compare(got, want, tols={k: np.inf for k in oracle_leaves})
    exact = _f64_grads(tmp_path, p, xs, c, _cotangents(lead, m, O, seed=len(name)), eps)
    g, w = _named(got), _named(want)
    errs = {k: (rel_err(g[k], exact[k]), rel_err(w[k], exact[k])) for k in oracle_leaves}
    bad = {k: e for k, e in errs.items() if not e[0] <= max(TOL, 2.0 * e[1])}
    assert not bad, f"(kernel, XLA) errors against float64 above the bound: {bad} (all: {errs})"
    # both forwards agree with the float64 NumPy oracle of test_vsn.py
    want_out, want_w = np_vsn(p, xs, c, eps)
    for res in (got, want):
        assert rel_err(res[0][0], want_out) <= TOL and rel_err(res[0][1], want_w) <= TOL


def test_bfloat16_xs():
    p, xs, c, step, _ = _case("main", seed=1)
    xs16 = jnp.asarray(xs, jnp.bfloat16)
    got = _run(step, p, xs16, c)
    want = _run(step, p, xs16, c, reference=True)
    # d xs is rounded to bfloat16 from float32 values that agree to ~1e-6: at most one bf16 ulp apart
    _compare(got, want, tols={"d xs": 8e-3})
    assert np.mean(got[1][1] == want[1][1]) > 0.95


@pytest.mark.parametrize("name", ["main", "r37_m3_d5_h17_o9", "widest_d31_h32_o32"])
def test_random_normal_params(name):
    """Every parameter N(0, 1) (no init structure): large pre-activations, saturated sigmoids and ELUs.

    The kernels' own outputs and parameter gradients keep the 1e-5 bound. The selection GRN (XLA code on both
    paths) and d xs (which it reaches) get 5e-5: their cotangent passes the softmax backward, whose cancellation
    at these saturated weights amplifies the kernels' ~5e-7 output differences (H200, main case: up to 2.9e-5
    for d selection.b5 and 1.04e-5 for d xs, the same before and after the forward kernel looped over row tiles)."""
    p, xs, c, step, _ = _case(name, seed=2, kind="normal", scale=1.0)
    got, want = _run(step, p, xs, c), _run(step, p, xs, c, reference=True)
    loose = {k: 5e-5 for k in _named(want) if k.startswith("d selection.") or k == "d xs"}
    _compare(got, want, tols=loose)


def test_layernorm_hard_rows_xs_offset():
    """Rows of xs with a common offset of 1000 (identity skip d = O, so z = x + GLU(x) keeps it; W2 scaled
    down so the GLU stays O(1)): |mean(z)| / std(z) ~ 1000, where a one-pass variance loses every digit."""
    lead, m, d, H, O = (6, 40), 3, 8, 17, 8
    p = _params(m, d, H, O, seed=3)
    p["variables"]["w2"] = p["variables"]["w2"] * 1e-3
    xs, _ = _inputs(lead, m, d, seed=3)
    hard = np.zeros(lead, bool)
    hard[:, ::2] = True
    xs[hard] += 1000.0
    step = _make_step(*_cotangents(lead, m, O, seed=3))
    got = _run(step, p, xs)
    want = _run(step, p, xs, reference=True)
    _compare(got, want)
    assert rel_err(got[0][0][hard], want[0][0][hard]) <= TOL
    assert rel_err(got[1][1][hard], want[1][1][hard]) <= TOL


def test_layernorm_offset_skip_bias():
    """A common offset of 30 in every z through the skip Dense's bias (d != O)."""
    lead, m, d, H, O = (5, 37), 3, 5, 17, 9
    p = _params(m, d, H, O, seed=4)
    p["variables"]["skip_b"] = p["variables"]["skip_b"] + 30.0
    xs, _ = _inputs(lead, m, d, seed=4)
    step = _make_step(*_cotangents(lead, m, O, seed=4))
    _compare(_run(step, p, xs), _run(step, p, xs, reference=True))


# ----------------------------------------------------------------------------------------------
# Batch independence, determinism, vmap.
def test_single_row_equals_batch():
    lead, m, d, H, O = (200,), 48, 4, 32, 32
    p = _params(m, d, H, O, seed=5)
    xs, _ = _inputs(lead, m, d, seed=5)
    r1, r2 = _cotangents(lead, m, O, seed=5)
    (out, w), (_, dx) = _run(_make_step(r1, r2), p, xs)
    # The selection GRN and the softmax are XLA code, whose matmuls on 1 row and on 200 rows may sum in
    # different orders: the reference path on the CPU differs by up to 1.07e-6 here (row 64's weights), hence
    # 5e-6 for the whole op; the kernels alone are checked bitwise below.
    for i in (0, 63, 64, 137, 199):
        s = slice(i, i + 1)
        (o1, w1), (_, dx1) = _run(_make_step(r1[s], r2[s]), p, xs[s])
        assert rel_err(o1, out[s]) <= 5e-6, i
        assert rel_err(w1, w[s]) <= 5e-6, i
        assert rel_err(dx1, dx[s]) <= 5e-6, i
    # the kernels alone: a row's input and weight gradients are bitwise those of the row inside the batch (its
    # combined output passes XLA's weighted sum over m: 1e-6)
    x3 = jnp.asarray(xs)
    rng = np.random.default_rng(6)
    vsel, dout = _sel_weights(rng, (200, m)), jnp.asarray(rng.standard_normal((200, O)), jnp.float32)
    y, (_, gx, gv) = _run(_stacked_fwd_bwd, p["variables"], x3, vsel, dout)
    for i in (0, 63, 64, 137, 199):
        s = slice(i, i + 1)
        y1, (_, gx1, gv1) = _run(_stacked_fwd_bwd, p["variables"], x3[s], vsel[s], dout[s])
        assert rel_err(y1, y[s]) <= 1e-6, i
        assert np.array_equal(gx1, gx[s]) and np.array_equal(gv1, gv[s]), i


def test_gradients_bitwise_repeatable():
    p, xs, c, step, _ = _case("main", seed=7)
    args = jax.device_put((p, jnp.asarray(xs)))
    with jax.default_matmul_precision("highest"):
        f = jax.jit(step)
        _assert_kernel_calls(f.lower(*args).compile().as_text())
        first = jax.device_get(f(*args))
        for run in range(9):
            assert _leaves_equal(jax.device_get(f(*args)), first), f"run {run + 2} differs"
        # a second compilation of the same computation gives the same bits
        assert _leaves_equal(jax.device_get(jax.jit(lambda *a: step(*a))(*args)), first)
    for leaf in jax.tree.leaves(first[1][0]["variables"]):
        assert np.isfinite(leaf).all() and np.any(leaf != 0)


def test_parameter_gradient_depends_on_the_shape_only():
    """The kernels' parameter gradient (summed in an order fixed by R and m) has the same bits standalone and
    inside another program (a lax.scan), compiled separately."""
    lead, m, d, H, O = (2048,), 48, 4, 32, 32
    p = _params(m, d, H, O, seed=8)["variables"]
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal(lead + (m, d)), jnp.float32)
    vsel, dout = _sel_weights(rng, lead + (m,)), jnp.asarray(rng.standard_normal(lead + (O,)), jnp.float32)
    alone = _run(_stacked_fwd_bwd, p, x, vsel, dout)

    def in_scan(p, x2, v2, dout2):  # the same rows twice, as the scanned-over inputs of a loop
        return jax.lax.scan(lambda k, a: (k, _stacked_fwd_bwd(p, *a)), 0, (x2, v2, dout2))[1]

    twice = _run(in_scan, p, jnp.stack([x, x]), jnp.stack([vsel, vsel]), jnp.stack([dout, dout]))
    for it in range(2):
        assert _leaves_equal(jax.tree.map(lambda a: a[it], twice)[1], alone[1]), it
    for leaf in jax.tree.leaves(alone[1][0]):
        assert np.isfinite(leaf).all() and np.any(leaf != 0)


def _vmap_case(V, lead, m, d, H, O, seed):
    ps = [_params(m, d, H, O, seed=seed + v) for v in range(V)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ps)
    xs = np.stack([_inputs(lead, m, d, seed=seed + v)[0] for v in range(V)])
    cots = [_cotangents(lead, m, O, seed=seed + v) for v in range(V)]
    r1 = jnp.stack([c[0] for c in cots])
    r2 = jnp.stack([c[1] for c in cots])
    return ps, stacked, xs, r1, r2


def _step_args(p, xs, r1, r2):
    return _make_step(r1, r2)(p, xs)


@pytest.mark.parametrize("V,lead,m,d,H,O", [(3, (5, 37), 3, 5, 17, 9), (2, (4, 64), 48, 4, 32, 32)])
def test_vmap_matches_loop(V, lead, m, d, H, O):
    """jax.vmap over a leading instance axis of params and xs (broadcast_all: one FFI call over V instances)."""
    ps, stacked, xs, r1, r2 = _vmap_case(V, lead, m, d, H, O, seed=9)
    fn = jax.vmap(_step_args)
    text = jax.jit(fn).trace(stacked, xs, r1, r2).lower(lowering_platforms=("cuda",)).as_text()
    P = _num_params(ps[0])
    calls = re.findall(r"custom_call @(jaxfox_vsn_grn_\w+)\((.*)", text)
    assert {t for t, _ in calls} == {FWD, BWD}
    for target, rest in calls:  # the weights operand carries the instance axis: [V, m, P]
        assert f"tensor<{V}x{m}x{P}xf32>" in rest, (target, rest[-300:])
    got = _run(fn, stacked, xs, r1, r2)
    want = _run(jax.vmap(_step_args), stacked, xs, r1, r2, reference=True)
    _compare(got, want)
    for v in range(V):
        one = _run(_step_args, ps[v], xs[v], r1[v], r2[v])
        _compare(jax.tree.map(lambda a: a[v], got), one)
    # the kernels alone: instance v inside the vmapped call has the bits of instance v alone
    rng = np.random.default_rng(10)
    R = int(np.prod(lead))
    vsel, dout = _sel_weights(rng, (V, R, m)), jnp.asarray(rng.standard_normal((V, R, O)), jnp.float32)
    x3 = jnp.asarray(xs.reshape(V, -1, m, d))
    vm = _run(jax.vmap(_stacked_fwd_bwd), stacked["variables"], x3, vsel, dout)
    for v in range(V):
        one = _run(_stacked_fwd_bwd, ps[v]["variables"], x3[v], vsel[v], dout[v])
        assert _leaves_equal(jax.tree.map(lambda a: a[v], vm)[1], one[1]), v
        assert rel_err(vm[0][v], one[0]) <= 1e-6, v


def test_vmap_over_xs_only():
    """vmap over xs with the params shared: the kernels see the weights broadcast to every instance and the
    parameter gradient is the sum over the instances."""
    V, lead, m, d, H, O = 3, (4, 37), 3, 5, 17, 9
    p = _params(m, d, H, O, seed=11)
    xs = np.stack([_inputs(lead, m, d, seed=11 + v)[0] for v in range(V)])
    r1, r2 = _cotangents((V,) + lead, m, O, seed=11)

    def step(p, xs):
        def loss(p, xs):
            out, w = jax.vmap(lambda x: vsn(p, x))(xs)
            return jnp.sum(out * r1) + jnp.sum(w * r2)

        return jax.vmap(lambda x: vsn(p, x))(xs), jax.grad(loss, argnums=(0, 1))(p, xs)

    _compare(_run(step, p, xs), _run(step, p, xs, reference=True))


# ----------------------------------------------------------------------------------------------
# Shapes routed to the reference.
@pytest.mark.parametrize("d,H,O", [(4, 33, 32), (40, 32, 32), (4, 32, 33)])
def test_wide_shapes_run_the_reference(d, H, O):
    lead, m = (6, 37), 3
    p = _params(m, d, H, O, seed=12)
    xs, _ = _inputs(lead, m, d, seed=12)
    step = _make_step(*_cotangents(lead, m, O, seed=12))
    got = _run(step, p, xs, kernel=False)  # the default path, compiled without the vsn FFI calls
    want = _run(step, p, xs, reference=True)
    _compare(got, want)
    # both runs are XLA's reference: the values are held to the float64 oracle of test_vsn.py too
    from test_vsn import np_vsn

    want_out, want_w = np_vsn(p, xs, None, 1e-5)
    assert rel_err(got[0][0], want_out) <= TOL and rel_err(got[0][1], want_w) <= TOL


# ----------------------------------------------------------------------------------------------
# Command buffers.
_CMDBUF_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfox
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {}
    for (lead, m, d, H, O) in (((32, 64), 48, 4, 32, 32), ((37,), 3, 5, 17, 9), ((100, 128), 3, 4, 32, 32)):
        rng = np.random.default_rng(m + d)
        p = jaxfox.vsn_init(jax.random.key(0), m, d, H, O)
        p = jax.tree.map(lambda v: v + jnp.asarray(0.3 * rng.standard_normal(v.shape), jnp.float32), p)
        xs = jnp.asarray(rng.standard_normal(lead + (m, d)), jnp.float32)
        r1 = jnp.asarray(rng.standard_normal(lead + (O,)), jnp.float32)
        r2 = jnp.asarray(rng.standard_normal(lead + (m,)), jnp.float32)

        def loss(p, x):
            out, w = jaxfox.vsn(p, x)
            return jnp.sum(out * r1) + jnp.sum(w * r2)

        @jax.jit
        def run(p, x):  # several dependent calls: a graph worth capturing
            def body(c, _):
                l, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x + 1e-3 * c)
                return c + gx, (l, gp)
            return jax.lax.scan(body, jnp.zeros_like(x), None, length=3)

        text = run.lower(p, xs).as_text()
        assert "jaxfox_vsn_grn_fwd" in text and "jaxfox_vsn_grn_bwd" in text
        tag = "x".join(map(str, lead)) + f"_{m}_{d}_{H}_{O}"
        for it in range(3):  # command buffers are recorded / updated over the first executions
            c, (l, gp) = jax.device_get(run(p, xs))
            out[f"{tag}_c_run{it}"] = c
            out[f"{tag}_loss_run{it}"] = l
            for path, v in jax.tree_util.tree_leaves_with_path(gp):
                name = "_".join(str(getattr(k, "key", k)) for k in path)
                out[f"{tag}_g_{name}_run{it}"] = v
    np.savez(sys.argv[1], **out)
    print("DONE", len(out))
""")


def test_command_buffers_on_off_identical(tmp_path):
    assert_command_buffers_identical(_CMDBUF_SCRIPT, tmp_path)


# ----------------------------------------------------------------------------------------------
# Training the full model through the kernels.
def test_full_model_training_loss_falls():
    """jaxfox.models.perception (FULL_DEFAULTS: m = 48, d = 4, Hd = O = 32) at B = 32, T = 64: 30 train_steps
    over 8 random batches (label: the sign of the last step's first feature) lower the loss; the first two
    losses equal the reference path's. Both runs under ``jax.default_matmul_precision("highest")``: at the default
    precision the model's other XLA matmuls use TF32 (the H200 run saw 1.7e-5 relative between the two first
    losses from that alone)."""
    from conftest import train_full_perception

    def train(reference):
        losses, before, after = train_full_perception(
            reference, lambda text: _assert_kernel_calls(text, present=not reference))
        changed = {k: not np.array_equal(v, after[k]) for k, v in before.items() if k[0] == "vsn"}
        return losses, changed

    losses, changed = train(reference=False)
    assert np.isfinite(losses).all()
    first, last = losses[:5].mean(), losses[-5:].mean()
    assert last < 0.5 * first, (first, last, losses)
    # every parameter of the per-variable GRNs (and of the selection GRN) is trained
    assert changed and all(changed.values()), [k for k, v in changed.items() if not v]
    ref_losses, _ = train(reference=True)
    assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (losses[:2], ref_losses[:2])
    assert abs(losses[1] - ref_losses[1]) <= 1e-3 * abs(ref_losses[1]), (losses[:2], ref_losses[:2])


# ----------------------------------------------------------------------------------------------
# Tensor-core (TF32) kernels for the per-variable GRNs: the bench widths d = 16, Hd = O = 128, which the
# CUDA-core kernels above do not take (d, Hd, O <= 32), run ffi/grn.cu's jaxfox_grn_tc_fwd / jaxfox_grn_tc_bwd, one
# call each over the m variables (a jax.vmap of the single-GRN path), when JAXFOX_OPT_IN_KERNELS names "grn" (the
# ``grn_opted_in`` fixture: these tests only) and at the DEFAULT matmul precision only. The selection GRN (input m d
# = 768) stays XLA code. As in test_gpu_grn.py's test_tc_* (whose section comment gives the reasoning and the
# calibration): every output and gradient leaf against a float64 oracle (``np_vsn`` for the forward, the x64 child
# ``_F64_SCRIPT`` for the gradients) within XLA_FACTOR x the XLA reference's own error on the same inputs (default
# precision: TF32) + XLA_SLACK, also per row of out and d xs; no kinks (ELU has a continuous derivative), so one
# regime; parameters perturbed by 0.1 (not 0.3) so that the width-128 gates do not saturate.
TC_FWD, TC_BWD = "jaxfox_grn_tc_fwd", "jaxfox_grn_tc_bwd"
XLA_FACTOR, XLA_SLACK = 3.0, 3e-3
TC_CASES = {  # name: (lead, m, d, Hd, O)
    "r2048_m48_d16_h128_o128": ((2048,), 48, 16, 128, 128),  # the bench shape: 64 full 32-row tiles
    "r100_m48_d16_h128_o128": ((100,), 48, 16, 128, 128),    # ragged last tile (4 of 32 rows)
}


@pytest.fixture
def grn_opted_in(monkeypatch):
    """JAXFOX_OPT_IN_KERNELS=grn for one test (the tensor-core kernels are opt-in; the rest of this module runs
    without the grn opt-in, as the main job does by default)."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn")


def _tc_check_text(text, reference):
    """Kernel path: both tensor-core targets, no CUDA-core vsn or grn one (the per-variable widths are too wide for
    ffi/vsn.cu, the selection input m d = 768 for ffi/grn.cu); reference: none of them."""
    cuda_core = (FWD, BWD, "jaxfox_grn_fwd", "jaxfox_grn_bwd")
    if reference:
        found = [t for t in (TC_FWD, TC_BWD) + cuda_core if t in text]
        assert not found, f"FFI calls {found} in the reference path"
    else:
        missing = [t for t in (TC_FWD, TC_BWD) if t not in text]
        assert not missing, f"the per-variable GRNs did not compile to the tensor-core calls {missing}"
        found = [t for t in cuda_core if t in text]
        assert not found, f"CUDA-core FFI calls {found} where the tensor-core kernels were expected"


def _compile_tc(step, *args, reference=False, options=None):
    """A fresh jit of ``step`` compiled at the DEFAULT matmul precision (no precision context) and checked by
    :func:`_tc_check_text`; the reference traced inside jaxfox.use_reference(). ``options``: XLA compiler options
    (``Lowered.compile(compiler_options=...)``)."""
    with jaxfox.use_reference() if reference else contextlib.nullcontext():
        compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile(compiler_options=options)
    _tc_check_text(compiled.as_text(), reference)
    return compiled


def _run_tc(step, *args, reference=False):
    return jax.tree.map(_host, jax.device_get(_compile_tc(step, *args, reference=reference)(*args)))


def _tc_case(name, seed):
    lead, m, d, H, O = TC_CASES[name]
    p = _params(m, d, H, O, seed=seed, scale=0.1)
    xs, _ = _inputs(lead, m, d, seed=seed)
    cot = _cotangents(lead, m, O, seed=seed)
    return p, xs, cot, _make_step(*cot)


def _rows(a):
    a = np.asarray(a, np.float64)
    return a.reshape(a.shape[0], -1)


@pytest.mark.parametrize("name", sorted(TC_CASES))
def test_tensor_core_variables_match_oracle_within_xla_tf32_error(name, tmp_path, grn_opted_in):
    """out, weights and every gradient leaf (d xs, d selection.*, d variables.*) of sum(out r1) + sum(weights r2):
    the tensor-core path within XLA_FACTOR x the XLA reference's error + XLA_SLACK of the float64 oracle, per
    leaf and per row of out and d xs."""
    from test_vsn import np_vsn

    lead, m, d, H, O = TC_CASES[name]
    p, xs, cot, step = _tc_case(name, seed=len(name))
    got = _run_tc(step, p, xs)
    ref = _run_tc(step, p, xs, reference=True)
    assert got[0][0].shape == lead + (O,) and got[0][1].shape == lead + (m,) and got[1][1].shape == lead + (m, d)
    want_out, want_w = np_vsn(p, xs, None, 1e-5)
    want = {"out": want_out, "weights": want_w, **_f64_grads(tmp_path, p, xs, None, cot, 1e-5)}
    g, x = _named(got), _named(ref)
    assert g.keys() == x.keys() == want.keys(), (sorted(g), sorted(want))
    for k in g:
        assert np.shape(g[k]) == np.shape(want[k]) and np.isfinite(g[k]).all(), k
    ek = {k: rel_err(g[k], want[k]) for k in want}
    ex = {k: rel_err(x[k], want[k]) for k in want}
    both = {k: f"kernel {ek[k]:.2e} / XLA {ex[k]:.2e}" for k in want}
    bad = {k: both[k] for k in want if not ek[k] <= XLA_FACTOR * ex[k] + XLA_SLACK}
    assert not bad, f"kernel error > {XLA_FACTOR} x XLA's + {XLA_SLACK} (vs float64): {bad} (all: {both})"
    for k in ("out", "d xs"):
        w = _rows(want[k])
        rk = np.linalg.norm(_rows(g[k]) - w, axis=-1) / np.linalg.norm(w, axis=-1)
        rx = np.linalg.norm(_rows(x[k]) - w, axis=-1) / np.linalg.norm(w, axis=-1)
        assert rk.max() <= XLA_FACTOR * rx.max() + XLA_SLACK, \
            f"{k} row {int(rk.argmax())}: kernel {rk.max():.2e} vs XLA's worst row {rx.max():.2e}"
    for k, leaf in got[1][0]["variables"].items():  # not vacuous
        assert np.any(leaf != 0), k


def test_tensor_core_variables_bitwise_repeatable(grn_opted_in):
    """Five runs of the bench-shape program (2048 rows, the tensor-core per-variable GRNs and XLA's selection GRN)
    give the same bits, outputs and every gradient; so does a second compilation of the same computation, and the
    per-variable GRNs alone (jaxfox.vsn._grn_combined and its vjp).

    Both compilations run with XLA's GEMM autotuner off (``xla_gpu_autotune_level=0``): with it on, XLA times
    candidate GEMM kernels at each compilation and may pick another one (another summation order) for the same
    product. On an H100 (thirty-fifth session) two autotuned compilations of this program differed in the last
    bit of d xs, and with the autotuner off they agreed: XLA's choice, not the jaxfox kernels (which have no
    atomics), and the reference path's GEMMs are subject to it too."""
    p, xs, _, step = _tc_case("r2048_m48_d16_h128_o128", seed=7)
    args = jax.device_put((p, jnp.asarray(xs)))
    fixed = {"xla_gpu_autotune_level": 0}
    compiled = _compile_tc(step, *args, options=fixed)
    first = jax.device_get(compiled(*args))
    for run in range(4):
        assert _leaves_equal(jax.device_get(compiled(*args)), first), f"run {run + 2} differs"
    assert _leaves_equal(jax.device_get(_compile_tc(step, *args, options=fixed)(*args)), first), \
        "second compilation differs"
    for leaf in jax.tree.leaves(first[1][0]["variables"]):
        assert np.isfinite(leaf).all() and np.any(leaf != 0)
    # the per-variable GRNs alone (the tensor-core kernels; their weight gradients are XLA GEMMs)
    R, m, O = xs.shape[0], xs.shape[1], p["variables"]["w4"].shape[-1]
    rng = np.random.default_rng(17)
    vsel, dout = _sel_weights(rng, (R, m)), jnp.asarray(rng.standard_normal((R, O)), jnp.float32)
    vargs = jax.device_put((p["variables"], jnp.asarray(xs), vsel, dout))
    alone = jax.jit(_stacked_fwd_bwd).lower(*vargs).compile()
    text = alone.as_text()
    assert TC_FWD in text and TC_BWD in text
    first = jax.device_get(alone(*vargs))
    for run in range(4):
        assert _leaves_equal(jax.device_get(alone(*vargs)), first), f"variables alone: run {run + 2} differs"


def _lower(step, *args):
    """The HLO text of a fresh jit of ``step`` (a new function object: JAX's trace cache keys on the function and
    not on JAXFOX_OPT_IN_KERNELS, so a jit of the same function traced before would be reused)."""
    return jax.jit(lambda *a: step(*a)).lower(*args).as_text()


def test_tensor_core_variables_hlo(grn_opted_in, monkeypatch):
    """The jitted program's HLO text (``jax.jit(f).lower(...).as_text()``) calls jaxfox_grn_tc_fwd and _bwd over
    the m variables at once (x operand [m, R, d], dy [m, R, O]: vmapped, not a loop of m calls); at the "highest"
    matmul precision, or without the grn opt-in, no tensor-core kernel; the main job's widths (d = 4, Hd = O = 32)
    keep ffi/vsn.cu's kernels."""
    lead, m, d, H, O = TC_CASES["r100_m48_d16_h128_o128"]
    p, xs, _, step = _tc_case("r100_m48_d16_h128_o128", seed=3)
    text = _lower(step, p, xs)
    calls = re.findall(r"custom_call @(jaxfox_grn_tc_\w+)\((.*)", text)
    assert {t for t, _ in calls} == {TC_FWD, TC_BWD}, [t for t, _ in calls]
    for t, rest in calls:  # (the value and the gradient's forward may be two calls) x [m, R, d] / dy [m, R, O]
        want = f"tensor<{m}x{lead[0]}x{d if t == TC_FWD else O}xf32>"
        assert want in rest, (t, want, rest[-400:])
    assert FWD not in text and BWD not in text
    with jax.default_matmul_precision("highest"):
        assert "jaxfox_grn_tc" not in _lower(step, p, xs)
    lead2, m2, d2, H2, O2 = (37,), 3, 4, 32, 32
    p2 = _params(m2, d2, H2, O2, seed=4)
    xs2, _ = _inputs(lead2, m2, d2, seed=4)
    step2 = _make_step(*_cotangents(lead2, m2, O2, seed=4))
    text = _lower(step2, p2, xs2)
    assert FWD in text and BWD in text and "jaxfox_grn_tc" not in text
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
    assert "jaxfox_grn_tc" not in _lower(step, p, xs)
