"""The scheduler's admission order: priority, then the shortest prefill first among the waiting
sequences that arrived together, arrival beyond that (engine/scheduler.py)."""

from engine import scheduler as scheduler_module
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import SHORTEST_FIRST_WINDOW_S, Scheduler
from engine.sequence import Sequence


def make_scheduler(budget: int = 4096, blocks: int = 256) -> Scheduler:
    return Scheduler(BlockManager(blocks, 16, enable_prefix_caching=True), max_num_seqs=64,
                     max_num_batched_tokens=budget)


def add(scheduler: Scheduler, name: str, length: int, arrival: float = 0.0,
        priority: int = 0) -> Sequence:
    # distinct tokens per request: no prefix cache hit between them
    first = 1000 * (len(scheduler.waiting) + len(scheduler.running) + 1)
    seq = Sequence(name, list(range(first, first + length)), SamplingParams(), priority, arrival)
    scheduler.add(seq)
    return seq


def admitted(scheduler: Scheduler) -> list[tuple[str, int]]:
    out = scheduler.schedule()
    return [(s.request_id, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)]


def test_a_burst_is_admitted_shortest_first() -> None:
    s = make_scheduler()
    for i, (name, length) in enumerate([("a", 200), ("b", 50), ("c", 120), ("d", 80)]):
        add(s, name, length, arrival=0.01 * i)
    assert admitted(s) == [("b", 50), ("d", 80), ("c", 120), ("a", 200)]


def test_the_budget_ends_on_a_chunk_of_the_next_shortest() -> None:
    s = make_scheduler(budget=140)
    for name, length in [("a", 200), ("b", 50), ("c", 120), ("d", 80)]:
        add(s, name, length)
    assert admitted(s) == [("b", 50), ("d", 80), ("c", 10)]
    assert [q.request_id for q in s.waiting] == ["a"]


def test_a_prompt_is_passed_only_by_those_that_arrived_within_the_window() -> None:
    s = make_scheduler()
    add(s, "long", 300, arrival=0.0)
    add(s, "soon", 20, arrival=SHORTEST_FIRST_WINDOW_S / 2)
    add(s, "late", 10, arrival=SHORTEST_FIRST_WINDOW_S * 2)
    assert [name for name, _ in admitted(s)] == ["soon", "long", "late"]


def test_priority_comes_before_length() -> None:
    s = make_scheduler()
    add(s, "short", 20, priority=1)
    add(s, "urgent", 300, priority=-1)
    add(s, "normal", 100, priority=0)
    assert [name for name, _ in admitted(s)] == ["urgent", "normal", "short"]


def test_the_scan_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "SHORTEST_FIRST_SCAN", 2)
    s = make_scheduler(budget=100)
    add(s, "a", 90)
    add(s, "b", 80)
    add(s, "c", 5)  # third in arrival order: past the first scan, within the second
    assert admitted(s) == [("b", 80), ("c", 5), ("a", 15)]


def test_a_sequence_that_cannot_fit_blocks_admission() -> None:
    # 4 blocks of 16: the shortest (40 tokens, 3 blocks) fits, then the next shortest (50
    # tokens, 4 blocks) does not, and admission stops there rather than passing it
    s = make_scheduler(blocks=4)
    add(s, "big", 60)
    add(s, "mid", 50)
    add(s, "small", 40)
    assert admitted(s) == [("small", 40)]
    assert [q.request_id for q in s.waiting] == ["big", "mid"]
