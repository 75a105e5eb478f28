"""Adding a policy is one core module, one reference check and one registry line.

A second toy policy (``toyzip``) has a setting of its own and a model-driven phase: it is driven
through the config, its generated ``--toyzip-*`` flags, ``velox_mlx_lm.compress`` and save/load,
and the server and batching refuse it by its declared phase, never by its name.

A toy policy (``knorm``: evict the key with the largest L2 norm, a query-free rule in the spirit
of kvpress's ``KnormPress``) is written here as a policy module would be, registered at test
time, and then driven through everything users touch without any other edit: ``KVCacheConfig``,
``KVCacheBuilder.for_model``, generation on a tiny mlx-lm model, prompt-cache save/load and
``velox-generate --method``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_cache_core import (
    POLICIES,
    Call,
    Compressor,
    Decision,
    KVSlots,
    Policy,
    PolicyState,
    read_settings,
    register,
    running,
    unregister,
)
from velox_cache_core.scoring import grouped_logits, softmax
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.validation import check_budget_and_sinks, check_int
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, cache_class, cli, methods
from velox_mlx_lm.flags import config_from_args

# -- the policy module (what policies/knorm.py would hold) --------------------------------------


@dataclass(frozen=True, kw_only=True)
class KnormState(PolicyState):
    budget: int
    n_sink: int
    evicted: int = running(0)  # running state: tokens dropped so far, per (row, head)


def init_knorm_state(budget: int = 512, n_sink: int = 4) -> KnormState:
    check_budget_and_sinks(budget, n_sink)
    return KnormState(budget=budget, n_sink=n_sink)


def knorm_rule(state: KnormState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Drop the largest-norm keys (sinks kept; ties lose the oldest)."""
    n = candidates.n_slots
    if n <= state.budget:
        return Decision(candidates)
    score = -mx.sqrt((candidates.keys.astype(mx.float32) ** 2).sum(axis=-1))
    positions = candidates.positions
    protected = sinks(positions, state.n_sink)
    if call.length == 1:
        kept = candidates.with_free(lowest_weight(score, positions, protected))
    else:
        kept = candidates.take(highest_weights(score, positions, protected, state.budget))
    return Decision(kept, changes={"evicted": state.evicted + n - state.budget})


KNORM = Policy("knorm", KnormState, init_knorm_state, knorm_rule, uses_queries=False)


# -- the reference (what the core's contract matrix entry would hold) ---------------------------


def knorm_reference(keys: np.ndarray, budget: int, n_sink: int) -> list[list[int]]:
    """Token by token: kept positions per head after the whole stream. keys ``[H, T, D]``."""
    out = []
    for head in keys:
        kept: list[int] = []
        for t in range(head.shape[0]):
            kept.append(t)
            if len(kept) > budget:
                norms = {p: float(np.linalg.norm(head[p])) for p in kept if p >= n_sink}
                worst = max(norms.values())
                kept.remove(min(p for p, v in norms.items() if v == worst))
        out.append(sorted(kept))
    return out


@pytest.fixture
def knorm() -> Iterator[Policy]:
    register(KNORM)
    yield KNORM
    unregister("knorm")


def _kept(cache: Any) -> list[list[int]]:
    return [sorted(row) for row in np.array(cache.positions)[0].tolist()]


def test_reference_agreement_any_chunking(knorm: Policy) -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 2, 23, 4)).astype(np.float32)
    want = knorm_reference(keys[0], budget=6, n_sink=1)
    for sizes in ([23], [1] * 23, [5, 1, 9, 1, 7]):
        state, start = knorm.init(budget=6, n_sink=1), 0
        for size in sizes:
            k = mx.array(keys[:, :, start : start + size])
            state = knorm.update(state, k, k).state
            start += size
        assert [sorted(r) for r in np.array(state.positions)[0].tolist()] == want
        assert state.evicted == 23 - 6


def test_config_builder_generation_and_prompt_cache(
    knorm: Policy, tiny_model: Any, h: Any, tmp_path: Path
) -> None:
    assert "knorm" in methods()
    config = KVCacheConfig(method="knorm", knorm_budget=8, knorm_n_sink=1)
    assert config.settings() == {"budget": 8, "n_sink": 1}
    with pytest.raises(ValueError, match="knorm_budget"):
        KVCacheConfig(method="knorm", knorm_budget=0)
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, config)
    assert all(type(c) is cache_class("knorm") for c in caches)
    prompt = h.random_tokens(20, seed=3)
    steps = generate_step(prompt[0], model, prompt_cache=caches, max_tokens=6)
    for _ in steps:
        assert all(c.size() <= 8 for c in caches)
    assert all(c.offset > 20 and c.policy_state.evicted == c.offset - 8 for c in caches)

    path = str(tmp_path / "knorm.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        assert type(b) is type(a) and b.settings == a.settings
        assert b.offset == a.offset and b.policy_state.evicted == a.policy_state.evicted
        assert _kept(b) == _kept(a)
        assert mx.array_equal(b.policy_state.keys, a.policy_state.keys)


@pytest.mark.model
def test_velox_generate_method(
    knorm: Policy, capsys: pytest.CaptureFixture[str], embedded_model_path: Any
) -> None:
    code = cli.main(
        [
            *("--prompt", "The capital of France is", "--max-tokens", "4"),
            *("--method", "knorm", "--budget", "6", "--json"),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == {"method": "knorm", "budget": 6, "n_sink": 4}
    assert report["runs"][0]["tokens_kept_per_layer"] == 6


# -- a model-driven policy with a setting of its own (what policies/toyzip.py would hold) -------
# It keeps every token until a pass through the model scores the context (the mean attention the
# pass's queries give each row), then keeps ``budget`` rows per head, the first ``keep_first``
# positions always. Nothing outside this module and this test knows its name.


@dataclass(frozen=True, kw_only=True)
class ZipState(PolicyState):
    budget: int
    keep_first: int
    compressed: bool = running(False)


def init_zip_state(budget: int = 512, keep_first: int = 0) -> ZipState:
    check_int("budget", budget, minimum=1)
    check_int("keep_first", keep_first, minimum=0)
    return ZipState(budget=budget, keep_first=keep_first)


def zip_rule(state: ZipState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    return Decision(candidates)


def zip_check(state: ZipState) -> None:
    if state.compressed or state.slots is None:
        raise ValueError("the toyzip state holds no whole context")


def zip_score(
    state: ZipState, queries: mx.array, keys: mx.array, start: int, end: int, scale: float
) -> mx.array:
    """float32 ``[B, H_kv, end - start]``: the pass chunk's mean weight on rows start..end-1."""
    assert state.slots is not None
    rows = state.slots.compact().keys[:, :, start:end]
    logits = grouped_logits(queries, rows, scale, "head")  # [B, H_kv, g, R, m]
    return softmax(logits.astype(mx.float32)).mean(axis=(2, 3))


def zip_cut(state: ZipState, scores: mx.array, total: int | None) -> ZipState:
    assert state.slots is not None
    live = state.slots.compact()
    if live.n_slots <= state.budget:
        return replace(state, compressed=True)
    keep = highest_weights(
        scores, live.positions, sinks(live.positions, state.keep_first), state.budget
    )
    return replace(state, slots=live.take(keep), compressed=True)


TOYZIP = Policy(
    "toyzip",
    ZipState,
    init_zip_state,
    zip_rule,
    grows_after_prompt_end=True,
    traits=read_settings("budget"),
    compressor=Compressor(
        needs_pass=lambda state: True,
        check=zip_check,
        score=zip_score,
        cut=zip_cut,
        shares=lambda scores, state: [None] * len(scores),
    ),
    help={"keep_first": "first positions the cut keeps"},
    summary={"toyzip": "keeps the rows a pass through the model attends to most (a test)"},
)


@pytest.fixture
def toyzip() -> Iterator[Policy]:
    register(TOYZIP)
    yield TOYZIP
    unregister("toyzip")


def test_phase_policy_through_config_flags_compress_and_prompt_cache(
    toyzip: Policy, tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    from velox_mlx_lm.compress import compress, prefill

    args = cli.build_parser().parse_args(
        ["--prompt", "x", "--method", "toyzip", "--budget", "12", "--toyzip-keep-first", "3"]
    )
    config = config_from_args(args)
    assert config == KVCacheConfig(method="toyzip", toyzip_budget=12, toyzip_keep_first=3)
    assert config.settings() == {"budget": 12, "keep_first": 3}
    with pytest.raises(ValueError, match="toyzip_keep_first"):
        KVCacheConfig(method="toyzip", toyzip_keep_first=-1)
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, config)
    tokens = [int(t) for t in np.random.default_rng(2).integers(2, 100, 40)]
    prefill(model, caches, tokens, step=16)
    assert all(c.size() == 40 for c in caches)  # nothing evicted before the pass
    info = compress(model, tiny_tokenizer, caches, tokens, chunk_size=16)
    assert info["chunks"] == 3 and info["scored_tokens"] > 40
    for cache in caches:
        kept = np.array(cache.positions)[0]
        assert cache.offset == 40 and kept.shape[-1] == 12 and not cache.scoring
        assert all({0, 1, 2} <= set(row.tolist()) for row in kept)
        assert cache.policy_state.compressed
    path = str(tmp_path / "toyzip.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        assert type(b) is type(a) and b.settings == a.settings == {"budget": 12, "keep_first": 3}
        assert _kept(b) == _kept(a) and b.policy_state.compressed


def test_phase_policy_flags_are_listed_and_refused_by_traits(
    toyzip: Policy, capsys: pytest.CaptureFixture[str]
) -> None:
    from velox_mlx_lm.serve import app as serve

    for parser in (cli.build_parser(), serve.build_parser()):
        # A method's own flags are listed by --help-method (the first screen keeps to the
        # common flags), and parse whether shown or not.
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--help-method", "toyzip"])
        assert exited.value.code == 0
        text = capsys.readouterr().out
        assert (
            "--toyzip-keep-first" in text and "--toyzip-budget" in text and "toyzip keeps" in text
        )
        args = parser.parse_args(["--method", "toyzip", "--toyzip-keep-first", "3"])
        assert args.toyzip_keep_first == 3
    # The server refuses it by its declared phase, naming the method.
    with pytest.raises(ValueError, match="--method toyzip compresses one document"):
        serve._check_args(serve.build_parser().parse_args(["--method", "toyzip"]))
    # velox-generate refuses a batch of documents, by the same trait, before loading a model.
    with pytest.raises(SystemExit):
        cli.main(["--method", "toyzip", "--prompt", "a\nb", "--prompt", "c\nd"])
    assert "--method toyzip compresses one document at a time" in capsys.readouterr().err
    # A flag of another policy is refused for this method.
    args = cli.build_parser().parse_args(
        ["--prompt", "x", "--method", "toyzip", "--h2o-recent", "4"]
    )
    with pytest.raises(ValueError, match="--h2o-recent does not apply to --method toyzip"):
        config_from_args(args)


def test_register_refuses_colliding_fields_and_flags() -> None:
    # ``streaming`` + ``llm_budget`` is the config field ``streaming_llm_budget`` again.
    clash = replace(KNORM, name="streaming", init=_init_llm_budget)
    with pytest.raises(ValueError, match="config field 'streaming_llm_budget'"):
        register(clash)
    # ``--top-k`` is mlx_lm.server's flag; ``--prompt-cache`` abbreviates two of them.
    with pytest.raises(ValueError, match="--top-k"):
        register(replace(KNORM, name="top", init=_init_k))
    with pytest.raises(ValueError, match="abbreviates --prompt-cache-bytes"):
        register(replace(KNORM, name="prompt", init=_init_cache))
    assert {"streaming", "top", "prompt"}.isdisjoint(POLICIES)


def _init_llm_budget(llm_budget: int = 8) -> KnormState:
    return init_knorm_state(budget=llm_budget)


def _init_k(k: int = 8) -> KnormState:
    return init_knorm_state(budget=k)


def _init_cache(cache: int = 8) -> KnormState:
    return init_knorm_state(budget=cache)


def test_command_flags_cover_the_live_parsers() -> None:
    """velox_mlx_lm.flags.COMMAND_FLAGS (what register() keeps free) holds every flag of both
    commands that is not generated from the registry."""
    from velox_cache_core import RESERVED_FLAGS, flag_name
    from velox_mlx_lm import serve

    generated = {flag_name(p.name, s) for p in POLICIES.values() for s in p.setting_names}
    for parser in (cli.build_parser(), serve.build_parser()):
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        assert flags - generated <= RESERVED_FLAGS
