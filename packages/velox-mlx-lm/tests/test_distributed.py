"""Velox caches under ``mx.distributed``: real multi-process runs on this host.

``mlx.launch --backend ring`` starts the ranks of ``distributed_worker.py``. Every rank runs
each case on the unsharded model (the single-process reference) and on its shard; here the
shards' kept positions (per layer and KV head) and greedy tokens are compared with the
reference. Tensor parallel: a tiny llama (8 query / 4 KV heads) on 2 ranks; pipeline parallel:
a tiny qwen2 (4 layers) on 2 ranks; the embedded SmolLM2 (9 / 3 heads) on 3 ranks (slow).

``VELOX_DISTRIBUTED_STEPS`` sets the tiny runs' decode steps (24 by default, 64 in ``nox -s
distributed``); ``VELOX_DISTRIBUTED_MODEL=1`` (set there) adds the 3-rank embedded-model run,
which always decodes 64 steps (the issue's check; ``EMBEDDED_STEPS``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

HERE = Path(__file__).parent
WORKER = HERE / "distributed_worker.py"
STEPS = int(os.environ.get("VELOX_DISTRIBUTED_STEPS", "24"))
EMBEDDED_STEPS = 64
# Seconds a launch may take; the 3-rank embedded run gets EMBEDDED_TIMEOUT (3 ranks of a 135M
# model on 2 cores shared with other jobs can take many minutes).
TIMEOUT = int(os.environ.get("VELOX_DISTRIBUTED_TIMEOUT", "600"))
EMBEDDED_TIMEOUT = max(TIMEOUT, 2400)

# Cases whose decisions span the layer: every rank keeps the same positions on every head.
LAYER_SCOPE = {
    "tova",
    "tova_oneshot",
    "tova_key_layer",
    "tova_per_layer",
    "h2o_layer",
    "h2o_layer_oneshot",
    "morphkv",
    "morphkv_max",
    "tova_q4",
    "tova_q4_channel",
    "tova_pinned",
    "tova_tier",
}
# Cases with a demoted tier: decided per layer and call (no StepSums), tiers compared too.
TIER = {"tova_tier", "h2o_head_tier"}
# Cases with the worker's pinned span (distributed_worker.PIN): every head keeps it.
PINNED = {"tova_pinned", "h2o_head_pinned", "snapkv_pinned"}
TENSOR_CASES = [
    "tova",
    "tova_adapted",
    "tova_oneshot",
    "tova_key_layer",
    "tova_per_layer",
    "h2o_layer",
    "h2o_head",
    "h2o_layer_oneshot",
    "morphkv",
    "morphkv_max",
    "snapkv",
    "streaming_llm",
    "tova_q4",
    "tova_q4_channel",
    "h2o_head_q8",
    "tova_pinned",
    "h2o_head_pinned",
    "snapkv_pinned",
    *sorted(TIER),
]
NEGATIVE = "tova_no_allreduce"
# Adaptive allocation: each rank shares its budget among the KV heads it holds (and, with
# global, its layers), so a sharded model keeps the same bytes, not the same rows, as one
# process.
ADAPTIVE = ["tova_head_alloc", "snapkv_global"]


def _launcher() -> list[str]:
    """``mlx.launch`` next to this interpreter (a nox or venv ``bin/``), else on ``PATH``."""
    local = Path(sys.executable).parent / "mlx.launch"
    found = str(local) if local.exists() else shutil.which("mlx.launch")
    if found is None:
        pytest.skip("mlx.launch not found")
    return [found]


def _free_port(span: int) -> int:
    """A port ``p`` with ``p .. p + span - 1`` free now (the ring backend listens on
    consecutive ports from ``--starting-port``)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + span):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range for the ring backend")


def launch_cmd(ranks: int, *argv: str) -> list[str]:
    """``mlx.launch --backend ring -n RANKS ... --python <this interpreter> ARGV`` (skips where
    MLX has no distributed backend)."""
    if not mx.distributed.is_available():
        pytest.skip("mx.distributed has no backend in this MLX build")
    return [
        *_launcher(),
        "--backend",
        "ring",
        "-n",
        str(ranks),
        "--starting-port",
        str(_free_port(2 * ranks)),
        # Several ranks share this host's cores: one BLAS thread each.
        "--env",
        "OPENBLAS_NUM_THREADS=1",
        "--python",
        sys.executable,
        *argv,
    ]


def launch(
    out: Path,
    ranks: int,
    mode: str,
    cases: Sequence[str] = (),
    steps: int = STEPS,
    timeout: float = TIMEOUT,
) -> list[dict[str, Any]]:
    cmd = launch_cmd(ranks, str(WORKER), str(out), mode, str(steps), *cases)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    files = sorted(out.glob("rank*.json"))
    if proc.returncode or len(files) != ranks:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    results = _read(out)
    assert [r["rank"] for r in results] == list(range(ranks))
    assert all(r["size"] == ranks for r in results)
    return results


def _read(out: Path) -> list[dict[str, Any]]:
    """The ranks' results, by rank; rank 0 ran the unsharded reference (once for all ranks),
    which is copied into every rank's cases."""
    results = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    results.sort(key=lambda r: r["rank"])
    for result in results[1:]:
        for case, run in result["cases"].items():
            run["reference"] = results[0]["cases"][case]["reference"]
    return results


def _local(reference: list[Any], rank: int, heads: int) -> list[Any]:
    """The reference's kept positions of the KV heads rank ``rank`` holds (``heads`` each)."""
    return [
        None if layer is None else layer[rank * heads : (rank + 1) * heads] for layer in reference
    ]


def _mismatch(result: dict[str, Any], case: str) -> list[str]:
    """What rank ``result`` got differently from the reference in ``case`` (empty: nothing)."""
    run = result["cases"][case]
    ref, mine = run["reference"], run["sharded"]
    rank = result["rank"]
    problems = []
    if ref["tokens"] != mine["tokens"]:
        problems.append(f"rank {rank}: tokens {mine['tokens']} != {ref['tokens']}")
    if result["layers"] is not None:  # pipeline: this rank's layers only
        start, end = result["layers"]
        expected = ref["kept"][start:end]
    else:
        heads = len(next(layer for layer in mine["kept"] if layer is not None))
        expected = _local(ref["kept"], rank, heads)
    for i, (want, got) in enumerate(zip(expected, mine["kept"], strict=True)):
        if want != got:
            problems.append(f"rank {rank} layer {i}: kept {got} != {want}")
    if case in TIER:  # the tiers' rows too, head by head
        if result["layers"] is not None:
            want_tiers = ref["demoted"][start:end]
        else:
            want_tiers = _local(ref["demoted"], rank, heads)
        if not any(want_tiers):
            problems.append(f"{case}: nothing was demoted (the test would not see the tier)")
        for i, (want, got) in enumerate(zip(want_tiers, mine["demoted"], strict=True)):
            if want != got:
                problems.append(f"rank {rank} layer {i}: demoted {got} != {want}")
    return problems


def _shared_launch(
    factory: pytest.TempPathFactory, name: str, ranks: int, mode: str, cases: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """One launch per test session, even when pytest-xdist spreads this module's tests over
    several workers: the first worker runs it, the others read its results (a file lock in the
    session's shared temporary folder)."""
    from filelock import FileLock  # a dependency of mlx-lm (through huggingface_hub)

    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers
    out = root / f"velox-distributed-{name}"
    with FileLock(str(out) + ".lock"):
        done = out / "done"
        if done.exists():
            return _read(out)
        shutil.rmtree(out, ignore_errors=True)
        results = launch(out, ranks, mode, cases)
        done.write_text("ok")
        return results


@pytest.fixture(scope="module")
def tensor_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _shared_launch(
        tmp_path_factory, "tensor", 2, "tensor", [*TENSOR_CASES, NEGATIVE, *ADAPTIVE]
    )


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _shared_launch(tmp_path_factory, "pipeline", 2, "pipeline")


@pytest.mark.slow
@pytest.mark.parametrize("case", TENSOR_CASES)
def test_tensor_parallel_matches_single_process(
    tensor_run: list[dict[str, Any]], case: str
) -> None:
    """2 ranks, each with 4 query / 2 KV heads of 8 / 4: kept positions on every layer and
    head, and the greedy tokens, equal the unsharded model's. Decode steps send every layer's
    sums in one all_sum per forward pass (``StepSums``), except ``tova_per_layer``: one per
    layer."""
    assert all(r["detected_group"] for r in tensor_run)  # for_model found the shard group
    for result in tensor_run:
        sharded = result["cases"][case]["sharded"]
        assert all(sharded["grouped"])
        assert all(sharded["step_sums"]) == (case != "tova_per_layer" and case not in TIER)
        assert not _mismatch(result, case), "\n".join(_mismatch(result, case))
    if case in PINNED:
        _assert_pinned_kept(tensor_run, case)
        if case == "tova_pinned":  # the test of the test: unpinned TOVA lets the span go
            with pytest.raises(AssertionError, match="a pinned token went"):
                _assert_pinned_kept(tensor_run, "tova")
    if case in LAYER_SCOPE:  # one decision per layer: every head of every rank agrees
        for layer in range(len(tensor_run[0]["cases"][case]["sharded"]["kept"])):
            rows = [row for r in tensor_run for row in r["cases"][case]["sharded"]["kept"][layer]]
            assert all(row == rows[0] for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("case", ADAPTIVE)
def test_adaptive_allocation_under_tensor_parallel_holds_its_bytes(
    tensor_run: list[dict[str, Any]], case: str
) -> None:
    """Per-head (and model-wide) shares on 2 ranks: every rank decodes, and each layer (with
    global, all of the rank's layers together) holds at most the uniform cut's rows over the
    heads the rank holds (TOVA's shares include one dead row per head; SnapKV appends every
    decoded token after its cut), with heads keeping different counts somewhere."""
    from distributed_worker import BUDGET

    # tokens after the prompt's end: generate_step feeds one more than it yields (look-ahead)
    grown = STEPS if case.startswith("snapkv") else 0
    counts = set()
    for result in tensor_run:
        sharded = result["cases"][case]["sharded"]
        assert len(sharded["tokens"]) == STEPS
        held, bound = 0, 0
        for layer in sharded["kept"]:
            rows = [[p for p in head if p < 2**30] for head in layer]
            if not case.endswith("global"):  # each layer within its own rows
                assert sum(len(h) for h in rows) <= (BUDGET + grown) * len(rows)
            held += sum(len(h) for h in rows)
            bound += (BUDGET + grown) * len(rows)
            counts |= {len(h) for h in rows}
        assert held <= bound  # global: the rank's layers share their rows
    assert len(counts) > 1


@pytest.mark.slow
def test_without_the_all_reduce_layer_scope_diverges(tensor_run: list[dict[str, Any]]) -> None:
    """The test of the test: with the group withheld (``for_model(..., group=None)``) each rank
    decides on its own heads, and the layer-scope run differs from the reference."""
    assert not any(any(r["cases"][NEGATIVE]["sharded"]["grouped"]) for r in tensor_run)
    problems = [p for r in tensor_run for p in _mismatch(r, NEGATIVE)]
    assert problems, "layer scope without the all-reduce matched the reference: the check is blind"


@pytest.mark.slow
def test_pipeline_parallel_matches_single_process(pipeline_run: list[dict[str, Any]]) -> None:
    """A qwen2 split into 2 stages: each rank's caches (its own layers) keep what the
    single-process run keeps there, and the tokens are the same; the stages cover every layer
    (``cache[-1].keys = mx.depends(...)`` went through the caches' ``keys`` setter)."""
    spans = sorted(tuple(r["layers"]) for r in pipeline_run)
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0]
    assert not any(r["detected_group"] for r in pipeline_run)  # no tensor group: no all_sum
    for result in pipeline_run:
        for case in result["cases"]:
            assert not _mismatch(result, case), "\n".join(_mismatch(result, case))
    _assert_pinned_kept(pipeline_run, "tova_pinned")


def _assert_pinned_kept(results: list[dict[str, Any]], case: str) -> None:
    """Every head of every layer, on every rank and in the reference, still holds the pinned
    span after the prompt (40 tokens) and the decode steps overflowed budget 16."""
    from distributed_worker import PIN

    span = set(range(*PIN))
    for result in results:
        run = result["cases"][case]
        for kept in (run["sharded"]["kept"], run["reference"]["kept"]):
            heads = [h for layer in kept if layer is not None for h in layer]
            assert heads and all(span <= set(h) for h in heads), f"{case}: a pinned token went"


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(
    os.environ.get("VELOX_DISTRIBUTED_MODEL") != "1",
    reason="minutes on 2 cores: runs in `nox -s distributed` (VELOX_DISTRIBUTED_MODEL=1)",
)
def test_embedded_model_on_three_ranks(embedded_model_path: Any, tmp_path: Path) -> None:
    """The embedded SmolLM2 (9 query / 3 KV heads) on 3 ranks: 3 / 1 heads each; 64 greedy
    steps whatever ``VELOX_DISTRIBUTED_STEPS`` says."""
    cases = ["tova", "h2o_layer", "morphkv", "tova_adapted"]
    results = launch(tmp_path, 3, "embedded", cases, steps=EMBEDDED_STEPS, timeout=EMBEDDED_TIMEOUT)
    for result in results:
        for case in cases:
            assert len(result["cases"][case]["reference"]["tokens"]) == EMBEDDED_STEPS
        for case in cases:
            assert not _mismatch(result, case), "\n".join(_mismatch(result, case))


# -- in-process checks (no launch) -------------------------------------------------------------


class _FakeGroup:
    """Stands in for an ``mx.distributed.Group`` where nothing is communicated."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_head_mean_without_a_group_is_the_plain_mean() -> None:
    from velox_cache_core.distributed import head_mean, layer_group

    x = mx.random.uniform(shape=(1, 1, 8, 1, 17))
    assert mx.array_equal(head_mean(x, 2), x.mean(axis=2))
    assert layer_group(None, "layer") is None
    assert layer_group(_FakeGroup(1), "layer") is None
    assert layer_group(_FakeGroup(2), "head") is None
    two = _FakeGroup(2)
    assert layer_group(two, "layer") is two


def test_cache_group_setting_and_deepcopy() -> None:
    import copy

    from velox_mlx_lm import TOVAKVCache

    cache = TOVAKVCache(budget=8)
    assert cache.group is None
    cache.group = _FakeGroup(1)  # one rank: nothing to communicate, stored as None
    assert cache.group is None
    group = _FakeGroup(2)
    cache.group = group
    clone = copy.deepcopy(cache)  # a real Group cannot be deep-copied: copies share it
    assert clone.group is group
    with pytest.raises(TypeError, match=r"mx\.distributed\.Group"):
        cache.group = "ring"


def test_keys_setter_ties_a_dependency_and_keeps_the_rows() -> None:
    """What pipeline models do: ``cache[-1].keys = mx.depends(cache[-1].keys, h)``."""
    from velox_mlx_lm import TOVAKVCache

    cache = TOVAKVCache(budget=8, n_sink=2, signal="key", scope="head")
    assert cache.keys is None
    cache.keys = mx.zeros((1,))  # empty cache: ignored
    for _ in range(12):
        kv = mx.random.normal((1, 2, 1, 4))
        cache.update_and_fetch(kv, kv)
    keys, positions = cache.keys, cache.positions
    h = mx.ones((1, 3))
    cache.keys = mx.depends(cache.keys, h)
    assert mx.array_equal(cache.keys, keys) and mx.array_equal(cache.positions, positions)
    assert cache.offset == 12 and cache.size() == 8
    mx.eval(cache.state)
    kv = mx.random.normal((1, 2, 1, 4))
    cache.update_and_fetch(kv, kv)  # and it goes on
    assert cache.offset == 13 and cache.size() == 8


def test_for_model_on_an_unsharded_model_has_no_group() -> None:
    from mlx_lm.models import llama

    from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
    from velox_mlx_lm.distributed import tensor_group

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    model = llama.Model(args)
    assert tensor_group(model) is None
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", tova_budget=8))
    assert all(c.group is None for c in caches)
    model.shard(mx.distributed.init())  # one process: a group of one rank
    assert tensor_group(model) is None


def test_keys_setter_on_packed_rows_ties_without_unpacking() -> None:
    """A pipeline model ties its send to the last layer's keys every pass: on a batch decoding
    packed, that must neither unpack the rows (the next step would copy them again) nor
    change what they hold."""
    from velox_mlx_lm import TOVAKVCache
    from velox_mlx_lm.batch_cache import merge

    rows = []
    for seed in (0, 1):
        row = TOVAKVCache(budget=6, n_sink=1)
        mx.random.seed(seed)
        for n in (9, 1):  # a prompt past the budget, then a decode step: laid out alike
            kv, q = mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 4, n, 4))
            row.update_and_fetch(kv, kv)
            row.attend(q, 0.5, None, None)
        rows.append(row)
    batch = merge(rows)
    kv, q = mx.random.normal((2, 2, 1, 4)), mx.random.normal((2, 4, 1, 4))
    batch.update_and_fetch(kv, kv)
    batch.attend(q, 0.5, None, None)
    assert batch.batch.packed is not None
    keys = batch.keys
    batch.keys = mx.depends(batch.keys, mx.ones((1, 3)))
    assert batch.batch.packed is not None and mx.array_equal(batch.keys, keys)
    mx.eval(batch.state)
    assert batch.tokens_seen == [11, 11] and batch.size() == 6
    kept = [r.view().positions for r in batch.rows]  # now unpacked
    assert all(p.shape == (1, 2, 6) for p in kept)
