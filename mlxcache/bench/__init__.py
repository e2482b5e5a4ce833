"""Benchmark: prefix reuse, batched decode and pool writes on tiny random mlx-lm models.

``python -m mlxcache.bench [--json] [--quick]`` builds three float32 models from mlx-lm's own
classes (random weights, fixed seeds): a llama (plain ``KVCache``), a qwen3_next (hybrid:
gated-delta ``ArraysCache`` layers and a full-attention layer) and a gemma3_text (sliding
window ``RotatingKVCache`` layers of 128 tokens and a global layer), and, in one run, measures

(a) *shared prefix* (every model): 16 requests = one 512-token prefix + 16 unique tokens each;
(b) *branching* (llama): one system prompt, three few-shot blocks, a unique question each;
(m) *multi-turn* (every model): 8 conversations x 4 turns, each turn the previous prompt, its
    16-token greedy answer and a 32-token message;
    for each, prefill throughput (all prompt tokens / prefill time, the time from each turn's
    start to its last first token) and mean TTFT for mlxcache, the same engine with reuse off
    (the base of every speedup), and mlx-lm's ``LRUPromptCache`` driven as ``mlx_lm.server``
    drives it (fetch nearest, prefill the rest, insert prompt + answer; its clock runs only
    while it prefills); for models whose caches mlx-lm cannot trim (``ArraysCache``, a
    ``RotatingKVCache`` past its window) also the server's system-segment checkpoint (the
    cache inserted at the end of the shared prefix, as ``mlx_lm.server`` does at the end of
    a chat template's system segment). Beside each speedup, two ideals: the token ratio
    (prompt tokens / uncached tokens) and the measured one (no-reuse prefill time of the whole
    prompts over that of only their uncached parts, batched as mlxcache batches them);
(c) *batched decode* tokens/s against mlx-lm's ``BatchGenerator``: llama at B = 1, 8, 32,
    qwen3_next and gemma3_text at B = 8; each system runs the same prompts to two lengths,
    and the rate is the extra tokens over the extra wall time, so prompt processing and
    start-up cancel out;
(d) the cost of one ``set_kv`` writing 16 tokens into pools of 16k and 256k slots, used
    linearly (must not grow with the pool) and, for contrast, with the old pool still held.

Every system sees the same model, weights and prompts, in one process. Each table runs one
untimed round of every system (warm-up), then ``REPEATS`` rounds that visit every system in
turn, so a busy spell on a shared machine slows all of them alike; times are medians over the
rounds and ratios are medians of the per-round ratios (paired). ``--quick`` shrinks the
workloads for a smoke run.

``python -m mlxcache.bench server`` is apart (``mlxcache.bench.server``): the same kind of
workloads as chat requests over HTTP, ``python -m mlxcache.serve`` against ``mlx_lm.server``.

Example:
    $ python -m mlxcache.bench --quick
"""
