"""A probe's allocator events as a program of the batch shape: the reserved memory of a shape nobody probed.

`AllocationProgram` takes one calibration probe's events (memory.allocator.Events) as a template and writes each
allocation's size as a law of the batch shape (b, s, t) — a constant, or a constant plus one term of SHAPE_TERMS —
fitted through the same allocation in the other probes. The same allocation is found by where it was made: its
Python call site (the trace's innermost frames), and for allocations without Python frames (autograd's backward)
their position in their run, or where runs differ in length, sizes the two shapes share and sizes one law turns
into each other. A law may leave out one probe (an allocation aligned wrongly there); an allocation no law fits
takes its size at the probe nearest the shape asked for. Replaying the program at a new shape
(memory.allocator.replay) predicts that shape's peak reserved, fragmentation included.

Measured on run 18's shapes (benchmarks/README.md, "Run 19"): within 2.5% of the measured peak reserved for every
checkpointed model, where the fitted ratio model misses by up to 5.5%; without checkpointing a seq2seq backward is
one long frameless run that the alignment follows less well (bart_large up to 6.5%). On run 19's fresh shapes,
inside memfit's calibration ("Run 19 in memfit"), the largest of three templates: 41 checkpointed rows, median 0.00%,
−1.38% to +5.35% (T5, where a template whose backward allocates otherwise reads high). The mean of three, on run
20's fresh shapes ("Run 20"): 43 checkpointed rows, median 0.00%, −0.76% to +1.35%.
"""

from __future__ import annotations

import difflib
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from memfit.memory.allocator import Events, replay


def _runs(sites: list[int], frameless: int) -> tuple[list[int], list[list[int]]]:
    """Tokens to align (each call site; each run of frameless allocations one token) and their allocations."""
    tokens, spans, at = [], [], 0
    while at < len(sites):
        end = at + 1
        if sites[at] == frameless:
            while end < len(sites) and sites[end] == frameless:
                end += 1
        tokens.append(sites[at])
        spans.append(list(range(at, end)))
        at = end
    return tokens, spans


def _matching(first: list[int], second: list[int], lookahead: int = 400, window: int = 6) -> list[tuple[int, int]]:
    """Index pairs of two nearly equal token lists: walk both, and where they differ resynchronise at the nearest
    point where `window` tokens agree again (linear where difflib's matcher took a minute on 26k tokens)."""
    pairs, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        if first[i] == second[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
            continue
        for skip in range(1, lookahead):
            if first[i + skip : i + skip + window] == second[j : j + window]:
                i += skip
                break
            if second[j + skip : j + skip + window] == first[i : i + window]:
                j += skip
                break
        else:
            i, j = i + 1, j + 1
    return pairs


def _compatible(size_a: int, size_b: int, shape_a: tuple, shape_b: tuple) -> bool:
    """Whether two sizes could be one allocation at two shapes: their ratio is one of the laws' ratios."""
    for law in SHAPE_TERMS.values():
        expected = size_a * law(*shape_b) / law(*shape_a)
        if abs(expected - size_b) <= max(1024, 0.01 * size_b):
            return True
    return False


def align(first: Events, second: Events, frameless: int, shapes: tuple[tuple, tuple]) -> list[tuple[int, int]]:
    """Pairs of allocation indices of two probes (at `shapes`) made at the same point of the program."""
    (sites_a, sizes_a), (sites_b, sizes_b) = first.allocations(), second.allocations()
    tokens_a, spans_a = _runs(sites_a, frameless)
    tokens_b, spans_b = _runs(sites_b, frameless)

    def compatible(i: int, j: int) -> bool:
        return _compatible(sizes_a[i], sizes_b[j], *shapes)

    pairs = []
    for x, y in _matching(tokens_a, tokens_b):
        run_a, run_b = spans_a[x], spans_b[y]
        if len(run_a) == len(run_b):
            pairs += zip(run_a, run_b, strict=True)
            continue
        # a frameless run of another length: aligned by the sizes both shapes share, and where they differ by
        # sizes one law could turn into each other
        matcher = difflib.SequenceMatcher(None, [sizes_a[k] for k in run_a], [sizes_b[k] for k in run_b], False)
        for tag, a1, a2, b1, b2 in matcher.get_opcodes():
            if tag == "equal" or (tag == "replace" and a2 - a1 == b2 - b1):
                pairs += [(i, j) for i, j in zip(run_a[a1:a2], run_b[b1:b2], strict=True) if compatible(i, j)]
    return pairs


SHAPE_TERMS = {  # the laws an allocation's size may follow in the batch shape (b, s, t): a tensor's elements
    "1": lambda b, s, t: 1,
    "b": lambda b, s, t: b,
    "bs": lambda b, s, t: b * s,
    "bt": lambda b, s, t: b * t,
    "bss": lambda b, s, t: b * s * s,
    "btt": lambda b, s, t: b * t * t,
    "bst": lambda b, s, t: b * s * t,
    "s": lambda b, s, t: s,
    "t": lambda b, s, t: t,
    "ss": lambda b, s, t: s * s,
    "tt": lambda b, s, t: t * t,
    "st": lambda b, s, t: s * t,
}


def fit_size(points: list[tuple[tuple[int, int, int], int]]) -> tuple[str, float, float] | None:
    """(term, constant, coefficient) with size = constant + coefficient × term(shape), through the template's point
    (the first) and all the others but at most one (an allocation the alignment paired wrongly in one probe): one term
    through the origin where one fits within 1%, else a constant plus one term; None where neither fits (the size is
    then read at the probe nearest the shape asked for)."""
    (shape0, size0) = points[0]
    needed = max(2, len(points) - 1)

    def close(predicted: float, size: int, tolerance: float) -> bool:
        return abs(predicted - size) <= max(1024, tolerance * size)

    best_count, best = 0, None
    for term, law in SHAPE_TERMS.items():
        coefficient = size0 / law(*shape0)
        count = sum(close(coefficient * law(*shape), size, 0.01) for shape, size in points)
        if count > best_count:
            best_count, best = count, (term, 0.0, coefficient)
    if best_count == len(points) or (best_count >= needed and len(points) >= 4):
        return best
    if len(points) < 3:
        return None
    ys = [size for _, size in points]
    for term, law in list(SHAPE_TERMS.items())[1:]:
        xs = [law(*shape) for shape, _ in points]
        if len(set(xs)) == 1:  # the probes do not tell this term from a constant
            continue
        slope, constant = statistics.linear_regression(xs, ys)
        if all(close(constant + slope * x, y, 0.02) for x, y in zip(xs, ys, strict=True)):
            return term, constant, slope
    return None


def _distance(first: tuple[int, int, int], second: tuple[int, int, int]) -> float:
    return sum(abs(math.log(a / b)) for a, b in zip(first, second, strict=True))


@dataclass
class AllocationProgram:
    """A template probe's events with each allocation's size law fitted over the other probes; an allocation no law
    fits takes its size at the probe nearest the shape it is asked for."""

    events: Events
    laws: list[tuple[str, float, float] | None]
    points: list[list[tuple[tuple[int, int, int], int]]]  # each allocation's (probe shape, size), template first

    @classmethod
    def fit(
        cls,
        template: tuple[tuple[int, int, int], Events],
        others: list[tuple[tuple[int, int, int], Events]],
        frameless: int,
    ) -> AllocationProgram:
        shape, events = template
        points = [[(shape, size)] for size in events.allocations()[1]]
        for other_shape, other in others:
            other_sizes = other.allocations()[1]
            for i, j in align(events, other, frameless, (shape, other_shape)):
                points[i].append((other_shape, other_sizes[j]))
        return cls(events, [fit_size(p) for p in points], points)

    def sizes(self, shape: tuple[int, int, int]) -> list[int]:
        sizes = []
        for law, points in zip(self.laws, self.points, strict=True):
            if law is None:
                sizes.append(min(points, key=lambda point: _distance(point[0], shape))[1])
            else:
                sizes.append(max(1, round(law[1] + law[2] * SHAPE_TERMS[law[0]](*shape))))
        return sizes

    def predict(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        """(peak reserved, peak allocated) of the probe at `shape`, by replay."""
        replayed = replay(self.events, self.sizes(shape))
        return replayed.peak_reserved, replayed.peak_allocated

    @property
    def unfitted(self) -> int:
        return sum(law is None for law in self.laws)


NEAREST_TEMPLATES = 3  # on run 18's checkpointed rows the nearest three gave what all five did (benchmarks "Run 19")


@dataclass
class ReservedByReplay:
    """A shape's peak reserved from a calibration's recorded probes: the mean replay of the NEAREST_TEMPLATES
    programs whose templates lie nearest the shape (in log batch and lengths). The first probe is no template: its
    events hold the process's one-time allocations (library workspaces), which later steps reuse. Replays are kept
    per shape: a batch search asks for the same shapes again.

    Each template fragments its blocks in its own way (T5's position biases interleave otherwise at each shape), so
    each replay misses the shape's own fragmentation by its own error, either way. The mean of three, not their
    largest: on runs 18 and 19's 82 checkpointed rows the largest read T5 up to 5.35% high, the mean within 3.69%
    (and the nearest alone or the median 5.84% and 4.00% low); benchmarks/README.md, "Run 20", has both rules on
    fresh shapes. The preflight measures what it proves, so a low reading costs a probe, not an OOM."""

    programs: list[AllocationProgram]
    shapes: list[tuple[int, int, int]]  # each program's template shape
    _replayed: dict[tuple[int, int, int], list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def fit(cls, probes: list[tuple[tuple[int, int, int], Events]], frameless: int) -> ReservedByReplay:
        """From the probes' (shape, events) in the order they ran; `frameless` is the call-site index of allocations
        without Python frames. Raises ValueError with fewer than three probes (two templates, each fitted through
        two others)."""
        if len(probes) < 3:
            raise ValueError(f"{len(probes)} recorded probes: the replay needs at least three")
        programs = [
            AllocationProgram.fit(probe, [other for other in probes if other is not probe], frameless)
            for probe in probes[1:]
        ]
        return cls(programs, [shape for shape, _ in probes[1:]])

    def replays(self, shape: tuple[int, int, int]) -> list[int]:
        """The peak reserved that each of the nearest templates replays at `shape`, nearest first."""
        if shape not in self._replayed:
            nearest = sorted(range(len(self.shapes)), key=lambda i: _distance(self.shapes[i], shape))
            self._replayed[shape] = [self.programs[i].predict(shape)[0] for i in nearest[:NEAREST_TEMPLATES]]
        return list(self._replayed[shape])

    def reserved(self, shape: tuple[int, int, int]) -> int:
        return round(statistics.fmean(self.replays(shape)))

    def to_arrays(self) -> dict[str, Any]:
        """Numpy arrays for np.savez: each program's events, its template shape, its laws and the points of the
        allocations no law fits (the only ones a prediction reads)."""
        import numpy as np

        terms = list(SHAPE_TERMS)
        arrays: dict[str, Any] = {"count": np.array(len(self.programs))}
        for number, (program, shape) in enumerate(zip(self.programs, self.shapes, strict=True)):
            events, key = program.events, f"t{number}."
            unfitted = [(i, point) for i, law in enumerate(program.laws) if law is None for point in program.points[i]]
            arrays |= {
                key + "shape": np.array(shape, dtype=np.int64),
                key + "action": np.array(events.action, dtype=np.int8),
                key + "addr": np.array(events.addr, dtype=np.int64),
                key + "size": np.array(events.size, dtype=np.int64),
                key + "site": np.array(events.site, dtype=np.int32),
                key + "state": np.array(json.dumps(events.state)),
                key + "term": np.array([-1 if law is None else terms.index(law[0]) for law in program.laws], np.int8),
                key + "constant": np.array([0.0 if law is None else law[1] for law in program.laws]),
                key + "coefficient": np.array([0.0 if law is None else law[2] for law in program.laws]),
                key + "point_of": np.array([i for i, _ in unfitted], dtype=np.int64).reshape(-1),
                key + "point_shape": np.array([p[0] for _, p in unfitted], dtype=np.int64).reshape(-1, 3),
                key + "point_size": np.array([p[1] for _, p in unfitted], dtype=np.int64).reshape(-1),
            }
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Any) -> ReservedByReplay:
        """What `to_arrays` wrote (an np.load of its file)."""
        terms = list(SHAPE_TERMS)
        programs, shapes = [], []
        for number in range(int(arrays["count"])):
            key = f"t{number}."
            events = Events.from_trace(arrays, key.rstrip("."))
            laws: list[tuple[str, float, float] | None] = [
                None if term < 0 else (terms[term], float(constant), float(coefficient))
                for term, constant, coefficient in zip(
                    arrays[key + "term"].tolist(),
                    arrays[key + "constant"].tolist(),
                    arrays[key + "coefficient"].tolist(),
                    strict=True,
                )
            ]
            points: list[list[tuple[tuple[int, int, int], int]]] = [[] for _ in laws]
            for owner, point_shape, size in zip(
                arrays[key + "point_of"].tolist(),
                arrays[key + "point_shape"].tolist(),
                arrays[key + "point_size"].tolist(),
                strict=True,
            ):
                points[owner].append((tuple(point_shape), size))
            programs.append(AllocationProgram(events, laws, points))
            shapes.append(tuple(arrays[key + "shape"].tolist()))
        return cls(programs, shapes)
