"""``velox_mlx_lm.serve.release``: what MLX frees goes back to the operating system
(docs/serving.md, "Process memory"). The allocator's settings are process-wide, so each case
runs in its own interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from velox_mlx_lm.serve import release as serve_release

MIB = 1 << 20

# The server's pattern in small: prefill-sized buffers (3 MiB) allocated between long-lived
# small arrays (64 KiB, like prompt-cache entries), then freed. An 8 MiB buffer freed first
# raises glibc's dynamic mmap threshold, as loading a model does, so the 3 MiB buffers come
# from the heap. Measured here with neither step: 82 MB before, 211 MB at the peak, still
# 211 MB once freed and MLX's cache emptied.
SCENARIO = """
import sys
import mlx.core as mx
from velox_mlx_lm.serve import release as serve_release

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

if sys.argv[1] == "configure":
    assert serve_release.configure_allocator()
warm = mx.ones((2 << 20,))
mx.eval(warm)
del warm
mx.clear_cache()
before = rss()
kept, transient = [], []
for _ in range(40):
    a, b = mx.ones((3 << 18,)), mx.ones((1 << 14,))
    mx.eval(a, b)
    transient.append(a)
    kept.append(b)
peak = rss()
del transient
mx.clear_cache()
freed = rss()
if sys.argv[1] == "release":
    serve_release.Releaser().release(force=True)
print(before, peak, freed, rss())
"""

glibc_only = pytest.mark.skipif(
    serve_release.glibc() is None, reason="the heap steps need glibc (Linux)"
)


def _run(mode: str) -> tuple[int, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    before, peak, freed, after = (int(x) for x in out.stdout.split())
    assert peak - before >= 100 * MIB  # the 120 MiB of buffers were resident
    return before, peak, freed, after


@glibc_only
def test_fixed_mmap_threshold_unmaps_freed_buffers_at_once() -> None:
    before, _, freed, _ = _run("configure")
    assert freed - before <= 16 * MIB


@glibc_only
def test_release_trims_what_the_heap_kept() -> None:
    before, _, _, after = _run("release")
    assert after - before <= 16 * MIB


def test_release_at_most_once_per_interval_unless_forced() -> None:
    releaser = serve_release.Releaser(interval_s=3600.0)
    assert releaser.release()
    assert not releaser.release()  # within the interval: nothing done
    assert releaser.release(force=True)
    assert releaser.releases == 2
