"""GPTQ checkpoints written by the tests in the format's documented layout, from a
round-to-nearest reference quantizer: gptqmodel 7.7 needs torch>=2.14.1 (the project holds
2.13.0), so it cannot make them here. Beside each, the float checkpoint its dequantization gives
(``w = (q - zero) * scale``, applied here, not by pagedq), which transformers runs as the
reference; ``awq_float_twin`` does the same for AutoAWQ's checkpoints."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i holds column order[i] of 8
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# layers that read one input share GPTQ's activation order (one Hessian)
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def rtn(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int,
        sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes [N, K], fp16 scales [N, G] and zeros [N, G], GPTQ's rules."""
    maxq = (1 << bits) - 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        scales[:, g] = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros[:, g] = torch.full_like(hi, (maxq + 1) / 2) if sym else torch.round(-lo /
                                                                                 scales[:, g])
    scales = scales.half().float()  # as stored
    q = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq)
    return q.long(), scales, zeros.long()


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs the last dim little-endian, 32 // bits codes to an int32."""
    per = 32 // bits
    v = values.long().reshape(*values.shape[:-1], -1, per)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(q, scales, zeros, g_idx, bits, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ: qweight packed along the inputs [K / pack, N], qzeros packed along the outputs
    [G, N / pack] (v1, AutoGPTQ's, stores them minus one; gptq_v2 as they are), scales [G, N]
    fp16, g_idx [K] int32."""
    return {"qweight": _pack(q, bits).t().contiguous(),
            "qzeros": _pack(zeros.t() - int(v1), bits), "scales": scales.t().half().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def write_gptq(source: Path, out: Path, bits: int, group: int, desc_act: bool = False,
               sym: bool = True, checkpoint_format: str = "gptq") -> tuple[Path, Path]:
    """(quantized checkpoint, its dequantized float twin) under ``out``; ``desc_act`` orders
    the groups by a seeded permutation of the input columns, as GPTQ's activation order does."""
    quant_dir, float_dir = out / "gptq", out / "gptq-float"
    state = load_file(str(source / "model.safetensors"))
    quant_state, float_state = {}, {}
    gen = torch.Generator().manual_seed(0)
    perms: dict[tuple[str, str], torch.Tensor] = {}  # layers reading one input share it
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.split(".")[-1] in _LINEARS):
            quant_state[name] = float_state[name] = tensor
            continue
        k = tensor.shape[1]
        size = group if group > 0 else k
        groups = -(-k // size)
        g_idx = torch.arange(k) // size
        if desc_act:
            parent, proj = prefix.rsplit(".", 1)
            shared = (parent, _SHARED_INPUT.get(proj, proj))
            g_idx = g_idx[perms.setdefault(shared, torch.randperm(k, generator=gen))]
        q, scales, zeros = rtn(tensor.float(), bits, g_idx, groups, sym)
        float_state[name] = (q - zeros[:, g_idx]) * scales[:, g_idx]
        packed = gptq_tensors(q, scales, zeros, g_idx, bits, checkpoint_format == "gptq")
        quant_state |= {f"{prefix}.{t}": v for t, v in packed.items()}
    config = json.loads((source / "config.json").read_text())
    quant_config = {"quant_method": "gptq", "bits": bits, "group_size": group,
                    "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format}
    for folder, tensors, cfg in ((quant_dir, quant_state, config | {
            "quantization_config": quant_config}), (float_dir, float_state, config)):
        shutil.copytree(source, folder, dirs_exist_ok=True)
        (folder / "pagedq_random.json").unlink(missing_ok=True)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return quant_dir, float_dir


def awq_float_twin(checkpoint: Path, out: Path) -> Path:
    """The float checkpoint an AWQ GEMM checkpoint's documented dequantization gives: nibble i
    of a word is column ``AWQ_PACK_ORDER[i]`` of its 8, ``w = (q - zero) * scale`` per group."""
    state = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    group = config.pop("quantization_config")["group_size"]

    def columns(packed: torch.Tensor) -> torch.Tensor:
        nibbles = (packed.long().unsqueeze(-1) >> (torch.arange(8) * 4)) & 15
        ordered = torch.empty_like(nibbles)
        ordered[..., list(AWQ_PACK_ORDER)] = nibbles
        return ordered.reshape(packed.shape[0], -1)

    floats = {}
    for name, tensor in state.items():
        if name.endswith((".qzeros", ".scales")):
            continue
        if not name.endswith(".qweight"):
            floats[name] = tensor
            continue
        prefix = name.removesuffix(".qweight")
        q, zeros = columns(tensor), columns(state[f"{prefix}.qzeros"])
        scales = state[f"{prefix}.scales"].float()
        rows = torch.arange(q.shape[0]) // group
        floats[f"{prefix}.weight"] = ((q - zeros[rows]) * scales[rows]).t().contiguous()
    shutil.copytree(checkpoint, out, dirs_exist_ok=True)
    save_file(floats, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
