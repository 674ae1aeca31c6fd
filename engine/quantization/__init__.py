"""Quantized checkpoints: GPTQ, AWQ and compressed-tensors (see ``config`` for what is
supported), read into layers that compute from packed weights (``linear``)."""

from transformers import PretrainedConfig

from engine.quantization.config import (
    SUPPORTED,
    CompressedTensorsConfig,
    QuantConfig,
    QuantizationError,
    parse_quant_config,
)
from engine.quantization.linear import Fp8Linear, IntQuantLinear, quantize_linears

__all__ = ["SUPPORTED", "Fp8Linear", "IntQuantLinear", "QuantConfig", "QuantizationError",
           "checkpoint_quantization", "describe", "parse_quant_config", "quantize_linears"]


def describe(config: QuantConfig | None) -> str:
    """A short name for logs and stats: ``gptq-w4-g128``, ``compressed-tensors-fp8``..."""
    if config is None:
        return "none"
    if not isinstance(config, CompressedTensorsConfig):
        return f"{config.quant_method}-w{config.bits}-g{config.group_size}"
    kinds = sorted({"fp8" if s.weights.type == "float" else f"w{s.weights.num_bits}a16"
                    for s in config.config_groups.values()})
    return "-".join(["compressed-tensors", *kinds])  # no groups: KV-cache scales only


def checkpoint_quantization(hf_config: PretrainedConfig, requested: str | None) -> str:
    """The checkpoint's quantization, named by ``describe``; ``requested`` (vLLM's
    ``--quantization``), when given, must be the checkpoint's method, as vLLM requires."""
    config = parse_quant_config(getattr(hf_config, "quantization_config", None))
    method = None if config is None else config.quant_method
    if requested is not None and requested != method:
        raise QuantizationError(f"quantization={requested!r} was asked for, but the checkpoint "
                                f"is {'not quantized' if method is None else repr(method)}")
    return describe(config)
