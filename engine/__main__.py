"""``python -m engine``: the offline engine on the default model, streaming a few chat prompts
through the step API and printing the KV figures."""

import argparse
import sys

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [
    ("What is a paged KV cache, in two sentences?", 1),
    ("Write a haiku about queues.", 2),  # n=2: both samples share the prompt's blocks
    ("Name three uses of Redis.", 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model))
    for i, (question, n) in enumerate(PROMPTS):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
        engine.add_request(str(i), ids, SamplingParams(n=n, temperature=0.7, top_p=0.9,
                                                       max_tokens=args.max_tokens, seed=i))
    texts: dict[tuple[str, int], str] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            for sample in delta.samples:
                texts[delta.request_id, sample.index] = (
                    texts.get((delta.request_id, sample.index), "") + sample.text)
                if delta.request_id == "0":  # stream the first answer as it is generated
                    sys.stdout.write(sample.text)
                    sys.stdout.flush()
    print("\n")
    for (request_id, index), text in sorted(texts.items()):
        print(f"--- {PROMPTS[int(request_id)][0]} [sample {index}]\n{text.strip()}\n")
    print("engine stats:", engine.stats())


if __name__ == "__main__":
    main()
