"""A Llama-family decode step for a batch of sequences as one C call (``cpu_decode.c``,
built by ``kernels.cpu_native``): the layers' weights and KV pools bound once, each step's
tokens, positions, slots and block tables passed in.

The C step runs the same functions the model's modules call one by one (``cpu_rows.c``,
``cpu_gemv.c``, ``cpu_attention.c``), so its rows have their bits; what it saves is the Python
between them. ``engine.cpu_decode`` decides when it may run and binds the model to it.
"""

import torch

from kernels import cpu_native

# cpu_decode.c's enums: the model's dimensions, then each layer's tensors, in these orders
DIMS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size",
        "qkv_block", "o_block", "gate_up_block", "down_block")
TENSORS = ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down",
           "k_cache", "v_cache")
OPTIONAL = {"qkv_bias"}
STORED = {"qkv", "o_proj", "gate_up", "down", "k_cache", "v_cache"}  # float32 or bfloat16


def available() -> bool:
    return cpu_native.function("pagedq_decode") is not None


class DecodeStep:
    """The bound step. ``dims`` by the names of ``DIMS``; ``layers`` one dict per layer by the
    names of ``TENSORS``: the norms' weights, the products' ``cpu_gemv`` panels, the layer's K
    and V pools ``[blocks, block_size, kv_heads, head_dim]``, contiguous, held here for as
    long as the step lives; the panels and pools (``STORED``) all float32 or all bfloat16
    (``cpu_bf16.c``'s build), the rest float32. ``cos`` and ``sin``: the rotary tables
    ``[positions, head_dim]``. ``split_rows``: from this many rows a thread on (0: never)
    each thread runs the whole step on its own share of the rows (``cpu_decode.c`` says when
    that pays), and a thread done with its share takes parts of the others' kernels."""

    def __init__(self, dims: dict[str, int], layers: list[dict[str, torch.Tensor | None]],
                 final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 scale: float, split_rows: int = 0) -> None:
        qkv = layers[0].get("qkv") if layers else None
        stored = torch.float32 if qkv is None else qkv.dtype
        function = cpu_native.typed("pagedq_decode", stored)
        if function is None:
            raise ValueError(f"no C decode step for {stored} weights on this machine")
        self._function = function
        if len(layers) != dims["layers"]:
            raise ValueError(f"{len(layers)} layers given for dims['layers']={dims['layers']}")
        tensors = [(final_norm, torch.float32), (cos, torch.float32), (sin, torch.float32)]
        pointers = []
        for i, layer in enumerate(layers):
            for name in TENSORS:
                tensor = layer.get(name)
                if tensor is None and name not in OPTIONAL:
                    raise ValueError(f"layer {i} lacks {name}")
                tensors += [] if tensor is None else [
                    (tensor, stored if name in STORED else torch.float32)]
                pointers.append(0 if tensor is None else tensor.data_ptr())
        for tensor, dtype in tensors:
            if tensor.dtype != dtype or tensor.device.type != "cpu" or (
                    not tensor.is_contiguous()):
                raise ValueError(f"the decode step takes contiguous {dtype} CPU tensors here, "
                                 f"got {tensor.dtype} on {tensor.device} {tuple(tensor.shape)}")
        self._tensors = [tensor for tensor, _ in tensors]  # the pointers stay valid while held
        self._dims = torch.tensor([dims[name] for name in DIMS], dtype=torch.int64)
        self._layers = torch.tensor(pointers, dtype=torch.int64)
        self._final_norm, self._cos, self._sin = final_norm, cos, sin
        self._eps, self._scale = eps, scale
        self.split_rows = split_rows
        self.last_shares = 0  # the last call's: 1, or its threads where the rows were split
        self.last_helped = 0  # the last call's kernels that a finished share's thread could help
        self._helped = torch.zeros(1, dtype=torch.int64)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, hidden]: the tokens' embeddings (overwritten); returns it holding the
        final norm's output. ``positions`` and ``slots`` int64 [rows], ``block_tables`` int32
        [rows, width], ``context_lens`` int32 [rows] (this token included)."""
        rows = x.shape[0]
        if rows == 0 or not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError("the decode step takes contiguous float32 rows, "
                             f"got {x.dtype} {tuple(x.shape)}")
        # held in names until the call returns: the C step reads their memory
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        shares = self._function(
            self._dims.data_ptr(), self._layers.data_ptr(), self._final_norm.data_ptr(),
            self._cos.data_ptr(), self._sin.data_ptr(), self._eps, self._scale, x.data_ptr(),
            rows, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), torch.get_num_threads(), self.split_rows, self._helped.data_ptr())
        if shares < 0:
            raise MemoryError("the decode step could not allocate its scratch memory")
        self.last_shares, self.last_helped = shares, int(self._helped)
        return x
