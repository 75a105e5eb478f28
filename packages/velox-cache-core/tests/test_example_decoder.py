"""The hand-written example decoder (examples/tiny_decoder.py) with TOVA at its attention site."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_decoder.py"
MODULE_NAME = "velox_example_tiny_decoder"

# Every signal x scope x prefill combination (docs/architecture.md section 3: all are valid).
SETTINGS = [
    {"signal": signal, "scope": scope, "prefill": prefill}
    for signal, scope, prefill in itertools.product(
        ("query", "key"), ("layer", "head"), ("sequential", "oneshot")
    )
]
SETTING_IDS = ["-".join(s.values()) for s in SETTINGS]
SEQUENTIAL = [s for s in SETTINGS if s["prefill"] == "sequential"]
SEQUENTIAL_IDS = ["-".join(s.values()) for s in SEQUENTIAL]


def load_example() -> ModuleType:
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    spec = importlib.util.spec_from_file_location(MODULE_NAME, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


@pytest.fixture(scope="module")
def model(example: ModuleType) -> Any:
    mx.random.seed(7)
    model = example.Model(example.ModelArgs())
    mx.eval(model.parameters())
    return model


def random_tokens(example: ModuleType, length: int, batch: int = 2) -> mx.array:
    vocab = example.ModelArgs().vocab_size
    return mx.random.randint(0, vocab, (batch, length), key=mx.random.key(11))


def feed(
    example: ModuleType,
    model: Any,
    tokens: mx.array,
    chunks: list[int],
    budget: int | None,
    **settings: Any,
) -> tuple[np.ndarray, list[Any]]:
    caches = example.make_caches(model.args, budget, **settings)
    logits, caches = example.run(model, tokens, chunks, caches)
    return np.array(logits), caches


def sorted_positions(cache: Any) -> np.ndarray:
    return np.sort(np.array(cache.positions), axis=-1)


@pytest.mark.parametrize(
    "chunks",
    [[24], [1] * 24, [5, 7, 1, 11], [8, 8, 8], [1, 23], [23, 1]],
    ids=["oneshot", "tokens", "mixed", "thirds", "1+23", "23+1"],
)
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("budget", [24, 64])
def test_budget_covering_sequence_matches_full_cache(
    example: ModuleType, model: Any, chunks: list[int], settings: dict[str, str], budget: int
) -> None:
    tokens = random_tokens(example, 24)
    reference, _ = feed(example, model, tokens, [24], None)
    logits, caches = feed(example, model, tokens, chunks, budget, n_sink=2, **settings)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
    for cache in caches:
        assert cache.offset == 24
        assert cache.n_kept == 24
        assert cache.compression_ratio == 1.0


@pytest.mark.parametrize("chunks", [[1] * 24, [5, 7, 1, 11]], ids=["tokens", "mixed"])
def test_full_cache_reference_is_chunking_independent(
    example: ModuleType, model: Any, chunks: list[int]
) -> None:
    tokens = random_tokens(example, 24)
    reference, _ = feed(example, model, tokens, [24], None)
    logits, caches = feed(example, model, tokens, chunks, None)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
    assert all(cache.offset == 24 for cache in caches)


@pytest.mark.parametrize(
    "chunks",
    [[40], [16, 16, 8], [3, 1, 9, 27], [9, 1, 1, 29]],
    ids=["oneshot", "sixteens", "mixed", "below-budget-then-chunk"],
)
@pytest.mark.parametrize("settings", SEQUENTIAL, ids=SEQUENTIAL_IDS)
def test_small_budget_sequential_prefill_equals_token_by_token(
    example: ModuleType, model: Any, chunks: list[int], settings: dict[str, str]
) -> None:
    tokens = random_tokens(example, 40)
    by_token, token_caches = feed(example, model, tokens, [1] * 40, 8, n_sink=2, **settings)
    chunked, chunk_caches = feed(example, model, tokens, chunks, 8, n_sink=2, **settings)
    np.testing.assert_allclose(chunked, by_token, rtol=1e-4, atol=1e-5)
    for by_token_cache, chunk_cache in zip(token_caches, chunk_caches, strict=True):
        assert chunk_cache.offset == by_token_cache.offset == 40
        assert chunk_cache.n_kept == by_token_cache.n_kept == 8
        assert chunk_cache.compression_ratio == pytest.approx(5.0)
        np.testing.assert_array_equal(
            sorted_positions(chunk_cache), sorted_positions(by_token_cache)
        )
    # Eviction really happened: the answer is not the full cache's.
    full, _ = feed(example, model, tokens, [40], None)
    assert np.abs(chunked - full).max() > 1e-3


def test_positions_are_true_and_sinks_kept(example: ModuleType, model: Any) -> None:
    tokens = random_tokens(example, 40)
    _, caches = feed(example, model, tokens, [16, 1, 1, 22], 8, n_sink=3)
    for cache in caches:
        positions = sorted_positions(cache)
        assert positions.shape[-1] == 8
        assert (positions[..., :3] == [0, 1, 2]).all()
        assert positions.max() == 39  # retained positions are absolute, not renumbered


def test_example_imports_no_mlx_lm() -> None:
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not any(name.split(".")[0] == "mlx_lm" for name in imported), imported


def test_main_runs_without_loading_mlx_lm() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location({MODULE_NAME!r}, {str(EXAMPLE)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "module.main()\n"
        "assert 'mlx_lm' not in sys.modules, 'the example loaded mlx_lm'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "compression ratio" in result.stdout
    assert "positions [0, 1, 2, 3," in result.stdout
