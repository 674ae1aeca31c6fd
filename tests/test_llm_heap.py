"""``LLM.generate`` keeps loading's long-lived objects out of the garbage collector's sight
only while it runs (``engine.llm.heap_frozen``), and leaves a host's own freeze alone."""

import gc
import weakref

from engine import SamplingParams


def test_generate_hides_the_heap_from_the_collector_only_while_it_runs(tiny_llama,
                                                                       make_llm) -> None:
    """During ``generate`` the objects alive before it are frozen (no full collection walks
    them mid-run); after it they are the collector's again (a cycle made before is collected),
    and a process that froze its own heap keeps its freeze."""
    llm = make_llm(tiny_llama)
    assert gc.get_freeze_count() == 0
    seen = []
    real_step = llm.engine.step
    llm.engine.step = lambda: seen.append(gc.get_freeze_count()) or real_step()

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    gone = weakref.ref(node)
    del node
    llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
        # still the host's freeze (frozen objects freed meanwhile leave it), not undone
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
