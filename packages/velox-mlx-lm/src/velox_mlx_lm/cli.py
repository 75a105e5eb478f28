"""``velox-generate``: generate with a Velox cache, optionally side by side with the full cache.

Flags follow ``mlx_lm.generate`` where they overlap. On Linux, importing ``velox_mlx_lm``
loads OpenBLAS before mlx when the system has it (MLX's CPU wheel links the slow reference
BLAS otherwise); set ``VELOX_BLAS=default`` to keep the default. It always prints which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

NO_PROMPT = "give a prompt: --prompt TEXT, --prompt-file FILE, --prompts-file FILE or --demo"
METHOD_HELP = (
    "the cache: "
    "tova drops the token the newest query attends to least (TOVA); "
    "tova_adapted is TOVA scored with the new key in place of the query, per KV head; "
    "h2o keeps the tokens with the most attention summed so far plus the recent ones (H2O); "
    "streaming_llm keeps the first tokens and a sliding window of the latest (StreamingLLM); "
    "snapkv cuts the prompt once, at its end, by what its last tokens attend to (SnapKV); "
    "morphkv drops the token the last few tokens' queries attend to least (MorphKV); "
    "kvzip compresses the document part of the prompt (all but its last line) once, by how "
    "much reconstructing it attends to each token, then answers (KVzip); "
    "full keeps everything (mlx-lm's own cache). Default: %(default)s"
)
# A Hugging Face repo id: owner/name, letters, digits, '-', '_' and '.' (the hub's own rule).
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def build_parser() -> argparse.ArgumentParser:
    from velox_mlx_lm.config import methods

    p = argparse.ArgumentParser(
        prog="velox-generate",
        description="Generate text with a fixed-budget Velox KV cache (TOVA and siblings).",
    )
    p.add_argument(
        "--model",
        help="a local mlx-lm model folder, a Hugging Face repo id (owner/name) or a .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        action="append",
        help="prompt text ('-' reads standard input); repeat it to generate several prompts "
        "as one batch",
    )
    src.add_argument("--prompt-file", help="file holding the prompt")
    src.add_argument(
        "--prompts-file",
        help="file with one prompt per line (blank lines skipped), generated as one batch",
    )
    src.add_argument(
        "--demo", action="store_true", help="the built-in long document and its question"
    )
    p.add_argument(
        "--max-tokens", "-m", type=int, default=256, help="tokens to generate (default: 256)"
    )
    p.add_argument("--method", choices=methods(), default="tova", help=METHOD_HELP)
    p.add_argument(
        "--budget", type=int, help="tokens kept per layer (every method but full; default: 512)"
    )
    p.add_argument(
        "--n-sink",
        type=int,
        help="first positions never evicted (tova, h2o, streaming_llm, morphkv, kvzip; default: 4)",
    )
    p.add_argument(
        "--signal",
        choices=("query", "key"),
        help="what scores the tokens: the model's true queries or the keys as a stand-in "
        "(tova, h2o, snapkv, morphkv, kvzip; default: the method's)",
    )
    p.add_argument(
        "--scope",
        choices=("layer", "head"),
        help="one eviction per layer (all KV heads drop the same token) or one per KV head "
        "(tova, h2o, morphkv; default: the method's)",
    )
    p.add_argument(
        "--prefill",
        choices=("sequential", "oneshot"),
        help="during the prompt, evict token by token as decode would, or once per chunk "
        "(tova, h2o, morphkv; default: the method's)",
    )
    p.add_argument(
        "--window",
        type=int,
        help="latest tokens whose attention decides (snapkv, default 32; morphkv, default 8)",
    )
    p.add_argument(
        "--allocation",
        choices=("global", "layer", "head"),
        help="how kvzip shares the rows out: one threshold over every head of every layer "
        "(default, the paper's), per layer across its heads, or exactly --budget per head",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on for --demo)",
    )
    p.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (default: 0, greedy)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=512,
        help="prompt tokens per forward pass while prefilling (default: 512)",
    )
    p.add_argument(
        "--quantized",
        action="store_true",
        help="keep a GGUF's 4/8-bit layers quantized (default: float32, faster on CPU)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the full cache and print both answers side by side",
    )
    p.add_argument(
        "--draft-model",
        help="speculative decoding with this draft model: 'embedded:layers=N' (the first N "
        "layers of the main model, a llama-architecture one), or a model path/repo/.gguf like "
        "--model; it gets a Velox cache of the same method",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="tokens the draft model proposes per round (default: 3; needs --draft-model)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable stats only")
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The KVCacheConfig the flags describe; flags that the method has no use for are errors."""
    from velox_mlx_lm.config import KVCacheConfig, config_fields

    method = args.method
    config = KVCacheConfig(method=method)
    policy = config.policy
    # A flag applies when the method's policy has the setting (config field `<policy>_<flag>`).
    known = config_fields()
    given = {
        "budget": args.budget,
        "n_sink": args.n_sink,
        "signal": args.signal,
        "scope": args.scope,
        "prefill": args.prefill,
        "window": args.window,
        "allocation": getattr(args, "allocation", None),
    }
    fields = {}
    for name, value in given.items():
        if value is None:
            continue
        if policy is None or f"{policy}_{name}" not in known:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --method {method}")
        fields[f"{policy}_{name}"] = value
    return config.replace(**fields)


@dataclass
class Run:
    label: str
    answer: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


def _kv_bytes(cache: Any) -> int:
    """Bytes of the keys and values a cache holds for its tokens (mlx-lm's KVCache reports its
    allocation, rounded up to 256-token steps; count the rows in use for a fair comparison)."""
    keys: Any = getattr(cache, "keys", None)
    if isinstance(getattr(cache, "offset", None), int) and hasattr(keys, "shape"):
        rows = min(int(cache.size()), keys.shape[2])
        return int(2 * keys.nbytes * rows // max(keys.shape[2], 1))
    return int(cache.nbytes)


def _kv_stats(caches: list[Any]) -> dict[str, Any]:
    from velox_mlx_lm.serve_cache import kept_rows

    kept = [kept_rows(c) for c in caches]
    ratios = [float(getattr(c, "compression_ratio", 1.0)) for c in caches]
    return {
        "tokens_kept_per_layer": max(kept) if kept else 0,
        "compression_ratio": max(ratios) if ratios else 1.0,
        "kv_bytes": sum(_kv_bytes(c) for c in caches),
    }


def generate_once(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    caches: list[Any],
    args: argparse.Namespace,
    label: str,
    echo: bool,
    draft: tuple[Any, list[Any]] | None = None,
) -> Run:
    """One generation; with ``draft`` (draft model, its caches) speculatively."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm  # type: ignore[import-untyped]

    mx.random.seed(args.seed)
    mx.reset_peak_memory()
    bar = tqdm(
        total=len(prompt),
        desc=f"prefill ({label})",
        unit="tok",
        file=sys.stderr,
        disable=args.json or len(prompt) <= args.prefill_step_size,
        leave=False,
    )

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    if echo:
        print(f"\n=== {label} ===", flush=True)
    run = Run(label)
    last = None
    accepted = 0
    speculative: dict[str, Any] = {}
    if draft is not None:
        speculative = {
            "draft_model": draft[0],
            "num_draft_tokens": args.num_draft_tokens,
        }
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp),
        prompt_cache=caches if draft is None else caches + draft[1],
        prefill_step_size=args.prefill_step_size,
        prompt_progress_callback=progress,
        **speculative,
    ):
        run.answer += response.text
        accepted += bool(getattr(response, "from_draft", False))
        last = response
        if echo:
            print(response.text, end="", flush=True)
    bar.close()
    if echo:
        print(flush=True)
    assert last is not None
    run.stats = {
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prefill_tokens_per_s": round(last.prompt_tps, 2),
        "decode_tokens_per_s": round(last.generation_tps, 2),
        **_kv_stats(caches),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
    }
    if draft is not None:
        run.stats["draft_tokens_accepted"] = accepted
    return run


DRAFT_LAYERS = "embedded:layers="


def _load_draft(args: argparse.Namespace, model: Any) -> Any:
    """The draft model ``--draft-model`` names (``None`` without the flag)."""
    spec = args.draft_model
    if spec is None:
        return None
    if spec.startswith(DRAFT_LAYERS):
        from velox_mlx_lm.embedded import draft_of

        try:
            layers = int(spec[len(DRAFT_LAYERS) :])
        except ValueError:
            raise ValueError(f"--draft-model {spec}: N in {DRAFT_LAYERS}N must be an int") from None
        try:
            return draft_of(model, layers)
        except ValueError as exc:
            raise ValueError(f"--draft-model {spec}: {exc}") from None
    draft_args = argparse.Namespace(**{**vars(args), "model": spec})
    return _load(draft_args)[0]


def grid(header: list[str], rows: dict[str, list[Any]], min_width: int = 14) -> str:
    """A plain-text table: one column per ``header`` entry, one line per ``rows`` key."""
    width = max(len(k) for k in rows) + 2
    cols = [max(min_width, len(h) + 2) for h in header]
    lines = ["".ljust(width) + "".join(h.rjust(c) for h, c in zip(header, cols, strict=True))]
    for key, cells in rows.items():
        lines.append(
            key.ljust(width) + "".join(str(v).rjust(c) for v, c in zip(cells, cols, strict=True))
        )
    return "\n".join(lines)


def _table(runs: list[Run]) -> str:
    keys = dict.fromkeys(key for r in runs for key in r.stats)  # kvzip adds rows
    return grid([r.label for r in runs], {k: [r.stats.get(k, "-") for r in runs] for k in keys})


def _side_by_side(runs: list[Run], width: int = 48) -> str:
    import textwrap

    wrapped = [textwrap.wrap(r.answer.strip(), width) or [""] for r in runs]
    height = max(len(w) for w in wrapped)
    lines = [" | ".join(r.label.ljust(width) for r in runs)]
    lines.append("-+-".join("-" * width for _ in runs))
    for i in range(height):
        lines.append(" | ".join((w[i] if i < len(w) else "").ljust(width) for w in wrapped))
    return "\n".join(lines)


def _blas_name() -> str:
    from velox_mlx_lm.blas import blas_in_use

    name = blas_in_use()
    if name.startswith("default") and sys.platform.startswith("linux"):
        name += "; apt-get install libopenblas0-pthread makes the float32 model ~20x faster"
    return name


def model_ref(model: str) -> str:
    """What ``--model MODEL`` names: an existing local path (``~`` expanded) or a Hugging Face
    repo id. Anything else is a path that does not exist: ``FileNotFoundError`` naming it (an
    existing file that is not a ``.gguf``: ``OSError``).

    Only an argument shaped like ``owner/name`` (and not like a path: no leading ``.``, ``/``
    or ``~``) that is not a local path is taken as a repo id, so a mistyped path is reported as
    missing rather than looked up on the hub.
    """
    path = os.path.expanduser(model)
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--model: no such GGUF file: {model}")
        return path
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise OSError(f"--model: {model} is neither a model folder nor a .gguf file")
    if HUB_REPO_ID.fullmatch(model) and ".." not in model and "--" not in model:
        return model
    raise FileNotFoundError(
        f"--model: no such file or directory: {model} (a Hugging Face model is given as owner/name)"
    )


def _load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    from velox_mlx_lm.embedded import default_model_path, load_gguf

    dequantize = not args.quantized
    if args.model is None:
        path = default_model_path()
        return (*load_gguf(path, dequantize=dequantize), f"embedded SmolLM2-135M ({path.name})")
    ref = model_ref(args.model)
    if ref.lower().endswith(".gguf"):
        return (*load_gguf(ref, dequantize=dequantize), args.model)
    import mlx_lm

    if os.path.isdir(ref):
        try:
            model, tokenizer = mlx_lm.load(ref)[:2]
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"--model: {args.model} is not an mlx-lm model folder "
                f"(no {os.path.basename(exc.filename or '') or 'model files'})"
            ) from exc
        return model, tokenizer, args.model
    try:
        model, tokenizer = mlx_lm.load(ref)[:2]
    except OSError as exc:  # the hub's errors (not found, offline) are OSErrors
        detail = " ".join(str(exc).split())
        raise FileNotFoundError(
            f"--model: {ref} is not a local path and could not be fetched from the Hugging "
            f"Face hub: {detail}"
        ) from exc
    return model, tokenizer, args.model


def _load_for_launch(args: argparse.Namespace, pipeline: bool = False) -> tuple[Any, Any, str]:
    """``_load``, sharded over the ranks when run by ``mlx.launch`` with several
    (docs/distributed.md): a model folder or repo through ``mlx_lm.utils.sharded_load``, a GGUF
    (the embedded model too) by ``model.shard``; ``pipeline`` asks for pipeline parallelism
    instead of tensor parallelism (``velox-serve --pipeline``, as in ``mlx_lm.server``). Ranks
    other than 0 print nothing."""
    from velox_mlx_lm.distributed import shard_model, world

    group = world()
    if group is None:
        return _load(args)
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    ref = None if args.model is None else model_ref(args.model)
    if ref is not None and not ref.lower().endswith(".gguf"):
        from mlx_lm.utils import sharded_load

        groups = {"pipeline_group": group} if pipeline else {"tensor_group": group}
        model, tokenizer = sharded_load(ref, **groups)[:2]
        name = args.model
    else:
        model, tokenizer, name = _load(args)
        shard_model(model, group, pipeline=pipeline)
    how = "pipeline" if pipeline else "tensor"
    return model, tokenizer, f"{name}, sharded over {group.size()} ranks ({how} parallel)"


def _nonblank(text: str, where: str) -> str:
    if not text.strip():
        what = "is empty" if not text else "holds only whitespace"
        raise ValueError(f"{where} {what}: the prompt needs some text")
    return text


def _read_file(path: str, where: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise OSError(f"{where}: {exc.strerror or exc}") from exc


def read_prompts(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The prompt texts the flags name (several with ``--prompt`` repeated or
    ``--prompts-file``) and whether to apply the chat template; read before the model is
    loaded. ``ValueError`` for no prompt or an empty (or blank) one, ``OSError`` for a prompt
    file that cannot be read."""
    chat = bool(args.chat)
    if args.demo:
        from velox_mlx_lm.embedded import demo_prompt

        text = demo_prompt().messages()[0]["content"]
        return [text], args.chat is None or args.chat
    if args.prompt_file is not None:
        where = f"--prompt-file {args.prompt_file}"
        return [_nonblank(_read_file(args.prompt_file, where), where)], chat
    if args.prompts_file is not None:
        where = f"--prompts-file {args.prompts_file}"
        lines = _read_file(args.prompts_file, where).splitlines()
        texts = [line for line in lines if line.strip()]
        if not texts:
            raise ValueError(f"{where} holds no prompt (one prompt per non-blank line)")
        return texts, chat
    if not args.prompt:
        raise ValueError(NO_PROMPT)
    texts = []
    for i, prompt in enumerate(args.prompt):
        where = "--prompt" if len(args.prompt) == 1 else f"--prompt #{i + 1}"
        if prompt == "-":
            prompt, where = sys.stdin.read(), "standard input (--prompt -)"
        texts.append(_nonblank(prompt, where))
    return texts, chat


def _prompt_tokens(text: str, chat: bool, tokenizer: Any) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.prefill_step_size < 1:
            raise ValueError(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
        if args.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
        if args.draft_model is not None and config.policy == "kvzip":
            raise ValueError("--draft-model does not apply to --method kvzip")
        if args.draft_model is not None and config.policy is not None and not config.trim_window:
            raise ValueError("--draft-model needs a trimmable cache")
        if not (args.prompt or args.prompt_file or args.prompts_file or args.demo):
            raise ValueError(NO_PROMPT)  # before loading a model for nothing
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    # Everything that can be checked without the model is, before loading it.
    try:
        if args.model is not None:
            model_ref(args.model)
        texts, chat = read_prompts(args)
        if len(texts) > 1:
            if args.draft_model is not None:
                raise ValueError("--draft-model generates one prompt at a time, not a batch")
            if config.policy == "kvzip":
                raise ValueError("--method kvzip compresses one document at a time, not a batch")
    except OSError as exc:  # a missing model path or prompt file
        return _error(exc)
    except ValueError as exc:  # no prompt, an empty one, or a prompt file that is not UTF-8
        parser.error(str(exc))
    from velox_mlx_lm.builder import KVCacheBuilder
    from velox_mlx_lm.config import KVCacheConfig

    echo = not args.json
    try:
        started = time.perf_counter()
        model, tokenizer, model_name = _load_for_launch(args)
        draft_model = _load_draft(args, model)
        prompts = [_prompt_tokens(text, chat, tokenizer) for text in texts]
    except (ValueError, OSError) as exc:
        return _error(exc)
    if len(prompts) > 1:
        from velox_mlx_lm.cli_batch import generate_batch, print_batch

        batch_runs = []
        if args.compare and config.method != "full":
            full_config = KVCacheConfig(method="full")
            batch_runs.append(generate_batch(model, tokenizer, prompts, full_config, args, "full"))
        batch_runs.append(generate_batch(model, tokenizer, prompts, config, args, _label(config)))
        print_batch(
            batch_runs, model_name, _blas_name(), config, time.perf_counter() - started, args
        )
        return 0
    prompt, text = prompts[0], texts[0]

    def drafting(config: Any) -> tuple[Any, list[Any]] | None:
        if draft_model is None:
            return None
        return draft_model, KVCacheBuilder.for_model(draft_model, config)

    if echo:
        print(f"model: {model_name}  |  BLAS: {_blas_name()}  |  prompt: {len(prompt)} tokens")
    runs = []
    if args.compare and config.method != "full":
        full_config = KVCacheConfig(method="full")
        full = KVCacheBuilder.for_model(model, full_config)
        draft = drafting(full_config)
        runs.append(generate_once(model, tokenizer, prompt, full, args, "full", echo, draft))
    caches = KVCacheBuilder.for_model(model, config)
    label = _label(config)
    if config.policy == "kvzip":
        try:
            runs.append(_kvzip_run(model, tokenizer, text, chat, caches, args, label, echo))
        except ValueError as exc:
            return _error(exc)
    else:
        runs.append(
            generate_once(model, tokenizer, prompt, caches, args, label, echo, drafting(config))
        )
    elapsed = time.perf_counter() - started
    if args.json:
        print(
            json.dumps(
                {
                    "model": model_name,
                    "blas": _blas_name(),
                    "config": {"method": config.method, **config.settings()},
                    "runs": [{"label": r.label, "answer": r.answer, **r.stats} for r in runs],
                    "seconds": round(elapsed, 2),
                },
                indent=2,
            )
        )
        return 0
    if len(runs) > 1:
        print("\n" + _side_by_side(runs))
    print("\n" + _table(runs))
    print(f"\ntotal time: {elapsed:.1f} s")
    return 0


def split_document(text: str, chat: bool, tokenizer: Any) -> tuple[list[int], list[int]]:
    """``--method kvzip``: the prompt's tokens as (document, rest). The document is the prompt
    minus its last non-empty line (the question; for ``--demo``, the demo's question), with the
    chat template's opening where it applies; the rest is the question and the template's
    closing."""
    body = text.rstrip()
    cut = body.rfind("\n")
    if cut <= 0 or not body[:cut].strip():
        raise ValueError("--method kvzip needs a document and, on its last line, the question")
    full = _prompt_tokens(text, chat, tokenizer)
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        head = rendered[: rendered.index(text) + cut]
        document = list(tokenizer.encode(head, add_special_tokens=False))
    else:
        document = list(tokenizer.encode(text[:cut]))
    n = 0  # the longest common prefix (token merges may differ at the boundary)
    while n < min(len(document), len(full) - 1) and document[n] == full[n]:
        n += 1
    return full[:n], full[n:]


def _kvzip_run(
    model: Any,
    tokenizer: Any,
    text: str,
    chat: bool,
    caches: list[Any],
    args: argparse.Namespace,
    label: str,
    echo: bool,
) -> Run:
    """Prefill the document, compress it (KVzip), then generate the answer to the rest."""
    from velox_mlx_lm.compress import compress, prefill

    document, rest = split_document(text, chat, tokenizer)
    started = time.perf_counter()
    prefill(model, caches, document, step=args.prefill_step_size)
    prefilled = time.perf_counter()
    info = compress(model, tokenizer, caches, document)
    scored = time.perf_counter()
    run = generate_once(model, tokenizer, rest, caches, args, label, echo)
    run.stats = {
        "document_tokens": len(document),
        **run.stats,
        "document_prefill_s": round(prefilled - started, 2),
        "kvzip_scoring_s": round(scored - prefilled, 2),
        "kvzip_scored_tokens": info["scored_tokens"],
    }
    return run


def _error(exc: BaseException) -> int:
    """Report a runtime error the argparse way (``velox-generate: error: ...``); exit status 1."""
    print(f"velox-generate: error: {exc}", file=sys.stderr)
    return 1


def _budget(config: Any) -> int:
    return int(config.settings()["budget"])


def _label(config: Any) -> str:
    """A run's name in the output: the method, with its budget when it evicts."""
    return config.method if config.policy is None else f"{config.method}({_budget(config)})"


if __name__ == "__main__":
    sys.exit(main())
