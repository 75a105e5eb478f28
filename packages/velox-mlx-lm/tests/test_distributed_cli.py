"""``velox-generate`` and ``velox-serve`` under ``mlx.launch`` (2 ranks, ring backend, this host).

A tiny random model is written as an mlx-lm model folder (config, safetensors with an index,
the embedded model's tokenizer and chat template), so the commands load it the way they load a
real one under ``mlx.launch``: ``mlx_lm.utils.sharded_load``, tensor parallel (a llama, 8 query
/ 4 KV heads) or pipeline parallel (a qwen2 with ``velox-serve --pipeline``). Each sharded answer
must equal the single-process ``velox-generate`` answer token for token, and only rank 0 prints.
The all-reduce itself is checked position by position in ``test_distributed.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from test_distributed import launch_cmd
from test_serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPT = (
    "Tell me a long story about plants and the sun and water, with many details about "
    "leaves, roots and flowers in the garden."
)
BUDGET = 16
TOKENS = 24
TIMEOUT = 300


def write_model(folder: Path, arch: str) -> Path:
    """A random ``arch`` (llama or qwen2) model folder mlx-lm loads; untied output head and
    sharpened q/k projections so the greedy tokens vary and the attention is far from ties."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama, qwen2

    from velox_mlx_lm.embedded import load_default

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_default()[1]
    tokenizer._tokenizer.save_pretrained(folder)
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 2 if arch == "llama" else 4,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(tokenizer._tokenizer),
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    }
    module = llama if arch == "llama" else qwen2
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    for layer in model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * 3.0
        attn.k_proj.weight = attn.k_proj.weight * 3.0
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, embedded_model_path: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("velox-sharded-models")
    return {arch: write_model(root / arch, arch) for arch in ("llama", "qwen2")}


def script(name: str) -> str:
    """A console script next to this interpreter (``mlx.launch`` starts a script path)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return str(path)


def generate_answer(model: Path, method: str, ranks: int = 1) -> tuple[str, str]:
    """(answer, stdout) of ``velox-generate --chat --json`` alone or under ``mlx.launch``."""
    argv = ["--model", str(model), "--prompt", PROMPT, "--chat", "--method", method]
    argv += ["--budget", str(BUDGET), "--max-tokens", str(TOKENS), "--json"]
    if ranks == 1:
        cmd = [sys.executable, "-m", "velox_mlx_lm.cli", *argv]
    else:
        cmd = launch_cmd(ranks, script("velox-generate"), *argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout)["runs"][-1]["answer"], out.stdout


class LaunchedServer(Server):
    """``velox-serve`` on ``ranks`` ranks (``test_serve.Server``'s readiness wait and requests);
    its own process group, so stopping it stops every rank."""

    def __init__(self, ranks: int, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        cmd = launch_cmd(ranks, script("velox-serve"), "--port", str(self.port), *flags)
        self.process = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture
def launched() -> Iterator[Any]:
    servers: list[LaunchedServer] = []

    def start(ranks: int, *flags: str) -> LaunchedServer:
        server = LaunchedServer(ranks, *flags)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def test_velox_generate_on_two_ranks_prints_once_and_equals_one_process(
    models: dict[str, Path],
) -> None:
    alone, _ = generate_answer(models["llama"], "tova")
    sharded, stdout = generate_answer(models["llama"], "tova", ranks=2)
    assert sharded == alone and len(alone.split()) > 3
    assert json.loads(stdout)["model"].endswith("sharded over 2 ranks (tensor parallel)")


@pytest.mark.parametrize(
    ("arch", "method", "flags"),
    [("llama", "tova", ()), ("llama", "h2o", ()), ("qwen2", "tova", ("--pipeline",))],
    ids=["tensor-tova", "tensor-h2o", "pipeline-tova"],
)
def test_velox_serve_on_two_ranks_equals_velox_generate(
    models: dict[str, Path], launched: Any, arch: str, method: str, flags: tuple[str, ...]
) -> None:
    """The sharded server's greedy chat answer equals ``velox-generate`` in one process, and
    the server's usage shows the cache evicted down to the budget."""
    model = models[arch]
    server = launched(2, "--model", str(model), "--method", method, "--budget", str(BUDGET), *flags)
    status, reply = server.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": str(model),
            "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0.0,
            "max_tokens": TOKENS,
        },
    )
    assert status == 200, reply
    answer = reply["choices"][0]["message"]["content"]
    velox = reply["usage"]["velox"]
    assert velox["tokens_seen"] > BUDGET and velox["tokens_kept"] == BUDGET
    alone, _ = generate_answer(model, method)
    assert answer == alone
    how = "pipeline" if flags else "tensor"
    assert f"{how} parallel over 2 ranks" in server.tail()
