"""CPU tests of jaxfox.attention (attention_pool_init, attention_pool).

Oracle: ``np_attention_pool`` below, a float64 NumPy loop over samples and heads written from
OPS.md "Attention pooling over time" (K and V formed, softmax over the valid steps only); it shares
no code with the library. Gradients are checked against float64 central differences of it.

The kernel path cannot run here, but its host side can: ``kernel_path`` replaces ``jax.ffi.ffi_call``
by ``jax.pure_callback`` into ``_emu_fwd`` / ``_emu_bwd``, a float64 NumPy transcription of the
algorithm of ffi/attention_pool.cu (no K or V; u = W_k q / sqrt d; per-sample factors; per-block
d u partials summed over the blocks). That checks the custom_vjp wiring (operand and output order, attrs,
workspace sizes, vmap through broadcast_all, dtypes) and the derivation of the factored gradients
against the oracle. The CUDA code itself is tested in test_gpu_attention.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import assert_raises_naming as _bad, central_diff_grad, rel_err
import jaxfox
from jaxfox import attention_pool, attention_pool_init
from jaxfox import attention as attn_mod

KEYS = ("q", "w_k", "w_v", "w_o", "b_o")


# ----------------------------------------------------------------------------------------------
# Float64 oracle.
def np_attention_pool(params, hs, mask, num_heads):
    """pooled [B, H], alpha [B, n, T] in float64, straight from the equations."""
    p = {k: np.asarray(params[k], np.float64) for k in KEYS}
    hs = np.asarray(hs, np.float64)
    B, T, H = hs.shape
    n, d = num_heads, H // num_heads
    valid_all = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    pooled = np.zeros((B, H))
    alpha = np.zeros((B, n, T))
    for b in range(B):
        valid = valid_all[b]
        if not valid.any():
            continue                                   # pooled 0, alpha 0
        K = hs[b] @ p["w_k"]                           # [T, H]
        V = hs[b] @ p["w_v"]
        pv = np.zeros(H)
        for j in range(n):
            cols = slice(j * d, (j + 1) * d)
            s = K[valid][:, cols] @ p["q"].reshape(-1)[cols] / math.sqrt(d)
            e = np.exp(s - s.max())
            a = e / e.sum()
            alpha[b, j, valid] = a
            pv[cols] = a @ V[valid][:, cols]
        pooled[b] = pv @ p["w_o"] + p["b_o"]
    return pooled, alpha


def random_params(H, n, seed=0, scale=0.4):
    """attention_pool_init plus a perturbation of every leaf (b_o nonzero, sharper attention)."""
    params = attention_pool_init(jax.random.key(seed), H, num_heads=n)
    rng = np.random.default_rng(seed + 1000)
    return {k: params[k] + jnp.asarray(scale * rng.standard_normal(params[k].shape), jnp.float32) for k in KEYS}


def random_mask(B, T, seed=0, all_masked=(), single=()):
    rng = np.random.default_rng(seed + 2000)
    m = rng.uniform(size=(B, T)) < 0.7
    m[:, 0] |= ~m.any(axis=1)
    for b in all_masked:
        m[b] = False
    for b in single:
        m[b] = False
        m[b, T // 2] = True
    return m


def _setup(B=3, T=5, H=8, n=2, seed=0, masked=True, **mask_kw):
    params = random_params(H, n, seed)
    hs = np.random.default_rng(seed + 3000).standard_normal((B, T, H)).astype(np.float32)
    mask = random_mask(B, T, seed, **mask_kw) if masked else None
    return params, hs, mask


def _weights(B, T, H, n, seed=0):
    rng = np.random.default_rng(seed + 4000)
    return rng.standard_normal((B, H)), rng.standard_normal((B, n, T))


def _loss_jax(params, hs, mask, n, r1, r2):
    pooled, alpha = attention_pool(params, hs, None if mask is None else jnp.asarray(mask), num_heads=n)
    return jnp.sum(pooled * jnp.asarray(r1, jnp.float32)) + jnp.sum(alpha * jnp.asarray(r2, jnp.float32))


def _oracle_grads(params, hs, mask, n, r1, r2, eps=1e-6):
    """Float64 central differences of the oracle loss w.r.t. every parameter and hs."""
    H = hs.shape[-1]
    base = {k: np.asarray(params[k], np.float64) for k in KEYS}
    sizes = [base[k].size for k in KEYS]
    x0 = np.concatenate([base[k].ravel() for k in KEYS] + [np.asarray(hs, np.float64).ravel()])

    def f(x):
        p, o = {}, 0
        for k, s in zip(KEYS, sizes):
            p[k] = x[o:o + s].reshape(base[k].shape)
            o += s
        pooled, alpha = np_attention_pool(p, x[o:].reshape(hs.shape), mask, n)
        return float(np.sum(pooled * r1) + np.sum(alpha * r2))

    g = central_diff_grad(f, x0, eps)
    out, o = {}, 0
    for k, s in zip(KEYS, sizes):
        out[k] = g[o:o + s].reshape(base[k].shape)
        o += s
    assert H == hs.shape[-1]
    return out, g[o:].reshape(hs.shape)


def _assert_grads_match_oracle(params, hs, mask, n, r1, r2, oracle_hs=None, tol=1e-4):
    """jax.grad of _loss_jax w.r.t. (params, hs) against the float64 central differences of the oracle (taken at
    ``oracle_hs``, default hs: e.g. the unpadded values where hs holds padding at masked steps), every parameter
    leaf and hs within ``tol``. Returns (gp, gh, wp) for further checks."""
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, n, r1, r2)
    wp, wh = _oracle_grads(params, hs if oracle_hs is None else oracle_hs, mask, n, r1, r2)
    for k in KEYS:
        _assert_f32_close(gp[k], wp[k], tol=tol)
    _assert_f32_close(gh, wh, tol=tol)
    return gp, gh, wp


def _assert_f32_close(got, want, tol=1e-5):
    got = np.asarray(got)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= tol, err


CONFIGS = [  # (B, T, H, n)
    (3, 5, 8, 2),
    (2, 7, 12, 3),
    (4, 6, 8, 1),     # one head, d = H
    (2, 4, 6, 6),     # d = 1
]


@pytest.fixture(params=["reference", "factored"])
def path(request, monkeypatch):
    """Each test runs twice: on this machine's path (the reference) and on CUDA's default path,
    attention._factored (K and V never formed), run here through a patched dispatch."""
    if request.param == "factored":
        monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
        monkeypatch.setattr(attn_mod, "dispatch", lambda cuda_fn, reference_fn, *a, **k: cuda_fn(*a))
    return request.param


# ----------------------------------------------------------------------------------------------
# Values.
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B,T,H,n", CONFIGS)
def test_matches_float64_oracle(B, T, H, n, masked, path):
    params, hs, mask = _setup(B, T, H, n, seed=B + T + H + n, masked=masked)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), None if mask is None else jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    assert np.std(want_a) > 0.02  # attention is not uniform: the case is not trivial
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)
    assert alpha.shape == (B, n, T)
    if mask is not None:
        assert np.all(np.asarray(alpha)[np.broadcast_to(~mask[:, None, :], alpha.shape)] == 0.0)
    np.testing.assert_allclose(np.asarray(alpha).sum(-1), 1.0, rtol=1e-6)


def test_mask_all_true_equals_no_mask():
    params, hs, _ = _setup(masked=False)
    a = attention_pool(params, jnp.asarray(hs), num_heads=2)
    b = attention_pool(params, jnp.asarray(hs), jnp.ones(hs.shape[:2], bool), num_heads=2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_alpha_semantics_match_jax_softmax_where():
    """alpha = jax.nn.softmax(scores, where=mask), scores computed here independently (float64)."""
    B, T, H, n = 3, 6, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=7, all_masked=(1,))
    d = H // n
    k = np.asarray(hs, np.float64) @ np.asarray(params["w_k"], np.float64)
    s = np.einsum("btjd,jd->bjt", k.reshape(B, T, n, d), np.asarray(params["q"], np.float64).reshape(n, d)) / 2.0
    want = jax.nn.softmax(jnp.asarray(s, jnp.float32), axis=-1, where=jnp.asarray(mask)[:, None, :])
    _, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    np.testing.assert_allclose(np.asarray(alpha), np.asarray(want), atol=2e-6)


# ----------------------------------------------------------------------------------------------
# Gradients.
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B,T,H,n", CONFIGS[:3])
def test_grads_match_oracle_finite_differences(B, T, H, n, masked, path):
    params, hs, mask = _setup(B, T, H, n, seed=11 + B + n, masked=masked)
    r1, r2 = _weights(B, T, H, n, seed=B)
    _, _, wp = _assert_grads_match_oracle(params, hs, mask, n, r1, r2)
    assert np.abs(wp["w_k"]).max() > 1e-3 and np.abs(wp["q"]).max() > 1e-3  # score path is exercised


def test_check_grads(path):
    params, hs, mask = _setup(2, 4, 8, 2, seed=5)
    r1, r2 = _weights(2, 4, 8, 2)

    def f(params, hs):
        return _loss_jax(params, hs, mask, 2, r1, r2)

    check_grads(f, (params, jnp.asarray(hs)), order=1, modes=("fwd", "rev"), atol=5e-2, rtol=5e-2, eps=1e-2)


# ----------------------------------------------------------------------------------------------
# Edge cases.
def test_all_masked_sample(path):
    B, T, H, n = 4, 6, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=21, all_masked=(2,))
    hs[2] = 1e3 * np.random.default_rng(0).standard_normal((T, H))  # large values there change nothing
    r1, r2 = _weights(B, T, H, n, seed=3)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    pooled, alpha = np.asarray(pooled), np.asarray(alpha)
    assert np.all(pooled[2] == 0.0) and np.all(alpha[2] == 0.0)
    assert np.isfinite(pooled).all() and np.isfinite(alpha).all()
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)

    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, n, r1, r2)
    assert all(np.isfinite(np.asarray(gp[k])).all() for k in KEYS) and np.isfinite(np.asarray(gh)).all()
    assert np.all(np.asarray(gh)[2] == 0.0)
    # The other samples are unaffected: same outputs and same parameter gradient without sample 2.
    keep = [0, 1, 3]
    # (XLA:CPU blocks its float32 matmuls by batch size, so B=3 and B=4 round differently: ~1e-5.)
    p2, a2 = attention_pool(params, jnp.asarray(hs[keep]), jnp.asarray(mask[keep]), num_heads=n)
    np.testing.assert_allclose(np.asarray(p2), pooled[keep], rtol=3e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a2), alpha[keep], rtol=3e-5, atol=1e-6)
    gp2, gh2 = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs[keep]), mask[keep], n, r1[keep], r2[keep])
    for k in KEYS:
        np.testing.assert_allclose(np.asarray(gp[k]), np.asarray(gp2[k]), rtol=3e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gh)[keep], np.asarray(gh2), rtol=3e-5, atol=1e-6)


def test_every_sample_masked(path):
    params, hs, _ = _setup(3, 4, 8, 2)
    mask = np.zeros((3, 4), bool)
    r1, r2 = _weights(3, 4, 8, 2)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=2)
    assert np.all(np.asarray(pooled) == 0.0) and np.all(np.asarray(alpha) == 0.0)
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, 2, r1, r2)
    for leaf in list(gp.values()) + [gh]:
        assert np.all(np.asarray(leaf) == 0.0)


def test_single_valid_step(path):
    B, T, H, n = 3, 7, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=31, single=(1,))
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    alpha = np.asarray(alpha)
    t0 = T // 2
    assert np.all(alpha[1, :, t0] == 1.0)
    assert np.all(np.delete(alpha[1], t0, axis=1) == 0.0)
    p = {k: np.asarray(params[k], np.float64) for k in KEYS}
    want = (hs[1, t0].astype(np.float64) @ p["w_v"]) @ p["w_o"] + p["b_o"]  # pooled = v_t0 W_o + b_o
    _assert_f32_close(np.asarray(pooled)[1], want)
    # The scores cannot matter: the gradient of w_k and q from this sample alone is 0.
    r1, r2 = _weights(1, T, H, n)
    gp = jax.grad(_loss_jax)(params, jnp.asarray(hs[1:2]), mask[1:2], n, r1, r2)
    assert np.all(np.asarray(gp["w_k"]) == 0.0) and np.all(np.asarray(gp["q"]) == 0.0)


def _large_logit_case(kind):
    """Scores of about +-1e4 that are exact in float32 (W_k = I, only q[0] and q[4] nonzero, d = 4).

    kind "q": a large query (|q| = 16384) on unit-scale states; kind "h": a unit query (2 / sqrt(4))
    on states of about +-1e4.
    """
    B, T, H, n = 2, 6, 8, 2
    params, _, _ = _setup(B, T, H, n, seed=41)
    params = dict(params)
    params["w_k"] = jnp.eye(H, dtype=jnp.float32)
    rng = np.random.default_rng(5)
    hs = rng.standard_normal((B, T, H)).astype(np.float32)
    t = np.arange(T, dtype=np.float32)
    if kind == "q":
        params["q"] = jnp.asarray([[16384.0, 0, 0, 0], [-16384.0, 0, 0, 0]], jnp.float32)  # s_j = +-8192 h[4 j]
        hs[0, :, 0] = 1 - t / 8192         # head 0 scores 8192 - t
        hs[0, :, 4] = 1 - t / 16384        # head 1 scores -8192 + t / 2
        hs[1, :, 0] = np.where(t % 2 == 0, 1.25, -1.25)   # +-10240: saturated
        hs[1, :, 4] = np.where(t < 3, 1.0, 1 - 1 / 8192)
    else:
        params["q"] = jnp.asarray([[2.0, 0, 0, 0], [2.0, 0, 0, 0]], jnp.float32)       # s_j = h[4 j]
        hs[0, :, 0] = 1e4 - t
        hs[0, :, 4] = -1e4 + 0.5 * t
        hs[1, :, 0] = np.where(t % 2 == 0, 1e4, -1e4)
        hs[1, :, 4] = np.where(t < 3, -1e4 + t, -9990.0)
    mask = np.ones((B, T), bool)
    mask[1, 0] = False               # the largest logit of sample 1, head 0 is masked
    return params, hs, mask, n


@pytest.mark.parametrize("kind", ["q", "h"])
def test_large_logits(kind, path):
    params, hs, mask, n = _large_logit_case(kind)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    assert np.isfinite(np.asarray(pooled)).all() and np.isfinite(np.asarray(alpha)).all()
    np.testing.assert_allclose(np.asarray(alpha), want_a, atol=1e-6)
    assert abs(float(want_a[0, 0, 1]) - math.exp(-1) / sum(math.exp(-k) for k in range(6))) < 1e-12
    assert np.all(np.asarray(alpha)[1, 0, 0] == 0.0) and abs(float(np.asarray(alpha)[1, 0, 2]) - 0.5) < 1e-6
    _assert_f32_close(pooled, want_p)
    r1, r2 = _weights(2, 6, 8, n)
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, n, r1, r2)
    assert all(np.isfinite(np.asarray(gp[k])).all() for k in KEYS) and np.isfinite(np.asarray(gh)).all()
    wp, wh = _oracle_grads(params, hs, mask, n, r1, r2, eps=1e-8 if kind == "q" else 1e-4)
    if kind == "q":
        for k in KEYS:
            _assert_f32_close(gp[k], wp[k], tol=1e-4)
        _assert_f32_close(gh, wh, tol=1e-4)
    else:
        # With states of 1e4 the softmax backward a - rho (a = dalpha + h . dc ~ 1e4) loses about
        # 1e-3 absolute in float32 (in any float32 implementation), and d q, d W_k multiply that by
        # h ~ 1e4 again: only the gradients that do not pass through the scores are tight.
        for k in ("w_v", "w_o", "b_o"):
            _assert_f32_close(gp[k], wp[k], tol=1e-5)


def test_bfloat16_hs_keeps_float32_softmax(path):
    B, T, H, n = 3, 9, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=51)
    params = dict(params)
    params["q"] = params["q"] * 4.0   # sharp attention: bf16 scores or softmax would be off by ~1e-2
    hs_bf = jnp.asarray(hs, jnp.bfloat16)
    hs_exact = np.asarray(hs_bf.astype(jnp.float32))  # the values the bf16 array holds
    pooled, alpha = attention_pool(params, hs_bf, jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs_exact, mask, n)
    assert pooled.dtype == jnp.float32 and alpha.dtype == jnp.float32
    _assert_f32_close(alpha, want_a)
    _assert_f32_close(pooled, want_p)
    r1, r2 = _weights(B, T, H, n)
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, hs_bf, mask, n, r1, r2)
    assert gh.dtype == jnp.bfloat16 and gp["w_k"].dtype == jnp.float32
    wp, wh = _oracle_grads(params, hs_exact, mask, n, r1, r2)
    _assert_f32_close(gp["w_v"], wp["w_v"], tol=1e-4)
    assert rel_err(np.asarray(gh.astype(jnp.float32)), wh) < 1e-2  # bf16 rounding of the result only


@pytest.mark.parametrize("B,T,H,n", [
    (1, 1, 8, 2),     # one sample, one step
    (3, 1, 4, 4),     # T = 1, d = 1, sample 1 all masked
    (1, 6, 6, 6),     # B = 1, d = 1 (num_heads = H)
    (2, 6, 5, 1),     # odd H, one head
    (3, 5, 6, 3),     # odd d, holes and an all-masked sample
])
def test_small_shapes_values_and_grads(B, T, H, n, path):
    """T = 1, B = 1, head width 1 and odd widths: values, alpha and every gradient against the float64 oracle."""
    params, hs, _ = _setup(B, T, H, n, seed=100 + B + T + H + n, masked=False)
    mask = np.ones((B, T), bool)
    mask[:, 1::2] = False                # holes (none when T = 1)
    if B == 3:
        mask[1] = False                  # an all-masked sample
    r1, r2 = _weights(B, T, H, n, seed=T)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)
    _, gh, _ = _assert_grads_match_oracle(params, hs, mask, n, r1, r2)
    assert np.all(np.asarray(gh)[~mask] == 0.0)  # masked steps get exactly zero gradient


def test_params_only_grad_of_pooled(path):
    """The aux trainer's use (jaxfox.models.aux.attention_loss): no mask, alpha discarded, jax.grad w.r.t. the
    params only, under jit; against the float64 oracle."""
    B, T, H, n = 5, 4, 8, 2
    params, hs, _ = _setup(B, T, H, n, seed=111, masked=False)
    r1 = np.random.default_rng(3).standard_normal((B, H))

    @jax.jit
    def loss(p, h):
        pooled, _ = attention_pool(p, h, num_heads=n)
        return jnp.sum(pooled * jnp.asarray(r1, jnp.float32))

    gp = jax.jit(jax.grad(loss))(params, jnp.asarray(hs))
    wp, _ = _oracle_grads(params, hs, None, n, r1, np.zeros((B, n, T)))
    for k in KEYS:
        _assert_f32_close(gp[k], wp[k], tol=1e-4)
    assert np.abs(wp["q"]).max() > 1e-3 and set(gp) == set(KEYS)


def test_large_common_offset_in_hs(path):
    """hs = x + 1000 (a large common offset): the softmax cancels the offset's share of each score, but float32
    scores keep only ~1e-4 of it (hs u ~ 1e3 |u|). Values and the gradients that do not pass through the scores
    stay tight; d q and d W_k (x^T ds with x ~ 1e3 and sum_t ds_t = 0) lose a few 1e-2 relative on either path
    (float32 conditioning, not an error of the form), so they are not asserted."""
    B, T, H, n = 3, 6, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=121, all_masked=(2,))
    hs = hs + np.float32(1000.0)
    r1, r2 = _weights(B, T, H, n, seed=4)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    _assert_f32_close(pooled, want_p, tol=1e-6)
    _assert_f32_close(alpha, want_a, tol=5e-4)
    assert np.all(np.asarray(pooled)[2] == 0.0)
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, n, r1, r2)
    wp, wh = _oracle_grads(params, hs, mask, n, r1, r2)
    for k in ("w_v", "w_o", "b_o"):
        _assert_f32_close(gp[k], wp[k], tol=1e-5)
    _assert_f32_close(gh, wh, tol=1e-3)
    assert all(np.isfinite(np.asarray(gp[k])).all() for k in ("q", "w_k"))
    assert np.all(np.asarray(gh)[2] == 0.0)


def test_masked_padding(path):
    """The docstring's padding caveat: masked steps padded with 1e30 change nothing (values, and every gradient,
    as the oracle that drops them); a NaN or Inf at a masked step makes that sample's pooled NaN and no other's."""
    B, T, H, n = 3, 6, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=131, all_masked=(1,))
    mask[0, 2] = False
    big = hs.copy()
    big[~mask] = 1e30
    r1, r2 = _weights(B, T, H, n, seed=6)
    pooled, alpha = attention_pool(params, jnp.asarray(big), jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)
    _assert_grads_match_oracle(params, big, mask, n, r1, r2, oracle_hs=hs)
    for bad in (np.nan, np.inf):
        h = hs.copy()
        h[0, 2, 3] = bad
        pooled, alpha = attention_pool(params, jnp.asarray(h), jnp.asarray(mask), num_heads=n)
        pooled = np.asarray(pooled)
        assert np.isnan(pooled[0]).any()
        np.testing.assert_allclose(pooled[1:], want_p[1:], rtol=1e-5, atol=1e-6)
        _assert_f32_close(alpha, want_a)


# ----------------------------------------------------------------------------------------------
# API errors.
def test_errors():
    params, hs, mask = _setup(2, 5, 8, 2)
    hs = jnp.asarray(hs)
    mask = jnp.asarray(mask)
    ap = functools.partial(attention_pool, num_heads=2)
    _bad(lambda: ap(params, hs, mask.astype(jnp.int32)), TypeError, "mask", "bool", "int32")
    _bad(lambda: ap(params, hs, mask.astype(jnp.float32)), TypeError, "mask", "bool")
    _bad(lambda: ap(params, hs, mask[:, :4]), ValueError, "mask", "[2, 5]", "(2, 4)")
    _bad(lambda: ap(params, hs, mask[None]), ValueError, "mask", "(1, 2, 5)")
    _bad(lambda: ap(params, hs.astype(jnp.int32), mask), TypeError, "hs", "int32")
    _bad(lambda: ap(params, hs.astype(jnp.float16), mask), TypeError, "hs", "float16")
    _bad(lambda: ap(params, np.asarray(hs, np.float64), mask), TypeError, "hs", "float64")
    _bad(lambda: ap(params, hs[0], mask), ValueError, "hs", "[B, T, H]", "(5, 8)")
    _bad(lambda: ap(params, [[1.0]], mask), TypeError, "hs")
    _bad(lambda: ap(params, hs[..., :6], mask), ValueError, "params['q']", "[num_heads, H / num_heads]", "H = 6",
         "(2, 4)")
    _bad(lambda: ap({**params, "q": params["q"].reshape(8)}, hs, mask), ValueError, "params['q']", "(8,)")
    _bad(lambda: ap({**params, "q": params["q"].astype(jnp.bfloat16)}, hs, mask), TypeError, "params['q']", "float32")
    _bad(lambda: attention_pool(params, hs, mask, num_heads=4), ValueError, "num_heads=4", "2 heads")
    _bad(lambda: attention_pool(params, hs, mask, num_heads=3), ValueError, "num_heads", "8")
    _bad(lambda: attention_pool(params, hs, mask, num_heads=0), ValueError, "num_heads")
    _bad(lambda: attention_pool(params, hs, mask, num_heads=2.0), ValueError, "num_heads")
    for k, bad in [("w_k", jnp.zeros((8, 7))), ("w_o", jnp.zeros((8,))), ("b_o", jnp.zeros((9,)))]:
        _bad(lambda: ap({**params, k: bad}, hs, mask), ValueError, f"params['{k}']")
    _bad(lambda: ap({**params, "w_v": params["w_v"].astype(jnp.bfloat16)}, hs, mask), TypeError,
         "params['w_v']", "float32")
    _bad(lambda: ap({k: params[k] for k in KEYS if k != "b_o"}, hs, mask), ValueError, "params", "b_o")
    _bad(lambda: ap([params], hs, mask), ValueError, "params")
    _bad(lambda: attention_pool_init(jax.random.key(0), 10, num_heads=4), ValueError, "num_heads", "10")
    _bad(lambda: attention_pool_init(jax.random.key(0), 0), ValueError, "hidden_size")
    _bad(lambda: attention_pool_init(jax.random.key(0), 8, num_heads=-1), ValueError, "num_heads")


# ----------------------------------------------------------------------------------------------
# The number of heads comes from the parameters.
@pytest.mark.parametrize("n", [1, 2, 8])
def test_heads_from_params(n):
    """attention_pool(params, hs, mask) as issue 3 writes it (no num_heads): params made for n heads pool with n
    heads (the float64 oracle with n heads), and num_heads=n given explicitly gives the same result."""
    B, T, H = 3, 5, 16
    params = random_params(H, n, seed=7)
    assert params["q"].shape == (n, H // n)
    hs = np.random.default_rng(8).standard_normal((B, T, H)).astype(np.float32)
    mask = random_mask(B, T, seed=9)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask))
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    assert alpha.shape == (B, n, T)
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)
    pooled2, alpha2 = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    np.testing.assert_array_equal(np.asarray(pooled2), np.asarray(pooled))
    np.testing.assert_array_equal(np.asarray(alpha2), np.asarray(alpha))


# ----------------------------------------------------------------------------------------------
# Init.
def test_init():
    H = 16
    p = attention_pool_init(jax.random.key(3), H, num_heads=4)
    assert set(p) == set(KEYS)
    assert p["q"].shape == (4, H // 4) and p["b_o"].shape == (H,)
    for k in ("w_k", "w_v", "w_o"):
        w = np.asarray(p[k])
        assert w.shape == (H, H) and w.dtype == np.float32
        b = math.sqrt(6.0 / (2 * H))
        assert np.abs(w).max() <= b and np.abs(w).max() > 0.8 * b and abs(w.mean()) < 0.1 * b
    assert np.abs(np.asarray(p["q"])).max() <= math.sqrt(6.0 / (1 + H))
    assert np.all(np.asarray(p["b_o"]) == 0.0)
    assert not np.array_equal(np.asarray(p["w_k"]), np.asarray(p["w_v"]))
    p2 = attention_pool_init(jax.random.key(3), H, num_heads=4)
    assert all(np.array_equal(np.asarray(p[k]), np.asarray(p2[k])) for k in KEYS)
    # Near-uniform attention at initialisation for unit-scale inputs at the model's width (score
    # std about 0.12 for H = 128).
    p = attention_pool_init(jax.random.key(5), 128, num_heads=4)
    hs = jax.random.normal(jax.random.key(4), (4, 10, 128))
    _, alpha = attention_pool(p, hs, num_heads=4)
    assert np.abs(np.asarray(alpha) - 0.1).max() < 0.05


# ----------------------------------------------------------------------------------------------
# Composition.
def test_jit_and_grad_under_jit(path):
    B, T, H, n = 3, 5, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=61)
    r1, r2 = _weights(B, T, H, n)
    eager = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    jitted = jax.jit(functools.partial(attention_pool, num_heads=n))(params, jnp.asarray(hs), jnp.asarray(mask))
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    g = jax.jit(jax.grad(lambda p, h, m: _loss_jax(p, h, m, n, r1, r2), argnums=(0, 1)))(
        params, jnp.asarray(hs), jnp.asarray(mask))
    wp, wh = _oracle_grads(params, hs, mask, n, r1, r2)
    _assert_f32_close(g[0]["w_k"], wp["w_k"], tol=1e-4)
    _assert_f32_close(g[1], wh, tol=1e-4)


def test_vmap_over_instances_and_batch(path):
    V, B, T, H, n = 3, 2, 5, 8, 2
    ps = [random_params(H, n, seed=s) for s in range(V)]
    stacked = {k: jnp.stack([p[k] for p in ps]) for k in KEYS}
    rng = np.random.default_rng(9)
    hs = rng.standard_normal((V, B, T, H)).astype(np.float32)
    mask = rng.uniform(size=(V, B, T)) < 0.6
    mask[..., 0] = True
    mask[1, 1] = False  # one all-masked sample inside the vmapped batch
    f = functools.partial(attention_pool, num_heads=n)
    pooled, alpha = jax.vmap(f)(stacked, jnp.asarray(hs), jnp.asarray(mask))
    for v in range(V):
        wp, wa = np_attention_pool(ps[v], hs[v], mask[v], n)
        _assert_f32_close(pooled[v], wp)
        _assert_f32_close(alpha[v], wa)
    # shared params, vmapped data; and vmap over the batch axis itself (B -> [V] x [1])
    pooled2, _ = jax.vmap(f, in_axes=(None, 0, 0))(ps[0], jnp.asarray(hs), jnp.asarray(mask))
    for v in range(V):
        _assert_f32_close(pooled2[v], np_attention_pool(ps[0], hs[v], mask[v], n)[0])
    pooled3, _ = jax.vmap(lambda h, m: f(ps[0], h[None], m[None]))(jnp.asarray(hs[0]), jnp.asarray(mask[0]))
    _assert_f32_close(pooled3[:, 0], np_attention_pool(ps[0], hs[0], mask[0], n)[0])
    # gradients under vmap (params and data batched), instance 1 holding the all-masked sample
    r1, r2 = _weights(B, T, H, n, seed=2)
    gv = jax.vmap(jax.grad(lambda p, h, m: _loss_jax(p, h, m, n, r1, r2), argnums=(0, 1)))(
        stacked, jnp.asarray(hs), jnp.asarray(mask))
    wp, wh = _oracle_grads(ps[1], hs[1], mask[1], n, r1, r2)
    for k in KEYS:
        _assert_f32_close(gv[0][k][1], wp[k], tol=1e-4)
    _assert_f32_close(gv[1][1], wh, tol=1e-4)
    assert np.all(np.asarray(gv[1])[1, 1] == 0.0)


def test_inside_scan():
    B, T, H, n = 2, 4, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=71)
    xs = jnp.stack([jnp.asarray(hs), jnp.asarray(hs) * 0.5])

    def body(carry, h):
        pooled, _ = attention_pool(params, h + carry[:, None, :], jnp.asarray(mask), num_heads=n)
        return pooled * 0.1, pooled

    _, out = jax.lax.scan(body, jnp.zeros((B, H)), xs)
    first = np_attention_pool(params, hs, mask, n)[0]
    second = np_attention_pool(params, 0.5 * hs + (0.1 * first.astype(np.float32))[:, None, :], mask, n)[0]
    _assert_f32_close(out[0], first)
    _assert_f32_close(out[1], second)


def test_zero_size_inputs():
    params = random_params(8, 2)
    pooled, alpha = attention_pool(params, jnp.zeros((0, 5, 8)), num_heads=2)
    assert pooled.shape == (0, 8) and alpha.shape == (0, 2, 5)
    pooled, alpha = attention_pool(params, jnp.zeros((2, 0, 8)), jnp.zeros((2, 0), bool), num_heads=2)
    assert alpha.shape == (2, 2, 0) and np.all(np.asarray(pooled) == 0.0)


# ----------------------------------------------------------------------------------------------
# Host side of the kernel path, through a float64 NumPy transcription of ffi/attention_pool.cu.
def _emu_fwd(hs, mask, u, *, samples_per_block, _shapes):
    """jaxfox_attention_pool_fwd: (hs [.., B, T, H], mask [.., B, T], u [.., H, n]) -> alpha [.., B, n, T],
    c [.., B, n, H], written from the kernel file's equations (block by block of G samples)."""
    B, T, H = hs.shape[-3:]
    n = u.shape[-1]
    lead = hs.shape[:-3]
    G = samples_per_block
    assert G == attn_mod._samples_per_block(T, H, n) >= 1
    assert attn_mod._smem_bytes(G, T, H, n) <= (attn_mod._SMEM_LIMIT if G > 1 else attn_mod._SMEM_LIMIT_ONE)
    assert mask.shape == lead + (B, T) and mask.dtype == np.bool_ and u.shape == lead + (H, n)
    V = int(np.prod(lead, dtype=np.int64))
    hsv = np.asarray(hs).astype(np.float64).reshape(V, B, T, H)
    uv = np.asarray(u, np.float64).reshape(V, H, n)
    mv = mask.reshape(V, B, T)
    alpha, c = np.zeros((V, B, n, T)), np.zeros((V, B, n, H))
    for v in range(V):
        for b in range(B):
            m = mv[v, b]
            s = (hsv[v, b] @ uv[v]).T                                    # [n, T]
            if m.any():
                mx = np.max(np.where(m, s, -np.inf), axis=1, keepdims=True)
                e = np.where(m, np.exp(np.where(m, s - mx, 0.0)), 0.0)
                alpha[v, b] = e / e.sum(axis=1, keepdims=True)
            c[v, b] = alpha[v, b] @ hsv[v, b]
    f32 = np.float32
    return alpha.reshape(lead + (B, n, T)).astype(f32), c.reshape(lead + (B, n, H)).astype(f32)


def _emu_bwd(hs, u, alpha, dalpha, dc, *, samples_per_block, _shapes):
    """jaxfox_attention_pool_bwd: -> dh [.., B, T, H] (or [.., 0]), du [.., n H] ([j][h]), partials; the du
    partials per block of G samples, then summed over the blocks."""
    B, T, H = hs.shape[-3:]
    n = u.shape[-1]
    lead = hs.shape[:-3]
    G = samples_per_block
    blocks = -(-B // G)
    for x, shape in [(alpha, (B, n, T)), (dalpha, (B, n, T)), (dc, (B, n, H))]:
        assert x.shape == lead + shape and x.dtype == np.float32, (x.shape, shape, x.dtype)
    want_dh = tuple(_shapes[0].shape) != (0,)
    V = int(np.prod(lead, dtype=np.int64))
    f64 = lambda x, *sh: np.asarray(x).astype(np.float64).reshape((V,) + sh)  # noqa: E731
    hsv, uv, av, dav, dcv = f64(hs, B, T, H), f64(u, H, n), f64(alpha, B, n, T), f64(dalpha, B, n, T), f64(dc, B, n, H)
    dh, part = np.zeros((V, B, T, H)), np.zeros((V, blocks, n * H))
    for v in range(V):
        for b in range(B):
            h, a = hsv[v, b], av[v, b]
            at = dav[v, b] + dcv[v, b] @ h.T                             # [n, T]
            ds = a * (at - np.sum(a * at, axis=1, keepdims=True))
            dh[v, b] = a.T @ dcv[v, b] + ds.T @ uv[v].T
            part[v, b // G] += (ds @ h).ravel()                          # [n, H] -> [j][h]
    f32 = np.float32
    dh_out = dh.reshape(lead + (B, T, H)).astype(hs.dtype) if want_dh else np.zeros(lead + (0,), hs.dtype)
    return (dh_out, part.sum(axis=1).reshape(lead + (n * H,)).astype(f32),
            part.reshape(lead + (blocks, n * H)).astype(f32))


_EMULATORS = {"jaxfox_attention_pool_fwd": _emu_fwd, "jaxfox_attention_pool_bwd": _emu_bwd}


@pytest.fixture
def kernel_path(monkeypatch):
    """Runs attention_pool's kernel path with the FFI calls answered by the NumPy emulation."""
    calls = []

    def fake_ffi_call(target, result_shape_dtypes, *, vmap_method=None, **_):
        assert vmap_method == "broadcast_all"

        def call(*args, **attrs):
            for k, val in attrs.items():
                assert isinstance(val, np.int64), (k, type(val))
            calls.append((target, tuple(tuple(r.shape) for r in result_shape_dtypes)))
            cb = functools.partial(_EMULATORS[target], _shapes=result_shape_dtypes,
                                   **{k: int(val) for k, val in attrs.items()})
            return jax.pure_callback(cb, result_shape_dtypes, *args, vmap_method="broadcast_all")

        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    monkeypatch.setattr(attn_mod, "dispatch", lambda kernel, reference, *args, **_: kernel(*args))
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "attention_pool")  # the kernel is opt-in (jaxfox._ffi.OPT_IN)
    return calls


@pytest.mark.parametrize("B,T,H,n", [(3, 5, 8, 2), (4, 7, 12, 3), (37, 4, 8, 2), (70, 64, 8, 2)])
def test_kernel_algorithm_and_wiring(kernel_path, B, T, H, n):
    """Values and every gradient of the kernel path (kernels emulated) against the float64 oracle. (37, 4):
    3 blocks of 16 samples, the last partial; (70, 64): one sample a block, 70 blocks of du partials."""
    params, hs, mask = _setup(B, T, H, n, seed=81 + B, all_masked=(1,), single=(0,))
    r1, r2 = _weights(B, T, H, n, seed=5)
    pooled, alpha = attention_pool(params, jnp.asarray(hs), jnp.asarray(mask), num_heads=n)
    want_p, want_a = np_attention_pool(params, hs, mask, n)
    _assert_f32_close(pooled, want_p)
    _assert_f32_close(alpha, want_a)
    gp, gh = jax.grad(_loss_jax, argnums=(0, 1))(params, jnp.asarray(hs), mask, n, r1, r2)
    targets = [t for t, _ in kernel_path]
    assert "jaxfox_attention_pool_bwd" in targets and "jaxfox_attention_pool_fwd" in targets
    if B > 10:  # finite differences of the oracle are slow for many samples: differentiate the reference
        def ref_loss(p, h):
            pooled, alpha = attn_mod._reference(n, p, h, jnp.asarray(mask))
            return jnp.sum(pooled * jnp.asarray(r1, jnp.float32)) + jnp.sum(alpha * jnp.asarray(r2, jnp.float32))

        before = len(kernel_path)
        with jax.default_matmul_precision("highest"):
            wp, wh = jax.grad(ref_loss, argnums=(0, 1))(params, jnp.asarray(hs))
        assert len(kernel_path) == before  # the reference made no FFI calls
        wp = {k: np.asarray(wp[k], np.float64) for k in KEYS}
        wh = np.asarray(wh, np.float64)
    else:
        wp, wh = _oracle_grads(params, hs, mask, n, r1, r2)
    for k in KEYS:
        _assert_f32_close(gp[k], wp[k], tol=1e-4)
    _assert_f32_close(gh, wh, tol=1e-4)
    assert np.all(np.asarray(gh)[1] == 0.0)


def test_kernel_path_skips_dhs_when_hs_is_not_differentiated(kernel_path):
    """jax.grad w.r.t. params only: the backward call's dh result is [0] (not computed), and the parameter
    gradients are those of the oracle."""
    B, T, H, n = 5, 6, 8, 2
    params, hs, mask = _setup(B, T, H, n, seed=7)
    r1, r2 = _weights(B, T, H, n, seed=7)
    gp = jax.grad(_loss_jax)(params, jnp.asarray(hs), mask, n, r1, r2)
    (shapes,) = [sh for t, sh in kernel_path if t == "jaxfox_attention_pool_bwd"]
    assert shapes[0] == (0,) and shapes[1] == (n * H,), shapes
    wp, _ = _oracle_grads(params, hs, mask, n, r1, r2)
    for k in KEYS:
        _assert_f32_close(gp[k], wp[k], tol=1e-4)


def test_kernel_path_no_mask_vmap_bf16(kernel_path):
    B, T, H, n = 2, 5, 8, 2
    params, hs, _ = _setup(B, T, H, n, seed=91, masked=False)
    pooled, _ = attention_pool(params, jnp.asarray(hs), num_heads=n)
    _assert_f32_close(pooled, np_attention_pool(params, hs, None, n)[0])
    # vmap: params and data batched (broadcast_all gives every operand the leading axis)
    V = 3
    ps = [random_params(H, n, seed=s) for s in range(V)]
    stacked = {k: jnp.stack([p[k] for p in ps]) for k in KEYS}
    hsv = np.random.default_rng(1).standard_normal((V, B, T, H)).astype(np.float32)
    r1, r2 = _weights(B, T, H, n)

    def loss(p, h):
        return _loss_jax(p, h, None, n, r1, r2)

    with jax.default_matmul_precision("highest"):
        gv = jax.vmap(jax.grad(loss, argnums=(0, 1)))(stacked, jnp.asarray(hsv))
    for v in range(V):
        wp, wh = _oracle_grads(ps[v], hsv[v], None, n, r1, r2)
        for k in KEYS:
            _assert_f32_close(gv[0][k][v], wp[k], tol=1e-4)
        _assert_f32_close(gv[1][v], wh, tol=1e-4)
    # bfloat16 hs: dhs comes back as bfloat16
    gh = jax.grad(loss, argnums=1)(params, jnp.asarray(hs, jnp.bfloat16))
    assert gh.dtype == jnp.bfloat16


def test_block_choice():
    spb = attn_mod._samples_per_block
    assert spb(64, 128, 4) == 1 and spb(16, 64, 4) == 4 and spb(150, 128, 4) == 1 and spb(1, 8, 2) == 64
    # the target shapes fit (54.3 KiB at T=64 H=128, 31.3 KiB at the aux trainer's T=16 H=64): regions of hs rows,
    # u, alpha, scores, dc, flags and the 8 warps' [n H] sums, each rounded up to 4 floats
    assert attn_mod._smem_bytes(1, 64, 128, 4) == 4 * (64 * 128 + 512 + 2 * 256 + 512 + 64 + 8 * 512) == 55552
    assert attn_mod._smem_bytes(4, 16, 64, 4) == 4 * (64 * 64 + 256 + 2 * 256 + 4 * 256 + 64 + 8 * 256) == 32000
    assert attn_mod._smem_bytes(1, 5, 10, 2) == 4 * (52 + 20 + 2 * 12 + 20 + 8 + 8 * 20)  # 50, 10 and 5 rounded up
    # the kernels' lane layouts: 4 columns a lane for H % 4 == 0 from 128 on (up to 4 x 128), 2 for even H from 64 on
    # (up to 4 x 64), else 1 (up to 4 x 32)
    Hs = (4, 128, 132, 256, 264, 512, 516, 64, 96, 130, 258, 30, 48, 127, 129)
    assert [attn_mod._lane_chunks(H) for H in Hs] == [1, 1, 2, 2, 4, 4, 0, 1, 2, 4, 0, 1, 2, 4, 0]
    assert spb(64, 258, 2) == 0 and spb(64, 516, 4) == 0 and spb(64, 129, 3) == 0 and spb(64, 130, 2) == 1
    # one sample above 96 KiB runs alone in its block, up to 160 KiB
    assert attn_mod._SMEM_LIMIT < attn_mod._smem_bytes(1, 150, 128, 4) <= attn_mod._SMEM_LIMIT_ONE
    assert spb(150, 128, 4) == 1
    # short rows of wide samples: fewer than 64 // T samples a block, the most that fit
    for T, H, n in [(1, 128, 4), (1, 256, 4), (4, 256, 4), (2, 128, 4)]:
        G = spb(T, H, n)
        assert 1 <= G < 64 // T and attn_mod._smem_bytes(G, T, H, n) <= attn_mod._SMEM_LIMIT
        assert attn_mod._smem_bytes(G + 1, T, H, n) > attn_mod._SMEM_LIMIT
    # one sample that does not fit: 0 (the factored XLA form runs)
    assert attn_mod._smem_bytes(1, 1000, 128, 4) > attn_mod._SMEM_LIMIT_ONE and spb(1000, 128, 4) == 0


def test_rows_beyond_the_shared_memory_run_the_factored_form(monkeypatch):
    """A shape whose block does not fit runs the factored XLA form even when opted in with kernels available."""
    import jaxfox._ffi
    import jaxfox.attention as attn_mod

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "attention_pool")
    calls = []
    factored = attn_mod._factored
    monkeypatch.setattr(attn_mod, "_factored", lambda *a: calls.append(a[2].shape) or factored(*a))
    params = random_params(128, 4)
    hs = jnp.zeros((2, 1000, 128), jnp.float32)
    text = jax.jit(lambda p, h: attention_pool(p, h)[0]).trace(params, hs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jaxfox_attention_pool" not in text and calls == [(2, 1000, 128)]
    text = jax.jit(lambda p, h: attention_pool(p, h)[0]).trace(params, hs[:, :64]).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jaxfox_attention_pool_fwd" in text


def test_cuda_default_is_the_factored_form_and_the_kernels_are_opt_in(monkeypatch):
    """With kernels available, the default CUDA path is attention._factored at every size (the H200 measured it
    faster than the kernels at 2048, 16384 and 262144 rows), with no jaxfox custom call; JAXFOX_OPT_IN_KERNELS=
    attention_pool runs the kernels instead."""
    import jaxfox._ffi
    import jaxfox.attention as attn_mod

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    calls = []
    factored = attn_mod._factored

    def spy(*args):
        calls.append(args[2].shape)
        return factored(*args)

    monkeypatch.setattr(attn_mod, "_factored", spy)
    params = random_params(8, 2)

    def lowered(B, T):
        hs = jnp.zeros((B, T, 8), jnp.float32)
        return jax.jit(lambda p, h: attention_pool(p, h, num_heads=2)[0]).trace(params, hs).lower(
            lowering_platforms=("cuda",)).as_text()

    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
    for B, T in ((32, 64), (256, 64), (1024, 16)):     # the main job's 2048 rows, 16384 rows, the aux trainer's T
        assert "jaxfox_attention_pool" not in lowered(B, T)
        assert calls[-1] == (B, T, 8)
    n_calls = len(calls)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "attention_pool")
    assert "jaxfox_attention_pool_fwd" in lowered(32, 64)
    assert len(calls) == n_calls


def test_no_steps_without_a_mask_gives_zero_like_an_all_false_mask():
    """T = 0 and mask=None: no sample has a valid step, so pooled is 0 (the docstring's rule, and what the
    float64 oracle and an all-False [B, 0] mask give), not b_o."""
    params = random_params(8, 2)
    assert np.any(np.asarray(params["b_o"]) != 0.0)
    hs = np.zeros((3, 0, 8), np.float32)
    want_p, want_a = np_attention_pool(params, hs, None, 2)
    for fn in (attention_pool, jax.jit(attention_pool, static_argnames="num_heads")):
        pooled, alpha = fn(params, jnp.asarray(hs), None, num_heads=2)
        np.testing.assert_array_equal(np.asarray(pooled), want_p.astype(np.float32))
        assert alpha.shape == want_a.shape == (3, 2, 0)
    g = jax.grad(lambda p: attention_pool(p, jnp.asarray(hs), num_heads=2)[0].sum())(params)
    assert np.all(np.asarray(g["b_o"]) == 0.0)
