"""The serve commands' door: a flag that cannot work, or a cache directory another server
owns, is a usage error naming it (exit status 2, no traceback), as a user meets it on the
command line; a cache directory given as ``~/...`` lies under the home directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.mlx

BAD_FLAGS = [
    (["--port", "99999"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--keepalive", "0"], "--keepalive"),
    (["--keepalive", "-5"], "--keepalive"),
    (["--keepalive", "nan"], "--keepalive"),
    (["--api-key", ""], "--api-key"),
]


@pytest.mark.parametrize(("flags", "name"), BAD_FLAGS, ids=lambda x: " ".join(x)
                         if isinstance(x, list) else x)
def test_a_flag_that_cannot_work_is_a_usage_error_naming_it(flags, name, capsys):
    from mlxcache import serve

    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "nowhere", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {name}" in err and "Traceback" not in err


def test_a_second_server_on_a_cache_dir_in_use_exits_naming_it(tmp_path):
    from mlxcache import Engine, zoo

    zoo.save_checkpoint("llama", tmp_path / "model")
    holder = Engine(zoo.make("llama"), num_slots=64, cache_dir=tmp_path / "cache")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mlxcache.serve", "--model", str(tmp_path / "model"),
             "--num-slots", "64", "--cache-dir", str(tmp_path / "cache"), "--port", "0"],
            capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert run.returncode == 2, run.stderr
    assert "is in use by another engine" in run.stderr and "Traceback" not in run.stderr


def test_a_cache_dir_under_home_is_expanded(tmp_path, monkeypatch):
    from mlxcache import Engine, zoo

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with Engine(zoo.make("llama"), num_slots=64, cache_dir="~/cache/model") as engine:
        engine.generate([[5, 6, 7]], 2)
    assert (tmp_path / "home" / "cache" / "model" / "index.sqlite").exists()
    assert not (tmp_path / "~").exists()
