"""transformers' greedy continuations of a compressed-tensors checkpoint, as JSON on stdout;
runs inside .venv-quant, whose transformers loads the format through compressed-tensors (the
project's venv lacks that package and its pinned transformers).

    .venv-quant/bin/python tests/quant_tools/hf_generate.py CHECKPOINT MAX_NEW < prompts.json
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main(checkpoint: str, max_new: str) -> None:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in json.load(sys.stdin):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=int(max_new), pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    json.dump({"tokens": outputs, "modules": sorted({type(m).__name__ for m in model.modules()})},
              sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:])
