"""A token's bits do not depend on how it is computed: decoded or recomputed after a resume,
prefilled whole or in chunks, in a last layer that computes only the rows that sample. Seeded
draws rest on it (a top-p draw once flipped on logits 1.4e-6 apart)."""

import torch

from engine import SamplingParams
from tests.conftest import drain, run_modules


def test_a_token_has_the_same_bits_however_it_is_computed(tmp_path, make_llm) -> None:
    """Decoded, recomputed after a resume, or prefilled in other chunks, a token's logprobs are
    the same floats: so a seeded draw cannot flip where two tokens are nearly tied (the chaos
    test once saw a top-p draw flip on logits 1.4e-6 apart). An MLP wider than 1,024 takes
    oneDNN's other one-row path."""
    from engine.llm_engine import Resume
    from engine.random_model import build_random_checkpoint

    model = build_random_checkpoint(tmp_path / "wide", "llama", intermediate_size=1280)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.8, seed=5, max_tokens=24,
                            ignore_eos=True, logprobs=3)
    prompt = [7 + (i * 13) % 400 for i in range(90)]
    whole = make_llm(model, max_num_batched_tokens=512).engine
    whole.add_request("r", prompt, params)
    chunked = make_llm(model, max_num_batched_tokens=32).engine  # 3 prompt chunks
    chunked.add_request("r", prompt, params)
    runs = [_samples(whole), _samples(chunked)]
    for cut in (1, 6, 17):
        whole.add_request(f"cut{cut}", prompt, params, resume=[
            Resume(runs[0][i][0][:cut], 0) for i in range(2)])
        resumed = _samples(whole)
        assert resumed == {i: (ids[cut:], logprobs[cut:])
                           for i, (ids, logprobs) in runs[0].items()}, cut
    assert runs[1] == runs[0]


def _samples(engine) -> dict[int, tuple[list[int], list[dict[int, float]]]]:
    """Each sample's tokens and logprobs from one finished request."""
    out: dict[int, tuple[list[int], list[dict[int, float]]]] = {}
    for deltas in drain(engine).values():
        for delta in deltas:
            for s in delta.samples:
                ids, logprobs = out.setdefault(s.index, ([], []))
                ids += s.token_ids
                logprobs += s.logprobs or []
    return out


def test_the_last_layer_computes_the_rows_that_sample_with_the_whole_batchs_bits(
        tiny_llama, make_llm) -> None:
    """A prefill's last layer runs past its attention only on the rows that sample (the
    model's ``output_rows``): their hidden states are the bits every row computed gives, and
    every row's KV is still stored. Two prompts in one step, the second cut short of its end by
    the token budget (it samples nothing)."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=64)
    engine, runner = llm.engine, llm.engine.model_runner
    engine.add_request("a", [7 + (i * 13) % 300 for i in range(40)], SamplingParams(max_tokens=2))
    engine.add_request("b", [9 + (i * 11) % 300 for i in range(30)], SamplingParams(max_tokens=2))
    step, sampled = runner._gather(engine.scheduler.schedule())
    # the shorter prompt goes first (shortest prefill first) and samples; the other is cut
    assert [s.request_id for s in sampled] == ["b"] and len(step.input_ids) == 64
    with torch.inference_mode():
        runner.kv_cache.zero_()  # the slots neither run writes: equal (a pool may reuse memory)
        kept = runner._forward(step, None)
        pool = runner.kv_cache.clone()
        runner.kv_cache.zero_()
        every = run_modules(runner, torch.tensor(step.input_ids), torch.tensor(step.positions),
                            runner._context(step))
    assert kept.shape == (1, every.shape[1])
    assert torch.equal(kept, every[step.logit_rows])
    assert torch.equal(runner.kv_cache, pool)  # the same KV, every layer's, every row's
    for request_id in ("a", "b"):
        engine.abort(request_id)
