"""The paged KV pool: block tables, ref counts, copy-on-write and prefix caching.

A block is a fixed run of ``block_size`` KV slots. Full blocks whose KV has been computed are
registered under a chained hash of their tokens (the hash of block i covers tokens
``0 .. (i+1)*block_size``), so a later sequence with the same prefix reuses them. A block whose
ref count drops to zero joins the free queue but keeps its cached content until it is handed
out again; the queue is in least-recently-freed order, so eviction is LRU.

The blocks one call takes (a prompt's, a chunk's) go into the table in ascending id order, not
in the queue's: which blocks are evicted is the same, but a sequence's KV then runs forward
through memory. Once the pool had been handed out whole, the queue's order (each sequence freed
tail first) had scattered the runs: SmolLM2's 128 throughput.py requests on a warm pool took
47.6-47.8 s against 46.4-46.6 sorted (AMD EPYC Zen 5, 2 threads, alternating processes).

A sequence grows into the block after its last where that one is free, and its admission
sends the free blocks after its run (as many as its prompt and ``max_tokens`` could fill, up
to ``ROOM_BLOCKS``) to the queue's back, so that the sequences admitted after it take blocks
further on and leave it room. Without that, 128 sequences admitted back to back each grew
into blocks scattered among the others' (27 % of a table's neighbours apart), and the decode
attention reads a run of blocks from memory faster than scattered ones: random-26m's 128
throughput.py requests, Intel Xeon, 2 threads, two processes of each alternating, the native
decode steps' attention 4.72 / 4.60 / 4.51 / 4.56 -> 4.30 / 4.30 / 4.30 / 4.28 s a call
(22.1-23.1 -> 24.3-24.4 GB/s; the call about 0.3 s, 2 %, shorter). The room is a preference,
not a reservation: the blocks stay free and counted, and any sequence takes them once the queue
reaches them; LRU eviction holds but for them (their cached content outlives older blocks'
until the queue reaches them or their sequence grows into them).
"""

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.sequence import Sequence

ROOM_BLOCKS = 128  # the most blocks an admission leaves free after its run


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.chains: dict[int, list[int]] = {}  # seq_id -> hashes of its computed full blocks
        self.prefix_cache_queries = 0  # prompt tokens looked up, in tokens as vLLM counts
        self.prefix_cache_hits = 0
        self.peak_blocks, self.utilization_at_peak = 0, 0.0  # see record_use
        self._measure_at = 0  # blocks in use at which record_use measures next

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _extend_chain(self, seq: Sequence, chain: list[int], num_blocks: int) -> list[int]:
        for i in range(len(chain), num_blocks):
            chain.append(hash((chain[-1] if chain else None, self._block_tokens(seq, i))))
        return chain

    def _take_run(self, count: int) -> list[int]:
        """``count`` blocks off the free queue, in ascending id order (see the module's
        docstring)."""
        return sorted(self._take_free() for _ in range(count))

    def _grow(self, table: list[int], count: int) -> None:
        """``count`` more blocks onto ``table``: those after its last while they are free,
        then a run off the queue."""
        while count and table and table[-1] + 1 in self.free_queue:
            table.append(self._take_free(table[-1] + 1))
            count -= 1
        table.extend(self._take_run(count))

    def _leave_room(self, seq: Sequence) -> None:
        """The free blocks after the sequence's run go to the queue's back: as many as the rest
        of its prompt and its ``max_tokens`` could fill, up to ``ROOM_BLOCKS``."""
        left = seq.params.max_tokens
        tokens = len(seq) + (left - seq.num_output_tokens if left is not None
                             else ROOM_BLOCKS * self.block_size)
        room = min(-(-tokens // self.block_size) - len(seq.block_table), ROOM_BLOCKS)
        start = seq.block_table[-1] + 1
        for block_id in range(start, min(start + room, len(self.blocks))):
            if block_id in self.free_queue:
                self.free_queue.move_to_end(block_id)

    def _take_free(self, block_id: int | None = None) -> int:
        """The least recently freed block, or ``block_id`` (which must be free)."""
        if block_id is None:
            block_id, _ = self.free_queue.popitem(last=False)  # least recently freed first
        else:
            del self.free_queue[block_id]
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of ``seq``, leaving at least its last token to
        compute (the step needs that token's logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i, h in enumerate(self._extend_chain(seq, [], (len(seq) - 1) // self.block_size)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, max_new_tokens: int) -> int:
        """Admit a waiting sequence: take its cached prefix, then blocks for up to
        ``max_new_tokens`` uncached tokens. Returns how many tokens to compute now; 0, with
        nothing changed, when the pool cannot hold them."""
        assert not seq.block_table
        hits = self._cache_hits(seq)
        num_cached = len(hits) * self.block_size
        num_new = min(len(seq) - num_cached, max_new_tokens)
        needed = -(-(num_cached + num_new) // self.block_size) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new <= 0 or needed > self.num_free_blocks - reclaimed:
            return 0
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_table = hits + self._take_run(needed)
        self._leave_room(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        self.chains[seq.seq_id] = self._extend_chain(seq, [], len(hits))
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += num_cached
        return num_new

    def append_slots(self, seq: Sequence, num_new_tokens: int,
                     copies: list[tuple[int, int]]) -> bool:
        """Make room for KV of the next ``num_new_tokens`` tokens of a running sequence. A shared
        block about to be written is copied first (copy-on-write); the ``(src, dst)`` pair goes
        into ``copies``. False, with nothing changed, when the pool is short."""
        start, table, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        write_block = start // bs
        cow = write_block < len(table) and self.blocks[table[write_block]].ref_count > 1
        grow = -(-(start + num_new_tokens) // bs) - len(table)
        if grow <= 0 and not cow:  # the common decode step: room in the last block
            return True
        grow = max(0, grow)
        if grow + cow > len(self.free_queue):
            return False
        if cow:
            src = seq.block_table[write_block]
            self.blocks[src].ref_count -= 1
            seq.block_table[write_block] = self._take_free()
            copies.append((src, seq.block_table[write_block]))
        self._grow(seq.block_table, grow)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Enter the sequence's newly computed full blocks into the prefix cache."""
        chain = self.chains.setdefault(seq.seq_id, [])
        first, last = len(chain), seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or last <= first:
            return
        for i, h in enumerate(self._extend_chain(seq, chain, last)[first:], start=first):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, self._block_tokens(seq, i)
                self.cached[h] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1
        self.chains[child.seq_id] = list(self.chains.get(parent.seq_id, []))

    def held_slots(self, running: Iterable[Sequence]) -> tuple[int, int]:
        """Slots holding KV, and the blocks of ``running``'s sequences (a shared block counts once).
        A sequence's blocks before its last computed token are full: they go into a set in one
        C call. For 256 sequences of 36 blocks, 1.1 ms here against 8.3 for a per-block Python
        walk, which the engine ran on every step that reached a new peak of blocks in use: at
        batch 256 on an H200 the host, not the GPU, set the step time."""
        bs = self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}  # block -> its most filled slots, under bs
        for seq in running:
            n, table = seq.num_computed_tokens, seq.block_table
            whole = min(len(table), n // bs)
            full.update(table[:whole])
            for i in range(whole, len(table)):
                partial[table[i]] = max(partial.get(table[i], 0), max(0, n - i * bs))
        tails = [fill for block, fill in partial.items() if block not in full]
        return bs * len(full) + sum(tails), len(full) + len(tails)

    def utilization(self, held: int, blocks: int) -> float:
        """Slots holding KV over the slots of the blocks holding them (``held_slots``)."""
        return held / (blocks * self.block_size) if blocks else 0.0

    def record_use(self, running: Iterable[Sequence]) -> None:
        """Tracks the peak of blocks in use, and the slots' utilization when the blocks in use
        were last within 1 % of it. Measured at every new peak (at batch 256 most steps reach
        one, as sequences grow into new blocks), ``held_slots`` cost each step up to 1.1 ms."""
        used = self.num_used_blocks
        self.peak_blocks = max(self.peak_blocks, used)
        if used >= self._measure_at:
            self.utilization_at_peak = self.utilization(*self.held_slots(running))
            self._measure_at = used + max(1, used // 100)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the (more shareable) head blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.chains.pop(seq.seq_id, None)
