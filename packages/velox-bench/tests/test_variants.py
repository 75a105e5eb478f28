"""The benchmarks' rows come from the policy registry, under the names the results already use."""

from __future__ import annotations

from velox_blas import preload_openblas

# OpenBLAS if mlx is not imported yet (a run of this file alone); harmless otherwise
preload_openblas()

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from velox_bench import models, variants  # noqa: E402
from velox_bench.micro import make_subject  # noqa: E402
from velox_bench.quality import methods, report  # noqa: E402
from velox_bench.summary import summarize  # noqa: E402
from velox_cache_core import POLICIES, Policy, register, unregister  # noqa: E402
from velox_mlx_lm import KVCacheConfig, cache_class  # noqa: E402

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def _committed(suite: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / f"{suite}.json").read_text(encoding="utf-8"))
    return data


def _methods(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def test_micro_rows_keep_their_names() -> None:
    assert set(variants.micro_methods()) == set(_methods(_committed("micro")["rows"]))


def test_model_rows_keep_their_names_and_order() -> None:
    data = _committed("model")
    assert variants.model_methods() == _methods(data["rows"])
    assert variants.reduced_model_methods() == data["settings"]["reduced_methods"]


def test_quality_rows_keep_their_names_and_order() -> None:
    data = _committed("quality")
    assert [v.name for v in methods.perplexity_variants()] == [
        n for n in data["perplexity"]["ppl"] if n != methods.FULL.name
    ]
    assert [v.name for v in methods.retrieval_variants()] == [
        n for n in data["retrieval"]["results"] if n != methods.FULL.name
    ]
    assert methods.excluded_from_perplexity() == data["perplexity"]["excluded"]
    assert report.findings(data) == data["findings"]  # the report reads these names


def test_summaries_find_their_rows() -> None:
    # summary.py names the rows its targets compare; they must be among the suites' rows.
    micro = [
        {"config": "budget512-hkv8-hq32-d128", "method": m, "seconds": 1.0}
        for m in variants.micro_methods()
    ]
    target = summarize("micro", micro)["targets"]["micro_tova_over_sdpa_budget512_hkv8_d128"]
    assert target["value"] == 1.0
    rows = [
        {"phase": p, "context": 8192, "method": m, "seconds": 1.0}
        for m in variants.model_methods()
        for p in ("prefill", "decode")
    ]
    targets = summarize("model", rows)["targets"]
    assert len(targets) == 4 and all(t["value"] == 1.0 for t in targets.values())


def test_variant_configs_match_the_former_lists() -> None:
    b = models.BUDGET
    assert {v.name: v.config(b) for v in variants.model_variants()} == {
        "tova": KVCacheConfig("tova", tova_budget=b),
        "tova_oneshot": KVCacheConfig("tova", tova_budget=b, tova_prefill="oneshot"),
        "tova_adapted": KVCacheConfig("tova_adapted", tova_budget=b),
        "h2o": KVCacheConfig("h2o", h2o_budget=b),
        "streaming_llm": KVCacheConfig("streaming_llm", streaming_llm_budget=b),
        "snapkv": KVCacheConfig("snapkv", snapkv_budget=b),
        "morphkv": KVCacheConfig("morphkv", morphkv_budget=b),
        "expected_attention": KVCacheConfig("expected_attention", expected_attention_budget=b),
    }
    tova_adapted = methods.variant("tova_adapted (key/head)").config(64)
    assert (
        tova_adapted.settings()
        == KVCacheConfig("tova_adapted", tova_budget=64, tova_prefill="sequential").settings()
    )
    assert methods.variant("morphkv").config(64).settings()["prefill"] == "sequential"
    assert (
        variants.Variant("snapkv", "snapkv").config(32, snapkv_window=8).value("snapkv_window") == 8
    )


# -- a policy registered later joins every list ------------------------------------------------


@pytest.fixture
def late_policy() -> Iterator[Policy]:
    """A copy of StreamingLLM under a new name, registered after velox_bench was imported."""
    policy = dataclasses.replace(POLICIES["streaming_llm"], name="late_window")
    register(policy)
    yield policy
    unregister(policy.name)


def test_a_late_policy_joins_every_suite(late_policy: Policy) -> None:
    name = late_policy.name
    assert name in variants.micro_methods()
    assert name in variants.model_methods()
    assert name not in variants.reduced_model_methods()
    assert name in [v.name for v in methods.perplexity_variants()]
    assert name in [v.name for v in methods.retrieval_variants()]
    subject = make_subject(name, 32, 2, 4, 16)
    subject.step()
    assert subject.n_keys() <= 33 and not subject.grows
    model = models.tiny_llama()
    caches = models.make_caches(model, name)
    y = models.prefill(model, caches, mx.random.randint(0, 256, (1, 48)))
    models.decode_step(model, caches, y)
    assert type(caches[0]) is cache_class(name) and caches[0].size() == 49  # budget 512


def test_unknown_methods_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown micro method"):
        make_subject("nope", 16, 2, 4, 16)
    with pytest.raises(ValueError, match="unknown model-suite method"):
        models.make_caches(models.tiny_llama(), "nope")


# -- import-time side effects ------------------------------------------------------------------


def test_blas_loader_imports_no_mlx() -> None:
    code = (
        "import sys, velox_blas\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'mlx imported'\n"
        "first = velox_blas.preload_openblas()\n"
        "import velox_mlx_lm\n"
        "assert velox_blas.blas_in_use() == first, first\n"
        "print(first)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.startswith(("OpenBLAS (", "default (no OpenBLAS found)", "Accelerate")), out
