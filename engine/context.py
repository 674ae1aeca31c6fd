"""The attention context of the step being run: the model code reads it instead of taking
block tables as arguments, as nano-vllm does."""

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeGroup:
    """Rows ``start:end`` of the batch: single-token steps sharing one padded block table."""

    start: int
    end: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class StepInputs:
    """A step's inputs on the host, rows in the model's order: single-token (decode) rows first,
    longest context first, then prefill chunks. The model runner turns them into device tensors
    (``Context``); CUDA graphs stage them in pinned memory instead (``engine.cuda_graph``)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # one per row (sequence)
    context_lens: list[int] = field(default_factory=list)
    cu_seqlens: list[int] = field(default_factory=lambda: [0])  # the prefill chunks'
    num_decode: int = 0
    logit_rows: list[int] = field(default_factory=list)  # the tokens whose logits are sampled
    # (row, row of the previous step's sampled tokens): decode rows whose input token is still
    # on the device (async scheduling: engine.async_step)
    deferred: list[tuple[int, int]] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.input_ids)


@dataclass
class Context:
    slot_mapping: torch.Tensor  # [T]: where each token's KV goes
    num_decode_tokens: int  # the first tokens of the batch are single-token steps
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    # the prefill chunks' lengths where every one is a whole prompt with nothing cached and
    # they go through kernels.prefill_attention_fresh (kernels.fresh_prefill_pays)
    prefill_fresh_lens: list[int] | None = None


_LOCAL = threading.local()  # per thread, so engines in different threads do not mix steps


def set_context(context: Context | None) -> None:
    _LOCAL.context = context


def get_context() -> Context:
    context = getattr(_LOCAL, "context", None)
    assert context is not None, "attention called outside a model runner step"
    return context
