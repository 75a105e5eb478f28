"""Velox caches for mlx-lm: one layer cache class per core policy, each mlx-lm's cache protocol
over one core :class:`velox_cache_core.layer.Layer`.

The model reads ``offset`` for RoPE, calls ``update_and_fetch`` with rotated keys/values
``[B, H_kv, L, D]`` (the layer lays the call out) and attends over what it returns. With the
attention hook installed (``velox_mlx_lm.hook``) the attention call comes back here
(``attend``) with the true queries, and the layer settles the call with them. Which mode the
layer runs in is decided once, by ``KVCacheBuilder.for_model``; a cache made directly stays
correct without the hook. State round-trips through mlx-lm's prompt-cache files
(``velox_mlx_lm.prompt_state``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx
import mlx_lm.models.cache as _mlx_cache

from velox_cache_core import (
    POLICIES,
    Compaction,
    Layer,
    Mode,
    Policy,
    Quant,
    Rope,
    StepSums,
    TierSpec,
    new_log,
    rotate,
    seen_pinned,
    spans,
)
from velox_mlx_lm.base import VeloxKVCache, additive, fetched_as_is, for_mlx
from velox_mlx_lm.batch_cache import BatchVeloxKVCache, merge
from velox_mlx_lm.positions import COMPACT_POLICIES, shift_layer
from velox_mlx_lm.prompt_state import decode, encode, load_tier, quant_of_state, tier_state

# Tokens a cache can take back by default: mlx-lm's speculative decoding trims up to
# num_draft_tokens (2 by default, 3 on its command line) per round.
TRIM_WINDOW = 16


class _Offset:
    """:attr:`PolicyKVCache.offset`: computed by ``PolicyKVCache._offset``, except while the
    layer decodes on the core's decode path, which keeps the value in the instance's dict (a
    descriptor without ``__set__`` lets that win), so the model's two reads a layer a step
    cost no Python call; the path drops it when it leaves (``velox_cache_core.decode``)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return obj._offset()


class PolicyKVCache(VeloxKVCache):
    """A core policy (``velox_cache_core.POLICIES[policy_name]``) as an mlx-lm layer cache.

    One subclass per registered policy (:func:`cache_class`); each is registered by name in
    ``mlx_lm.models.cache``, where ``load_prompt_cache`` looks classes up. ``mode``: where the
    layer decides (:class:`velox_cache_core.layer.Mode`; the builder chooses it).
    """

    policy_name: ClassVar[str]
    _layer: Layer
    # what update_and_fetch returned last (the hook hands it back to attend)
    _returned: tuple[Any, Any] | None = None
    # whether another layer of the model may read this one's last call (mlx-lm's KV sharing:
    # gemma3n, afm7): the builder says no for a model with a cache per layer; if not, a call
    # off the decode path drops its copies once attended (Layer.release)
    shared_rows: bool = True
    # whether the model hands what update_and_fetch returned back to attend untouched (seen
    # at a decode step: True; keys of its own or an additive mask: False for good): a decode
    # step that waits for its queries then writes its token in attend, with the decision
    # (velox_cache_core.decode.evicting.Evicting.write's defer)
    _as_returned: bool | None = None
    # positions="compact": the layer's compaction (None: absolute positions), and the shift
    # the queries of the call in flight still need (the model rotated them before the shift)
    _compaction: Compaction | None = None
    _query_shift: int = 0
    # the layer's state, undo log, compaction, and demoted tier with its undo record (None
    # without one) just before the last shift, while a trim may still reach back past it (its
    # undo window): such a trim undoes the shift
    _before_shift: tuple[Any, Any, Compaction, Any, Any] | None = None
    # a call whose shift falls inside it: (tokens before the shift, keys, values); attend
    # runs it as two calls around the shift
    _split: tuple[int, mx.array, mx.array] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "policy_name" in cls.__dict__:
            _CLASSES[cls.policy_name] = cls
            setattr(_mlx_cache, cls.__name__, cls)

    def __init__(
        self,
        trim_window: int = TRIM_WINDOW,
        group: Any = None,
        mode: Mode = Mode.QUERIES,
        quant: Quant | None = None,
        demote: TierSpec | None = None,
        **settings: Any,
    ) -> None:
        state = self._policy.init(**settings)
        log = new_log(trim_window)
        self._layer = Layer(self._policy, state, log, mode=mode, quant=quant, demote=demote)
        self.group = group

    @classmethod
    def from_layer(cls, layer: Layer) -> PolicyKVCache:
        """A cache over ``layer`` (a row taken out of a batched cache)."""
        cache = cls.__new__(cls)
        cache._layer = layer
        return cache

    def __copy__(self) -> PolicyKVCache:
        out = type(self).from_layer(copy.copy(self._layer))
        out._compaction = self._compaction  # immutable: shared
        out._before_shift = self._before_shift
        out.shared_rows = self.shared_rows
        return out

    @property
    def _policy(self) -> Policy:
        return POLICIES[self.policy_name]

    @property
    def layer(self) -> Layer:
        """The core layer object this cache drives."""
        return self._layer

    @property
    def group(self) -> Any:
        """The tensor-parallel group (``mx.distributed.Group``) of a sharded model's layer, or
        ``None``: layer-wide decisions ``all_sum`` the heads' weights over it (see
        ``docs/distributed.md``). A group of one rank is stored as ``None``."""
        return self._layer.group

    @group.setter
    def group(self, group: Any) -> None:
        self._layer.connect(group)

    # -- quantized rows: mlx-lm's quantized attention reads ``bits``/``group_size`` -------------
    @property
    def quant(self) -> Quant | None:
        """How the rows are quantized (``None``: the model's precision)."""
        return self._layer.quant

    @property
    def bits(self) -> int:
        """Bits per element of the quantized rows. Only a quantized cache has it, so that
        mlx-lm's ``scaled_dot_product_attention`` (which checks ``hasattr(cache, "bits")``)
        runs its quantized attention over what ``update_and_fetch`` returned when the hook
        does not take the call."""
        return self._quant_field("bits")

    @property
    def group_size(self) -> int:
        """Features per scale and bias of the quantized rows (a quantized cache only)."""
        return self._quant_field("group_size")

    def _quant_field(self, name: str) -> int:
        quant = self._layer.quant
        if quant is None:
            raise AttributeError(f"{type(self).__name__} holds full-precision rows: no {name}")
        return int(getattr(quant, name))

    @property
    def step_sums(self) -> StepSums | None:
        """The ``StepSums`` this cache's decode steps send their layer-wide sums through (one
        ``all_sum`` per forward pass for all layers), or ``None``: one per layer."""
        return self._layer.sums

    def share_step_sums(self, sums: StepSums | None, layer: int = 0) -> None:
        """Send this cache's decode-step sums through ``sums`` as layer ``layer`` of the model
        (``None``: one ``all_sum`` per layer again). ``sums.group`` must be this cache's."""
        self._layer.share_step_sums(sums, layer)

    # -- what users read (never a collective) ---------------------------------------------------
    @property
    def policy_state(self) -> Any:
        """The core state after every pending decision (arrays stay lazy)."""
        self._layer.settle()
        return self._layer.state

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self._layer.state.settings)

    offset = _Offset()

    def _offset(self) -> int:
        """The position the model rotates the next token at: its token index (tokens seen,
        not tokens kept) with ``positions="absolute"``; with ``"compact"``, the token index
        less the gaps closed by the shifts so far (:attr:`token_offset` is the index)."""
        comp = self._compaction
        offset = self._layer.offset
        return offset if comp is None else offset - comp.lag

    def __getstate__(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.pop("offset", None)  # the decode path's mirror of it belongs to this object
        return out

    @property
    def token_offset(self) -> int:
        """The token index of the next token (tokens seen; ``offset`` with absolute
        positions)."""
        return self._layer.offset

    # -- positions ---------------------------------------------------------------------------
    @property
    def positions_mode(self) -> str:
        """``"absolute"`` or ``"compact"`` (see :meth:`compact_positions`)."""
        return "absolute" if self._compaction is None else "compact"

    @property
    def compaction(self) -> Compaction | None:
        """The compact positions' state (``None`` with absolute positions)."""
        return self._compaction

    def compact_positions(self, context: int, rope: Rope) -> None:
        """Keep every query-to-key RoPE distance below ``context`` (the model's trained
        context): when a call would reach it, the kept rows are shifted down to close the
        gaps of evicted ones (``velox_cache_core.store.rope_shift``). ``rope``: the model's
        rotation of this layer. The builder calls it for ``KVCacheConfig(positions=
        "compact")``; the queries of a call that shifted are rotated in :meth:`attend`, so
        the attention hook must reach the model. Only before the first call."""
        if self.policy_name not in COMPACT_POLICIES:
            raise ValueError(
                f"positions='compact' supports the policies {', '.join(COMPACT_POLICIES)}; "
                f"{self.policy_name} keeps rows it cannot shift: use positions='absolute'"
            )
        if not self._layer.empty():
            raise ValueError("compact_positions() must come before the cache's first call")
        quant = self._layer.quant
        if quant is not None and quant.keys != "token":
            raise ValueError(
                "positions='compact' shifts keys quantized per token (kv_key_layout='token'), "
                f"not per {quant.keys}; or use positions='absolute'"
            )
        settings = self._layer.state.settings
        if settings.get("allocation", "uniform") != "uniform":
            raise ValueError(
                f"positions='compact' needs {self.policy_name}_allocation='uniform' (got "
                f"{settings['allocation']!r}): every layer must lay its rows below the same "
                "budget; or use positions='absolute'"
            )
        if not isinstance(rope, Rope):
            raise TypeError(f"rope must be a Rope, got {type(rope).__name__}")
        top = int(settings["budget"])  # the kept rows, and a demoted tier's below them
        if self._layer.demote is not None:
            top += self._layer.demote.budget
        self._compaction = Compaction(
            context=context, rope=rope, top=top, n_sink=int(settings["n_sink"])
        )

    def _shift(self, length: int) -> int:
        """Compact the kept rows before a call of ``length`` tokens that would reach the
        context (``length=1`` after a call: the next token would); returns Δ, the rotation
        the call's keys and queries still need (the model rotated them before the shift)."""
        comp = self._compaction
        assert comp is not None
        layer = self._layer
        layer.settle()
        before = (layer.state, layer.log, comp, layer.tier, layer.tier_undo)
        self._compaction, delta = shift_layer(layer, comp, length)
        self._before_shift = before if layer.log is not None else None
        return delta

    def _forget_before_shift(self) -> None:
        """Drop the state before the last shift once no trim can reach back to it."""
        comp, log = self._compaction, self._layer.log
        if comp is None or log is None or self._layer.offset - comp.shifted_at > log.window:
            self._before_shift = None

    def _shift_after_call(self) -> None:
        """Shift now when the next token would reach the context, so that ``offset`` stays
        below it between calls (a collective-free moment: not under shared step sums)."""
        comp = self._compaction
        layer = self._layer
        if comp is None or layer.pending is not None or layer.mode is Mode.STEP_SUMS:
            return
        if comp.needs_shift(layer.offset, 1):  # nothing pending: the state's offset
            self._shift(1)

    @property
    def tokens_seen(self) -> int:
        return int(self._layer.view().tokens_seen)

    def pin(self, start: int, stop: int) -> None:
        """Never evict tokens ``[start, stop)`` (token indices of the sequence, 0 = its first):
        seen ones must all still be kept, later ones are kept as they come. They count in the
        budget and the bytes; ``ValueError`` (and nothing changed) when they cannot fit
        (``velox_cache_core.pins``). :func:`velox_mlx_lm.pins.pin_span` pins every layer."""
        self._layer.pin(start, stop)

    @property
    def pinned_spans(self) -> list[tuple[int, int]]:
        """The pinned ``[start, stop)`` spans, sorted and disjoint."""
        return spans(self._layer.view().pins)

    @property
    def pinned_tokens(self) -> int:
        """Tokens of the pinned spans seen so far (all of them kept)."""
        return seen_pinned(self._layer.view().pins, self.token_offset)  # a token index

    @property
    def tokens_kept(self) -> int:
        return int(self._layer.view().tokens_kept)

    @property
    def compression_ratio(self) -> float:
        return float(self._layer.view().compression_ratio)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows kept: the main rows and the demoted tier's."""
        return int(self._layer.view().nbytes) + self.tier_nbytes

    @property
    def tier_nbytes(self) -> int:
        """Bytes of the demoted tier (keys, values, positions and scores; 0 without one)."""
        tier = self._layer.tier
        return 0 if tier is None else tier.nbytes

    @property
    def demoted_tokens(self) -> int:
        """Rows per (batch row, KV head) in the demoted tier (0 without one)."""
        tier = self._layer.tier
        return 0 if tier is None else tier.n_rows

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained tokens."""
        return self._layer.view().positions

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys (``None`` while empty)."""
        return self.policy_state.keys

    @keys.setter
    def keys(self, value: Any) -> None:
        """Tie ``value`` to the stored keys without changing them: mlx-lm's pipeline-parallel
        models end a rank's pass with ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` so
        that evaluating the caches' state also runs the ``send`` of ``h``."""
        if isinstance(value, mx.array):
            self._layer.tie(value)

    def size(self) -> int:
        """Rows held per KV head (averaged over the heads when an adaptive allocation gave
        them different counts)."""
        return int(self._layer.view().tokens_kept)

    def empty(self) -> bool:
        return self._layer.empty()

    @property
    def trim_window(self) -> int:
        """Tokens the undo log keeps for exact trims (0: not trimmable)."""
        log = self._layer.log
        return 0 if log is None else log.window

    @property
    def undo_nbytes(self) -> int:
        """Bytes held by the undo log (apart from ``nbytes``, the kept rows)."""
        self._layer.view()
        log = self._layer.log
        return 0 if log is None else log.nbytes

    @property
    def held_nbytes(self) -> int:
        """Every byte the cache holds: the state's (rows held, their positions, running
        arrays), the undo log's and the demoted tier's, with the tier kept for trims (counted
        whole, though it shares arrays with the tier now: a bound)."""
        held = int(self._layer.view().held_nbytes) + self.undo_nbytes + self.tier_nbytes
        held += _tier_bytes(self._layer.tier_undo)
        before = self._before_shift
        if before is not None:  # the state before a shift, kept for trims past it
            held += int(before[0].held_nbytes) + (0 if before[1] is None else before[1].nbytes)
            held += (0 if before[3] is None else before[3].nbytes) + _tier_bytes(before[4])
        return held

    @property
    def trimmable_tokens(self) -> int:
        """How many of the last tokens ``trim`` can take back now (0 without a log)."""
        self._layer.view()
        tokens = self._layer.trimmable_tokens  # with a tier, within the last call
        comp = self._compaction
        if comp is not None and comp.shifts:  # past a shift: only with the state before it
            since = self._layer.offset - comp.shifted_at
            tokens = min(tokens, since)
            before = self._before_shift
            if tokens == since and before is not None and before[1] is not None:
                back = before[1].tokens
                if self._layer.demote is not None:  # the tier's last call before the shift
                    undo = before[4]
                    back = 0 if undo is None else min(back, undo.length)
                tokens = min(since + back, before[1].window)
        return tokens

    # -- the model's calls -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Append ``[B, H_kv, L, D]`` rotated keys/values; return ``retained + new`` (when
        quantized: mlx-lm's quantized tuples, ``(packed, scales, biases)`` each).

        With compact positions a call that would reach the model's context first shifts the
        kept rows (its keys, rotated by the model before the shift, are rotated with them)."""
        comp = self._compaction
        if comp is not None:
            if self._query_shift or self._split is not None:
                raise RuntimeError(
                    "positions='compact': the last call's queries never came back through the "
                    "attention hook (they needed the shift's rotation); the hook must reach "
                    "the model (KVCacheBuilder.for_model installs it)"
                )
            if self._before_shift is not None:
                self._forget_before_shift()
            length = int(keys.shape[2])
            if comp.needs_shift(self._layer.offset, length):
                first = comp.context - comp.offset(self._layer.offset)  # tokens before it
                if 0 < first < length:  # the shift falls inside the call: attend splits it
                    comp.check_fits(length - first)
                    self._split = (first, keys, values)
                    self._returned = (keys, values)
                    return keys, values
                self._query_shift = self._shift(length)
                keys = rotate(keys, self._query_shift, comp.rope)
        layer = self._layer
        hot = layer.hot
        if hot is not None and keys.shape[2] == 1:  # decoding: the decode path's own step
            defer = self._as_returned is True and not self.shared_rows and comp is None
            fetched = hot.write(keys, values, defer=defer)
            if fetched is not None:
                self._returned = fetched
                return fetched
        laid_out = layer.lay_out(keys, values)
        hot = layer.hot
        if hot is not None and comp is None:  # decoding now: it keeps the offset here
            hot.mirror = self.__dict__
            self.__dict__["offset"] = layer.offset
        if layer.quant is not None:
            laid_out = (for_mlx(laid_out[0]), for_mlx(laid_out[1]))
        self._returned = laid_out
        return laid_out

    def attend(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
        keys: mx.array | None = None,
        values: mx.array | None = None,
    ) -> mx.array:
        """Attention of ``queries [B, H_q, L, D]`` over this call's candidates, policy mask.

        When the model passes keys/values of its own (derived row by row from what
        ``update_and_fetch`` returned, as absorbed latent attention does) or adds scores
        through ``mask``, the cache attends over those, the model's scores added and its
        evicted rows hidden (:meth:`velox_cache_core.layer.Layer.attend_rows`).

        With compact positions, the queries of a call that shifted are rotated as its keys
        were; a call the shift falls inside runs as two calls around it."""
        if self._split is not None:
            return self._attend_split(queries, scale, mask, sinks, keys, values)
        if self._query_shift:
            comp = self._compaction
            assert comp is not None
            queries = rotate(queries, self._query_shift, comp.rope)
            self._query_shift = 0
        returned = self._returned
        if keys is None or (
            returned is not None
            and keys is returned[0]
            and values is returned[1]
            and (mask is None or not additive(mask))
        ):  # over exactly what update_and_fetch returned (fetched_as_is, inlined: every step)
            hot = self._layer.hot
            out = None if hot is None else hot.attend(queries, scale, sinks)
            if out is None:
                out = self._layer.attend(queries, scale, sinks)
            elif keys is not None and self._as_returned is None:
                self._as_returned = True
        else:
            assert keys is not None and values is not None
            out = self._attend_own_rows(queries, keys, values, scale, mask, sinks)
        self._after_attend()
        return out

    def _attend_own_rows(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
    ) -> mx.array:
        """Attention over keys/values the model derived itself or with scores it adds
        (:meth:`attend`); from then on this cache's decode steps write before they attend. A
        decode step whose write waits for the returned arrays cannot be served: RuntimeError."""
        self._as_returned = False
        hot = self._layer.hot
        if hot is not None and hot.deferred is not None:
            raise RuntimeError(
                "the model attended over keys/values other than what update_and_fetch "
                "returned, at a decode step after steps that handed them back untouched "
                "(the step's token was not written yet): a model must attend the same "
                "way at every decode step"
            )
        scores = mask if additive(mask) else None
        return self._layer.attend_rows(
            queries, keys, values, scale=scale, scores=scores, sinks=sinks
        )

    def _after_attend(self) -> None:
        """Once a call is attended: drop its copies when no other layer reads them
        (``shared_rows``; the decode path holds none), and shift when the next token would
        reach the context (compact positions)."""
        if not self.shared_rows and self._layer.hot is None:
            self._returned = None
            self._layer.release()
        if self._compaction is not None:
            self._shift_after_call()

    def _attend_split(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
        keys: mx.array | None,
        values: mx.array | None,
    ) -> mx.array:
        """A call whose tokens reach the context at its ``first``-th: the tokens before it are
        laid out and attended, the kept rows shift (as after a call that ends at the context),
        then the rest, rotated by the shift, are laid out and attended. The state is what
        feeding the tokens in those two calls gives (with sequential prefill, what feeding them
        one by one gives), so it does not depend on where the calls begin and end, and trims
        stay exact (speculative decoding's verify chunks)."""
        assert self._split is not None
        (first, k, v), self._split = self._split, None
        if not fetched_as_is(self._returned, keys, values, mask):
            raise ValueError(
                f"{self.serves or 'this model'} attends over keys, values or scores of its own: "
                "positions='compact' cannot split its calls at the context; use "
                "positions='absolute'"
            )
        layer = self._layer
        layer.lay_out(k[:, :, :first], v[:, :, :first])
        before = layer.attend(queries[:, :, :first], scale, sinks)
        delta = self._shift(int(k.shape[2]) - first)
        comp = self._compaction
        assert comp is not None
        layer.lay_out(rotate(k[:, :, first:], delta, comp.rope), v[:, :, first:])
        after = layer.attend(rotate(queries[:, :, first:], delta, comp.rope), scale, sinks)
        self._returned = None
        self._shift_after_call()
        return mx.concatenate([before, after], axis=2)

    def keys_and_values(self) -> tuple[Any, Any]:
        """What the last call attended over (``retained + new``), for layers that share this
        layer's keys and values (mlx-lm's KV sharing: gemma3n, afm7); quantized rows as
        mlx-lm's quantized tuples."""
        keys, values = self._layer.keys_and_values()
        return for_mlx(keys), for_mlx(values)

    def finish_prefill(self) -> None:
        """End the prompt now (for callers that do not end it with a 1-token call), and drop
        what the last call returned to the model: after a prompt that is the whole prompt,
        which nothing reads again once its forward pass is over."""
        self._layer.end_prompt()
        self._returned = None

    @property
    def serves(self) -> str | None:
        return self._layer.serves

    def is_trimmable(self) -> bool:
        """True when the cache keeps an undo log: ``trim(n)`` then works for up to the last
        ``trim_window`` tokens (more raises ``ValueError``)."""
        return self._layer.keeps_log

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens exactly; raises ``ValueError`` and changes nothing if
        the undo log does not reach back ``n`` tokens. With compact positions a trim that
        reaches back past the last shift restores the state before it (kept for the undo
        window after a shift), then trims the rest."""
        comp = self._compaction
        if comp is not None and comp.shifts and isinstance(n, int) and n > 0:
            self._layer.settle()
            since = self._layer.offset - comp.shifted_at
            before = self._before_shift
            # back to the shift itself: the state there is the shifted one when the shift came
            # after a call (the next token would have reached the context), else the one before
            back = (
                n == since and before is not None and not before[2].needs_shift(comp.shifted_at, 1)
            )
            if n > since or back:
                return self._trim_past_shift(n, since)
        self._layer.trim(n)
        return n

    def _trim_past_shift(self, n: int, since: int) -> int:
        """A trim of ``n`` tokens reaching back past the last shift (``since`` tokens ago):
        the state before the shift, trimmed by the rest (exact: what the cache would hold had
        it never seen the trimmed tokens; the shift comes again when the context is reached)."""
        comp = self._compaction
        before = self._before_shift
        log = self._layer.log
        if before is None or log is None or log.tokens < since:
            raise ValueError(
                f"cannot trim {n} tokens: positions='compact' shifted the kept rows {since} "
                "tokens ago and the state before the shift is gone (beyond the undo window, or "
                "a loaded prompt cache); a trim cannot reach back past it"
            )
        state, old_log, old_comp, tier, tier_undo = before
        if old_log is None or old_log.tokens < n - since:
            raise ValueError(
                f"cannot trim {n} tokens: the undo log reaches back {since} tokens past the "
                f"shift at token {comp.shifted_at if comp else '?'} and "
                f"{0 if old_log is None else old_log.tokens} before it"
            )
        trimmed = copy.copy(self._layer)
        trimmed.restore(state, old_log)
        trimmed.tier, trimmed.tier_undo = tier, tier_undo  # the tier before the shift, if any
        trimmed.trim(n - since)  # raises, changing nothing here, when it cannot
        layer = self._layer
        layer.restore(trimmed.state, trimmed.log)
        layer.tier, layer.tier_undo = trimmed.tier, trimmed.tier_undo
        layer.shared_tier = trimmed.shared_tier
        self._compaction = old_comp
        self._before_shift = None
        return n

    @property
    def state(self) -> dict[str, Any]:
        """Arrays and one JSON string (``mx.eval``-ed after prefill chunks, saved by mlx-lm);
        with compact positions also ``positions`` (a JSON string) and the ``positions_anchor_*``
        arrays."""
        out = encode(self.policy_state, self._layer.log)
        layer = self._layer
        if layer.demote is not None:
            out.update(tier_state(layer.demote, layer.tier))
        comp = self._compaction
        if comp is not None:
            out["positions"] = json.dumps(comp.scalars(), sort_keys=True)
            for name, array in comp.arrays().items():
                out[f"positions_{name}"] = array
        return out

    @state.setter
    def state(self, v: dict[str, Any]) -> None:
        v = dict(v)
        demote, tier = load_tier(v)  # pops the tier's entries
        saved_positions = v.pop("positions", None)
        anchors = {name: v.pop(f"positions_{name}", None) for name in Compaction.ARRAYS}
        compaction = None
        if saved_positions is not None:
            compaction = Compaction.load(json.loads(saved_positions), anchors)
        elif self.__dict__.get("_compaction") is not None:
            comp = self.__dict__["_compaction"]  # absolute rows into a compact cache: unshifted
            compaction = Compaction(comp.context, comp.rope, comp.top, comp.n_sink)
        state, log = decode(self._policy, v)
        saved = quant_of_state(state)
        if "_layer" in self.__dict__ and self._layer.demote != demote:
            raise ValueError(
                f"the saved cache has demoted tier {demote}, this cache "
                f"{self._layer.demote}: load it under the config it was saved with"
            )
        if "_layer" in self.__dict__:
            if state.slots is not None and saved != self._layer.quant:
                raise ValueError(
                    f"the saved {self.policy_name} state holds rows {_quant_name(saved)}, but "
                    f"this cache holds them {_quant_name(self._layer.quant)}"
                )
            self._layer.restore(state, log)
        else:  # from_state (a loaded prompt cache) skips __init__
            self._layer = Layer(self._policy, state, log, quant=saved, demote=demote)
        self._layer.tier = tier
        self._compaction = compaction
        self._query_shift = 0
        self._before_shift = None
        self._split = None

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchVeloxKVCache:
        """One batched cache from single-sequence caches of one layer, as
        ``mlx_lm.generate.BatchGenerator`` asks; the caches are not changed (each row keeps
        its compact positions, if any)."""
        return merge(caches)

    @property
    def scoring(self) -> bool:
        """Whether the cache is in its policy's model-driven phase (``velox_mlx_lm.compress``
        drives it through :attr:`layer`)."""
        return self._layer.phase is not None


def _quant_name(quant: Quant | None) -> str:
    if quant is None:
        return "at full precision"
    keys = ", keys per channel" if quant.keys == "channel" else ""
    return f"quantized to {quant.bits} bits in groups of {quant.group_size}{keys}"


_CLASSES: dict[str, type[PolicyKVCache]] = {}


def cache_class(policy_name: str) -> type[PolicyKVCache]:
    """The mlx-lm cache class of a registered policy (made and registered on first use)."""
    if policy_name not in POLICIES:
        raise ValueError(f"no registered policy {policy_name!r}; registered: {sorted(POLICIES)}")
    if policy_name not in _CLASSES:
        name = "".join(part.capitalize() for part in policy_name.split("_")) + "KVCache"
        type(name, (PolicyKVCache,), {"policy_name": policy_name, "__module__": __name__})
    return _CLASSES[policy_name]


class TOVAKVCache(PolicyKVCache):
    """TOVA eviction as an mlx-lm layer cache (see ``velox_cache_core.tova_update``)."""

    policy_name = "tova"

    @property
    def tova_state(self) -> Any:
        """The core state after every pending eviction (arrays stay lazy)."""
        return self.policy_state


class H2OKVCache(PolicyKVCache):
    """H2O: evict the lowest accumulated attention (sinks and a recent window kept)."""

    policy_name = "h2o"


class StreamingLLMKVCache(PolicyKVCache):
    """StreamingLLM: sinks plus the most recent tokens."""

    policy_name = "streaming_llm"


class MorphKVCache(PolicyKVCache):
    """MorphKV: TOVA's weights fused over the last ``window`` queries."""

    policy_name = "morphkv"


class SnapKVCache(PolicyKVCache):
    """SnapKV: cut the prompt once at its end (the first single-token call, or
    ``finish_prefill()``), then grow."""

    policy_name = "snapkv"


class KVzipKVCache(PolicyKVCache):
    """KVzip: the context is kept whole until ``velox_mlx_lm.compress.compress`` scores it by a
    reconstruction pass (the policy's model-driven phase) and cuts it; ``probe="latest"``
    cuts at the prompt's end by its last query."""

    policy_name = "kvzip"


def _tier_bytes(undo: Any) -> int:
    """Bytes of the tier a ``TierUndo`` keeps for trims (0 without one)."""
    return 0 if undo is None or undo.tier is None else int(undo.tier.nbytes)
