"""Load a Hugging Face checkpoint folder: config through AutoConfig, weights from safetensors
(single file or sharded), fused parameters assembled from their checkpoint parts; the eos ids."""

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from engine.cpu_linear import can_pack, pack_linears
from engine.cuda_linear import gemv_linears, use_gemv
from engine.models import MODEL_REGISTRY, LlamaForCausalLM
from engine.quantization import parse_quant_config, quantize_linears
from kernels import cpu_gemv


def _architecture(config: PretrainedConfig) -> str:
    """The model class the checkpoint names (``?`` where its config names none)."""
    return (config.architectures or ["?"])[0]


def load_config(path: Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(path)
    arch = _architecture(config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; pagedq supports "
                         f"{sorted(MODEL_REGISTRY)}")
    return config


def eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokenizer's eos and those of the checkpoint's generation_config.json, if any."""
    ids = {tokenizer.eos_token_id} - {None}
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    return ids | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def read_kv_scales(path: Path, num_layers: int) -> torch.Tensor | None:
    """The checkpoint's fp8 KV scales ``[2, num_layers]`` (K then V) as llm-compressor writes
    them (``model.layers.<i>.self_attn.k_scale`` / ``v_scale``), or None when it has none.
    Reads those tensors only, not the weights."""
    names = [f"model.layers.{i}.self_attn.{kind}_scale" for kind in "kv" for i in range(num_layers)]
    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found |= {name: f.get_tensor(name).float() for name in set(f.keys()) & set(names)}
    if not found:
        return None
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"checkpoint {path} has fp8 KV scales for some layers but lacks "
                         f"{missing[:4]}")
    shaped = [name for name in names if found[name].numel() != 1]
    if shaped:
        raise ValueError(f"{shaped[0]} has shape {tuple(found[shaped[0]].shape)}: pagedq "
                         f"takes one K and one V scale per layer (per-tensor), not per head")
    return torch.stack([found[name].reshape(()) for name in names]).view(2, num_layers)


def activation_dtype(dtype: torch.dtype, device: torch.device, quantized: bool) -> torch.dtype:
    """What the model's activations are held in: ``dtype``, but float32 for bfloat16 on the CPU
    where the C kernels build, whose weights and KV are then bfloat16 and everything between
    the products float32 (llama.cpp's F16 shape). The C decode step, norms and rotary exist in
    float32 only, and what bfloat16 saves is in the bytes the memory-bound parts read (the
    weights at small batches, the KV) and in oneDNN's bfloat16 products at large ones:
    random-26m's 128 requests (2 threads, AMD EPYC Zen 4 with AVX-512 BF16) took 58 s in
    torch's bfloat16 ops, 23.3 s in float32 and 17.9 s so. Quantized weights keep ``dtype``."""
    if (dtype == torch.bfloat16 and device.type == "cpu" and not quantized
            and cpu_gemv.available() and torch.backends.mkldnn.is_available()):
        return torch.float32
    return dtype


def load_model(path: Path, config: PretrainedConfig, max_positions: int, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    """The model with its weights in ``dtype`` (rounded to it), its activations in
    ``activation_dtype``'s."""
    with torch.device("meta"):
        model = MODEL_REGISTRY[_architecture(config)](config, max_positions)
    checkpoint = _read_safetensors(path)
    quant = parse_quant_config(getattr(config, "quantization_config", None))
    if quant is not None:  # quantized layers take (pop) their tensors first
        quantize_linears(model, quant, checkpoint, dtype, device)
    held = activation_dtype(dtype, device, quant is not None)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # tied parameters are named once
        parts = next(((fused, sources) for fused, sources in model.packed_modules.items()
                      if f".{fused}." in name), None)
        if parts is None:
            sources = [name]
        else:
            sources = [name.replace(f".{parts[0]}.", f".{src}.") for src in parts[1]]
        missing = [s for s in sources if s not in checkpoint]
        if missing:
            raise ValueError(f"checkpoint {path} lacks {missing} (needed for {name})")
        state[name] = torch.cat([checkpoint[s] for s in sources]).to(dtype).to(held)
        if tuple(state[name].shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)}, "
                             f"model expects {tuple(param.shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    if can_pack(model):
        pack_linears(model, dtype if held != dtype else torch.float32)
    elif use_gemv(model):
        gemv_linears(model)
    return model
