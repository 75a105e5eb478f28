"""Where a layer's rows are held: the slot store and the rows it keeps, of any kind.

- :mod:`~velox_cache_core.store.slots`: :class:`KVSlots`, a layer's ``S`` slots per (batch
  row, KV head): keys, values and true positions, a dead slot, reserved rows to grow into;
- :mod:`~velox_cache_core.store.rows`: the row protocol (:class:`RowStore`), the kinds of
  rows a store holds (:data:`Rows`) and the row operations on any of them (``take``, ``put``,
  ``concat``, ``pad``, ``dense``, ...);
- :mod:`~velox_cache_core.store.token_rows`: rows quantized per token (:class:`QRows`, mlx-lm's
  ``QuantizedKVCache`` layout) and the :class:`Quant` spec a layer quantizes by;
- :mod:`~velox_cache_core.store.channel_keys`: keys quantized per channel over groups of
  tokens, with a full-precision window (:class:`KRows`, KIVI's keys);
- :mod:`~velox_cache_core.store.rope_shift`: compact RoPE positions, the re-rotation of kept
  keys that keeps query-to-key distances inside a model's context (``positions="compact"``).

Dense rows are plain ``mx.array`` ``[B, H_kv, S, D]``. Nothing here imports the rest of the
core.
"""

from __future__ import annotations

from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.rows import QUANTIZED, Rows, RowStore, quant_of
from velox_cache_core.store.slots import KVSlots, Reserve, stored_fields
from velox_cache_core.store.token_rows import KEY_LAYOUTS, QRows, Quant

__all__ = [
    "KEY_LAYOUTS",
    "QUANTIZED",
    "KRows",
    "KVSlots",
    "QRows",
    "Quant",
    "Reserve",
    "RowStore",
    "Rows",
    "quant_of",
    "stored_fields",
]
