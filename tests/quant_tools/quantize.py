"""Quantizes a float checkpoint with llm-compressor; runs inside .venv-quant (see
tests/quant_venv.sh), never in the project's venv: llmcompressor 0.14 pins transformers
<=5.17 while pagedq runs 5.23.

    .venv-quant/bin/python tests/quant_tools/quantize.py SOURCE OUT RECIPE

Recipes: GPTQ (llm-compressor's GPTQModifier) at 4 or 8 bits, group or channel scales,
symmetric or not, with activation ordering; ``rtn-...`` the same scheme rounded to nearest by
its QuantizationModifier (no calibration: SmolLM2's GPTQ pass takes ~7 min on 2 busy cores,
this seconds); FP8_DYNAMIC (no calibration); and AutoAWQ's GEMM
format (``autoawq-w4-g128``; llm-compressor's own AWQModifier wants an accelerator).
Calibration text: the Python documentation's topics shipped with CPython
(``pydoc_data.topics``), real English prose, so the run needs nothing from a hub.
"""

import pydoc_data.topics
import sys
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

SAMPLES, SEQ_LEN = 32, 128


def _weights(bits: int, group: int, symmetric: bool, actorder: str | None) -> dict:
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric,
            "strategy": "group" if group > 0 else "channel"}
    if group > 0:
        args["group_size"] = group
    if actorder:
        args["actorder"] = actorder
    return {"group_0": {"targets": ["Linear"], "weights": args}}


def _recipe(name: str):
    """``{gptq|rtn}-w{bits}-g{group|ch}[-asym][-act]`` or ``fp8-dynamic``."""
    if name == "fp8-dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    method, bits, group, *flags = name.split("-")
    bits, group = int(bits[1:]), -1 if group == "gch" else int(group[1:])
    if method == "rtn":
        return QuantizationModifier(config_groups=_weights(bits, group, "asym" not in flags,
                                                           None), ignore=["lm_head"])
    return GPTQModifier(config_groups=_weights(bits, group, "asym" not in flags,
                                               "weight" if "act" in flags else None),
                        ignore=["lm_head"])


def _text() -> str:
    return " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def _calibration(tokenizer) -> Dataset:
    ids = tokenizer(_text())["input_ids"]
    chunks = [ids[i * SEQ_LEN:(i + 1) * SEQ_LEN] for i in range(SAMPLES)]
    return Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * SEQ_LEN] * SAMPLES})


def _autoawq(source: str, out: str, group: int) -> None:
    from awq import AutoAWQForCausalLM

    model = AutoAWQForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    words = _text().split()
    texts = [" ".join(words[i:i + 30]) for i in range(0, 30 * 4 * SAMPLES, 30)]
    model.quantize(tokenizer, quant_config={"zero_point": True, "q_group_size": group,
                                            "w_bit": 4, "version": "GEMM"},
                   calib_data=texts, max_calib_seq_len=SEQ_LEN, n_parallel_calib_samples=8)
    model.save_quantized(out)
    tokenizer.save_pretrained(out)


def main(source: str, out: str, recipe: str) -> None:
    torch.manual_seed(0)
    if recipe.startswith("autoawq-w4-g"):
        _autoawq(source, out, int(recipe.removeprefix("autoawq-w4-g")))
        Path(out, "generation_config.json").unlink(missing_ok=True)
        return
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    kwargs = {} if recipe.startswith(("fp8", "rtn")) else {
        "dataset": _calibration(tokenizer), "num_calibration_samples": SAMPLES,
        "max_seq_length": SEQ_LEN}
    oneshot(model=model, recipe=_recipe(recipe), **kwargs)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    Path(out, "generation_config.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
