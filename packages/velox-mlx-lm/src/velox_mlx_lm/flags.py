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
from typing import Any

from velox_cache_core.registry import POLICIES, field_name, flag_name, reserve_flags
from velox_cache_core.settings import Setting

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


def _argument(setting: Setting) -> dict[str, Any]:
    """``add_argument`` keywords for one typed setting (default ``None``: not given)."""
    kind: Any = setting.kind
    if kind is bool:
        kind = _boolean
    default = "the method's" if setting.default is None else repr(setting.default)
    help = f"{setting.help} (default: {default})" if setting.help else f"default: {default}"
    kwargs: dict[str, Any] = {"type": kind, "default": None, "help": help}
    if setting.choices is not None:
        kwargs["choices"] = setting.choices
    return kwargs


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
    return kwargs


def add_method_flags(parser: argparse.ArgumentParser) -> None:
    """``--method``, the short aliases and every policy's ``--<policy>-<setting>``."""
    from velox_mlx_lm.config import methods

    parser.add_argument("--method", choices=methods(), default="tova", help=method_help())
    for name in ALIASES:
        parser.add_argument(f"--{name.replace('_', '-')}", **_alias_argument(name))
    for policy in POLICIES.values():
        group = parser.add_argument_group(f"{policy.name} settings ({', '.join(policy.methods)})")
        for setting in policy.settings:
            group.add_argument(
                flag_name(policy.name, setting.name),
                dest=field_name(policy.name, setting.name),
                **_argument(setting),
            )


def add_quant_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start``, as mlx-lm names them."""
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="keep the cache's rows quantized to this many bits (1-6 or 8), for every method; "
        "with --method full: mlx-lm's QuantizedKVCache (default: the model's precision)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        help="features per scale and bias of quantized rows: 32, 64 or 128 (default: 64)",
    )
    parser.add_argument(
        "--kv-key-layout",
        choices=("token", "channel"),
        default="token",
        help="how quantized keys are grouped (Velox methods): token, each row along its "
        "features, as mlx-lm does; channel, each feature over groups of --kv-group-size tokens "
        "with the newest at full precision (KIVI), which keeps 4 and 2 bits usable "
        "(default: token)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=None,
        help="only 0: Velox quantizes every row as it arrives, so that a long prompt never "
        "holds a full-precision copy (default: 0)",
    )


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
    ``quantize_full``: velox-serve leaves mlx-lm's full cache to mlx-lm's own flags)."""
    from velox_mlx_lm.config import FULL, KVCacheConfig

    method = args.method
    policy = KVCacheConfig(method=method).policy
    fields: dict[str, Any] = {}
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
    for name in ALIASES:
        value = getattr(args, f"alias_{name}", None)
        if value is not None:
            _apply_alias(fields, policy, method, name, value)
    if method != FULL or quantize_full:
        fields["kv_bits"] = getattr(args, "kv_bits", None)
        fields["kv_group_size"] = getattr(args, "kv_group_size", 64)
        fields["kv_key_layout"] = getattr(args, "kv_key_layout", "token")
    elif getattr(args, "kv_key_layout", "token") != "token":
        raise ValueError(
            f"--kv-key-layout {args.kv_key_layout} is a Velox layout: --method full keeps "
            "mlx-lm's QuantizedKVCache (--kv-bits), which quantizes keys per token"
        )
    try:
        return KVCacheConfig(method=method, **fields)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith("kv_"):  # name the flag
            raise type(exc)(f"--{str(exc).replace('_', '-', 2)}") from None
        raise


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
