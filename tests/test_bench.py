"""Smoke test of the benchmark harness (``python -m jaxfox.bench``): it runs end to end on CPU and
writes well-formed JSON. No timing assertions (speed targets are measured on the H200, not tested)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
