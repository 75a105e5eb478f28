"""The decode path: a layer's rows while it decodes, held in plain mutable fields.

Between prefill and whatever comes next (a trim, a pin, a save, a batch), a decoding layer does
the same thing every token. Its rows (keys, values, positions, the dead slot, the running
fields, the counters) then live in one of these stores as mutable attributes that a step
replaces in place, and the step runs without building a frozen state, a step record or an undo
entry per token:

- :class:`~velox_cache_core.decode.evicting.Evicting`: an evicting policy at its budget (TOVA,
  H2O, StreamingLLM, MorphKV: ``Policy.compiled_decode``): write into the dead slot, score,
  pick the next one, attend, in two compiled kernels (one, when the caller hands the written
  rows back untouched: ``Evicting.write``'s ``defer``);
- :class:`~velox_cache_core.decode.appending.Appending`: a policy that only appends after its
  prompt (SnapKV after its cut: ``Policy.appends_now``): the token written in place into
  reserved rows, nothing to decide.

The undo entries are kept as raw tuples and become :class:`~velox_cache_core.undo.Entry`
objects, and the rows a frozen state, only when something other than a decode step reads the
layer (``cool``: :class:`velox_cache_core.layer.Layer` does it whenever its ``state``,
``log`` or ``pending`` is read). What a store computes is what the general path computes (the
kernels are its code traced once), bit for bit: ``tests/test_fast_step.py``.

Both stores answer the same calls (``write`` a decode token, ``lay_out_chunk``, ``attend``,
``cool``, ``arrays``) and share their counters, the call in flight and the raw undo entries
(:class:`~velox_cache_core.decode.store.Store`); only an evicting store lays out a short chunk
and runs it as decode steps (``attend_chunk``).
"""

from velox_cache_core.decode.appending import Appending
from velox_cache_core.decode.evicting import Evicting

Hot = Evicting | Appending
"""A layer's decode-path store."""

__all__ = ["Appending", "Evicting", "Hot"]
