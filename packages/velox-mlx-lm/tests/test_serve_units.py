"""velox-serve's agent-serving pieces without a server: the API key check
(``serve.auth``), the Messages API translation (``serve.messages``), the memory bound's
parsing, admission queue, prompt-cache room and cost (``serve.memory``), and the flags that
``velox-serve`` refuses at start."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.serve.auth import (
    is_authorized,
    needs_key,
    resolve_api_key,
    unauthorized_body,
)
from velox_mlx_lm.serve.cache import kv_stats
from velox_mlx_lm.serve.errors import BadRequest
from velox_mlx_lm.serve.memory import (
    AdmissionCost,
    BoundedPromptCache,
    MemoryGovernor,
    parse_max_memory,
    probe_geometry,
    resolve_bound,
)
from velox_mlx_lm.serve.messages import parse_request, stop_reason, token_stop_words
from velox_mlx_lm.serve.tools import render_tools_as_text, template_renders_tools

# -- API key ----------------------------------------------------------------------------------


def test_api_key_from_flag_or_environment() -> None:
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {"VELOX_API_KEY": "k1"}) == "k1"
    assert resolve_api_key("k2", {"VELOX_API_KEY": "k1"}) == "k2"  # the flag wins
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="--api-key"):
            resolve_api_key(blank, {})
        with pytest.raises(ValueError, match="VELOX_API_KEY"):
            resolve_api_key(None, {"VELOX_API_KEY": blank})


def test_key_in_either_header_and_nothing_else() -> None:
    key = "s3cret"
    assert is_authorized({}, None)  # no key configured: open
    assert is_authorized({"Authorization": "Bearer s3cret"}, key)
    assert is_authorized({"Authorization": "bearer  s3cret "}, key)
    assert is_authorized({"x-api-key": "s3cret"}, key)
    for headers in (
        {},
        {"Authorization": "s3cret"},
        {"Authorization": "Basic s3cret"},
        {"Authorization": "Bearer s3cre"},
        {"Authorization": "Bearer s3cret2"},
        {"x-api-key": "S3CRET"},
        {"x-api-key": "wrong", "Authorization": "Bearer s3cret"},  # x-api-key is the one read
    ):
        assert not is_authorized(headers, key), headers
    assert needs_key("/v1/models") and needs_key("/v1/velox/stats") and needs_key("/")
    assert not needs_key("/health") and not needs_key("/health?x=1")


def test_401_bodies_in_the_route_style_never_echo_the_key() -> None:
    anthropic = unauthorized_body("/v1/messages", has_key=True)
    assert anthropic["type"] == "error"
    assert anthropic["error"]["type"] == "authentication_error"
    openai = unauthorized_body("/v1/chat/completions", has_key=False)
    assert openai["error"]["code"] == "invalid_api_key"
    assert "Bearer" in openai["error"]["message"]


# -- Messages API translation ---------------------------------------------------------------


def test_messages_request_becomes_a_chat_request() -> None:
    body = {
        "model": "velox-embedded",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "/"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a b"},
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
    }
    request = parse_request(body)
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert request.messages[0]["content"] == "Be brief.\n\nBe kind."
    call = request.messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "ls", "arguments": {"dir": "/"}} and call["id"] == "t1"
    assert request.messages[3] == {"role": "tool", "content": "a b", "tool_call_id": "t1"}
    assert request.tools == [
        {
            "type": "function",
            "function": {"name": "ls", "parameters": {"type": "object"}, "description": "list"},
        }
    ]
    assert request.max_tokens == 20 and request.temperature == 0.5 and not request.stream
    assert token_stop_words(request.stop_sequences) == ["END", " END"]


def test_thinking_blocks_are_dropped_and_count_tokens_needs_no_max_tokens() -> None:
    thinking = {"type": "thinking", "thinking": "hmm", "signature": "c2ln"}
    redacted = {"type": "redacted_thinking", "data": "ZW5j"}
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [thinking, redacted, {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "And?"},
    ]
    request = parse_request({"messages": history}, count_only=True)
    assert request.messages[1] == {"role": "assistant", "content": "Hello"}
    with pytest.raises(BadRequest, match="thinking"):  # only in assistant turns
        parse_request({"max_tokens": 4, "messages": [{"role": "user", "content": [thinking]}]})


def test_tools_as_text_for_a_template_without_tools() -> None:
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    call = {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": {"d": "/"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List /"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a b", "tool_call_id": "t1"},
        {"role": "user", "content": "And now?"},
    ]
    out = render_tools_as_text(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call the tools below")
    assert '{"name": "ls", "parameters": {"type": "object"}}' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": 'Tool call ls (id t1): {"d": "/"}'}
    assert out[3]["content"] == "Tool result (id t1): a b\n\nAnd now?"
    plain = [{"role": "user", "content": "hi"}]
    assert render_tools_as_text(plain, None) is plain
    assert render_tools_as_text(plain, tools)[0]["role"] == "system"


class _Template:
    has_chat_template = True

    def __init__(self, renders: bool) -> None:
        self.renders = renders

    def apply_chat_template(self, messages: Any, tools: Any = None, **kwargs: Any) -> str:
        names = [t["function"]["name"] for t in tools or []] if self.renders else []
        return f"{names}{messages}"


def test_tool_support_is_detected_by_rendering() -> None:
    assert template_renders_tools(_Template(renders=True))
    assert not template_renders_tools(_Template(renders=False))


BAD_MESSAGES: list[tuple[Any, str]] = [
    ([], "JSON object"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": True, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 3}]}, "content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "system": 4}, "system"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "temperature": 2}, "temp"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "top_k": -1}, "top_k"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "stream": "y"}, "stream"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "tools": {}}, "tools"),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "stop_sequences": "x"},
        "stop_sequences",
    ),
]


@pytest.mark.parametrize(("body", "field"), BAD_MESSAGES)
def test_bad_messages_requests_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(BadRequest, match=field) as caught:
        parse_request(body)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request_error"


class _Tokenizer:
    eos_token_ids = frozenset({2})

    def decode(self, tokens: list[int]) -> str:
        return "".join({5: "The", 6: " capital", 7: " Paris", 8: "."}.get(t, "") for t in tokens)


def test_stop_reasons() -> None:
    tok = _Tokenizer()
    assert stop_reason("length", [5, 6], tok, ["Paris"]) == ("max_tokens", None)
    assert stop_reason("stop", [5, 6, 2], tok, ["Paris"]) == ("end_turn", None)
    assert stop_reason("stop", [5, 6, 7], tok, ["Paris"]) == ("stop_sequence", "Paris")
    assert stop_reason("stop", [5, 6, 7], tok, []) == ("end_turn", None)


# -- memory bound ---------------------------------------------------------------------------


def test_retry_after_from_the_queue_and_the_mean_duration() -> None:
    governor = MemoryGovernor(bound=100, max_queue=1)
    assert governor.retry_after() == 1  # nothing known yet: 1 s per request, nobody waiting
    governor.acquire(10)
    governor.release(10, duration=9.0)
    assert governor.retry_after() == 9
    governor.acquire(10)
    governor.release(10, duration=4.0)  # moving average: 9 + 0.2 x (4 - 9) = 8
    assert governor.retry_after() == 8
    governor.acquire(100)
    waiter = _admit_in_thread(governor, 50, [], "a")
    _wait_for(lambda: len(governor.waiting) == 1)
    with pytest.raises(BadRequest) as full:
        governor.acquire(1)
    assert full.value.headers["Retry-After"] == "16"  # (1 waiting + 1) x 8 s / 1 running
    governor.close()  # shutting down: the waiter and newcomers get 503
    waiter.join()
    with pytest.raises(BadRequest, match="shutting down") as late:
        governor.acquire(1)
    assert late.value.status == 503


def test_max_memory_sizes_and_fractions() -> None:
    assert parse_max_memory("6GB") == 6 * 10**9
    assert parse_max_memory("512MB") == 512 * 10**6
    assert parse_max_memory("1.5GiB") == int(1.5 * 2**30)
    assert parse_max_memory("123456") == 123456
    assert parse_max_memory("0.25") == 0.25
    for bad in ("0", "1.5", "-1GB", "6 parsecs", "", "GB", "0MB"):
        with pytest.raises(ValueError, match="--max-memory"):
            parse_max_memory(bad)
    assert resolve_bound(1000, 0, 0) == 1000
    assert resolve_bound(0.5, 10_000, 2_000) == 4_000
    assert resolve_bound(None, 10_000, 2_000) == 4_000  # the default fraction
    with pytest.raises(ValueError, match="weights"):
        resolve_bound(0.5, 1_000, 2_000)


def _admit_in_thread(governor: MemoryGovernor, cost: int, log: list[str], name: str) -> Any:
    def run() -> None:
        try:
            governor.acquire(cost)
            log.append(name)
        except BadRequest as exc:
            log.append(f"{name}:{exc.status}")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for(predicate: Any) -> None:
    event = threading.Event()
    for _ in range(2000):
        if predicate():
            return
        event.wait(0.005)
    raise AssertionError("condition not reached")


def test_governor_queues_fifo_then_refuses_with_503() -> None:
    governor = MemoryGovernor(bound=100, max_queue=2)
    with pytest.raises(BadRequest) as too_big:
        governor.acquire(101)
    assert too_big.value.status == 400 and too_big.value.code == "request_too_large"
    governor.acquire(60)
    log: list[str] = []
    first = _admit_in_thread(governor, 50, log, "a")  # does not fit: waits
    _wait_for(lambda: len(governor.waiting) == 1)
    second = _admit_in_thread(governor, 10, log, "b")  # would fit, but waits behind "a"
    _wait_for(lambda: len(governor.waiting) == 2)
    with pytest.raises(BadRequest) as full:
        governor.acquire(1)
    assert full.value.status == 503 and full.value.headers["Retry-After"] == "3"  # 3 x 1 s
    assert log == [] and governor.room() == 40
    governor.release(60)
    first.join(timeout=10)
    second.join(timeout=10)
    assert log == ["a", "b"] and governor.reserved == 60
    snap = governor.snapshot(prompt_cache_bytes=0)
    assert snap["refused_503"] == 1 and snap["queue"] == {"waiting": 0, "max": 2}
    assert snap["running"] == 2


def _fed(model: Any, config: KVCacheConfig, tokens: list[int]) -> list[Any]:
    caches = KVCacheBuilder.for_model(model, config)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_prompt_cache_keeps_within_the_room_left(tiny_model: Any) -> None:
    model = tiny_model("llama")
    config = KVCacheConfig(method="tova", tova_budget=8, tova_n_sink=1)
    one = kv_stats(_fed(model, config, list(range(2, 22))))["cache_bytes"]
    room = [10 * one]
    store = BoundedPromptCache(10, 1 << 62, room=lambda: room[0])
    for start in (2, 30, 60):
        tokens = list(range(start, start + 20))
        store.insert_cache("m", tokens, _fed(model, config, tokens))
    assert len(store) == 3
    room[0] = one + one // 2  # admitted requests reserved the rest
    store.fetch_nearest_cache("m", list(range(90, 100)))
    assert len(store) == 1 and store.nbytes <= room[0]
    room[0] = 0
    store.insert_cache("m", list(range(2, 22)), _fed(model, config, list(range(2, 22))))
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm", "snapkv", "morphkv"])
def test_admission_cost_bounds_what_a_sequence_holds(method: str, embedded_model: Any) -> None:
    """Prefill in chunks the undo log keeps, then decode: the bytes held never pass the
    admission cost of (prompt, max_tokens)."""
    from velox_cache_core import policy_for_method

    model = embedded_model
    policy = policy_for_method(method).name
    config = KVCacheConfig(method=method, **{f"{policy}_budget": 48})
    model.make_cache = lambda: KVCacheBuilder.for_model(model, config)
    cost = AdmissionCost(probe_geometry(model), config)
    prompt, max_tokens = 60, 12
    caches = model.make_cache()
    worst = 0
    for start in range(0, prompt, 10):
        model(mx.array([list(range(100 + start, 110 + start))]), cache=caches)
        mx.eval([c.state for c in caches])
        worst = max(worst, kv_stats(caches)["cache_bytes"])
    for t in range(max_tokens):
        model(mx.array([[5 + t]]), cache=caches)
        mx.eval([c.state for c in caches])
        worst = max(worst, kv_stats(caches)["cache_bytes"])
    assert 0 < worst <= cost(prompt, max_tokens)
    assert cost(prompt, max_tokens) < 3 * worst  # an upper bound, not a wild one


@pytest.fixture(scope="module")
def embedded_model(embedded_model_path: Any) -> Any:
    from velox_mlx_lm.embedded import load_default

    model = load_default()[0]
    yield model
    if "make_cache" in vars(model):
        del model.make_cache


def test_full_cost_counts_prompt_and_max_tokens(tiny_model: Any) -> None:
    model = tiny_model("llama", fresh=True)
    config = KVCacheConfig(method="full")
    model.make_cache = lambda: KVCacheBuilder.for_model(model, config)
    cost = AdmissionCost(probe_geometry(model), config)
    assert cost(100, 100) == cost(10, 10)  # one 256-row step either way
    assert cost(300, 100) == 2 * cost(10, 10)
    caches = _fed(model, config, list(range(2, 120)))
    assert sum(c.nbytes for c in caches) <= cost(118, 0)


# -- flags refused at start -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--method", "full", "--beyond-context"],
        ["--max-queue", "-1"],
        ["--drain-timeout", "-1"],
        ["--max-memory", "0"],
        ["--max-memory", "lots"],
        ["--api-key", " "],
        ["--method", "snapkv", "--allocation", "global", "--decode-concurrency", "4"],
    ],
)
def test_bad_serving_flags_exit_2(argv: list[str], capsys: Any) -> None:
    from velox_mlx_lm.serve import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err or argv[0].lstrip("-").replace("-", "_") in err


def test_global_allocation_needs_one_sequence_at_a_time(capsys: Any) -> None:
    from velox_mlx_lm.serve import main

    with pytest.raises(SystemExit) as exited:
        main(["--method", "tova_adapted", "--allocation", "global", "--decode-concurrency", "2"])
    assert exited.value.code == 2
    assert "--tova-allocation global cuts one sequence at a time" in capsys.readouterr().err
