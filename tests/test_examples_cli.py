"""examples/_cli.py: the example scripts' shared argument checks (CPU, no JAX needed)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cli():
    spec = importlib.util.spec_from_file_location("_cli", ROOT / "examples" / "_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _error(capsys, fn):
    with pytest.raises(SystemExit) as e:
        fn()
    return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_check_output_folder(tmp_path, capsys):
    cli, p = _cli(), argparse.ArgumentParser(prog="prog")
    # a folder that does not exist yet is accepted and NOT created (the script creates it when it saves)
    new = tmp_path / "a" / "b"
    assert cli.check_output_folder(p, str(new)) == str(new)
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # the probe file is gone too
    assert cli.check_output_folder(p, str(tmp_path)) == str(tmp_path)
    # a path through a file: the scripts' os.makedirs raised FileExistsError / NotADirectoryError after JAX started
    f = tmp_path / "file"
    f.write_text("x")
    for bad in (f, f / "sub"):
        code, err = _error(capsys, lambda: cli.check_output_folder(p, str(bad)))
        assert code == 2 and err == f"prog: error: --out {str(bad)!r}: {f} exists and is not a folder", err
    # a folder where no file can be created (root may write anywhere by permissions, so a pseudo file system):
    # the scripts trained fully and then failed in savefig / open(metrics.json)
    if os.path.isdir("/proc"):
        code, err = _error(capsys, lambda: cli.check_output_folder(p, "/proc/run", flag="--dir"))
        assert code == 2 and err.startswith("prog: error: --dir '/proc/run': cannot write files in /proc ("), err


def test_check_finite(capsys):
    cli, p = _cli(), argparse.ArgumentParser(prog="prog")
    ns = argparse.Namespace(lr=1e-3, v_max=0.0, gamma=float("inf"), eps=float("nan"), zero=0.0)
    cli.check_finite(p, ns, ("lr", "zero"), low=0)
    for names, strict, want in ((("v_max",), True, "--v-max must be a finite number > 0, got 0.0"),
                                (("lr", "gamma"), False, "--gamma must be a finite number >= 0, got inf"),
                                (("eps",), False, "--eps must be a finite number >= 0, got nan")):
        code, err = _error(capsys, lambda: cli.check_finite(p, ns, names, low=0, strict=strict))
        assert code == 2 and err == f"prog: error: {want}", err


def test_usage_error(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/train_thing.py"])
    code, err = _error(capsys, lambda: _cli().usage_error("--window 5: too long"))
    assert code == 2 and err == "train_thing.py: error: --window 5: too long"
