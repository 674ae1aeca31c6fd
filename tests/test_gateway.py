"""The OpenAI-compatible gateway with the official ``openai`` SDK as the client, a real
redis-server, a real worker process on the tiny random model and the gateway on uvicorn: texts
equal LLM.generate's for the same request, plain and streamed; n, logprobs, stop; each error
status; keys; a client that goes away cancels its job."""

from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import redis
from test_worker import reference, wait_for
from transformers import AutoTokenizer

from engine import LLM, BeamSearchParams
from producer import Client
from producer.core import new_job
from producer.gateway.schemas import ChatCompletionRequest, CompletionRequest
from producer.gateway.settings import parse_args
from producer.protocol import queue_key
from producer.rq_mirror import register_worker

pytest_plugins = ["redis_fixtures", "gateway_fixtures"]  # real servers; `stack` shared
QUEUE = "q"


def expected(model: Path, request: CompletionRequest | ChatCompletionRequest) -> list[Any]:
    """LLM.generate's outputs for the jobs the gateway makes of ``request``."""
    return reference(model, [new_job(QUEUE, **spec) for spec in request.specs()])


def test_models_are_the_queues_with_live_workers(stack, tiny_llama) -> None:
    server, gateway = stack
    Client(server.url, queue="orphan").submit("x")  # a queue, but nobody serves it
    models = gateway.client().models.list().data
    assert (QUEUE, str(tiny_llama), "pagedq") in [(m.id, m.root, m.owned_by) for m in models]
    assert "orphan" not in [m.id for m in models]
    assert gateway.client().models.retrieve(QUEUE).id == QUEUE


def test_completion_plain_and_streamed_equal_llm_generate(stack, tiny_llama) -> None:
    _, gateway = stack
    body = {"model": QUEUE, "prompt": "The queue worker pulls a job", "max_tokens": 12,
            "temperature": 0}
    (ref,) = expected(tiny_llama, CompletionRequest(**body))
    client = gateway.client()
    plain = client.completions.create(**body)
    assert plain.choices[0].text == ref.outputs[0].text
    assert plain.choices[0].finish_reason == ref.outputs[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == \
        (len(ref.prompt_token_ids), 12)
    chunks = list(client.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_plain_and_streamed_equal_llm_generate(stack, tiny_llama) -> None:
    _, gateway = stack
    body = {"model": QUEUE, "max_completion_tokens": 10, "temperature": 0, "seed": 1,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hello! How are you?"}]}
    (ref,) = expected(tiny_llama, ChatCompletionRequest(**body))
    client = gateway.client()
    plain = client.chat.completions.create(**body)
    assert plain.choices[0].message.content == ref.outputs[0].text
    assert plain.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_n_prompts_logprobs_and_stop(stack, tiny_llama) -> None:
    _, gateway = stack
    client = gateway.client()
    sampled = {"model": QUEUE, "prompt": [[5, 6, 7], [8, 9, 10, 11]], "n": 2, "max_tokens": 6,
               "temperature": 0.8, "seed": 3, "logprobs": 2}
    refs = expected(tiny_llama, CompletionRequest(**sampled))
    name = AutoTokenizer.from_pretrained(tiny_llama).decode  # a token's text, decoded alone
    answer = client.completions.create(**sampled)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt i, sample j: i * n + j
    for choice in answer.choices:
        out = refs[choice.index // 2].outputs[choice.index % 2]
        assert choice.text == out.text
        assert choice.logprobs.tokens == [name([t]) for t in out.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)], abs=1e-5)
        # vLLM's rule: the top `logprobs` tokens plus the chosen one (2 or 3), named by their
        # text (two byte tokens may both read U+FFFD: one key, as in vLLM's legacy format)
        assert all(2 <= len(lp) <= 3 for lp in out.logprobs)
        assert [set(top) for top in choice.logprobs.top_logprobs] == \
            [{name([k]) for k in lp} for lp in out.logprobs]
    streamed = client.completions.create(**sampled, stream=True)
    texts = ["", "", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in answer.choices]
    chat = client.chat.completions.create(model=QUEUE, messages=[{"role": "user",
                                          "content": "hi"}], max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.bytes == list(t.token.encode()) and not t.token.startswith("token_id:")
               for t in content + [top for t in content for top in t.top_logprobs])
    greedy = {"model": QUEUE, "prompt": "She sells sea shells by", "max_tokens": 30,
              "temperature": 0}
    text = client.completions.create(**greedy).choices[0].text
    stop = text[len(text) // 2:][:2]  # somewhere in the greedy text
    (ref,) = expected(tiny_llama, CompletionRequest(**greedy, stop=stop))
    stopped = client.completions.create(**greedy, stop=stop).choices[0]
    assert (stopped.text, stopped.finish_reason) == (ref.outputs[0].text, "stop")
    assert stop not in stopped.text and len(stopped.text) < len(text)


def test_beam_search_as_vllm_extra_parameters_equals_llm_beam_search(stack, tiny_llama) -> None:
    _, gateway = stack
    client, prompt = gateway.client(), "The queue worker pulls a job"
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    want = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=10,
                                                    length_penalty=0.5,
                                                    early_stopping=True))[0].sequences
    start = len(llm.tokenizer.encode(prompt))
    beams = [[llm.tokenizer.decode([t]) for t in s.tokens[start:]] for s in want]
    assert len({tuple(s.tokens) for s in want}) == 3  # three different beams, best first
    plain = client.completions.create(model=QUEUE, prompt=prompt, max_tokens=10, n=3, logprobs=0,
                                      extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                  "early_stopping": True})
    assert [c.logprobs.tokens for c in plain.choices] == beams
    assert [c.text for c in plain.choices] == [s.text for s in want]
    assert [c.index for c in plain.choices] == [0, 1, 2]
    streamed = client.completions.create(model=QUEUE, prompt=prompt, max_tokens=10, stream=True,
                                         extra_body={"beam_width": 3, "length_penalty": 0.5,
                                                     "early_stopping": True})
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [s.text for s in want]
    with pytest.raises(openai.BadRequestError, match="beam"):
        client.completions.create(model=QUEUE, prompt=prompt, n=2, temperature=0.7,
                                  extra_body={"use_beam_search": True})


def test_every_error_status_is_an_openai_error(stack) -> None:
    server, gateway = stack
    client = gateway.client()
    with pytest.raises(openai.BadRequestError, match="temperature") as bad:
        client.completions.create(model=QUEUE, prompt="x", temperature=-1)
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model=QUEUE, prompt="x", max_tokens=2,
                                  extra_body={"min_tokens": 5})
    too_long = {"model": QUEUE, "prompt": "x", "max_tokens": 5000}  # refused by the worker
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(**too_long)
    with pytest.raises(openai.APIError, match="max_tokens"):  # in the stream, before [DONE]
        list(client.completions.create(**too_long, stream=True))
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x")
    Client(server.url, queue="orphan").submit("x")  # a queue nobody serves
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.completions.create(model="orphan", prompt="x")
    assert unavailable.value.status_code == 503
    conn = redis.Redis.from_url(server.url, decode_responses=True)
    register_worker(conn, "asleep", ["full"], ttl=60)  # live, but reading nothing
    wait_for(lambda: "full" in [m.id for m in client.models.list().data], what="the worker")
    Client(server.url, queue="full", max_queue_len=None).submit_many([{"prompt": "x"}] * 50)
    with pytest.raises(openai.RateLimitError, match="full"):
        client.completions.create(model="full", prompt="x")
    assert conn.xlen(queue_key("full")) == 50  # nothing was added


def test_api_keys(stack) -> None:
    _, gateway = stack
    keys = gateway.settings.api_key
    assert len(keys) == 2
    for key in keys:
        assert gateway.client(key).models.list().data
    with pytest.raises(openai.AuthenticationError, match="API key"):
        gateway.client("wrong").models.list()
    response = httpx.get(f"{gateway.base_url}/models")  # no key at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_disconnects_cancels_its_job(stack) -> None:
    server, gateway = stack
    jobs = Client(server.url, queue=QUEUE)
    long = {"model": QUEUE, "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
    stream = gateway.client().completions.create(
        **{k: v for k, v in long.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True},
        stream=True)
    first = next(iter(stream))
    stream.close()
    job = jobs.job(first.id.removeprefix("cmpl-") + "-0")
    result = job.result(timeout=30)
    assert result.status == "canceled" and result.outputs[0].finish_reason == "abort"
    assert len(result.outputs[0].token_ids) < 1500
    before = set(jobs.redis.scan_iter("pagedq:results:*"))
    # a plain request, given up by its client long before its 1,500 tokens are done (the
    # tiny model decodes them in about a second with the native decode step)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/completions", json=long, timeout=0.3,
                   headers={"Authorization": f"Bearer {gateway.settings.api_key[0]}"})
    wait_for(lambda: set(jobs.redis.scan_iter("pagedq:results:*")) - before, what="the job")
    (key,) = set(jobs.redis.scan_iter("pagedq:results:*")) - before
    plain = jobs.job(key.removeprefix("pagedq:results:")).result(timeout=30)
    assert plain.status == "canceled"


def test_settings_flags_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDQ_API_KEY", "a, b")
    monkeypatch.setenv("PAGEDQ_PORT", "9000")
    assert (parse_args([]).api_key, parse_args([]).port) == (["a", "b"], 9000)
    settings = parse_args(["--api-key", "c", "--api-key", "d,e", "--port", "9001"])
    assert (settings.api_key, settings.port) == (["c", "d", "e"], 9001)
    with pytest.raises(ValueError, match="port"):
        parse_args(["--port", "70000"])
