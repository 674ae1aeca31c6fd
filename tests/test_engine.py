"""Engine invariants through the offline and step APIs: aborts free the pool at once, the n
samples of a job share the prompt's blocks, seeded sampling ignores the batch, bad input gets a
clear error and the engine keeps working, the KV pool is sized from its memory budget (or
reserved whole at start). A token's bits however it is computed: test_engine_bits."""

import pytest

from engine import SamplingParams
from tests.conftest import assert_pool_whole, drain, hf_greedy


def test_abort_mid_prefill_and_mid_decode(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("long", list(range(3, 203)), params)  # 200 tokens: 7 chunks
    engine.add_request("short", [5, 6, 7], params)
    engine.add_request("waiting", list(range(3, 300)), params)
    engine.step()
    # mid-prefill: "short" went first (the shortest prefill of those that came together)
    assert engine.requests["long"].seqs[0].num_computed_tokens == 32 - 3
    used = engine.block_manager.num_used_blocks
    delta = engine.abort("long")
    assert delta.finished and delta.samples[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks < used  # freed at once, not at the next step
    engine.abort("waiting")  # never admitted
    for _ in range(5):
        engine.step()
    short = engine.requests["short"].seqs[0]
    assert short.num_output_tokens > 1  # mid-decode
    engine.abort("short")
    assert engine.abort("short") is None and engine.abort("nope") is None
    assert_pool_whole(engine)
    # and the engine still serves
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_llama, [5, 6, 7], 50)


def test_abort_after_fork_frees_shared_blocks(tiny_llama, make_llm) -> None:
    engine = make_llm(tiny_llama).engine
    engine.add_request("job", list(range(3, 60)), SamplingParams(n=4, max_tokens=30, seed=1))
    for _ in range(3):
        engine.step()
    assert len(engine.requests["job"].seqs) == 4
    delta = engine.abort("job")
    assert sorted(s.index for s in delta.samples) == [0, 1, 2, 3]
    assert_pool_whole(engine)


def test_n_samples_share_prompt_blocks(tiny_llama, make_llm) -> None:
    prompt = [3 + i % 900 for i in range(500)]  # 31 full blocks of 16 and 4 tokens
    params = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    shared = make_llm(tiny_llama, enable_prefix_caching=False)
    out = shared.generate([prompt], params, use_tqdm=False)[0]
    # the 31 full prompt blocks once, plus each sample's own copy of the partial last block
    assert shared.stats()["kv_blocks_peak"] == 31 + 8
    separate = make_llm(tiny_llama, enable_prefix_caching=False)
    singles = [SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)] * 8
    separate.generate([prompt] * 8, singles, use_tqdm=False)
    assert separate.stats()["kv_blocks_peak"] == 8 * 32
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the samples differ


def test_seeded_output_ignores_the_batch(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    params = SamplingParams(n=4, temperature=0.9, top_p=0.9, max_tokens=20, seed=42)
    alone = llm.generate([[7, 8, 9, 10]], params, use_tqdm=False)[0]
    others = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(n=3, temperature=1.2, top_k=20, max_tokens=25),
              params,
              SamplingParams(temperature=0.7, min_p=0.1, max_tokens=10, seed=5)]
    crowd = llm.generate([list(range(3, 90)), [11, 12], [7, 8, 9, 10], list(range(50, 250))],
                         others, use_tqdm=False)[2]
    assert [o.token_ids for o in crowd.outputs] == [o.token_ids for o in alone.outputs]
    assert [o.text for o in crowd.outputs] == [o.text for o in alone.outputs]


def test_step_deltas_concatenate_to_the_output(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.engine
    params = SamplingParams(n=2, temperature=0.8, max_tokens=40, seed=9, stop=["the"])
    engine.add_request("r", "The queue worker pulls a job", params)
    deltas = drain(engine)["r"]
    assert deltas[-1].finished
    expected = llm.generate(["The queue worker pulls a job"], params, use_tqdm=False)[0]
    for sample in expected.outputs:
        pieces = [s for d in deltas for s in d.samples if s.index == sample.index]
        assert "".join(p.text for p in pieces) == sample.text
        assert [t for p in pieces for t in p.token_ids] == sample.token_ids
        assert pieces[-1].finish_reason == sample.finish_reason
        assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)


BAD = [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([5] * 3000, SamplingParams(), "maximum context length"),
    ([5, 6], SamplingParams(max_tokens=4000), "exceeds"),
    ([5, -1], SamplingParams(), "outside the vocabulary"),
    ([5, 10**6], SamplingParams(), "outside the vocabulary"),
]


@pytest.mark.parametrize(("prompt", "params", "message"), BAD)
def test_bad_prompts_are_rejected(tiny_llama, make_llm, prompt, params, message) -> None:
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    # nothing was left behind and the engine keeps serving
    assert_pool_whole(llm.engine)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama, [5, 6, 7], 5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "n must be"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -3}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_too_big_for_the_pool(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    assert llm.generate([[5] * 30], SamplingParams(max_tokens=10), use_tqdm=False)


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_resume_continues_the_stream_exactly(tiny_llama, make_llm, steps) -> None:
    """A request stopped after some steps and resumed from what it had published gives the
    same tokens and text as one uninterrupted run (seeded sampling included)."""
    from engine.llm_engine import Resume

    engine = make_llm(tiny_llama).engine
    prompt = "深度学习模型 streams tokens 🙂"
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=11, stop=["ing"])
    engine.add_request("whole", prompt, params)
    whole = drain(engine)["whole"]
    engine.add_request("cut", prompt, params)
    published: dict[int, tuple[list[int], str, bool]] = {}
    for _ in range(steps):
        for delta in engine.step():
            for s in delta.samples:
                ids, text, _ = published.get(s.index, ([], "", False))
                published[s.index] = (ids + s.token_ids, text + s.text, s.finished)
    engine.abort("cut")  # the worker died; what it published stays
    resume = [None if published.get(i, ([], "", False))[2] else
              Resume(published.get(i, ([], ""))[0], len(published.get(i, ([], ""))[1]))
              for i in range(3)]
    if all(r is None for r in resume):
        return
    engine.add_request("cut", prompt, params, resume=resume)
    for delta in drain(engine)["cut"]:
        for s in delta.samples:
            ids, text, _ = published.get(s.index, ([], "", False))
            published[s.index] = (ids + s.token_ids, text + s.text, s.finished)
    for i in range(3):
        pieces = [s for d in whole for s in d.samples if s.index == i]
        assert published[i][0] == [t for p in pieces for t in p.token_ids]
        assert published[i][1] == "".join(p.text for p in pieces)


def test_final_only_deltas_carry_the_text_whole_at_the_end(tiny_llama, make_llm) -> None:
    """``final_only`` (what LLM.generate asks): the same tokens and text as a streamed request
    (n samples forked from one prompt included), the text whole in each sample's last delta;
    a resume cannot ask for it."""
    from engine.llm_engine import Resume

    engine = make_llm(tiny_llama).engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    engine.add_request("streamed", "深度学习 🙂", params)
    engine.add_request("final", "深度学习 🙂", params, final_only=True)
    runs = drain(engine)
    for i in range(2):
        streamed = [s for d in runs["streamed"] for s in d.samples if s.index == i]
        final = [s for d in runs["final"] for s in d.samples if s.index == i]
        assert [t for s in final for t in s.token_ids] == [t for s in streamed for t in s.token_ids]
        assert [s.text for s in final[:-1]] == [""] * (len(final) - 1)
        assert final[-1].text == "".join(s.text for s in streamed) != ""
    with pytest.raises(ValueError, match="final_only"):
        engine.add_request("resumed", "x", SamplingParams(), resume=[Resume([5], 0)],
                           final_only=True)


def test_kv_pool_sized_from_the_memory_budget(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, kv_cache_memory_gib=0.001, block_size=16)
    runner = llm.engine.model_runner
    block_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    assert llm.stats()["kv_blocks_total"] == 2**30 * 0.001 // block_bytes == runner.num_kv_blocks
    # never more than max_num_seqs sequences at the full context need
    capped = make_llm(tiny_llama, kv_cache_memory_gib=1.0, max_num_seqs=2, max_model_len=100)
    assert capped.stats()["kv_blocks_total"] == 2 * 7


def test_a_reserved_pool_is_written_whole_at_start_and_generates_the_same(
        tiny_llama, make_llm) -> None:
    import ctypes
    import ctypes.util

    def resident_pages(tensor) -> int:  # mincore(2): the pages of tensor in memory now
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        pages = -(-tensor.nbytes // 4096)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(tensor.data_ptr(), tensor.nbytes, vec) == 0
        return sum(b & 1 for b in vec.raw)

    prompts = ["the first prompt", "a second, longer prompt than that"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = make_llm(tiny_llama, kv_cache_memory_gib=0.01)
    reserved = make_llm(tiny_llama, kv_cache_memory_gib=0.01, reserve_kv_cache=True)
    pool = reserved.engine.model_runner.kv_cache
    assert pool.shape == plain.engine.model_runner.kv_cache.shape
    assert pool.data_ptr() % (2 << 20) == 0
    # every page of the reserved pool is in memory before any call
    assert resident_pages(pool) == -(-pool.nbytes // 4096)
    assert not pool[:, :, 1:].any()
    assert ([o.outputs[0].token_ids for o in reserved.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
