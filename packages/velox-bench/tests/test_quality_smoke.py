"""Smoke test of the quality harness on one short document (no OpenBLAS needed)."""

from __future__ import annotations

from velox_blas import preload_openblas

# OpenBLAS if mlx is not imported yet (a run of this file alone); harmless otherwise
preload_openblas()

import math  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = [pytest.mark.quality, pytest.mark.model, pytest.mark.corpus, pytest.mark.slow]

N_TOKENS = 64
Loaded = tuple[Any, Any, list[int]]


@pytest.fixture(scope="module")
def model_and_tokens() -> Loaded:
    pytest.importorskip("mlx_lm")
    from velox_bench.quality import corpus
    from velox_mlx_lm.embedded import ModelNotFoundError, load_default

    try:
        model, tokenizer = load_default()
        speech = corpus.most_recent(1, N_TOKENS + 1, tokenizer.encode)[0]
    except (ModelNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    return model, tokenizer, tokenizer.encode(speech.text())[: N_TOKENS + 1]


def test_chunked_scoring_equals_token_by_token(model_and_tokens: Loaded) -> None:
    # The premise of streaming perplexity: sequential chunks see what decoding would see.
    from velox_bench.quality.methods import TOVA
    from velox_bench.quality.perplexity import token_nll

    model, _, tokens = model_and_tokens
    config = TOVA.config(16)
    chunked = token_nll(model, config, tokens, chunk=24)
    one_by_one = token_nll(model, config, tokens, chunk=1)
    assert chunked.shape == (N_TOKENS,)
    np.testing.assert_allclose(chunked, one_by_one, rtol=0, atol=2e-4)


def test_budget_at_least_t_equals_full(model_and_tokens: Loaded) -> None:
    from velox_bench.quality.methods import FULL, TOVA
    from velox_bench.quality.perplexity import perplexity, token_nll

    model, _, tokens = model_and_tokens
    tokens = tokens[:33]  # T = 32: budget 32 never evicts
    full = token_nll(model, FULL.config(0), tokens, chunk=16)
    kept = token_nll(model, TOVA.config(32), tokens, chunk=16)
    assert 1 < perplexity(full) < 200
    np.testing.assert_allclose(kept, full, rtol=0, atol=1e-5)


def test_evaluate_structure(model_and_tokens: Loaded, tmp_path: Any) -> None:
    from dataclasses import replace

    from velox_bench.quality import report
    from velox_bench.quality.methods import TOVA, variant
    from velox_bench.quality.run import evaluate
    from velox_bench.quality.settings import Settings

    settings = Settings(
        n_tokens=16,
        n_documents=1,
        budgets=(8, 16),
        chunk=8,
        retrieval_tokens=30,
        retrieval_budgets=(64,),
        n_trials=1,
    )
    model, tokenizer, _ = model_and_tokens
    # Retrieval is the slow part: only the full cache here (the full run covers the policies).
    streaming_llm = variant("streaming_llm")
    results = evaluate(settings, (TOVA, streaming_llm), (), (model, tokenizer))
    ppl = results["perplexity"]["ppl"]
    assert results["perplexity"]["budgets"] == [8]  # budget >= T is the full cache
    assert set(ppl) == {"full", TOVA.name, streaming_llm.name}
    assert all(math.isfinite(v) and v > 1 for row in ppl.values() for v in row.values())
    retrieval = results["retrieval"]
    assert set(retrieval["results"]) == {"full"}
    for by_budget in retrieval["results"].values():
        for rows in by_budget.values():
            assert set(rows) == {"0.1", "0.5", "0.9"}
    full_rows = retrieval["results"]["full"]["full"]
    assert all(row["logprob_vs_full"] == 0 for row in full_rows.values())
    assert retrieval["measure"] in ("exact_match", "likelihood")
    assert "| tova (query/layer) |" in report.perplexity_table(results)
    assert "best_tova_variant" in report.findings(results)
    assert results["settings"]["model"] == "smollm2-135m"
    assert results["environment"]["model"].startswith("SmolLM2-135M-Instruct")
    assert retrieval["chat"] is True  # SmolLM2-Instruct asks through its chat template

    # Another model's run writes files and a docs section that carry its name, beside the
    # default model's, and writing it again replaces its section.
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    other = {**results, "settings": {**results["settings"], "model": "gemma3-270m"}}
    other["retrieval"] = {**retrieval, "chat": False}
    for r in (results, other, other):
        report.write(r, tmp_path)
    for name in ("quality.json", "quality_gemma3-270m.json"):
        assert (tmp_path / "benchmarks" / "results" / name).is_file()
    for name in ("ppl_vs_budget_gemma3-270m.png", "retrieval_gemma3-270m.png", "retrieval.png"):
        assert (tmp_path / "docs" / "figures" / name).is_file()
    doc = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert doc.count("<!-- quality:start -->") == 1
    assert doc.count("<!-- quality-gemma3-270m:start -->") == 1
    assert "figures/retrieval_gemma3-270m.png" in doc and "as plain text" in doc
    assert "--model gemma3-270m" in doc
    assert replace(settings, model="gemma3-270m").default_model is False


def test_plain_prompt_for_a_base_model(model_and_tokens: Loaded) -> None:
    # A tokenizer without a chat template (a base model such as Gemma 3 270M) gets the document
    # as plain text with the tokenizer's own special tokens, then the question on its own line.
    from velox_bench.quality import retrieval

    _, tokenizer, tokens = model_and_tokens

    class Base:
        chat_template = None

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            return [7, *ids] if add_special_tokens else ids  # 7: a stand-in BOS

    document = retrieval.cut_document(tokenizer.decode(tokens), 48, tokenizer.encode)
    fact = retrieval.facts(0)[0]
    prompt = retrieval.build_prompt(Base(), document, retrieval.facts(0))
    text = retrieval.plant(document, retrieval.facts(0))
    assert prompt.document == [7, *tokenizer.encode(text, add_special_tokens=False)]
    question = tokenizer.decode(prompt.questions[0])
    assert question == f"\n\n{fact.question()}\n{fact.primer()}"
    assert tokenizer.decode(prompt.answers[0]).strip() == str(fact.number)
    assert all(0 <= d < 1 for d in prompt.depths)


def test_batched_trials_equal_trials_alone(model_and_tokens: Loaded) -> None:
    # Retrieval runs trials of one prompt shape as a batch: each row must see only its own prompt.
    # TOVA (evicting every step) and SnapKV (a cut at the prompt's end) cover the harness's
    # batching (its padding, masks and merged caches); the full cache adds only CI time.
    from velox_bench.quality import retrieval
    from velox_bench.quality.methods import TOVA, variant

    model, tokenizer, tokens = model_and_tokens
    document = retrieval.cut_document(tokenizer.decode(tokens), 48, tokenizer.encode)
    prompts = [retrieval.build_prompt(tokenizer, document, retrieval.facts(t)) for t in range(2)]
    assert len({p.shape() for p in prompts}) == 1  # one-token cities: one batch
    for config in (TOVA.config(24), variant("snapkv").config(40)):
        batched = retrieval.run_trials(model, config, prompts, chunk=16, batch=2)
        alone = retrieval.run_trials(model, config, prompts, chunk=16, batch=1)
        assert [[a.correct for a in t] for t in batched] == [[a.correct for a in t] for t in alone]
        np.testing.assert_allclose(
            [[a.logprob for a in t] for t in batched],
            [[a.logprob for a in t] for t in alone],
            rtol=0,
            atol=2e-3,
        )


def test_run_trials_rejects_bad_batch(model_and_tokens: Loaded) -> None:
    from velox_bench.quality import retrieval
    from velox_bench.quality.methods import FULL

    model, _, _ = model_and_tokens
    with pytest.raises(ValueError, match="batch must be >= 1"):
        retrieval.run_trials(model, FULL.config(0), [], batch=0)


def test_quick_and_full_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    from velox_bench.quality.run import main
    from velox_bench.quality.settings import Settings

    with pytest.raises(SystemExit):
        main(["--quick", "--full"])
    assert "not allowed with argument" in capsys.readouterr().err
    full = Settings.full_run()
    assert (full.n_tokens, full.retrieval_budgets, full.n_trials) == (4096, (256, 512, 1024), 30)
    assert full.describe() == "T = 4096, retrieval budgets 256, 512 and 1024"
    assert Settings(retrieval_budgets=(512,)).describe() == "T = 2048, retrieval budget 512"
