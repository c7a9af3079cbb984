"""Smoke test of the benchmark harness (``python -m jaxfox.bench``): it runs end to end on CPU and
writes well-formed JSON. No timing assertions (speed targets are measured on the H200, not tested)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_small_cpu_json(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxfox.bench", "--shapes", "small", "--ops", "reduce_axis0,cfc_scan",
         "--repeats", "3", "--min-call-ms", "2", "--json", str(out), "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())

    env_info = data["environment"]
    assert env_info["kernels_available"] is False        # JAX_PLATFORMS=cpu: reference path only
    assert env_info["kernels_unavailable_reason"]
    assert data["skipped"] == []

    rows = data["rows"]
    # 3 reduce_axis0 shapes + cfc_scan fwd+bwd and fwd.
    assert [r["case"] for r in rows] == ["reduce_axis0"] * 3 + ["cfc_scan"] * 2
    assert {r["shape"] for r in rows if r["case"] == "reduce_axis0"} == {
        "[32, 65536]", "[256, 1024]", "[1024, 64]"}
    for r in rows:
        for path in ("reference", "jaxfox"):
            p = r[path]
            assert p["n_inner"] >= 1
            assert len(p["times_per_iter_s"]) == 3
            for t in (p["median_s"], p["min_s"], *p["times_per_iter_s"]):
                assert math.isfinite(t) and t > 0, (r["case"], r["shape"], path, t)
            assert p["min_s"] <= p["median_s"] <= p["max_s"]
            assert p["ffi_calls"] == 0                    # no CUDA: no jaxfox FFI call compiled in
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0
        if r["case"] == "reduce_axis0":
            B, P = r["params"]["B"], r["params"]["P"]
            assert r["bytes"] == 4 * (B * P + P)
            assert r["jaxfox"]["gbps"] == pytest.approx(r["bytes"] / r["jaxfox"]["median_s"] / 1e9)
        else:
            assert r["flops"] > 0 and r["jaxfox"]["gflops"] > 0
    # The table went to stdout.
    assert "speed-up" in proc.stdout and "cfc_scan" in proc.stdout


def test_bench_rejects_unknown_case():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "jaxfox.bench", "--ops", "no_such_op"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no_such_op" in proc.stderr


def _bench_variants():
    from jaxfox.bench import REGISTRY
    import jaxfox.bench.cases  # noqa: F401  (registers the cases)

    return [(name, i) for name in sorted(REGISTRY) for i in range(len(REGISTRY[name]("small")))]


@pytest.mark.parametrize("name,index", _bench_variants())
def test_bench_case_kernel_path_lowers_for_cuda(name, index, monkeypatch):
    """Every bench row's jaxfox path, with every opt-in kernel on, traces and lowers for CUDA here (the kernels
    made available by monkeypatching), so a typing error on the kernel path of a row shows up on this machine,
    not in a GPU visit's budget. Rows that run the reference only have no custom calls to check."""
    import jaxfox._ffi
    from jaxfox.bench import REGISTRY, SkipCase, _make_loop

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "all")
    variant = REGISTRY[name]("small")[index]
    try:
        spec = variant.setup()
    except SkipCase as e:
        pytest.skip(f"{variant.label}: {e}")
    loop = _make_loop(spec.kernel_builder(), 1, 1, variant.stateful)
    text = jax.jit(loop).trace(*spec.inputs).lower(lowering_platforms=("cuda",)).as_text()
    xla_only = (variant.reference_only or name in _XLA_ROWS or variant.label.startswith(_XLA_SMALL.get(name, ()))
                or (name in _OPT_IN_ROWS and not variant.label.endswith(_OPT_IN_ROWS[name])))
    assert ("custom_call @jaxfox_" in text) != xla_only, (name, variant.label)


# rows whose jaxfox path is XLA by design (no jaxfox kernel for that op), and rows whose small shapes are outside
# their kernels' limits (the IQN head's minimum width; lowered with kernels at the default shapes on the H200)
_XLA_ROWS = ("ema_update", "cast_bf16")
_XLA_SMALL = {"aux_step": ("iqn",)}
# ops whose default path is XLA and whose kernels have rows of their own (labels ending so), traced opted in
_OPT_IN_ROWS = {"attention_pool": "kernel (opt-in)"}


def test_opt_in_names_unknown_are_ignored_with_a_warning(monkeypatch):
    """JAXFOX_OPT_IN_KERNELS decides which opt-in kernels a trace uses: a misspelt name was ignored silently."""
    from jaxfox import _ffi

    monkeypatch.setattr(_ffi, "_warned_unknown", set())
    monkeypatch.setenv(_ffi.OPT_IN_ENV, " grn , iqll,")
    with pytest.warns(UserWarning, match=r"names \['iqll'\], which are not opt-in kernels"):
        assert _ffi.kernel_opted_in("grn") is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per distinct set of unknown names
        assert _ffi.kernel_opted_in("adamw") is False
    monkeypatch.setenv(_ffi.OPT_IN_ENV, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(_ffi.kernel_opted_in(op) for op in _ffi.OPT_IN)
    with pytest.raises(ValueError, match="op must be one of"):
        _ffi.kernel_opted_in("iqll")


def _cpu_loop_hlo(op, stateful, unroll, *inputs):
    from jaxfox.bench import _make_loop

    return jax.jit(_make_loop(op, None, unroll, stateful)).lower(np.int32(2), *inputs).compile().as_text()


@pytest.mark.parametrize("unroll", [1, 4])
def test_bench_loop_keeps_every_unrolled_op_call_whole(unroll):
    """With unroll > 1 (reduce_axis0's rows, or --unroll), only the last op call's outputs were carried: the others
    were read only through the one element of the opaque zero, and XLA removed the rest of their work (e.g. the whole
    backward of a value_and_grad op, whose first output is the loss). Here the backward's cosine (of sin's VJP) and a
    stateful step's cos output must appear once per op call in the compiled loop."""
    x = jnp.linspace(0.0, 1.0, 4096, dtype=jnp.float32).reshape(64, 64)
    w = jnp.linspace(1.0, 2.0, 64, dtype=jnp.float32)

    def op(x, w):
        return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) * w))(x)

    def step(state, x):
        return state * 0.5 + jnp.sum(x), (jnp.sum(state), jnp.cos(x))

    assert _cpu_loop_hlo(op, False, unroll, x, w).count(" cosine(") == unroll
    assert _cpu_loop_hlo(step, True, unroll, jnp.float32(1.0), x).count(" cosine(") == unroll


def _ops_outside_loops(hlo_text: str, opcode: str) -> int:
    """Instructions of ``opcode`` in the compiled program outside every while loop's body and condition."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo_text):
        m = re.match(r"(ENTRY )?%(\S+)", block)
        if m:
            comps["ENTRY" if m.group(1) else m.group(2)] = block
    seen, todo, n = set(), ["ENTRY"], 0
    while todo:
        lines = comps.get(todo.pop(), "").splitlines()[1:]
        n += sum(f" {opcode}(" in line for line in lines)
        for line in lines:
            if " while(" in line:
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return n


def test_bench_loop_draws_random_numbers_every_op_call():
    """A PRNG key input was not perturbed, so random draws from it were loop-invariant and XLA hoisted them out of
    the timed loop (per_sample's stratified draws). The draws must stay inside the loop and keep their values."""
    key = jax.random.key(3)
    x = jnp.ones((64, 64), jnp.float32)

    def op(x, key):
        return x + jax.random.uniform(key, (64, 64))

    text = _cpu_loop_hlo(op, False, 1, x, key)
    assert " xor(" in text and _ops_outside_loops(text, "xor") == 0
    from jaxfox.bench import _make_loop

    (x_out, key_out), (y,) = jax.jit(_make_loop(op, None, 1, False))(np.int32(3), x, key)
    np.testing.assert_array_equal(jax.random.key_data(key_out), jax.random.key_data(key))
    np.testing.assert_array_equal(y, np.ones((64, 64), np.float32) + np.asarray(jax.random.uniform(key, (64, 64))))


@pytest.mark.parametrize("name", ["per_sample", "dqn_step_dp"])
def test_bench_case_random_draws_stay_in_the_loop(name):
    """per_sample (key input) and dqn_step_dp (a constant key inside the step) had their PER draws hoisted out of the
    timed loop on both paths: the threefry hash (xor) must run inside the loop only."""
    from jaxfox import use_reference
    from jaxfox.bench import REGISTRY

    variant = REGISTRY[name]("small")[0]
    spec = variant.setup()
    with use_reference():
        op = (spec.reference_builder or spec.kernel_builder)()
        text = _cpu_loop_hlo(op, variant.stateful, 1, *spec.inputs)
    assert " xor(" in text
    assert _ops_outside_loops(text, "xor") == 0


@pytest.mark.parametrize("argv,message", [
    (["--ops", ","], "--ops: no case named"),
    (["--ops", " "], "--ops: no case named"),
    (["--min-call-ms", "nan"], "--min-call-ms must be a finite number > 0"),
    (["--min-call-ms", "inf"], "--min-call-ms must be a finite number > 0"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--shapes", "huge"], "invalid choice: 'huge'"),
    # n_inner is an int32 trip count (10^11 failed a row with an OverflowError after 78 s), and unroll op calls
    # a trip made --max-inner below --unroll no bound
    (["--max-inner", str(2**31)], "--max-inner must be in [1, 2^31 - 1]"),
    (["--max-inner", "3", "--unroll", "8"], "--unroll must be in [1, --max-inner (3)]"),
    # output paths failed only after every case had run (a folder, a path through a file), and the plot
    # silently replaced the JSON of the same name or was written to name.png while "wrote name" was printed
    (["--json", "/"], "--json '/': is a folder; name a file"),
    (["--json", __file__ + "/x.json"], "exists and is not a folder"),
    (["--plot", "/proc/x.png"], "--plot '/proc/x.png': cannot write files in /proc"),
    (["--plot", "chart"], "--plot must name a .png file"),
    (["--json", "same.png", "--plot", "same.png"], "--json and --plot name the same file"),
])
def test_bench_cli_rejects_bad_arguments(argv, message, capsys):
    """An empty --ops ran nothing and exited 0 (an empty table from a GPU visit); a non-finite --min-call-ms failed
    every case later with an OverflowError / ValueError from the calibration."""
    from jaxfox.bench.__main__ import _parse

    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_cli_runs_a_case_named_twice_once():
    from jaxfox.bench.__main__ import _parse

    assert _parse(["--ops", "copy,cfc_scan,copy"]).ops == ["copy", "cfc_scan"]
