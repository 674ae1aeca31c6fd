"""CUDA graphs for the decode step, as vLLM and nano-vllm capture them.

One graph per padded batch size (1, 2, 4, 8, then every 16 up to ``max_num_seqs``), captured at
start-up over static input buffers, largest first, all sharing one memory pool. A step whose
tokens are all single-token decodes of at most the largest size copies its inputs into the
buffers and replays the smallest graph that holds it; padding rows write no KV (slot -1) and
attend to one token, so they stay finite and touch no sequence. Prefill and mixed steps run
eagerly. The block-table buffer is as wide as the longest sequence (``max_model_len``), so the
decode kernel's split count is fixed per graph.
"""

from bisect import bisect_left

import torch
from torch import nn

from engine.context import Context, DecodeGroup, set_context


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
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
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

    def can_run(self, ctx: Context, num_tokens: int) -> bool:
        return (ctx.num_decode_tokens == num_tokens and len(ctx.decode_groups) == 1
                and num_tokens <= self.sizes[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: Context) -> torch.Tensor:
        """The hidden states ``[len(input_ids), H]`` of a decode-only step (``can_run``), a view
        of the graphs' output buffer that the next replay overwrites."""
        n = input_ids.shape[0]
        batch = padded_size(n, self.sizes)
        assert batch is not None and self.can_run(ctx, n)
        group = ctx.decode_groups[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.slot_mapping[n:batch].fill_(-1)
        self.block_tables[:n, :group.block_tables.shape[1]].copy_(group.block_tables)
        self.context_lens[:n].copy_(group.context_lens)
        self.context_lens[n:batch].fill_(1)  # padding rows attend to slot 0 of their row's table
        self.graphs[batch].replay()
        return self.hidden[:n]
