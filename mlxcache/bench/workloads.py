"""The benchmark's models (tiny random float32 mlx-lm models) and workloads (shared
prefix, branching, multi-turn prompts)."""

from __future__ import annotations

import random
from collections.abc import Callable

from mlxcache import zoo
from mlxcache.engine import Engine
from mlxcache.zoo import make_model  # the llama

VOCAB = 1000  # every model's vocabulary, make_model's included
REPEATS = 5
WINDOW = 128
"""gemma3_text's sliding window: shorter than the 512-token shared prefix."""


def make_hybrid(seed: int = 0):
    """qwen3_next, hidden 128, 4 layers (3 gated delta + 1 full attention), MoE, f32."""
    return zoo.make(
        "qwen3_next", seed, hidden_size=128, num_hidden_layers=4, full_attention_interval=4,
        intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
        shared_expert_intermediate_size=128, moe_intermediate_size=64, vocab_size=VOCAB,
    )


def make_sliding(seed: int = 0):
    """gemma3_text, hidden 128, 4 layers (3 sliding of ``WINDOW`` tokens + 1 global), f32."""
    return zoo.make(
        "gemma3_text", seed, hidden_size=128, num_hidden_layers=4, sliding_window_pattern=4,
        sliding_window=WINDOW, intermediate_size=256, head_dim=32, query_pre_attn_scalar=32,
        vocab_size=VOCAB,
    )


MODELS: dict[str, tuple[Callable[[], object], str]] = {
    "llama": (make_model, "llama hidden=128 layers=2 heads=4 kv_heads=2 vocab=1000 float32"),
    "qwen3_next": (make_hybrid, "qwen3_next hidden=128 layers=4 (3 gated delta + 1 attention) "
                                "MoE 4 experts vocab=1000 float32"),
    "gemma3_text": (make_sliding, f"gemma3_text hidden=128 layers=4 (3 sliding window={WINDOW} "
                                  f"+ 1 global) vocab=1000 float32"),
}


# ---------------------------------------------------------------------------- workloads ----


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def shared_prefix(rng: random.Random, n_req: int, prefix: int, unique: int) -> list[list[int]]:
    head = random_tokens(rng, prefix)
    return [head + random_tokens(rng, unique) for _ in range(n_req)]


def branching(
    rng: random.Random, n_req: int, system: int, shots: int, shot_len: int, question: int
) -> list[list[int]]:
    sys_prompt = random_tokens(rng, system)
    blocks = [random_tokens(rng, shot_len) for _ in range(shots)]
    return [sys_prompt + blocks[i % shots] + random_tokens(rng, question) for i in range(n_req)]


def multi_turn(
    rng: random.Random, engine: Engine, n_conv: int, turns: int, first: int, msg: int, new: int
) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """``(rounds, uncached)``: turn 0 opens each conversation with ``first`` tokens; turn k is
    the turn k-1 prompt + its ``new``-token greedy answer (from ``engine``, without reuse) +
    a ``msg``-token message. ``uncached`` is what a prefix cache cannot supply: turn 0 whole,
    then the answer's last token (it never ran) and the message."""
    rounds = [[random_tokens(rng, first) for _ in range(n_conv)]]
    uncached = [rounds[0]]
    for _ in range(1, turns):
        answers = engine.generate(rounds[-1], max_tokens=new)
        msgs = [random_tokens(rng, msg) for _ in range(n_conv)]
        rounds.append([p + a + m for p, a, m in zip(rounds[-1], answers, msgs, strict=True)])
        uncached.append([a[-1:] + m for a, m in zip(answers, msgs, strict=True)])
    return rounds, uncached


def unique_tokens(prompts: list[list[int]]) -> int:
    """Distinct prefixes over all prompts: what an ideal prefix cache computes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


# ------------------------------------------------------------------------------ systems ----
