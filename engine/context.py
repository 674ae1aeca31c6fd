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
class Context:
    slot_mapping: torch.Tensor  # [T]: where each token's KV goes
    num_decode_tokens: int  # the first tokens of the batch are single-token steps
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None


_LOCAL = threading.local()  # per thread, so engines in different threads do not mix steps


def set_context(context: Context | None) -> None:
    _LOCAL.context = context


def get_context() -> Context:
    context = getattr(_LOCAL, "context", None)
    assert context is not None, "attention called outside a model runner step"
    return context
