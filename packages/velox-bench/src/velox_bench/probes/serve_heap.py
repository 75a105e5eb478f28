"""Where ``velox-serve``'s RSS goes over a soak: glibc's heap sampled inside the server.

    python -m velox_bench.probes.serve_heap [--target 9000] [--out heap.jsonl] [--no-release]

Starts ``velox-serve --method tova --budget 512 --beyond-context --max-tokens 32`` through a
wrapper that samples, every second, the RSS, MLX's active and cached bytes and glibc's
``mallinfo2`` (bytes in use in the heap, free bytes kept in it, bytes of chunks mapped on
their own) into ``--out`` (JSON lines), and drives the soak load of ``velox_bench.serve_soak``
against it (4 conversations, 1,500-token turns, up to ``--target`` tokens). ``--no-release``
starts the server as it was before issue 33's fix: no fixed mmap threshold and no trim
(``velox_mlx_lm.serve.release``). Prints the soak's summary and, per 100 s, the most RSS, the
most free heap bytes and the most MLX active bytes. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from velox_bench.serve_run import ServerProcess
from velox_bench.serve_soak import SoakSpec, run_soak, summarize_soak, table

# The server, with a sampler thread; sys.argv[1] is the output file, sys.argv[2] "1" to keep
# serve_release from acting.
WRAPPER = """
import ctypes, json, sys, threading, time
import mlx.core as mx
import velox_mlx_lm.serve as serve
from velox_mlx_lm.serve import release as serve_release

out, no_release = sys.argv.pop(1), sys.argv.pop(1) == "1"
if no_release:
    serve_release.configure_allocator = lambda threshold=0: False
    serve_release.Releaser.release = lambda self, force=False: False
fields = ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost"]
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def sample():
    t0 = time.monotonic()
    with open(out, "w") as f:
        while True:
            info = libc.mallinfo2()
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * 4096
            row = {"t_s": time.monotonic() - t0, "rss_bytes": rss,
                   "mlx_active_bytes": mx.get_active_memory(),
                   "mlx_cache_bytes": mx.get_cache_memory(),
                   "heap_bytes": info.arena, "heap_in_use_bytes": info.uordblks,
                   "heap_free_bytes": info.fordblks, "mapped_bytes": info.hblkhd}
            f.write(json.dumps(row) + "\\n")
            f.flush()
            time.sleep(1.0)

threading.Thread(target=sample, daemon=True).start()
sys.exit(serve.main(sys.argv[1:]))
"""
FLAGS = ["--method", "tova", "--budget", "512", "--beyond-context", "--max-tokens", "32"]


def per_window(rows: list[dict[str, Any]], width_s: float = 100.0) -> list[dict[str, int]]:
    """The most RSS, free heap bytes and MLX active bytes per ``width_s`` seconds."""
    windows: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        windows.setdefault(int(row["t_s"] // width_s), []).append(row)
    keys = ("rss_bytes", "heap_free_bytes", "mlx_active_bytes")
    return [{k: max(r[k] for r in w) for k in keys} for _, w in sorted(windows.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=int, default=9000, help="tokens per conversation")
    parser.add_argument("--out", default="heap.jsonl", help="the samples (JSON lines)")
    parser.add_argument("--no-release", action="store_true", help="as before issue 33's fix")
    args = parser.parse_args()
    spec = SoakSpec(target_tokens=args.target)
    entry = ["-c", WRAPPER, args.out, "1" if args.no_release else "0"]
    import velox_bench.serve_soak as soak

    soak.soak_server = lambda flags, lowered_context=None: ServerProcess(flags, entry=entry)
    summary = summarize_soak(run_soak(FLAGS, spec, stay_in_context=False), spec)
    print(table({"tova(512)": summary}))
    print(json.dumps(summary["rss"], indent=1))
    with open(args.out) as f:
        rows = [json.loads(line) for line in f]
    print("per 100 s: most RSS / free heap / MLX active, MB")
    for i, w in enumerate(per_window(rows)):
        values = " / ".join(f"{w[k] / 1e6:.0f}" for k in w)
        print(f"{100 * i:>5} s  {values}")


if __name__ == "__main__":
    main()
