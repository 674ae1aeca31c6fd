"""compose.yaml as ``docker compose`` reads it: YAML (anchors and merge keys resolved), then
variables interpolated from an environment (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?error}``, ``${VAR?error}``, ``$$``), then profiles. Shared by test_compose.py (the file
itself) and test_stack.py (the services' commands run as processes)."""

import json
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def compose_schema() -> dict[str, Any]:
    """The compose specification's JSON schema, as check-jsonschema ships it (vendored from
    the compose-spec repository's schema/compose-spec.json)."""
    vendor = files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with compose's variable syntax replaced, recursively; a missing required
    variable raises ValueError with its message."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def replace(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name, op, arg = m.group(2) or m.group(5), m.group(3) or "", m.group(4) or ""
        current = env.get(name)
        missing = not current if op.startswith(":") else current is None
        if missing and op.endswith("-"):
            return arg
        if missing and op.endswith("?"):
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return current or ""

    return _VARIABLE.sub(replace, value)


def load(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml, interpolated from ``env`` unless it is None (raw)."""
    raw = yaml.safe_load(COMPOSE.read_text())
    return raw if env is None else interpolate(raw, env)


def active(compose: dict[str, Any], *profiles: str) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile P ... up`` starts."""
    return {name: s for name, s in compose["services"].items()
            if not s.get("profiles") or set(s["profiles"]) & set(profiles)}


def gpu_ids(service: dict[str, Any]) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return [i for d in devices.get("devices", []) for i in d.get("device_ids", [])]
