"""Beam search through the queue: a job with beam_width gets the engine's ranked hypotheses as
samples 0.., best first, each `done` with its cum_logprob, and nothing before them; it runs
beside sampling jobs; the RQ record's result and the worker's metrics carry it; a canceled
beam job frees its blocks."""

import redis
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from test_worker import KV_BLOCKS, QUEUE, events_of, one_torch_thread, serving, wait_for  # noqa: F401

from engine import LLM, BeamSearchParams
from producer import Client
from producer.protocol import Chunk, Done, End

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def test_beam_jobs(redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    prompts = ["The queue worker pulls a job", "Each sequence owns a block table"]
    with serving(redis_url, tiny_llama) as worker:
        beams = [client.submit(p, beam_width=4, max_tokens=12, length_penalty=0.5)
                 for p in prompts]
        sampled = client.submit(prompts[0], n=2, temperature=0.8, seed=3, max_tokens=12)
        canceled = client.submit(prompts[1], beam_width=8, max_tokens=400, ignore_eos=True)
        wait_for(lambda: canceled.id in worker.engine.requests, what="the wide search to start")
        canceled.cancel()
        assert canceled.result(timeout=30).status == "canceled"
        results = [b.result(timeout=60) for b in beams]
        assert sampled.result(timeout=60).status == "finished"
        assert worker.engine.stats()["beam_searches"] == len(beams)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=KV_BLOCKS)
    expected = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12,
                                                         length_penalty=0.5))
    rq_conn = redis.Redis.from_url(redis_url)
    for prompt, handle, result, want in zip(prompts, beams, results, expected, strict=True):
        assert [o.index for o in result.outputs] == [0, 1, 2, 3]
        start = len(llm.tokenizer.encode(prompt))
        assert [o.token_ids for o in result.outputs] == [s.tokens[start:] for s in want.sequences]
        assert [o.text for o in result.outputs] == [s.text for s in want.sequences]
        assert [o.cum_logprob for o in result.outputs] == [s.cum_logprob
                                                           for s in want.sequences]
        events = events_of(client.redis, handle.id)
        # Nothing streams before the search is done: every chunk comes with its done.
        assert [type(e) for e in events] == [Chunk, Done] * 4 + [End]
        record = RQJob.fetch(handle.id, connection=rq_conn, serializer=JSONSerializer)
        assert [o["cum_logprob"] for o in record.return_value()["outputs"]] == [
            o.cum_logprob for o in result.outputs]
