"""Compact RoPE positions (velox_cache_core.store.rope_shift): the rotation and the shift."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import KVSlots
from velox_cache_core.store.rope_shift import Compaction, Rope, compacted, rotate
from velox_cache_core.store.tier import TierSpec, demote

ROPES = [
    Rope(dims=16, base=10_000.0, traditional=False),
    Rope(dims=16, base=10_000.0, traditional=True),
    Rope(dims=8, base=100_000.0, traditional=False, scale=0.25),  # partial dims, linear scale
    Rope(dims=8, base=100_000.0, traditional=True, scale=0.5),
]


def _at(x: mx.array, positions: np.ndarray, rope: Rope) -> mx.array:
    """``x`` ``[B, H, n, D]`` with row ``[b, h, i]`` rotated at ``positions[b, h, i]``."""
    B, H, n, D = x.shape
    rows = x.reshape(B * H * n, 1, D)
    offset = mx.array(positions.reshape(-1).astype(np.int32))
    out = mx.fast.rope(
        rows,
        rope.dims,
        traditional=rope.traditional,
        base=rope.base,
        scale=rope.scale,
        offset=offset,
    )
    return out.reshape(B, H, n, D)


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.dims}-{r.traditional}-{r.scale}")
def test_rotate_equals_rope_at_the_shifted_position(rope: Rope) -> None:
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((2, 3, 5, 16)).astype(np.float32))
    p = rng.integers(5_000, 40_000, size=(2, 3, 5))
    shift = rng.integers(-100, 30_000, size=(2, 3, 5))
    got = rotate(_at(x, p, rope), mx.array(shift.astype(np.int32)), rope)
    want = _at(x, p - shift, rope)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-3, rtol=0)
    # a scalar shift moves every row alike; features past dims are untouched
    one = rotate(_at(x, p, rope), 7_000, rope)
    np.testing.assert_allclose(np.array(one), np.array(_at(x, p - 7_000, rope)), atol=2e-3)
    np.testing.assert_array_equal(np.array(one[..., rope.dims :]), np.array(x[..., rope.dims :]))


def test_rotate_keeps_dtype_and_refuses_bad_input() -> None:
    rope = ROPES[0]
    x = mx.ones((1, 2, 3, 16), dtype=mx.bfloat16)
    assert rotate(x, 5, rope).dtype == mx.bfloat16
    assert rotate(x, 0, rope) is x
    with pytest.raises(ValueError, match="shift must be"):
        rotate(x, mx.zeros((1, 2, 4), dtype=mx.int32), rope)
    with pytest.raises(TypeError, match="integers"):
        rotate(x, mx.zeros((1, 2, 3)), rope)
    with pytest.raises(ValueError, match="dims"):
        rotate(mx.ones((1, 1, 1, 4)), 1, rope)
    with pytest.raises(ValueError, match="dims"):
        Rope(dims=7, base=1e4)
    with pytest.raises(ValueError, match="base"):
        Rope(dims=8, base=0.0)


def test_compacted_lays_the_kept_rows_below_top() -> None:
    positions = mx.array([[[0, 1, 900, 40, 5000, 77]]], dtype=mx.int32)
    live = mx.array([[[True, True, True, True, True, False]]])
    got = np.array(compacted(positions, live, n_sink=2, top=10))
    # sinks keep theirs; 40 < 900 < 5000 laid at 7, 8, 9; the dead slot keeps its index
    np.testing.assert_array_equal(got, [[[0, 1, 8, 7, 9, 77]]])


def test_compaction_rope_positions_follow_the_shifts() -> None:
    rope = ROPES[0]
    comp = Compaction(context=64, rope=rope, top=6, n_sink=2)
    rng = np.random.default_rng(1)
    raw = mx.array(rng.standard_normal((1, 1, 6, 16)).astype(np.float32))
    token = np.array([[[0, 1, 10, 30, 50, 62]]])
    slots = KVSlots(
        keys=_at(raw, token, rope), values=raw, positions=mx.array(token, dtype=mx.int32)
    )
    assert comp.needs_shift(63, 2) and not comp.needs_shift(63, 1)
    shifted, _, after, delta = comp.shift(slots, 63, 2)
    assert shifted is not None
    assert delta == 63 - 6 and after.lag == delta and after.shifted_at == 63 and after.shifts == 1
    want = np.array([[[0, 1, 2, 3, 4, 5]]])
    np.testing.assert_array_equal(np.array(after.rope_positions(slots.positions)), want)
    np.testing.assert_allclose(np.array(shifted.keys), np.array(_at(raw, want, rope)), atol=1e-4)
    # a row arriving after the shift sits at its token index less the lag
    later = mx.array([[[0, 10, 63, 70]]], dtype=mx.int32)
    np.testing.assert_array_equal(np.array(after.rope_positions(later)), [[[0, 2, 6, 13]]])
    with pytest.raises(ValueError, match="positions='compact'"):
        comp.shift(slots, 63, 60)
    with pytest.raises(ValueError, match="below the model's context"):
        Compaction(context=6, rope=rope, top=6, n_sink=2)


def test_compaction_saves_and_loads() -> None:
    comp = Compaction(
        context=64,
        rope=ROPES[2],
        top=6,
        n_sink=2,
        lag=3,
        shifted_at=9,
        shifts=1,
        anchor_positions=mx.array([[[1, 2]]]),
        anchor_ropes=mx.array([[[1, 5]]]),
    )
    back = Compaction.load(comp.scalars(), comp.arrays())
    assert back.scalars() == comp.scalars()
    assert back.anchor_ropes is not None
    np.testing.assert_array_equal(np.array(back.anchor_ropes), [[[1, 5]]])


def test_a_demoted_tier_shifts_with_the_main_rows() -> None:
    """The tier's rows and the main rows' movable ones are laid below ``top`` together, in
    token order; the tier's keys (4-bit, per channel) land where a fresh quantization of the
    keys rotated at the new positions would, within the width's rounding; a row demoted after
    the shift keeps the position the shift gave it."""
    rope = ROPES[0]
    comp = Compaction(context=64, rope=rope, top=10, n_sink=2)
    rng = np.random.default_rng(3)
    raw = mx.array(rng.standard_normal((1, 1, 5, 32)).astype(np.float32))
    token = np.array([[[0, 1, 30, 50, 62]]])
    slots = KVSlots(
        keys=_at(raw, token, rope), values=raw, positions=mx.array(token, dtype=mx.int32)
    )
    tier_raw = mx.array(rng.standard_normal((1, 1, 4, 32)).astype(np.float32))
    tier_token = np.array([[[5, 20, 40, 55]]])
    spec = TierSpec(4, 8, group_size=32)
    tier = demote(
        spec,
        None,
        _at(tier_raw, tier_token, rope),
        tier_raw,
        mx.array(tier_token, dtype=mx.int32),
        mx.ones((1, 1, 4)),
    )
    assert tier is not None
    before = np.array(tier.keys.dense())
    shifted, moved, after, delta = comp.shift(slots, 63, 1, tier=tier)
    assert shifted is not None and moved is not None
    # token order 5, 20, 30, 40, 50, 55, 62 -> 3 .. 9 below top 10; sinks 0, 1 stay
    np.testing.assert_array_equal(
        np.array(after.rope_positions(slots.positions)), [[[0, 1, 5, 7, 9]]]
    )
    want_tier = np.array([[[3, 4, 6, 8]]])
    np.testing.assert_array_equal(np.array(after.rope_positions(tier.positions)), want_tier)
    np.testing.assert_array_equal(np.array(moved.positions), tier_token)  # token indices stay
    got = np.array(moved.keys.dense())
    want = np.array(_at(tier_raw, want_tier, rope))
    rounding = np.abs(before - np.array(_at(tier_raw, tier_token, rope))).max()
    assert np.abs(got - want).max() <= 2.5 * rounding + 1e-3
    assert np.abs(got - want).max() < np.abs(before - want).max()  # it did move
    assert delta == 63 - 10 and after.lag == delta
    # a shift with the same rows without the tier lays them lower: the tier counts in top
    alone = comp.shift(slots, 63, 1)[2]
    assert np.array(alone.rope_positions(slots.positions)).tolist() == [[[0, 1, 7, 8, 9]]]
