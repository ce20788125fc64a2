"""A probe's allocations written as laws of the shape: aligned across probes by call site, fitted, replayed."""

from __future__ import annotations

import pytest

from memfit.memory.allocation_program import AllocationProgram, ReservedByReplay, align, fit_size
from memfit.memory.allocator import LARGE_PAGE, Events, replay

MIB = 1 << 20
FRAMELESS = 0  # the call-site index of allocations without Python frames


def test_a_law_is_found_through_every_probe_and_survives_one_wrongly_paired_probe():
    shapes = [(4, 512, 128), (8, 512, 128), (4, 1024, 128), (2, 256, 512), (8, 256, 256)]
    points = [(shape, 6 * shape[0] * shape[1]) for shape in shapes]  # b·s elements of 6 bytes
    assert fit_size(points)[0] == "bs"
    points[3] = (shapes[3], 12345678)  # one probe's partner was the wrong allocation
    term, constant, coefficient = fit_size(points)
    assert (term, constant) == ("bs", 0.0) and coefficient == 6
    assert fit_size([(shape, hash(shape) % 10**9) for shape in shapes]) is None  # no law: None


def test_a_constant_plus_a_term_is_fitted_where_no_term_alone_fits():
    shapes = [(4, 512, 128), (8, 512, 128), (4, 1024, 128), (2, 256, 512)]
    term, constant, coefficient = fit_size([(shape, 2**24 + 4096 * shape[0] * shape[2]) for shape in shapes])
    assert term == "bt" and round(constant) == 2**24 and round(coefficient) == 4096


def probe(shape: tuple[int, int, int], sites: list[int], sizes: list[int]) -> tuple[tuple, Events]:
    """A probe's events: each allocation made and freed in turn, from an allocator with one free page."""
    action, addr, size = [], [], []
    for number, allocation in enumerate(sizes):
        action += [0]
        addr += [number * LARGE_PAGE * 8]  # distinct traced addresses; the replay places its own
        size += [allocation]
    for number in range(len(sizes)):
        action += [2]
        addr += [number * LARGE_PAGE * 8]
        size += [0]
    page = {"address": 1 << 40, "total_size": LARGE_PAGE, "segment_type": "large"}
    page["blocks"] = [{"size": LARGE_PAGE, "state": "inactive"}]
    site = sites + [-1] * len(sites)
    return shape, Events(action, addr, size, site, [page])


def program_sizes(shape: tuple[int, int, int], extra: int = 0) -> tuple[list[int], list[int]]:
    """Call sites and sizes of a made-up step: a constant buffer, a b·s activation, a frameless backward run
    (with `extra` more frameless scratch allocations in it) and a b·t logits buffer."""
    b, s, t = shape
    sites = [1, 2] + [FRAMELESS] * (3 + extra) + [3]
    sizes = [MIB, 2048 * b * s] + [1024 * b * s, 4096, 512 * b * s] + [777] * extra + [4096 * b * t]
    return sites, sizes


def test_probes_are_aligned_by_call_site_and_a_longer_frameless_run_by_its_shared_sizes():
    first = probe((4, 512, 128), *program_sizes((4, 512, 128)))
    second = probe((8, 256, 256), *program_sizes((8, 256, 256), extra=2))
    pairs = align(first[1], second[1], FRAMELESS, (first[0], second[0]))
    assert (0, 0) in pairs and (1, 1) in pairs  # by call site
    assert (5, 7) in pairs  # the logits, after a frameless run two allocations longer
    assert (3, 3) in pairs  # the constant scratch inside the run


def test_a_program_replayed_at_an_unprobed_shape_peaks_where_that_shape_would():
    shapes = [(4, 512, 128), (8, 512, 256), (2, 256, 512), (16, 128, 64)]  # b·s and b·t both vary
    probes = [probe(shape, *program_sizes(shape)) for shape in shapes]
    program = AllocationProgram.fit(probes[0], probes[1:], FRAMELESS)
    assert program.unfitted == 0
    target = (6, 640, 96)
    _, truth = probe(target, *program_sizes(target))
    assert program.sizes(target) == truth.allocations()[1]
    assert program.predict(target)[1] == sum(-(-size // 512) * 512 for size in truth.allocations()[1])


def _recorded(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple, Events]]:
    return [probe(shape, *program_sizes(shape, extra=shape[0] % 3)) for shape in shapes]


PROBED = [(4, 512, 128), (8, 512, 256), (2, 256, 512), (16, 128, 64), (4, 1024, 64)]


def test_reserved_by_replay_is_the_mean_of_the_nearest_templates_and_reads_back_from_its_arrays(tmp_path):
    import numpy as np

    probes = _recorded(PROBED)
    probes[2][1].size[0] = 12345  # one probe's constant buffer differs: no law fits it, the nearest probe's is read
    replayed = ReservedByReplay.fit(probes, FRAMELESS)
    assert replayed.shapes == PROBED[1:]  # the first probe (one-time allocations) is no template
    assert any(p.unfitted for p in replayed.programs)
    target = (6, 640, 96)
    distance = [sum(abs(np.log(a / b)) for a, b in zip(shape, target, strict=True)) for shape in PROBED[1:]]
    nearest = sorted(range(4), key=distance.__getitem__)[:3]
    assert replayed.replays(target) == [replayed.programs[i].predict(target)[0] for i in nearest]
    assert replayed.reserved(target) == round(np.mean(replayed.replays(target)))
    apart = replayed.replays((3, 300, 700))  # templates that disagree (the unfitted buffer is the nearest probe's)
    assert min(apart) < replayed.reserved((3, 300, 700)) < max(apart)
    for shape in (target, (32, 2048, 512)):  # what the program would reserve there, run for real
        assert replayed.reserved(shape) == replay(probe(shape, *program_sizes(shape))[1]).peak_reserved

    np.savez_compressed(tmp_path / "replay.npz", **replayed.to_arrays())
    with np.load(tmp_path / "replay.npz") as arrays:
        again = ReservedByReplay.from_arrays(arrays)
    for shape in (target, (1, 64, 64), (32, 2048, 512)):
        assert again.reserved(shape) == replayed.reserved(shape)
    assert [p.laws for p in again.programs] == [p.laws for p in replayed.programs]


def test_reserved_by_replay_needs_three_probes():
    with pytest.raises(ValueError, match="2 recorded probes"):
        ReservedByReplay.fit(_recorded(PROBED[:2]), FRAMELESS)
