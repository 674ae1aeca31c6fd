"""compose.yaml against the compose specification's JSON schema, and what the stack promises:
Redis with AOF, a healthcheck and a required password; one worker per GPU, each reserving its
own; a CPU profile; the dashboard on localhost with auth; the Dockerfile's pins equal the
worker extra's. (No Docker engine here: test_stack.py runs the services' commands.)"""

import ast
import copy
import re
import tomllib

import jsonschema
import pytest
from compose_file import ROOT, active, compose_schema, gpu_ids, load

from producer.gateway.settings import GatewaySettings
from worker.acl import placeholders
from worker.config import Settings

ENV = {"REDIS_PASSWORD": "s3cret", "DASHBOARD_PASSWORD": "dash", "PRODUCER_REDIS_PASSWORD": "pp",
       "WORKER_REDIS_PASSWORD": "ww", "DASHBOARD_REDIS_PASSWORD": "dd",
       "GATEWAY_REDIS_PASSWORD": "gg", "GATEWAY_API_KEYS": "k1,k2"}
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_compose_yaml_follows_the_specification() -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    for compose in (load(), load(ENV)):  # as written, and as interpolated
        assert not [e.message for e in validator.iter_errors(compose)]
    broken = copy.deepcopy(load(ENV))
    broken["services"]["worker"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    assert list(validator.iter_errors(broken))  # the schema does catch a wrong key


@pytest.mark.parametrize("missing", list(ENV))
def test_passwords_are_required(missing: str) -> None:
    with pytest.raises(ValueError, match=missing):
        load({k: v for k, v in ENV.items() if k != missing})


def test_redis_persists_and_checks_health() -> None:
    redis = load(ENV)["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--aclfile /data/users.acl" in command
    assert redis["environment"]["REDIS_PASSWORD"] == "s3cret"  # for the healthcheck
    render = redis["entrypoint"][2]  # fills in every placeholder of the ACL file
    assert "./worker/redis.acl:/etc/pagedq/redis.acl:ro" in redis["volumes"]
    for user in placeholders():
        assert f"s/@{user}_PASSWORD@/$" in render, user
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "redis-cli ping" in redis["healthcheck"]["test"][1]
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["ports"] == ["127.0.0.1:6379:6379"]


@pytest.mark.parametrize("gpus", range(1, 9))
def test_one_worker_per_gpu(gpus: int) -> None:
    compose = load(ENV)
    services = active(compose, f"gpus{gpus}") if gpus > 1 else active(compose)
    workers = {name: s for name, s in services.items() if name.startswith("worker")}
    assert sorted(gpu_ids(s)[0] for s in workers.values()) == [str(i) for i in range(gpus)]
    for service in workers.values():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["capabilities"], len(device["device_ids"])) == \
            ("nvidia", ["gpu"], 1)
        assert service["environment"]["PAGEDQ_DEVICE"] == "cuda"
        assert service["build"]["target"] == "worker"
    assert {"redis", "dashboard"} <= set(services)


def test_cpu_profile_runs_one_cpu_worker() -> None:
    services = load(ENV)["services"]
    cpu = [name for name, s in services.items() if "cpu" in s.get("profiles", [])]
    assert cpu == ["worker-cpu"]
    worker = services["worker-cpu"]
    assert not gpu_ids(worker) and "deploy" not in worker
    assert worker["environment"]["PAGEDQ_DEVICE"] == "cpu"
    assert "PAGEDQ_MODEL" not in worker["environment"]  # the default model


def test_worker_environment_names_real_settings() -> None:
    for name, service in load(ENV)["services"].items():
        for key in service.get("environment", {}) if name.startswith("worker") else []:
            assert key.removeprefix("PAGEDQ_").lower() in Settings.model_fields, key
        if name.startswith("worker"):
            assert service["environment"]["PAGEDQ_REDIS_URL"] == \
                "redis://worker:ww@redis:6379/0"  # its own Redis user


def test_dashboard_on_localhost_with_auth() -> None:
    dashboard = load(ENV | {"DASHBOARD_USERNAME": "ops"})["services"]["dashboard"]
    assert all(p.startswith("127.0.0.1:") for p in dashboard["ports"])
    env = dashboard["environment"]
    assert (env["RQ_DASHBOARD_USERNAME"], env["RQ_DASHBOARD_PASSWORD"]) == ("ops", "dash")
    assert env["RQ_DASHBOARD_REDIS_URL"] == "redis://dashboard:dd@redis:6379/0"
    command = dashboard["command"]
    assert command[0] == "rq-dashboard" and {"--json", "--disable-delete"} <= set(command)
    assert command[command.index("--config") + 1] == "worker.dashboard_config"
    assert dashboard["build"]["target"] == "dashboard"


def test_dockerfile_pins_the_worker_extras_versions() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["worker"]
    pins = dict(re.findall(r"\b(rq|rq-dashboard|six)==([\w.]+)", DOCKERFILE))
    assert f"rq=={pins['rq']}" in extra and f"rq-dashboard=={pins['rq-dashboard']}" in extra
    [six] = [req for req in extra if req.startswith("six")]
    assert six == "six>=1.16" and tuple(map(int, pins["six"].split("."))) >= (1, 16)


def test_dockerfile_stages() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    by_name = {s.split("\n")[0].split(" AS ")[1].strip(): s for s in stages}
    assert set(by_name) == {"worker", "dashboard", "gateway"}
    assert stages[-1] is by_name["worker"]  # the default target
    assert re.search(r"^ARG CUDA_BASE=nvidia/cuda:[\w.-]+-runtime-", DOCKERFILE, re.M)
    assert by_name["worker"].startswith("${CUDA_BASE}")
    assert "pip install '.[worker,cuda]'" in by_name["worker"]
    for stage in by_name.values():
        users = re.findall(r"^USER (\S+)", stage, re.M)
        assert users and users[-1] not in ("root", "0")
    assert re.search(r'HEALTHCHECK .*\n?.*CMD \["python", "-m", "worker.healthcheck", "healthz"\]',
                     by_name["worker"])


def test_docker_context_holds_what_the_dockerfile_copies() -> None:
    """Every COPY source exists and .dockerignore (everything out, then exceptions) keeps it."""
    kept = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")]
    sources = [src for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M)
               for src in line.split()[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src == k or src.startswith(k + "/") for k in kept), src


def test_dashboard_config_needs_only_rq_dashboard() -> None:
    """The dashboard image holds rq-dashboard and worker/dashboard_config.py, not pagedq."""
    tree = ast.parse((ROOT / "worker" / "dashboard_config.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= {"flask", "rq_dashboard"}
    assert (ROOT / "worker" / "__init__.py").read_text() == ""


def test_gateway_on_localhost_with_keys_from_the_environment(monkeypatch) -> None:
    gateway = load(ENV)["services"]["gateway"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]
    assert gateway["build"]["target"] == "gateway"
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert (settings.api_key, settings.host) == (["k1", "k2"], "0.0.0.0")
    assert settings.redis_url == "redis://gateway:gg@redis:6379/0"
    stage = DOCKERFILE.split("AS gateway")[1].split("FROM ")[0]
    assert "pip install '.[gateway]'" in stage and 'ENTRYPOINT ["pagedq-gateway"]' in stage


def test_triton_only_where_cuda_is() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert not any(req.startswith("triton") for req in extras["worker"])  # CPU installs
    assert any(req.startswith("triton") for req in extras["cuda"])
    assert any(req.startswith("triton") for req in extras["dev"])  # the interpreter tests
