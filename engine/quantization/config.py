"""``config.json``'s ``quantization_config``, parsed and checked before any weight is read.

Supported, as vLLM names them: ``gptq`` (4/8 bit, any group size or -1, ``desc_act`` with
``g_idx``, symmetric or not, ``checkpoint_format`` gptq or gptq_v2), ``awq`` (GEMM, 4 bit), and
``compressed-tensors`` (``pack-quantized``/``int-quantized`` W4A16 and W8A16 with group or
channel scales, ``float-quantized`` FP8 W8A8 with static or dynamic activation scales). Anything
else is refused here, naming the method and what is supported.
"""

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

SUPPORTED = ("gptq", "awq", "compressed-tensors")
_CT_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_CT_FORMATS = (*_CT_INT_FORMATS, "float-quantized")


class QuantizationError(ValueError):
    """A checkpoint's quantization pagedq cannot load; the message says what and why."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GPTQConfig(_Lenient):
    quant_method: Literal["gptq"]
    bits: Literal[4, 8]
    group_size: int
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and v <= 0:
            raise ValueError("must be -1 (one group per row) or positive")
        return v


class AWQConfig(_Lenient):
    quant_method: Literal["awq"]
    bits: Literal[4]
    group_size: int
    zero_point: Literal[True] = True
    version: Literal["gemm", "GEMM"] = "gemm"


class CTArgs(_Lenient):
    num_bits: int
    type: Literal["int", "float"]
    symmetric: bool = True
    strategy: Literal["group", "channel", "tensor", "token"]
    group_size: int | None = None
    dynamic: bool = False


class CTScheme(_Lenient):
    targets: list[str]
    weights: CTArgs
    input_activations: CTArgs | None = None
    format: str | None = None

    def matches(self, name: str) -> bool:
        """compressed-tensors' targets: a class name ("Linear"), ``re:`` a regex, or a name."""
        return any(t == "Linear" or (t.startswith("re:") and re.match(t[3:], name))
                   or name == t or name.endswith("." + t) for t in self.targets)


class CompressedTensorsConfig(_Lenient):
    quant_method: Literal["compressed-tensors"]
    format: str | None = None
    config_groups: dict[str, CTScheme]
    ignore: list[str] = []

    def scheme(self, name: str) -> CTScheme | None:
        if any(i == name or (i.startswith("re:") and re.match(i[3:], name))
               for i in self.ignore):
            return None
        return next((s for s in self.config_groups.values() if s.matches(name)), None)

    def check(self) -> None:
        for key, s in self.config_groups.items():
            fmt, w, act = s.format or self.format, s.weights, s.input_activations
            where = f"compressed-tensors config_groups.{key}"
            if fmt not in _CT_FORMATS:
                raise QuantizationError(f"{where}: format {fmt!r} is not supported; pagedq "
                                        f"supports {list(_CT_FORMATS)}")
            if w.type == "int" and (w.num_bits not in (4, 8) or act is not None
                                    or fmt not in _CT_INT_FORMATS
                                    or w.strategy not in ("group", "channel")):
                raise QuantizationError(
                    f"{where}: int{w.num_bits} weights, {w.strategy} scales, activations "
                    f"{act and act.type}: pagedq supports 4 or 8-bit int weights with group or "
                    "channel scales and unquantized activations (W4A16, W8A16)")
            if w.type == "float" and (w.num_bits != 8 or w.strategy not in ("channel", "tensor")
                                      or act is None or act.type != "float"
                                      or act.strategy not in ("token", "tensor")):
                raise QuantizationError(
                    f"{where}: pagedq supports FP8 weights (channel or tensor scales) with FP8 "
                    "activations (dynamic per token or static per tensor), i.e. FP8 W8A8")
            if w.strategy == "group" and not (w.group_size or 0) > 0:
                raise QuantizationError(f"{where}: group strategy needs a positive group_size")


QuantConfig = GPTQConfig | AWQConfig | CompressedTensorsConfig
_PARSERS: dict[str, type[QuantConfig]] = {"gptq": GPTQConfig, "awq": AWQConfig,
                                          "compressed-tensors": CompressedTensorsConfig}


def parse_quant_config(raw: Any) -> QuantConfig | None:
    """The checkpoint's quantization, or None for a float checkpoint."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else raw
    if not isinstance(raw, dict) or "quant_method" not in raw:
        raise QuantizationError(f"quantization_config {raw!r} names no quant_method; pagedq "
                                f"supports {list(SUPPORTED)}")
    method = raw["quant_method"]
    if method not in _PARSERS:
        raise QuantizationError(f"quantization method {method!r} is not supported; pagedq "
                                f"supports {list(SUPPORTED)} (SqueezeLLM is left out: see README)")
    try:
        config = _PARSERS[method].model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                             for err in e.errors())
        raise QuantizationError(f"malformed {method} quantization_config: {problems}") from None
    if isinstance(config, CompressedTensorsConfig):
        config.check()
    return config
