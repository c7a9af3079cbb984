"""Shared test setup and helpers.

* Forces 8 host (CPU) devices so shard_map tests can build 4- and 8-device meshes. This must
  happen before jax is imported anywhere, hence at the top of conftest.py; existing XLA_FLAGS
  are kept.
* ``np_cfc_scan`` / ``np_cfc_cell``: an independent float64 NumPy implementation of the CfC
  equations (OPS.md "CfC cell and scan", ncps ``CfCCell``), a plain loop over time. It shares no
  code with ``jaxfox.cfc``.
* ``rel_err``, ``random_cfc_params``, ``flat_grad_fd``: small helpers used by several test files.
* ``kernels_on`` (fixture), ``assert_leaves_close``, ``cuda_custom_calls``: kernel-vs-reference comparison of named leaves; the jaxfox FFI
  calls of a program's CUDA lowering.
* ``module_opt_in``: a module's opt-in kernels (``JAXFOX_OPT_IN_KERNELS``) for that module's tests only.
* ``JAXFOX_TEST_SHARD=i/n`` (environment): run only the collected tests whose index is i modulo n, so that n
  pytest processes split one compile-bound GPU test module between them (tools/gpu_visit.sh's ``ptest`` phase).
"""

from __future__ import annotations

import os


def _force_host_devices(n=8):
    """Appends --xla_force_host_platform_device_count=n to XLA_FLAGS, keeping every other flag
    (a count of at least n that is already there is kept as it is)."""
    key = "--xla_force_host_platform_device_count="
    kept = []
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(key):
            try:
                if int(flag[len(key):]) >= n:
                    return
            except ValueError:
                pass
            continue
        kept.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{key}{n}"])


_force_host_devices(8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("JAXFOX_TEST_SHARD")
    if not shard:
        return
    i, n = (int(v) for v in shard.split("/"))
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = items[i::n]


# ----------------------------------------------------------------------------------------------
# Float64 NumPy oracle of the CfC equations.
def _np_lecun_tanh(x):
    return 1.7159 * np.tanh(0.666 * x)


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def to_f64(params):
    """cfc_init-style params (jax or numpy leaves) -> the same structure of float64 numpy arrays."""
    out = {
        "backbone": [{"w": np.asarray(l["w"], np.float64), "b": np.asarray(l["b"], np.float64)}
                     for l in params["backbone"]],
        "heads_w": np.asarray(params["heads_w"], np.float64),
        "heads_b": np.asarray(params["heads_b"], np.float64),
    }
    for k in ("w_tau", "A"):
        if k in params:
            out[k] = np.asarray(params[k], np.float64)
    return out


def np_ts(ts, B, T):
    """ts as a scalar, [B] or [B, T] -> [B, T] float64."""
    ts = np.asarray(ts, np.float64)
    if ts.ndim == 1:
        ts = ts[:, None]
    return np.broadcast_to(ts, (B, T)).astype(np.float64)


def np_cfc_cell(p, h, x, ts, mode):
    """One CfC step in float64. p from to_f64; h [B, H], x [B, I], ts [B] -> [B, H]."""
    h = np.asarray(h, np.float64)
    x = np.asarray(x, np.float64)
    t = np.asarray(ts, np.float64).reshape(-1, 1)
    z = np.concatenate([x, h], axis=1)                    # z = [x_t, h_{t-1}]
    for layer in p["backbone"]:                            # Linear -> lecun_tanh, L times
        z = _np_lecun_tanh(z @ layer["w"] + layer["b"])
    H = h.shape[1]
    if mode == "pure":
        ff1 = z @ p["heads_w"] + p["heads_b"]              # the only head
        A, w_tau = p["A"], p["w_tau"]
        return -A * np.exp(-t * (np.abs(w_tau) + np.abs(ff1))) * ff1 + A
    heads = z @ p["heads_w"] + p["heads_b"]
    ff1 = np.tanh(heads[:, 0 * H:1 * H])
    ff2 = np.tanh(heads[:, 1 * H:2 * H])
    t_a = heads[:, 2 * H:3 * H]
    t_b = heads[:, 3 * H:4 * H]
    g = _np_sigmoid(t_a * t + t_b)
    if mode == "no_gate":
        return ff1 + g * ff2
    if mode == "default":
        return ff1 * (1.0 - g) + g * ff2
    raise ValueError(mode)


def np_cfc_scan(params, xs, ts=1.0, h0=None, mode="default"):
    """Float64 CfC scan: xs [B, T, I], ts scalar/[B]/[B, T], h0 [B, H] or None -> hs [B, T, H]."""
    p = to_f64(params)
    xs = np.asarray(xs, np.float64)
    B, T, _ = xs.shape
    H = p["heads_w"].shape[1] // (1 if mode == "pure" else 4)
    h = np.zeros((B, H)) if h0 is None else np.asarray(h0, np.float64)
    t = np_ts(ts, B, T)
    hs = np.empty((B, T, H))
    for k in range(T):
        h = np_cfc_cell(p, h, xs[:, k], t[:, k], mode)
        hs[:, k] = h
    return hs


# ----------------------------------------------------------------------------------------------
# Helpers.
def rel_err(a, b):
    """||a - b|| / ||b|| over all leaves (float64); 0 when both are exactly zero."""
    import jax

    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb):
        assert x.shape == y.shape, (x.shape, y.shape)
    a = np.concatenate(la) if la else np.zeros(0)
    b = np.concatenate(lb) if lb else np.zeros(0)
    num = np.linalg.norm(a - b)
    den = np.linalg.norm(b)
    if den == 0.0:
        return 0.0 if num == 0.0 else np.inf
    return float(num / den)


def random_cfc_params(key, I, H, U, L, mode, scale=0.3, seed=0):
    """cfc_init params plus a random perturbation of every leaf (so no value is trivially 0 / 1)."""
    import jax
    import jax.numpy as jnp

    from jaxfox import cfc_init

    params = cfc_init(key, I, H, backbone_units=U, backbone_layers=L, mode=mode)
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32), params)


def random_inputs(B, T, I, H, seed=0, ts_kind="per_step"):
    """xs [B, T, I], ts (per `ts_kind`: "scalar", "per_sample", "per_step"), h0 [B, H]; all float32 numpy."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((B, T, I)).astype(np.float32)
    h0 = (0.5 * rng.standard_normal((B, H))).astype(np.float32)
    if ts_kind == "scalar":
        ts = np.float32(0.7)
    elif ts_kind == "per_sample":
        ts = rng.uniform(0.1, 2.0, (B,)).astype(np.float32)
    else:
        ts = rng.uniform(0.1, 2.0, (B, T)).astype(np.float32)
    return xs, ts, h0


def central_diff_grad(f, x, eps=1e-6):
    """Float64 central-difference gradient of scalar f at float64 array x (same shape as x)."""
    x = np.array(x, np.float64)
    g = np.empty_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f(x)
        flat[i] = old - eps
        fm = f(x)
        flat[i] = old
        gf[i] = (fp - fm) / (2 * eps)
    return g


# ----------------------------------------------------------------------------------------------
# GPU tests: run a script in a child process under given XLA_FLAGS (command buffers on/off).
def assert_leaves_close(got, want, tol, tols=None):
    """``got`` and ``want`` are {name: array} with the same names; every ``got[name]`` has ``want[name]``'s shape,
    is finite and within :func:`rel_err` ``tols.get(name, tol)`` of it. Returns {name: rel_err}."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    errs = {}
    for k in want:
        assert np.shape(got[k]) == np.shape(want[k]), (k, np.shape(got[k]), np.shape(want[k]))
        assert np.isfinite(got[k]).all(), f"{k}: not finite"
        errs[k] = rel_err(got[k], want[k])
    limits = {k: (tols or {}).get(k, tol) for k in want}
    bad = {k: e for k, e in errs.items() if not e <= limits[k]}
    assert not bad, f"errors above tolerance: {bad} (all: {errs})"
    return errs


def cuda_custom_calls(f, *args):
    """{target: [the text after '@target(' on each call line]} of the jaxfox FFI calls in jit(f)'s CUDA lowering
    (traced and lowered on any machine; with ``jaxfox._ffi.kernels_available`` patched to True it shows the
    kernel path)."""
    import re

    import jax

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = {}
    for target, rest in re.findall(r"custom_call @(jaxfox_\w+)\((.*)", text):
        calls.setdefault(target, []).append(rest)
    return calls


@pytest.fixture
def kernels_on(monkeypatch):
    """jaxfox.kernels_available() as on a GPU machine with the extension: True unless inside use_reference(), so
    that the kernel path can be traced and lowered for CUDA (:func:`cuda_custom_calls`) on any machine."""
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: not jaxfox._ffi._reference_forced())


def module_opt_in(names):
    """A module-scoped autouse fixture that sets ``JAXFOX_OPT_IN_KERNELS=names`` for the tests of the module that
    binds it (``_opt_in = module_opt_in("all")``) and restores the previous value after them, so that one GPU
    module's opt-in kernels do not leak into the modules that pytest runs after it in the same process.
    Child processes started by those tests (:func:`run_child_npz`) inherit the setting."""
    @pytest.fixture(autouse=True, scope="module")
    def _opt_in():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JAXFOX_OPT_IN_KERNELS", names)
            yield

    return _opt_in


def run_child_npz(script, xla_flags, path, env=None):
    """Runs ``python -c script path`` with ``XLA_FLAGS=xla_flags`` (and the extra environment variables
    ``env``); the script saves arrays to ``path`` (an .npz) and prints DONE. Returns {name: array}."""
    import subprocess
    import sys

    import jaxfox

    env = {**os.environ, **(env or {})}
    env["XLA_FLAGS"] = xla_flags
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the parent process already holds most of the GPU memory
    env.pop("JAXFOX_DISABLE_KERNELS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxfox.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "DONE" in proc.stdout, \
        f"child with XLA_FLAGS={xla_flags!r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_command_buffers_identical(script, tmp_path):
    """Runs `script` (see :func:`run_child_npz`) with XLA command buffers off and on (every graph
    captured); every saved array must be finite and bitwise equal across the two, and repeated runs
    (keys ending in ``_run<i>``) equal to the first."""
    # Autotuning off in both: XLA times cuBLAS/fusion candidates in each process and may pick another
    # algorithm in the other child, whose last bits differ; that is not what this compares. (Suspected
    # cause of the attention test's intermittent B=256 loss mismatch, in 2 of 4 H200 runs; not yet
    # confirmed on the GPU.)
    off = run_child_npz(script, "--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0", tmp_path / "off.npz")
    on = run_child_npz(script, "--xla_gpu_graph_min_graph_size=1 --xla_gpu_autotune_level=0", tmp_path / "on.npz")
    assert off.keys() == on.keys() and len(off) > 0
    for k in off:
        assert np.isfinite(off[k]).all(), k
        assert np.array_equal(off[k], on[k]), f"{k}: command buffers on/off differ"
        if "_run" in k and not k.endswith("run0"):
            assert np.array_equal(on[k], on[k[:-1] + "0"]), f"{k}: differs from the first run"


def train_full_perception(reference, check_program, steps=30):
    """Trains jaxfox.models.perception (FULL_DEFAULTS) at B = 32, T = 64, m = 48 for ``steps`` train_steps over 8
    fixed random batches (label: the sign of the last step's first feature), under
    ``jax.default_matmul_precision("highest")`` and, with ``reference``, inside ``jaxfox.use_reference()``.
    ``check_program(text)`` gets the lowered train_step first. Returns (losses [steps], params before, params after),
    the params as {flat path: NumPy array} of the model's nnx.Param state."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxfox
    from jaxfox.models.perception import FULL_DEFAULTS, make_model, make_optimizer, train_step

    B, T, m = 32, 64, 48
    rng = np.random.default_rng(0)
    X = rng.standard_normal((8 * B, T, m)).astype(np.float32)
    Y = (X[:, -1, 0] > 0).astype(np.float32)
    model = make_model(m, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=FULL_DEFAULTS["lr"], weight_decay=FULL_DEFAULTS["weight_decay"])
    params = lambda: {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}  # noqa: E731
    before, losses = params(), []
    with jax.default_matmul_precision("highest"), jaxfox.use_reference() if reference else contextlib.nullcontext():
        check_program(train_step.lower(model, opt, jnp.asarray(X[:B]), jnp.asarray(Y[:B])).as_text())
        for it in range(steps):
            k = (it % 8) * B
            losses.append(float(train_step(model, opt, jnp.asarray(X[k:k + B]), jnp.asarray(Y[k:k + B]))))
    return np.array(losses), before, params()


def execute_notebook(name, tmp_path, monkeypatch, env=None):
    """Executes ``examples/<name>`` (committed without outputs) with nbclient, the repository first on
    PYTHONPATH and ``env`` set, in ``tmp_path``. Returns (notebook with outputs, all stream text).
    A failing cell (the notebooks assert their own values) raises CellExecutionError."""
    import pathlib

    import nbclient  # the `test` extra installs both; a missing one must fail, not skip
    import nbformat

    root = pathlib.Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "examples" / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return nb, text


U32 = 2.0 ** -24  # float32 unit roundoff


def assert_sum_close(got, x):
    """Any summation order of n float32 terms is within (n - 1) u sum|x| of the exact sum."""
    x64 = np.asarray(x, np.float64)
    want = x64.sum(axis=0)
    bound = max(x64.shape[0] - 1, 1) * U32 * np.abs(x64).sum(axis=0) * 1.01 + 1e-30
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"


def assert_raises_naming(fn, exc, *words):
    """``fn()`` raises ``exc`` whose message contains every one of ``words``."""
    import pytest

    with pytest.raises(exc) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def import_main_job():
    """examples/train_perception.py as a module (its ``main(argv)`` returns the metrics)."""
    import pathlib
    import sys

    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import train_perception
    finally:
        sys.path.remove(examples)
    return train_perception
