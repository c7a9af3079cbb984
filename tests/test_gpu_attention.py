"""GPU tests of the attention_pool CUDA kernels (ffi/attention_pool.cu), run with ``pytest -m gpu``.

Every comparison is kernel path vs the pure-JAX reference path on the same GPU, both jitted, under
``jax.default_matmul_precision("highest")`` (the reference's matmuls in full float32); the CPU
tests (test_attention.py) tie the reference to a float64 NumPy oracle. Errors are
max|kernel - reference| / max|reference| per array.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfox
from jaxfox import attention_pool, attention_pool_init
from conftest import assert_command_buffers_identical, module_opt_in

pytestmark = pytest.mark.gpu
# The attention_pool kernel is opt-in (slower than XLA so far, see jaxfox._ffi.OPT_IN); these tests exercise
# it, and the command-buffer child processes inherit the setting.
_opt_in = module_opt_in("all")

if not jaxfox.kernels_available():
    pytest.skip(f"attention_pool kernels not available: {jaxfox.kernels_unavailable_reason()}",
                allow_module_level=True)

KEYS = ("q", "w_k", "w_v", "w_o", "b_o")
TOL = 1e-5


def _params(H, n, seed=0, scale=0.3):
    p = attention_pool_init(jax.random.key(seed), H, num_heads=n)
    rng = np.random.default_rng(seed + 100)
    return {k: p[k] + jnp.asarray(scale * rng.standard_normal(p[k].shape), jnp.float32) for k in KEYS}


def _inputs(B, T, H, seed=0, mask_kind="mixed", dtype=jnp.float32):
    rng = np.random.default_rng(seed + 200)
    hs = jnp.asarray(rng.standard_normal((B, T, H)), dtype)
    if mask_kind == "none":
        return hs, None
    m = rng.uniform(size=(B, T)) < 0.75
    m[:, 0] |= ~m.any(axis=1)
    if B >= 4:
        m[1] = False                 # all masked
        m[2] = False
        m[2, T // 2] = True          # a single valid step
        m[3, : max(1, T // 3)] = False  # leading padding
    return hs, jnp.asarray(m)


def _weights(B, T, H, n, seed=0):
    rng = np.random.default_rng(seed + 300)
    return (jnp.asarray(rng.standard_normal((B, H)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, n, T)), jnp.float32))


def _make_step(n, r1, r2):
    def loss(p, h, m):
        pooled, alpha = attention_pool(p, h, m, num_heads=n)
        return jnp.sum(pooled * r1) + jnp.sum(alpha * r2)

    def step(p, h, m):
        outs = attention_pool(p, h, m, num_heads=n)
        grads = jax.grad(loss, argnums=(0, 1))(p, h, m)
        return outs, grads

    return step


def _run(step, *args, reference=False):
    """Traces and runs a fresh jit of `step` (kernel path, or reference path when asked)."""
    with jax.default_matmul_precision("highest"):
        if reference:
            with jaxfox.use_reference():
                fn = jax.jit(lambda *a: step(*a))
                text = fn.lower(*args).as_text()
                out = fn(*args)
            assert "jaxfox_attention_pool" not in text
        else:
            fn = jax.jit(lambda *a: step(*a))
            text = fn.lower(*args).as_text()
            assert "jaxfox_attention_pool_fwd" in text and "jaxfox_attention_pool_bwd" in text
            out = fn(*args)
    return jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x), out)


def _relmax(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale > 0 else float(np.abs(a).max())


def _compare(got, want, tol=TOL, hs_tol=TOL):
    (gp, ga), (gdp, gdh) = got
    (wp, wa), (wdp, wdh) = want
    errs = {"pooled": _relmax(gp, wp), "alpha": _relmax(ga, wa), "d hs": _relmax(gdh, wdh)}
    errs.update({f"d {k}": _relmax(gdp[k], wdp[k]) for k in KEYS})
    for x in [gp, ga, gdh] + [gdp[k] for k in KEYS]:
        assert np.isfinite(x).all()
    bad = {k: v for k, v in errs.items() if v > (hs_tol if k == "d hs" else tol)}
    assert not bad, f"errors above tolerance: {bad} (all: {errs})"
    return errs


CASES = [  # B, T, H, n, mask kind (a block holds G = max(1, 64 // T) samples)
    (32, 64, 128, 4, "none"),
    (32, 64, 128, 4, "mixed"),
    (256, 64, 128, 4, "mixed"),   # 256 blocks: 8 partial rows a thread row in the d u sum
    (70, 64, 128, 4, "mixed"),    # 70 blocks: thread rows of 3 and 2 partial rows
    (37, 16, 64, 4, "mixed"),     # 4 samples a block (the aux trainer's widths), the last block partial
    (1100, 4, 8, 2, "mixed"),     # 16 samples a block, 69 blocks
    (5, 37, 24, 3, "mixed"),
    (4, 150, 128, 4, "mixed"),    # one sample of 150 rows a block: 100 KiB of shared memory (above 96 KiB)
    (3, 10, 130, 2, "mixed"),     # H % 4 != 0: 2 columns a lane, 3 of 4 chunks of 64, the third partial
    (5, 12, 96, 4, "mixed"),      # 2 columns a lane, 2 chunks of 64, the second half-used
    (3, 10, 30, 2, "mixed"),      # H % 4 != 0, one chunk (lanes 30, 31 idle)
    (3, 20, 264, 4, "mixed"),     # H > 256: 3 of 4 column chunks a lane, the third partial
    (6, 16, 16, 16, "mixed"),     # d_head = 1
    (6, 16, 64, 1, "none"),       # one head
    (2, 1, 128, 4, "none"),       # T = 1: up to 30 samples a block (what fits), 2 of them here
]


@pytest.mark.parametrize("B,T,H,n,mask_kind", CASES)
def test_kernel_matches_reference(B, T, H, n, mask_kind):
    params = _params(H, n, seed=B + T)
    hs, mask = _inputs(B, T, H, seed=B * T, mask_kind=mask_kind)
    step = _make_step(n, *_weights(B, T, H, n))
    if B >= 70:  # more partial rows than the d u sum's 32 thread rows (ffi/common.h FixedOrderColumnSum)
        assert -(-B // jaxfox.attention._samples_per_block(T, H, n)) > 32
    _compare(_run(step, params, hs, mask), _run(step, params, hs, mask, reference=True))


@pytest.mark.parametrize("B,T,H,n,mask_kind",
                         [CASES[1], CASES[2], CASES[4], CASES[7], CASES[8], (1024, 16, 64, 4, "none")])
def test_default_factored_path_matches_reference(B, T, H, n, mask_kind, monkeypatch):
    """The default CUDA path (no opt-in): XLA runs attention._factored, no jaxfox custom call; values and gradients
    as the reference's (both at "highest" precision), masks included."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
    calls = []
    factored = jaxfox.attention._factored
    monkeypatch.setattr(jaxfox.attention, "_factored", lambda *a: calls.append(a[2].shape) or factored(*a))
    params = _params(H, n, seed=B + T)
    hs, mask = _inputs(B, T, H, seed=B * T, mask_kind=mask_kind)
    step = _make_step(n, *_weights(B, T, H, n))
    with jax.default_matmul_precision("highest"):
        fn = jax.jit(step)
        assert "jaxfox_" not in fn.lower(params, hs, mask).as_text()
        assert calls and all(c == (B, T, H) for c in calls)  # the factored form ran, not the reference
        got = jax.tree.map(np.asarray, fn(params, hs, mask))
    _compare(got, _run(step, params, hs, mask, reference=True))


def test_bfloat16_hs():
    B, T, H, n = 32, 64, 128, 4
    params = _params(H, n, seed=1)
    hs, mask = _inputs(B, T, H, seed=2, dtype=jnp.bfloat16)
    step = _make_step(n, *_weights(B, T, H, n))
    got = _run(step, params, hs, mask)
    want = _run(step, params, hs, mask, reference=True)
    # d hs is rounded to bfloat16 from float32 values that agree to ~1e-6: at most one bf16 ulp apart.
    _compare(got, want, hs_tol=8e-3)
    assert np.mean(got[1][1] == want[1][1]) > 0.95


def test_all_masked_rows():
    B, T, H, n = 32, 64, 128, 4
    params = _params(H, n, seed=3)
    hs, mask = _inputs(B, T, H, seed=4)
    m = np.asarray(mask).copy()
    dead = [1, 9, 31]
    m[dead] = False
    hs = hs.at[jnp.asarray(dead)].multiply(1e3)  # large values in masked rows change nothing
    r1, r2 = _weights(B, T, H, n)
    (pooled, alpha), (dp, dh) = _run(_make_step(n, r1, r2), params, hs, jnp.asarray(m))
    assert np.all(pooled[dead] == 0.0) and np.all(alpha[dead] == 0.0) and np.all(dh[dead] == 0.0)
    assert all(np.isfinite(x).all() for x in [pooled, alpha, dh] + [dp[k] for k in KEYS])
    keep = np.array([b for b in range(B) if b not in dead])
    (p2, a2), (dp2, dh2) = _run(_make_step(n, r1[keep], r2[keep]), params, hs[keep], jnp.asarray(m[keep]))
    # alpha comes from the kernel alone (bitwise); pooled and d hs also pass through XLA's batched GEMMs, whose
    # algorithm may change with the batch size
    assert np.array_equal(alpha[keep], a2)
    assert _relmax(p2, pooled[keep]) <= 1e-6 and _relmax(dh2, dh[keep]) <= 1e-6
    for k in KEYS:
        assert _relmax(dp[k], dp2[k]) <= TOL, k
    # every sample masked: all zeros, no NaN
    (pooled, alpha), (dp, dh) = _run(_make_step(n, r1, r2), params, hs, jnp.zeros((B, T), bool))
    for x in [pooled, alpha, dh] + [dp[k] for k in KEYS]:
        assert np.all(x == 0.0)


def test_single_sample_equals_batch():
    B, T, H, n = 32, 64, 128, 4
    params = _params(H, n, seed=5)
    hs, mask = _inputs(B, T, H, seed=6)
    r1, r2 = _weights(B, T, H, n)
    (pooled, alpha), (_, dh) = _run(_make_step(n, r1, r2), params, hs, mask)
    for i in (0, 2, 3, 17, 31):
        (p1, a1), (_, dh1) = _run(_make_step(n, r1[i:i + 1], r2[i:i + 1]), params, hs[i:i + 1], mask[i:i + 1])
        assert _relmax(p1, pooled[i:i + 1]) <= 1e-6
        assert _relmax(a1, alpha[i:i + 1]) <= 1e-6
        assert _relmax(dh1, dh[i:i + 1]) <= 1e-6


@pytest.mark.parametrize("B", [32, 256])
def test_bitwise_deterministic(B):
    T, H, n = 64, 128, 4
    params = _params(H, n, seed=7)
    hs, mask = _inputs(B, T, H, seed=8)
    step = jax.jit(_make_step(n, *_weights(B, T, H, n)))
    first = jax.tree.map(np.asarray, step(params, hs, mask))
    for _ in range(9):
        again = jax.tree.map(np.asarray, step(params, hs, mask))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            assert np.array_equal(a, b)


def test_vmap_matches_reference():
    V, B, T, H, n = 3, 8, 64, 128, 4
    ps = [_params(H, n, seed=s) for s in range(V)]
    stacked = {k: jnp.stack([p[k] for p in ps]) for k in KEYS}
    rng = np.random.default_rng(9)
    hs = jnp.asarray(rng.standard_normal((V, B, T, H)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(V, B, T)) < 0.7).at[:, :, 0].set(True).at[1, 2].set(False)
    step = jax.vmap(_make_step(n, *_weights(B, T, H, n)))
    _compare(_run(step, stacked, hs, mask), _run(step, stacked, hs, mask, reference=True))


_CMDBUF_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfox
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {}
    for (B, T, H, n) in ((32, 64, 128, 4), (256, 64, 128, 4), (5, 37, 24, 3)):
        rng = np.random.default_rng(B)
        p = jaxfox.attention_pool_init(jax.random.key(0), H, num_heads=n)
        p = {k: v + jnp.asarray(0.3 * rng.standard_normal(v.shape), jnp.float32) for k, v in p.items()}
        hs = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
        m = rng.uniform(size=(B, T)) < 0.75
        m[:, 0] = True
        m[1] = False
        mask = jnp.asarray(m)
        r1 = jnp.asarray(rng.standard_normal((B, H)), jnp.float32)
        r2 = jnp.asarray(rng.standard_normal((B, n, T)), jnp.float32)

        def loss(p, h):
            pooled, alpha = jaxfox.attention_pool(p, h, mask, num_heads=n)
            return jnp.sum(pooled * r1) + jnp.sum(alpha * r2)

        @jax.jit
        def run(p, h):  # several dependent calls: a graph worth capturing
            def body(c, _):
                l, (gp, gh) = jax.value_and_grad(loss, argnums=(0, 1))(p, h + 1e-3 * c)
                return c + gh, (l, gp)
            return jax.lax.scan(body, jnp.zeros_like(h), None, length=3)

        assert "jaxfox_attention_pool_bwd" in run.lower(p, hs).as_text()
        for it in range(3):  # command buffers are recorded / updated over the first executions
            c, (l, gp) = jax.device_get(run(p, hs))
            out[f"{B}_c_run{it}"] = c
            out[f"{B}_loss_run{it}"] = l
            for k, v in gp.items():
                out[f"{B}_g{k}_run{it}"] = v
    np.savez(sys.argv[1], **out)
    print("DONE", len(out))
""")


def test_command_buffers_on_off_identical(tmp_path):
    assert_command_buffers_identical(_CMDBUF_SCRIPT, tmp_path)


def test_training_loss_falls():
    """B = 32, T = 64: attention pooling + a linear readout learns an attention-pooled target."""
    import optax

    B, T, H, n = 32, 64, 32, 4
    rng = np.random.default_rng(0)
    N = 8 * B
    hs = rng.standard_normal((N, T, H)).astype(np.float32)
    mask = np.arange(T)[None, :] < rng.integers(16, T + 1, size=(N, 1))
    logits = np.where(mask, 3.0 * hs[:, :, 1], -np.inf)
    w = np.exp(logits - logits.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    y = (w * hs[:, :, 0]).sum(1).astype(np.float32)
    params = {"pool": attention_pool_init(jax.random.key(0), H, num_heads=n), "w_r": jnp.zeros((H,)),
              "c": jnp.zeros(())}
    opt = optax.adam(1e-2)
    state = opt.init(params)

    def loss_fn(p, h, m, y):
        pooled, _ = attention_pool(p["pool"], h, m, num_heads=n)
        return jnp.mean((pooled @ p["w_r"] + p["c"] - y) ** 2)

    @jax.jit
    def step(p, s, h, m, y):
        loss, g = jax.value_and_grad(loss_fn)(p, h, m, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    assert "jaxfox_attention_pool_bwd" in step.lower(params, state, hs[:B], mask[:B], y[:B]).as_text()
    losses = []
    for it in range(300):
        k = (it % 8) * B
        params, state, loss = step(params, state, hs[k:k + B], mask[k:k + B], y[k:k + B])
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    first, last = np.mean(losses[:8]), np.mean(losses[-8:])
    assert last < 0.3 * first, (first, last)


def test_parameter_gradient_without_hs_gradient_aux_shape():
    """The aux attention trainer's use (hs is data): the gradient w.r.t. the parameters only, at its widths
    (T = 16, H = 64, 4 heads: 4 samples a block); the backward kernel skips d hs."""
    B, T, H, n = 600, 16, 64, 4
    params = _params(H, n, seed=11)
    hs, mask = _inputs(B, T, H, seed=12)
    r1, r2 = _weights(B, T, H, n)

    def grad_params(p, h, m):
        def loss(p):
            pooled, alpha = attention_pool(p, h, m, num_heads=n)
            return jnp.sum(pooled * r1) + jnp.sum(alpha * r2)
        return jax.grad(loss)(p)

    with jax.default_matmul_precision("highest"):
        fn = jax.jit(grad_params)
        hlo = fn.lower(params, hs, mask).compile().as_text()
        assert "jaxfox_attention_pool_bwd" in hlo
        got = jax.device_get(fn(params, hs, mask))
        with jaxfox.use_reference():
            want = jax.device_get(jax.jit(grad_params)(params, hs, mask))
    errs = {k: _relmax(got[k], want[k]) for k in KEYS}
    assert all(v <= TOL for v in errs.values()), errs
