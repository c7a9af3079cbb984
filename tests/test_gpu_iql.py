"""GPU tests of the IQL value loss's kernel path (ffi/iql.cu: jaxfox_iql_head, and on compute capability 9.0
jaxfox_iql_fused for H = 128 or 256: the first product on wgmma with the head in its epilogue; section (h)),
``pytest -m gpu`` on the H200.

Every test is marked ``gpu``; the module is skipped when the kernels are not available (no CUDA device, extension not
built, JAXFOX_DISABLE_KERNELS set). The kernel runs by default for H >= 128 and is opt-in below: the module's tests
run with JAXFOX_OPT_IN_KERNELS=iql (conftest.module_opt_in). The kernel path is compared with the float64 NumPy
oracle of test_iql.py (``np_iql_loss`` / ``np_iql_grads``, written from the equations) and with the pure-JAX
reference path on the same GPU (traced inside ``jaxfox.use_reference()``), both at the default matmul precision: the
two products (obs W1 and obs^T dpre, and d obs) are XLA's float32 GEMMs on both paths, TF32 there (10-bit mantissa,
float32 accumulation), except that on compute capability 9.0 the fused kernel (jaxfox_iql_fused, H = 128 or 256)
computes obs W1 itself in TF32, its inputs truncated by the tensor cores; the rest of the kernels is float32. (The
numbers below were worked out for an earlier kernel that ran the products itself, rounding its operands to nearest
TF32; the bounds hold for XLA's GEMMs and for the fused kernel's truncation.)

Why there are two sets of inputs (the scheme of test_gpu_iqn.py). TF32 rounding moves a first-layer
pre-activation p by ~1e-3 of its scale, so a p close to 0 can land on the other side of its ReLU kink: the loss
does not notice (a ReLU is continuous), but the ReLU's derivative at that entry flips between 0 and 1, which
changes dh there by a full-size term. The summed gradients (dW1, db1, dw2) of random-sign residuals cancel, so a
few such flips are a visible part of them, and XLA's TF32 path flips masks too. (The expectile weight also jumps
at u = 0, from tau to 1 - tau, but there u ~ 0, so a flip there changes dv by ~|u| only.) So:

1. Exact-math tests (``exact_inputs`` of test_iql.py, at the cases of tests/iql_cases.py): every first-layer
   pre-activation has |p| >= 0.2 and every residual |u| >= 0.25 (asserted with the float64 oracle in each test,
   ``assert_far_from_kinks``), with units always on, always off and switching by row, different per network, and
   both signs of u. There the kernel
   matches the oracle to TF32 accuracy: rel_err <= TOL = 5e-3 for the losses and EVERY gradient (a NumPy model
   of the kernel's TF32 rounding to nearest gave <= 8e-4 on these shapes, of truncating TF32 everywhere <= 3.2e-3).
2. Typical-init tests (``typical_inputs``: iql_init, obs ~ N(0, 1), target ~ 1.5 N(0, 1), random-sign loss
   cotangents): the kernel is as accurate as XLA's TF32 path: per array rel_err(kernel, oracle) <= 3
   rel_err(reference, oracle) + 2e-3, and the losses within TOL of the oracle. The flips are random, so the two
   errors are comparable only with many of them: B ~ 1e4 rows (TYPICAL_SHAPES). (NumPy model, kernel rounding
   obs, W1 and dh to nearest, reference truncating all operands: the ratio of the kernel's error to the bound
   was <= 0.36 over 3 seeds x 2 inits per shape of TYPICAL_SHAPES; dW1's errors ~2e-3 .. 6e-3 on both.)
Comparisons between two kernel runs (repeats, command buffers, vmap, other argnums) are bitwise, except for the
values of XLA's products when the program around them changes (vmap batches dW1's GEMM differently).

Kernel use is decided when a function is traced: every comparison builds fresh jitted functions, and the kernel
ones assert that the FFI call is in the compiled program.
"""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfox
from jaxfox import iql_value_loss

import iql_cases
from conftest import assert_command_buffers_identical, module_opt_in, rel_err
from test_iql import (GRAD_KEYS, assert_far_from_kinks, cotangent, exact_inputs, exact_targets, named, np_iql_grads,
                      np_iql_loss, preactivations, taus_for, typical_inputs)

if not jaxfox.kernels_available():
    pytest.skip(f"jaxfox CUDA kernels unavailable: {jaxfox.kernels_unavailable_reason()}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu
_opt_in = module_opt_in("iql")  # the kernel path is opt-in below H = 128 (jaxfox.iql._DEFAULT_MIN_H), and most
                                # shapes here are smaller; the opt-in also keeps the fused kernel below B = 4096
                                # (jaxfox.iql._FUSED_MIN_B); the command-buffer children inherit it

TARGETS = ("jaxfox_iql_head", "jaxfox_iql_fused")  # the fused kernel (first product + head) on sm_90 for H = 128, 256


def _kernel_in(text):
    return any(t in text for t in TARGETS)


def _n_calls(text):
    return sum(text.count(f"custom_call @{t}") for t in TARGETS)
TOL = 5e-3                          # TF32 products without mask flips: norm-wise relative error per array
XLA_FACTOR, XLA_SLACK = 3.0, 2e-3   # typical init: err(kernel) <= XLA_FACTOR err(reference) + XLA_SLACK
TYPICAL_SHAPES = [  # typical init, ~1e4 rows each (see the module docstring)
    (2, 256, 128, 10000),
    (1, 64, 64, 10001),
    (3, 128, 64, 9999),
    (2, 128, 128, 8193),
]
ALL = (0, 1, 2)  # argnums: params, obs, target


# ----------------------------------------------------------------------------------------------
# Running and comparing.
def _fwd_bwd(taus, argnums=ALL):
    """A fresh function (params, obs, target, c) -> (loss [G], {name: gradient of sum_g c_g loss_g}) w.r.t. the
    arguments in argnums (0 params, 1 obs, 2 target)."""
    def f(params, obs, target, c):
        args = (params, obs, target)

        def loss(*diff):
            full = list(args)
            for i, a in zip(argnums, diff):
                full[i] = a
            return iql_value_loss(*full, taus)

        out, vjp = jax.vjp(loss, *(args[i] for i in argnums))
        cts = dict(zip(argnums, vjp(c)))
        grads = named(cts[0]) if 0 in argnums else {}
        if 1 in argnums:
            grads["dobs"] = cts[1]
        if 2 in argnums:
            grads["dtarget"] = cts[2]
        return out, grads
    return f


def _run(fn, *args, reference=False):
    """Compiles a fresh jit of fn (kernel path, or the reference path inside use_reference()), checks which path
    is in the compiled program, runs it and fetches the outputs to the host."""
    if reference:
        with jaxfox.use_reference():
            compiled = jax.jit(fn).lower(*args).compile()
            assert not _kernel_in(compiled.as_text())
            out = compiled(*args)
    else:
        compiled = jax.jit(fn).lower(*args).compile()
        assert _kernel_in(compiled.as_text()), "no IQL kernel in the compiled program: the kernel path was not taken"
        out = compiled(*args)
    return jax.device_get(out)


def _oracle(params, obs, target, taus, c, argnums=ALL):
    want = np_iql_grads(params, obs, target, taus, c)
    keys = (("dw1", "db1", "dw2", "db2") if 0 in argnums else ()) + (("dobs",) if 1 in argnums else ()) + \
        (("dtarget",) if 2 in argnums else ())
    return np_iql_loss(params, obs, target, taus), {k: want[k] for k in keys}


def _errors(got, want):
    """{name: rel_err} per array ("loss" and each gradient); shapes equal, every array finite."""
    (gl, gg), (wl, wg) = got, want
    assert gg.keys() == wg.keys(), (sorted(gg), sorted(wg))
    arrays = {"loss": (gl, wl), **{k: (gg[k], wg[k]) for k in gg}}
    for name, (a, b) in arrays.items():
        assert np.shape(a) == np.shape(b), (name, np.shape(a), np.shape(b))
        assert np.isfinite(np.asarray(a)).all(), f"{name}: not finite"
    return {name: rel_err(a, b) for name, (a, b) in arrays.items()}


def _assert_close(got, want, tol, what):
    """Rule 1 (exact-math inputs): rel_err <= tol for every array."""
    errs = _errors(got, want)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{what}: rel err > {tol}: {bad} (all: {errs})"
    return errs


def _assert_as_accurate_as_xla(got, ref, want, what):
    """Rule 2 (typical init): per array err(kernel) <= XLA_FACTOR err(reference) + XLA_SLACK against the float64
    oracle, and the losses within TOL of it."""
    ek, er = _errors(got, want), _errors(ref, want)
    both = {k: f"kernel {ek[k]:.2e} / reference {er[k]:.2e}" for k in ek}
    bad = {k: both[k] for k in ek if not ek[k] <= XLA_FACTOR * er[k] + XLA_SLACK}
    assert not bad, (f"{what}: kernel error > {XLA_FACTOR} x reference error + {XLA_SLACK} (vs float64 oracle): "
                     f"{bad} (all: {both})")
    assert ek["loss"] <= TOL, f"{what}: loss rel err {both['loss']} > {TOL}"
    return ek, er


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _exact(G, D, H, B, seed):
    params, obs, target = exact_inputs(G, D, H, B, seed=seed)
    assert_far_from_kinks(params, obs, target)
    return params, obs, target, cotangent(G, seed=seed)


# ----------------------------------------------------------------------------------------------
# (a) Exact-math inputs (no mask can flip): kernel vs the float64 oracle at TF32 accuracy.
@pytest.mark.parametrize("G,D,H,B,seed", iql_cases.KERNEL_VS_ORACLE)
def test_exact_math_kernel_matches_oracle(G, D, H, B, seed):
    args = _exact(G, D, H, B, seed)
    taus = taus_for(G)
    got = _run(_fwd_bwd(taus), *args)
    assert got[0].shape == (G,) and got[0].dtype == np.float32
    assert got[1]["dw1"].shape == (G, D, H) and got[1]["dobs"].shape == (B, D) and got[1]["dtarget"].shape == (B,)
    _assert_close(got, _oracle(*args[:3], taus, args[3]), TOL, "kernel vs float64 oracle (exact-math inputs)")


@pytest.mark.parametrize("G,D,H,B,seed", iql_cases.REFERENCE_VS_ORACLE)
def test_exact_math_reference_matches_oracle(G, D, H, B, seed):
    """The premise of TOL: XLA's TF32 path on the same GPU meets it too when no mask can flip."""
    args = _exact(G, D, H, B, seed)
    taus = taus_for(G)
    _assert_close(_run(_fwd_bwd(taus), *args, reference=True), _oracle(*args[:3], taus, args[3]), TOL,
                  "reference (XLA, TF32) vs float64 oracle (exact-math inputs)")


# ----------------------------------------------------------------------------------------------
# (b) Typical init: the kernel is as accurate as XLA's TF32 path (both flip masks near the kinks).
# (2, 256, 128, 12289): 97 tiles, so two networks a CTA (ffi/iql.cu kPairMinCtas = 96), the aux trainers' kernel; the
# other fused shapes here have fewer tiles and run one network a CTA
_TYPICAL_CASES = [(*s, True) for s in TYPICAL_SHAPES] + [(2, 256, 128, 10000, False), (1, 64, 64, 10001, False),
                                                          (2, 256, 128, 12289, False)]


@pytest.mark.parametrize("G,D,H,B,perturbed", _TYPICAL_CASES)
def test_typical_init_as_accurate_as_xla(G, D, H, B, perturbed):
    params, obs, target = typical_inputs(G, D, H, B, seed=G + B, perturbed=perturbed)
    taus, c = taus_for(G), cotangent(G, seed=B)
    got = _run(_fwd_bwd(taus), params, obs, target, c)
    ref = _run(_fwd_bwd(taus), params, obs, target, c, reference=True)
    _assert_as_accurate_as_xla(got, ref, _oracle(params, obs, target, taus, c),
                               f"typical init (perturbed={perturbed})")


@pytest.mark.parametrize("G,D,H,B", [(2, 256, 128, 37), (1, 64, 64, 1), (3, 128, 64, 1000)])
def test_forward_only(G, D, H, B):
    """The losses alone (no jax.grad; the kernel still computes the gradient): a ReLU is continuous, so TF32
    keeps the losses within TOL at typical init."""
    params, obs, target = typical_inputs(G, D, H, B, seed=3)
    taus = taus_for(G)
    loss = _run(lambda p, o, t: iql_value_loss(p, o, t, taus), params, obs, target)
    assert loss.shape == (G,) and loss.dtype == np.float32
    assert rel_err(loss, np_iql_loss(params, obs, target, taus)) <= TOL


@pytest.mark.parametrize("regime", ["exact", "typical"])
def test_grad_of_params_only_matches_oracle(regime):
    """jax.grad of sum_g c_g loss_g w.r.t. the params only (the training use): the kernel's gradient scaled by the
    cotangent; the backward's only product is XLA's dW1 = dpre^T obs (no d obs product)."""
    (G, D, H, B, seed), = iql_cases.PARAMS_ONLY
    if regime == "exact":
        args = _exact(G, D, H, B, seed)
    else:
        args = (*typical_inputs(G, D, H, B, seed=seed), cotangent(G, seed=seed))
    taus = (0.7, 0.9)
    f = _fwd_bwd(taus, argnums=(0,))
    got = _run(f, *args)
    want = _oracle(*args[:3], taus, args[3], argnums=(0,))
    if regime == "exact":
        _assert_close(got, want, TOL, "params-only gradient vs oracle (exact-math inputs)")
    else:
        _assert_as_accurate_as_xla(got, _run(f, *args, reference=True), want, "params-only gradient, typical init")


# ----------------------------------------------------------------------------------------------
# (f) d obs (XLA's dpre W1^T, from the dpre saved by the kernel) and d target (the kernel's dy) vs the oracle.
@pytest.mark.parametrize("argnums", [(1,), (2,), (1, 2), (0, 2), (0, 1)], ids=str)
@pytest.mark.parametrize("G,D,H,B,seed", iql_cases.DOBS_DTARGET)
def test_dobs_and_dtarget_match_oracle(G, D, H, B, seed, argnums):
    args = _exact(G, D, H, B, seed)
    taus = taus_for(G)
    got = _run(_fwd_bwd(taus, argnums), *args)
    _assert_close(got, _oracle(*args[:3], taus, args[3], argnums), TOL, f"argnums {argnums} vs oracle")
    if 0 in argnums:  # the parameter gradient does not depend on which other inputs are differentiated
        full = _run(_fwd_bwd(taus), *args)
        assert all(np.array_equal(got[1][k], full[1][k]) for k in ("dw1", "db1", "dw2", "db2"))
        assert np.array_equal(got[0], full[0])


def test_dtarget_is_per_row():
    """d target_b depends on row b alone: replacing every other row of the batch (by the others in reverse order)
    leaves d target_b bitwise unchanged (same shapes, so the same GEMM algorithms; a one-row call would be a
    different GEMM, whose TF32 rounding XLA may do differently)."""
    (G, D, H, B, seed), = iql_cases.DTARGET_PER_ROW
    params, obs, target, c = _exact(G, D, H, B, seed)
    taus = (0.7, 0.9)
    f = jax.jit(_fwd_bwd(taus, (2,))).lower(params, obs, target, c).compile()  # one executable for every call
    assert _kernel_in(f.as_text())
    _, g = jax.device_get(f(params, obs, target, c))
    for i in (0, 5, 31, 32, B - 1):
        others = np.array([j for j in range(B) if j != i])
        perm = np.arange(B)
        perm[others] = others[::-1]
        _, g2 = jax.device_get(f(params, obs[perm], target[perm], c))
        assert g2["dtarget"][i] == g["dtarget"][i], (i, g2["dtarget"][i], g["dtarget"][i])
        np.testing.assert_array_equal(g2["dtarget"][perm], g["dtarget"])  # every row moved with its data


# ----------------------------------------------------------------------------------------------
# (c) Bitwise repeatable; vmap.
@pytest.mark.parametrize("G,D,H,B", [(2, 256, 128, 16384), (3, 128, 64, 1000), (1, 64, 64, 5)])
def test_bitwise_repeatable(G, D, H, B):
    params, obs, target = typical_inputs(G, D, H, B, seed=13)
    args = (params, obs, target, cotangent(G, seed=13))
    f = jax.jit(_fwd_bwd(taus_for(G)))
    assert _kernel_in(f.lower(*args).compile().as_text())
    first = jax.device_get(f(*args))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(first))
    for _ in range(9):
        assert _leaves_equal(jax.device_get(f(*args)), first)


@pytest.mark.parametrize("H", [64, 128])
def test_vmap_matches_per_instance_calls(H):
    """vmap over params, obs and target: every instance matches its oracle within TOL, in the vmap and alone (XLA
    batches the products under vmap: other GEMM kernels than an instance alone, so other rounding of pre and dW1).
    vmap over target only (the first case's params and obs, targets from exact_targets: another case's target
    can sit next to these networks' values, where TF32 may flip an expectile weight): pre is then one unbatched
    product in both programs (XLA's GEMM autotuner off in both compilations, so the same GEMM kernel), and the
    kernel, called once an instance (vmap_method="sequential"), gives instance v the loss, db1, dw2 and db2 bits
    of instance v alone. H = 64 runs the head kernel; H = 128 on compute capability 9.0 the fused kernel (its own
    first product, the same for every instance)."""
    taus = (0.7, 0.9)
    shapes = [case for case in iql_cases.VMAP if case[2] == H]  # one (G, D, H, B, seed) an instance
    cases = [_exact(*case) for case in shapes]
    V = len(cases)
    c = cases[0][3]
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *[cs[i] for cs in cases]) for i in range(3)]
    vm = _run(jax.vmap(_fwd_bwd(taus), in_axes=(0, 0, 0, None)), *stacked, c)
    f = jax.jit(_fwd_bwd(taus))
    for v in range(V):
        one = jax.device_get(f(*cases[v][:3], c))
        want = _oracle(*cases[v][:3], taus, c)
        _assert_close(one, want, TOL, f"instance {v} alone")
        _assert_close(jax.tree.map(lambda a: a[v], vm), want, TOL, f"instance {v} in the vmap")

    fixed = {"xla_gpu_autotune_level": 0}
    params, obs, target, _ = cases[0]
    targets = exact_targets(params, obs, target, V, seed=shapes[0][4])
    for v in range(V):
        assert_far_from_kinks(params, obs, targets[v])
    vt = jax.jit(jax.vmap(_fwd_bwd(taus), in_axes=(None, None, 0, None))).lower(params, obs, targets, c)
    vt = vt.compile(compiler_options=fixed)
    assert _kernel_in(vt.as_text())
    vt = jax.device_get(vt(params, obs, targets, c))
    alone = jax.jit(_fwd_bwd(taus)).lower(params, obs, targets[0], c).compile(compiler_options=fixed)
    for v in range(V):
        one = jax.device_get(alone(params, obs, targets[v], c))
        assert np.array_equal(vt[0][v], one[0]), v
        for k in ("db1", "dw2", "db2"):
            assert np.array_equal(vt[1][k][v], one[1][k]), (v, k)
        _assert_close(jax.tree.map(lambda a: a[v], vt), _oracle(params, obs, targets[v], taus, c), TOL,
                      f"instance {v} of the vmap over target")


# ----------------------------------------------------------------------------------------------
# (e) The program: the FFI call on the kernel path only; no [G, B, H] buffer when obs is not differentiated.
def test_kernel_is_in_the_program_and_not_in_the_reference():
    G, D, H, B = 2, 256, 128, 37
    params, obs, target = typical_inputs(G, D, H, B)
    args = (params, obs, target, cotangent(G))
    f = _fwd_bwd((0.7, 0.9), argnums=(0, 2))
    assert _n_calls(jax.jit(f).lower(*args).as_text()) == 1
    text = jax.jit(f).lower(*args).compile().as_text()
    assert _kernel_in(text)
    # the lowered program carries zero placeholders for the reference branch's [G, B, H] residuals
    # (platform_dependent): the compiled one must not (no [B, H] activation in memory, ffi/iql.cu)
    acts = re.findall(rf"(?:f32|pred)\[{G},{B},{H}\]|(?:f32|pred)\[{G},{H},{B}\]|f32\[{B},{H}\]", text)
    assert not acts, f"[G, B, H] buffers in the compiled kernel-path program: {sorted(set(acts))}"
    with jaxfox.use_reference():
        assert not _kernel_in(jax.jit(f).lower(*args).compile().as_text())


@pytest.mark.parametrize("G,D,H,B,seed", iql_cases.OUTSIDE_THE_KERNEL)
def test_shapes_outside_the_kernel_run_the_reference(G, D, H, B, seed):
    """H not a multiple of 4, or above 512 (outside the kernel, jaxfox/iql.py _kernel_supported): the reference on
    CUDA (XLA, TF32), matching the oracle on exact-math inputs."""
    args = _exact(G, D, H, B, seed)
    compiled = jax.jit(_fwd_bwd(taus_for(G))).lower(*args).compile()
    assert not _kernel_in(compiled.as_text())
    _assert_close(jax.device_get(compiled(*args)), _oracle(*args[:3], taus_for(G), args[3]), TOL,
                  "reference on CUDA vs oracle")


def test_nan_target_gives_nan_loss():
    """A NaN in target makes every network's loss NaN (the mean over the rows), as on the reference path."""
    G, D, H, B = 2, 256, 128, 37
    params, obs, target = typical_inputs(G, D, H, B, seed=4)
    bad = target.at[7].set(jnp.nan)
    f = lambda p, o, t: iql_value_loss(p, o, t, (0.7, 0.9))  # noqa: E731
    assert np.isnan(_run(f, params, obs, bad)).all()
    assert np.isnan(_run(f, params, obs, bad, reference=True)).all()
    assert np.isfinite(_run(f, params, obs, target)).all()


# ----------------------------------------------------------------------------------------------
# (d) Command buffers (CUDA graphs) on and off: bitwise the same results.
_CMDBUF_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfox
    from jaxfox.models.aux import iql_init
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {}
    for (G, D, H, B) in ((2, 256, 128, 4097), (3, 128, 64, 37), (1, 64, 64, 5)):
        rng = np.random.default_rng(B)
        p = iql_init(jax.random.key(B), D, hidden=(H,), num_networks=G)
        obs = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
        target = jnp.asarray(rng.standard_normal(B), jnp.float32)
        c = jnp.asarray(rng.standard_normal(G), jnp.float32)
        taus = tuple(np.linspace(0.6, 0.9, G).tolist())

        def loss(p, o, t):
            return jnp.sum(c * jaxfox.iql_value_loss(p, o, t, taus))

        @jax.jit
        def run(p, o, t):  # several dependent calls, with and without d obs / d target: a graph worth capturing
            def body(carry, _):
                p, o = carry
                l, (gp, gt) = jax.value_and_grad(loss, argnums=(0, 2))(p, o, t)
                l2, go = jax.value_and_grad(loss, argnums=1)(p, o, t)
                p = jax.tree.map(lambda a, b: a - 1e-2 * b, p, gp)
                return (p, o + 1e-3 * go), (l + l2, gt)
            return jax.lax.scan(body, (p, o), None, length=3)

        text = run.lower(p, obs, target).compile().as_text()
        # the fused kernel on sm_90 at H = 128 (the first shape), the head kernel otherwise
        assert "jaxfox_iql_head" in text or "jaxfox_iql_fused" in text
        for it in range(3):  # command buffers are recorded / updated over the first executions
            (pp, oo), (l, gt) = jax.device_get(run(p, obs, target))
            out[f"{B}_obs_run{it}"] = oo
            out[f"{B}_loss_run{it}"] = l
            out[f"{B}_gtarget_run{it}"] = gt
            for i, leaf in enumerate(jax.tree.leaves(pp)):
                out[f"{B}_p{i}_run{it}"] = leaf
    np.savez(sys.argv[1], **out)
    print("DONE", len(out))
""")


def test_command_buffers_on_off_identical(tmp_path):
    assert_command_buffers_identical(_CMDBUF_SCRIPT, tmp_path)


# ----------------------------------------------------------------------------------------------
# (g) Training: optax adam on a fixed batch through the kernel.
def test_adam_training_losses_fall():
    """G = 2 value networks (expectiles 0.7, 0.9), D = 256, H = 128, B = 4096, fitted with optax.adam(1e-3) for 50
    steps on a fixed batch: target = a smooth function of 4 projections of obs + 0.3 N(0, 1) noise. The summed
    loss falls below 0.1 of its first value (the reference path on CPU: 6.01 -> 0.235), falls in at least 45 of the
    50 steps, and the kernel path ends within 10 % of the reference path on the same GPU."""
    import optax

    from jaxfox.models.aux import iql_init

    B, D, H, G = 4096, 256, 128, 2
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((B, D)).astype(np.float32)
    a = rng.standard_normal((D, 4)) / np.sqrt(D)
    target = (np.tanh(obs @ a) @ np.array([1.5, -1.0, 0.8, 0.5]) + 0.3 * rng.standard_normal(B)).astype(np.float32)
    obs, target = jnp.asarray(obs), jnp.asarray(target)
    params0 = iql_init(jax.random.key(0), D, hidden=(H,), num_networks=G)
    opt = optax.adam(1e-3)

    def train(reference):
        def step(p, s):
            loss, g = jax.value_and_grad(lambda p: jnp.sum(iql_value_loss(p, obs, target, (0.7, 0.9))))(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        if reference:
            with jaxfox.use_reference():
                compiled = jax.jit(step).lower(params0, opt.init(params0)).compile()
                assert not _kernel_in(compiled.as_text())
        else:
            compiled = jax.jit(step).lower(params0, opt.init(params0)).compile()
            assert _kernel_in(compiled.as_text())
        p, s, losses = params0, opt.init(params0), []
        for _ in range(50):
            p, s, loss = compiled(p, s)
            losses.append(float(loss))
        return np.asarray(losses)

    lk, lr = train(False), train(True)
    assert np.isfinite(lk).all() and np.isfinite(lr).all()
    assert lk[-1] < 0.1 * lk[0], (lk[0], lk[-1])
    assert int((np.diff(lk) < 0).sum()) >= 45, np.round(lk, 4)
    assert abs(lk[-1] - lr[-1]) <= 0.1 * lr[-1], (lk[-1], lr[-1])
    np.testing.assert_allclose(lk[0], np.sum(np_iql_loss(params0, obs, target, (0.7, 0.9))), rtol=TOL)


def test_exact_inputs_reach_every_mask_kind():
    """The exact-math inputs do exercise what they are for (so the exact tests cannot pass trivially): at the
    aux shape every network has switching units, both signs of u, and a non-trivial dW1 (not all zeros)."""
    (G, D, H, B, seed), = iql_cases.MASK_KINDS
    params, obs, target, c = _exact(G, D, H, B, seed)
    p, u = preactivations(params, obs, target)
    assert ((p > 0).mean(axis=(1, 2)) > 0.3).all() and ((p > 0).mean(axis=(1, 2)) < 0.7).all()
    assert ((u > 0).mean(axis=1) > 0.3).all() and ((u > 0).mean(axis=1) < 0.7).all()
    _, g = _run(_fwd_bwd((0.7, 0.9), (0,)), params, obs, target, c)
    assert set(g) == set(GRAD_KEYS[:4]) and np.abs(g["dw1"]).max() > 0


# (h) Which kernel: the fused one (ffi/iql.cu jaxfox_iql_fused: the first product on wgmma with the head in its
# epilogue) on compute capability 9.0 for H = 128 or 256 and D a multiple of 4 (at any B under this module's opt-in;
# by default from B = 4096, test_default_path_by_batch); the head kernel between XLA's products elsewhere. Both
# against the oracle on exact-math inputs.
@pytest.mark.parametrize("G,D,H,B,seed,fused", iql_cases.FUSED_WHERE_IT_APPLIES)
def test_fused_kernel_where_it_applies(G, D, H, B, seed, fused):
    from jaxfox._ffi import cuda_compute_capability

    want_fused = fused and cuda_compute_capability() == (9, 0)
    args = _exact(G, D, H, B, seed)
    compiled = jax.jit(_fwd_bwd(taus_for(G))).lower(*args).compile()
    text = compiled.as_text()
    assert ("jaxfox_iql_fused" in text) == want_fused and ("jaxfox_iql_head" in text) == (not want_fused)
    _assert_close(jax.device_get(compiled(*args)), _oracle(*args[:3], taus_for(G), args[3]), TOL,
                  f"{'fused' if want_fused else 'head'} kernel path vs oracle")


def test_two_networks_a_cta_give_the_bits_of_one():
    """At H = 128 the fused kernel computes two networks a CTA when G is even and the grid has at least 96 network-pair
    CTAs (G = 4, B = 6145: 49 tiles x 2 pairs), and one network a CTA when G is odd (G = 3):
    networks 0-2 of a G = 4 run must give the same bits as a G = 3 run of the same three networks in what the fused
    kernel and its finish kernel compute (each network's loss, db1, dw2, db2: the same products a k-step, the same
    head sums and the same fixed-order partial sums). dW1 is XLA's GEMM over all G H rows of dpre^T, whose tiling may
    change with G, so it is only held to the oracle."""
    from jaxfox._ffi import cuda_compute_capability

    if cuda_compute_capability() != (9, 0):
        pytest.skip("the fused kernel runs on compute capability 9.0 only")
    params4, obs, target, c4 = _exact(*iql_cases.TWO_NETWORKS_A_CTA[0])
    params3 = jax.tree.map(lambda x: x[:3], params4)
    out = {}
    for G, params, c in ((4, params4, c4), (3, params3, c4[:3])):
        compiled = jax.jit(_fwd_bwd(taus_for(G), argnums=(0,))).lower(params, obs, target, c).compile()
        assert "jaxfox_iql_fused" in compiled.as_text()
        out[G] = jax.device_get(compiled(params, obs, target, c))
        _assert_close(out[G], _oracle(params, obs, target, taus_for(G), c, argnums=(0,)), TOL, f"G = {G}")
    (l4, g4), (l3, g3) = out[4], out[3]
    np.testing.assert_array_equal(np.asarray(l4)[:3], np.asarray(l3))
    for k in ("db1", "dw2", "db2"):
        np.testing.assert_array_equal(np.asarray(g4[k])[:3], np.asarray(g3[k]), err_msg=k)


@pytest.mark.parametrize("G,D,H,B,seed,fused", iql_cases.DEFAULT_PATH_BY_BATCH)
def test_default_path_by_batch(monkeypatch, G, D, H, B, seed, fused):
    """Without JAXFOX_OPT_IN_KERNELS=iql (this module sets it), the aux trainers' shape takes the head path below
    4096 rows and the fused kernel from 4096 on (jaxfox.iql._FUSED_MIN_B; on compute capability 9.0 only), and
    both match the oracle."""
    from jaxfox._ffi import cuda_compute_capability

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
    want_fused = fused and cuda_compute_capability() == (9, 0)
    args = _exact(G, D, H, B, seed)
    compiled = jax.jit(_fwd_bwd(taus_for(G))).lower(*args).compile()
    text = compiled.as_text()
    assert ("jaxfox_iql_fused" in text) == want_fused and ("jaxfox_iql_head" in text) == (not want_fused)
    _assert_close(jax.device_get(compiled(*args)), _oracle(*args[:3], taus_for(2), args[3]), TOL, f"B = {B}")


def test_highest_precision_takes_the_head_path():
    """Under jax.default_matmul_precision("highest") the fused kernel (its product is TF32) is not taken: the head
    kernel runs after XLA's float32 product (jaxfox.iql._fused_supported), and the result matches the oracle."""
    (G, D, H, B, seed), = iql_cases.HIGHEST_PRECISION
    args = _exact(G, D, H, B, seed)
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(_fwd_bwd(taus_for(G))).lower(*args).compile()
        text = compiled.as_text()
        out = jax.device_get(compiled(*args))
    assert "jaxfox_iql_head" in text and "jaxfox_iql_fused" not in text
    _assert_close(out, _oracle(*args[:3], taus_for(G), args[3]), TOL, "highest precision, head path")
