"""Quantized checkpoints: GPTQ, AWQ and compressed-tensors (see ``config`` for what is
supported), read into layers that compute from packed weights (``linear``)."""

from engine.quantization.config import (
    SUPPORTED,
    CompressedTensorsConfig,
    QuantConfig,
    QuantizationError,
    parse_quant_config,
)
from engine.quantization.linear import Fp8Linear, IntQuantLinear, quantize_linears

__all__ = ["SUPPORTED", "Fp8Linear", "IntQuantLinear", "QuantConfig", "QuantizationError",
           "describe", "parse_quant_config", "quantize_linears"]


def describe(config: QuantConfig | None) -> str:
    """A short name for logs and stats: ``gptq-w4-g128``, ``compressed-tensors-fp8``..."""
    if config is None:
        return "none"
    if not isinstance(config, CompressedTensorsConfig):
        return f"{config.quant_method}-w{config.bits}-g{config.group_size}"
    w = next(iter(config.config_groups.values())).weights
    kind = "fp8" if w.type == "float" else f"w{w.num_bits}a16"
    return f"compressed-tensors-{kind}"
