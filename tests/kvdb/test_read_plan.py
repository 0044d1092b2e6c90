"""read_plan: which blocks of a remote read move as one request, and how runs are chunked."""

from __future__ import annotations

from kvflow.kvdb.remote.read_plan import Run, chunk_runs, plan_runs


def test_blocks_adjacent_on_both_sides_form_one_run() -> None:
    items = [("dst", 100 + 10 * i, 5000 + 10 * i, 10) for i in range(4)]
    assert plan_runs(items) == [Run(0, 4, "dst", 100, 5000, 40)]


def test_a_gap_on_either_side_or_another_segment_starts_a_new_run() -> None:
    items = [
        ("dst", 0, 0, 10),
        ("dst", 10, 10, 10),  # joins
        ("dst", 21, 20, 10),  # local gap
        ("dst", 31, 31, 10),  # remote gap
        ("other", 41, 41, 10),  # another local segment
        ("other", 51, 51, 10),  # joins
        ("other", 41, 61, 10),  # local offset goes back
    ]
    assert plan_runs(items) == [
        Run(0, 2, "dst", 0, 0, 20),
        Run(2, 1, "dst", 21, 20, 10),
        Run(3, 1, "dst", 31, 31, 10),
        Run(4, 2, "other", 41, 41, 20),
        Run(6, 1, "other", 41, 61, 10),
    ]


def test_a_run_stops_at_max_bytes_and_a_larger_block_is_its_own_run() -> None:
    items = [("d", 10 * i, 10 * i, 10) for i in range(5)] + [("d", 50, 50, 100)]
    assert plan_runs(items, max_bytes=25) == [
        Run(0, 2, "d", 0, 0, 20),
        Run(2, 2, "d", 20, 20, 20),
        Run(4, 1, "d", 40, 40, 10),
        Run(5, 1, "d", 50, 50, 100),
    ]
    assert plan_runs([]) == []


def test_chunks_hold_at_least_chunk_bytes_each_but_the_last() -> None:
    runs = [Run(i, 1, "d", 10 * i, 10 * i, n) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    assert chunk_runs(runs, chunk_bytes=20) == [(0, 2), (2, 3), (3, 6)]
    assert chunk_runs(runs, chunk_bytes=1000) == [(0, 6)]
    assert chunk_runs([], chunk_bytes=20) == []
