"""The CPU's counterpart of ``engine.cuda_graph``: decode steps of up to ``max_rows``
sequences run as one native call (``kernels.cpu_decode``) in place of the model's modules.

Why: at one stream a SmolLM2 step took 21 ms, of which the linear layers, at the memory's
rate, were 12.6; the rest was the small ops and the Python around some 330 module and kernel
calls a step, each slow on caches the weights had just flushed. The native step runs the same
C functions those calls reach, so a row's bits do not depend on which path ran it (the tests
check each row against the modules' batch), and the modules keep every other step.

It binds where every piece has its C form: a Llama-family model with float32 activations on
the ``"cpu"`` kernel backend with the C attention body, every linear layer packed for
``cpu_gemv``, and a KV pool of its panels' type (float32, or bfloat16 for both). Elsewhere
(fp8 caches, quantized weights, numba-only machines, ``PAGEDQ_NATIVE_KERNELS=0``) ``bind``
returns None and the modules run every step.
"""

import torch

import kernels
from engine.context import Context
from engine.cpu_linear import GEMV_ROWS, PackedLinear
from engine.models import LlamaForCausalLM
from kernels import cpu_decode, cpu_native

# decode steps of at least this many rows a thread run with each thread on its own share of the
# rows, on AMD's cores (kernels/cpu_decode.c: a Zen 4, 2 threads, SmolLM2 float32 at 32 rows 49.8 ->
# 47.2 ms a step, at 16 rows 24.3 -> 27.6; bfloat16 weights and pool at 32 rows 33.9 -> 33.5,
# 64 rows 75.3 -> 67.9; a Zen 5, the native step alternating with the split off step by step
# over throughput.py's workloads: unsplit took 1.13-1.16x the time at 33-128 rows on
# random-26m, 1.03-1.04x on SmolLM2); 0 elsewhere: a Xeon lost at 32 rows, drew level at 64.
SPLIT_ROWS = 16 if cpu_native.VENDOR == "AuthenticAMD" else 0
# float32 decode steps of up to this many rows run natively where SPLIT_ROWS is set (AMD's
# cores), past AVX2's GEMV_ROWS (64): on 2 threads or more such steps split, and each thread's
# products are then cpu_gemv's over its own share of the rows, not the many-row product split
# by panels that falls behind oneDNN's past 64 rows (on one thread they run unsplit: not
# measured against the modules there). An AMD EPYC Zen 3 (AVX2), random-26m's 128 requests
# (decode steps of up to 128 rows), 2 threads, 6 runs each alternating: 38.1-47.0 s (median
# 39.1) against 39.0-51.5 (41.9) with steps past 64 rows through the modules. AVX-512's
# GEMV_ROWS is this already.
SPLIT_F32_ROWS = 256


class CpuDecode:
    def __init__(self, model: LlamaForCausalLM, step: cpu_decode.DecodeStep,
                 max_rows: int) -> None:
        self.model = model
        self.step = step
        # decode steps of up to this many sequences run natively (see `bind`)
        self.max_rows = max_rows

    @classmethod
    def bind(cls, model: LlamaForCausalLM, block_size: int) -> "CpuDecode | None":
        """The model's native decode step over its bound KV pools, or None where a piece has
        no C form (see the module's docstring)."""
        body = getattr(model, "model", None)
        layers = list(getattr(body, "layers", []))
        if body is None or not layers or not cpu_decode.available():
            return None
        attn = layers[0].self_attn
        if (kernels.default_backend(attn.attn.k_cache.device) != "cpu"
                or kernels.cpu_attention_body(attn.head_dim) != "c"):
            return None
        linears = [m for layer in layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        if not all(isinstance(m, PackedLinear) and m.panels is not None for m in linears):
            return None
        if any(m.bias is not None for layer in layers for m in (
                layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            return None
        first = layers[0]
        dims = {"layers": len(layers), "hidden": first.input_layernorm.weight.shape[0],
                "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
                "head_dim": attn.head_dim,
                "intermediate": first.mlp.down_proj.in_features, "block_size": block_size,
                "qkv_block": attn.qkv_proj.block, "o_block": attn.o_proj.block,
                "gate_up_block": first.mlp.gate_up_proj.block,
                "down_block": first.mlp.down_proj.block}
        for layer in layers:  # one block per product kind: the C step takes four
            if (layer.self_attn.qkv_proj.block, layer.self_attn.o_proj.block,
                    layer.mlp.gate_up_proj.block, layer.mlp.down_proj.block) != (
                    dims["qkv_block"], dims["o_block"], dims["gate_up_block"],
                    dims["down_block"]):
                return None
        tensors = []
        for layer in layers:
            a = layer.self_attn
            if a.attn.k_cache.dtype != a.qkv_proj.panels.dtype or a.attn.k_shift is not None:
                return None
            tensors.append({
                "input_norm": layer.input_layernorm.weight.detach(),
                "qkv": a.qkv_proj.panels, "qkv_bias": a.qkv_proj.bias,
                "o_proj": a.o_proj.panels,
                "post_norm": layer.post_attention_layernorm.weight.detach(),
                "gate_up": layer.mlp.gate_up_proj.panels, "down": layer.mlp.down_proj.panels,
                "k_cache": a.attn.k_cache, "v_cache": a.attn.v_cache})
        norm = body.norm
        step = cpu_decode.DecodeStep(dims, tensors, norm.weight.detach(), attn.rotary.cos,
                                     attn.rotary.sin, norm.eps, attn.attn.scale, SPLIT_ROWS)
        return cls(model, step, cls._max_rows(linears))

    @staticmethod
    def _max_rows(linears: list[PackedLinear]) -> int:
        """The most rows a native step takes: float32 weights SPLIT_F32_ROWS where SPLIT_ROWS
        is set (their products have oneDNN's bits at any rows: the probe at load);
        else the rows the modules' products take through cpu_gemv (bfloat16 weights sum
        otherwise in oneDNN), and no more than GEMV_ROWS where float32 weights take every
        batch there (a prefill's too)."""
        if SPLIT_ROWS and all(m.panels is not None and m.panels.dtype == torch.float32
                              for m in linears):
            return SPLIT_F32_ROWS
        return min(min(m.gemv_rows for m in linears), GEMV_ROWS)

    def can_run(self, ctx: Context, num_tokens: int) -> bool:
        """A step of 1 to ``max_rows`` single-token decodes, in one group (as the ``"cpu"``
        backend groups them)."""
        return (0 < num_tokens <= self.max_rows and ctx.num_decode_tokens == num_tokens
                and len(ctx.decode_groups) == 1)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: Context) -> torch.Tensor:
        """The final norm's output for the step's tokens, as ``model(input_ids, positions)``
        returns it."""
        group = ctx.decode_groups[0]
        x = self.model.model.embed_tokens(input_ids)
        return self.step(x, positions, ctx.slot_mapping, group.block_tables, group.context_lens)
