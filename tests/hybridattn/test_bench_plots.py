"""``python -m hybridattn.bench WHAT --from-json FILE --plot DIR`` draws each benchmark's saved
result (the runs in ``docs/bench/``, whose plots the benchmarks page shows) as a PNG, and still
prints its table."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("matplotlib")

from hybridattn.bench.cli import main  # noqa: E402

SAVED = pathlib.Path(__file__).resolve().parents[2] / "docs" / "bench"


@pytest.mark.parametrize("what", ["kda", "serve", "prefix"])
def test_a_saved_result_is_plotted_and_tabled(what, tmp_path, capsys):
    assert main([what, "--from-json", str(SAVED / f"{what}.json"),
                 "--plot", str(tmp_path)]) == 0
    png = tmp_path / f"{what}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    out, err = capsys.readouterr()
    assert f"wrote {png}" in err and "|" in out  # the table, as a measuring run prints it


def test_a_missing_json_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["kda", "--from-json", str(tmp_path / "none.json"), "--plot", str(tmp_path)])
    assert "none.json" in capsys.readouterr().err
