"""The CUDA caching allocator's block placement with expandable segments, replayed on the host.

`ExpandableSegments` places allocations as torch 2.11's CUDACachingAllocator.cpp does with
`expandable_segments:True` (one stream): requests rounded to 512 bytes; a small pool (requests up to 1 MiB, 2 MiB
pages) and a large pool (20 MiB pages); best fit among free mapped blocks (by size, then address, preferring the
smaller "expandable size" as `get_free_block` does); a block split when 512 bytes or more would remain; where nothing
fits, pages mapped at the lowest address whose free and unmapped blocks together have room (`find_expandable_block`);
freed blocks merged with free neighbours of the same mapping. Reserved memory is the mapped bytes; its peak is what
`torch.cuda.max_memory_reserved` reads. `replay` runs a probe's recorded allocator events through it
(benchmarks/README.md, "Run 19": every allocation at its traced address and the peak reserved to the byte on 141
traced probes of five architectures, on an H100).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

SMALL_REQUEST = 1 << 20  # kSmallSize: the largest request served from the small pool
MIN_BLOCK = 512  # kMinBlockSize: every request rounded up to a multiple of it
SMALL_PAGE, LARGE_PAGE = 2 << 20, 20 << 20  # expandable segments map 2 MiB pages (small pool), 20 MiB (large)
# the address space an expandable segment reserves: 1 1/8 of the GPU's memory (an H100 80GB HBM3's here)
ADDRESS_SPACE = int(85_520_809_984 * 1.125)
ALLOC, FREE_COMPLETED, SEGMENT_UNMAP = 0, 2, 6  # allocator_trace_gpu.ACTIONS indices


def round_size(size: int) -> int:
    return MIN_BLOCK * max(1, -(-size // MIN_BLOCK))


class _Block:
    __slots__ = ("ptr", "size", "allocated", "mapped", "prev", "next")

    def __init__(self, ptr: int, size: int, allocated: bool = False, mapped: bool = True):
        self.ptr, self.size, self.allocated, self.mapped = ptr, size, allocated, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None


def _link(first: _Block | None, second: _Block | None) -> None:
    if first is not None:
        first.next = second
    if second is not None:
        second.prev = first


@dataclass
class _Pool:
    page: int
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, ptr) of free mapped blocks, sorted
    unmapped: list[int] = field(default_factory=list)  # ptr of unmapped blocks, sorted
    blocks: dict[int, _Block] = field(default_factory=dict)  # every block, by ptr

    def add(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self.free, (block.size, block.ptr))
        else:
            bisect.insort(self.unmapped, block.ptr)

    def remove(self, block: _Block) -> None:
        if block.mapped:
            del self.free[bisect.bisect_left(self.free, (block.size, block.ptr))]
        else:
            del self.unmapped[bisect.bisect_left(self.unmapped, block.ptr)]


class ExpandableSegments:
    """The caching allocator's block placement with expandable segments, from a snapshot's segments (a trace's
    `<key>.state`: mapped ranges and their blocks); `malloc` returns the address, `free` takes it back."""

    def __init__(self, segments: list[dict], address_space: int = ADDRESS_SPACE):
        self._pools = {True: _Pool(SMALL_PAGE), False: _Pool(LARGE_PAGE)}
        self._live: dict[int, tuple[_Block, _Pool]] = {}
        self._address_space = address_space
        self.reserved = self.allocated = 0
        for small, pool in self._pools.items():
            ranges = sorted(
                (s for s in segments if (s["segment_type"] == "small") == small), key=lambda s: s["address"]
            )
            if ranges:
                self._lay_out(pool, ranges, address_space)
        ends = [block.ptr + block.size for pool in self._pools.values() for block in pool.blocks.values()]
        self._next_segment = max(ends, default=0)  # where a new segment's address space would start
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated

    def _lay_out(self, pool: _Pool, ranges: list[dict], address_space: int) -> None:
        """The segment's blocks in address order: the snapshot's mapped ranges, unmapped gaps between them, and
        the rest of the address space unmapped after them (the segment is assumed to start at the first range)."""
        base = cursor = ranges[0]["address"]
        chain: list[_Block] = []
        for segment in ranges:
            if segment["address"] > cursor:
                chain.append(_Block(cursor, segment["address"] - cursor, mapped=False))
            cursor = segment["address"]
            for block in segment["blocks"]:
                chain.append(_Block(cursor, block["size"], allocated=block["state"].startswith("active")))
                cursor += block["size"]
            self.reserved += segment["total_size"]
        chain.append(_Block(cursor, base + address_space - cursor, mapped=False))
        for first, second in zip(chain, chain[1:], strict=False):
            _link(first, second)
        for block in chain:
            pool.blocks[block.ptr] = block
            if block.allocated:
                self._live[block.ptr] = (block, pool)
                self.allocated += block.size
            else:
                pool.add(block)

    def malloc(self, requested: int) -> int:
        size = round_size(requested)
        pool = self._pools[size <= SMALL_REQUEST]
        block = self._best_fit(pool, size) or self._expand(pool, size)
        if block.size - size >= MIN_BLOCK:  # split: the allocation takes the block's start
            rest = _Block(block.ptr + size, block.size - size)
            _link(rest, block.next)
            _link(block, rest)
            block.size = size
            pool.blocks[rest.ptr] = rest
            pool.add(rest)
        block.allocated = True
        self._live[block.ptr] = (block, pool)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.ptr

    def live(self) -> list[int]:
        """The addresses of the blocks in use."""
        return list(self._live)

    def free(self, ptr: int) -> None:
        block, pool = self._live.pop(ptr)
        block.allocated = False
        self.allocated -= block.size
        block = self._merge(pool, block, block.prev)
        block = self._merge(pool, block, block.next)
        pool.add(block)

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        at = bisect.bisect_left(pool.free, (size, -1))
        if at == len(pool.free):
            return None

        def expandable(index: int) -> int:  # a block's size counting the unmapped room right after it
            block = pool.blocks[pool.free[index][1]]
            after = block.next
            return block.size + (after.size if after is not None and not after.mapped else 0)

        while at + 1 < len(pool.free) and expandable(at + 1) < expandable(at):
            at += 1
        return pool.blocks[pool.free.pop(at)[1]]

    def _expand(self, pool: _Pool, size: int) -> _Block:
        candidate = self._expandable_start(pool, size)
        if not candidate.mapped:
            candidate = self._map(pool, candidate, min(candidate.size, size))
        while candidate.size < size:
            after = candidate.next
            assert after is not None
            candidate = self._map(pool, after, min(size - candidate.size, after.size))
        pool.remove(candidate)
        return candidate

    def _expandable_start(self, pool: _Pool, size: int) -> _Block:
        """The lowest unmapped block (with the free block before it) whose free and unmapped run has room; else a
        new segment's unmapped address space, as the allocator reserves one for a pool that has none or is full."""
        for ptr in pool.unmapped:
            start = pool.blocks[ptr]
            if start.prev is not None and start.prev.mapped and not start.prev.allocated:
                start = start.prev
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room, block = room + block.size, block.next
            if room >= size:
                return start
        segment = _Block(self._next_segment, self._address_space, mapped=False)
        self._next_segment += self._address_space
        pool.blocks[segment.ptr] = segment
        pool.add(segment)
        return segment

    def _map(self, pool: _Pool, block: _Block, size: int) -> _Block:
        mapped = -(-size // pool.page) * pool.page
        pool.remove(block)
        if mapped < block.size:
            rest = _Block(block.ptr + mapped, block.size - mapped, mapped=False)
            _link(rest, block.next)
            _link(block, rest)
            pool.blocks[rest.ptr] = rest
            pool.add(rest)
            block.size = mapped
        block.mapped = True
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = self._merge(pool, block, block.prev)
        block = self._merge(pool, block, block.next)
        pool.add(block)
        return block

    @staticmethod
    def _merge(pool: _Pool, keep: _Block, other: _Block | None) -> _Block:
        """`other` into `keep` where it is free and mapped alike (`keep` is in no free list yet)."""
        if other is None or other.allocated or other.mapped != keep.mapped:
            return keep
        pool.remove(other)
        del pool.blocks[other.ptr]
        if keep.prev is other:
            del pool.blocks[keep.ptr]
            keep.ptr = other.ptr
            pool.blocks[keep.ptr] = keep
            _link(other.prev, keep)
        else:
            _link(keep, other.next)
        keep.size += other.size
        return keep


@dataclass(frozen=True)
class Events:
    """One probe's allocator events (a trace's arrays): action, address, requested size and call site."""

    action: list[int]
    addr: list[int]
    size: list[int]
    site: list[int]
    state: list[dict]

    @classmethod
    def from_trace(cls, arrays, key: str) -> Events:
        site = arrays[f"{key}.site"] if f"{key}.site" in arrays else [-1] * len(arrays[f"{key}.action"])
        return cls(
            [int(x) for x in arrays[f"{key}.action"]],
            [int(x) for x in arrays[f"{key}.addr"]],
            [int(x) for x in arrays[f"{key}.size"]],
            [int(x) for x in site],
            json.loads(str(arrays[f"{key}.state"])),
        )

    def allocations(self) -> tuple[list[int], list[int]]:
        """(call sites, sizes) of the allocations, in order."""
        index = [i for i, action in enumerate(self.action) if action == ALLOC]
        return [self.site[i] for i in index], [self.size[i] for i in index]


@dataclass(frozen=True)
class Replay:
    peak_reserved: int
    peak_allocated: int
    addresses: list[int]  # where each allocation was placed, in order


def replay(events: Events, sizes: list[int] | None = None) -> Replay:
    """The allocator's peaks over `events` from their starting state, each allocation at `sizes` (default: as
    traced), up to the probe's closing `empty_cache`."""
    allocator = ExpandableSegments(events.state)
    earlier = set(allocator.live())  # blocks from before the trace, at their traced addresses
    placed: dict[int, int] = {}  # traced address -> replayed address
    addresses = []
    for action, addr, size in zip(events.action, events.addr, events.size, strict=True):
        if action == ALLOC:
            addresses.append(allocator.malloc(size if sizes is None else sizes[len(addresses)]))
            placed[addr] = addresses[-1]
        elif action == FREE_COMPLETED and addr in placed:
            allocator.free(placed.pop(addr))
        elif action == FREE_COMPLETED and addr in earlier:
            earlier.discard(addr)
            allocator.free(addr)
        elif action == SEGMENT_UNMAP:
            break
    return Replay(allocator.peak_reserved, allocator.peak_allocated, addresses)
