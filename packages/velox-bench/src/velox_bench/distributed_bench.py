"""Decode step time of a tensor-parallel model with Velox caches (``mx.distributed``).

What a layer-scope eviction decision costs when the model is split over ranks: its per-key
weights are ``all_sum``-ed over the tensor group (``budget + 1`` float32 per layer and decode
step, all layers in one ``all_sum`` per forward pass, or one per layer; see
``docs/distributed.md``). Every rank builds the same random llama (same seed), splits it
with ``model.shard``, fills one cache list per variant with the same prompt, then times
decode steps of the variants in interleaved rounds (each round runs every variant once, in a
rotating order, so drifts of a noisy machine hit them alike):

- ``full``: mlx-lm's ``KVCache`` (holds the whole context);
- ``tova_layer``: TOVA's paper preset (``scope="layer"``), the all-reduce on: every layer's
  sums of a decode step go out in one ``all_sum`` per forward pass (``StepSums``, what
  ``KVCacheBuilder.for_model`` sets up);
- ``tova_layer_per_layer``: the same with one ``all_sum`` per layer and step (the caches'
  ``share_step_sums(None)``), as before ``StepSums``;
- ``tova_head``: TOVA with ``scope="head"`` (rank-local decisions, nothing communicated);
- ``tova_layer_local``: layer scope with the all-reduce off (``for_model(..., group=None)``):
  the same arithmetic as ``tova_layer`` without the collective (the ranks' decisions then
  differ; it is here only to isolate the all-reduce's cost).

Rank 0 gathers every rank's round times (a round's time is the slowest rank's) and writes the
JSON; the launcher (:func:`launch`) prints a summary table (:func:`table`).

    python -m velox_bench.distributed_bench [--smoke] [--ranks 2] [--out distributed.json]

runs :func:`launch`, which starts ``mlx.launch --backend ring -n RANKS`` on this host with this
file as the rank program (``--worker OUT``).
"""

from __future__ import annotations

# Before mlx: OpenBLAS only takes effect when it is loaded first (a no-op when mlx already is).
from velox_blas import preload_openblas

preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402

__all__ = ["FULL_SETTINGS", "SMOKE_SETTINGS", "VARIANTS", "launch", "summarize", "table"]

# A Llama-3.2-1B-shaped attention (32 query / 8 KV heads, head_dim 64, hidden 2048, MLP 8192),
# fewer layers; a small vocabulary so the (unsharded) LM head does not dilute the layers' cost.
FULL_SETTINGS: dict[str, Any] = {
    "model": {
        "hidden_size": 2048,
        "num_hidden_layers": 4,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 1024,
    },
    "budget": 512,
    "prompt": 2048,
    "prefill_step": 512,
    "steps_per_round": 16,
    "rounds": 9,
    "warmup_steps": 4,
}
SMOKE_SETTINGS: dict[str, Any] = {
    "model": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "vocab_size": 128,
    },
    "budget": 16,
    "prompt": 40,
    "prefill_step": 16,
    "steps_per_round": 3,
    "rounds": 2,
    "warmup_steps": 1,
}
VARIANTS = ("full", "tova_layer", "tova_layer_per_layer", "tova_head", "tova_layer_local")
# Variants whose decision spans the layer: every head of every rank should keep the same rows.
LAYER_VARIANTS = ("tova_layer", "tova_layer_per_layer", "tova_layer_local")


# -- one rank ----------------------------------------------------------------------------------


def _model(shape: dict[str, Any]) -> Any:
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **shape,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _caches(model: Any, variant: str, budget: int) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

    if variant == "full":
        return list(make_prompt_cache(model))
    scope = "head" if variant == "tova_head" else "layer"
    config = KVCacheConfig(method="tova", tova_budget=budget, tova_scope=scope)
    if variant == "tova_layer_local":  # the all-reduce off: each rank decides on its heads
        return list(KVCacheBuilder.for_model(model, config, group=None))
    caches = list(KVCacheBuilder.for_model(model, config))  # the group found in the model
    if variant == "tova_layer_per_layer":
        for cache in caches:
            cache.share_step_sums(None)
    return caches


def _barrier(world: Any) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=world))


def _step(model: Any, caches: list[Any], y: mx.array) -> mx.array:
    """One greedy decode step, evaluated like mlx-lm's generate loop."""
    y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
    mx.eval(y)
    return y


def _as_list(a: mx.array) -> Any:
    """``a.tolist()``, typed loosely (nested lists of Python floats)."""
    return a.tolist()


def _kept_fingerprint(caches: list[Any]) -> list[float]:
    """Per layer, the sorted kept positions of this rank's first KV head, concatenated."""
    rows: list[float] = []
    for cache in caches:
        positions = getattr(cache, "positions", None)
        if positions is None:
            return []
        rows += _as_list(mx.sort(positions[0, 0], axis=-1).astype(mx.float32))
    return rows


def _bar(items: Iterable[Any], *, desc: str, show: bool) -> Iterable[Any]:
    """``items`` behind a tqdm progress bar, shown only if ``show``."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(items, desc=desc, disable=not show)


# Per variant: its caches and the last token fed (``[1, 1]``).
_State = dict[str, tuple[list[Any], mx.array]]


def _prefill(
    model: Any, world: Any, *, prompt: mx.array, settings: dict[str, Any], show: bool
) -> tuple[_State, dict[str, float]]:
    """Fresh caches per variant filled with ``prompt`` (``[1, prompt]`` token ids) in chunks of
    ``prefill_step``, then ``warmup_steps`` decode steps; (the state, seconds per variant)."""
    budget, prompt_len, chunk = settings["budget"], settings["prompt"], settings["prefill_step"]
    state: _State = {}
    prefill_s: dict[str, float] = {}
    for variant in _bar(VARIANTS, desc="prefill", show=show):
        caches = _caches(model, variant, budget)
        _barrier(world)
        start = time.perf_counter()
        for s in range(0, prompt_len, chunk):
            logits = model(prompt[:, s : s + chunk], cache=caches)
            mx.eval([c.state for c in caches], logits)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        for _ in range(settings["warmup_steps"]):
            y = _step(model, caches, y)
        prefill_s[variant] = time.perf_counter() - start
        state[variant] = (caches, y)
    return state, prefill_s


def _decode_rounds(
    model: Any, world: Any, state: _State, *, settings: dict[str, Any], show: bool
) -> dict[str, list[float]]:
    """Seconds per decode step, per variant and round: each round runs ``steps_per_round`` steps
    of every variant, in an order rotated by one per round; ``state`` moves on with them."""
    steps, rounds = settings["steps_per_round"], settings["rounds"]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in _bar(range(rounds), desc="decode rounds", show=show):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            caches, y = state[variant]
            _barrier(world)
            start = time.perf_counter()
            for _ in range(steps):
                y = _step(model, caches, y)
            times[variant].append((time.perf_counter() - start) / steps)
            state[variant] = (caches, y)
    return times


def _gather(world: Any, times: dict[str, list[float]], state: _State) -> tuple[Any, dict[str, Any]]:
    """Every rank's round times (``[ranks][variants][rounds]``) and, per layer-scope variant,
    every rank's kept rows (do the ranks agree?). Every rank must take part."""
    local = mx.array([times[v] for v in VARIANTS])  # [variants, rounds]
    gathered = mx.distributed.all_gather(local[None], group=world)  # [ranks, variants, rounds]
    fingerprints = {}
    for variant in LAYER_VARIANTS:
        fp = mx.array(_kept_fingerprint(state[variant][0]))[None]
        fingerprints[variant] = _as_list(mx.distributed.all_gather(fp, group=world))
    return _as_list(gathered), fingerprints


def _variant_results(
    per_rank: Any,
    fingerprints: dict[str, Any],
    *,
    state: _State,
    prefill_s: dict[str, float],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The JSON's ``results``: per variant, step times (a round's time is its slowest rank's),
    prefill time, rows kept and whether the ranks agree on them (layer scope only)."""
    size, rounds = len(per_rank), settings["rounds"]
    context = settings["prompt"] + settings["warmup_steps"] + rounds * settings["steps_per_round"]
    results: dict[str, Any] = {}
    for i, variant in enumerate(VARIANTS):
        rounds_s = [max(per_rank[k][i][j] for k in range(size)) for j in range(rounds)]
        caches = state[variant][0]
        results[variant] = {
            "step_ms_median": statistics.median(rounds_s) * 1e3,
            "step_ms_rounds": [t * 1e3 for t in rounds_s],
            "step_ms_median_per_rank": [
                statistics.median(per_rank[k][i]) * 1e3 for k in range(size)
            ],
            "prefill_s": prefill_s[variant],
            "kept_rows_layer0": int(caches[0].size()),
            "context": context,
        }
        if variant in fingerprints:
            fps = fingerprints[variant]
            results[variant]["ranks_agree"] = all(fp == fps[0] for fp in fps)
    return results


def _payload(settings: dict[str, Any], size: int, results: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 writes: the settings as run on ``size`` ranks, ``results`` and their summary."""
    return {
        "suite": "distributed",
        "smoke": bool(os.environ.get("VELOX_BENCH_SMOKE")),
        "settings": {
            **settings,
            "ranks": size,
            "backend": "ring",
            "variants": list(VARIANTS),
            "local_heads": {
                "query": settings["model"]["num_attention_heads"] // size,
                "kv": settings["model"]["num_key_value_heads"] // size,
            },
        },
        "results": results,
        "summary": summarize(results),
        "machine": _machine(),
        "blas": _blas(),
    }


def worker(out: Path, settings: dict[str, Any]) -> None:
    """One rank: build and shard the model, prefill every variant, time the decode rounds,
    gather every rank's times; rank 0 writes the JSON to ``out``."""
    from velox_mlx_lm.distributed import shard_model, tensor_group

    world = mx.distributed.init()
    rank, size = world.rank(), world.size()
    model = shard_model(_model(settings["model"]), world)
    assert tensor_group(model) is not None, "model.shard did not split the attention"
    vocab = settings["model"]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, settings["prompt"]), key=mx.random.key(1))
    show = rank == 0 and not os.environ.get("VELOX_BENCH_SMOKE")
    state, prefill_s = _prefill(model, world, prompt=prompt, settings=settings, show=show)
    times = _decode_rounds(model, world, state, settings=settings, show=show)
    per_rank, fingerprints = _gather(world, times, state)
    if rank != 0:
        return
    results = _variant_results(
        per_rank, fingerprints, state=state, prefill_s=prefill_s, settings=settings
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_payload(settings, size, results), indent=2) + "\n")


def _machine() -> dict[str, Any]:
    from velox_bench.results import machine_info

    return machine_info()


def _blas() -> dict[str, Any]:
    from velox_bench.results import blas_report

    return blas_report()


# -- summary -----------------------------------------------------------------------------------


def _paired(results: dict[str, Any], a: str, b: str) -> float:
    """Median over rounds of ``a``'s round time / ``b``'s (paired: same round, same drift)."""
    ra, rb = results[a]["step_ms_rounds"], results[b]["step_ms_rounds"]
    return statistics.median(x / y for x, y in zip(ra, rb, strict=True))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the variants' decode steps, each the median of per-round ratios.

    - ``layer_over_head``: ``tova_layer`` / ``tova_head``; ``layer_overhead_fraction`` is
      ``1 - tova_head / tova_layer``, the share of a layer-scope decode step that head scope
      does not spend (the goal: at most 0.10 at budget 512);
    - ``allreduce_share``: ``1 - tova_layer_local / tova_layer``, the share of a layer-scope
      step spent in the all-reduce alone (same arithmetic, collective off);
    - ``per_layer_over_head`` and ``per_layer_overhead_fraction``: the same for
      ``tova_layer_per_layer`` (one ``all_sum`` per layer and step);
    - ``*_over_full``: against mlx-lm's ``KVCache`` holding the whole context.
    """
    layer_over_head = _paired(results, "tova_layer", "tova_head")
    layer_over_local = _paired(results, "tova_layer", "tova_layer_local")
    per_layer_over_head = _paired(results, "tova_layer_per_layer", "tova_head")
    overhead = 1 - 1 / layer_over_head
    return {
        "layer_over_head": layer_over_head,
        "layer_overhead_fraction": overhead,
        "layer_over_local": layer_over_local,
        "allreduce_share": 1 - 1 / layer_over_local,
        "per_layer_over_head": per_layer_over_head,
        "per_layer_overhead_fraction": 1 - 1 / per_layer_over_head,
        "tova_layer_over_full": _paired(results, "tova_layer", "full"),
        "tova_head_over_full": _paired(results, "tova_head", "full"),
        "goal_overhead_at_most": 0.10,
        "goal_met": overhead <= 0.10,
    }


def table(payload: dict[str, Any]) -> str:
    """The summary as text: one row per variant, then the ratios."""
    s, results, summary = payload["settings"], payload["results"], payload["summary"]
    m = s["model"]
    lines = [
        f"distributed decode: {s['ranks']} ranks ({s['backend']}), llama "
        f"{m['num_attention_heads']}q/{m['num_key_value_heads']}kv heads x {m['head_dim']}, "
        f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers; prompt {s['prompt']}, "
        f"budget {s['budget']}; {s['rounds']} rounds x {s['steps_per_round']} steps",
        f"{'variant':<22}{'median ms/step':>16}{'min':>10}{'max':>10}{'kept rows':>11}"
        f"{'ranks agree':>13}",
    ]
    for variant, row in results.items():
        rounds = row["step_ms_rounds"]
        agree = row.get("ranks_agree")
        lines.append(
            f"{variant:<22}{row['step_ms_median']:>16.2f}{min(rounds):>10.2f}"
            f"{max(rounds):>10.2f}{row['kept_rows_layer0']:>11}"
            f"{'' if agree is None else str(agree):>13}"
        )
    lines.append(
        f"layer/head {summary['layer_over_head']:.3f} (overhead "
        f"{summary['layer_overhead_fraction']:.1%} of a layer-scope step, goal <= "
        f"{summary['goal_overhead_at_most']:.0%}: {'met' if summary['goal_met'] else 'NOT met'}); "
        f"all-reduce alone {summary['allreduce_share']:.1%} (layer/local "
        f"{summary['layer_over_local']:.3f}); layer/full {summary['tova_layer_over_full']:.3f}, "
        f"head/full {summary['tova_head_over_full']:.3f}; one all_sum per layer: "
        f"{summary['per_layer_over_head']:.3f} x head (overhead "
        f"{summary['per_layer_overhead_fraction']:.1%})"
    )
    return "\n".join(lines)


# -- launcher ----------------------------------------------------------------------------------


def free_port(span: int) -> int:
    """A port ``p`` with ``p .. p + span - 1`` free now (the ring backend listens on
    consecutive ports from ``--starting-port``)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + span > 65535:
            continue
        socks: list[socket.socket] = []
        try:
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


def launcher() -> str:
    """``mlx.launch`` next to this interpreter (a nox or venv ``bin/``), else on ``PATH``."""
    local = Path(sys.executable).parent / "mlx.launch"
    found = str(local) if local.exists() else shutil.which("mlx.launch")
    if found is None:
        raise FileNotFoundError("mlx.launch not found next to this Python or on PATH")
    return found


def launch(
    out: Path, *, ranks: int = 2, smoke: bool = False, timeout: float = 3600
) -> dict[str, Any]:
    """Run the benchmark on ``ranks`` ranks of this host (``mlx.launch --backend ring``); rank 0
    writes ``out``, which is returned parsed. The ranks' output passes through (rank 0's
    progress bars). Each rank gets ``cpu_count // ranks`` BLAS threads (at least one)."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env = dict(os.environ)
    if smoke:
        env["VELOX_BENCH_SMOKE"] = "1"
    else:
        env.pop("VELOX_BENCH_SMOKE", None)
    out.unlink(missing_ok=True)
    cmd = [
        launcher(),
        "--backend",
        "ring",
        "-n",
        str(ranks),
        "--starting-port",
        str(free_port(2 * ranks)),
        "--env",
        f"OPENBLAS_NUM_THREADS={threads}",
        "--python",
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
    ]
    if smoke:
        cmd.append("--smoke")
    proc = subprocess.run(cmd, env=env, timeout=timeout, check=False)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    payload: dict[str, Any] = json.loads(out.read_text())
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = SMOKE_SETTINGS if args.smoke else FULL_SETTINGS
    if args.worker is not None:
        worker(args.worker, settings)
        return
    if args.out is None:
        from velox_bench.results import results_dir

        args.out = results_dir() / "distributed.json"
    payload = launch(args.out, ranks=args.ranks, smoke=args.smoke)
    print(table(payload))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
