"""CUDA graphs for the decode step, as vLLM and nano-vllm capture them.

One graph per padded batch size (1, 2, 4, 8, then every 16 up to ``max_num_seqs``), captured at
start-up over static input buffers, largest first, all sharing one memory pool. A step whose
tokens are all single-token decodes of at most the largest size copies its inputs into the
buffers and replays the smallest graph that holds it; padding rows write no KV (slot -1) and
attend to one token, so they stay finite and touch no sequence. Prefill and mixed steps run
eagerly. The block-table buffer is as wide as the longest sequence (``max_model_len``), so the
decode kernel's split count is fixed per graph.

The step's inputs reach the static buffers in three host-to-device copies from pinned staging
(token ids, positions and slots in one int64 buffer; context lengths; block tables), enqueued
before the replay without waiting for it. Before, each input became a device tensor of its own
(a pageable transfer, which waits) and was then copied into its buffer: 13 transfers and
launches. On an H200 at batch 1 the graph's kernels took 1.0 ms of a 1.59 ms step, the host
work before the replay most of the rest; with the staging (and one-tile attention splits) the
step took 1.35 ms.
"""

from bisect import bisect_left

import torch
from torch import nn

from engine.context import Context, DecodeGroup, StepInputs, set_context


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes to capture: 1, 2, 4, 8, every 16 below ``max_batch``, and
    ``max_batch`` itself."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_batch}
                  | set(range(16, max_batch, 16)) | {max_batch})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows; None above the largest."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.sizes = graph_batch_sizes(max_batch)
        n = self.sizes[-1]
        # int64 [4, n]: token ids, positions, slots, the deferred rows' sources (-1: none);
        # int32: context lengths, then block tables
        self.longs = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.ints = torch.zeros(n * (1 + max_blocks_per_seq), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.sources = self.longs
        self.context_lens = self.ints[:n]
        self.block_tables = self.ints[n:].view(n, max_blocks_per_seq)
        self.slot_mapping.fill_(-1)  # the captures' warm-up forwards write no KV
        self.context_lens.fill_(1)
        self.staged_longs = torch.zeros_like(self.longs, device="cpu").pin_memory()
        staged_ints = torch.zeros_like(self.ints, device="cpu").pin_memory()
        self.staged_lens = staged_ints[:n]
        self.staged_tables = staged_ints[n:].view(n, max_blocks_per_seq)
        self.copied = torch.cuda.Event()  # the last staging's copies: none may be overwritten
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _context(self, batch: int) -> Context:
        ctx = Context(slot_mapping=self.slot_mapping[:batch], num_decode_tokens=batch)
        ctx.decode_groups = [DecodeGroup(0, batch, self.block_tables[:batch],
                                         self.context_lens[:batch])]
        return ctx

    def _forward(self, batch: int) -> None:
        self.hidden[:batch] = self.model(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for batch in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            set_context(self._context(batch))
            try:
                self._forward(batch)  # warm-up: Triton compiles outside the capture
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(batch)
            finally:
                set_context(None)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def can_run(self, step: StepInputs) -> bool:
        return step.decode_only and len(step.input_ids) <= self.sizes[-1]

    def run(self, step: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states ``[n, H]`` of a decode-only step (``can_run``) of ``n`` rows, a view
        of the graphs' output buffer that the next replay overwrites. ``step.deferred`` rows
        take their token from ``prev_tokens`` on the device, outside the graph."""
        n = len(step.input_ids)
        batch = padded_size(n, self.sizes)
        assert batch is not None and self.can_run(step)
        self.copied.synchronize()  # the previous step's copies have left the staging
        longs, lens = self.staged_longs.numpy(), self.staged_lens.numpy()
        longs[0, :n], longs[1, :n], longs[2, :n] = step.input_ids, step.positions, step.slot_mapping
        # padding rows read token 0 (the rows hold an earlier step's ids, placeholders among
        # them under async scheduling), write no KV and attend to slot 0 of their row
        longs[0, n:batch], longs[2, n:batch] = 0, -1
        lens[:n], lens[n:batch] = step.context_lens, 1
        for row, table in zip(self.staged_tables.numpy(), step.block_tables, strict=False):
            row[:len(table)] = table
        if step.deferred:
            longs[3, :batch] = -1
            for row, src in step.deferred:
                longs[3, row] = src
        self.longs.copy_(self.staged_longs, non_blocking=True)  # whole: a strided slice is not
        self.context_lens[:batch].copy_(self.staged_lens[:batch], non_blocking=True)
        self.block_tables[:batch].copy_(self.staged_tables[:batch], non_blocking=True)
        self.copied.record()
        if step.deferred:
            assert prev_tokens is not None
            src = self.sources[:batch]
            self.input_ids[:batch] = torch.where(src >= 0, prev_tokens[src.clamp(min=0)],
                                                 self.input_ids[:batch])
        self.graphs[batch].replay()
        return self.hidden[:n]
