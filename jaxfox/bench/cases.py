"""The benchmark cases (rows of the table). Each is ``@register("name") def f(size) -> list[Variant]``.

``size`` is "small" (a few seconds on a CPU, for tests), "default" (the shapes the issues' speed
targets name; what the H200 run uses) or "large".
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp

from jaxfox.bench import CaseSpec, SkipCase, Variant, register
from jaxfox.sharding import batch_mesh


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ----------------------------------------------------------------------------------------------
@register("copy")
def copy_case(size: str) -> list[Variant]:
    """Device-to-device copy bandwidth: y = x + 1 over a float32 buffer (reads N, writes N bytes).

    The bandwidth ceiling the bandwidth-bound ops are compared with; reference path only.
    """
    n = {"small": 1 << 20, "default": 1 << 28, "large": 1 << 30}[size]

    def setup():
        x = _normal(0, (n,))
        builder = lambda: (lambda x: x + jnp.float32(1.0))  # noqa: E731
        return CaseSpec(builder, None, (x,), 2.0 * 4 * n, None)

    label = f"[{n}] f32 ({4 * n / 2**30:.3g} GiB)"
    return [Variant("copy", label, setup, reference_only=True, params={"n": n})]


# ----------------------------------------------------------------------------------------------
@register("reduce_axis0")
def reduce_case(size: str) -> list[Variant]:
    """jaxfox.reduce_axis0(x): x [B, P] float32 -> [P]; bytes = 4 (B P + P)."""
    import jaxfox

    shapes = {
        "small": [(32, 1 << 16), (256, 1024), (1024, 64)],
        "default": [(32, 1 << 20), (2048, 4096), (16384, 64)],
        "large": [(32, 1 << 22), (8192, 8192), (65536, 64)],
    }[size]
    out = []
    for B, P in shapes:
        def setup(B=B, P=P):
            x = _normal(1, (B, P))
            builder = lambda: (lambda x: jaxfox.reduce_axis0(x))  # noqa: E731
            return CaseSpec(builder, None, (x,), 4.0 * (B * P + P), None)

        unroll = 8 if B * P <= (1 << 25) else 1
        out.append(Variant("reduce_axis0", f"[{B}, {P}]", setup, unroll=unroll, params={"B": B, "P": P}))
    return out


# ----------------------------------------------------------------------------------------------
_CFC_SHAPES = {
    "small": dict(B=4, T=16, I=8, H=16, U=16),
    "default": dict(B=32, T=256, I=48, H=128, U=128),
    "large": dict(B=256, T=256, I=48, H=128, U=128),
}


@register("cfc_scan")
def cfc_scan_case(size: str) -> list[Variant]:
    """jaxfox.cfc_scan, mode "default", one backbone layer, ts = 1.

    Rows: forward+backward (value_and_grad of sum(hs * w_out) w.r.t. params and xs) and forward only.
    FLOPs are the matmuls only: forward 2 B T ((I + H) U + U 4H); forward+backward counted as 3x.
    """
    import jaxfox

    s = _CFC_SHAPES[size]
    B, T, I, H, U = s["B"], s["T"], s["I"], s["H"], s["U"]
    fwd_flops = 2.0 * B * T * ((I + H) * U + U * 4 * H)
    label = f"B={B} T={T} I={I} H={H} U={U}"

    def inputs():
        params = jaxfox.cfc_init(jax.random.key(2), I, H, backbone_units=U, backbone_layers=1,
                                 mode="default")
        xs = _normal(3, (B, T, I))
        w_out = _normal(4, (H,))
        return params, xs, w_out

    def setup_grad():
        def builder():
            def op(params, xs, w_out):
                def loss(p, x):
                    return jnp.sum(jaxfox.cfc_scan(p, x, mode="default") * w_out)

                return jax.value_and_grad(loss, argnums=(0, 1))(params, xs)

            return op

        return CaseSpec(builder, None, inputs(), None, 3.0 * fwd_flops)

    def setup_fwd():
        params, xs, _ = inputs()
        builder = lambda: (lambda params, xs: jaxfox.cfc_scan(params, xs, mode="default"))  # noqa: E731
        return CaseSpec(builder, None, (params, xs), None, fwd_flops)

    return [
        Variant("cfc_scan", f"fwd+bwd {label}", setup_grad, params=dict(s, direction="fwd+bwd")),
        Variant("cfc_scan", f"fwd {label}", setup_fwd, params=dict(s, direction="fwd")),
    ]


# ----------------------------------------------------------------------------------------------
_PERCEPTION_SHAPES = {
    "small": dict(batch=4, window=16, num_features=8),
    "default": dict(batch=32, window=64, num_features=48),
    "large": dict(batch=256, window=64, num_features=48),
}


@register("perception_step")
def perception_case(size: str) -> list[Variant]:
    """One whole training step of the perception model (forward, backward, optimizer update).

    Rows: model v0 (``jaxfox.models.perception_v0``) and the full model (``jaxfox.models.perception``:
    VSN, CfC, attention pool, GRN head). Uses ``<module>.benchmark_step(batch, window, num_features)``, which returns
    ``(step_fn, state, batch)``: ``step_fn(state, batch) -> (state, loss)`` un-jitted; state and
    batch pytrees of arrays. The loop carries the state, as a training loop does (same batch every
    step). Skipped when that module or function is missing.
    """
    kw = _PERCEPTION_SHAPES[size]

    def setup_for(module_name):
        def setup():
            import importlib

            try:
                make = importlib.import_module(f"jaxfox.models.{module_name}").benchmark_step
            except (ImportError, AttributeError) as e:
                raise SkipCase(f"jaxfox.models.{module_name}.benchmark_step unavailable: {e}") from e
            one = batch_mesh(jax.local_devices()[:1])
            step_fn, state, batch = make(**kw, mesh=one)
            kernel_builder = lambda: step_fn  # noqa: E731
            reference_builder = lambda: make(**kw, mesh=one)[0]  # noqa: E731  (built again inside use_reference())
            return CaseSpec(kernel_builder, reference_builder, (state, batch), None, None)

        return setup

    label = f"B={kw['batch']} T={kw['window']} m={kw['num_features']}"
    return [Variant("perception_step", label, setup_for("perception_v0"), stateful=True, params=dict(kw, model="v0")),
            Variant("perception_step", f"full {label}", setup_for("perception"), stateful=True,
                    params=dict(kw, model="full"))]


# ----------------------------------------------------------------------------------------------
_ROW_SHAPES = {"small": [(4, 16)], "default": [(32, 64), (256, 64)], "large": [(1024, 64)]}


# ----------------------------------------------------------------------------------------------
def _weighted_sum_grad(apply, w):
    """Builder of ``op(params, x) = value_and_grad(sum(apply(params, x) * w), argnums=(0, 1))``: the
    forward+backward of the row-wise perception blocks (a fixed random w, so that the input gradients
    do not vanish, as they would for sum of squares through a LayerNorm)."""
    def builder():
        def op(params, x):
            return jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x) * w), argnums=(0, 1))(params, x)

        return op

    return builder


@register("attention_pool")
def attention_pool_case(size: str) -> list[Variant]:
    """jaxfox.attention_pool forward+backward (value_and_grad of sum(pooled * w) w.r.t. params and hs).

    hs [B, T, H] with H = 128 (16 small), 4 heads, no mask; rows = B x T (2048 and 16384 by default); and the
    aux attention trainer's shape, B = 16384, T = 16, H = 64, differentiated w.r.t. the parameters only.
    Each shape has two rows: the default jaxfox path (XLA runs the factored form, jaxfox.attention._factored;
    traced with attention_pool out of JAXFOX_OPT_IN_KERNELS) and the kernels (``kernel (opt-in)``: traced with
    attention_pool opted in).
    """
    import jaxfox

    def rows(label, make_builder, key, shape, params):
        def setup(opt_in):
            p = jaxfox.attention_pool_init(jax.random.key(key), shape[2], num_heads=4)
            hs, w = _normal(key + 1, shape), _normal(key + 2, (shape[2],))
            inner = make_builder(w)

            def builder():
                op = inner()

                def traced(*args):
                    with _opted_in("attention_pool", opt_in):  # no effect on the reference path
                        return op(*args)

                return traced

            return CaseSpec(builder, None, (p, hs), None, None)

        return [Variant("attention_pool", label, lambda: setup(False), params=params),
                Variant("attention_pool", f"{label}, kernel (opt-in)", lambda: setup(True),
                        params=dict(params, kernel=True))]

    def pooled(p, x):
        return jaxfox.attention_pool(p, x)[0]

    H = 16 if size == "small" else 128
    out = []
    for B, T in _ROW_SHAPES[size]:
        out += rows(f"fwd+bwd B={B} T={T} H={H} ({B * T} rows)", lambda w: _weighted_sum_grad(pooled, w), 6,
                    (B, T, H), {"B": B, "T": T, "H": H})

    # the aux attention trainer's shape (jaxfox.models.aux): the gradient w.r.t. the parameters only (hs is data)
    Ba, Ta, Ha = (64, 16, 16) if size == "small" else (16384, 16, 64)

    def params_only(w):
        def builder():
            def op(params, x):
                return jax.value_and_grad(lambda p: jnp.sum(pooled(p, x) * w))(params)
            return op
        return builder

    out += rows(f"fwd+bwd params only B={Ba} T={Ta} H={Ha} (aux trainer)", params_only, 9, (Ba, Ta, Ha),
                {"B": Ba, "T": Ta, "H": Ha, "params_only": True})
    return out


# ----------------------------------------------------------------------------------------------
def _grn_matmul_flops(R, I, H, O):
    """Forward matmul FLOPs of one GRN without context on R rows: 2 R (I H + H H + 2 H O [+ I O])."""
    return 2.0 * R * (I * H + H * H + 2 * H * O + (I * O if I != O else 0))


@register("grn")
def grn_case(size: str) -> list[Variant]:
    """jaxfox.grn forward+backward (value_and_grad of sum(y * w) w.r.t. params and a), no context.

    The issue's bench shape: a [R, I] float32 with I = Hd = O = 128 (16 small), so the skip is the identity;
    rows R = B x T = 2048 and 16384 by default (64 small). At width 128 the jaxfox path (``grn`` opted in while it
    is traced) runs ffi/grn.cu's tensor-core (TF32) kernels, jaxfox_grn_tc_fwd / _bwd (default matmul precision;
    the CUDA-core kernels take Hd, O <= 64), labelled "tensor-core kernels (opt-in)"; the reference is XLA's TF32
    matmuls. (At width 16, small, the CUDA-core kernels run.) Then the perception model's two GRNs, which fit the
    CUDA-core kernels: the VSN's
    selection GRN (I = m d = 192, Hd = 32, O = m = 48; without the VSN's softmax here) at the same row counts,
    and the head GRN (I = 2 H = 64, Hd = O = 32) on B = 32 rows. The kernels are opt-in (slower than XLA so
    far): the jaxfox path of these rows opts in to ``grn`` while it is traced. FLOPs are the matmuls only: forward
    2 R (I Hd + Hd Hd + 2 Hd O [+ I O]); forward+backward counted as 3x.
    """
    import jaxfox

    W = 16 if size == "small" else 128
    wide = f"I=H=O={W}" + (", tensor-core kernels (opt-in)" if W == 128 else "")
    shapes = [(B * T, W, W, W, wide) for B, T in _ROW_SHAPES[size]]
    shapes += [(B * T, 192, 32, 48, "I=192 H=32 O=48 (VSN selection)") for B, T in _ROW_SHAPES[size]]
    shapes.append((32, 64, 32, 32, "I=64 H=O=32 (head)"))
    out = []
    for R, I, H, O, label in shapes:
        def setup(R=R, I=I, H=H, O=O):
            params = jaxfox.grn_init(jax.random.key(70), I, H, O)
            a, w = _normal(71, (R, I)), _normal(72, (O,))

            def grn_opted_in(p, a):
                with _opted_in("grn"):   # no effect on the reference path (use_reference() wins)
                    return jaxfox.grn(p, a)

            builder = _weighted_sum_grad(grn_opted_in, w)
            return CaseSpec(builder, None, (params, a), None, 3.0 * _grn_matmul_flops(R, I, H, O))

        out.append(Variant("grn", f"fwd+bwd R={R} {label}", setup,
                           params={"R": R, "I": I, "H": H, "O": O}))
    return out


@register("vsn")
def vsn_case(size: str) -> list[Variant]:
    """jaxfox.vsn forward+backward (value_and_grad of sum(out * w) w.r.t. params and xs), no context.

    xs [R, m, d] float32 at two widths: the issue's bench shape, m = 48 variables of width d = 16, hidden
    Hd = 128, output O = 128, and the main job's, m = 48, d = 4, Hd = O = 32 (FULL_DEFAULTS of
    jaxfox.models.perception); small: m = 4, d = 4, Hd = O = 16 and the main job's. Rows R = 2048 and
    16384 by default (64 small). The loss reaches the selection weights through out. FLOPs are the
    matmuls only: the selection GRN (input m d, output m, Dense skip) plus m per-variable GRNs (input d,
    output O, Dense skip); forward+backward counted as 3x.
    The per-variable GRNs run the fused kernels of ffi/vsn.cu when d, Hd, O <= 32 (the main job's width,
    and the small shapes): there the ffi column counts their forward and backward calls. The bench shape
    (Hd = O = 128) has two rows per row count: the default jaxfox path, which runs the XLA reference there (its
    ffi column shows 0 and the speed-up is ~1; on a GPU the harness also warns that the jaxfox path compiled
    without an FFI call), and "tensor-core kernels (opt-in)", whose jaxfox path is traced with ``grn`` opted in:
    the m per-variable GRNs then run ffi/grn.cu's TF32 tensor-core kernels (one call pair over the m variables,
    default matmul precision; the selection GRN, input m d = 768, stays XLA). Small: that row at m = 4, d = 16,
    Hd = O = 128.
    """
    import jaxfox

    if size == "small":
        widths = [(4, 4, 16, 16, None), (48, 4, 32, 32, None), (4, 16, 128, 128, True)]
    else:
        widths = [(48, 16, 128, 128, False), (48, 16, 128, 128, True), (48, 4, 32, 32, None)]
    out = []
    for m, d, H, O, tc in widths:
        for B, T in _ROW_SHAPES[size]:
            R = B * T

            def setup(R=R, m=m, d=d, H=H, O=O, tc=tc):
                params = jaxfox.vsn_init(jax.random.key(73), m, d, H, O)
                xs, w = _normal(74, (R, m, d)), _normal(75, (O,))

                def apply(p, x):
                    # tc: grn opted in (True), out (False: the default path even when the environment opts in), or
                    # the environment as it is (None); no effect on the reference path (use_reference() wins)
                    with contextlib.nullcontext() if tc is None else _opted_in("grn", tc):
                        return jaxfox.vsn(p, x)[0]

                builder = _weighted_sum_grad(apply, w)
                fwd = _grn_matmul_flops(R, m * d, H, m) + m * _grn_matmul_flops(R, d, H, O)
                return CaseSpec(builder, None, (params, xs), None, 3.0 * fwd)

            label = (f"fwd+bwd R={R} m={m} d={d} H=O={H}, tensor-core kernels (opt-in)" if tc
                     else f"fwd+bwd R={R} m={m} d={d} H={H} O={O}")
            out.append(Variant("vsn", label, setup,
                               params={"R": R, "B": B, "T": T, "m": m, "d": d, "H": H, "O": O, "tc": bool(tc)}))
    return out


# ----------------------------------------------------------------------------------------------
_IQL_SHAPES = {"small": dict(B=256, D=32, H=16), "default": dict(B=16384, D=256, H=128),
               "large": dict(B=65536, D=256, H=128)}


@register("iql_pair")
def iql_pair_case(size: str) -> list[Variant]:
    """Two IQL value networks D -> H -> 1 (ReLU), identical shapes, on one batch of B states:
    value_and_grad of expectile(0.7) + expectile(0.9) losses (mean over B) w.r.t. both networks.

    jaxfox path: :func:`jaxfox.iql_value_loss`'s kernel path (on sm_90 one kernel for both first layers' product
    and the rest of the losses and their gradients, elsewhere one XLA GEMM for both first layers and one kernel for
    the rest; XLA's GEMM for dW1); reference path: the same call under
    ``use_reference()``, i.e. the networks ``jax.vmap``-ed over their stacked weights (batched GEMMs, TF32 at
    the default precision on the GPU), the baseline of issue 5.
    FLOPs: matmuls only, forward 2 B (D H + H) x 2 networks; forward+backward counted as 2x
    (the backward needs dW only for layer 1, dW and dX for layer 2).
    """
    import jaxfox
    from jaxfox.models.aux import iql_init

    s = _IQL_SHAPES[size]
    B, D, H = s["B"], s["D"], s["H"]
    taus = (0.7, 0.9)

    def setup():
        params = iql_init(jax.random.key(21), D, hidden=(H,), num_networks=len(taus))
        states = _normal(22, (B, D))
        target = _normal(23, (B,))

        def builder():
            def op(params, states, target):
                return jax.value_and_grad(lambda p: jnp.sum(jaxfox.iql_value_loss(p, states, target, taus)))(params)

            return op

        flops = 2.0 * 2.0 * B * (D * H + H) * 2
        return CaseSpec(builder, None, (params, states, target), None, flops)

    return [Variant("iql_pair", f"fwd+bwd 2 x ({D} -> {H} -> 1) B={B}", setup, params=dict(s))]


_IQN_SHAPES = {"small": dict(B=64, N=8, K=32, H=64), "default": dict(B=16384, N=32, K=64, H=128),
               "large": dict(B=65536, N=32, K=64, H=128)}


@register("iqn_head")
def iqn_head_case(size: str) -> list[Variant]:
    """jaxfox.iqn_head (the IQN quantile head: cosine embedding, W_phi + ReLU, Hadamard product with psi,
    W_h + ReLU, output layer) at the aux trainer's shape: forward only, and forward+backward
    (value_and_grad of sum(z * c) w.r.t. params and psi; taus not differentiated, as in IQN training).
    Third row: value_and_grad of :func:`jaxfox.iqn_quantile_huber_loss` (N' = N targets a state) w.r.t. params
    and psi: jaxfox path = the fused loss kernel (opt-in, opted in while tracing: ONE launch, no forward
    kernel), reference = the composition in XLA.
    jaxfox path: the fused kernels; reference: the XLA einsums (TF32 matmuls at default precision).
    FLOPs: matmuls only, forward 2 B N (K H + H H + H); the backward recomputes the forward and adds
    d m, d W_h (2 B N H H each) and d W_phi (2 B N K H).
    """
    import jaxfox

    s = _IQN_SHAPES[size]
    B, N, K, H = s["B"], s["N"], s["K"], s["H"]
    R = B * N
    fwd_flops = 2.0 * R * (K * H + H * H + H)
    bwd_flops = 2 * fwd_flops + 2.0 * R * (2 * H * H + K * H)

    def inputs():
        params = jaxfox.iqn_head_init(jax.random.key(31), H, n_cos=K)
        psi = jax.nn.relu(_normal(32, (B, H)))
        taus = jax.random.uniform(jax.random.key(33), (B, N), jnp.float32)
        return params, psi, taus, _normal(34, (B, N))

    def setup_fwd():
        params, psi, taus, _ = inputs()
        builder = lambda: (lambda p, psi, taus: jaxfox.iqn_head(p, psi, taus))  # noqa: E731
        return CaseSpec(builder, None, (params, psi, taus), None, fwd_flops)

    def setup_bwd():
        params, psi, taus, c = inputs()

        def builder():
            def op(p, psi, taus, c):
                return jax.value_and_grad(lambda p, psi: jnp.sum(jaxfox.iqn_head(p, psi, taus) * c),
                                          argnums=(0, 1))(p, psi)
            return op

        return CaseSpec(builder, None, (params, psi, taus, c), None, bwd_flops)

    def setup_loss():
        params, psi, taus, c = inputs()
        y = c[:, : s["N"]]  # N' = N target samples a state

        def builder():
            def op(p, psi, taus, y):
                return jax.value_and_grad(lambda p, psi: jaxfox.iqn_quantile_huber_loss(p, psi, taus, y),
                                          argnums=(0, 1))(p, psi)
            return op

        return CaseSpec(builder, None, (params, psi, taus, y), None, bwd_flops)

    label = f"B={B} N={N} n_cos={K} H={H}"
    return [Variant("iqn_head", "fwd " + label, setup_fwd, params=dict(s)),
            Variant("iqn_head", "fwd+bwd " + label, setup_bwd, params=dict(s)),
            Variant("iqn_head", "loss fwd+bwd (quantile Huber, N'=N) " + label, setup_loss, params=dict(s, loss=True))]


_GROUPED_SHAPES = {
    "small": [(64, 32, 16), (0, 8, 8), (33, 17, 5), (128, 64, 1)],
    "default": [(16384, 256, 128), (16384, 128, 64), (4096, 64, 51), (0, 32, 32), (1024, 512, 256)],
    "large": [(65536, 256, 128), (65536, 128, 64), (16384, 64, 51), (4096, 512, 256)],
}


@register("grouped_matmul")
def grouped_matmul_case(size: str) -> list[Variant]:
    """jaxfox.grouped_matmul over groups of mixed shapes (M, K, N), with biases: forward only and
    forward+backward (value_and_grad of sum_g sum(y_g * c_g) w.r.t. xs, ws, bs). float32, default
    matmul precision. Reference path: one jnp.dot per group. FLOPs: 2 M K N per group (x3 fwd+bwd).
    Kernels opt-in (JAXFOX_OPT_IN_KERNELS=grouped_matmul).
    """
    import jaxfox

    shapes = _GROUPED_SHAPES[size]
    fwd_flops = sum(2.0 * M * K * N for M, K, N in shapes)
    label = f"{len(shapes)} groups " + " ".join(f"{M}x{K}x{N}" for M, K, N in shapes)

    def make_inputs():
        xs = [_normal(30 + g, (M, K)) for g, (M, K, N) in enumerate(shapes)]
        ws = [_normal(40 + g, (K, N)) / jnp.sqrt(max(K, 1)) for g, (M, K, N) in enumerate(shapes)]
        bs = [_normal(50 + g, (N,)) for g, (M, K, N) in enumerate(shapes)]
        cs = [_normal(60 + g, (M, N)) for g, (M, K, N) in enumerate(shapes)]
        return xs, ws, bs, cs

    def setup_fwd():
        xs, ws, bs, _ = make_inputs()
        builder = lambda: (lambda xs, ws, bs: jaxfox.grouped_matmul(xs, ws, bs))  # noqa: E731
        return CaseSpec(builder, None, (xs, ws, bs), None, fwd_flops)

    def setup_bwd():
        xs, ws, bs, cs = make_inputs()

        def builder():
            def op(xs, ws, bs, cs):
                def loss(xs, ws, bs):
                    return sum(jnp.sum(y * c) for y, c in zip(jaxfox.grouped_matmul(xs, ws, bs), cs))

                return jax.value_and_grad(loss, argnums=(0, 1, 2))(xs, ws, bs)

            return op

        return CaseSpec(builder, None, (xs, ws, bs, cs), None, 3 * fwd_flops)

    return [Variant("grouped_matmul", "fwd " + label, setup_fwd, params={"shapes": shapes}),
            Variant("grouped_matmul", "fwd+bwd " + label, setup_bwd, params={"shapes": shapes})]


# ----------------------------------------------------------------------------------------------
@register("c51_loss")
def c51_loss_case(size: str) -> list[Variant]:
    """jaxfox.categorical_double_q_loss forward+backward (value_and_grad of mean(loss) w.r.t. logits_tm1).

    logits [B, D, A, N] float32 (D = 4 branches, A = 5 actions, N = 51 atoms), support linspace(-10, 10).
    Bytes: the three logit tensors read once and the gradient written once (4 B D A N each).
    """
    import jaxfox

    B = {"small": 64, "default": 1024, "large": 8192}[size]
    D, A, N = 4, 5, 51

    def setup():
        lt, tg, on = _normal(10, (B, D, A, N)), _normal(11, (B, D, A, N)), _normal(12, (B, D, A, N))
        a = jax.random.randint(jax.random.key(13), (B, D), 0, A, jnp.int32)
        r = _normal(14, (B,))
        disc = jnp.where(jax.random.uniform(jax.random.key(15), (B,)) < 0.1, 0.0, 0.99).astype(jnp.float32)
        z = jnp.linspace(-10.0, 10.0, N, dtype=jnp.float32)

        def builder():
            def op(lt, a, r, disc, tg, on, z):
                def loss(x):
                    return jnp.mean(jaxfox.categorical_double_q_loss(x, a, r, disc, tg, on, z))

                return jax.value_and_grad(loss)(lt)

            return op

        return CaseSpec(builder, None, (lt, a, r, disc, tg, on, z), 4.0 * 4 * B * D * A * N, None)

    return [Variant("c51_loss", f"fwd+bwd B={B} D={D} A={A} N={N}", setup, params=dict(B=B, D=D, A=A, N=N))]


@register("per_sample")
def per_sample_case(size: str) -> list[Variant]:
    """jaxfox.per.sample (prefix sum of p^alpha, stratified draws, IS weights), alpha 0.6, beta 0.4.

    Full buffers with lognormal priorities (5% zeros). Bytes: the priorities read once (4 C). Two rows per
    capacity: against the reference path (compensated float32 prefix scan), and against a plain float32
    ``jnp.cumsum`` + ``jnp.searchsorted`` sampler (the issue's yardstick; less accurate at large C).
    """
    from jaxfox import per

    caps = {"small": [1 << 12, 4099], "default": [1 << 20, 1000003], "large": [1 << 24, 16777259]}[size]
    B = 1024 if size != "small" else 64
    out = []
    for C in caps:
        def setup(C=C):
            p = jnp.exp(2.0 * _normal(20, (C,)))
            p = jnp.where(jax.random.uniform(jax.random.key(21), (C,)) < 0.05, 0.0, p).astype(jnp.float32)
            state = per.PERState(p, jnp.float32(1.0), jnp.int32(C), jnp.int32(0))
            key = jax.random.key(22)
            builder = lambda: (lambda state, key: per.sample(state, key, B, alpha=0.6, beta=0.4))  # noqa: E731
            return CaseSpec(builder, None, (state, key), 4.0 * C, None)

        def setup_cumsum(C=C):
            spec = setup(C)

            def baseline():
                # the yardstick: float32 jnp.cumsum + jnp.searchsorted, same draws and weights
                def sample(state, key):
                    p = state.priorities
                    q = jnp.where(p > 0, jnp.where(p > 0, p, 1.0) ** 0.6, 0.0)
                    c = jnp.cumsum(q)
                    u = (jnp.arange(B) + jax.random.uniform(key, (B,))) / B * c[-1]
                    idx = jnp.minimum(jnp.searchsorted(c, u, side="right"), C - 1).astype(jnp.int32)
                    qi = q[idx]
                    return idx, (jnp.min(qi) / qi) ** 0.4

                return sample

            return CaseSpec(spec.kernel_builder, baseline, spec.inputs, spec.bytes, None)

        out.append(Variant("per_sample", f"C={C} B={B}", setup, params=dict(C=C, B=B)))
        out.append(Variant("per_sample", f"C={C} B={B} vs jnp.cumsum + searchsorted", setup_cumsum,
                           params=dict(C=C, B=B, baseline="cumsum")))
    return out


# ----------------------------------------------------------------------------------------------
_AUX_SHAPES = {
    "small": dict(B=64, obs_dim=16, iql_hidden=(16,), iqn_hidden=16, n_quantiles=8, n_target_quantiles=8,
                  n_cos=16, seq_len=4, seq_dim=16),
    "default": dict(B=16384, obs_dim=256, iql_hidden=(128,), iqn_hidden=128, n_quantiles=32,
                    n_target_quantiles=32, n_cos=64, seq_len=16, seq_dim=64),
    "large": dict(B=65536, obs_dim=256, iql_hidden=(128,), iqn_hidden=128, n_quantiles=32,
                  n_target_quantiles=32, n_cos=64, seq_len=16, seq_dim=64),
}


def _aux_summary(rows: list[dict]) -> str:
    """The concurrency breakdown of the aux_step case (issue 5): stored in the rows as "breakdown"."""
    t = {r["params"]["part"]: r for r in rows}
    need = ("iql_pair", "iqn", "attention", "together", "sequence")
    if any(p not in t for p in need):
        return "aux_step breakdown: incomplete (a row failed or was skipped)"
    out = {}
    for path in ("jaxfox", "reference"):
        get = lambda p: t[p][path]["median_s"] if t[p][path] else None  # noqa: E731
        alone = [get(p) for p in ("iql_pair", "iqn", "attention")]
        if None in alone or get("together") is None:
            continue
        s = sum(alone)
        out[path] = {"alone_s": dict(zip(("iql_pair", "iqn", "attention"), alone)), "sum_alone_s": s,
                     "together_s": get("together"), "sequence_s": get("sequence"),
                     "together_over_sum": get("together") / s}
    ref_seq = t["sequence"]["reference"]["median_s"]
    lines = ["aux_step breakdown (median per step):"]
    for path, d in out.items():
        a = d["alone_s"]
        lines.append(f"  {path:9s} alone: iql_pair {a['iql_pair'] * 1e3:.3f} ms, iqn {a['iqn'] * 1e3:.3f} ms, "
                     f"attention {a['attention'] * 1e3:.3f} ms; sum {d['sum_alone_s'] * 1e3:.3f} ms; together "
                     f"{d['together_s'] * 1e3:.3f} ms ({d['together_over_sum']:.2f}x the sum; target <= 0.8); "
                     f"in sequence {d['sequence_s'] * 1e3:.3f} ms")
    if "jaxfox" in out:
        sp = ref_seq / out["jaxfox"]["together_s"]
        out["speedup_together_vs_reference_sequence"] = sp
        lines.append(f"  jaxfox together vs reference in sequence: {sp:.2f}x (target >= 1.5)")
    for r in rows:
        r["breakdown"] = out
    return "\n".join(lines)


@register("aux_step")
def aux_step_case(size: str) -> list[Variant]:
    """The auxiliary trainers of issue 5 (``jaxfox.models.aux``): IQL value pair (256 -> 128 -> 1 x 2,
    expectiles 0.7/0.9), IQN head, attention trainer (T = 16, H = 64), each one full training step
    (forward, backward, fused AdamW), B = 16384 per trainer.

    Rows (part): each trainer alone (``iql_pair``: jaxfox path = :func:`jaxfox.iql_value_loss`'s kernel path,
    reference = the vmapped batched-GEMM baseline), ``together`` (``aux_step``: all
    three in one step, no data dependence between them), ``sequence`` (``aux_step_sequential``: the same with a data dependency
    chaining the trainers, so they cannot overlap; its reference path is "the same trainers run in
    sequence on the reference path"). After the rows a breakdown is printed: the sum of the separate
    times, together / sum, and jaxfox together vs reference in sequence. Overlap needs
    ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` (``python -m jaxfox.bench --concurrent``).
    """
    s = dict(_AUX_SHAPES[size])
    B = s.pop("B")
    label = f"B={B} F={s['obs_dim']} IQL {s['obs_dim']}->{s['iql_hidden'][0]}->1 x2, IQN N={s['n_quantiles']}, " \
            f"attn T={s['seq_len']} H={s['seq_dim']}"

    def make(part):
        def setup():
            from jaxfox.models.aux import AuxConfig, make_aux, synthetic_batch

            cfg = AuxConfig(**s)
            fused, vmapped = make_aux(cfg), make_aux(cfg, iql_impl="vmap")
            state = fused.init(jax.random.key(11))
            batch = synthetic_batch(jax.random.key(12), cfg, B)
            fn = {"iql_pair": ("iql_step", "iql", "iql"), "iqn": ("iqn_step", "iqn", "iqn"),
                  "attention": ("attention_step", "attn", "attn"),
                  "together": ("aux_step", None, None), "sequence": ("aux_step_sequential", None, None)}[part]
            name, field, key = fn
            st = state if field is None else getattr(state, field)
            b = batch if key is None else batch[key]
            return CaseSpec(lambda: getattr(fused, name), lambda: getattr(vmapped, name), (st, b), None, None)

        return setup

    parts = ("iql_pair", "iqn", "attention", "together", "sequence")
    return [Variant("aux_step", f"{p} {label}", make(p), stateful=True, params=dict(s, B=B, part=p))
            for p in parts]


aux_step_case.summarize = _aux_summary


# ----------------------------------------------------------------------------------------------
_OPTIM_SIZES = {"small": [1 << 16], "default": [1 << 20, 10_000_000, 1 << 24], "large": [1 << 26]}


@contextlib.contextmanager
def _opted_in(name: str, on: bool = True):
    """JAXFOX_OPT_IN_KERNELS with ``name`` added (``on``) or removed (``all`` spelt out without it) while the body
    runs (wrap the tracing of the jaxfox path)."""
    from jaxfox._ffi import OPT_IN, OPT_IN_ENV, opted_in_names

    old = os.environ.get(OPT_IN_ENV)
    names = opted_in_names()
    if not on and "all" in names:
        names = set(OPT_IN)
    os.environ[OPT_IN_ENV] = ",".join(sorted(names | {name} if on else names - {name}))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(OPT_IN_ENV, None)
        else:
            os.environ[OPT_IN_ENV] = old


@register("adamw")
def adamw_case(size: str) -> list[Variant]:
    """One ``fused_adamw(...).step`` (update + apply) on a FlatParams [P] (default decay mask, no
    clipping / clipping at 1.0). jaxfox path: the fused update-and-apply kernel (``jaxfox_adamw_apply``,
    opt-in for one flat buffer: opted in here while the step is traced); reference: ``update`` then
    ``optax.apply_updates``, XLA code (use_reference()). One more row: the main job's optimizer on the full
    perception model's parameter tree (49 leaves, moments flat, every leaf decayed, clipping at 1.0: the
    kernel by the default rule; the reference is optax.flatten's operations then one add per leaf), 32 bytes
    per parameter (params and moments read and written, grads read twice).

    Bytes per parameter, what the fused step must move: params, grads, mu, nu (16) and the bool mask (1)
    in, params, mu, nu (12) out; the norm pass reads grads again (4, clipping only). The updates and
    ``apply_updates``' own pass are not counted: XLA fuses them into the update, so they never reach memory.
    """
    from jaxfox import optim

    out = []
    for P in _OPTIM_SIZES[size]:
        for clip in (None, 1.0):
            def setup(P=P, clip=clip):
                fp = optim.FlatParams.from_tree({"w": _normal(10, (P // 8, 8)), "b": _normal(11, (P - 8 * (P // 8),))})
                g = _normal(12, (P,)) * 1e-3

                def builder():
                    tx = optim.fused_adamw(1e-3, weight_decay=1e-4, max_grad_norm=clip)

                    def step(state, g):
                        fp, st = state
                        with _opted_in("adamw"):
                            fp, st = tx.step(optim.FlatParams(g, fp.layout), st, fp)
                        return (fp, st), fp.flat[:1]

                    return step

                tx0 = optim.fused_adamw(1e-3, weight_decay=1e-4, max_grad_norm=clip)
                per = 29 + (4 if clip is not None else 0)
                return CaseSpec(builder, None, ((fp, tx0.init(fp)), g), float(per) * P, None)

            label = f"P={P} {'clip 1.0' if clip is not None else 'no clip'}"
            out.append(Variant("adamw", label, setup, stateful=True, params={"P": P, "clip": clip}))

    def setup_tree():
        # the main job's optimizer (jaxfox.models.perception.make_optimizer) on the full model's parameter tree
        from flax import nnx

        from jaxfox.models.perception import make_model

        params = nnx.as_pure(nnx.state(make_model(48, rngs=nnx.Rngs(0)), nnx.Param))
        g = jax.tree.map(lambda x: x * 1e-3 + 1e-4, params)
        tx = optim.fused_adamw(1e-3, weight_decay=1.0, mask=True, max_grad_norm=1.0, flatten_moments=True)

        def builder():
            def step(state, g):
                p, st = tx.step(g, state[1], state[0])
                return (p, st), st.mu.flat[:1]

            return step

        P = sum(int(x.size) for x in jax.tree.leaves(params))
        return CaseSpec(builder, None, ((params, tx.init(params)), g), 32.0 * P, None)

    out.append(Variant("adamw", "perception tree (49 leaves, flat moments, clip 1.0)", setup_tree, stateful=True,
                       params={"tree": "perception", "clip": 1.0}))
    return out


@register("ema_update")
def ema_update_case(size: str) -> list[Variant]:
    """jaxfox.ema_update(target [P], online [P], tau = 0.01): reads 8, writes 4 bytes per element."""
    from jaxfox import optim

    out = []
    for P in _OPTIM_SIZES[size]:
        def setup(P=P):
            builder = lambda: (lambda t, o: optim.ema_update(t, o, jnp.float32(0.01)))  # noqa: E731
            return CaseSpec(builder, None, (_normal(13, (P,)), _normal(14, (P,))), 12.0 * P, None)

        out.append(Variant("ema_update", f"P={P}", setup, params={"P": P}))
    return out


@register("cast_bf16")
def cast_bf16_case(size: str) -> list[Variant]:
    """jaxfox.cast_bf16(x [P] float32) -> bfloat16: reads 4, writes 2 bytes per element."""
    from jaxfox import optim

    out = []
    for P in _OPTIM_SIZES[size]:
        def setup(P=P):
            builder = lambda: (lambda x: optim.cast_bf16(x))  # noqa: E731
            return CaseSpec(builder, None, (_normal(15, (P,)),), 6.0 * P, None)

        out.append(Variant("cast_bf16", f"P={P}", setup, params={"P": P}))
    return out


# ----------------------------------------------------------------------------------------------
# Data-parallel scaling (issue 6): the same training step on 1, 2, 4, 8 local devices at a fixed batch
# per device; throughput scaling on n devices = n * time(1 device) / time(n devices).
def _device_counts():
    n = len(jax.local_devices())
    return [k for k in (1, 2, 4, 8) if k <= n]


@register("perception_step_dp")
def perception_dp_case(size: str) -> list[Variant]:
    """The perception training step (as ``perception_step``) data parallel over n local devices
    (``jaxfox.models.perception_v0.train_step``'s mesh), with a fixed batch per device: the ``perception_step``
    shape's batch (32 by default) and 256; small: that shape's batch only."""
    from jaxfox.models import perception_v0

    kw = dict(_PERCEPTION_SHAPES[size])
    per_device = [kw.pop("batch")] + ([256] if size != "small" else [])
    out = []
    for b in per_device:
        for n in _device_counts():
            def setup(b=b, n=n):
                mesh = batch_mesh(jax.local_devices()[:n])
                make = lambda: perception_v0.benchmark_step(batch=b * n, mesh=mesh, **kw)  # noqa: E731
                step_fn, state, batch = make()
                return CaseSpec(lambda: step_fn, lambda: make()[0], (state, batch), None, None)

            out.append(Variant("perception_step_dp", f"{n} device(s) x B={b} (T={kw['window']})", setup,
                               stateful=True, params={"devices": n, "per_device_batch": b}))
    return out


@register("dqn_step_dp")
def dqn_dp_case(size: str) -> list[Variant]:
    """The whole DQN update (``jaxfox.models.branching_c51.make_update``: PER sample, bf16 forward, C51
    loss, grad, fused AdamW, EMA, priority update) data parallel over n local devices, 1024 samples per
    device (64 small), D=4 x A=5 x N=51, capacity 2^17 (2^12 small) filled with random transitions."""
    from jaxfox.models.branching_c51 import Transition, init_agent, make_update, support

    b = 64 if size == "small" else 1024
    cap = 1 << (12 if size == "small" else 17)
    out = []
    for n in _device_counts():
        def setup(n=n):
            mesh = batch_mesh(jax.local_devices()[:n])
            state, opt, dan = init_agent(jax.random.key(0), num_branches=4, capacity=cap)
            k = jax.random.split(jax.random.key(1), 4)
            items = Transition(jax.random.normal(k[0], (cap, 48)), jax.random.randint(k[1], (cap, 4), 0, 5),
                               jax.random.normal(k[2], (cap,)), jnp.full((cap,), 0.99),
                               jax.random.normal(k[3], (cap, 48)))
            import jaxfox

            state = state._replace(buffer=jaxfox.per.add(state.buffer, items))
            state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
            make = lambda: make_update(opt, dan, support(), batch_size=b * n, mesh=mesh)  # noqa: E731
            update = make()

            # the key is an input (perturbed by the loop like any other), not a constant: a constant key's
            # PER draws would be loop-invariant and XLA would hoist them out of the timed loop
            return CaseSpec(lambda: update, make, (state, jax.random.key(0), jnp.float32(0.4)), None, None)

        out.append(Variant("dqn_step_dp", f"{n} device(s) x B={b}", setup, stateful=True,
                           params={"devices": n, "per_device_batch": b}))
    return out
