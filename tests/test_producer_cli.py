"""The ``pagedq`` CLI against a real redis-server, with redis_fixtures' FakeWorker as the worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from producer import Sampling
from producer.cli import SAMPLING_OPTIONS, build_parser, main
from producer.protocol import cancel_key, queue_key

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


def test_batch_refuses_a_bad_line_before_submitting(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "x", "top_p": 7}\n')
    with pytest.raises(SystemExit, match=r"in.jsonl:2: .*top_p"):
        main(["--redis-url", redis_url, "batch", str(tmp_path / "in.jsonl"), "-o",
              str(tmp_path / "out.jsonl")])
    assert not redis.Redis.from_url(redis_url).exists(queue_key("default"))


def test_cancel_and_status(redis_url: str, make_fake_worker, capsys: pytest.CaptureFixture) -> None:
    make_fake_worker(name="gpu-7")  # registered with the group and RQ, not consuming
    assert main(["--redis-url", redis_url, "cancel", "job-1"]) == 0
    assert redis.Redis.from_url(redis_url).ttl(cancel_key("job-1")) > 0
    assert main(["--redis-url", redis_url, "submit", "never answered", "--timeout", "0.2"]) == 1
    capsys.readouterr()
    assert main(["--redis-url", redis_url, "status", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["length"], stats["lag"], stats["pending"], stats["dead_letters"]) == (1, 1, 0, 0)
    assert [w["name"] for w in stats["workers"]] == ["gpu-7"]
    assert main(["--redis-url", redis_url, "status"]) == 0
    text = capsys.readouterr().out
    assert "1 not yet delivered" in text and "worker gpu-7: idle" in text
