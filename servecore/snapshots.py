"""Where a hybrid model's prefix cache takes state snapshots, and the host free list of
snapshot slots (plain Python: ``hybridattn`` and ``mlxcache`` plan with the same code).

A cached prefix of a hybrid model is two things: the attention K/V (MLA latents, in
``hybridattn``) of its tokens, valid at any depth (the row borrows their token slots), and
every recurrent layer's (KDA, Gated DeltaNet, Mamba, ...) conv and recurrent state,
valid only at the exact depth where it was taken. So the tree (``servecore.radix``,
``states=True``) maps tokens to token slots and some nodes to snapshot slots, and a match is
usable up to the deepest snapshot on it: a request restores that snapshot into its working
state slot (copy-on-write, inside the step) and recomputes the tokens after it; their latents
already sit in the borrowed slots, so those tokens write only to the sink.

Snapshot points, planned at admission (``snapshot_points``), each exact float32 state of the
kernel:

* a grid of ``interval`` tokens (a multiple of the KDA chunk, so a grid point is a chunk
  boundary of every prefill that starts on the grid, as cold prompts and grid hits do);
* the *branch point*: where the prompt leaves a cached path off the grid, so the next prompt
  that shares those tokens finds a state exactly there;
* one token before the end of the prompt, so an exact repeat recomputes only its last token
  (whose logits it needs);
* the end of the request (all tokens that ran), taken when it finishes, so the next turn of a
  conversation reuses prompt and answer.

Snapshot slots come from a host free list (``servecore.ids.IdPool``); the tree owns the handles it
holds and hands them back when it evicts states. Snapshots are best effort: when no slot is
free even after evicting unlocked states, a point is skipped (the cache is only less useful).

>>> points = snapshot_points(prompt_len=300, kv_len=140, state_len=128, interval=64)
>>> points  # grid 192 and 256, the branch point 140, and one before the end (299)
[140, 192, 256, 299]
"""

from __future__ import annotations

__all__ = ["snapshot_points"]


def snapshot_points(prompt_len: int, kv_len: int, state_len: int, interval: int) -> list[int]:
    """Depths at which a prompt of ``prompt_len`` tokens takes snapshots during its prefill,
    given its cache hit: ``kv_len`` tokens of KV matched, a state restored at ``state_len``
    (0: none). Grid points ``interval, 2 interval, ...`` past the restored state and before
    the prompt's last token; the branch point ``kv_len`` when it is off the grid and past
    the restored state; and ``prompt_len - 1`` (ascending, each once).

    >>> snapshot_points(prompt_len=10, kv_len=0, state_len=0, interval=4)
    [4, 8, 9]
    >>> snapshot_points(prompt_len=10, kv_len=10, state_len=9, interval=4)  # an exact repeat
    []
    """
    last = prompt_len - 1
    points = set(range((state_len // interval + 1) * interval, last, interval))
    if state_len < kv_len < last and kv_len % interval:
        points.add(kv_len)
    if last > state_len:
        points.add(last)
    return sorted(points)
