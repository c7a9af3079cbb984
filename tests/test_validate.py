"""jaxfox._validate.real_scalar: the one check of every real scalar hyperparameter (fused_adamw's, ema_update's tau,
per's alpha/beta and beta_schedule, cql_penalty's alpha, epsilon_greedy's epsilon)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfox
import jaxfox.nn
from jaxfox._validate import in_open_unit_float32, real_scalar


@pytest.mark.parametrize("value", [0.25, 1, np.float32(0.25), np.int64(1), np.asarray(0.25), jnp.float32(0.25),
                                   jnp.asarray(1, jnp.int32), jnp.bfloat16(0.25)])
def test_concrete_real_scalars_come_back_as_python_floats(value):
    got = real_scalar("x", value, 0.0, 1.0)
    assert type(got) is float and got == float(np.asarray(value, np.float64))


@pytest.mark.parametrize("kw,value,ok", [
    ({}, 0.0, True), ({"lo_open": True}, 0.0, False), ({}, 1.0, True), ({"hi_open": True}, 1.0, False),
    ({}, -1e-12, False), ({}, 1.0 + 1e-12, False), ({}, math.nan, False), ({}, math.inf, False),
])
def test_range_ends_open_and_closed(kw, value, ok):
    if ok:
        assert real_scalar("x", value, 0.0, 1.0, **kw) == value
    else:
        with pytest.raises(ValueError, match=r"^x must be finite and in [\[(]0, 1[\])], got"):
            real_scalar("x", value, 0.0, 1.0, **kw)


def test_unbounded_ends_and_message():
    assert real_scalar("x", -5.0) == -5.0
    with pytest.raises(ValueError, match=r"^lr must be finite and in \[0, inf\), got -1$"):
        real_scalar("lr", -1, 0.0)
    with pytest.raises(ValueError, match=r"^x must be finite and in \(-inf, inf\), got inf$"):
        real_scalar("x", float("inf"))
    with pytest.raises(ValueError, match=r"^x must be finite and in \[0, 0.9999999\], got 1.0$"):  # no rounding
        real_scalar("x", 1.0, 0, 0.9999999)
    with pytest.raises(ValueError, match=r"^x must be finite and in \[0, 1\], got 2.0$"):  # an array's value
        real_scalar("x", jnp.float32(2), 0, 1)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), jnp.asarray(True), np.asarray(False), "0.5", None,
                                   [0.5], jnp.asarray(0.5 + 1j), np.asarray("a")])
def test_bools_and_non_real_values_are_type_errors(value):
    with pytest.raises(TypeError, match="^x must be a real scalar"):
        real_scalar("x", value, 0.0, 1.0)


@pytest.mark.parametrize("value", [jnp.ones(2), np.zeros((1,)), jnp.zeros((1, 1))])
def test_non_scalar_arrays_are_value_errors_naming_the_shape(value):
    with pytest.raises(ValueError, match=rf"^x must be a scalar \(shape \[\]\), got shape {re_shape(value.shape)}$"):
        real_scalar("x", value, 0.0, 1.0)


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_traced_values_pass_unchecked_unless_refused():
    seen = []

    def f(v):
        got = real_scalar("x", v, 0.0, 1.0)
        seen.append(got is v)
        return got * 2

    assert float(jax.jit(f)(5.0)) == 10.0      # out of range, but not known at trace time: not checked
    assert seen == [True]
    with pytest.raises(TypeError, match="^x must be a concrete real scalar"):
        jax.jit(lambda v: real_scalar("x", v, traced=False))(0.5)
    with pytest.raises(TypeError, match="^x must be a real scalar, got a bool"):  # a traced bool is still refused
        jax.jit(lambda v: real_scalar("x", v))(True)


def test_subnormal_float32_constants_are_refused_because_xla_flushes_them():
    """The premise of refusing subnormal constants (positive_float32, in_open_unit_float32): XLA flushes them to
    zero, so a LayerNorm eps of 1e-44 gives NaN on a constant row, and an expectile of 1e-40 weighs u > 0 by 0."""
    from jaxfox._validate import positive_float32

    x = jnp.ones(4)
    ln = jax.jit(lambda x, e: (x - x.mean()) * jax.lax.rsqrt(((x - x.mean()) ** 2).mean() + e))
    assert np.isnan(np.asarray(ln(x, jnp.float32(1e-44)))).all()
    assert np.isfinite(np.asarray(ln(x, jnp.float32(np.finfo(np.float32).tiny)))).all()
    with pytest.raises(ValueError, match="^eps must be a positive finite normal float32"):
        positive_float32("eps", 1e-44)
    tiny = np.finfo(np.float32).tiny
    for ok in (0.5, tiny, [0.7, 0.9], 1 - 2.0 ** -24):
        assert in_open_unit_float32(ok), ok
    for bad in (1e-40, [0.7, 1e-40], 0.0, 1.0, 1 - 1e-9, 1e-50, float("nan"), -0.5):
        assert not in_open_unit_float32(bad), bad


def test_positive_float32_is_a_positive_real_that_float32_keeps():
    from jaxfox._validate import positive_float32

    tiny = float(np.finfo(np.float32).tiny)  # 2^-126
    for ok in (1e-5, 1, np.float32(3.0), jnp.float32(0.5), tiny, 3e38):
        assert positive_float32("eps", ok) == float(np.asarray(ok, np.float64))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^eps must be finite and in \(0, inf\)"):
            positive_float32("eps", bad)
    # 0 and inf in float32, where the statistics / the loss are computed, and subnormals there (flushed to 0)
    for bad in (1e-46, 1e39, 1e-44, float(np.nextafter(np.float32(tiny), np.float32(0)))):
        with pytest.raises(ValueError, match=r"^eps must be a positive finite normal float32"):
            positive_float32("eps", bad)
    for bad in (True, "1e-5", None):
        with pytest.raises(TypeError, match="^eps must be a real scalar"):
            positive_float32("eps", bad)
    with pytest.raises(TypeError, match="^kappa must be a concrete real scalar"):  # a constant of the computation
        jax.jit(lambda k: positive_float32("kappa", k))(1.0)


def test_a_python_int_beyond_float64_is_a_value_error_naming_the_argument():
    """np.asarray(10**400, np.float64) raised a bare OverflowError ("int too large to convert to float") naming no
    argument, from every real_scalar / positive_float32 check (Trading's cost_bps, fused_adamw's lr, ...)."""
    from jaxfox._validate import positive_float32

    with pytest.raises(ValueError, match=r"^lr must be finite and in \[0, inf\), got 1000"):
        real_scalar("lr", 10**400, 0.0)
    with pytest.raises(ValueError, match=r"^x must be finite and in \(-inf, inf\), got -1000"):
        real_scalar("x", -(10**400))
    with pytest.raises(ValueError, match=r"^eps must be finite and in \(0, inf\)"):
        positive_float32("eps", 10**400)
    assert real_scalar("x", 2**1000, 0.0) == math.ldexp(1.0, 1000)  # large but within float64: unchanged


def test_inits_refuse_a_parameter_dtype_their_op_rejects():
    """cfc_init / attention_pool_init / grn_init / vsn_init took dtype=bfloat16 and their op then refused the params
    ("params['heads_w'] must be float32"); an int dtype gave jax.random.uniform's message. Now the init raises."""
    import jaxfox

    k = jax.random.key(0)
    calls = {"cfc_init": lambda dt: jaxfox.cfc_init(k, 3, 4, dtype=dt),
             "attention_pool_init": lambda dt: jaxfox.attention_pool_init(k, 8, num_heads=2, dtype=dt),
             "grn_init": lambda dt: jaxfox.grn_init(k, 3, 4, 5, dtype=dt),
             "vsn_init": lambda dt: jaxfox.vsn_init(k, 2, 3, 4, 5, dtype=dt)}
    for name, call in calls.items():
        for dt in (jnp.bfloat16, jnp.int32, "not a dtype"):
            with pytest.raises(TypeError, match=rf"{name}: dtype must be float32"):
                call(dt)
        for dt in (jnp.float32, np.float32, "float32"):
            assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(call(dt)))



def _inits():
    from jaxfox.models.aux import attention_init, iql_init, iqn_init

    return [(jaxfox.cfc_init, (4, 6)), (jaxfox.grn_init, (4, 8, 4)), (jaxfox.vsn_init, (3, 2, 4, 4)),
            (jaxfox.attention_pool_init, (8,)), (jaxfox.iqn_head_init, (8,)), (iql_init, (4,)), (iqn_init, (4,)),
            (attention_init, (8,))]


def test_every_init_names_a_bad_key():
    """Every public *_init refuses an int seed, None, a float array and a batch of keys (typed or raw) with an error
    that names the function and its key (JAX's own said "invalid PRNG key data" / "split accepts a single key"), and
    still takes a typed key, a raw uint32 [2] key (the same draws) and a vmapped key (an ensemble)."""
    batches = (jax.random.split(jax.random.key(0), 2), jax.random.split(jax.random.PRNGKey(0), 2))
    for init, args in _inits():
        name = init.__name__
        for bad in (0, None, jnp.zeros(2)):
            with pytest.raises(TypeError, match=rf"^{name}: key must be a single jax\.random key .*got "):
                init(bad, *args)
        for bad in batches:
            with pytest.raises(ValueError, match=rf"^{name}: key must be a single jax\.random key \("):
                init(bad, *args)
        typed = init(jax.random.key(5), *args)
        raw = init(jax.random.key_data(jax.random.key(5)), *args)
        for a, b in zip(jax.tree.leaves(typed), jax.tree.leaves(raw), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        keys = jax.random.split(jax.random.key(1), 3)
        ens = jax.vmap(lambda k: init(k, *args))(keys)
        one = init(keys[2], *args)
        for a, b in zip(jax.tree.leaves(ens), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b))


def test_every_module_names_a_bad_rngs():
    """Every flax.nnx module of jaxfox refuses rngs=None or an int seed with a TypeError naming rngs (it was an
    AttributeError on rngs.params) and builds with an nnx.Rngs."""
    from flax import nnx

    from jaxfox.models import BranchingC51, Perception, PerceptionV0

    modules = [(jaxfox.nn.CfC, (4, 6), {"backbone_units": 8}), (jaxfox.nn.GRN, (4, 8, 4), {}),
               (jaxfox.nn.VSN, (3, 2, 4, 4), {}), (jaxfox.nn.AttentionPool, (8,), {}),
               (Perception, (6,), {"embed_dim": 2, "vsn_hidden": 4, "vsn_out": 4, "hidden": 4, "backbone_units": 8,
                                   "num_heads": 2}),
               (PerceptionV0, (6,), {"hidden": 8, "embed_dim": 2, "backbone_units": 16}),
               (BranchingC51, (6, 2, 3, 5, (8, 8)), {})]
    for cls, args, kw in modules:
        for bad in (None, 0):
            with pytest.raises(TypeError, match=r"^rngs must be an nnx\.Rngs .*got " + type(bad).__name__):
                cls(*args, **kw, rngs=bad)
        assert isinstance(cls(*args, **kw, rngs=nnx.Rngs(0)), nnx.Module)
