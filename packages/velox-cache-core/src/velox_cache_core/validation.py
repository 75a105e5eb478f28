"""Checks at the public boundary: clear messages naming the argument, nothing clamped."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from velox_cache_core.store.rows import QUANTIZED, quant_of
from velox_cache_core.store.token_rows import check_member

if TYPE_CHECKING:
    from velox_cache_core.store.slots import KVSlots


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """``value`` must be an int (not bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` must be a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    check_member(name, value, tuple(choices))
    return str(value)


def check_budget_and_sinks(budget: Any, n_sink: Any) -> None:
    """``budget >= 1``; ``0 <= n_sink < budget``."""
    check_int("budget", budget, minimum=1)
    check_int("n_sink", n_sink, minimum=0)
    if n_sink and n_sink >= budget:
        raise ValueError(
            f"n_sink must be < budget ({budget}) so that a token can be evicted, got {n_sink}"
        )


def check_tensor(name: str, x: Any, layout: str) -> None:
    """An ``mx.array`` of 4 axes (``layout``) and a floating dtype, or quantized rows
    (:data:`~velox_cache_core.store.rows.QUANTIZED`)."""
    if isinstance(x, QUANTIZED):
        return
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array {layout}, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")


def check_kv(
    keys: Any,
    values: Any,
    *,
    expect: tuple[int, int, int] | None,
    dtype: mx.Dtype | None,
    value_dim: int | None = None,
) -> None:
    """keys ``[B, H_kv, L, D]`` and values ``[B, H_kv, L, D_v]``, one dtype; ``expect`` =
    (B, H_kv, D) and ``value_dim`` = D_v, fixed by the state. Values may be narrower or wider
    than keys (latent attention caches a latent and a RoPE part of different widths)."""
    check_tensor("keys", keys, "[B, H_kv, L, D]")
    check_tensor("values", values, "[B, H_kv, L, D_v]")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"values must be [B, H_kv, L, D_v] with the B, H_kv, L of keys {tuple(keys.shape)}, "
            f"got {tuple(values.shape)}"
        )
    if keys.dtype != values.dtype:
        raise TypeError(f"values must have the dtype of keys ({keys.dtype}), got {values.dtype}")
    kq, vq = quant_of(keys), quant_of(values)
    if (kq and (kq.bits, kq.group_size)) != (vq and (vq.bits, vq.group_size)):
        raise TypeError(
            f"keys and values must be quantized alike, got {quant_of(keys)} and {quant_of(values)}"
        )
    if expect is not None:
        B, H, _, D = keys.shape
        for label, got, want in (("B", B, expect[0]), ("H_kv", H, expect[1]), ("D", D, expect[2])):
            if got != want:
                raise ValueError(
                    f"keys {label} ({got}) differs from the state's {label} ({want}); "
                    "a state serves one layer of one batch"
                )
    if value_dim is not None and values.shape[3] != value_dim:
        raise ValueError(
            f"values D_v ({values.shape[3]}) differs from the state's D_v ({value_dim}); "
            "a state serves one layer of one batch"
        )
    if dtype is not None and keys.dtype != dtype:
        raise TypeError(f"keys dtype {keys.dtype} differs from the state's dtype {dtype}")


def check_queries(queries: Any, keys: Any) -> mx.array:
    """queries ``[B, H_q, L, D]`` matching keys ``[B, H_kv, L, D]`` with ``H_q % H_kv == 0``."""
    check_tensor("queries", queries, "[B, H_q, L, D]")
    B, H_kv, L, D = keys.shape
    qB, H_q, qL, qD = queries.shape
    if (qB, qL, qD) != (B, L, D):
        raise ValueError(
            f"queries must have shape [B={B}, H_q, L={L}, D={D}], got {tuple(queries.shape)}"
        )
    if H_q % H_kv:
        raise ValueError(f"queries H_q ({H_q}) must be a multiple of keys H_kv ({H_kv})")
    return queries


def check_scale(scale: Any, head_dim: int) -> float:
    """Softmax scale: positive finite float; ``None`` means ``1/sqrt(D)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return float(scale)


def require_finite(**arrays: Any) -> None:
    """Raise if any given array (or quantized rows' scales and biases) has NaN or inf
    (forces evaluation: boundary use only)."""
    for name, given in arrays.items():
        if given is None:
            continue
        parts = given.arrays()[1:4] if isinstance(given, QUANTIZED) else [given]
        if any(x.size and not mx.isfinite(x).all().item() for x in parts):
            raise ValueError(f"{name} contains NaN or inf")


def check_fits(slots: KVSlots | None, keys: Any, values: Any, *, stored: bool = True) -> None:
    """``keys``/``values`` ``[B, H_kv, L, D]`` (values ``D_v`` wide) match the slots' batch,
    heads, widths and dtype (anything goes for an empty state), and, when they are to be
    ``stored`` with them, their quantization; ``ValueError``/``TypeError`` naming what
    differs."""
    if slots is None:
        check_kv(keys, values, expect=None, dtype=None)
        return
    B, H, _, D = slots.keys.shape
    check_kv(
        keys,
        values,
        expect=(B, H, D),
        dtype=slots.keys.dtype,
        value_dim=int(slots.values.shape[3]),
    )
    held, given = quant_of(slots.keys), quant_of(keys)
    if stored and held != given:
        raise TypeError(
            f"keys are {'quantized as ' + str(given) if given else 'full precision'}, but the "
            f"state holds {'rows quantized as ' + str(held) if held else 'full-precision rows'}"
        )
