"""The past-context perplexity harness (velox_bench.quality.past_context) at smoke size."""

from __future__ import annotations

from velox_blas import preload_openblas

# OpenBLAS if mlx is not imported yet (a run of this file alone); harmless otherwise
preload_openblas()

import math  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = [pytest.mark.quality, pytest.mark.model, pytest.mark.corpus, pytest.mark.slow]


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    pytest.importorskip("mlx_lm")
    from velox_mlx_lm.embedded import ModelNotFoundError, load_default

    try:
        return load_default()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def test_every_bounded_served_method_is_scored_or_excluded_with_a_reason() -> None:
    from velox_bench.quality.past_context import served_variants
    from velox_bench.variants import policy_variants

    chosen, excluded = served_variants(None)
    scored = {v.method for v in chosen}
    assert {"tova", "tova_adapted", "h2o", "streaming_llm"} <= scored
    assert "snapkv" in excluded and "prompt end" in excluded["snapkv"]
    assert scored | set(excluded) == {v.method for v in policy_variants()}
    assert "kvzip" not in scored | set(excluded)  # velox-serve refuses it
    for v in chosen:  # chunked scoring equals token-by-token decoding
        if v.policy is not None and "prefill" in v.policy.setting_names:
            assert v.settings["prefill"] == "sequential"


def test_windows_are_the_perplexity_of_each_slice() -> None:
    from velox_bench.quality.past_context import windows

    nll = np.array([0.0, 0.0, 1.0, 1.0, 2.0])
    assert windows(nll, 2) == [1.0, math.e, math.exp(2.0)]


def test_settings_per_model_and_bad_input() -> None:
    from velox_bench.quality.past_context import PastContextSettings

    assert PastContextSettings.for_model("smollm2-135m").tokens == 16_384  # 2x its 8k context
    assert PastContextSettings.for_model("gemma3-270m").tokens == 40_960  # past its 32k
    assert PastContextSettings.for_model("gemma3-270m", tokens=100, window=None).tokens == 100
    with pytest.raises(ValueError, match="window must be >= 1"):
        PastContextSettings(window=0)
    with pytest.raises(ValueError, match="model must be one of"):
        PastContextSettings(model="llama")


def test_run_and_report(loaded: tuple[Any, Any], tmp_path: Path) -> None:
    from velox_bench.quality.past_context import PastContextSettings, evaluate, summary, write

    # A budget above the length never evicts: every window equals the full cache's.
    settings = PastContextSettings(tokens=96, window=32, budget=128, chunk=16, methods=("tova",))
    results = evaluate(settings, loaded)
    assert results["context"] == 8192 and results["windows"] == [[0, 32], [32, 64], [64, 96]]
    assert set(results["rows"]) == {"full", "tova(128)"}
    np.testing.assert_allclose(
        results["rows"]["tova(128)"]["windows"], results["rows"]["full"]["windows"], rtol=1e-5
    )
    # Below it, TOVA evicts and the windows after the budget differ.
    small = evaluate(
        PastContextSettings(tokens=96, window=32, budget=24, chunk=16, methods=("tova",)), loaded
    )
    assert small["rows"]["tova(24)"]["windows"][-1] != small["rows"]["full"]["windows"][-1]
    assert all(math.isfinite(p) and p > 1 for p in small["rows"]["tova(24)"]["windows"])
    assert "| tova(24) |" in summary(small)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    for _ in range(2):
        paths = write(small, tmp_path)
    assert all(p.is_file() for p in paths)
    doc = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert doc.count("<!-- past-context-smollm2-135m:start -->") == 1
    assert "figures/past_context_smollm2-135m.png" in doc


def test_a_stopped_run_resumes_from_its_partial_file(
    loaded: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from velox_bench.quality import past_context as pc

    settings = pc.PastContextSettings(tokens=48, window=16, budget=24, chunk=16, methods=("tova",))
    partial = tmp_path / "partial.json"
    first = pc.evaluate(settings, loaded, partial)
    assert set(pc.resumed(settings, partial)) == {"full", "tova(24)"}
    runs: list[Any] = []
    real = pc.token_nll
    monkeypatch.setattr(pc, "token_nll", lambda *a, **k: runs.append(a) or real(*a, **k))
    again = pc.evaluate(settings, loaded, partial)  # both methods read back, none run
    assert runs == [] and again["rows"] == first["rows"]
    other = pc.PastContextSettings(tokens=48, window=16, budget=20, chunk=16, methods=("tova",))
    assert pc.resumed(other, partial) == {}  # other settings start over
