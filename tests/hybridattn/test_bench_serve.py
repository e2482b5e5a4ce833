"""``bench serve``'s columns of where our step's time goes, on a 2-layer model: per-step host,
exposed host, wait and device medians, compile seconds per bucket, compile seconds against
the layer count and the small-prefill ratio, in the JSON and in the table with the bandwidth
and compute floors and the products-alone step (the anchors and the long runs live in the
bench itself)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hybridattn.bench import anchors as A
from hybridattn.bench import compile_time, serve
from hybridattn.bench.cli import main
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear

CFG = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)


def test_serve_reports_host_device_and_compile_seconds_and_prints_them(capsys):
    params = kimi_linear.init_params(CFG, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 8))
    ours = serve._ours_serve(CFG, params, prompts, new_tokens=3, repeats=1, device_rounds=2)
    steps = ours["per_step"]
    assert set(steps) == {"prefill", "decode"}
    assert steps["prefill"]["steps"] == 1 and steps["decode"]["steps"] == 2
    for e in steps.values():
        assert all(e[k] > 0 for k in ("step_s", "host_s", "wait_s", "device_s"))
        assert 0 <= e["exposed_s"] <= e["host_s"]
    assert steps["prefill"]["exposed_s"] == steps["prefill"]["host_s"]  # never overlapped
    assert {(b["mode"], b["requests"], b["tokens"]) for b in ours["bucket_compile_s"]} == {
        ("extend", 2, 18), ("decode", 2, 2)}
    assert sum(b["s"] for b in ours["bucket_compile_s"]) == pytest.approx(ours["compile_s"])

    # one bucket holds both prompts here: a single compile, and about equal costs
    small = serve._small_prefill(CFG, params, small=4, large=16, rounds=1)
    assert small["token_buckets"][0] == 16 and len(small["bucket_compile_s"]) == 1
    assert small["large_over_small"] == pytest.approx(small["large_s"] / small["small_s"])
    assert small["large_over_small_products"] == pytest.approx(
        small["large_s"] / small["small_products_s"])

    layers = compile_time.compile_vs_layers([2])
    row = layers[0]
    assert row["kda_layers"] == row["mla_layers"] == 1 and row["compiled_layers"] == 2
    for v in (row["unrolled"], row["scanned"]):
        assert v["total_s"] == pytest.approx(v["prefill"]["s"] + v["decode"]["s"])

    ours.pop("tokens")
    flops = A.decode_flops_per_step(CFG, 2, 10)["total"]
    nbytes = A.decode_bytes_per_step(CFG, 2, 10)["total"]
    row = dict(batch_size=2, ours=ours, decode_floor_s=nbytes / 20e9, decode_floor_bytes=nbytes,
               decode_compute_floor_s=flops / 100e9, decode_flops=flops,
               decode_products_s=A.products_step_seconds(CFG, 2, rounds=2))
    serve.print_serve(dict(config=CFG.to_dict(), prompt_len=8, new_tokens=3, bandwidth_gbs=20.0,
                           peak_gflops=100.0, transformers="not requested", rows=[row],
                           small_prefill=small, compile_vs_layers=layers))
    out = capsys.readouterr().out
    assert "matmul peak 100 GFLOP/s" in out and "of the bandwidth bound" in out
    assert f"of the compute bound ({flops / 1e6:.0f} MFLOP/step" in out
    assert "exposed" in out and "extend 2x18x64x18" in out and "decode 2x2x64x1" in out
    assert "costs 1/" in out and "target 1/25" in out
    assert "products |" in out and "matrix products alone of 4 tokens" in out
    assert "     2 |   1+1   |        2 |" in out and "scanned/unrolled" in out


def test_compile_layers_below_two_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--compile-layers", "4", "1"])
    assert "--compile-layers 4 1: each must be at least 2" in capsys.readouterr().err
