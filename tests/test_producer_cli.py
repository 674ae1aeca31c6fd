"""The ``pagedq`` CLI against a real redis-server, with redis_fixtures' FakeWorker as the worker."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from producer import Client, Sampling
from producer.cli import SAMPLING_OPTIONS, build_parser, main
from producer.gateway.settings import settings_table
from producer.protocol import cancel_key, queue_key
from producer.rq_mirror import register_worker
from worker.redis_server import free_port

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test


def test_every_sampling_field_has_a_submit_option() -> None:
    assert sorted(SAMPLING_OPTIONS) == sorted(Sampling.model_fields)
    args = build_parser().parse_args(["submit", "x", "--top-k", "5", "--no-skip-special-tokens",
                                      "--stop", "a", "--stop", "b", "--stop-token-ids", "7"])
    assert (args.top_k, args.skip_special_tokens, args.stop, args.stop_token_ids) == \
        (5, False, ["a", "b"], [7])
    assert not hasattr(args, "temperature")  # absent options keep SamplingParams' defaults


def test_submit_streams_tokens_to_the_terminal(redis_url: str, fake_worker) -> None:
    """The console entry point, as a user runs it: text on stdout, job id and usage on stderr."""
    env = {**os.environ, "REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "producer.cli", "submit", "Hello", "--max-tokens",
                          "3", "--temperature", "0", "--stop", "zz"], capture_output=True,
                         text=True, env=env, timeout=30, check=True)
    assert out.stdout == " s0t0 s0t1 s0t2\n[length]\n"
    assert out.stderr.startswith("job ") and "3 completion tokens" in out.stderr


def test_submit_several_samples_and_chat(redis_url: str, fake_worker,
                                         capsys: pytest.CaptureFixture) -> None:
    assert main(["--redis-url", redis_url, "submit", "hi", "--chat", "--n", "2",
                 "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out == ("--- sample 0 ---\n s0t0 s0t1\n[length]\n"
                                       "--- sample 1 ---\n s1t0 s1t1\n[length]\n")


def test_submit_refuses_bad_values(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["--redis-url", redis_url, "submit", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert not redis.Redis.from_url(redis_url).exists(queue_key("default"))


def test_submit_beam_search_options(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["submit", "x", "--beam-width", "4", "--length-penalty",
                                      "0.5", "--early-stopping", "never"])
    assert (args.beam_width, args.length_penalty, args.early_stopping) == (4, 0.5, "never")
    assert main(["--redis-url", redis_url, "submit", "hi", "--beam-width", "4",
                 "--temperature", "0.7"]) == 2
    assert "beam search" in capsys.readouterr().err
    assert not redis.Redis.from_url(redis_url).exists(queue_key("default"))


def write_jobs(path: Path) -> None:
    lines = [{"prompt": "a", "max_tokens": 1}, {"prompt": "b", "n": 2, "max_tokens": 2}, None,
             {"messages": [{"role": "user", "content": "c"}]}, {"prompt": "please FAIL"},
             {"prompt": [1, 2], "max_tokens": 3, "priority": 1}]
    path.write_text("".join(("" if x is None else json.dumps(x)) + "\n" for x in lines))


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_writes_results_in_input_order(redis_url: str, fake_worker,
                                             tmp_path: Path) -> None:
    write_jobs(tmp_path / "in.jsonl")
    assert main(["--redis-url", redis_url, "batch", str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--max-in-flight", "3"]) == 0
    out = read_output(tmp_path / "out.jsonl")
    assert [r["line"] for r in out] == [1, 2, 4, 5, 6]  # line 3 is blank
    assert [o["text"] for o in out[1]["outputs"]] == [" s0t0 s0t1", " s1t0 s1t1"]
    assert out[2]["outputs"][0]["finish_reason"] == "length"
    assert out[3]["error"] == {"code": "invalid_request", "message": "the prompt asked to fail"}
    assert out[4]["outputs"][0]["token_ids"] == [0, 1, 2]


def test_batch_resumes_and_reattaches(redis_url: str, make_fake_worker, tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jobs(source)
    args = ["--redis-url", redis_url, "batch", str(source), "-o", str(output)]
    # interrupted: no worker, so the first jobs are submitted and never answered
    assert main([*args, "--max-in-flight", "2", "--timeout", "0.3"]) == 1
    conn = redis.Redis.from_url(redis_url)
    assert conn.xlen(queue_key("default")) == 2 and output.read_text() == ""
    line_1 = next(i for i in redis_ids(conn) if i.endswith("-1"))  # lanes submit in any order
    first = json.dumps({"line": 1, "id": line_1, "status": "finished", "outputs": []})
    output.write_text(first + '\n{"line": 2, "i')
    make_fake_worker().start()
    assert main(args) == 0
    out = read_output(output)
    assert [r["line"] for r in out] == [1, 2, 4, 5, 6]  # the torn line 2 was dropped and redone
    assert out[0]["outputs"] == [] and out[1]["outputs"][1]["text"] == " s1t0 s1t1"
    assert conn.xlen(queue_key("default")) == 5  # line 2's job was re-attached, not resubmitted
    assert main(args) == 0 and read_output(output) == out  # nothing left to do
    source.write_text(source.read_text() + '{"prompt": "new"}\n')
    with pytest.raises(SystemExit, match="results of another input"):
        main(args)


def redis_ids(conn: redis.Redis) -> list[str]:
    """The ids of the jobs in the default queue's stream, in order."""
    return [json.loads(f[b"job"])["id"] for _, f in conn.xrange(queue_key("default"))]


def test_batch_reports_every_bad_line_before_submitting(redis_url: str, tmp_path: Path) -> None:
    lines = ['{"prompt": "ok"}', '{"prompt": "x", "top_p": 7}', "[1]", "not json", "",
             '{"prompt": "y", "sampling": {"tempreature": 1}}',
             '{"custom_id": "r", "method": "POST", "url": "/v1/embeddings", "body": {}}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as refused:
        main(["--redis-url", redis_url, "batch", str(tmp_path / "in.jsonl"), "-o",
              str(tmp_path / "out.jsonl")])
    message = str(refused.value)
    for number, what in [(2, "top_p"), (3, "JSON object"), (4, "Expecting value"),
                         (6, "tempreature"), (7, "url")]:
        assert re.search(rf"in.jsonl:{number}: .*{what}", message), (number, message)
    assert "in.jsonl:1:" not in message and "5 bad lines: nothing was submitted" in message
    assert not redis.Redis.from_url(redis_url).exists(queue_key("default"))


def test_batch_takes_job_shaped_and_openai_lines(redis_url: str, fake_worker,
                                                 tmp_path: Path) -> None:
    job = {"id": "ignored", "v": 1, "prompt": "b", "sampling": {"n": 2, "max_tokens": 2},
           "priority": 1}
    openai_line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "any", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]}}
    (tmp_path / "in.jsonl").write_text(f"{json.dumps(job)}\n{json.dumps(openai_line)}\n")
    assert main(["--redis-url", redis_url, "batch", str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl")]) == 0
    job_out, openai_out = read_output(tmp_path / "out.jsonl")
    assert [o["text"] for o in job_out["outputs"]] == [" s0t0 s0t1", " s1t0 s1t1"]
    assert openai_out["custom_id"] == "r1" and openai_out["outputs"][0]["token_ids"] == [0, 1, 2]


def test_cancel_refuses_what_it_cannot_cancel(redis_url: str, fake_worker,
                                              capsys: pytest.CaptureFixture) -> None:
    conn = redis.Redis.from_url(redis_url)
    done = Client(redis_url).submit("hi", max_tokens=1)
    done.result(timeout=10)
    for job_id, code, why in [("has:colon", 2, "no job id"), ("x" * 129, 2, "no job id"),
                              ("unknown", 1, "no job unknown"), (done.id, 1, "finished")]:
        assert main(["--redis-url", redis_url, "cancel", job_id]) == code
        assert why in capsys.readouterr().err
    assert not conn.keys("pagedq:cancel:*")  # refusals leave nothing behind


def test_cancel_and_status(redis_url: str, make_fake_worker, capsys: pytest.CaptureFixture) -> None:
    make_fake_worker(name="gpu-7")  # registered with the group and RQ, not consuming
    assert main(["--redis-url", redis_url, "submit", "never answered", "--timeout", "0.2"]) == 1
    job_id = capsys.readouterr().err.split()[1]
    assert main(["--redis-url", redis_url, "cancel", job_id]) == 0
    assert f"cancel requested for {job_id} (queued)" in capsys.readouterr().out
    assert redis.Redis.from_url(redis_url).ttl(cancel_key(job_id)) > 0
    assert main(["--redis-url", redis_url, "status", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["length"], stats["lag"], stats["pending"], stats["dead_letters"]) == (1, 1, 0, 0)
    assert [w["name"] for w in stats["workers"]] == ["gpu-7"]
    assert main(["--redis-url", redis_url, "status"]) == 0
    text = capsys.readouterr().out
    assert "1 not yet delivered" in text and "worker gpu-7: idle" in text


def test_submit_streams_several_samples(redis_url: str, make_fake_worker) -> None:
    """``--n 2``: sample 0's tokens show while the job runs; the queue and Redis come from the
    worker's variables."""
    make_fake_worker(queue="cliq", delay=0.3).start()
    env = {**os.environ, "PAGEDQ_REDIS_URL": redis_url, "PAGEDQ_QUEUE": "cliq"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "producer.cli", "submit", "hi", "--n",
                             "2", "--max-tokens", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    job_id = proc.stderr.readline().decode().split()[1]
    seen = b""
    while b" s0t0" not in seen:
        seen += os.read(proc.stdout.fileno(), 64)
    assert Client(redis_url, queue="cliq").job(job_id).status() == "started"  # still running
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (seen + rest).decode() == ("--- sample 0 ---\n s0t0 s0t1 s0t2\n[length]\n"
                                      "--- sample 1 ---\n s1t0 s1t1 s1t2\n[length]\n")


def test_help_shows_defaults_and_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PAGEDQ_REDIS_URL", "redis://elsewhere:6390/1")
    monkeypatch.setenv("PAGEDQ_QUEUE", "gpu")
    args = build_parser().parse_args(["status"])
    assert (args.redis_url, args.queue) == ("redis://elsewhere:6390/1", "gpu")
    assert "(default: redis://elsewhere:6390/1)" in " ".join(build_parser().format_help().split())
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-tokens MAX_TOKENS default: 16" in text
    assert "--temperature TEMPERATURE default: 1.0" in text and "(default: 0)" in text


def test_an_unreachable_redis_fails_at_once() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(SystemExit, match="cannot reach Redis at redis://127.0.0.1"):
        main(["--redis-url", url, "status"])
    assert time.monotonic() - started < 5  # not the client's retries (13 s before)


def test_status_into_a_closed_pipe_exits_quietly(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    for i in range(1500):  # more lines than a pipe holds
        register_worker(conn, f"worker-{i:04}", ["default"], ttl=60)
    done = subprocess.run(["bash", "-c", "set -o pipefail; "
                           f"{sys.executable} -m producer.cli status | head -1"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PAGEDQ_REDIS_URL": redis_url})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("queue default: 0 entries")


def test_readme_documents_the_defaults() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "`max_tokens` defaults to 16" in readme
    assert settings_table() in readme  # the gateway's flags and variables
