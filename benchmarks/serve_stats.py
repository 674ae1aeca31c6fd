"""What ``serve.py`` reports of a system serving its traces: per trace TTFT, TPOT and ITL
percentiles and throughput; per rate, whether the system keeps up with it."""

from typing import Any

from common import percentile_ms


def keeps_up(by_rate: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Per rate, whether the system keeps up with it: its capacity, the request rate it served
    in the burst (every request sent at once: a full queue throughout), is at least the rate;
    None for the burst itself, and where no burst ran. Until session 52 the test was a TTFT
    that did not grow over the trace (the last quarter's median within 2x the first's + 0.25
    s): on a Zen 4 at 4 req/s it passed vLLM, whose burst capacity was 1.81 req/s, as its
    first quarter had already fallen behind, and failed pagedq, whose capacity was 2.53. Nor
    do finish times alone tell: a system that batches every request it holds finishes them in
    bunches (the middle half of vLLM's finishes at 4 req/s came at 0.8x its sends' rate or
    faster)."""
    capacity = by_rate.get("burst", {}).get("req_s")
    return {rate: None if rate == "burst" or capacity is None else float(rate) <= capacity
            for rate in by_rate}


def summarize(answers: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """``answers``: each request's send time, its chunks' (arrival time, tokens) and its text;
    ``wall``: the trace's seconds from its first send to its last answer."""
    ttft = [a["times"][0][0] - a["sent"] for a in answers]
    tpot, itl = [], []
    for a in answers:
        stamps = [t for t, _ in a["times"]]
        if a["tokens"] > 1:
            tpot.append((stamps[-1] - stamps[0]) / (a["tokens"] - 1))
        for (before, _), (at, k) in zip(a["times"], a["times"][1:], strict=False):
            itl += [(at - before) / k] * k
    tokens = sum(a["tokens"] for a in answers)
    return {"ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
            "tpot_p50_ms": percentile_ms(tpot, 50), "itl_p50_ms": percentile_ms(itl, 50),
            "itl_p99_ms": percentile_ms(itl, 99), "req_s": len(answers) / wall,
            "tok_s": tokens / wall, "wall_s": wall,
            "texts": [a["text"] for a in answers]}
