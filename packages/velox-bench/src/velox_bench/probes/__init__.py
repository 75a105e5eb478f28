"""Measurement probes: one question each, answered by a command that prints (or writes) numbers.

Each module runs as ``python -m velox_bench.probes.NAME [flags]`` (``--help`` lists its flags);
the ones that time MLX load OpenBLAS first (``velox_blas``), before anything imports mlx. This
package imports nothing at import time. The docs quote their output (docs/benchmarks.md,
docs/quantized.md, docs/architecture.md); unlike the pytest-benchmark suites they write no
results file unless asked (``--json``).

Decode steps, one layer at a real model's attention shape:

- ``decode_step_compare``: every method's update + attention against ``RotatingKVCache`` + SDPA;
- ``adaptive_decode_step``: the step after an adaptive (per-head lanes) cut against the uniform;
- ``attend_once_core``: the arithmetic of a TOVA step alone, next to one SDPA call;
- ``profile_decode``: the stages of one ``tova_update`` (logits, softmax/mean, selection);
- ``score_op_costs``: each op of a windowed (MorphKV) step's scoring, one at a time;
- ``layer_host_compare``: host time (Python and graph building) of one layer's cache calls;
- ``graph_nodes``: the graph nodes one layer's call adds, and what one node costs here;
- ``shift_cost``: one compact-positions shift of the main rows and of a demoted tier;
- ``tier_step_split``: a decode step with a demoted tier split into its parts.

The embedded model:

- ``single_sequence_step``: one sequence's decode step, a Velox cache beside the full cache;
- ``decode_trace``: the Python calls one decode step makes into the project, and the modules
  one layer's share of them enters and returns to (``sys.setprofile``, issue 47);
- ``batch_decode_step``: a batch's decode step, batched Velox caches beside mlx-lm's;
- ``prefill_compare``: prefill time, the full cache against TOVA(512);
- ``verify_chunk_compare``: a speculative verify round (chunk of 4, trim of 3);
- ``speculative_compare``: speculative decoding against the full cache on a self-draft;
- ``speculative_round_split``: a speculative round split into draft, verify and trims;
- ``kept_positions``: which prompt positions each policy keeps;
- ``stream_ppl_compare``: perplexity of tokens streamed after a prompt, per method and budget;
- ``quant_layout_probe``: which quantized row layout keeps TOVA's perplexity;
- ``quantized_memory``: bytes held and peak memory of quantized rows over a long prefill;
- ``serve_heap``: where ``velox-serve``'s RSS goes over a soak (glibc's heap, sampled inside).

Memory, a small model's caches (MLX active memory against what the caches report):

- ``tier_memory``: one layer with a demoted tier after steady decode steps;
- ``undo_memory``: every method's caches, undo log on, after steady decode steps.

The machine:

- ``matmul_dtypes``: one MLP-sized matmul per dtype on this machine's MLX backend.

``timing.alternating_medians`` times named pieces of work in alternating rounds (medians).
"""
