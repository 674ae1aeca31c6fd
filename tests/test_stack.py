"""The compose stack without Docker (tests/stack_processes.py runs each service's own command,
arguments and environment from compose.yaml as processes, and a run of jobs); then /metrics,
the probes, the dashboard's JSON routes and its page in headless Chromium. Set
``PAGEDQ_SCREENSHOT=docs/dashboard.png`` to refresh the README's picture."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import redis
from browser import AuthProxy, chromium
from compose_file import ROOT
from redis.backoff import NoBackoff
from redis.retry import Retry
from stack_processes import ENV, USER, http, running_stack
from test_metrics import value


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, smollm2: Path):
    """Runs the stack and a run of jobs once (the worker on smollm2, the default model);
    yields what the tests check."""
    with running_stack(tmp_path_factory.mktemp("stack")) as out:
        yield out


def test_redis_runs_with_the_compose_arguments(stack) -> None:
    assert stack.redis_config["appendonly"] == "yes"
    assert stack.redis_config["appendfsync"] == "everysec"
    assert stack.redis_health == [0, 1]  # the compose healthcheck, right and wrong password
    with pytest.raises((redis.AuthenticationError, redis.ResponseError), match="(?i)auth"):
        redis.Redis(host="127.0.0.1", port=stack.redis_port,  # no password; no retries
                    retry=Retry(NoBackoff(), 0)).ping()


def test_worker_metrics_count_the_run(stack) -> None:
    m, jobs = stack.metrics, stack.jobs
    assert {o: value(m, "pagedq_jobs_total", outcome=o)
            for o in ("finished", "failed", "canceled", "dead_letter")} == \
        {"finished": jobs["n_finished"], "failed": 1, "canceled": 1, "dead_letter": 0}
    [ready] = [e for e in stack.log if e["event"] == "worker ready"]
    assert value(m, "pagedq_kv_pool_blocks") == ready["kv_blocks_total"] > 0
    assert value(m, "pagedq_time_to_first_token_seconds_count") == jobs["n_finished"] + 1
    assert value(m, "pagedq_inter_token_latency_seconds_count") > 0
    assert value(m, "pagedq_prefix_cache_queries_total") > 0
    assert (value(m, "pagedq_queue_depth", queue="default"),
            value(m, "pagedq_queue_pending", queue="default")) == (0, 0)
    assert stack.probes == {"healthz": (200, "ok\n"), "readyz": (200, "ok\n")}
    assert stack.healthcheck.returncode == 0, stack.healthcheck.stderr
    assert stack.worker_exit == 0


def dashboard_get(stack, path: str, method: str = "GET") -> tuple[int, str]:
    return http(stack.dashboard + path, method, auth=(USER, ENV["DASHBOARD_PASSWORD"]))


def queue_counts(stack) -> dict[str, int]:
    status, body = dashboard_get(stack, "/0/data/queues.json")
    assert status == 200
    [queue] = json.loads(body)["queues"]
    assert queue["name"] == "default"
    return {"queued": queue["count"], **{k: queue[f"{k}_job_registry_count"] for k in
                                         ("started", "finished", "failed", "canceled")}}


def test_dashboard_shows_the_run_and_refuses_requeue_and_delete(stack) -> None:
    expected = {"queued": 2, "started": 0, "finished": stack.jobs["n_finished"], "failed": 1,
                "canceled": 1}
    assert http(stack.dashboard + "/0/data/queues.json")[0] == 401  # basic auth
    assert queue_counts(stack) == expected
    failed = stack.jobs["failed"]
    status, body = dashboard_get(stack, f"/0/data/job/{failed}.json")
    assert status == 200 and json.loads(body)["status"] == "failed"
    for path, method in [(f"/job/{failed}/requeue", "POST"), ("/requeue/default", "GET"),
                         ("/requeue/default", "POST"), (f"/job/{failed}/delete", "POST"),
                         ("/queue/default/failed/empty", "POST"),
                         ("/queue/default/queued/empty", "POST")]:
        status, body = dashboard_get(stack, path, method)
        assert status == 403 and "refused by pagedq" in body, path
    assert queue_counts(stack) == expected  # nothing moved


def cells(row_html: str) -> list[str]:
    return [re.sub(r"<[^>]+>|\s+", "", td) for td in re.findall(r"<td[^>]*>(.*?)</td>",
                                                                row_html, re.S)]


def test_dashboard_page_in_chromium(stack) -> None:
    """The queues page as a browser renders it (its table is filled by JavaScript from
    queues.json): the default queue's row has the run's counts; the screenshot is kept."""
    proxy = AuthProxy(stack.dashboard, (USER, ENV["DASHBOARD_PASSWORD"]))
    try:
        check_page(stack, proxy.url)
    finally:
        proxy.close()


def check_page(stack, url: str) -> None:
    dom = chromium("--virtual-time-budget=8000", "--dump-dom", f"{url}/0/view/queues",
                   tmp=stack.tmp)
    dom = re.sub(r"<script.*?</script>", "", dom, flags=re.S)  # the row template is one
    rows = re.findall(r'<tr data-role="queue">(.*?)</tr>', dom, re.S)
    assert [cells(row) for row in rows] == [
        # queue, queued, deferred, scheduled, started, finished, failed, canceled
        ["default", "2", "0", "0", "0", str(stack.jobs["n_finished"]), "1", "1"]]
    jobs = chromium("--virtual-time-budget=8000", "--dump-dom",
                    f"{url}/0/view/jobs/default/failed/8/asc/1", tmp=stack.tmp)
    assert stack.jobs["failed"] in jobs and "display: none !important" in jobs
    shot = stack.tmp / "dashboard.png"
    chromium("--virtual-time-budget=8000", "--window-size=1280,560", "--hide-scrollbars",
             f"--screenshot={shot}", f"{url}/0/view/queues", tmp=stack.tmp)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("PAGEDQ_SCREENSHOT"):
        shutil.copyfile(shot, ROOT / os.environ["PAGEDQ_SCREENSHOT"])
