"""KV pool and slot allocator: round trips, the padding sink, errors, purity, mx.compile."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

mx = pytest.importorskip("mlx.core")

from mlxcache.pool import (  # noqa: E402
    POOL_NAME,
    KVPool,
    PoolExhausted,
    alloc,
    bytes_per_token_slot,
    free,
    get_kv,
    init_allocator,
    init_pool,
    set_kv,
    set_kv_all_layers,
)

pytestmark = pytest.mark.mlx


def rand(shape, seed=0, dtype=np.float32) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def snapshot(pool: KVPool) -> list[np.ndarray]:
    return [np.array(a) for a in pool.keys + pool.values]


def assert_same(pool: KVPool, snap: list[np.ndarray]) -> None:
    for a, b in zip(pool.keys + pool.values, snap, strict=True):
        np.testing.assert_array_equal(np.array(a), b)


# ------------------------------------------------------------------------------------ pool --


def test_init_pool_shapes_and_sizes():
    pool = init_pool(num_layers=3, num_slots=10, n_kv_heads=2, head_dim=4, dtype=mx.bfloat16)
    assert (pool.num_layers, pool.num_slots, pool.n_kv_heads, pool.head_dim) == (3, 10, 2, 4)
    assert pool.dtype == mx.bfloat16
    assert all(a.shape == (10, 2, 4) for a in pool.keys + pool.values)
    assert pool.bytes_per_slot == bytes_per_token_slot(3, 2, 4, mx.bfloat16) == 2 * 3 * 2 * 4 * 2
    assert pool.nbytes == pool.bytes_per_slot * pool.num_slots


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(num_layers=0, num_slots=4, n_kv_heads=1, head_dim=2), "num_layers.*0"),
        (dict(num_layers=1, num_slots=1, n_kv_heads=1, head_dim=2), "num_slots=1.*padding"),
        (dict(num_layers=1, num_slots=4, n_kv_heads=0, head_dim=2), "n_kv_heads.*0"),
        (dict(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=-3), "head_dim.*-3"),
    ],
)
def test_init_pool_rejects_bad_sizes(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        init_pool(**kwargs)


def test_set_get_round_trip_both_layouts():
    pool = init_pool(num_layers=2, num_slots=8, n_kv_heads=2, head_dim=4, dtype=mx.float32)
    k, v = rand((3, 2, 4), 1), rand((3, 2, 4), 2)
    slots = mx.array([5, 1, 7], dtype=mx.int32)
    pool = set_kv(pool, 1, slots, k, v)
    k2, v2 = get_kv(pool, 1, slots)
    np.testing.assert_array_equal(np.array(k2), np.array(k))
    np.testing.assert_array_equal(np.array(v2), np.array(v))
    assert not np.array(pool.keys[0]).any()  # other layer untouched
    mlx_lm_k = k.swapaxes(0, 1)[None]  # [1, n_kv_heads, T, head_dim]
    mlx_lm_v = v.swapaxes(0, 1)[None]
    other = set_kv(init_pool(2, 8, 2, 4, mx.float32), 1, slots, mlx_lm_k, mlx_lm_v)
    assert_same(other, snapshot(pool))


def test_set_kv_casts_to_pool_dtype_and_accepts_list_slots():
    pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=2)
    pool = set_kv(pool, 0, [3], mx.ones((1, 1, 2), dtype=mx.float32), mx.ones((1, 1, 2)))
    assert pool.keys[0].dtype == mx.float16
    assert get_kv(pool, 0, [3])[0].tolist() == [[[1.0, 1.0]]]


def test_set_kv_all_layers_matches_per_layer_writes():
    pool = init_pool(num_layers=3, num_slots=6, n_kv_heads=1, head_dim=3, dtype=mx.float32)
    slots = mx.array([4, 2], dtype=mx.int32)
    ks = [rand((2, 1, 3), i) for i in range(3)]
    vs = [rand((1, 1, 2, 3), 10 + i) for i in range(3)]
    expected = pool
    for layer in range(3):
        expected = set_kv(expected, layer, slots, ks[layer], vs[layer])
    assert_same(set_kv_all_layers(pool, slots, ks, vs), snapshot(expected))


@pytest.mark.parametrize("slots", [[2, 3, 4], np.array([3, 4, 5]), [5], [4, 3, 2], [1, 2, 4]])
def test_host_slots_in_one_run_write_as_a_scatter_does(slots):
    """Host slots in one ascending run take a slice write; any other order a scatter: both
    write what per-layer scatters of device slots write."""
    pool = init_pool(num_layers=2, num_slots=6, n_kv_heads=1, head_dim=3, dtype=mx.float32)
    pool = set_kv_all_layers(pool, list(range(6)), [rand((6, 1, 3), i) for i in range(2)],
                             [rand((6, 1, 3), 5 + i) for i in range(2)])
    ks = [rand((len(slots), 1, 3), 20 + i) for i in range(2)]
    vs = [rand((len(slots), 1, 3), 30 + i) for i in range(2)]
    expected, device = pool, mx.array([int(s) for s in slots], dtype=mx.int32)
    for layer in range(2):
        expected = set_kv(expected, layer, device, ks[layer], vs[layer])
    assert_same(set_kv_all_layers(pool, slots, ks, vs), snapshot(expected))


def test_padding_sink_rows_never_touch_live_slots():
    pool = init_pool(num_layers=1, num_slots=6, n_kv_heads=1, head_dim=2, dtype=mx.float32)
    live = mx.array([1, 2, 3, 4, 5], dtype=mx.int32)
    pool = set_kv(pool, 0, live, rand((5, 1, 2), 1), rand((5, 1, 2), 2))
    before = np.array(pool.keys[0])
    padded = mx.array([0, 3, 0, 0], dtype=mx.int32)  # one real row, three padded rows
    k = rand((4, 1, 2), 3)
    pool = set_kv(pool, 0, padded, k, k)
    after = np.array(pool.keys[0])
    np.testing.assert_array_equal(after[3], np.array(k)[1])
    np.testing.assert_array_equal(after[[1, 2, 4, 5]], before[[1, 2, 4, 5]])


def test_empty_write_is_a_no_op():
    pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=2)
    empty = mx.zeros((0, 1, 2))
    out = set_kv(pool, 0, mx.zeros((0,), dtype=mx.int32), empty, empty)
    assert_same(out, snapshot(pool))


def test_bad_layer_and_shapes_name_the_value():
    pool = init_pool(num_layers=2, num_slots=4, n_kv_heads=2, head_dim=3)
    kv = mx.zeros((1, 2, 3))
    slots = mx.array([1], dtype=mx.int32)
    with pytest.raises(ValueError, match=r"layer=2 must be an int in \[0, 2\)"):
        set_kv(pool, 2, slots, kv, kv)
    with pytest.raises(ValueError, match="layer=-1"):
        get_kv(pool, -1, slots)
    with pytest.raises(ValueError, match="layer=True"):
        get_kv(pool, True, slots)
    with pytest.raises(ValueError, match=r"k must be.*got shape \[1, 2, 4\]"):
        set_kv(pool, 0, slots, mx.zeros((1, 2, 4)), kv)
    with pytest.raises(ValueError, match=r"v must be.*got shape \[2, 2, 3\]"):
        set_kv(pool, 0, slots, kv, mx.zeros((2, 2, 3)))  # T differs from len(slots)
    with pytest.raises(ValueError, match=r"got shape \[2, 2, 1, 3\]"):
        set_kv(pool, 0, slots, mx.zeros((2, 2, 1, 3)), kv)  # batch of 2 in mlx-lm layout
    with pytest.raises(ValueError, match=r"slots must be a 1-D integer.*\(1, 1\)"):
        set_kv(pool, 0, mx.array([[1]]), kv, kv)
    with pytest.raises(ValueError, match="slots must be a 1-D integer.*float32"):
        get_kv(pool, 0, mx.array([1.0]))
    with pytest.raises(ValueError, match="one k and one v per layer.*1 ks"):
        set_kv_all_layers(pool, slots, [kv], [kv, kv])
    with pytest.raises(ValueError, match=r"ks\[1\] must be"):
        set_kv_all_layers(pool, slots, [kv, mx.zeros((1, 3, 3))], [kv, kv])


@pytest.mark.parametrize(
    "slots, message",
    [
        ([1.9], r"slots\[0\]=1.9 must be an int slot id in \[0, 4\)"),
        ([1, True], r"slots\[1\]=True"),
        ([4], r"slots\[0\]=4 must be an int slot id in \[0, 4\)"),
        ([-1], r"slots\[0\]=-1"),
        (np.array([2**32 + 1]), r"slots\[0\]=4294967297"),  # would wrap to 1 as int32
        (np.array([1.0]), "1-D integer array.*float64"),
        ("12", "list or 1-D integer array of slot ids, got str"),
    ],
)
def test_host_slots_are_checked_never_rounded(slots, message):
    pool = init_pool(num_layers=1, num_slots=4, n_kv_heads=1, head_dim=2)
    kv = mx.zeros((len(slots), 1, 2))
    with pytest.raises(ValueError, match=message):
        set_kv(pool, 0, slots, kv, kv)
    with pytest.raises(ValueError, match=message):
        get_kv(pool, 0, slots)


def test_numpy_and_list_slots_write_where_mx_slots_do():
    pool = init_pool(num_layers=1, num_slots=8, n_kv_heads=1, head_dim=2, dtype=mx.float32)
    k, v = rand((3, 1, 2), 1), rand((3, 1, 2), 2)
    want = snapshot(set_kv(pool, 0, mx.array([5, 1, 7]), k, v))
    for slots in ([5, 1, 7], np.array([5, 1, 7], dtype=np.int64), np.array([5, 1, 7], np.uint8)):
        assert_same(set_kv(pool, 0, slots, k, v), want)
        np.testing.assert_array_equal(np.array(get_kv(pool, 0, slots)[0]), np.array(
            get_kv(pool, 0, mx.array([5, 1, 7]))[0]))


@st.composite
def pool_write(draw):
    layers = draw(st.integers(1, 3))
    slots_n = draw(st.integers(2, 9))
    heads = draw(st.integers(1, 3))
    dim = draw(st.integers(1, 4))
    slots = draw(st.lists(st.integers(0, slots_n - 1), unique=True, max_size=slots_n))
    layer = draw(st.integers(0, layers - 1))
    seed = draw(st.integers(0, 2**16))
    mlx_lm_layout = draw(st.booleans())
    return layers, slots_n, heads, dim, slots, layer, seed, mlx_lm_layout


@given(pool_write())
def test_pool_functions_never_mutate_inputs_and_match_numpy(case):
    layers, slots_n, heads, dim, slots, layer, seed, mlx_lm_layout = case
    t = len(slots)
    pool = set_kv_all_layers(
        init_pool(layers, slots_n, heads, dim, mx.float32),
        mx.arange(slots_n, dtype=mx.int32),
        [rand((slots_n, heads, dim), seed + i) for i in range(layers)],
        [rand((slots_n, heads, dim), seed + 100 + i) for i in range(layers)],
    )
    keys_tuple, values_tuple = pool.keys, pool.values
    before = snapshot(pool)
    idx = mx.array(slots, dtype=mx.int32)
    k, v = rand((t, heads, dim), seed + 7), rand((t, heads, dim), seed + 8)
    k_np, v_np, idx_np = np.array(k), np.array(v), np.array(idx)
    if mlx_lm_layout:
        k, v = k.swapaxes(0, 1)[None], v.swapaxes(0, 1)[None]

    one = set_kv(pool, layer, idx, k, v)
    every = set_kv_all_layers(pool, idx, [k] * layers, [v] * layers)
    got_k, got_v = get_kv(one, layer, idx)
    mx.eval(one, every, got_k, got_v)

    assert pool.keys is keys_tuple and pool.values is values_tuple
    assert_same(pool, before)
    np.testing.assert_array_equal(np.array(idx), idx_np)
    if mlx_lm_layout:
        np.testing.assert_array_equal(np.array(k)[0].swapaxes(0, 1), k_np)
    else:
        np.testing.assert_array_equal(np.array(k), k_np)

    expected = [a.copy() for a in before]
    expected[layer][idx_np] = k_np
    expected[layers + layer][idx_np] = v_np
    assert_same(one, expected)
    np.testing.assert_array_equal(np.array(got_k), k_np)
    np.testing.assert_array_equal(np.array(got_v), v_np)
    for i in range(layers):
        np.testing.assert_array_equal(np.array(every.keys[i])[idx_np], k_np)
        np.testing.assert_array_equal(np.array(every.values[i])[idx_np], v_np)


def test_set_kv_under_compile_matches_eager():
    pool = init_pool(num_layers=2, num_slots=8, n_kv_heads=2, head_dim=4, dtype=mx.float32)
    slots = mx.array([6, 0, 2], dtype=mx.int32)
    k, v = rand((3, 2, 4), 1), rand((1, 2, 3, 4), 2)

    def step(pool, slots, k, v):
        pool = set_kv(pool, 1, slots, k, v)
        pool = set_kv_all_layers(pool, slots[:1], [k[:1], k[1:2]], [k[2:], k[:1]])
        return pool, get_kv(pool, 1, slots)

    eager_pool, eager_kv = step(pool, slots, k, v)
    compiled = mx.compile(step)
    for _ in range(2):  # the second call runs the cached trace
        got_pool, got_kv = compiled(pool, slots, k, v)
        assert isinstance(got_pool, KVPool)
        assert_same(got_pool, snapshot(eager_pool))
        for a, b in zip(got_kv, eager_kv, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_linear_use_in_a_loop_accumulates_writes():
    pool = init_pool(num_layers=1, num_slots=5, n_kv_heads=1, head_dim=1, dtype=mx.float32)
    write = mx.compile(lambda pool, s, x: set_kv(pool, 0, s, x, x))
    for slot in range(1, 5):
        pool = write(pool, mx.array([slot]), mx.full((1, 1, 1), float(slot)))
        mx.eval(pool)
    assert np.array(pool.keys[0]).reshape(-1).tolist() == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------- allocator --


def test_allocator_hands_out_slots_in_order_and_never_slot_0():
    a = init_allocator(5)
    assert a.num_free == 4 and a.num_slots == 5
    a, slots, ok = alloc(a, 3)
    assert ok and slots == [1, 2, 3] and a.num_free == 1
    a, slots, ok = alloc(a, 1)
    assert ok and slots == [4] and a.num_free == 0
    a2, slots, ok = alloc(a, 0)
    assert ok and slots == [] and a2 is a


def test_failed_alloc_returns_the_same_allocator():
    a, _, _ = alloc(init_allocator(4), 2)
    free_before = a.free_slots.copy()
    a2, slots, ok = alloc(a, 2)
    assert (a2, slots, ok) == (a, None, False) and a2 is a
    np.testing.assert_array_equal(a.free_slots, free_before)


def test_free_returns_slots_lifo_and_leaves_input_unchanged():
    a, slots, _ = alloc(init_allocator(6), 4)
    snap = a.free_slots.copy()
    b = free(a, [2, 3])
    np.testing.assert_array_equal(a.free_slots, snap)
    assert b.num_free == a.num_free + 2
    assert alloc(b, 2)[1] == [2, 3]
    assert free(a, np.array([1, 4])).num_free == 3
    assert free(a, mx.array([1, 4], dtype=mx.int32)).free_slots.tolist() == [5, 4, 1]
    assert free(a, []) is a


@pytest.mark.parametrize(
    "slots, message",
    [
        ([0], "slot 0"),
        ([7], r"out of range \[1, 6\): \[7\]"),
        ([-2], r"out of range.*\[-2\]"),
        ([5], r"double free.*\[5\]"),
        ([1, 1], r"repeated.*\[1\]"),
        ([1.5], "integers"),
        (np.array([1.0]), "integers"),
    ],
)
def test_free_errors_name_the_slots_and_leave_input_unchanged(slots, message):
    a, _, _ = alloc(init_allocator(6), 3)  # 1, 2, 3 in use; 4, 5 free
    snap = a.free_slots.copy()
    with pytest.raises(ValueError, match=message):
        free(a, slots)
    np.testing.assert_array_equal(a.free_slots, snap)


def test_allocator_arguments_are_checked_and_state_is_read_only():
    with pytest.raises(ValueError, match="num_slots=1"):
        init_allocator(1)
    with pytest.raises(ValueError, match="num_slots=4.0"):
        init_allocator(4.0)
    a = init_allocator(4)
    with pytest.raises(ValueError, match="n=-1"):
        alloc(a, -1)
    with pytest.raises(ValueError, match="n=True"):
        alloc(a, True)
    with pytest.raises(ValueError, match="integers"):
        free(alloc(a, 1)[0], [True])
    with pytest.raises(ValueError, match="read-only"):
        a.free_slots[0] = 0
    with pytest.raises(ValueError, match="read-only"):
        alloc(a, 1)[0].free_slots[0] = 0


def test_pool_exhausted_is_servecores_and_names_the_pool():
    import servecore

    assert PoolExhausted is servecore.PoolExhausted
    err = PoolExhausted(requested=9, available=4, what=POOL_NAME)
    assert isinstance(err, RuntimeError)
    assert (err.requested, err.available) == (9, 4)
    assert str(err) == "KV pool slots exhausted: requested 9, 4 available"


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: the set of slots in use."""

    @initialize(num_slots=st.integers(2, 12))
    def init(self, num_slots):
        self.a = init_allocator(num_slots)
        self.in_use: set[int] = set()
        self.history: list[tuple] = []  # (allocator, its free_slots copy): old values stay put

    def step(self, new):
        self.history.append((self.a, self.a.free_slots.copy()))
        self.a = new

    @rule(n=st.integers(0, 13))
    def alloc(self, n):
        new, slots, ok = alloc(self.a, n)
        if n > self.a.num_free:
            assert (new, slots, ok) == (self.a, None, False)
            return
        assert ok and len(slots) == n == len(set(slots))
        assert not self.in_use.intersection(slots) and 0 not in slots
        self.in_use.update(slots)
        self.step(new)

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def free(self, data):
        slots = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), unique=True))
        self.step(free(self.a, slots))
        self.in_use.difference_update(slots)

    @precondition(lambda self: self.a.num_free)
    @rule(data=st.data())
    def double_free(self, data):
        slot = data.draw(st.sampled_from(self.a.free_slots.tolist()))
        with pytest.raises(ValueError, match="double free"):
            free(self.a, [slot])

    @invariant()
    def slots_conserved(self):
        free_list = self.a.free_slots.tolist()
        assert len(free_list) == len(set(free_list)) == self.a.num_free
        assert not self.in_use.intersection(free_list), "a slot is both free and in use"
        assert self.in_use.union(free_list) == set(range(1, self.a.num_slots))
        for old, snap in self.history:
            np.testing.assert_array_equal(old.free_slots, snap)


AllocatorMachine.TestCase.settings = settings(stateful_step_count=30)
TestAllocatorMachine = AllocatorMachine.TestCase
