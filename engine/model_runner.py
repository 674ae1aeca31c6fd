"""Runs the model on a scheduled batch: owns the KV pool and turns sequences into positions,
``slot_mapping``, block tables and context lengths."""

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig

import kernels
from engine.config import EngineConfig
from engine.context import Context, DecodeGroup, StepInputs, set_context
from engine.cpu_decode import CpuDecode
from engine.cpu_linear import few_rows_path
from engine.cpu_malloc import keep_freed_memory, reserved_in_huge_pages
from engine.cuda_graph import DecodeGraphs
from engine.greedy_head import GreedyHead
from engine.kv_cache import bind_kv_cache, kv_cache_torch_dtype
from engine.loader import load_model, read_kv_scales
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.transfer import rows_on, tensor_on


class ModelRunner:
    def __init__(self, path: Path, hf_config: PretrainedConfig, *, max_model_len: int,
                 block_size: int, num_kv_blocks: int | Callable[[], int], dtype: torch.dtype,
                 device: torch.device, cuda_graph_max_batch: int = 0,
                 kv_cache_dtype: str = "auto", calculate_kv_scales: bool = True,
                 reserve_kv_cache: bool = False) -> None:
        """``num_kv_blocks``: a count, or a function that sizes the pool once the weights hold
        their memory. ``cuda_graph_max_batch`` > 0 on CUDA: decode steps up to that many
        sequences replay CUDA graphs (``engine.cuda_graph``). ``kv_cache_dtype``: the pool's,
        as ``EngineConfig``'s (checked before the weights load); ``engine.kv_cache`` tells how
        fp8 scales are set. ``reserve_kv_cache``: on the CPU, the pool is written whole now,
        in huge pages (``EngineConfig``'s)."""
        kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype, device)
        self.block_size = block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
        self.model = load_model(path, hf_config, max_model_len, dtype, device)
        self.num_kv_blocks = num_kv_blocks if isinstance(num_kv_blocks, int) else num_kv_blocks()
        attn = self.model.model.decoder_layers()[0].self_attn.attn
        num_layers = len(self.model.model.layers)
        # One pool for every layer's K and V, so that the whole cache is one allocation. Unless
        # reserved, left uninitialised: zeroing touched every page at start-up (4 GiB, 5.8 GB RSS
        # for the demo), and no kernel reads a slot before it is written (kernels.reference).
        shape = (2, num_layers, self.num_kv_blocks, block_size, attn.num_kv_heads,
                 attn.head_dim)
        self.kv_cache = (reserved_in_huge_pages(shape, kv_dtype)
                         if reserve_kv_cache and device.type == "cpu"
                         else torch.empty(shape, dtype=kv_dtype, device=device))
        # which CPU attention body runs (the start-up log says): numba's and the C one round
        # differently, so workers that resume each other's jobs should agree on it
        self.attention_body = (kernels.cpu_attention_body(attn.head_dim)
                               if device.type == "cpu" else None)
        self.linear_rows = few_rows_path(self.model)  # cpu_gemv or oneDNN, for the log
        self.kv_scales = bind_kv_cache(self.model, self.kv_cache,
                                       read_kv_scales(path, num_layers), calculate_kv_scales)
        # decode steps (up to CpuDecode.max_rows sequences) as one native call on the CPU,
        # where it binds
        self.cpu_decode = CpuDecode.bind(self.model, block_size) if device.type == "cpu" else None
        # greedy steps' tokens from a low-precision copy of the output layer and a bound, where it
        # binds (float32 panels on the CPU)
        self.greedy_head = GreedyHead.bind(self.model) if device.type == "cpu" else None
        self.graphs = None
        if cuda_graph_max_batch > 0 and device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, cuda_graph_max_batch,
                                       -(-max_model_len // block_size),
                                       self.model.model.embed_tokens.embedding_dim, dtype, device)
        self.warm_up()

    def warm_up(self) -> None:
        """One prefill and one decode step of a dummy sequence in the first blocks, before any
        request exists: a process's first step imports and loads the CPU kernels (numba),
        0.74-0.94 s on the 4-layer ``mid`` model against 0.02 s for the next, which a worker's
        first job (and every job of a burst read with it) would otherwise wait for, as vLLM
        warms up before it serves. Its blocks belong to no one yet (the pool is uninitialised
        anyway); the fp8 scales stay for the first real prefill to set."""
        blocks = -(-3 // self.block_size)  # three positions: two prompt tokens, one decoded
        if self.num_kv_blocks < blocks:
            return
        attns = [layer.self_attn.attn for layer in self.model.model.decoder_layers()]
        calculate = [attn.calculate_kv_scales for attn in attns]
        for attn in attns:
            attn.calculate_kv_scales = False
        try:
            seq = Sequence("warm-up", [0, 0], SamplingParams(max_tokens=1))
            seq.block_table = list(range(blocks))
            for num_new in (2, 1):  # the prompt, then one token more
                batch = SchedulerOutput()
                batch.add(seq, num_new)
                self.run(batch)
                seq.num_computed_tokens = len(seq)
                seq.token_ids.append(0)
        finally:
            for attn, flag in zip(attns, calculate, strict=True):
                attn.calculate_kv_scales = flag

    @staticmethod
    def block_bytes(hf_config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads)
        per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
        return per_token * block_size * dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_cache[:, :, 0, 0].nbytes

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return tensor_on(data, dtype, self.device)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def _decode_groups(self, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Splits the decode rows (longest first) where the block count drops below 60% of the
        group's first: the torch reference pads every row to its group's longest, so this bounds
        the wasted gather and attention work. The other backends take ragged rows as they are."""
        if not tables:
            return []
        if kernels.default_backend(self.device) != "torch":
            return [(0, len(tables))]
        starts = [0]
        for i, table in enumerate(tables):
            if len(table) < 0.6 * len(tables[starts[-1]]):
                starts.append(i)
        return list(zip(starts, starts[1:] + [len(tables)], strict=True))

    def _gather(self, batch: SchedulerOutput) -> tuple[StepInputs, list[Sequence]]:
        """The step's inputs as host lists, and the sequences that sample this step."""
        # Single-token steps first, longest context first: they take the batched decode path.
        order = sorted(range(len(batch.seqs)), key=lambda j: (
            batch.num_new_tokens[j] != 1, -batch.seqs[j].num_computed_tokens))
        step = StepInputs()
        sample_seqs: list[Sequence] = []
        bs = self.block_size
        for j in order:
            seq, num_new = batch.seqs[j], batch.num_new_tokens[j]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if num_new == 1:  # a decode row: no slices
                if seq.pending_row is not None:
                    step.deferred.append((len(step.input_ids), seq.pending_row))
                step.input_ids.append(seq.token_ids[start])
                step.positions.append(start)
                step.slot_mapping.append(seq.block_table[start // bs] * bs + start % bs)
                step.num_decode += 1
            else:
                step.input_ids += seq.token_ids[start:end]
                step.positions += range(start, end)
                step.slot_mapping += [seq.block_table[p // bs] * bs + p % bs
                                      for p in range(start, end)]
                step.cu_seqlens.append(step.cu_seqlens[-1] + num_new)
            step.block_tables.append(seq.block_table)
            step.context_lens.append(end)
            if end == len(seq):  # the chunk reaches the end: this step samples its next token
                step.logit_rows.append(len(step.input_ids) - 1)
                sample_seqs.append(seq)
        return step, sample_seqs

    def _context(self, step: StepInputs) -> Context:
        tables, lens, num_decode = step.block_tables, step.context_lens, step.num_decode
        ctx = Context(slot_mapping=self._tensor(step.slot_mapping, torch.int64),
                      num_decode_tokens=num_decode)
        ctx.decode_groups = [DecodeGroup(start, end, self._block_tables(tables[start:end]),
                                         self._tensor(lens[start:end], torch.int32))
                             for start, end in self._decode_groups(tables[:num_decode])]
        if not step.decode_only:
            ctx.prefill_block_tables = self._block_tables(tables[num_decode:])
            ctx.prefill_context_lens = self._tensor(lens[num_decode:], torch.int32)
            ctx.prefill_cu_seqlens_q = self._tensor(step.cu_seqlens, torch.int32)
            cu = step.cu_seqlens
            chunks = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
            # each chunk its whole context (no prefix), decided once for every layer
            if chunks == lens[num_decode:] and kernels.fresh_prefill_pays(
                    self.model.model.embed_tokens.weight.dtype, self.kv_cache, chunks):
                ctx.prefill_fresh_lens = chunks
        return ctx

    def _forward(self, step: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The hidden states of the tokens that sample (``step.logit_rows``, in order): a CUDA
        graph's replay for the decode steps that fit one (it stages the host lists itself),
        the CPU's native decode, or the model eagerly. ``step.deferred`` rows take their token
        from ``prev_tokens``."""
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step, prev_tokens)  # decode rows: every one samples
        input_ids = self._tensor(step.input_ids, torch.int64)
        if step.deferred:
            assert prev_tokens is not None
            rows, src = zip(*step.deferred, strict=True)
            input_ids[rows_on(list(rows), self.device)] = prev_tokens[rows_on(list(src),
                                                                               self.device)]
        positions = self._tensor(step.positions, torch.int64)
        ctx = self._context(step)
        if self.cpu_decode is not None and self.cpu_decode.can_run(ctx, input_ids.shape[0]):
            return self.cpu_decode.run(input_ids, positions, ctx)  # decode rows, as above
        # where no row samples (chunks short of their prompts' ends), the last stands in: the
        # layers' products take no empty batch, and ``run`` drops it
        output_rows = (None if len(step.logit_rows) == len(step.input_ids) else self._tensor(
            step.logit_rows or [len(step.input_ids) - 1], torch.int64))
        set_context(ctx)
        try:
            return self.model(input_ids, positions, output_rows)
        finally:
            set_context(None)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput, prev_tokens: torch.Tensor | None = None
            ) -> tuple[list[Sequence], torch.Tensor]:
        """Computes the batch's KV and returns the sequences that sample this step with their
        final hidden states ``[len(seqs), hidden]``, for ``logits`` or ``greedy_tokens``.
        ``prev_tokens``: the previous step's sampled tokens, still on the device, where
        sequences' last tokens are pending (``Sequence.pending_row``)."""
        if batch.copies:
            kernels.copy_blocks(list(self.kv_cache.flatten(0, 1)),  # every layer's K and V
                                self._tensor(batch.copies, torch.int64))
        step, sample_seqs = self._gather(batch)
        hidden = self._forward(step, prev_tokens)
        return sample_seqs, hidden if sample_seqs else hidden[:0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits ``[rows, vocab]`` of ``run``'s hidden states (none: ``[0, 0]``)."""
        if not hidden.shape[0]:  # the products take no empty batch
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``kernels.argmax(self.logits(hidden))``, computed without them where the greedy head
        binds (``engine.greedy_head``); else None."""
        return None if self.greedy_head is None else self.greedy_head.tokens(hidden)


def fit_kv_blocks(config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                  device: torch.device, max_model_len: int) -> int:
    """The pool's size in blocks (of ``config.kv_cache_dtype``: bytes are what is counted),
    called once the weights are loaded. On CUDA, as vLLM: the engine may take
    ``gpu_memory_utilization`` of the card's total memory; the pool gets what of that the
    weights (and whatever else holds memory now) leave."""
    block_bytes = ModelRunner.block_bytes(hf_config, config.block_size, kv_cache_torch_dtype(
        config.kv_cache_dtype, dtype, device))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free)
        if budget < block_bytes:
            raise ValueError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB "
                             f"free of {total / 2**30:.1f}; raise gpu_memory_utilization "
                             f"({config.gpu_memory_utilization}) or set num_kv_blocks")
    else:
        budget = config.kv_cache_memory_gib * 2**30
    # No use in more than every sequence slot filled to the context length.
    most = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(int(budget // block_bytes), most))
