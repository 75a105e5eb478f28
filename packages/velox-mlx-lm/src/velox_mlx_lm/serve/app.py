"""``velox-serve``: mlx-lm's OpenAI-compatible server with a Velox cache for every sequence.

mlx-lm's own server (``mlx_lm.server``) does the HTTP, the batching (``BatchGenerator``), the
one-at-a-time path and the prompt cache; this module plugs into it and forks none of it:

- the flags are mlx-lm's server flags (its parser, taken from ``mlx_lm.server.main``) plus
  ``velox-generate``'s method flags; the model is loaded like ``velox-generate`` (the embedded
  model by default, an mlx-lm folder or a GGUF) and its ``make_cache`` makes Velox caches;
- :class:`~velox_mlx_lm.serve.cache.VeloxPromptCache` keeps prompt-cache reuse exact;
- the request handler adds checks (4xx JSON errors), ``GET /v1/velox/stats`` and a ``velox``
  field in ``usage``; ``BatchGenerator`` and ``stream_generate`` are wrapped to watch the
  live sequences (see docs/serving.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from http.server import ThreadingHTTPServer
from queue import Empty
from typing import Any

import mlx.core as mx
import mlx_lm.server as mlx_server
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch
from mlx_lm.models.cache import make_prompt_cache

from velox_mlx_lm.batch_cache import BatchVeloxKVCache
from velox_mlx_lm.flags import (
    LOW_BITS,
    POSITIONS_HELP,
    add_method_flags,
    check_quantized_start,
    config_from_args,
    layout_warning,
)
from velox_mlx_lm.help import arrange
from velox_mlx_lm.serve import auth as serve_auth
from velox_mlx_lm.serve import memory as serve_memory
from velox_mlx_lm.serve import release as serve_release
from velox_mlx_lm.serve.cache import (
    VeloxPromptCache,
    cache_nbytes,
    combine_layers,
    kv_stats,
    layer_roles,
)
from velox_mlx_lm.serve.errors import ANTHROPIC_KINDS, BadRequest
from velox_mlx_lm.serve.memory import SHUTTING_DOWN
from velox_mlx_lm.serve.messages import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    error_body,
    parse_request,
    serve_messages,
)
from velox_mlx_lm.serve.pacing import Pacer
from velox_mlx_lm.serve.pins import check_max_pinned, system_span
from velox_mlx_lm.serve.sequences import (
    FREE_WAIT_S,
    ClientGone,
    SequenceTracker,
    TrackedQueue,
    client_gone,
    freed_of,
)
from velox_mlx_lm.serve.tools import (
    fenced_tool_call,
    render_tools_as_text,
    template_renders_tools,
    tool_names,
)

LOG = logging.getLogger("velox-serve")
# velox-generate's flags that choose and shape the cache (the rest are mlx-lm's server flags).
# velox-generate's flags velox-serve shares besides the method flags (velox_mlx_lm.flags).
VELOX_FLAGS: tuple[str, ...] = (
    *("--quantized", "--kv-key-layout", "--positions", "--demote-bits", "--demote-budget"),
)
STATS_PATH = "/v1/velox/stats"
STOP_JOIN_S = 10.0  # how long shutdown waits for the generation step in progress
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/chat/completions", MESSAGES_PATH)
# --max-prompt-tokens' default: a prompt the 2-core reference machine prefills in minutes, not
# hours, with the embedded model; within the model's context the context is the limit.
DEFAULT_MAX_PROMPT_TOKENS = 131_072
STATS_WAIT_S = 0.2  # how long the request log line waits for stats not collected yet


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _mlx_server_parser() -> argparse.ArgumentParser:
    """The parser ``mlx_lm.server.main`` builds (caught at ``parse_args``), so that every flag
    keeps mlx-lm's name, default and help."""

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        mlx_server.main()
    except _Parser as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError("mlx_lm.server.main() did not parse arguments")


USAGE = "%(prog)s [--model MODEL] [--method METHOD] [--budget N] [options]"
EXAMPLES = """examples:
  velox-serve --method tova --budget 1024 --port 8080
  velox-serve --model owner/name --budget 2048 --kv-bits 4 --max-memory 6GB
"""
# The first screen (--help): these flags, grouped, with one-line helps; --help-all shows all,
# mlx-lm's own server flags among them.
HELP_GROUPS = (
    ("model", ("--model", "--draft-model")),
    (
        "serving",
        ("--host", "--port", "--api-key", "--max-tokens", "--decode-concurrency"),
    ),
    (
        "method and budget",
        ("--method", "--budget", "--n-sink", "--window", "--allocation", "--positions"),
    ),
    (
        "memory and quantization",
        (
            "--kv-bits",
            "--kv-key-layout",
            "--demote-bits",
            "--demote-budget",
            "--max-memory",
            "--max-queue",
            "--beyond-context",
            "--max-prompt-tokens",
            "--max-pinned",
        ),
    ),
)
HELP_BRIEFS = {
    "--model": "embedded:smollm2-135m (default), a model folder, owner/name or a .gguf",
    "--draft-model": "speculative decoding (one request at a time)",
    "--kv-bits": "quantize the cache to N bits; batching stays on (Velox methods)",
    "--host": "address to listen on (default: 127.0.0.1)",
    "--port": "port to listen on (default: 8080)",
    "--api-key": f"require this key (default: ${serve_auth.ENV_VAR}, else none)",
    "--max-tokens": "default tokens per answer (default: 512)",
    "--decode-concurrency": "requests decoded together (default: 32)",
    "--max-memory": "bound on the KV bytes: 6GB, 512MB or a fraction of RAM",
    "--max-queue": "requests that may wait for memory (default: 64)",
    "--beyond-context": "let sequences go past the model's context",
    "--max-prompt-tokens": f"longest prompt (default: {DEFAULT_MAX_PROMPT_TOKENS})",
    "--max-pinned": "system prompt + tools tokens pinned (default: half the budget)",
}
# mlx-lm's help of these flags says what they do in mlx-lm; Velox changes it.
KV_BITS_HELP = (
    "keep the cache's rows quantized to this many bits (1-6 or 8): with a Velox method the "
    "caches quantize them and batching stays on; with --method full it is mlx-lm's "
    "QuantizedKVCache, which serves requests one at a time (default: the model's precision)"
)
QUANTIZED_START_HELP = (
    "with a Velox method only 0 (the default): rows are quantized as they arrive; with "
    "--method full the position where mlx-lm starts quantizing "
    f"(default there: {mlx_server.DEFAULT_QUANTIZED_KV_START})"
)


def build_parser() -> argparse.ArgumentParser:
    from velox_mlx_lm.cli.app import build_parser as generate_parser

    parser = _mlx_server_parser()
    parser.prog = "velox-serve"
    parser.description = (
        "mlx-lm's OpenAI-compatible server (/v1/chat/completions, /v1/completions,\n"
        "/v1/models) with a fixed-budget Velox KV cache for every sequence;\n"
        f"GET {STATS_PATH} reports the caches. See docs/serving.md."
    )
    helps = {
        "--model": "an embedded model (embedded:smollm2-135m, the default; "
        "embedded:gemma3-270m, a base model: /v1/completions only; "
        "embedded:qwen2.5-coder-1.5b, chat with tool calls), a local mlx-lm model "
        "folder, a Hugging Face repo id (owner/name) or a .gguf file",
        "--draft-model": "speculative decoding (requests are then served one at a time): "
        "'embedded:layers=N' or a model like --model; it gets a Velox cache too",
        "--kv-bits": KV_BITS_HELP,
        "--quantized-kv-start": QUANTIZED_START_HELP,
    }
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in helps:
                action.help = helps[flag]
            if action.metavar is None and action.nargs != 0 and action.choices is None:
                action.metavar = "N" if action.type in (int, float) else "VALUE"
        if "--model" in action.option_strings or "--draft-model" in action.option_strings:
            action.metavar = "MODEL"
    ours = generate_parser()
    for action in ours._actions:
        if any(flag in VELOX_FLAGS for flag in action.option_strings):
            if "--positions" in action.option_strings:  # its default follows --beyond-context
                action = copy.copy(action)
                action.help = (
                    f"{POSITIONS_HELP} (default: compact with --beyond-context where the method "
                    "allows it, else absolute)"
                )
                action.velox_brief = "absolute or compact (default: compact with --beyond-context)"  # type: ignore[attr-defined]
            parser._add_action(action)
    add_method_flags(parser)
    add_serving_flags(parser)
    parser.set_defaults(quantized_kv_start=None)  # None: not given (see _check_args)
    arrange(parser, USAGE, HELP_GROUPS, HELP_BRIEFS, EXAMPLES)
    return parser


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """The flags for long agent sessions (docs/serving.md#agents)."""
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help=f"require this key on every route but /health ('Authorization: Bearer KEY' or "
        f"'x-api-key: KEY'); default: ${serve_auth.ENV_VAR}, else no key",
    )
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        type=serve_memory.parse_max_memory,
        default=None,
        help="bound on the KV bytes of live sequences and the prompt cache together: a size "
        "(6GB, 512MB, bytes) or a fraction in (0, 1) of the RAM left after the weights "
        f"(default {serve_memory.DEFAULT_FRACTION}); printed at start",
    )
    parser.add_argument(
        "--max-queue",
        metavar="N",
        type=int,
        default=64,
        help="requests that may wait for memory; past it they get 503 (default 64)",
    )
    parser.add_argument(
        "--beyond-context",
        action="store_true",
        help="let prompts and generations go past the model's context (bounded methods only)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        metavar="N",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="longest prompt a request may have, with --beyond-context too; longer ones get "
        f"400 'prompt is too long' (default {DEFAULT_MAX_PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--max-pinned",
        metavar="N",
        type=int,
        default=None,
        help="tokens of a conversation's system prompt and tool definitions the server pins "
        "(never evicted, counted in the budget); longer ones get 400; 0 pins nothing "
        "(default: half the budget)",
    )
    parser.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="on SIGTERM or Ctrl-C, seconds the requests in flight may take to finish before "
        "their streams are ended; new requests get 503 meanwhile (default 60)",
    )


class VeloxModelProvider(mlx_server.ModelProvider):
    """Serves one model, loaded like ``velox-generate`` loads it, whose ``make_cache`` makes
    the configured Velox caches; other model names, adapters and draft models are refused."""

    def __init__(self, cli_args: argparse.Namespace, config: Any) -> None:
        super().__init__(cli_args)
        self.config = config
        self.name = "velox-embedded" if cli_args.model is None else cli_args.model
        self.names = {"default_model", self.name}
        if cli_args.model is not None:
            self.names.add(os.path.abspath(os.path.expanduser(cli_args.model)))
        self.context_length: int | None = None
        self.layer_roles: dict[str, Any] | None = None  # which layers evict, once loaded
        self.renders_tools = False  # whether the chat template renders tools (else: as text)

    def max_tokens_limit(self) -> int | None:
        """The most ``max_tokens`` a request may ask for: the model's context length, unless
        ``--beyond-context`` lets generations go past it (then only the memory bound limits)."""
        if self.cli_args.beyond_context:
            return None
        return self.context_length

    def check_max_tokens(self, max_tokens: Any) -> None:
        limit = self.max_tokens_limit()
        if isinstance(max_tokens, int) and limit is not None and max_tokens > limit:
            raise BadRequest(
                f"max_tokens is {max_tokens}, above this server's limit of {limit} "
                "(the model's context length)",
                400,
                "max_tokens_too_large",
            )

    def load_default(self) -> None:
        self.load("default_model")

    def load(self, model_path: Any, adapter_path: Any = None, draft_model_path: Any = None) -> Any:
        if model_path not in self.names:
            raise ValueError(f"model {model_path!r} is not served here (this server: {self.name})")
        if adapter_path is not None:
            raise ValueError("velox-serve does not load adapters")
        if draft_model_path not in (None, "default_model", self.cli_args.draft_model):
            raise ValueError("velox-serve serves only the draft model it was started with")
        if self.model is None:
            self._load_velox()
        return self.model, self.tokenizer

    def _load_velox(self) -> None:
        from velox_mlx_lm.builder import KVCacheBuilder
        from velox_mlx_lm.cli.app import _load_draft, _load_for_launch

        self.reset()
        gc.collect()
        # Under mlx.launch with several ranks: sharded like mlx_lm.server (tensor parallel, or
        # pipeline with --pipeline); the caches find the tensor group in the sharded layers.
        model, tokenizer, name = _load_for_launch(self.cli_args, pipeline=self.cli_args.pipeline)
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        draft = _load_draft(self.cli_args, model)
        mx.eval(model.parameters())
        config = self.config

        def velox_caches(model: Any = model) -> list[Any]:
            return KVCacheBuilder.for_model(model, config)

        model.make_cache = velox_caches
        if draft is not None:
            mx.eval(draft.parameters())
            draft.make_cache = lambda: KVCacheBuilder.for_model(draft, config.for_draft())
        args = getattr(model, "args", None)
        self.context_length = getattr(args, "max_position_embeddings", None)
        self.kv_geometry = serve_memory.probe_geometry(model)  # every rank: a forward pass
        self.weight_bytes = serve_memory.weight_bytes(model)
        self.model_key: Any = (self.name, None, self.cli_args.draft_model)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = None
        self.draft_model = draft
        self.renders_tools = template_renders_tools(tokenizer, self.cli_args.chat_template_args)
        if tokenizer.has_chat_template and not self.renders_tools:
            LOG.info("the chat template does not render tools: they go in the system text")
        caches = make_prompt_cache(model)
        self.layer_roles = layer_roles(caches)
        self.is_batchable = draft is None and all(hasattr(c, "merge") for c in caches)
        LOG.info("loaded %s; caches: %s", name, describe(config))


def describe(config: Any) -> str:
    if config.policy is None:
        return f"{config.method} (mlx-lm's own, unbounded)"
    return f"{config.method} {config.settings()}"


class Monitor:
    """What ``GET /v1/velox/stats`` and the ``usage.velox`` field report.

    The live sequences are read in the generation thread (between steps, where reading a
    cache changes nothing) into a snapshot that the HTTP threads only copy.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.lock = threading.Condition()
        self.live: list[dict[str, Any]] = []
        self.max_tokens_kept = 0  # the most any live sequence kept per layer, since start
        self.finished: dict[tuple[int, ...], deque[dict[str, Any]]] = {}
        self.order: deque[tuple[int, ...]] = deque()
        self.completed = 0
        self.prefill_tokens = 0  # prompt tokens run through the model (batched path), all told
        self.started = time.time()
        self.on_live: Any = None  # called with the live sequences' bytes after every step
        self.on_end: Any = None  # called with idle=bool after a step in which sequences ended

    # -- generation thread -----------------------------------------------------------------
    def prefilled(self, tokens: int) -> None:
        with self.lock:
            self.prefill_tokens += tokens

    def set_live(self, rows: list[dict[str, Any]]) -> None:
        with self.lock:
            ended = len(rows) < len(self.live)
            self.live = rows
            for row in rows:
                self.max_tokens_kept = max(self.max_tokens_kept, row["tokens_kept"])
        if self.on_live is not None:
            self.on_live(sum(row["cache_bytes"] for row in rows))
        if ended and self.on_end is not None:
            self.on_end(idle=not rows)

    def finish(self, tokens: list[int], caches: list[Any]) -> None:
        stats = kv_stats(caches)
        LOG.info(
            "sequence done: %d tokens seen, %d kept per layer (compression %.2fx), "
            "KV %.2f MB (%.2f MB with the cache's other state)",
            stats["tokens_seen"],
            stats["tokens_kept"],
            stats["compression_ratio"],
            stats["kv_bytes"] / 1e6,
            stats["cache_bytes"] / 1e6,
        )
        key = tuple(tokens)
        with self.lock:
            self.completed += 1
            self.max_tokens_kept = max(self.max_tokens_kept, stats["tokens_kept"])
            self.finished.setdefault(key, deque()).append({**stats, "tokens": len(tokens)})
            self.order.append(key)
            while len(self.order) > 256:  # requests whose client left never collect theirs
                old = self.order.popleft()
                if old in self.finished:
                    self.finished[old].popleft()
                    if not self.finished[old]:
                        del self.finished[old]
            self.lock.notify_all()

    # -- HTTP threads ------------------------------------------------------------------------
    def collect(self, prompt: list[int], timeout: float = 10.0) -> dict[str, Any] | None:
        """The stats of the finished sequence that began with ``prompt`` (the generation
        thread stores them just after the last token)."""
        n = len(prompt)
        head = tuple(prompt)

        def find() -> tuple[int, ...] | None:
            for key in reversed(self.order):
                if key[:n] == head and key in self.finished:
                    return key
            return None

        with self.lock:
            key = find()
            deadline = time.monotonic() + timeout
            while key is None and time.monotonic() < deadline:
                self.lock.wait(timeout=deadline - time.monotonic())
                key = find()
            if key is None:
                return None
            stats = self.finished[key].popleft()
            if not self.finished[key]:
                del self.finished[key]
            self.order.remove(key)
            return stats

    def snapshot(self, prompt_cache: Any, provider: Any) -> dict[str, Any]:
        with self.lock:
            live = [dict(row) for row in self.live]
            max_kept = self.max_tokens_kept
            completed = self.completed
            prefill_tokens = self.prefill_tokens
        config = self.config
        return {
            "ready": provider.model is not None,
            "model": provider.name,
            "method": config.method,
            "settings": {} if config.policy is None else config.settings(),
            "budget": None if config.policy is None else config.settings().get("budget"),
            "max_pinned": provider.cli_args.max_pinned,
            "layers": provider.layer_roles,
            "live": {
                "sequences": len(live),
                "kv_bytes": sum(r["kv_bytes"] for r in live),
                "cache_bytes": sum(r["cache_bytes"] for r in live),
                "max_tokens_kept": max((r["tokens_kept"] for r in live), default=0),
                "pinned_tokens": sum(r.get("pinned_tokens", 0) for r in live),
                "demoted_tokens": sum(r.get("demoted_tokens", 0) for r in live),
                "per_sequence": live,
            },
            "max_tokens_kept_since_start": max_kept,
            "prompt_cache": {
                "sequences": len(prompt_cache),
                "bytes": prompt_cache.nbytes,
                "max_bytes": None if prompt_cache.max_bytes >= 1 << 62 else prompt_cache.max_bytes,
                "max_sequences": prompt_cache.max_size,
            },
            "memory": {**memory(), "weight_bytes": getattr(provider, "weight_bytes", None)},
            "requests_completed": completed,
            "prefill_tokens": prefill_tokens,
            "uptime_s": round(time.time() - self.started, 1),
        }


def memory() -> dict[str, int]:
    """MLX's active, peak and cached bytes and the process's resident and peak resident
    bytes."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    rss = peak_rss
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return {
        "mlx_active_bytes": int(mx.get_active_memory()),
        "mlx_peak_bytes": int(mx.get_peak_memory()),
        "mlx_cache_bytes": int(mx.get_cache_memory()),
        "rss_bytes": int(rss),
        "rss_peak_bytes": int(peak_rss),
    }


def _batch_rows(caches: list[Any]) -> list[dict[str, Any]]:
    """One stats row per sequence of a batch's layer caches."""
    if not caches:
        return []
    if isinstance(caches[0], BatchVeloxKVCache):
        # Read without unpacking rows that decode packed (a step would then copy them again).
        layers = [c.row_stats() for c in caches]
        return [combine_layers(list(per_layer)) for per_layer in zip(*layers, strict=True)]
    offsets = getattr(caches[0], "offset", None)
    if not isinstance(offsets, mx.array) or offsets.ndim != 1:
        return []
    # mlx-lm's BatchKVCache: every row holds all it has seen (offset counts left padding out).
    values: Any = offsets.tolist()
    seen = [int(o) for o in values]
    total = sum(cache_nbytes(c) for c in caches)
    share = total // max(len(seen), 1)
    return [
        {
            "tokens_seen": s,
            "tokens_kept": s,
            "compression_ratio": 1.0,
            "kv_bytes": share,
            "cache_bytes": share,
        }
        for s in seen
    ]


def watched_batch_generator(monitor: Monitor, tracker: SequenceTracker | None = None) -> type:
    """``BatchGenerator`` reporting its sequences to ``monitor`` after every step, and to
    ``tracker`` which uid belongs to which request and when it has left the batch."""
    seen = tracker if tracker is not None else SequenceTracker()

    class WatchedBatchGenerator(BatchGenerator):
        def _report(self) -> None:
            rows = _batch_rows(self._prompt_batch.prompt_cache)
            rows += _batch_rows(self._generation_batch.prompt_cache)
            monitor.set_live(rows)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.pacer = Pacer(self.prefill_step_size)

        def _next(self) -> Any:
            # mlx-lm's step, with the prefill chunk sized by time (serve/pacing.py); first,
            # sequences stopped or whose client left are handed back to be removed, before
            # another chunk of theirs runs (serve/sequences.py)
            stopped = seen.stopped()
            if stopped:
                done = [
                    PromptProcessingBatch.Response(uid, (0, 0), False, False) for uid in stopped
                ]
                return done, []
            prompts = len(self._prompt_batch) + len(self._unprocessed_sequences)
            others = len(self._generation_batch) > 0 or prompts > 1
            self.prefill_step_size = self.pacer.chunk(others)
            tokens, seconds = self._counters.prompt_tokens, self._counters.prompt_time
            try:
                return super()._next()
            finally:
                self.prefill_step_size = self.pacer.max_chunk
                prefilled = self._counters.prompt_tokens - tokens
                monitor.prefilled(prefilled)
                batch = max(1, len(self._prompt_batch))
                positions = -(-prefilled // batch)
                self.pacer.measured(positions, self._counters.prompt_time - seconds)

        def insert_segments(self, *args: Any, **kwargs: Any) -> Any:
            uids = super().insert_segments(*args, **kwargs)
            seen.inserted(uids)
            return uids

        def next(self) -> Any:
            out = super().next()
            self._report()
            seen.freed([r.uid for r in out[1] if r.finish_reason is not None])
            return out

        def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
            out = super().remove(uids, return_prompt_caches)
            self._report()
            seen.freed(list(uids))
            return out

        def close(self) -> None:
            super().close()
            monitor.set_live([])
            seen.clear()

    return WatchedBatchGenerator


def watched_stream_generate(monitor: Monitor) -> Any:
    """``stream_generate`` (the one-at-a-time path) reporting its sequence to ``monitor``."""
    original = mlx_server.stream_generate

    def stream_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
        caches = kwargs.get("prompt_cache") or []
        try:
            for response in original(*args, **kwargs):
                monitor.set_live([kv_stats(caches)])
                yield response
        finally:
            monitor.set_live([])

    return stream_generate


class VeloxResponseGenerator(mlx_server.ResponseGenerator):
    """Remembers, per HTTP thread, the prompt of the request it is serving (to find its
    sequence's stats afterwards)."""

    local = threading.local()

    def __init__(
        self,
        provider: Any,
        prompt_cache: Any,
        monitor: Monitor,
        governor: serve_memory.MemoryGovernor | None = None,
        tracker: SequenceTracker | None = None,
    ) -> None:
        self.monitor = monitor
        self.tracker = tracker if tracker is not None else SequenceTracker()
        self.governor = governor
        self.api_key: str | None = None
        self.drain_timeout = 60.0
        self.draining = False  # shutting down: new requests get 503
        self.abandoned = False  # the drain timed out: streams in flight end at their next token
        self.in_flight = 0
        self.drain_deadline: float | None = None  # time.monotonic() at which the drain ends
        self._flights = threading.Condition()
        self._handlers: set[threading.Thread] = set()  # threads that served a request
        super().__init__(provider, prompt_cache)

    @contextlib.contextmanager
    def flight(self) -> Iterator[None]:
        """Count one request in flight (the drain waits for them)."""
        with self._flights:
            self.in_flight += 1
            self._handlers = {t for t in self._handlers if t.is_alive()}
            self._handlers.add(threading.current_thread())
        try:
            yield
        finally:
            with self._flights:
                self.in_flight -= 1
                self._flights.notify_all()

    def _next_request(self, timeout: float | None = None) -> Any:
        # mlx-lm's, with the request's queue tracked (which uid, when freed).
        return self.tracker.wrap(super()._next_request(timeout))

    def _serve_single(self, request: Any, stream: Any) -> None:
        # mlx-lm's one-at-a-time path; a cancelled request stops at its next prefill chunk.
        rqueue = request[0]
        if isinstance(rqueue, TrackedQueue):
            rqueue.alone = True
        try:
            super()._serve_single(request, stream)
        finally:
            self.tracker.served_alone(request)

    def _await_response(self, response_queue: Any) -> Any:
        # mlx-lm's, plus: a client that hung up ends this side within a second of no
        # response (the generation thread removes its sequence on its own before the next
        # step, and then puts nothing more), and once the drain has timed out, a stream ends
        # (None) at its next read.
        while not self.abandoned:
            try:
                return response_queue.get(timeout=1.0)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None
                self._check_client()
        self.local.prompt = None  # the sequence is dropped, not finished: it has no stats
        return None

    def _check_client(self) -> None:
        local = self.local
        if not client_gone(getattr(local, "socket", None)):
            return
        ctx = getattr(local, "ctx", None)
        if ctx is None:  # not started yet: its context, when it comes, is stopped at once
            local.gone = True
            return
        ctx.stop()
        raise ClientGone("the client closed the connection")

    def wait_freed(self) -> None:
        """After a request that did not finish (the client left, a stop sequence cut it, an
        error): wait until its sequence has left the batch, so that the memory reserved for it
        is released when its KV is freed, not before (at most :data:`FREE_WAIT_S`)."""
        ctx = getattr(self.local, "ctx", None)
        freed = None if ctx is None else freed_of(ctx)
        if ctx is None or freed is None or not ctx._should_stop:
            return
        if not freed.wait(FREE_WAIT_S):
            LOG.warning("a cancelled sequence was not freed within %.0f s", FREE_WAIT_S)

    def stop_and_join(self) -> None:
        """Shut down (SIGTERM, Ctrl-C): refuse new requests, let those in flight finish for up
        to ``drain_timeout`` seconds, end the streams of any left, then stop generating."""
        self.draining = True
        deadline = time.monotonic() + self.drain_timeout
        self.drain_deadline = deadline
        if self.governor is not None:
            self.governor.close()  # the requests waiting for memory get 503 now
        with self._flights:
            LOG.info("shutting down: %d requests in flight", self.in_flight)
            while self.in_flight and self._flights.wait(max(0.0, deadline - time.monotonic())):
                pass
            if self.in_flight:
                LOG.warning("drain timed out: ending %d streams in flight", self.in_flight)
                self.abandoned = True
                self._flights.wait_for(lambda: not self.in_flight, timeout=10.0)
            handlers = list(self._handlers)
        # The handler threads are daemons: one still freeing its request's arrays when the
        # interpreter exits aborts the process, so they end first.
        for thread in handlers:
            thread.join(timeout=10.0)
        # mlx-lm's stop_and_join, bounded: the generation loop sees the flag between steps, and
        # a step of long prefills can take minutes on a CPU. No client waits on it any more,
        # and serve() exits without interpreter teardown, so a step left running is harmless.
        self._stop = True
        self._generation_thread.join(timeout=STOP_JOIN_S)
        if self._generation_thread.is_alive():
            LOG.warning("a generation step still runs after %.0f s: exiting anyway", STOP_JOIN_S)

    def shutdown_refusal(self) -> BadRequest:
        """The 503 a request gets once the server is shutting down; ``Retry-After``: the time
        the drain may still take, at least 1 s (by then this server is gone or restarted)."""
        left = 1.0
        if self.drain_deadline is not None:
            left = max(1.0, self.drain_deadline - time.monotonic())
        if self.governor is not None:
            left = min(left, self.governor.retry_after())
        headers = {"Retry-After": str(max(1, math.ceil(left))), "Connection": "close"}
        return BadRequest(SHUTTING_DOWN, 503, "overloaded", headers=headers)

    def generate(self, request: Any, generation_args: Any, progress_callback: Any = None) -> Any:
        """mlx-lm's, plus: a request not yet started when the server shuts down gets 503 (a
        :class:`BadRequest`, also left in ``local.failure`` for the chat route), and the
        tokens are counted for the request's log line."""
        local = self.local
        local.prompt = None
        local.failure = None
        local.ctx = None
        local.gone = False
        try:
            if self.abandoned or (self.draining and not self.generation_available()):
                raise self.shutdown_refusal()
            self.tracker.register(request, getattr(local, "socket", None))
            try:
                ctx, responses = super().generate(request, generation_args, progress_callback)
            finally:
                self.tracker.forget(request)
            if ctx is None:  # the drain ended before the generation thread took it
                raise self.shutdown_refusal()
        except Exception as exc:
            local.failure = exc
            raise
        local.ctx = ctx
        if local.gone:  # the client left before its request started
            ctx.stop()
            local.failure = ClientGone("the client closed the connection")
            raise local.failure
        local.prompt = list(ctx.prompt)
        local.cached = ctx.prompt_cache_count
        local.stats = None
        return ctx, self._counted(responses)

    def _counted(self, responses: Iterator[Any]) -> Iterator[Any]:
        for response in responses:
            self.local.generated = getattr(self.local, "generated", 0) + 1
            yield response


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    content = message.get("content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise BadRequest(
            f"{where}.content is missing or null (only an assistant turn with tool_calls may "
            "have no content)"
        )
    if content is not None and not isinstance(content, (str, list)):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
        raise BadRequest(f"{where}.content parts must be objects")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")


def _check_options(body: dict[str, Any], options: Any) -> None:
    """The request's optional fields mlx-lm would read unchecked: 400 on a wrong type."""
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings")
    if options is not None and not (
        isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)
    ):
        raise BadRequest("stream_options must be an object with a boolean include_usage")
    for name, kind in (("chat_template_kwargs", dict), ("role_mapping", dict)):
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"{name} must be an object")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")


class VeloxHandler(mlx_server.APIHandler):
    """mlx-lm's handler plus: 4xx JSON errors for bad requests, one model name, the stats
    endpoint, and ``usage.velox`` (tokens kept, compression ratio, KV bytes)."""

    response_generator: VeloxResponseGenerator
    _status: int | str | None = None  # the response's status, for the request's log line
    _prompt_tokens: int | None = None  # the prompt's length where no generation ran

    @property
    def provider(self) -> VeloxModelProvider:
        provider = self.response_generator.model_provider
        assert isinstance(provider, VeloxModelProvider)
        return provider

    def _error(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
        if self._anthropic_route():
            body = error_body(ANTHROPIC_KINDS.get(status, "invalid_request_error"), message)
        self._send_json(status, body, headers)

    def _route(self) -> str:
        return self.path.split("?", 1)[0]

    def _anthropic_route(self) -> bool:
        route = self._route()
        return route == MESSAGES_PATH or route.startswith(MESSAGES_PATH + "/")

    def _not_found(self) -> None:
        self._error(404, f"no route {self.command} {self._route()}", "not_found")

    # -- the request log ------------------------------------------------------------------------
    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        pass  # one line per request comes from _logged (http.server would add its own)

    def log_message(self, format: str, *args: Any) -> None:
        LOG.warning("%s: %s", self.address_string(), format % args)

    @contextlib.contextmanager
    def _logged(self) -> Iterator[None]:
        """Log one line when the request ends; a client gone mid-reply is one line too."""
        local = self.response_generator.local
        local.prompt, local.cached, local.stats, local.generated = None, 0, None, 0
        local.failure, local.ctx, local.gone = None, None, False
        local.socket = self.connection
        self._status = None
        self._prompt_tokens = None
        start = time.monotonic()
        try:
            yield
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            # the built-in error's name (ClientGone is a ConnectionResetError noticed early)
            kind = next(k for k in type(exc).__mro__ if k.__module__ == "builtins")
            self._status = f"client disconnected ({kind.__name__})"
            self.close_connection = True
        finally:
            self._log_line(time.monotonic() - start)

    def _log_line(self, seconds: float) -> None:
        local = self.response_generator.local
        prompt = getattr(local, "prompt", None)
        prompt_tokens = len(prompt) if prompt else (self._prompt_tokens or 0)
        status = self._status if isinstance(self._status, str) else f"status {self._status}"
        line = (
            f"request {self.command} {self._route()}: {status}, prompt {prompt_tokens} tokens "
            f"({getattr(local, 'cached', 0) or 0} from the prompt cache), "
            f"{getattr(local, 'generated', 0)} generated, {seconds:.2f} s"
        )
        stats = getattr(local, "stats", None)
        if stats is None and prompt and self._status == 200:
            stats = local.stats = self.response_generator.monitor.collect(prompt, STATS_WAIT_S)
        if stats is not None:
            line += (
                f"; kept {stats['tokens_kept']} per layer, compression "
                f"{stats['compression_ratio']:.2f}x, KV {stats['kv_bytes'] / 1e6:.2f} MB"
            )
        LOG.info("%s", line)

    def _send_json(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        if self.requested_model not in self.provider.names:
            raise BadRequest(
                f"model {self.requested_model!r} is not served here; this server serves "
                f"{self.provider.name!r} (GET /v1/models)",
                404,
                "model_not_found",
            )
        self.requested_model = self.provider.name
        self.requested_draft_model = "default_model"
        if self.adapter is not None:
            raise BadRequest("adapters are not supported by velox-serve")
        _check_options(self.body, self.stream_options)
        if "max_tokens" in self.body or "max_completion_tokens" in self.body:
            self.provider.check_max_tokens(self.max_tokens)
        if self.path.endswith("chat/completions"):
            _check_messages(self.body.get("messages"))
        elif not isinstance(self.body.get("prompt"), str) or not self.body["prompt"]:
            raise BadRequest("prompt must be a non-empty string")

    def _authorized(self) -> bool:
        """Whether the request may go on; answers 401 (and reads a small body) if not."""
        key = self.response_generator.api_key
        if not serve_auth.needs_key(self.path) or serve_auth.is_authorized(self.headers, key):
            return True
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) <= 1 << 20:
            self.rfile.read(int(length))  # so the client reads the 401, not a reset
        body = serve_auth.unauthorized_body(
            self.path, serve_auth.presented_key(self.headers) is not None
        )
        self._send_json(401, body, {"WWW-Authenticate": "Bearer"})
        return False

    def do_POST(self) -> None:
        with self._logged():
            if not self._authorized():
                return
            rg = self.response_generator
            if rg.draining:
                exc = rg.shutdown_refusal()
                return self._error(exc.status, str(exc), exc.code, exc.headers)
            with rg.flight():
                try:
                    self._post()
                except BadRequest as exc:  # raised before anything was sent
                    self._error(exc.status, str(exc), exc.code, exc.headers)

    def _post(self) -> None:
        route = self._route()
        if route == MESSAGES_PATH:
            self.handle_messages()
        elif route == COUNT_TOKENS_PATH:
            self.handle_count_tokens()
        elif self.path in POST_ROUTES:
            super().do_POST()
        else:
            self._not_found()

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest("a Content-Length header is required", 411 if length is None else 400)
        try:
            return json.loads(self.rfile.read(int(length)).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"invalid JSON in the request body: {exc}") from None

    def _messages_request(self, count_only: bool = False) -> Any:
        request = parse_request(self._read_json(), count_only=count_only)
        if request.model not in self.provider.names:
            raise BadRequest(
                f"model {request.model!r} is not served here; this server serves "
                f"{self.provider.name!r} (GET /v1/models)",
                404,
            )
        request.model = self.provider.name
        if not self.provider.renders_tools:
            request.messages = render_tools_as_text(request.messages, request.tools)
            request.tools = None
        return request

    def handle_messages(self) -> None:
        """``POST /v1/messages`` (serve_messages), with this handler's checks and admission."""
        request = self._messages_request()
        self.stream = request.stream
        self.provider.check_max_tokens(request.max_tokens)
        prompt = self._checked_prompt(request.completion_request(), None)
        with self._admitted(len(prompt), request.max_tokens):
            try:
                serve_messages(self, request, len(prompt))
            finally:  # the reservation is released once the sequence has left the batch
                self.response_generator.wait_freed()

    def handle_count_tokens(self) -> None:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt
        ``/v1/messages`` would render for the same body (system and tools included)."""
        request = self._messages_request(count_only=True)
        prompt = self._prompt_tokens_of(request.completion_request(), None)
        self._prompt_tokens = len(prompt)
        self._send_json(200, {"input_tokens": len(prompt)})

    def handle_chat_completions(self) -> Any:
        request = super().handle_chat_completions()
        if not self.provider.renders_tools:
            request.messages = render_tools_as_text(request.messages, request.tools)
            request.tools = None
        return request

    def _prompt_tokens_of(self, request: Any, template_kwargs: Any) -> list[int]:
        """The request's prompt tokens, as the generation thread will tokenize them."""
        provider = self.provider
        if provider.tokenizer is None:
            raise BadRequest("the model is still loading", 503, "not_ready")
        if request.request_type == "chat" and not provider.tokenizer.has_chat_template:
            raise BadRequest(
                "the model has no chat template, so the chat endpoints cannot format messages: "
                "use /v1/completions, or start the server with --chat-template",
                400,
                "no_chat_template",
            )
        try:
            args = argparse.Namespace(chat_template_kwargs=template_kwargs)
            prompt = self.response_generator._tokenize(provider.tokenizer, request, args)[0]
        except Exception as exc:  # a template or tokenizer that rejects the messages
            raise BadRequest(f"cannot tokenize the request: {exc}") from None
        return list(prompt)

    def _checked_prompt(self, request: Any, template_kwargs: Any) -> list[int]:
        """The request's prompt tokens, tokenized here too so that a prompt the model cannot
        take is a 400, not a failure in the generation thread."""
        # looked up on the class: tests call this unbound with a stand-in handler
        prompt = VeloxHandler._prompt_tokens_of(self, request, template_kwargs)
        self._prompt_tokens = len(prompt)  # for the log line, if refused
        args = self.provider.cli_args
        limit = self.provider.context_length
        if args.beyond_context or limit is None or limit > args.max_prompt_tokens:
            limit, hint = args.max_prompt_tokens, "(this server's --max-prompt-tokens)"
        else:
            hint = "(a bounded method can go past the model's context with --beyond-context)"
        if len(prompt) > limit:
            if self._anthropic_route():  # Anthropic's wording, which agents compact on
                message = f"prompt is too long: {len(prompt)} tokens > {limit} maximum {hint}"
            else:
                message = f"the prompt has {len(prompt)} tokens; the limit is {limit} {hint}"
            raise BadRequest(message, 400, "context_length_exceeded")
        if not prompt:
            raise BadRequest("the prompt is empty")
        self._pin_system(request, template_kwargs, prompt)
        return prompt

    def _pin_system(self, request: Any, template_kwargs: Any, prompt: list[int]) -> None:
        """Have the conversation's system prompt and tool definitions pinned in its cache
        (serve/pins.py): a 400 naming --max-pinned when they are longer than it."""
        provider = self.provider
        limit = provider.cli_args.max_pinned
        if provider.config.policy is None or limit == 0:  # --max-pinned 0: nothing pinned
            return
        args = argparse.Namespace(chat_template_kwargs=template_kwargs)
        rg = self.response_generator

        def tokenize(head: Any) -> list[int]:
            return list(rg._tokenize(provider.tokenizer, head, args)[0])

        span = system_span(request, prompt, tokenize)
        if not span:
            return
        if span > limit:
            raise BadRequest(
                f"the system prompt and tool definitions take {span} tokens, more than this "
                f"server pins (--max-pinned {limit}): shorten them, or start the server with a "
                "larger --max-pinned (and --budget)",
                400,
                "invalid_request_error",
            )
        cache = rg.prompt_cache
        assert isinstance(cache, VeloxPromptCache)  # serve() gives it one
        cache.pins.put(prompt, span)

    def _admitted(self, prompt_tokens: int, max_tokens: int) -> Any:
        """Hold the request's admission cost against --max-memory while it runs."""
        rg = self.response_generator
        if rg.governor is None:
            return contextlib.nullcontext()
        cost = serve_memory.AdmissionCost(self.provider.kv_geometry, self.provider.config)
        return rg.governor.admitted(cost(prompt_tokens, max_tokens))

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        with contextlib.ExitStack() as stack:
            try:
                prompt = self._checked_prompt(request, self.chat_template_kwargs)
                stack.enter_context(self._admitted(len(prompt), self.max_tokens or 0))
            except BadRequest as exc:
                return self._error(exc.status, str(exc), exc.code, exc.headers)
            # the reservation is released once the sequence has left the batch
            stack.callback(self.response_generator.wait_freed)
            return super().handle_completion(request, stop_words)

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm's handle_completion answers any failure of generate() with a 404 and
        # {"error": ...}: a request refused at shutdown gets its 503 instead, and a failed
        # generation a 500 (raised out of mlx-lm's except clause, to do_POST).
        local = self.response_generator.local
        failure = getattr(local, "failure", None)
        if status_code == 404 and failure is not None:
            local.failure = None
            if isinstance(failure, BadRequest | ClientGone):
                raise failure
            raise BadRequest(f"generation failed: {failure}", 500, "api_error")
        super()._set_completion_headers(status_code)

    def _velox_usage(self) -> dict[str, Any] | None:
        local = self.response_generator.local
        if getattr(local, "stats", None) is None and getattr(local, "prompt", None):
            local.stats = self.response_generator.monitor.collect(local.prompt)
        stats = getattr(local, "stats", None)
        if stats is None:
            return None
        return {
            "method": self.provider.config.method,
            "tokens_kept": stats["tokens_kept"],
            "tokens_seen": stats["tokens_seen"],
            "compression_ratio": stats["compression_ratio"],
            "kv_bytes": stats["kv_bytes"],
            "cache_bytes": stats["cache_bytes"],
            "pinned_tokens": stats.get("pinned_tokens", 0),
            "demoted_tokens": stats.get("demoted_tokens", 0),
        }

    def generate_response(self, text: str, finish_reason: Any, *args: Any, **kwargs: Any) -> Any:
        if finish_reason == "stop" and not self.stream and not kwargs.get("tool_calls"):
            # a tool call written as a JSON object instead of tool-call tags (serve/tools.py)
            call = fenced_tool_call(text, tool_names(self.body.get("tools")))
            if call is not None:
                text, finish_reason = "", "tool_calls"
                arguments = json.dumps(call["arguments"], ensure_ascii=False)
                function = {"name": call["name"], "arguments": arguments}
                tool_call = {"function": function, "type": "function", "id": str(uuid.uuid4())}
                kwargs["tool_calls"] = [tool_call]
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        if finish_reason is not None:
            velox = self._velox_usage()
            if "usage" in response and velox is not None:
                response["usage"]["velox"] = velox
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().completion_usage_response(*args, **kwargs)
        velox = self._velox_usage()
        if velox is not None:
            response["usage"]["velox"] = velox
        return response

    def do_GET(self) -> None:
        with self._logged():
            if not self._authorized():
                return
            route = self._route()
            if route.rstrip("/") == STATS_PATH:
                rg = self.response_generator
                body = rg.monitor.snapshot(rg.prompt_cache, self.provider)
                if rg.governor is not None:
                    body["memory_bound"] = rg.governor.snapshot(rg.prompt_cache.nbytes)
                self._send_json(200, body)
            elif self.path.startswith("/v1/models") or self.path == "/health":
                super().do_GET()
            else:
                self._not_found()

    def handle_models_request(self) -> None:
        data = json.dumps(
            {
                "object": "list",
                "data": [{"id": self.provider.name, "object": "model", "created": self.created}],
            }
        ).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(args: argparse.Namespace, config: Any) -> None:
    """Load the model, then serve until interrupted."""
    monitor = Monitor(config)
    allocator = serve_release.configure_allocator()  # before the model's buffers
    provider = VeloxModelProvider(args, config)
    provider.load_default()
    max_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else 1 << 63
    governor = memory_governor(args, provider)
    prompt_cache = serve_memory.BoundedPromptCache(
        args.prompt_cache_size,
        max_bytes,
        room=governor.room,
        on_change=lambda nbytes: governor.observe(None, nbytes),
        on_insert=lambda tokens, caches, kind: (
            monitor.finish(tokens, caches) if kind == "assistant" else None
        ),
    )
    prompt_cache.make = lambda: fresh_caches(provider)
    monitor.on_live = lambda live: governor.observe(live, prompt_cache.nbytes)
    # What a finished sequence freed goes back to the OS (docs/serving.md, "Process memory").
    releaser = serve_release.Releaser()
    monitor.on_end = lambda idle: releaser.release(force=idle)
    releaser.release(force=True)  # the loading's transient buffers
    LOG.info("process memory: %s", serve_release.describe(allocator))
    # mlx-lm's server looks these up as module globals at each use.
    tracker = SequenceTracker()
    mlx_server.BatchGenerator = watched_batch_generator(monitor, tracker)  # type: ignore[misc,assignment]
    mlx_server.stream_generate = watched_stream_generate(monitor)
    generator = VeloxResponseGenerator(provider, prompt_cache, monitor, governor, tracker)
    generator.api_key = serve_auth.resolve_api_key(args.api_key)
    generator.drain_timeout = args.drain_timeout
    if generator.api_key is not None:
        LOG.info("requests need the API key (every route but /health)")
    LOG.info("velox-serve: %s with %s caches, %s", provider.name, describe(config), _mode(provider))
    if mx.distributed.init().rank() == 0:
        signal.signal(signal.SIGTERM, _terminate)
        mlx_server._run_http_server(
            args.host, args.port, generator, server_class=_HTTPServer, handler_class=VeloxHandler
        )
        # Shut down: the requests are drained and generation has stopped. Exit now, without the
        # interpreter's teardown, during which MLX's native threads at times abort the process
        # ("terminate called without an active exception", exit -6) after a batch has run.
        LOG.info("velox-serve: stopped")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:  # mlx_lm.server.run: rank 0 takes the requests and shares each with the other ranks
        generator.join()


def fresh_caches(provider: VeloxModelProvider) -> list[Any]:
    """New caches for one sequence, as mlx-lm's server makes them (the draft model's after)."""
    assert provider.model is not None  # loaded before serving
    caches = make_prompt_cache(provider.model)
    if provider.draft_model is not None:
        caches += make_prompt_cache(provider.draft_model)
    return caches


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: shut down like Ctrl-C (mlx-lm's server stops serving on KeyboardInterrupt, then
    ``stop_and_join`` drains); a second SIGTERM kills at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


class _HTTPServer(ThreadingHTTPServer):
    """Closes its listening socket on shutdown, so that connections made while the requests in
    flight drain are refused at once rather than left unanswered."""

    def shutdown(self) -> None:
        super().shutdown()
        self.socket.close()


def memory_governor(args: argparse.Namespace, provider: Any) -> serve_memory.MemoryGovernor:
    """The --max-memory bound (per rank under mlx.launch), logged with how it was derived."""
    spec = args.max_memory
    machine = serve_memory.machine_memory() if not isinstance(spec, int) else 0
    bound = serve_memory.resolve_bound(spec, machine, provider.weight_bytes)
    how = (
        "--max-memory"
        if isinstance(spec, int)
        else (
            f"{spec or serve_memory.DEFAULT_FRACTION} x (RAM {machine / 1e9:.2f} GB - weights "
            f"{provider.weight_bytes / 1e9:.2f} GB)"
        )
    )
    cost = serve_memory.AdmissionCost(provider.kv_geometry, provider.config)
    LOG.info(
        "memory bound: %.2f GB of KV (live sequences + prompt cache), from %s; a request of "
        "%d prompt tokens and --max-tokens %d is admitted at %.2f MB; queue up to %d",
        bound / 1e9,
        how,
        512,
        args.max_tokens,
        cost(512, args.max_tokens) / 1e6,
        args.max_queue,
    )
    return serve_memory.MemoryGovernor(bound, args.max_queue)


def _mode(provider: VeloxModelProvider) -> str:
    if provider.is_batchable:
        mode = "batched (BatchGenerator)"
    else:
        mode = "one request at a time (draft model)"
    group = mx.distributed.init()
    if group.size() > 1:
        how = "pipeline" if provider.pipeline_group is not None else "tensor"
        mode += f", {how} parallel over {group.size()} ranks"
    return mode


def beyond_context_positions(args: argparse.Namespace) -> str:
    """``--positions`` when it is not given: ``compact`` with ``--beyond-context`` where the
    method allows it (TOVA, H2O, StreamingLLM, uniform allocation, and keys not quantized to
    4 bits or fewer without ``--kv-key-layout token``, which are best per channel), else
    ``absolute``. The past-context table (docs/benchmarks.md) is why: past the context,
    absolute positions take SmolLM2 from about 22 to 302 (TOVA at 14k-16k)."""
    if args.positions is not None:
        return str(args.positions)
    if not args.beyond_context:
        return "absolute"
    bits, layout = getattr(args, "kv_bits", None), getattr(args, "kv_key_layout", None)
    if bits is not None and bits <= LOW_BITS and layout != "token":
        return "absolute"
    try:
        config = config_from_args(argparse.Namespace(**{**vars(args), "positions": "compact"}))
    except ValueError:
        return "absolute"
    return "compact" if config.policy is not None else "absolute"


def _check_args(args: argparse.Namespace) -> Any:
    """The config the flags describe, once every flag is checked (``ValueError``)."""
    args.positions = beyond_context_positions(args)
    config = config_from_args(args, quantize_full=False)
    record = config.record
    check_quantized_start(args, velox=record is not None)
    if record is None and args.quantized_kv_start is None:  # mlx-lm's own default
        args.quantized_kv_start = mlx_server.DEFAULT_QUANTIZED_KV_START
    if record is not None:
        # The Velox rows are quantized by the caches (config.kv_bits); mlx-lm must neither
        # quantize them again nor turn batching off, as it does whenever kv_bits is set.
        args.kv_bits = None
    if record is not None and record.compressor is not None:
        raise ValueError(
            f"--method {config.method} compresses one document with a pass through the model "
            "(velox-generate); the server does not run it"
        )
    if args.adapter_path is not None:
        raise ValueError("--adapter-path is not supported by velox-serve")
    for name in ("max_tokens", "prefill_step_size", "decode_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_cache_size < 0:
        raise ValueError("--prompt-cache-size must be >= 0")
    check_cache_flags(args, config)
    check_serving_flags(args, config)
    warning = layout_warning(args, config)
    if warning is not None:
        print(f"velox-serve: warning: {warning}", file=sys.stderr)
    return config


def check_cache_flags(args: argparse.Namespace, config: Any) -> None:
    """What the caches need of the server: a trimmable cache for a draft model, one sequence
    at a time for a model-wide (``global``) allocation."""
    record = config.record
    if args.draft_model is not None and mx.distributed.init().size() > 1:
        raise ValueError("--draft-model is not supported under mlx.launch (nor by mlx_lm.server)")
    if args.draft_model is not None and record is not None and not config.trim_window:
        raise ValueError("--draft-model needs a trimmable cache")
    batched = max(args.decode_concurrency, getattr(args, "prompt_concurrency", 1)) > 1
    if record is not None and config.settings().get("allocation") == "global" and batched:
        raise ValueError(
            f"--{config.policy.replace('_', '-')}-allocation global cuts one sequence at a time "
            "by a model-wide threshold, and the server batches requests: serve it with "
            "--decode-concurrency 1 --prompt-concurrency 1, or use --allocation head"
        )


def check_serving_flags(args: argparse.Namespace, config: Any) -> None:
    if args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.beyond_context and config.policy is None:
        raise ValueError(
            "--beyond-context needs a bounded cache: --method full keeps every token and the "
            "model is not trained past its context"
        )
    serve_auth.resolve_api_key(args.api_key)  # a blank key is an error, not "no key"
    args.max_pinned = check_max_pinned(args.max_pinned, config)


def main(argv: Sequence[str] | None = None) -> int:
    from velox_mlx_lm.cli.app import model_ref

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = _check_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    # Under mlx.launch every rank runs this; only rank 0 logs below warnings (and serves HTTP).
    quiet = mx.distributed.init().rank() != 0
    logging.basicConfig(
        level=logging.WARNING if quiet else getattr(logging, args.log_level.upper()),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    try:
        if args.model is not None:
            model_ref(args.model)
        serve(args, config)
    except (OSError, ValueError) as exc:
        print(f"velox-serve: error: {exc}", file=sys.stderr)
        return 1
    return 0
