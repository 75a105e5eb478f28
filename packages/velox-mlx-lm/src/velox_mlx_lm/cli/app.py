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
from dataclasses import dataclass
from typing import Any

from velox_mlx_lm.builder import KVCacheBuilder
from velox_mlx_lm.cli.batch import generate_batch, print_batch
from velox_mlx_lm.cli.document import document_run, prompt_tokens
from velox_mlx_lm.cli.generation import (
    Run,
    generate_once,
    quant_stats,
    quantized,
    side_by_side,
    table,
)
from velox_mlx_lm.config import FULL, KVCacheConfig
from velox_mlx_lm.flags import (
    add_demote_flags,
    add_method_flags,
    add_positions_flag,
    add_quant_flags,
    check_quantized_start,
    config_from_args,
    layout_warning,
)
from velox_mlx_lm.help import arrange
from velox_mlx_lm.pins import pin_prefix

NO_PROMPT = "give a prompt: --prompt TEXT, --prompt-file FILE, --prompts-file FILE or --demo"
# A Hugging Face repo id: owner/name, letters, digits, '-', '_' and '.' (the hub's own rule).
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


USAGE = "%(prog)s (--prompt TEXT | --prompt-file FILE | --demo) [options]"
EXAMPLES = """examples:
  velox-generate --compare --demo --method tova --budget 512
  velox-generate --chat --prompt "What is the capital of France?" --budget 64 --kv-bits 4
"""
# The first screen (--help): these flags, grouped, with one-line helps; --help-all shows all.
HELP_GROUPS = (
    ("model and prompt", ("--model", "--prompt", "--prompt-file", "--prompts-file", "--demo")),
    ("generation", ("--chat", "--max-tokens", "--temp", "--draft-model", "--pin-prefix")),
    (
        "method and budget",
        ("--method", "--budget", "--n-sink", "--window", "--allocation", "--positions"),
    ),
    (
        "memory and quantization",
        ("--kv-bits", "--kv-key-layout", "--kv-group-size", "--demote-bits", "--demote-budget"),
    ),
    ("output", ("--compare", "--json")),
)
HELP_BRIEFS = {
    "--model": "embedded:smollm2-135m (default), a model folder, owner/name or a .gguf",
    "--prompt": "the prompt ('-': standard input); repeat it for a batch",
    "--prompt-file": "file holding the prompt",
    "--prompts-file": "one prompt per line, generated as one batch",
    "--demo": "the built-in long document and its question",
    "--chat": "apply the chat template (default: on for --demo)",
    "--max-tokens": "tokens to generate (default: 256)",
    "--temp": "sampling temperature (default: 0, greedy)",
    "--draft-model": "speculative decoding: 'embedded:layers=N' or a model",
    "--pin-prefix": "never evict the prompt's first N tokens (default: 0)",
    "--compare": "also run the full cache; print both answers side by side",
    "--json": "print machine-readable stats only",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="velox-generate",
        description="Generate text with a fixed-budget Velox KV cache (TOVA and siblings).",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="an embedded model (embedded:smollm2-135m, the default, embedded:gemma3-270m or "
        "embedded:qwen2.5-coder-1.5b), a local mlx-lm model folder, a Hugging Face repo id "
        "(owner/name) or a .gguf file (llama, qwen2 or gemma3)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="prompt text ('-' reads standard input); repeat it to generate several prompts "
        "as one batch",
    )
    src.add_argument("--prompt-file", metavar="FILE", help="file holding the prompt")
    src.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="file with one prompt per line (blank lines skipped), generated as one batch",
    )
    src.add_argument(
        "--demo", action="store_true", help="the built-in long document and its question"
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=256,
        metavar="N",
        help="tokens to generate (default: 256)",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on for --demo)",
    )
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature (default: 0, greedy)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="random seed for sampling (default: 0)"
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=512,
        metavar="N",
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
        metavar="MODEL",
        help="speculative decoding with this draft model: 'embedded:layers=N' (the first N "
        "layers of the main model, a llama-architecture one), or a model path/repo/.gguf like "
        "--model; it gets a Velox cache of the same method",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        metavar="N",
        help="tokens the draft model proposes per round (default: 3; needs --draft-model)",
    )
    p.add_argument(
        "--pin-prefix",
        type=int,
        default=0,
        metavar="N",
        help="never evict the prompt's first N tokens (a system prompt, tool definitions): "
        "they count in the budget (default: 0)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable stats only")
    add_quant_flags(p)
    add_method_flags(p)
    add_positions_flag(p)
    add_demote_flags(p)
    arrange(p, USAGE, HELP_GROUPS, HELP_BRIEFS, EXAMPLES)
    return p


def _load_draft(args: argparse.Namespace, model: Any) -> Any:
    """The draft model ``--draft-model`` names (``None`` without the flag)."""
    spec = args.draft_model
    if spec is None:
        return None
    from velox_mlx_lm.embedded import DRAFT_LAYERS, draft_of

    if spec.startswith(DRAFT_LAYERS):
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


def _blas_name() -> str:
    from velox_blas import blas_in_use

    name = blas_in_use()
    if name.startswith("default") and sys.platform.startswith("linux"):
        name += "; apt-get install libopenblas0-pthread makes the float32 model ~20x faster"
    return name


def model_ref(model: str) -> str:
    """What ``--model MODEL`` names: an embedded model (``embedded:NAME``, returned as given;
    ``ValueError`` for an unknown name), an existing local path (``~`` expanded) or a Hugging
    Face repo id. Anything else is a path that does not exist: ``FileNotFoundError`` naming it
    (an existing file that is not a ``.gguf``: ``OSError``).

    Only an argument shaped like ``owner/name`` (and not like a path: no leading ``.``, ``/``
    or ``~``) that is not a local path is taken as a repo id, so a mistyped path is reported as
    missing rather than looked up on the hub.
    """
    from velox_mlx_lm.embedded import resolve

    if resolve(model) is not None:
        return model
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
    from velox_mlx_lm.embedded import MODELS, load, load_gguf, resolve

    dequantize = not args.quantized
    embedded = resolve(args.model)
    if embedded is not None:
        model, tokenizer = load(embedded, dequantize=dequantize)
        return model, tokenizer, f"embedded:{embedded} ({MODELS[embedded].title})"
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
    from velox_mlx_lm.embedded import resolve

    ref = None if resolve(args.model) is not None else model_ref(args.model)
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


def _check_args(args: argparse.Namespace) -> Any:
    """The config, once every flag that can be checked without the model is (``ValueError``)."""
    config = config_from_args(args)
    check_quantized_start(args, velox=True)
    for name in ("max_tokens", "prefill_step_size", "num_draft_tokens"):
        if getattr(args, name) < 1:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.pin_prefix < 0:
        raise ValueError(f"--pin-prefix must be >= 0, got {args.pin_prefix}")
    record = config.record
    if args.draft_model is not None and record is not None:
        if record.compressor is not None:
            raise ValueError(f"--draft-model does not apply to --method {config.method}")
        if not config.trim_window:
            raise ValueError("--draft-model needs a trimmable cache")
    if not (args.prompt or args.prompt_file or args.prompts_file or args.demo):
        raise ValueError(NO_PROMPT)  # before loading a model for nothing
    return config


def _check_batch(args: argparse.Namespace, config: Any, texts: list[str]) -> None:
    if len(texts) < 2:
        return
    if args.draft_model is not None:
        raise ValueError("--draft-model generates one prompt at a time, not a batch")
    if config.record is not None and config.record.compressor is not None:
        raise ValueError(f"--method {config.method} compresses one document at a time, not a batch")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = _check_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    warning = layout_warning(args, config)
    if warning is not None:
        print(f"velox-generate: warning: {warning}", file=sys.stderr)
    # Everything that can be checked without the model is, before loading it.
    try:
        if args.model is not None:
            model_ref(args.model)
        texts, chat = read_prompts(args)
        _check_batch(args, config, texts)
    except OSError as exc:  # a missing model path or prompt file
        return _error(exc)
    except ValueError as exc:  # no prompt, an empty one, or a prompt file that is not UTF-8
        parser.error(str(exc))
    started = time.perf_counter()
    try:
        model, tokenizer, model_name = _load_for_launch(args)
        draft_model = _load_draft(args, model)
        prompts = [prompt_tokens(text, chat, tokenizer) for text in texts]
        _check_pin_prefix(args, prompts)
    except (ValueError, OSError) as exc:
        return _error(exc)
    loaded = Loaded(model, tokenizer, model_name, draft_model, started)
    if len(prompts) > 1:
        return _batch(loaded, prompts, config, args)
    try:
        runs = _single(loaded, prompts[0], texts[0], chat, config, args)
    except ValueError as exc:
        return _error(exc)
    _report(loaded, runs, config, args)
    return 0


def _check_pin_prefix(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    shortest = min(len(p) for p in prompts)
    if args.pin_prefix > shortest:
        raise ValueError(
            f"--pin-prefix {args.pin_prefix} is longer than the prompt ({shortest} tokens)"
        )


@dataclass(frozen=True)
class Loaded:
    """The model, tokenizer and draft model of one run of the command."""

    model: Any
    tokenizer: Any
    name: str
    draft: Any
    started: float


def _batch(loaded: Loaded, prompts: list[list[int]], config: Any, args: argparse.Namespace) -> int:
    """Several prompts as one batch (and the full cache's batch with ``--compare``)."""
    runs = []
    if args.compare and config.method != FULL:
        full = KVCacheConfig(method=FULL)
        runs.append(generate_batch(loaded.model, loaded.tokenizer, prompts, full, args, FULL))
    runs.append(
        generate_batch(loaded.model, loaded.tokenizer, prompts, config, args, _label(config))
    )
    elapsed = time.perf_counter() - loaded.started
    print_batch(runs, loaded.name, _blas_name(), config, elapsed, args)
    return 0


def _single(
    loaded: Loaded,
    prompt: list[int],
    text: str,
    chat: bool,
    config: Any,
    args: argparse.Namespace,
) -> list[Run]:
    """One prompt: the full cache first with ``--compare``, then the configured one (a policy
    with a model-driven phase compresses the prompt's document first)."""
    model, tokenizer, echo = loaded.model, loaded.tokenizer, not args.json

    def drafting(cfg: Any) -> tuple[Any, list[Any]] | None:
        if loaded.draft is None:
            return None
        return loaded.draft, pin_prefix(
            KVCacheBuilder.for_model(loaded.draft, cfg.for_draft()), args.pin_prefix
        )

    if echo:
        print(f"model: {loaded.name}  |  BLAS: {_blas_name()}  |  prompt: {len(prompt)} tokens")
    runs = []
    if args.compare and config.method != FULL:
        full_config = KVCacheConfig(method=FULL)
        full = KVCacheBuilder.for_model(model, full_config)
        runs.append(
            generate_once(model, tokenizer, prompt, full, args, FULL, echo, drafting(full_config))
        )
        runs[-1].stats.update(quant_stats(full_config))
    caches = pin_prefix(KVCacheBuilder.for_model(model, config), args.pin_prefix)
    label = _label(config)
    if config.record is not None and config.record.compressor is not None:
        runs.append(document_run(model, tokenizer, text, chat, caches, args, label, echo))
    else:
        runs.append(
            generate_once(model, tokenizer, prompt, caches, args, label, echo, drafting(config))
        )
    runs[-1].stats.update(quant_stats(config))
    return runs


def _report(loaded: Loaded, runs: list[Run], config: Any, args: argparse.Namespace) -> None:
    elapsed = time.perf_counter() - loaded.started
    if args.json:
        report = {
            "model": loaded.name,
            "blas": _blas_name(),
            "config": {"method": config.method, **config.settings(), **quantized(config)},
            "runs": [{"label": r.label, "answer": r.answer, **r.stats} for r in runs],
            "seconds": round(elapsed, 2),
        }
        print(json.dumps(report, indent=2))
        return
    if len(runs) > 1:
        print("\n" + side_by_side(runs))
    print("\n" + table(runs))
    print(f"\ntotal time: {elapsed:.1f} s")


def _error(exc: BaseException) -> int:
    """Report a runtime error the argparse way (``velox-generate: error: ...``); exit status 1."""
    print(f"velox-generate: error: {exc}", file=sys.stderr)
    return 1


def _budget(config: Any) -> int:
    return int(config.settings()["budget"])


def _label(config: Any) -> str:
    """A run's name in the output: the method, with its budget when it evicts."""
    return config.method if config.policy is None else f"{config.method}({_budget(config)})"
