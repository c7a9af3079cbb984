"""Closed-form continuous-time (CfC) cell and scan.

Hasani et al. 2022, "Closed-form continuous-time neural networks" (Nature Machine Intelligence),
matching the PyTorch ``CfCCell`` of the ncps package (mlech26l/ncps, ``ncps/torch/cfc_cell.py``):

    z   = concat(x_t, h_{t-1})                                  [B, I + H]
    b   = lecun_tanh(... lecun_tanh(z W_1 + b_1) ... W_L + b_L)  [B, U]   (b = z when L = 0)
    ff1, ff2, t_a, t_b = split(b W_heads + b_heads, 4)            [B, H] each
    default:  h_t = tanh(ff1) * (1 - g) + g * tanh(ff2),  g = sigmoid(t_a * ts + t_b)
    no_gate:  h_t = tanh(ff1) + g * tanh(ff2)
    pure:     h_t = -A * exp(-ts * (|w_tau| + |ff1|)) * ff1 + A   (only the ff1 head exists)

with lecun_tanh(x) = 1.7159 tanh(0.666 x). ``ts`` is the elapsed time of each step in bars
(1.0 for regularly sampled data); ts = 0 is valid. ncps's Keras/TF code and the paper's TF code use
sigmoid(-t_a * ts + t_b): weights map across by negating the time_a column block (and its bias).

On CUDA the whole time loop runs inside one kernel launch forward and one backward
(``ffi/cfc.cu``); parameter gradients are per-sample partials summed by :func:`jaxfox.reduce_axis0`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import (cuda_compute_capability, dispatch, ffi_call as _ffi_call, psum_to_match,
                         smem_per_block_limit)
from jaxfox._validate import (check_array as _check_array, check_key, float32_param_dtype, is_concrete,
                              positive_int as _positive_int)
from jaxfox.reduce import reduce_chunks

__all__ = ["cfc_init", "cfc_cell", "cfc_scan", "lecun_tanh", "MODES"]

MODES = ("default", "no_gate", "pure")
_MAX_KERNEL_LAYERS = 4  # backbone depth the CUDA kernel handles; deeper backbones use the reference
_MAX_KERNEL_HIDDEN = 8 * 256  # clusters of at most 8 CTAs x 256 threads, one hidden unit per thread


def _kernel_hidden_limit():
    """Largest H the kernels take: 2048 with thread-block clusters (sm_90+), 256 before."""
    cc = cuda_compute_capability()
    return _MAX_KERNEL_HIDDEN if cc is None or cc >= (9, 0) else 256


def lecun_tanh(x):
    """1.7159 * tanh(0.666 * x), the ncps backbone activation; elementwise, x of any shape and float dtype
    -> the same shape and dtype, as ``jnp.tanh`` types it: an integer x is promoted (float32 with x64 off), and a
    float64 x (a NumPy array, a Python float) comes back float32 unless ``jax_enable_x64`` is on.

    Source: ncps's ``LeCun`` module (mlech26l/ncps, ``ncps/torch/cfc_cell.py``), after LeCun et al. 1998,
    "Efficient BackProp" (1.7159 tanh(2x / 3)).

    Raises:
      TypeError: x is not an array or number of a floating or integer dtype (a list gave "can't multiply sequence").
    """
    dt = getattr(x, "dtype", None)
    if dt is None and isinstance(x, (int, float)) and not isinstance(x, bool):
        dt = jnp.result_type(x)
    if dt is None or not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise TypeError(f"x must be an array (or number) of a floating or integer dtype, got "
                        f"{dt if dt is not None else type(x).__name__}")
    return 1.7159 * jnp.tanh(0.666 * x)


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def cfc_init(key, input_size, hidden_size, *, backbone_units=128, backbone_layers=1, mode="default",
             dtype=jnp.float32):
    """Parameters of a CfC cell, initialised as ncps's ``CfCCell.init_weights``.

    Every 2-D tensor is xavier-uniform (bound sqrt(6 / (fan_in + fan_out))); biases are PyTorch
    ``nn.Linear`` defaults, U(-1/sqrt(fan_in), 1/sqrt(fan_in)). The four heads are separate
    ``nn.Linear`` layers in ncps, so each column block gets its own xavier bound. In mode "pure",
    ncps stores ``w_tau`` and ``A`` as [1, H] tensors, so ``init_weights`` makes them xavier-uniform
    too (bound sqrt(6 / (1 + H))); this is reproduced.

    Args:
      key: one ``jax.random`` key (``jax.random.key(seed)``, or a raw uint32 [2] ``jax.random.PRNGKey``).
      input_size: I, features per step.  hidden_size: H.
      backbone_units: U, width of each backbone layer.  backbone_layers: L >= 0.
      mode: "default", "no_gate" or "pure".
      dtype: float32 (the kernels' parameter dtype).

    Returns:
      dict with ``"backbone"``: list of L dicts ``{"w": [in, U], "b": [U]}`` (in = I + H, then U);
      ``"heads_w"``: [K, 4H] (K = U, or I + H when L = 0) with column blocks ff1, ff2, time_a,
      time_b (mode "pure": [K, H], the ff1 head only, as in ncps); ``"heads_b"``: matching bias;
      mode "pure" also ``"w_tau"`` [H] and ``"A"`` [H].

    Raises:
      ValueError: a size is not a positive int (backbone_layers may be 0), mode is unknown, or key is a batch of
        keys.
      TypeError: key is not a jax.random key, or dtype is not float32.
    """
    check_key(key, "cfc_init: ", "vmap cfc_init over keys for an ensemble")
    dtype = float32_param_dtype("cfc_init", dtype, "cfc_scan takes float32 inputs xs and h0 only")
    _check_mode(mode)
    I = _positive_int("input_size", input_size)
    H = _positive_int("hidden_size", hidden_size)
    U = _positive_int("backbone_units", backbone_units)
    L = _positive_int("backbone_layers", backbone_layers, minimum=0)
    keys = iter(jax.random.split(key, 2 * L + 10))

    def xavier(shape):
        bound = math.sqrt(6.0 / (shape[0] + shape[1]))
        return jax.random.uniform(next(keys), shape, dtype, -bound, bound)

    def bias(fan_in, n):
        bound = 1.0 / math.sqrt(fan_in)
        return jax.random.uniform(next(keys), (n,), dtype, -bound, bound)

    backbone = []
    fan_in = I + H
    for _ in range(L):
        backbone.append({"w": xavier((fan_in, U)), "b": bias(fan_in, U)})
        fan_in = U
    n_heads = 1 if mode == "pure" else 4
    params = {
        "backbone": backbone,
        "heads_w": jnp.concatenate([xavier((fan_in, H)) for _ in range(n_heads)], axis=1),
        "heads_b": jnp.concatenate([bias(fan_in, H) for _ in range(n_heads)]),
    }
    if mode == "pure":
        params["w_tau"] = xavier((1, H))[0]
        params["A"] = xavier((1, H))[0]
    return params


class _Config(NamedTuple):
    input_size: int
    hidden_size: int
    units: int
    layers: int
    mode: str


def _config(params, input_size, mode, input_name="xs") -> _Config:
    """Checks params against the mode and an input of width ``input_size``. When params are consistent with
    the mode but for another input width, the error names the input (``input_name``), not the params."""
    try:
        return _check_config(params, input_size, mode)
    except ValueError:
        own = _params_input_size(params, mode)
        if own is not None and own != input_size:
            try:
                _check_config(params, own, mode)
            except (ValueError, TypeError):
                pass
            else:
                raise ValueError(f"{input_name} must have last dimension I = {own} (the input_size of params), "
                                 f"got I = {input_size}") from None
        raise


def _params_input_size(params, mode):
    """I that params were made for (their first fan-in is I + H), or None when they are malformed."""
    try:
        hw = params["heads_w"]
        n_heads = 1 if mode == "pure" else 4
        H = hw.shape[1] // n_heads
        first = params["backbone"][0]["w"] if params.get("backbone") else hw
        own = int(first.shape[0]) - H
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return own if own > 0 else None


def _check_config(params, input_size, mode) -> _Config:
    _check_mode(mode)
    if not isinstance(params, dict) or any(k not in params for k in ("backbone", "heads_w", "heads_b")):
        raise ValueError("params must be the dict returned by cfc_init (keys 'backbone', 'heads_w', 'heads_b'), got "
                         f"{sorted(map(str, params)) if isinstance(params, dict) else type(params).__name__}")
    backbone = params["backbone"]
    if not isinstance(backbone, (list, tuple)) or not all(
            isinstance(layer, dict) and "w" in layer and "b" in layer for layer in backbone):
        raise ValueError("params['backbone'] must be a list of L dicts {'w': [in, U], 'b': [U]} (as cfc_init makes), "
                         f"got {type(backbone).__name__}")
    if mode != "pure" and ("w_tau" in params or "A" in params):
        raise ValueError(f"params has the keys 'w_tau' and 'A' of mode 'pure' (made by cfc_init(mode='pure')), "
                         f"but mode is {mode!r}")
    if mode == "pure":  # before the shapes: a default-mode heads_w [K, 4H] read as pure's [K, H'] misreports them
        for k in ("w_tau", "A"):
            if k not in params:
                raise ValueError(f"mode 'pure' needs params[{k!r}] (create params with cfc_init(mode='pure'))")
    n_heads = 1 if mode == "pure" else 4
    hw = params["heads_w"]
    _check_array("params['heads_w']", hw, (None, None))
    if hw.shape[1] % n_heads:
        raise ValueError(f"params['heads_w'] must have {n_heads}*H columns for mode {mode!r}, got {hw.shape}")
    H = hw.shape[1] // n_heads
    I = input_size
    fan_in = I + H
    U = fan_in
    for l, layer in enumerate(backbone):
        w = layer["w"]
        _check_array(f"params['backbone'][{l}]['w']", w, (fan_in, None))
        U = w.shape[1]
        _check_array(f"params['backbone'][{l}]['b']", layer["b"], (U,))
        fan_in = U
    if backbone and any(layer["w"].shape[1] != U for layer in backbone):
        raise ValueError("params['backbone'] layers must all have the same width U, got widths "
                         f"{[int(layer['w'].shape[1]) for layer in backbone]}")
    _check_array("params['heads_w']", hw, (fan_in, n_heads * H))
    _check_array("params['heads_b']", params["heads_b"], (n_heads * H,))
    if mode == "pure":
        for k in ("w_tau", "A"):
            _check_array(f"params[{k!r}]", params[k], (H,))
    return _Config(I, H, U if backbone else 0, len(backbone), mode)


def _abs(x):
    """|x| whose derivative at 0 is 0 (sign(0)), as torch.abs in ncps and Sign in ffi/cfc.cu: jnp.abs's is 1 there,
    which moved a w_tau of exactly 0 that ncps and the kernel leave at 0. x * sign(x) is |x| exactly (sign's
    derivative is 0, so the derivative is sign(x))."""
    return x * jnp.sign(x)


def _cell_reference(params, h, x, ts, mode):
    """One step in plain JAX: h [B, H], x [B, I], ts [B] -> [B, H]."""
    z = jnp.concatenate([x, h], axis=-1)
    for layer in params["backbone"]:
        z = lecun_tanh(z @ layer["w"] + layer["b"])
    pre = z @ params["heads_w"] + params["heads_b"]
    t = ts[:, None]
    if mode == "pure":
        A = params["A"]
        return -A * jnp.exp(-t * (_abs(params["w_tau"]) + _abs(pre))) * pre + A
    ff1, ff2, t_a, t_b = jnp.split(pre, 4, axis=-1)
    ff1, ff2 = jnp.tanh(ff1), jnp.tanh(ff2)
    g = jax.nn.sigmoid(t_a * t + t_b)
    if mode == "no_gate":
        return ff1 + g * ff2
    return ff1 * (1.0 - g) + g * ff2


def _scan_reference(cfg, params, xs, ts, h0):
    def step(h, inp):
        x, t = inp
        h = _cell_reference(params, h, x, t, cfg.mode)
        return h, h

    _, hs = jax.lax.scan(step, h0, (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ts, 0, 1)))
    return jnp.swapaxes(hs, 0, 1)


# ----------------------------------------------------------------------------------------------
# Kernel path: parameters travel as one flat float32 vector, in this order:
#   for each backbone layer: w [in, U] (row-major), b [U]; heads_w [K, NH], heads_b [NH];
#   mode "pure": w_tau [H], A [H].
_MODE_ID = {"default": 0, "no_gate": 1, "pure": 2}


def _flatten(params):
    leaves = []
    for layer in params["backbone"]:
        leaves += [layer["w"], layer["b"]]
    leaves += [params["heads_w"], params["heads_b"]]
    if "w_tau" in params:
        leaves += [params["w_tau"], params["A"]]
    return jnp.concatenate([leaf.reshape(-1) for leaf in leaves])


def _unflatten_like(params, flat):
    out, offset = {}, 0

    def take(like):
        nonlocal offset
        n = like.size
        piece = flat[offset:offset + n].reshape(like.shape)
        offset += n
        return piece

    out["backbone"] = [{"w": take(layer["w"]), "b": take(layer["b"])} for layer in params["backbone"]]
    out["heads_w"] = take(params["heads_w"])
    out["heads_b"] = take(params["heads_b"])
    if "w_tau" in params:
        out["w_tau"] = take(params["w_tau"])
        out["A"] = take(params["A"])
    return out


def _attrs(cfg):
    return dict(input_size=np.int64(cfg.input_size), hidden_size=np.int64(cfg.hidden_size),
                units=np.int64(cfg.units), layers=np.int64(cfg.layers), mode=np.int64(_MODE_ID[cfg.mode]))


def _n_heads(cfg):
    return 1 if cfg.mode == "pure" else 4


def _fwd_call(cfg, wflat, xs, ts, h0):
    B, T, _ = xs.shape
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B, T, cfg.hidden_size), f32),
           jax.ShapeDtypeStruct((B, T, cfg.layers * cfg.units), f32),
           jax.ShapeDtypeStruct((B, T, _n_heads(cfg) * cfg.hidden_size), f32))
    return _ffi_call("jaxfox_cfc_fwd", out, vmap_method="broadcast_all")(xs, ts, h0, wflat, **_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_kernel(cfg, wflat, xs, ts, h0):
    return _fwd_call(cfg, wflat, xs, ts, h0)[0]


def _scan_kernel_fwd(cfg, wflat, xs, ts, h0):
    hs, acts, pre = _fwd_call(cfg, wflat, xs, ts, h0)
    return hs, (wflat, xs, ts, h0, hs, acts, pre)


def _scan_kernel_bwd(cfg, res, dhs):
    wflat, xs, ts, h0, hs, acts, pre = res
    B, T, I = xs.shape
    P = wflat.shape[0]
    chunks = reduce_chunks(B, P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((P,), f32),                                    # dw (reduced)
           jax.ShapeDtypeStruct((B, T, I), f32),                               # dxs
           jax.ShapeDtypeStruct((B, T), f32),                                  # dts
           jax.ShapeDtypeStruct((B, cfg.hidden_size), f32),                    # dh0
           jax.ShapeDtypeStruct((B, T, cfg.layers * cfg.units), f32),          # workspace: backbone d(pre-act)
           jax.ShapeDtypeStruct((B, T, _n_heads(cfg) * cfg.hidden_size), f32),  # workspace: heads d(pre-act)
           jax.ShapeDtypeStruct((B, P), f32),                                  # workspace: per-sample partials
           jax.ShapeDtypeStruct((chunks * P if chunks > 1 else 0,), f32))      # workspace: reduce_axis0
    dw, dxs, dts, dh0, *_ = _ffi_call("jaxfox_cfc_bwd", out, vmap_method="broadcast_all")(
        xs, ts, h0, wflat, hs, acts, pre, dhs, chunks=np.int64(chunks), **_attrs(cfg))
    return psum_to_match((dw, dxs, dts, dh0), (wflat, xs, ts, h0))


_scan_kernel.defvjp(_scan_kernel_fwd, _scan_kernel_bwd)


_KERNEL_THREADS = 256  # kNT in ffi/cfc.cu
_MAX_CLUSTER = 8


def _kernel_smem_fits(cfg) -> bool:
    """False when even the smallest forward layout of ffi/cfc.cu (MakeLayout with the weights in global memory, the
    largest cluster) exceeds the device's shared memory per block, so that ChooseCluster would return
    InvalidArgument at run time: its reduction buffer and the L + 1 task buffers hold red = max(256, I + H, U,
    nh ceil(H / 8), K nh) floats each (K = U, or I + H when L = 0), plus z [2 (I + H)] and the activations [L U].
    A lower bound (alignment padding left out), so a shape it rejects cannot run the kernels."""
    nh = _n_heads(cfg)
    k0 = cfg.input_size + cfg.hidden_size
    kh = cfg.units if cfg.layers > 0 else k0
    red = max(_KERNEL_THREADS, k0, cfg.units, nh * -(-cfg.hidden_size // _MAX_CLUSTER), kh * nh)
    floats = red + 4 * (cfg.layers + 1) * (red + 1) + 4 * (cfg.layers + 1) + 2 * k0 + cfg.layers * cfg.units
    # no CUDA device visible (tracing for CUDA elsewhere): 9.0's limit
    return 4 * floats <= smem_per_block_limit(cuda_compute_capability())


def _scan_dispatch(cfg, params, xs, ts, h0):
    def reference(params, xs, ts, h0):
        return _scan_reference(cfg, params, xs, ts, h0)

    def kernel(params, xs, ts, h0):
        return _scan_kernel(cfg, _flatten(params), xs, ts, h0)

    if (cfg.layers > _MAX_KERNEL_LAYERS or cfg.hidden_size > _kernel_hidden_limit()
            or xs.shape[0] == 0 or xs.shape[1] == 0 or not _kernel_smem_fits(cfg)):
        return reference(params, xs, ts, h0)
    return dispatch(kernel, reference, params, xs, ts, h0, batch=(False, True, True, True))


def _prepare_ts(ts, B, T):
    """Broadcasts ts (scalar, [B] or [B, T]) to [B, T] float32; rejects negative, NaN and infinite concrete values
    (finiteness checked on the float32 values the op uses: a float64 1e39 is inf there)."""
    if isinstance(ts, (int, float, np.integer, np.floating)) and not isinstance(ts, bool):
        try:
            with np.errstate(over="ignore"):
                ts = np.asarray(ts, np.float32)
        except OverflowError:  # a Python int beyond float64 (10**400): not a bare "int too large to convert"
            raise ValueError("ts (elapsed time per step) must be finite (as float32); got an int beyond float64's "
                             "range") from None
    if not hasattr(ts, "shape") or not jnp.issubdtype(ts.dtype, jnp.floating):
        raise TypeError(f"ts must be a float scalar or float array, got {type(ts).__name__} "
                        f"{getattr(ts, 'dtype', '')}")
    if ts.shape not in ((), (B,), (B, T)):
        raise ValueError(f"ts must be a scalar, [B]={B} or [B, T]=[{B}, {T}], got shape {tuple(ts.shape)}")
    concrete = is_concrete(ts)
    if concrete:
        host = np.asarray(ts)  # one transfer of a concrete jax array, for both checks
        if not bool(np.all(host >= 0)):
            raise ValueError("ts (elapsed time per step) must be >= 0; got a negative or NaN value")
        with np.errstate(over="ignore"):
            values = host.astype(np.float32)
        if not bool(np.all(np.isfinite(values))):
            # the forward would be finite, but 0 * inf in the derivatives of the gate (default, no_gate) or of
            # exp(-ts ...) (pure) makes every parameter gradient of the batch NaN
            raise ValueError("ts (elapsed time per step) must be finite (as float32); got an infinite value")
    ts = jnp.asarray(ts, jnp.float32)
    if ts.ndim == 1:
        ts = ts[:, None]
    return jnp.broadcast_to(ts, (B, T)), concrete


def cfc_scan(params, xs, ts=1.0, h0=None, *, mode="default"):
    """Runs a CfC cell over a sequence: xs [B, T, I] -> hs [B, T, H] (all float32).

    Args:
      params: from :func:`cfc_init` (same ``mode``).
      xs: [B, T, I] float32, batch-major (ncps ``batch_first=True``).
      ts: elapsed time of each step in bars: a scalar, [B] (one per sample) or [B, T] (per step); a Python or
        NumPy number, or an array of any float dtype (computed in float32; an integer or bool array is refused).
        Must be >= 0 and finite as float32 (0 is valid; NaN and inf are not: with an infinite ts the outputs are
        finite but the gradients of every parameter are NaN). Under ``jit`` a negative, NaN or inf traced value
        cannot raise (an inf one gives those NaN gradients):
        a negative one makes that step's output NaN, but the recurrence carries on from the state computed with
        the negative value, so later steps are not those of any valid input (in mode "pure", exp(-ts ...) overflows
        for a large negative ts and they become NaN too); a NaN one makes the sample's state NaN from that step on.
      h0: initial state [B, H] float32, or None for zeros.
      mode: "default", "no_gate" or "pure" (module docstring).

    Returns:
      hs [B, T, H] float32, the state after each step.

    Differentiable in params, xs, ts and h0 (``jax.custom_vjp`` over the forward and backward
    kernels on CUDA; autodiff of a ``lax.scan`` reference elsewhere): reverse mode everywhere; forward mode
    (``jax.jvp``, ``jax.jacfwd``) and derivatives of order 2 and higher only off the kernel path (on CUDA they
    raise, e.g. "can't apply forward-mode autodiff (jvp) to a custom_vjp function"; trace them inside
    :func:`jaxfox.use_reference`). The kernels take up to 4
    backbone layers and H <= 2048 (H <= 256 on GPUs older than sm_90, which lack thread-block
    clusters), with widths whose per-step buffers fit in shared memory, about (4 L + 5) max(I + H, nh K) floats
    (nh = 4 heads, 1 in mode "pure"; K = U, or I + H when L = 0): at L = 1 on 9.0 (227 KiB) I + H up to ~5000 and
    U up to ~1500; other sizes run the reference on every platform. Precision on the kernel path: float32
    throughout; the weight gradients' sums over time run on the tensor cores in 3xTF32 (each operand split into
    two TF32 parts, three products; float32-class accuracy, as CUTLASS's 3xTF32 GEMMs; the bias gradients are
    plain float32 sums), within 1e-5 of the float32 reference at ``default_matmul_precision("highest")``.

    Source: Hasani et al. 2022, "Closed-form continuous-time neural networks", the CfC equations as ncps's
    PyTorch ``CfCCell`` computes them (mlech26l/ncps ``ncps/torch/cfc_cell.py``; the module docstring writes
    them out), scanned over T as ncps's ``CfC`` layer with ``batch_first=True``.

    Raises:
      TypeError: xs, h0 or a params leaf is not a float32 array, or ts is not a number or float array.
      ValueError: wrong shape or rank (the message names the argument), unknown mode,
        params that do not match the mode, or a negative, NaN or infinite concrete ts.
    """
    if not hasattr(xs, "shape"):
        raise TypeError(f"xs must be an array, got {type(xs).__name__}")
    if len(xs.shape) != 3:
        raise ValueError(f"xs must have shape [B, T, I], got {tuple(xs.shape)}")
    B, T, I = xs.shape
    cfg = _config(params, I, mode)
    _check_array("xs", xs, (B, T, I))
    H = cfg.hidden_size
    if h0 is None:
        # zeros typed like xs's rows: split as xs's batch axis under Explicit mesh axes and varying like xs under
        # shard_map (zeros_like with a new shape drops the sharding; the sum is dead code, no data is read)
        h0 = jnp.broadcast_to(jnp.zeros_like(jnp.sum(xs, axis=(1, 2)))[:, None], (B, H))
    _check_array("h0", h0, (B, H))
    ts, concrete = _prepare_ts(ts, B, T)
    hs = _scan_dispatch(cfg, params, xs, ts, h0)
    if not concrete:
        hs = jnp.where((ts < 0)[..., None], jnp.nan, hs)
    return hs


def cfc_cell(params, h, x, ts=1.0, *, mode="default"):
    """One CfC step: h [B, H], x [B, I], ts scalar or [B] -> h_next [B, H] (float32).

    Same math, errors and differentiability as :func:`cfc_scan` with T = 1 (it runs ``cfc_scan`` on one step).

    Args:
      params: from :func:`cfc_init` (same ``mode``).
      h: [B, H] float32, the state before the step.
      x: [B, I] float32, the step's input.
      ts: the step's elapsed time in bars, a scalar or [B]; >= 0 and finite (as :func:`cfc_scan`).
      mode: "default", "no_gate" or "pure".

    Returns:
      h_next [B, H] float32.

    Source: Hasani et al. 2022 (Nature Machine Intelligence), as ncps's PyTorch ``CfCCell.forward``
    (module docstring).

    Raises:
      TypeError: x, h or a params leaf is not a float32 array, or ts is not a number or float array.
      ValueError: x or h is not 2-D or does not match the params' sizes (the message names the argument), ts is
        not a scalar or [B], unknown mode, params that do not match the mode, or a negative, NaN or infinite
        concrete ts.
    """
    for name, a, want in (("x", x, "[B, I]"), ("h", h, "[B, H]")):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if len(a.shape) != 2:
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    B = x.shape[0]
    cfg = _config(params, x.shape[1], mode, input_name="x")
    if hasattr(ts, "shape") and tuple(ts.shape) not in ((), (B,)):
        raise ValueError(f"ts must be a scalar or [B]={B} for cfc_cell, got shape {tuple(ts.shape)}")
    _check_array("x", x, (B, cfg.input_size))
    _check_array("h", h, (B, cfg.hidden_size))
    return cfc_scan(params, x[:, None, :], ts, h, mode=mode)[:, 0, :]
