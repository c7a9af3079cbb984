"""The benchmark cases (rows of the table). Each is ``@register("name") def f(size) -> list[Variant]``.

``size`` is "small" (a few seconds on a CPU, for tests), "default" (the shapes the issues' speed
targets name; what the H200 run uses) or "large".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfox.bench import CaseSpec, SkipCase, Variant, register


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

    Uses ``jaxfox.models.perception_v0.benchmark_step(batch, window, num_features)``, which returns
    ``(step_fn, state, batch)``: ``step_fn(state, batch) -> (state, loss)`` un-jitted; state and
    batch pytrees of arrays. The loop carries the state, as a training loop does (same batch every
    step). Skipped when that module or function is missing.
    """
    kw = _PERCEPTION_SHAPES[size]

    def setup():
        try:
            from jaxfox.models import perception_v0
            make = perception_v0.benchmark_step
        except (ImportError, AttributeError) as e:
            raise SkipCase(f"jaxfox.models.perception_v0.benchmark_step unavailable: {e}") from e
        step_fn, state, batch = make(**kw)
        kernel_builder = lambda: step_fn  # noqa: E731
        reference_builder = lambda: make(**kw)[0]  # noqa: E731  (built again inside use_reference())
        return CaseSpec(kernel_builder, reference_builder, (state, batch), None, None)

    label = f"B={kw['batch']} T={kw['window']} m={kw['num_features']}"
    return [Variant("perception_step", label, setup, stateful=True, params=dict(kw))]


# ----------------------------------------------------------------------------------------------
_ROW_SHAPES = {"small": [(4, 16)], "default": [(32, 64), (256, 64)], "large": [(1024, 64)]}


@register("attention_pool")
def attention_pool_case(size: str) -> list[Variant]:
    """jaxfox.attention_pool forward+backward (value_and_grad of sum(pooled * w) w.r.t. params and hs).

    hs [B, T, H] with H = 128 (16 small), 4 heads, no mask; rows = B x T (2048 and 16384 by default).
    """
    import jaxfox

    H = 16 if size == "small" else 128
    out = []
    for B, T in _ROW_SHAPES[size]:
        def setup(B=B, T=T):
            params = jaxfox.attention_pool_init(jax.random.key(5), H, num_heads=4)
            hs, w = _normal(6, (B, T, H)), _normal(7, (H,))

            def builder():
                def op(params, hs):
                    def loss(p, x):
                        return jnp.sum(jaxfox.attention_pool(p, x)[0] * w)

                    return jax.value_and_grad(loss, argnums=(0, 1))(params, hs)

                return op

            return CaseSpec(builder, None, (params, hs), None, None)

        out.append(Variant("attention_pool", f"fwd+bwd B={B} T={T} H={H} ({B * T} rows)", setup,
                           params={"B": B, "T": T, "H": H}))
    return out
