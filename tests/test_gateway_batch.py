"""The Batch API with the official ``openai`` SDK: files (upload, retrieve, content, list,
delete, the size limit), a batch whose input has bad lines (each one reported), a cancel, and a
batch that outlives a worker killed mid-batch and a gateway restart, every line answered once
with LLM.generate's text."""

import io
import json
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from test_gateway import QUEUE
from test_worker import check_stream, events_of, reference, wait_for
from test_worker_recovery import chunks_in, spawn

from producer.core import new_job
from producer.gateway.batch_runner import line_id
from producer.gateway.schemas import CompletionRequest

pytest_plugins = ["redis_fixtures", "gateway_fixtures"]  # real servers; `stack` shared


def jsonl(lines: list[Any]) -> io.BytesIO:
    return io.BytesIO("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                              for x in lines).encode())


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in (
            "completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
    return batch


def test_files(stack) -> None:
    client = stack[1].client()
    uploaded = client.files.create(file=("in.jsonl", jsonl([{"a": 1}])), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (9, "in.jsonl", "batch")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).text == '{"a": 1}\n'
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", jsonl(["{}"])), purpose="fine-tune")
    big = io.BytesIO(b"x" * ((1 << 20) + 1))
    with pytest.raises(openai.APIStatusError, match="limit") as too_big:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert too_big.value.status_code == 413


def test_a_batch_with_bad_lines_fails_naming_each(stack) -> None:
    client = stack[1].client()
    good = {"model": QUEUE, "prompt": "hi", "max_tokens": 2}
    lines = [line("a", good), "not json", line("b", good, url="/v1/chat/completions"),
             line("a", good), line("c", good | {"temperature": -1}), "",
             line("d", good | {"stream": True}), line("e", good | {"model": "nope"})]
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_request"), (3, "invalid_request"), (4, "invalid_request"),
        (5, "invalid_request"), (7, "invalid_request"), (None, "model_not_found")]
    assert "temperature" in batch.errors.data[3].message
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_cancel_a_batch(stack) -> None:
    client = stack[1].client()
    body = {"model": QUEUE, "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
    upload = client.files.create(file=("in.jsonl", jsonl([line(f"r{i}", body)
                                                          for i in range(3)])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h", metadata={"run": "cancel"})
    assert batch.status == "in_progress" and batch.request_counts.total == 3
    conn = redis.Redis.from_url(stack[0].url, decode_responses=True)
    wait_for(lambda: chunks_in(conn, line_id(batch.id, "r0") + "-0"), what="the batch running")
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.metadata == {
        "run": "cancel"}
    rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["r0", "r1", "r2"]
    choices = [r["response"]["body"]["choices"][0] for r in rows]
    assert all(c["finish_reason"] == "abort" and len(c["text"]) for c in choices)
    assert batch.id in [b.id for b in client.batches.list()]


def test_a_batch_outlives_a_killed_worker_and_a_gateway_restart(redis_url, tiny_llama: Path,
                                                                make_gateway) -> None:
    doomed = spawn(redis_url, tiny_llama, "doomed")
    gateway = make_gateway(redis_url, batch_lease_s=1.5)
    client = gateway.client()
    bodies = [{"model": QUEUE, "prompt": f"Job {i} of the batch", "max_tokens": 60 + 10 * i,
               "temperature": 0, "ignore_eos": True} for i in range(6)]
    bodies.append({"model": QUEUE, "prompt": ["two", "prompts"], "max_tokens": 50, "n": 2,
                   "temperature": 0})
    upload = client.files.create(file=("in.jsonl", jsonl([line(f"req-{i}", b) for i, b in
                                                          enumerate(bodies)])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    job_ids = [line_id(batch.id, f"req-{i}") + "-0" for i in range(6)]
    wait_for(lambda: all(chunks_in(conn, j) >= 3 for j in job_ids), timeout=90,
             what="every job under way")
    gateway.stop()  # as a restart: its lines are in the queue or running
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    heir = spawn(redis_url, tiny_llama, "heir")
    try:
        gateway.start()
        batch = wait_batch(client, batch.id)
        output = client.files.content(batch.output_file_id).text
    finally:
        gateway.stop()
        heir.kill()
        heir.wait(10)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (7, 0)
    rows = [json.loads(x) for x in output.splitlines()]
    assert [r["custom_id"] for r in rows] == [f"req-{i}" for i in range(7)]  # each line once
    requests = [CompletionRequest(**body) for body in bodies]
    references = iter(reference(tiny_llama, [new_job(QUEUE, **spec) for request in requests
                                             for spec in request.specs()]))
    for row, request in zip(rows, requests, strict=True):
        refs = [next(references) for _ in request.specs()]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        texts = [c["text"] for c in row["response"]["body"]["choices"]]
        assert texts == [o.text for ref in refs for o in ref.outputs]
        for i, ref in enumerate(refs):  # no token made twice, none missing, across the kill
            check_stream(events_of(conn, f"{line_id(batch.id, row['custom_id'])}-{i}"), ref)
