"""Fuzzing the job stream (hypothesis): 1,200 mutated and random entries, written straight
into the stream. Every entry gets exactly one last event on the stream its reader would
watch (its job id when one can be read from it, else its entry id): an ``error`` for every
invalid entry; good jobs sent between them give LLM.generate's tokens; the worker keeps
serving and holds nothing pending at the end."""

import json
import re
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_worker import (
    QUEUE,
    events_of,
    one_torch_thread,  # noqa: F401
    reference,
    serving,
)

from producer import Client
from producer.core import new_job
from producer.protocol import JOB_FIELD, End, Error, Job, queue_key

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
EXAMPLES, PER_EXAMPLE = 40, 30  # 1,200 entries (a few KB of choices per example)
ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
TOP_KEYS = ["id", "v", "queue", "prompt", "messages", "sampling", "priority", "deadline",
            "created_at", "colour"]
SAMPLING_KEYS = ["n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                 "stop", "stop_token_ids", "seed", "logprobs", "ignore_eos", "penalty"]
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6)
mutation = st.one_of(
    st.tuples(st.just("del"), st.sampled_from(TOP_KEYS)),
    st.tuples(st.just("top"), st.sampled_from(TOP_KEYS), values),
    st.tuples(st.just("sampling"), st.sampled_from(SAMPLING_KEYS), values),
    st.tuples(st.just("cut"), st.integers(0, 80)),
)
entry = st.one_of(
    st.tuples(st.just("job"), st.lists(mutation, min_size=1, max_size=3)),
    st.tuples(st.just("raw"), st.dictionaries(text.filter(bool), text, max_size=3)),
)


def build(k: int, kind: str, body: Any) -> dict[str, str]:
    """The fields of one entry: a good job (id ``fz{k}``) with ``body``'s mutations, or raw
    fields."""
    if kind == "raw":
        return body
    job: dict[str, Any] = {"id": f"fz{k}", "prompt": "hello there",
                           "sampling": {"max_tokens": 2, "temperature": 0.0}}
    raw = None
    for m in body:
        if m[0] == "del":
            job.pop(m[1], None)
        elif m[0] == "top":
            job[m[1]] = m[2]
        elif m[0] == "sampling":
            job["sampling"] = (job.get("sampling") if isinstance(job.get("sampling"), dict)
                               else {}) | {m[1]: m[2]}
        else:
            raw = json.dumps(job)[:m[1]]
    return {JOB_FIELD: raw if raw is not None else json.dumps(job)}


def target(entry_id: str, fields: dict[str, str]) -> tuple[str, bool]:
    """The stream an entry's last event goes to, and whether the entry is a valid job."""
    raw = fields.get(JOB_FIELD)
    if raw is None:
        return entry_id, False
    try:
        return Job.model_validate_json(raw).id, True
    except ValidationError:
        pass
    try:
        job_id = json.loads(raw).get("id")
    except (ValueError, AttributeError):
        return entry_id, False
    return (job_id, False) if isinstance(job_id, str) and ID.match(job_id) else (entry_id, False)


def test_fuzzed_entries_each_get_their_error_and_nothing_else_is_disturbed(
        redis_url, tiny_llama) -> None:
    client = Client(redis_url, queue=QUEUE)
    canaries = [{"prompt": f"canary {i}", "max_tokens": 8, "temperature": 0.0,
                 "job_id": f"canary{i}"} for i in range(EXAMPLES)]
    expected = reference(tiny_llama, [new_job(QUEUE, **spec) for spec in canaries])
    seen: dict[str, bool] = {}  # target stream -> valid job
    counter = iter(range(10**9))
    start = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(entry, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def fuzz(entries: list) -> None:
        with client.redis.pipeline(transaction=False) as pipe:
            built = [build(next(counter), kind, body) for kind, body in entries]
            for fields in built:
                pipe.xadd(queue_key(QUEUE), fields or {"": ""})
            ids = pipe.execute()
        for entry_id, fields in zip(ids, built, strict=True):
            stream, valid = target(entry_id, fields or {"": ""})
            if stream not in seen:  # an id two entries share has no single answer: skip
                seen[stream] = valid
        canary = client.submit(**canaries[len(seen) % EXAMPLES] | {
            "job_id": f"canary-{next(counter)}"})
        assert canary.result(timeout=60).outputs[0].token_ids == \
            expected[len(seen) % EXAMPLES].outputs[0].token_ids

    with serving(redis_url, tiny_llama, "fuzzed", max_model_len=64) as worker:
        fuzz()
        deadline = time.monotonic() + 120
        last: dict[str, Any] = {}
        # an entry whose job id an earlier one used stays pending until the worker reclaims it
        # from itself (reclaim_idle_ms) and finds its stream ended: wait for that too
        while ((len(last) < len(seen) or client.stats()["pending"])
               and time.monotonic() < deadline):
            for stream in seen.keys() - last.keys():
                events = events_of(client.redis, stream)
                if events and isinstance(events[-1], End | Error):
                    last[stream] = events
            time.sleep(0.2)
        assert client.stats()["pending"] == 0
        assert worker.driver.jobs == {}
    invalid = [s for s, valid in seen.items() if not valid]
    print(f"\nfuzz: {next(counter)} entries and canaries, {len(seen)} distinct streams, "
          f"{len(invalid)} invalid, all answered in {time.monotonic() - start:.1f} s")
    assert len(seen) >= 1000
    assert seen.keys() == last.keys(), "entries without a last event"
    for stream in invalid:
        assert isinstance(last[stream][-1], Error) and len(last[stream]) == 1, stream
    for stream, valid in seen.items():
        if valid:  # a mutation can leave a valid job: it ran, or the engine refused it
            assert sum(isinstance(e, End | Error) for e in last[stream]) == 1
