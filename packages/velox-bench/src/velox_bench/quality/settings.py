"""What one quality run measures (no mlx here: the report and the docs text read it too)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MODEL", "Settings", "model_tag"]

DEFAULT_MODEL = "smollm2-135m"  # the default embedded model (velox_mlx_lm.embedded.MODELS)


def model_tag(model: str) -> str:
    """``""`` for the default model, whose results, figures and docs section keep their plain
    names; ``"_<model>"`` for another, whose names carry it."""
    return "" if model == DEFAULT_MODEL else f"_{model}"


@dataclass(frozen=True)
class Settings:
    """What one run measures. The defaults are the full run (see docs/benchmarks.md)."""

    n_tokens: int = 2048  # T: tokens scored per document
    n_documents: int = 1
    budgets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    chunk: int = 256
    retrieval_tokens: int = 1800  # document length before the facts are planted
    retrieval_budgets: tuple[int, ...] = (512,)
    n_trials: int = 30  # trials of the fixed pool used; each asks one fact per depth
    retrieval_batch: int = 10  # trials of one prompt shape run together
    quick: bool = False
    model: str = DEFAULT_MODEL  # an embedded model (velox_mlx_lm.embedded.MODELS)

    @property
    def default_model(self) -> bool:
        """Whether this run is on the default embedded model, whose results keep the plain
        names (``quality.json``); another model's carry its name."""
        return not model_tag(self.model)

    @classmethod
    def quick_run(cls) -> Settings:
        return cls(
            n_tokens=256,
            n_documents=1,
            budgets=(64, 128),
            retrieval_tokens=400,
            retrieval_budgets=(128,),
            n_trials=2,
            quick=True,
        )

    @classmethod
    def full_run(cls) -> Settings:
        """The issue's full run: T = 4096 and three retrieval budgets (several hours on 2 CPUs)."""
        return cls(n_tokens=4096, retrieval_budgets=(256, 512, 1024))

    def describe(self) -> str:
        """``T = 4096, retrieval budgets 256, 512 and 1024``: what ``--full`` changes."""
        *rest, last = map(str, self.retrieval_budgets)
        budgets = f"{', '.join(rest)} and {last}" if rest else last
        return f"T = {self.n_tokens}, retrieval budget{'s' if rest else ''} {budgets}"
