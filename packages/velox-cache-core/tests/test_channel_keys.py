"""Keys quantized per channel (``kv_key_layout="channel"``, :class:`KRows`): the store against a
plain per-head reference of its bookkeeping (Python lists of rows, one group quantized at a
time by ``mx.quantize``), its bounds and bytes, and every policy over it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_contract import NAMES
from test_quantized_rows import every_chunking

from velox_cache_core.store import rows as R
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.token_rows import Quant

D = 64


def group_values(rows: list[np.ndarray], bits: int, group: int) -> list[np.ndarray]:
    """One group of ``group`` rows ``[D]`` quantized per feature over its rows, dequantized."""
    x = mx.array(np.stack(rows).T[None, None])  # [1, 1, D, group]
    q = mx.quantize(x, group_size=group, bits=bits)
    back = np.array(mx.dequantize(*q, group_size=group, bits=bits))[0, 0].T
    return list(back)


class Head:
    """One (batch row, head) of the store, as plain lists: ``groups`` of ``G`` row values,
    the ``window`` rows, and ``where``, the physical row each logical row reads (groups' rows
    first, then the window's)."""

    def __init__(self, rows: list[np.ndarray], bits: int, group: int, window: bool = False) -> None:
        self.bits, self.G = bits, group
        n = 0 if window else len(rows) // group * group
        self.groups = [group_values(rows[i : i + group], bits, group) for i in range(0, n, group)]
        self.window = list(rows[n:])
        self.where = list(range(len(rows)))

    def physical(self) -> list[np.ndarray]:
        return [r for g in self.groups for r in g] + self.window

    def dense(self) -> np.ndarray:
        phys = self.physical()
        return np.stack([phys[i] for i in self.where]) if self.where else np.zeros((0, D))

    def add(self, rows: list[np.ndarray]) -> list[int]:
        """Physical rows of ``rows``, a call's keys (all in the window), appended; their
        physical indices (``where`` shifted as the layout moves)."""
        new = Head(rows, self.bits, self.G, window=True)
        P, W = len(self.groups) * self.G, len(self.window)
        nP = len(new.groups) * self.G
        self.where = [i if i < P else i + nP for i in self.where]
        self.groups += new.groups
        self.window += new.window
        return [i + P if i < nP else i - nP + P + nP + W for i in new.where]

    def settle(self, keep: int = 0) -> None:
        """Repack once ``G`` rows are dead; else quantize the window's first ``G`` rows while
        it holds ``G`` besides its last ``keep`` (a call's rows waiting for its cut)."""
        while True:
            if len(self.physical()) - len(self.where) >= self.G:
                self.repack()
            elif len(self.window) - keep >= self.G:
                self.groups.append(group_values(self.window[: self.G], self.bits, self.G))
                self.window = self.window[self.G :]
            else:
                return

    def repack(self) -> None:
        G, phys, read = self.G, self.physical(), set(self.where)
        intact = [all(g * G + i in read for i in range(G)) for g in range(len(self.groups))]
        kept = [g for g, ok in enumerate(intact) if ok]
        order = [g * G + i for g in kept for i in range(G)]
        order += [p for p in range(len(phys)) if p in read and p not in order]
        rows = [phys[p] for p in order]
        n_new = len(rows) // G
        groups = [self.groups[kept[j]] for j in range(min(len(kept), n_new))]
        for j in range(len(groups), n_new):
            groups.append(group_values(rows[j * G : (j + 1) * G], self.bits, G))
        self.groups, self.window = groups, rows[n_new * G :]
        self.where = [order.index(p) for p in self.where]


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "take", "add", "pad", "head"]), st.integers(0, 2**31)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([32, 64]),
    heads=st.integers(1, 3),
    first=st.integers(0, 150),
    ops=OPS,
    seed=st.integers(0, 2**31),
)
def test_store_matches_plain_reference(
    bits: int, group: int, heads: int, first: int, ops: list, seed: int
) -> None:
    """Random row operations (a new row into a slot, a subset kept, a chunk joined, zero rows
    padded, the first rows sliced): every head's rows, as read, equal the reference's; the
    store holds fewer than ``G`` dead rows and a window under ``G`` rows besides a call's."""
    rng = np.random.default_rng(seed)
    draw = lambda n: (rng.standard_normal((2, heads, n, D)) * rng.uniform(0.1, 5, D)).astype(  # noqa: E731
        np.float32
    )
    x = draw(first)
    store = KRows.from_dense(mx.array(x), bits, group).settled()
    ref = [[Head(list(x[b, h]), bits, group) for h in range(heads)] for b in range(2)]
    for r in (h for row in ref for h in row):
        r.settle()
    call = Quant(bits, group, "channel").quantize_keys  # a call's keys: all in the window
    for op, arg in ops:
        S = store.shape[2]
        keep = 0
        op_rng = np.random.default_rng(arg)
        if op == "put" and not S:
            keep = -1  # nothing to write over: the store is as it was (maybe a view)
        elif op == "put":
            row = op_rng.integers(0, S, (2, heads, 1)).astype(np.int32)
            new = draw(1)
            store = R.put(store, mx.array(row), call(mx.array(new)))
            for b in range(2):
                for h in range(heads):
                    r = ref[b][h]
                    (p,) = r.add([new[b, h, 0]])
                    r.where[row[b, h, 0]] = p
        elif op == "take":
            m = int(op_rng.integers(0, S + 1))
            idx = np.stack(
                [[np.sort(op_rng.permutation(S)[:m]) for _ in range(heads)] for _ in range(2)]
            ).astype(np.int32)
            store = R.take(store, mx.array(idx))
            for b in range(2):
                for h in range(heads):
                    ref[b][h].where = [ref[b][h].where[i] for i in idx[b, h]]
        elif op == "add":
            new = draw(int(op_rng.integers(1, 3 * group)))
            store = R.concat([store, call(mx.array(new))], axis=2)
            keep = new.shape[2]
            for b in range(2):
                for h in range(heads):
                    added = ref[b][h].add(list(new[b, h]))
                    ref[b][h].where += added
        elif op == "pad":
            n = keep = int(op_rng.integers(1, 5))
            store = R.pad(store, n)
            for row_refs in ref:
                for r in row_refs:
                    added = r.add([np.zeros(D, np.float32)] * n)
                    r.where += added
        elif op == "head":  # a view: nothing repacked
            n = int(op_rng.integers(0, S + 1))
            store = store[:, :, :n]
            for row_refs in ref:
                for r in row_refs:
                    r.where = r.where[:n]
            keep = -1
        for r in (h for row in ref for h in row):
            if keep >= 0:
                r.settle(keep)
        got = np.array(store.dense())
        for b in range(2):
            for h in range(heads):
                np.testing.assert_array_equal(got[b, h], ref[b][h].dense().reshape(-1, D))
        if keep >= 0:
            assert store.n_physical - store.shape[2] < group
            assert store.window.shape[2] < group + keep
        assert store.nbytes == sum(a.nbytes for a in store.arrays())


def test_reads_packed_groups_and_window_alike() -> None:
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, 2, 150, 64)).astype(np.float32))
    store = R.take(KRows.from_dense(x, 4, 64), mx.array(rng.permutation(150)[None, None, :100]))
    store = KRows(*store.arrays()[:4], mx.broadcast_to(store.where[:, :1], (1, 2, 100)), 4, 64)
    q = mx.array(rng.standard_normal((1, 2, 3, 5, 64)).astype(np.float32))
    want = q @ store.dense()[:, :, None].swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(store.matmul(q, True)), np.array(want), atol=1e-4)


def test_per_channel_groups_keep_outlier_channels() -> None:
    """The reason for the layout: keys with an outlier channel lose far less per channel."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 256, 64)).astype(np.float32)
    x[..., 5] = 30 + rng.standard_normal(256)  # a channel far from the others, as keys have
    keys = mx.array(x)
    per_token = np.abs(np.array(Quant(4, 64).quantize(keys).dense()) - x).mean()
    per_channel = np.abs(np.array(Quant(4, 64, "channel").quantize_keys(keys).dense()) - x).mean()
    assert per_channel < per_token / 3


def test_refuses_being_read_as_mlx_lm_tuples() -> None:
    store = Quant(4, 32, "channel").quantize_keys(mx.zeros((1, 1, 40, 32)))
    with pytest.raises(TypeError, match="kv_key_layout='token'"):
        tuple(store)
    with pytest.raises(ValueError, match="kv_key_layout must be one of 'token', 'channel'"):
        Quant(4, 32, "rows")


@pytest.mark.parametrize("bits", (4, 2))
@pytest.mark.parametrize("name", NAMES)
def test_every_policy_over_channel_keys(name: str, bits: int) -> None:
    """Every policy keeps, scores and attends over per-channel keys (held in the window here:
    calls, streams and reserves shorter than a group of 64) as its reference does over the
    same rows."""
    every_chunking(name, Quant(bits, 64, "channel"), head_dim=64, seed=3000 + bits)
