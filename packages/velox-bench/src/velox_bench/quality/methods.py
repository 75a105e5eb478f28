"""The cache settings the quality harness compares, named as in the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from velox_mlx_lm import KVCacheConfig


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a ``KVCacheConfig`` method plus fixed settings; budget varies."""

    name: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    def config(self, budget: int) -> KVCacheConfig:
        if self.method == "full":
            return KVCacheConfig(method="full")
        prefix = "tova" if self.method.startswith("tova") else self.method
        kwargs: dict[str, Any] = {f"{prefix}_budget": budget, **self.settings}
        return KVCacheConfig(method=self.method, **kwargs)


FULL = Variant("full", "full")
# Every TOVA-like variant pins sequential prefill: it makes chunked scoring equal token-by-token
# decoding, whatever the presets' defaults become.
SEQ = {"tova_prefill": "sequential"}
TOVA = Variant("tova (query/layer)", "tova", {"tova_signal": "query", "tova_scope": "layer", **SEQ})
TOVA_NO_SINK = Variant("tova (query/layer, n_sink=0)", "tova", {**TOVA.settings, "tova_n_sink": 0})
TOVA_QUERY_HEAD = Variant(
    "tova (query/head)", "tova", {"tova_signal": "query", "tova_scope": "head", **SEQ}
)
TOVA_KEY_LAYER = Variant(
    "tova (key/layer)", "tova", {"tova_signal": "key", "tova_scope": "layer", **SEQ}
)
TOVA_ADAPTED = Variant("tova_adapted (key/head)", "tova_adapted", SEQ)
H2O = Variant("h2o", "h2o")
STREAMING_LLM = Variant("streaming_llm", "streaming_llm")
SNAPKV = Variant("snapkv", "snapkv")
MORPHKV = Variant("morphkv", "morphkv", {"morphkv_prefill": "sequential"})

PERPLEXITY_VARIANTS = (
    TOVA,
    TOVA_NO_SINK,
    TOVA_QUERY_HEAD,
    TOVA_KEY_LAYER,
    TOVA_ADAPTED,
    H2O,
    STREAMING_LLM,
    MORPHKV,
)
# SnapKV cuts once at the end of a prompt: streaming text has no prompt end, so it is compared
# only in retrieval, where the question ends the prompt.
RETRIEVAL_VARIANTS = (TOVA, TOVA_ADAPTED, H2O, STREAMING_LLM, SNAPKV, MORPHKV)
