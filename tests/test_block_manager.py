"""The block manager on its own: ref counts, copy-on-write, chained-hash prefix caching and LRU
eviction of free cached blocks."""

import random

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def _seq(tokens: list[int], n: int = 1) -> Sequence:
    return Sequence("r", tokens, SamplingParams(n=n))


def _compute(bm: BlockManager, seq: Sequence, num: int) -> None:
    seq.num_computed_tokens += num
    bm.register_computed(seq)


def test_allocate_and_free_restore_the_pool() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = _seq(list(range(10)))
    assert bm.allocate(seq, 6) == 6
    assert len(seq.block_table) == 2
    _compute(bm, seq, 6)
    assert bm.append_slots(seq, 4, [])
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_refuses_without_changing_anything() -> None:
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    seq = _seq(list(range(12)))
    assert bm.allocate(seq, 12) == 0
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(seq, 8) == 8  # a smaller chunk fits


def test_fork_shares_and_copy_on_write_copies_the_partial_block() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    parent = _seq(list(range(6)), n=3)  # one full block and a partial one
    bm.allocate(parent, 6)
    _compute(bm, parent, 6)
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        bm.fork(parent, child)
    full, partial = parent.block_table
    assert bm.blocks[full].ref_count == 3 and bm.blocks[partial].ref_count == 3
    copies: list[tuple[int, int]] = []
    for seq in [parent, *children]:
        seq.token_ids.append(99)
        assert bm.append_slots(seq, 1, copies)
    # the first two writers copy the shared block; the last one owns it and writes in place
    assert [src for src, _ in copies] == [partial, partial]
    assert children[1].block_table == [full, partial]
    assert len({s.block_table[1] for s in [parent, *children]}) == 3
    assert bm.blocks[full].ref_count == 3 and bm.blocks[partial].ref_count == 1
    for seq in [parent, *children]:
        bm.free(seq)
    assert bm.num_free_blocks == 10


def test_prefix_hits_use_the_chain_and_leave_a_token_to_compute() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    first = _seq(list(range(12)))
    bm.allocate(first, 12)
    _compute(bm, first, 12)
    bm.free(first)
    same = _seq(list(range(12)))
    assert bm.allocate(same, 100) == 4  # two blocks hit; the last block is recomputed
    assert same.num_cached_tokens == 8
    bm.free(same)
    # the same second block after a different first block is not a hit: hashes are chained
    other = _seq([50, 51, 52, 53] + list(range(4, 12)))
    bm.allocate(other, 100)
    assert other.num_cached_tokens == 0
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 36


def test_blocks_are_cached_only_once_computed() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    a = _seq(list(range(12)))
    bm.allocate(a, 12)  # allocated, not yet computed
    b = _seq(list(range(12)))
    bm.allocate(b, 12)
    assert b.num_cached_tokens == 0
    _compute(bm, a, 12)
    _compute(bm, b, 12)  # b's identical blocks stay out of the cache: a's are there
    assert len(bm.cached) == 3


def test_eviction_is_least_recently_freed_first() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    _compute(bm, a, 5)  # blocks [1,2] and [3,4] are cached
    bm.free(a)  # freed tail first: the head block is evicted last
    b = _seq([9, 9, 9, 9, 9])
    assert bm.allocate(b, 5) == 5  # takes the never-used block, then a's tail blocks
    c = _seq([1, 2, 3, 4, 7])
    bm.free(b)
    bm.allocate(c, 5)
    assert c.num_cached_tokens == 2  # [1, 2] survived; [3, 4] was evicted


def test_a_call_takes_the_least_recently_freed_blocks_in_ascending_order() -> None:
    """The blocks evicted are the LRU ones, as before; only their order in the table is by id,
    so that a sequence's KV runs forward through the pool once the queue is shuffled."""
    bm = BlockManager(10, 2, enable_prefix_caching=True)
    a = _seq(list(range(20)))
    bm.allocate(a, 20)
    _compute(bm, a, 20)
    bm.free(a)  # tail first: the queue is now 9, 8, ..., 0
    assert list(bm.free_queue) == list(range(9, -1, -1))
    b = _seq(list(range(100, 106)))
    assert bm.allocate(b, 6) == 6
    assert b.block_table == [7, 8, 9]  # the three least recently freed, ascending
    _compute(bm, b, 6)
    assert bm.append_slots(b, 4, [])  # a chunk of two more blocks, the next in the queue
    assert b.block_table == [7, 8, 9, 5, 6]
    c = _seq(list(range(8)))  # a's first blocks still hold their cached prefix
    assert bm.allocate(c, 8) == 2
    assert c.num_cached_tokens == 6 and c.block_table == [0, 1, 2, 4]


def test_held_slots_counts_each_block_once_at_its_fullest() -> None:
    """Against the per-block walk: shared prefixes, partial and empty tail blocks."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    rng = random.Random(0)
    seqs = []
    for i in range(12):
        seq = Sequence(f"s{i}", list(range(rng.randrange(1, 30))), SamplingParams())
        if seqs and rng.random() < 0.5:  # shares its first blocks with an earlier one
            seq.block_table = list(rng.choice(seqs).block_table[:rng.randrange(0, 4)])
        seq.block_table += [rng.randrange(64) for _ in range(-(-len(seq) // 4) + 1)]
        seq.num_computed_tokens = rng.randrange(0, len(seq) + 1)
        seqs.append(seq)
    held: dict[int, int] = {}
    for seq in seqs:
        for i, block in enumerate(seq.block_table):
            fill = min(4, max(0, seq.num_computed_tokens - 4 * i))
            held[block] = max(held.get(block, 0), fill)
    assert bm.held_slots(seqs) == (sum(held.values()), len(held))
    assert bm.held_slots([]) == (0, 0)


def _decode(bm: BlockManager, seq: Sequence) -> None:
    """One decode step of ``seq``: a token sampled, its slot made."""
    _compute(bm, seq, len(seq) - seq.num_computed_tokens)
    seq.token_ids.append(7)
    assert bm.append_slots(seq, 1, [])


def test_sequences_admitted_together_each_grow_into_a_run_of_blocks() -> None:
    """Each admission leaves the free blocks its prompt and max_tokens could fill after its run,
    so that sequences decoding side by side each keep their KV in one run of the pool."""
    bm = BlockManager(32, 2, enable_prefix_caching=True)
    seqs = [Sequence("r", [i] * 4, SamplingParams(max_tokens=6)) for i in range(3)]
    for seq in seqs:
        assert bm.allocate(seq, 4) == 4
    assert [s.block_table for s in seqs] == [[0, 1], [5, 6], [10, 11]]
    assert bm.num_free_blocks == 26  # the room is left free, not held
    for _ in range(6):
        for seq in seqs:
            _decode(bm, seq)
    assert [s.block_table for s in seqs] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                             [10, 11, 12, 13, 14]]


def test_a_sequence_whose_next_block_is_taken_grows_from_the_queue() -> None:
    """The room is a preference: once the queue reaches it, another sequence takes it, and the
    sequence it was left for grows from the queue's front instead, then on from there."""
    bm = BlockManager(6, 2, enable_prefix_caching=False)
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=8))
    assert bm.allocate(a, 2) == 2 and a.block_table == [0]
    assert list(bm.free_queue) == [5, 1, 2, 3, 4]  # a's room at the back
    b, c = (Sequence(name, [3, 4], SamplingParams(max_tokens=1)) for name in "bc")
    assert bm.allocate(b, 2) == 2 and b.block_table == [5]
    assert bm.allocate(c, 2) == 2 and c.block_table == [1]  # the queue reached a's room
    assert list(bm.free_queue) == [3, 4, 2]  # and c's own room, block 2, went to the back
    for _ in range(3):
        _decode(bm, a)
    assert a.block_table == [0, 3, 4]
