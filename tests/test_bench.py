"""Smoke test of the benchmark harness (``python -m jaxfox.bench``): it runs end to end on CPU and
writes well-formed JSON. No timing assertions (speed targets are measured on the H200, not tested)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
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
    xla_only = variant.reference_only or name in _XLA_ROWS or variant.label.startswith(_XLA_SMALL.get(name, ()))
    assert ("custom_call @jaxfox_" in text) != xla_only, (name, variant.label)


# rows whose jaxfox path is XLA by design (no jaxfox kernel for that op), and rows whose small shapes are outside
# their kernels' limits (the IQL kernel's and the IQN head's minimum widths; lowered with kernels at the default
# shapes on the H200)
_XLA_ROWS = ("ema_update", "cast_bf16")
_XLA_SMALL = {"iql_pair": ("fwd+bwd",), "aux_step": ("iql_pair", "iqn")}


def test_opt_in_names_unknown_are_ignored_with_a_warning(monkeypatch):
    """JAXFOX_OPT_IN_KERNELS decides which opt-in kernels a trace uses: a misspelt name was ignored silently."""
    from jaxfox import _ffi

    monkeypatch.setattr(_ffi, "_warned_unknown", set())
    monkeypatch.setenv(_ffi.OPT_IN_ENV, " grn , iqll,")
    with pytest.warns(UserWarning, match=r"names \['iqll'\], which are not opt-in kernels"):
        assert _ffi.kernel_opted_in("grn") is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per distinct set of unknown names
        assert _ffi.kernel_opted_in("iql") is False
    monkeypatch.setenv(_ffi.OPT_IN_ENV, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(_ffi.kernel_opted_in(op) for op in _ffi.OPT_IN)
    with pytest.raises(ValueError, match="op must be one of"):
        _ffi.kernel_opted_in("iqll")
