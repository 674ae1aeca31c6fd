"""The README's operator part cannot drift from the code: its settings table is the one
``worker.config.settings_table()`` generates, and its metrics table lists exactly what a worker
exposes."""

import re

from compose_file import ROOT

from worker.config import Settings, settings_table
from worker.metrics import Metrics

pytest_plugins = ["redis_fixtures"]  # a real redis-server per test
README = (ROOT / "README.md").read_text()


def test_settings_table_is_current() -> None:
    block = re.search(r"<!-- settings:.*?-->\n(.*?)\n<!-- /settings -->", README, re.S)
    assert block, "the README lost its settings block"
    expected = settings_table()
    assert block.group(1) == expected, f"paste this into the README:\n{expected}"
    for name in Settings.model_fields:
        assert f"`PAGEDQ_{name.upper()}`" in block.group(1)


def test_metrics_table_lists_every_metric(redis_url: str) -> None:
    metrics = Metrics(redis_url, "default")
    try:
        exposed = set()
        for family in metrics.registry.collect():
            suffix = "_total" if family.type == "counter" else ""
            exposed.add(family.name + suffix)
    finally:
        metrics.close()
    section = README.split("### Metrics", 1)[1].split("###", 1)[0]
    documented = set(re.findall(r"^\| `(pagedq_\w+)", section, re.M))
    assert documented == exposed
    assert len(exposed) == 17


def test_no_leftover_promise() -> None:
    assert "still to come" not in README
