"""tools/beyond_context_ppl.py without the model: which methods it scores, and its windows."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("velox_bench")
TOOL = Path(__file__).resolve().parents[1] / "beyond_context_ppl.py"
spec = importlib.util.spec_from_file_location("beyond_context_ppl", TOOL)
assert spec is not None and spec.loader is not None
tool = importlib.util.module_from_spec(spec)
sys.modules["beyond_context_ppl"] = tool
spec.loader.exec_module(tool)


def test_every_bounded_served_method_is_scored_or_excluded_with_a_reason() -> None:
    from velox_bench.variants import policy_variants

    chosen, excluded = tool.served_variants(None)
    scored = {v.method for v in chosen}
    assert {"tova", "tova_adapted", "h2o", "streaming_llm"} <= scored
    assert "snapkv" in excluded and "prompt end" in excluded["snapkv"]
    assert scored | set(excluded) == {v.method for v in policy_variants()}
    assert "kvzip" not in scored | set(excluded)  # velox-serve refuses it
    for v in chosen:  # chunked scoring equals token-by-token decoding
        if v.policy is not None and "prefill" in v.policy.setting_names:
            assert v.settings["prefill"] == "sequential"


def test_windows_are_the_perplexity_of_each_slice() -> None:
    nll = np.array([0.0, 0.0, 1.0, 1.0, 2.0])
    assert tool.windows(nll, 2) == [1.0, math.e, math.exp(2.0)]
