"""The support table (README and docs) is what the engine does, family by family; a cache kind
the engine cannot restore is named, never served from stale state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache  # noqa: E402

from mlxcache import zoo  # noqa: E402
from mlxcache.layers import describe  # noqa: E402

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parents[2]


def _table(path: Path) -> list[tuple[str, ...]]:
    text = path.read_text()
    block = re.search(r"<!-- support-table -->\n(.*?)<!-- /support-table -->", text, re.S)
    assert block, f"{path} has no support table"
    lines = block.group(1).strip().splitlines()[2:]  # past the header and the rule
    return [tuple(cell.strip() for cell in line.strip("|").split(" | ")) for line in lines]


@pytest.fixture(scope="module")
def measured():
    return zoo.support_table()


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_the_support_table_is_what_the_engine_does(doc, measured):
    assert _table(ROOT / doc) == measured


def test_every_listed_family_is_served_with_reuse_and_batching(measured):
    by_family = {row[0]: row for row in measured}
    for family in ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "kimi_linear", "falcon_h1",
                   "gemma3_text", "gpt_oss", "llama"]:
        assert by_family[family][2:4] == ("yes", "yes"), by_family[family]


def test_caches_without_a_ragged_form_are_named():
    layout = describe([KVCache(), ChunkedKVCache(8), QuantizedKVCache()])
    assert layout.unsupported == ("ChunkedKVCache", "QuantizedKVCache")


def test_the_kv_bits_column_quantizes_what_mlx_lm_can(measured):
    """Every full-attention layer of the families whose attention is mlx-lm's own (through
    ``scaled_dot_product_attention``) is quantized; sliding windows, sinks (gpt-oss) and
    attentions of their own (kimi_linear's MLA) are named."""
    by_family = {row[0]: row[4] for row in measured}
    for family in ["llama", "qwen3_next", "falcon_h1", "jamba"]:
        assert by_family[family].startswith(("1 of 1", "2 of 2")), by_family[family]
    assert "sliding window" in by_family["gemma3_text"]
    assert "refuses quantized K/V" in by_family["gpt_oss"]
    assert "refuses quantized K/V" in by_family["kimi_linear"]
