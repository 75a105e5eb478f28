"""``python -m velox_bench.model_speed``: load time and speed of each embedded model.

For each model: the seconds :func:`velox_mlx_lm.embedded.load` takes (the Qwen file assembled
already), prefill tokens/s over a 1,024-token prompt fed in chunks of 256, and decode tokens/s
over 16 single-token steps after it, with mlx-lm's own cache (the model's speed, not a Velox
method's). The size is the GGUF file's. Writes ``benchmarks/results/model_speed.json`` and
prints a table (the README's embedded-models table quotes it).

    python -m velox_bench.model_speed                      # every embedded model
    python -m velox_bench.model_speed --models smollm2-135m
"""

from __future__ import annotations

import velox_blas

velox_blas.preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from velox_bench.quality.run import environment, repo_root  # noqa: E402

PROMPT, CHUNK, STEPS = 1024, 256, 16


def measure(name: str) -> dict[str, Any]:
    """One model's row: load seconds, file size, prefill and decode tokens/s."""
    from velox_mlx_lm.embedded import MODELS, load, model_path

    size = model_path(name).stat().st_size
    began = time.perf_counter()
    model, _ = load(name)
    loaded = time.perf_counter() - began
    ids = mx.array([[1000 + i % 5000 for i in range(PROMPT)]], dtype=mx.int32)
    cache = make_prompt_cache(model)
    began = time.perf_counter()
    for start in range(0, PROMPT, CHUNK):
        model(ids[:, start : start + CHUNK], cache=cache)
        mx.eval([c.state for c in cache])
    prefill = PROMPT / (time.perf_counter() - began)
    token = ids[:, -1:]
    began = time.perf_counter()
    for _ in range(STEPS):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token, [c.state for c in cache])
    decode = STEPS / (time.perf_counter() - began)
    return {
        "model": name,
        "title": MODELS[name].title,
        "file_bytes": size,
        "load_seconds": round(loaded, 1),
        "prefill_tokens_per_s": round(prefill, 2),
        "decode_tokens_per_s": round(decode, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    from velox_mlx_lm.embedded import MODELS

    p = argparse.ArgumentParser(prog="python -m velox_bench.model_speed", description=__doc__)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or repo_root() / "benchmarks" / "results" / "model_speed.json"
    rows = [measure(name) for name in args.models.split(",") if name]
    print(f"{'model':<22} {'MB':>7} {'load s':>7} {'prefill t/s':>12} {'decode t/s':>11}")
    for r in rows:
        print(
            f"{r['model']:<22} {r['file_bytes'] / 1e6:7.0f} {r['load_seconds']:7.1f} "
            f"{r['prefill_tokens_per_s']:12.2f} {r['decode_tokens_per_s']:11.3f}"
        )
    saved = json.loads(out.read_text()) if out.is_file() else {}
    saved.setdefault("rows", {}).update({r["model"]: r for r in rows})
    saved["environment"] = environment()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
