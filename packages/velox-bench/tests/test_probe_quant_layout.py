"""velox_bench.probes.quant_layout_probe without the model: its emulated layouts against
numpy."""

from __future__ import annotations

import numpy as np
import pytest

from velox_bench.probes import quant_layout_probe as tool

mx = pytest.importorskip("mlx.core")


def test_hadamard_rotation_is_orthogonal_and_its_own_inverse() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 128)).astype(np.float32)
    y = np.array(tool.rotate(mx.array(x)))
    np.testing.assert_allclose(np.array(tool.rotate(mx.array(y))), x, atol=1e-5)
    # dot products of rows (what attention reads) are kept
    np.testing.assert_allclose(y @ y.swapaxes(-1, -2), x @ x.swapaxes(-1, -2), atol=1e-3)
    h = np.array(tool.hadamard(4)) * 2
    assert np.array_equal(h, [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])


def test_per_channel_groups_run_along_tokens() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 128, 64)).astype(np.float32)
    x[..., 7] *= 50  # an outlier channel: per-channel groups keep the others' precision
    got = np.array(tool.per_channel(mx.array(x), 4))
    for c in (0, 7):
        for g in range(2):  # each channel's group of 64 tokens: 16 levels between its min and max
            col = x[0, 0, 64 * g : 64 * (g + 1), c]
            step = (col.max() - col.min()) / 15
            err = np.abs(got[0, 0, 64 * g : 64 * (g + 1), c] - col)
            assert err.max() <= step  # within one of its own 16 levels
    per_token_err = np.abs(np.array(tool.per_token(mx.array(x), 4)) - x)[..., :7].mean()
    assert np.abs(got - x)[..., :7].mean() < per_token_err
    with pytest.raises(ValueError, match="whole groups of 64 tokens"):
        tool.per_channel(mx.array(x[:, :, :100]), 4)


def test_configs_and_the_store_is_restored() -> None:
    assert tool.config("float", 4, 512).kv_bits is None
    assert tool.config("per-token", 4, 512).kv_bits == 4
    assert tool.config("per-channel-keys", 4, 512).kv_bits == 8  # emulated, stored at 8 bits
    stored = tool.layer_module.Layer.stored
    with pytest.raises(Exception):  # noqa: B017 (no model: the call fails inside)
        tool.score(None, [1, 2, 3], "keys-only", 4, 64)
    assert tool.layer_module.Layer.stored is stored


def test_static_channel_maps_are_undone_exactly() -> None:
    """Without quantization error (identity quantizer), every smoothing map is undone: the
    keys come back, after RoPE removed and put back at each row's position too."""
    rng = np.random.default_rng(2)
    x = mx.array((rng.standard_normal((1, 2, 64, 64)) * rng.uniform(0.1, 9, 64)).astype(np.float32))
    rope = {"dims": 64, "traditional": True, "base": 1e4, "scale": 1.0}

    class Layer:
        pass

    quantizers = (tool.per_token, tool.per_token_hadamard)
    tool.per_token = tool.per_token_hadamard = tool.identity  # type: ignore[assignment]
    try:
        for name, smoothing in tool.SMOOTHED.items():
            layer = Layer()
            for start in (0, 32):  # the second call reuses the first call's statistics
                got = smoothing.keys(layer, x[:, :, start : start + 32], 4, rope)
                rotated = smoothing.rotate
                want = x[:, :, start : start + 32]
                tol = 1e-3 if rotated or smoothing.prerope else 1e-5
                np.testing.assert_allclose(np.array(got), np.array(want), atol=tol, err_msg=name)
            assert layer._probe_seen == 64
    finally:
        tool.per_token, tool.per_token_hadamard = quantizers
