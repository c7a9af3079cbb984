"""Multi-head attention pooling over time with one learned query (OPS.md "Attention pooling over time").

The pooling stage of the perception model (VSN -> CfC -> attention pooling -> GRN head): one
learned query attends over the T hidden states of each sample, as in the Set Transformer's pooling
by multi-head attention (Lee et al. 2019, "Set Transformer", PMA with one seed vector) and PyTorch's
``nn.MultiheadAttention`` with a learned query of length 1. With h_t the state at step t (a row),
head j owning the feature columns D_j = [j d, (j + 1) d), d = H / num_heads, and W [in, out]
(``x @ W``, the convention of every jaxfox op):

    k_t = h_t W_k,  v_t = h_t W_v                                    [H] each
    s[j, t] = q_{D_j} . k_t[D_j] / sqrt(d)                           scores, per head
    alpha[j, :] = softmax over t of s[j, :], masked                  float32, max subtracted
    pooled = (sum_t alpha[j(i), t] v_t[i])_i  W_o + b_o              [H]

Masking follows ``jax.nn.softmax(where=mask)``: masked steps get weight exactly 0. A sample whose
steps are all masked gets alpha = 0 and pooled = 0 (b_o is applied only to samples with at least
one valid step), zero gradients, and never affects the other samples, as long as its masked steps hold
finite values: unlike ``jax.nn.softmax(where=mask)``, which ignores the masked logits, a NaN or Inf in hs
at a masked step still enters the sums as 0 * h_t, making that sample's pooled NaN and, through it, the
parameter gradients of the whole batch (see :func:`attention_pool`'s ``mask``).

Biases: PyTorch's attention has biases on the key, value and output projections. Here the key bias
would add q_j . b_k / sqrt(d) to every score of head j, which the softmax cancels (it has no
effect and a zero gradient), and the value bias reaches the output only as W_o b_v (the weights sum
to 1), which b_o already represents; so only b_o is kept.

On CUDA K and V are never formed: s[j, t] = h_t . u_j with u_j = W_k[:, D_j] q_{D_j} / sqrt(d),
c_j = sum_t alpha[j, t] h_t and pv_{D_j} = c_j W_v[:, D_j]. By default XLA runs that factored form (``_factored``:
batched einsums, differentiated by JAX), which the H200 measured faster than the reference form and the kernels at
every benchmarked size (fwd+bwd, BENCHMARKS.md "thirty-first session"). The kernels (``ffi/attention_pool.cu``) run
with ``JAXFOX_OPT_IN_KERNELS=attention_pool``: they do the per-sample streaming part (scores, masked softmax, c; and
in the backward d alpha -> softmax backward -> d hs and d u), each CTA holding the rows of G <= max(1, 64 // T)
whole samples in shared memory (as many as fit in 96 KiB; one sample up to 160 KiB); u, pv, pooled and every
parameter gradient are batched XLA GEMMs over all samples. On an H100 (BENCHMARKS.md "thirty-seventh session",
fwd+bwd against the reference form) the kernels gave 1.91x at 16384 rows (B=256 T=64 H=128) where the factored
form gave 1.74x, but 1.10x at 2048 rows (factored 1.22x) and 2.42x at the aux trainer's B=16384 T=16 H=64
(factored 2.78x): they stay opt-in. Their sums run in a fixed order without atomics (d u: per-block partials added
column by column in block order by a second kernel of the backward call), so results are bitwise reproducible, and
a sample's alpha comes from the kernel alone and does not depend on the rest of the batch (pooled and d hs also
pass through XLA's batched GEMMs, whose algorithm may depend on the batch size). Shapes where one sample does not
fit in 160 KiB (T > 261 at H = 128 and 4 heads), and widths H without a compiled lane layout (``_lane_chunks``: H >
512, odd H > 128, or H > 256 not a multiple of 4), run the factored XLA form even when opted in.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, kernel_opted_in, psum_to_match
from jaxfox._validate import check_key, float32_param_dtype, positive_int as _positive_int

__all__ = ["attention_pool_init", "attention_pool"]

_PARAM_KEYS = ("q", "w_k", "w_v", "w_o", "b_o")
_HS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_heads(hidden_size, num_heads):
    n = _positive_int("num_heads", num_heads)
    if hidden_size % n:
        raise ValueError(f"num_heads={n} must divide hidden_size={hidden_size} (d_head = H / num_heads)")
    return n


def attention_pool_init(key, hidden_size, *, num_heads=4, dtype=jnp.float32):
    """Parameters of :func:`attention_pool`.

    ``w_k``, ``w_v``, ``w_o`` are xavier-uniform, U(-b, b) with b = sqrt(6 / (H + H)) (each its own
    ``nn.Linear``-sized matrix); the query ``q`` is xavier-uniform as a [1, H] tensor,
    b = sqrt(6 / (1 + H)) (as the Set Transformer's PMA seed vector); ``b_o`` is 0 (PyTorch's
    ``MultiheadAttention.out_proj.bias`` initialisation). At this scale the initial attention is
    close to uniform over the valid steps.

    Args:
      key: a ``jax.random`` key.
      hidden_size: H, features per step of the pooled sequence.
      num_heads: n; must divide H (each head sees d = H / n features).
      dtype: float32 (the kernels' parameter dtype).

    Returns:
      dict ``{"q": [n, d], "w_k": [H, H], "w_v": [H, H], "w_o": [H, H], "b_o": [H]}``, matrices as
      [in, out] (``x @ W``); the query is stored per head (row j is head j's d = H / n query features, the
      columns j d .. j d + d - 1 of the [1, H] seed vector), so the parameters record the number of heads and
      :func:`attention_pool` reads it from them.

    Raises:
      ValueError: hidden_size or num_heads is not a positive int, num_heads does not divide H, or key is a
        batch of keys.
      TypeError: dtype is not float32, or key is not a jax.random key.
    """
    check_key(key, "attention_pool_init: ")
    dtype = float32_param_dtype("attention_pool_init", dtype)
    H = _positive_int("hidden_size", hidden_size)
    _check_heads(H, num_heads)
    kq, kk, kv, ko = jax.random.split(key, 4)
    bound = math.sqrt(6.0 / (2 * H))
    mat = lambda k: jax.random.uniform(k, (H, H), dtype, -bound, bound)  # noqa: E731
    qb = math.sqrt(6.0 / (1 + H))
    return {
        "q": jax.random.uniform(kq, (H,), dtype, -qb, qb).reshape(num_heads, H // num_heads),
        "w_k": mat(kk),
        "w_v": mat(kv),
        "w_o": mat(ko),
        "b_o": jnp.zeros((H,), dtype),
    }


# ----------------------------------------------------------------------------------------------
# Validation.
def _check_array(name, x, shape, dtypes):
    """`shape` entries of None match any size. Raises TypeError/ValueError naming `name`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in dtypes:
        want = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {x.dtype}")
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _check_params(params, H, num_heads):
    """Checks params against hs's H; returns the number of heads n (params['q'] is [n, H / n])."""
    if not isinstance(params, dict) or any(k not in params for k in _PARAM_KEYS):
        raise ValueError(f"params must be the dict returned by attention_pool_init (keys {_PARAM_KEYS}), "
                         f"got {sorted(params) if isinstance(params, dict) else type(params).__name__}")
    f32 = (jnp.dtype(jnp.float32),)
    q = params["q"]
    _check_array("params['q']", q, tuple(getattr(q, "shape", ())), f32)  # an array, float32
    if len(q.shape) != 2 or q.shape[0] < 1 or q.shape[0] * q.shape[1] != H:
        raise ValueError(f"params['q'] must have shape [num_heads, H / num_heads] with H = {H} (hs's features), "
                         f"got {tuple(q.shape)}")
    n = q.shape[0]
    if num_heads is not None and _check_heads(H, num_heads) != n:
        raise ValueError(f"num_heads={num_heads} does not match the params, which were made for {n} heads "
                         f"(params['q'] has shape {tuple(q.shape)}); num_heads may be left out")
    for k in ("w_k", "w_v", "w_o"):
        _check_array(f"params[{k!r}]", params[k], (H, H), f32)
    _check_array("params['b_o']", params["b_o"], (H,), f32)
    return n


# ----------------------------------------------------------------------------------------------
# Pure-JAX reference (also the path off CUDA): the equations as written, K and V formed.
def _reference(num_heads, params, hs, mask):
    B, T, H = hs.shape
    n, d = num_heads, H // num_heads
    x = hs.astype(jnp.float32)
    k = (x @ params["w_k"]).reshape(B, T, n, d)
    v = (x @ params["w_v"]).reshape(B, T, n, d)
    s = jnp.einsum("btjd,jd->bjt", k, params["q"].reshape(n, d)) / jnp.float32(math.sqrt(d))
    where = None if mask is None else mask[:, None, :]
    alpha = jax.nn.softmax(s, axis=-1, where=where)                      # [B, n, T] float32
    pv = jnp.einsum("bjt,btjd->bjd", alpha, v).reshape(B, H)
    return _output(params, pv, mask), alpha


def _score_vectors(params, n):
    """u [H, n]: column j is W_k[:, D_j] q_{D_j} / sqrt(d), so that s[j, t] = h_t . u_j (K never formed)."""
    H = params["w_k"].shape[0]
    d = H // n
    return jnp.einsum("hjd,jd->hj", params["w_k"].reshape(H, n, d), params["q"].reshape(n, d)) / jnp.float32(
        math.sqrt(d))


def _head_values(params, c):
    """pv [B, H] from c [B, n, H]: pv_{D_j} = c_j W_v[:, D_j] (V never formed)."""
    B, n, H = c.shape
    return jnp.einsum("bjh,hjd->bjd", c, params["w_v"].reshape(H, n, H // n)).reshape(B, H)


def _factored(num_heads, params, hs, mask):
    """The same function in the kernel path's factoring, in pure JAX (the default on CUDA): the scores as hs u with
    u = W_k q / sqrt(d) [H, n] (K never formed), c_j = alpha_j hs [B, n, H], and pv_j = c_j W_v[:, head j] (V never
    formed), so the reference's [B, T, H] x [H, H] products are gone; JAX differentiates it."""
    x = hs.astype(jnp.float32)
    u = _score_vectors(params, num_heads)                                      # [H, n]
    s = jnp.einsum("bth,hj->bjt", x, u)
    where = None if mask is None else mask[:, None, :]
    alpha = jax.nn.softmax(s, axis=-1, where=where)                            # [B, n, T] float32
    c = jnp.einsum("bjt,bth->bjh", alpha, x)                                   # [B, n, H]
    pv = _head_values(params, c)
    return _output(params, pv, mask), alpha


def _output(params, pv, mask):
    """pooled = pv W_o + b_o [B, H]; b_o only for samples with a valid step (all of them when mask is None)."""
    bias = params["b_o"] if mask is None else jnp.where(jnp.any(mask, axis=1)[:, None], params["b_o"], 0.0)
    return pv @ params["w_o"] + bias


# ----------------------------------------------------------------------------------------------
# Kernel path: the per-sample streaming part (scores, masked softmax, c = alpha hs, and its backward) is
# ffi/attention_pool.cu; the weight products around it (u = W_k q, pv = c W_v per head, pooled = pv W_o + b_o)
# are batched XLA GEMMs over all samples, differentiated by JAX.
_BLOCK_ROWS = 64                 # a CTA owns G <= max(1, 64 // T) whole samples (_samples_per_block)
_SMEM_LIMIT = 96 * 1024          # bytes of shared memory a block of several samples may use (2 blocks an SM on 9.0)
_SMEM_LIMIT_ONE = 160 * 1024     # ... a block of one sample (within sm_80's 163 KiB opt-in maximum)


class _Config(NamedTuple):
    hidden_size: int
    num_heads: int
    samples_per_block: int


def _smem_bytes(G, T, H, n):
    """Dynamic shared memory of the kernels (ffi/attention_pool.cu Layout::total floats x 4): hs rows [G T][H], u
    [n][H], alpha and scores [n][G T] each, dc [G n][H], valid flags [G T] and 8 warps' sums [8][n H], every region
    rounded up to 4 floats."""
    R = G * T
    r4 = lambda x: -(-x // 4) * 4  # noqa: E731
    return 4 * (r4(R * H) + r4(n * H) + 2 * r4(n * R) + r4(G * n * H) + r4(R) + 8 * n * H)


def _lane_chunks(H):
    """Column chunks a lane walks in the kernels (ffi/attention_pool.cu LaneLayout): 32 lanes x VW columns with VW =
    4 when H % 4 == 0 and H >= 128, else 2 when H % 2 == 0 and H >= 64, else 1; rounded up to 1, 2 or 4; 0 when H
    needs more than 4 (H > 512; or H > 256 with H % 4 != 0; or odd H > 128: the kernels are not compiled for it and
    the factored XLA form runs)."""
    vw = 4 if H % 4 == 0 and H >= 128 else 2 if H % 2 == 0 and H >= 64 else 1
    chunks = -(-H // (32 * vw))
    return next((c for c in (1, 2, 4) if chunks <= c), 0)


def _samples_per_block(T, H, n):
    """G: the most whole samples a CTA holds, at most max(1, 64 // T) and within _SMEM_LIMIT (one sample: within
    _SMEM_LIMIT_ONE); 0 when one sample does not fit or H has no compiled lane layout (_lane_chunks; the factored XLA
    form runs then). A function of the shape only, as is the order of every sum in the kernels."""
    if _lane_chunks(H) == 0:
        return 0
    G = max(1, _BLOCK_ROWS // max(T, 1))
    while G > 1 and _smem_bytes(G, T, H, n) > _SMEM_LIMIT:
        G -= 1
    return G if _smem_bytes(G, T, H, n) <= (_SMEM_LIMIT if G > 1 else _SMEM_LIMIT_ONE) else 0


def _stream_fwd_call(cfg, hs, mask, u):
    B, T, H = hs.shape[-3:]
    n = cfg.num_heads
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B, n, T), f32),    # alpha
           jax.ShapeDtypeStruct((B, n, H), f32))    # c_j = sum_t alpha[j, t] h_t
    return _ffi_call("jaxfox_attention_pool_fwd", out, vmap_method="broadcast_all")(
        hs, mask, u, samples_per_block=np.int64(cfg.samples_per_block))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stream(cfg, hs, mask, u):
    """(alpha [B, n, T], c [B, n, H]) from hs [B, T, H], mask [B, T] and u [H, n] (the kernels' math)."""
    return _stream_fwd_call(cfg, hs, mask, u)


def _stream_fwd(cfg, hs, mask, u):
    # symbolic_zeros: the primals arrive as CustomVJPPrimal; d hs is formed only when hs is differentiated
    alpha, c = _stream_fwd_call(cfg, hs.value, mask.value, u.value)
    return (alpha, c), (hs.value, u.value, alpha, bool(hs.perturbed))


def _stream_bwd(cfg, res, cts):
    hs, u, alpha, want_dhs = res
    B, T, H = hs.shape
    n = cfg.num_heads
    f32 = jnp.float32
    dalpha, dc = (jnp.zeros(shape, f32) if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct.astype(f32)
                  for ct, shape in zip(cts, ((B, n, T), (B, n, H))))
    G = cfg.samples_per_block
    blocks = -(-B // G)
    out = (jax.ShapeDtypeStruct((B, T, H) if want_dhs else (0,), hs.dtype),  # dh (or not computed)
           jax.ShapeDtypeStruct((n * H,), f32),                               # du, [n, H] row-major
           jax.ShapeDtypeStruct((blocks, n * H), f32))                        # workspace: per-block partials
    dhs, du, _ = _ffi_call("jaxfox_attention_pool_bwd", out, vmap_method="broadcast_all")(
        hs, u, alpha, dalpha, dc, samples_per_block=np.int64(G))
    return psum_to_match((dhs if want_dhs else None, None, du.reshape(n, H).T), (hs, None, u))


_stream.defvjp(_stream_fwd, _stream_bwd, symbolic_zeros=True)


def _kernel_path(cfg, params, hs, mask):
    B, T, _ = hs.shape
    valid = jnp.ones((B, T), jnp.bool_) if mask is None else mask
    u = _score_vectors(params, cfg.num_heads)  # [H, n]
    alpha, c = _stream(cfg, hs, valid, u)
    pv = _head_values(params, c)
    return _output(params, pv, mask), alpha


def _dispatch(cfg, params, hs, mask):
    def reference(params, hs, mask):
        return _reference(cfg.num_heads, params, hs, mask)

    def factored(params, hs, mask):
        return _factored(cfg.num_heads, params, hs, mask)

    def kernel(params, hs, mask):
        return _kernel_path(cfg, params, hs, mask)

    B, T, H = hs.shape
    if T == 0 and mask is None:
        mask = jnp.zeros((B, 0), jnp.bool_)  # no step is valid: pooled = 0 (no b_o), as with any [B, 0] mask
    if B == 0 or T == 0:
        return reference(params, hs, mask)
    # the kernels are opt-in: the factored XLA form was faster on the H200 at every benchmarked size (docstring)
    cuda = kernel if cfg.samples_per_block >= 1 and kernel_opted_in("attention_pool") else factored
    return dispatch(cuda, reference, params, hs, mask, batch=(False, True, True))


def attention_pool(params, hs, mask=None, *, num_heads=None):
    """Pools a sequence with multi-head attention from one learned query: hs [B, T, H] -> [B, H].

    Args:
      params: from :func:`attention_pool_init` (``q`` [n, d] (n heads of d = H / n features: the number of
        heads comes from its shape), ``w_k``/``w_v``/``w_o`` [H, H] as [in, out], ``b_o`` [H]; all float32).
      hs: [B, T, H] float32 or bfloat16 (B samples, T time steps, H features). bfloat16 inputs are
        converted to float32 before any arithmetic (projections, softmax and sums are float32).
      mask: [B, T] bool, True where a step is valid, or None (all valid; with T = 0 no step is, so pooled is 0).
        Masked steps get weight 0, but their hs still enter the sums as 0 * h_t (as in PyTorch's attention): pad
        them with small finite values such as 0 (a NaN or Inf at a masked step makes the sample's pooled NaN, and
        so every parameter's gradient of a loss over the batch, even when all its steps are masked; so may a value
        so large that a product with the weights overflows float32: the reference forms h_t W_v, the factored
        form does not, so the two paths can differ there).
      num_heads: optional check: when given, it must equal the params' number of heads (``q.shape[0]``).

    Returns:
      (pooled, alpha): pooled [B, H] float32; alpha [B, n, T] float32, the attention weights of each
      head (sum to 1 over the valid steps, exactly 0 at masked steps; all 0 for a sample with no
      valid step, whose pooled is 0 too).

    Differentiable in params and hs (autodiff of the factored XLA form on CUDA, of the reference elsewhere;
    ``jax.custom_vjp`` over the forward and backward kernels with ``JAXFOX_OPT_IN_KERNELS=attention_pool``); the
    gradient for hs has hs's dtype. On the kernel path only reverse mode of order 1: forward mode (``jax.jvp``,
    ``jax.jacfwd``) and higher derivatives raise there (trace them inside :func:`jaxfox.use_reference`).
    A sample with every step masked (and finite hs) gets zero gradients and leaves the other samples unchanged.

    Source: OPS.md "Attention pooling over time"; Set Transformer PMA (Lee et al. 2019, eq. 11)
    with one seed vector and PyTorch ``nn.MultiheadAttention`` semantics (scaled dot product,
    heads split the feature dims), masking as ``jax.nn.softmax(where=mask)``.

    Raises:
      TypeError: hs is not float32/bfloat16, mask is not bool, or a parameter is not float32.
      ValueError: a shape does not match (the message names the argument, the expected and the
        actual shape), params is not an attention_pool_init dict, or num_heads is given and differs from
        the params' number of heads.
    """
    if not hasattr(hs, "shape") or not hasattr(hs, "dtype"):
        raise TypeError(f"hs must be an array, got {type(hs).__name__}")
    if len(hs.shape) != 3:
        raise ValueError(f"hs must have shape [B, T, H], got {tuple(hs.shape)}")
    B, T, H = hs.shape
    _check_array("hs", hs, (B, T, H), _HS_DTYPES)
    if H < 1:
        raise ValueError(f"hs must have H >= 1 features, got shape {tuple(hs.shape)}")
    n = _check_params(params, H, num_heads)
    if mask is not None:
        _check_array("mask", mask, (B, T), (jnp.dtype(jnp.bool_),))
    return _dispatch(_Config(H, n, _samples_per_block(T, H, n)), params, hs, mask)
