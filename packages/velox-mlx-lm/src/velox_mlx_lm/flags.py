"""Method flags generated from the policy registry, for ``velox-generate`` and ``velox-serve``.

Every setting of every registered policy gets ``--<policy>-<setting>`` (``--snapkv-window``,
``--h2o-recent``), typed and with its choices, from ``Policy.settings``; ``--method`` lists the
registry's methods with each one's summary. The shared short flags (``--budget``, ``--n-sink``,
``--signal``, ``--scope``, ``--prefill``, ``--window``, ``--allocation``) stay as aliases for
the chosen method's setting of that name. A policy registered later gets its flags for free;
one whose flag would equal or abbreviate a flag of either command is refused by ``register``
(the commands' own flags are reserved here).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from velox_cache_core import KEY_LAYOUTS, POLICIES, Setting, field_name, flag_name, reserve_flags

# The shared short flags: ``--<setting>`` sets the chosen method's setting of that name.
ALIASES = ("budget", "n_sink", "signal", "scope", "prefill", "window", "allocation")
# Flags of velox-generate and velox-serve that are not generated here: velox-generate's own,
# mlx_lm.server's (0.32; tests/test_cli.py checks this list against the live parsers) and
# velox-serve's additions. No policy's flag may equal or abbreviate one of them.
COMMAND_FLAGS = (
    *("--model", "--prompt", "--prompt-file", "--prompts-file", "--demo", "--max-tokens"),
    *("--method", "--chat", "--no-chat", "--temp", "--seed", "--prefill-step-size"),
    *("--quantized", "--compare", "--draft-model", "--num-draft-tokens", "--json", "--help"),
    *("--adapter-path", "--allowed-origins", "--chat-template", "--chat-template-args"),
    *("--decode-concurrency", "--host", "--kv-bits", "--kv-group-size", "--log-level"),
    "--kv-key-layout",
    *("--min-p", "--pipeline", "--port", "--prompt-cache-bytes", "--prompt-cache-size"),
    *("--prompt-concurrency", "--quantized-kv-start", "--top-k", "--top-p"),
    *("--trust-remote-code", "--use-default-chat-template"),
    *("--api-key", "--max-memory", "--max-queue", "--beyond-context", "--drain-timeout"),
    *("--help-method", "--help-all", "--max-prompt-tokens", "--pin-prefix", "--max-pinned"),
    *("--positions", "--demote-bits", "--demote-budget"),
    *(f"--{name.replace('_', '-')}" for name in ALIASES),
)
reserve_flags(COMMAND_FLAGS)


def method_help() -> str:
    """``--method``'s help: every method's summary, from the registry."""
    lines = [
        f"{method} {policy.summary.get(method, '(a registered policy)')}"
        for policy in POLICIES.values()
        for method in policy.methods
    ]
    lines.append("full keeps everything (mlx-lm's own cache)")
    return "the cache: " + "; ".join(lines) + ". Default: %(default)s"


def setting_argument(setting: Setting) -> dict[str, Any]:
    """``add_argument`` keywords for one typed setting (default ``None``: not given)."""
    kind: Any = setting.kind
    if kind is bool:
        kind = _boolean
    default = "the method's" if setting.default is None else repr(setting.default)
    help = setting.help or ""
    if "default" not in help:  # a help that says its default already says it once
        help = f"{help} (default: {default})" if help else f"default: {default}"
    kwargs: dict[str, Any] = {"type": kind, "default": None, "help": help}
    if setting.choices is not None:
        kwargs["choices"] = setting.choices
    else:
        kwargs["metavar"] = _METAVARS.get(setting.kind, "VALUE")
    return kwargs


_METAVARS: dict[Any, str] = {int: "N", float: "X", bool: "BOOL"}
_CHOICE_METAVARS = {"signal": "KIND", "scope": "SCOPE", "prefill": "MODE", "allocation": "HOW"}


def _boolean(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _alias_argument(name: str) -> dict[str, Any]:
    """``--<name>``: the union of the policies' settings of that name."""
    settings = [s for p in POLICIES.values() for s in p.settings if s.name == name]
    owners = [p.name for p in POLICIES.values() if name in p.setting_names]
    choices = sorted({c for s in settings for c in (s.choices or ())}) or None
    kind = settings[0].kind if settings else int
    help = f"the chosen method's {name} setting ({', '.join(owners) or 'no policy'})"
    kwargs: dict[str, Any] = {"type": kind, "default": None, "help": help, "dest": f"alias_{name}"}
    if choices:
        kwargs["choices"] = choices
        kwargs["metavar"] = _CHOICE_METAVARS.get(name, "CHOICE")
    else:
        kwargs["metavar"] = _METAVARS.get(kind, "VALUE")
    return kwargs


# The first screen's one-line help of the shared short flags (``--help-all`` shows the rest).
ALIAS_BRIEFS = {
    "budget": "tokens each layer keeps, per KV head (default: 512)",
    "n_sink": "first tokens never evicted (attention sinks)",
    "signal": "key or query: what scores a token",
    "scope": "head or layer: one choice per KV head or per layer",
    "prefill": "oneshot or sequential: how the prompt is cut",
    "window": "last tokens that score the rest (snapkv, morphkv)",
    "allocation": "uniform, head or global: how heads share the budget",
}


def method_brief() -> str:
    """``--method``'s one line on the first screen: the methods, named."""
    from velox_mlx_lm.config import methods

    return f"{', '.join(methods())} (default: tova; --help-method METHOD says what it keeps)"


def add_method_flags(parser: argparse.ArgumentParser) -> None:
    """``--method``, the short aliases and every policy's ``--<policy>-<setting>``."""
    from velox_mlx_lm.config import methods

    method = parser.add_argument(
        "--method", choices=methods(), default="tova", metavar="METHOD", help=method_help()
    )
    method.velox_brief = method_brief()  # type: ignore[attr-defined]
    for name in ALIASES:
        alias = parser.add_argument(f"--{name.replace('_', '-')}", **_alias_argument(name))
        alias.velox_brief = ALIAS_BRIEFS.get(name)  # type: ignore[attr-defined]
    for policy in POLICIES.values():
        group = parser.add_argument_group(f"{policy.name} settings ({', '.join(policy.methods)})")
        for setting in policy.settings:
            group.add_argument(
                flag_name(policy.name, setting.name),
                dest=field_name(policy.name, setting.name),
                **setting_argument(setting),
            )


KV_BITS_HELP = (
    "keep the cache's rows quantized to this many bits (1-6 or 8), for every method; batching "
    "stays on with a Velox method; with --method full: mlx-lm's QuantizedKVCache"
)
KEY_LAYOUT_HELP = (
    "how quantized keys are grouped (Velox methods): token, each row along its features, as "
    "mlx-lm does; channel, each feature over groups of --kv-group-size tokens with the newest "
    "at full precision (KIVI), which keeps 4 and 2 bits usable (default: channel at --kv-bits 4 "
    "and below where the method allows it, a Velox method with --allocation uniform; else token)"
)
QUANTIZED_START_HELP = (
    "only 0 with a Velox method: it quantizes every row as it arrives, so that a long prompt "
    "never holds a full-precision copy"
)


def add_quant_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start``, as mlx-lm names them."""
    bits = parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        metavar="N",
        help=f"{KV_BITS_HELP} (default: the model's precision)",
    )
    bits.velox_brief = "quantize the cache to N bits: 8, 4 (1-6 or 8)"  # type: ignore[attr-defined]
    group = parser.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        metavar="N",
        help="features per scale and bias of quantized rows: 32, 64 or 128 (default: 64)",
    )
    group.velox_brief = "32, 64 or 128 features per scale (default: 64)"  # type: ignore[attr-defined]
    layout = parser.add_argument(
        "--kv-key-layout", choices=KEY_LAYOUTS, default=None, metavar="LAYOUT", help=KEY_LAYOUT_HELP
    )
    layout.velox_brief = "token or channel (default: channel at 4 bits and below)"  # type: ignore[attr-defined]
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=None,
        metavar="N",
        help=f"{QUANTIZED_START_HELP} (default: 0)",
    )


POSITIONS_HELP = (
    "RoPE positions of a bounded method's rows: 'absolute' rotates every key at its token "
    "index; 'compact' shifts the kept rows down when the next position would reach the "
    "model's context, so that no query-to-key distance exceeds it (tova, h2o, streaming_llm; "
    "keys at full precision or quantized per token)"
)


def add_positions_flag(parser: argparse.ArgumentParser, default: str = "absolute") -> None:
    """``--positions absolute|compact`` (``KVCacheConfig(positions=...)``)."""
    from velox_mlx_lm.positions import POSITIONS

    action = parser.add_argument(
        "--positions",
        choices=POSITIONS,
        default=None,
        metavar="HOW",
        help=f"{POSITIONS_HELP} (default: {default})",
    )
    action.velox_brief = f"absolute or compact RoPE positions (default: {default})"  # type: ignore[attr-defined]


DEMOTE_HELP = (
    "keep the rows a bounded method evicts in a demoted tier at N bits (2 or 4; keys per "
    "channel, values per token) instead of dropping them, attended with the kept rows; needs "
    "--demote-budget (docs/quantized.md, 'The demoted tier')"
)


def add_demote_flags(parser: argparse.ArgumentParser) -> None:
    """``--demote-bits N --demote-budget N`` (``KVCacheConfig(demote_bits=, demote_budget=)``)."""
    bits = parser.add_argument(
        "--demote-bits", type=int, default=None, metavar="N", help=f"{DEMOTE_HELP} (default: off)"
    )
    bits.velox_brief = "keep evicted rows at 2 or 4 bits (default: dropped)"  # type: ignore[attr-defined]
    budget = parser.add_argument(
        "--demote-budget",
        type=int,
        default=None,
        metavar="N",
        help="rows per KV head the demoted tier holds (with --demote-bits)",
    )
    budget.velox_brief = "rows per KV head of the demoted tier"  # type: ignore[attr-defined]


def check_quantized_start(args: argparse.Namespace, velox: bool) -> None:
    """``--quantized-kv-start`` other than 0 is refused where the cache quantizes every row
    as it arrives (``velox``: a Velox method, or velox-generate's full cache)."""
    start = getattr(args, "quantized_kv_start", None)
    if velox and start not in (None, 0):
        raise ValueError(
            f"--quantized-kv-start {start}: with --method {args.method} rows are quantized as "
            "they arrive, so that a long prompt never holds a full-precision copy; only 0 is "
            "accepted (mlx-lm's delayed start applies to velox-serve --method full)"
        )


def config_from_args(args: argparse.Namespace, quantize_full: bool = True) -> Any:
    """The KVCacheConfig the flags describe; a flag the method has no use for is an error,
    and so is an alias that contradicts its ``--<policy>-<setting>``. ``--kv-bits`` and
    ``--kv-group-size`` go into the config for every method (for ``full`` only with
    ``quantize_full``: velox-serve leaves mlx-lm's full cache to mlx-lm's own flags).
    Without ``--kv-key-layout``, keys at 4 bits and below are quantized per channel where the
    config allows it (:func:`key_layout`). An error of the config names the flags typed."""
    from velox_mlx_lm.config import FULL, KVCacheConfig

    method = args.method
    policy = KVCacheConfig(method=method).policy
    fields, typed = _policy_fields(args, policy, method)
    layout = getattr(args, "kv_key_layout", None)
    if method != FULL or quantize_full:
        fields["kv_bits"] = getattr(args, "kv_bits", None)
        fields["kv_group_size"] = getattr(args, "kv_group_size", 64)
        fields["kv_key_layout"] = layout or "token"
    elif layout not in (None, "token"):
        raise ValueError(
            f"--kv-key-layout {args.kv_key_layout} is a Velox layout: --method full keeps "
            "mlx-lm's QuantizedKVCache (--kv-bits), which quantizes keys per token"
        )
    positions = getattr(args, "positions", None)
    if positions is not None:
        fields["positions"] = positions
    for name in ("demote_bits", "demote_budget"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    try:
        config = KVCacheConfig(method=method, **fields)
    except (TypeError, ValueError) as exc:
        raise type(exc)(name_flags(str(exc), policy, typed)) from None
    return config if layout is not None else config.replace(kv_key_layout=key_layout(config))


def _policy_fields(
    args: argparse.Namespace, policy: str | None, method: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The config fields the method flags give, and ``setting -> 'FLAG VALUE'`` as typed."""
    fields: dict[str, Any] = {}
    typed: dict[str, str] = {}
    for record in POLICIES.values():
        for name in record.setting_names:
            value = getattr(args, field_name(record.name, name), None)
            if value is None:
                continue
            if record.name != policy:
                raise ValueError(
                    f"{flag_name(record.name, name)} does not apply to --method {method}"
                )
            fields[field_name(record.name, name)] = value
            typed[name] = f"{flag_name(record.name, name)} {value}"
    for name in ALIASES:
        value = getattr(args, f"alias_{name}", None)
        if value is not None:
            _apply_alias(fields, policy, method, name, value)
            typed.setdefault(name, f"--{name.replace('_', '-')} {value}")
    return fields, typed


LOW_BITS = 4  # at this width and below, keys per token lose the answer (docs/quantized.md)


def key_layout(config: Any) -> str:
    """The key layout when ``--kv-key-layout`` is not given: ``channel`` at 4 bits and below
    where the config allows it (a Velox method whose heads keep their own rows: allocation
    ``uniform``), else ``token`` (KVCacheConfig's own default, the library's)."""
    if config.kv_bits is None or config.kv_bits > LOW_BITS or config.policy is None:
        return "token"
    if config.positions == "compact":  # shifts keys quantized per token only
        return "token"
    return "channel" if config.settings().get("allocation", "uniform") == "uniform" else "token"


def layout_warning(args: argparse.Namespace, config: Any) -> str | None:
    """One line when ``--kv-bits`` 4 or below quantizes keys per token without
    ``--kv-key-layout token`` having asked for it, naming the flag that changes it."""
    bits = getattr(args, "kv_bits", None)
    if bits is None or bits > LOW_BITS or getattr(args, "kv_key_layout", None) is not None:
        return None
    if config.policy is None:
        why, fix = "--method full has only mlx-lm's per-token layout", "a Velox --method"
    elif config.positions == "compact":
        why, fix = "--positions compact shifts keys per token", "--positions absolute"
    else:
        allocation = config.settings().get("allocation", "uniform")
        if allocation == "uniform":
            return None
        why, fix = f"--allocation {allocation} needs it", "--allocation uniform"
    return (
        f"keys are quantized per token at --kv-bits {bits} ({why}), which can garble answers; "
        f"{fix} allows --kv-key-layout channel, or use --kv-bits 8"
    )


def name_flags(message: str, policy: str | None, typed: Mapping[str, str]) -> str:
    """A config error in the flags' words: ``kv_bits`` as ``--kv-bits``; the settings of the
    method it names are led by the flags typed for them (``--budget 0: tova_budget must be an
    int >= 1, got 0``) and followed by the flags of those not typed."""
    message = _KV_FIELD.sub(
        lambda m: "--" + m.group(1).replace("_", "-") + " " * bool(m[2]), message
    )
    if policy is None:
        return message
    names = sorted(POLICIES[policy].setting_names, key=len, reverse=True)
    pattern = re.compile(rf"(?<![\w-])(?:{policy}_)?({'|'.join(names)})(?!\w)")
    mentioned = list(dict.fromkeys(m.group(1) for m in pattern.finditer(message)))
    given = [typed[name] for name in mentioned if name in typed]
    others = [f"{_flag_of(policy, name)} sets {name}" for name in mentioned if name not in typed]
    lead = f"{', '.join(given)}: " if given else ""
    tail = f" ({', '.join(others)})" if others else ""
    return f"{lead}{message}{tail}"


_KV_FIELD = re.compile(r"(?<![\w-])(kv_bits|kv_group_size|kv_key_layout)(=)?(?!\w)")


def _flag_of(policy: str, name: str) -> str:
    """The flag that sets a setting: its short alias where it has one."""
    return f"--{name.replace('_', '-')}" if name in ALIASES else flag_name(policy, name)


def _apply_alias(
    fields: dict[str, Any], policy: str | None, method: str, name: str, value: Any
) -> None:
    flag = f"--{name.replace('_', '-')}"
    if policy is None or name not in POLICIES[policy].setting_names:
        raise ValueError(f"{flag} does not apply to --method {method}")
    key = field_name(policy, name)
    if key in fields and fields[key] != value:
        raise ValueError(f"{flag} {value} contradicts {flag_name(policy, name)} {fields[key]}")
    fields[key] = value
