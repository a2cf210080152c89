"""The placement model (plan/placement.py): every rank's box of every tensor, stages included, and the
boxes as element ranges of the flattened tensor."""

from __future__ import annotations

import itertools
import math

import pytest

from plan.layout import Layout, LayoutError
from plan.placement import ROOT_UNIT, Box, TensorShape, box_of, ranges_of, stage_of, unit_of


def _elements(box: Box, shape: tuple[int, ...]) -> set[int]:
    """The flat indices of a box, by brute force."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return {sum(i * s for i, s in zip(index, strides))
            for index in itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.sizes)))}


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 6, 2), (3, 1, 5)])
def test_a_box_is_its_elements_as_few_runs(shape: tuple[int, ...]) -> None:
    for dim in range(len(shape)):
        for parts in (1, 2, 3, 4):
            for index in range(parts):
                box = Box.whole(shape).chunk(dim, index, parts)
                ranges = box.flat_ranges(shape)
                flat = {i for lo, hi in ranges for i in range(lo, hi)}
                assert flat == _elements(box, shape), (shape, dim, parts, index)
                assert all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:])), "sorted and disjoint"
                assert len(ranges) <= math.prod(box.sizes[:dim]), "one run per index of the dims before the cut"


def test_a_dim_0_chunk_is_one_range_and_a_dim_1_chunk_one_per_row() -> None:
    assert Box.whole((4, 6)).chunk(0, 1, 2).flat_ranges((4, 6)) == [(12, 24)]
    assert Box.whole((4, 6)).chunk(1, 1, 3).flat_ranges((4, 6)) == [(2, 4), (8, 10), (14, 16), (20, 22)]
    assert Box.whole((5, 3)).chunk(0, 3, 4).flat_ranges((5, 3)) == [], "torch.chunk leaves the last chunk empty"


def test_parameters_belong_to_the_longest_unit_that_prefixes_them() -> None:
    units = ["blocks.1", "blocks.10", "head"]
    assert unit_of("blocks.1.fc.weight", units) == "blocks.1"
    assert unit_of("blocks.10.fc.weight", units) == "blocks.10"
    assert unit_of("head", units) == "head"
    assert unit_of("wte.weight", units) == ROOT_UNIT


def test_a_pipeline_rank_holds_its_stage_and_nothing_else() -> None:
    layout = Layout(members=("a", "b", "c", "d"), shares=(4, 4, 4, 4), pp=2, dp_shard=2,
                    stages=(("0", "1"), ("2", "3")))
    w = TensorShape("2.fc.weight", rows=5, numel=15, unit="2")
    root = TensorShape("scale", rows=0, numel=1)
    assert stage_of(layout, "2") == 1 and stage_of(layout, ROOT_UNIT) == 0
    assert [box_of(layout, r, w) is None for r in range(4)] == [True, True, False, False]
    assert ranges_of(layout, 2, w) == [(0, 9)] and ranges_of(layout, 3, w) == [(9, 15)], "FSDP's chunks in the stage"
    assert ranges_of(layout, 0, root) == [(0, 1)] and ranges_of(layout, 2, root) == []
    assert ranges_of(layout, 0, TensorShape("empty", rows=0, numel=0)) == [], "nothing to hold of no elements"
    with pytest.raises(ValueError, match="in no stage"):
        box_of(layout, 0, TensorShape("9.w", rows=1, numel=1, unit="9"))


def test_the_dim_0_slice_of_a_layout_is_the_placements_box() -> None:
    layout = Layout(members=tuple("abc"), shares=(1, 1, 1), dp_shard=3)
    for rank in range(3):
        for rows, cols in ((7, 3), (2, 5), (1, 1)):
            t = TensorShape("w", rows=rows, numel=rows * cols)
            lo, hi = layout.slice_of(rank, rows, rows * cols)
            assert ([(lo, hi)] if hi > lo else []) == ranges_of(layout, rank, t)


def test_stages_are_checked() -> None:
    with pytest.raises(LayoutError, match="needs 2 stages"):
        Layout(members=("a", "b"), shares=(1, 1), pp=2, stages=(("0",),))
    with pytest.raises(LayoutError, match="in two stages"):
        Layout(members=("a", "b"), shares=(1, 1), pp=2, stages=(("0", "1"), ("1",)))
    with pytest.raises(LayoutError, match="without a pipeline"):
        Layout(members=("a",), shares=(1,), stages=(("0",),))
    layout = Layout(members=("a", "b"), shares=(2, 2), pp=2, stages=(("0",), ("1", "2")))
    assert Layout.from_dict(layout.to_dict()) == layout and layout.to_dict()["stages"] == [["0"], ["1", "2"]]


def test_tensor_parallel_splits_a_tensor_along_its_tp_dim_and_fsdp_then_cuts_dim_0() -> None:
    """A row-wise weight (tp_dim 1) of 4 x 6 over tp=2: each tp rank holds a column block, one range
    per row; a column-wise one (tp_dim 0) a block of rows; an unsplit one is whole on both; with
    dp_shard=2 beside tp=2, FSDP cuts dim 0 of the tp rank's block."""
    rowwise = TensorShape("proj.weight", 4, 24, tp_dim=1)
    colwise = TensorShape("q.weight", 4, 24, tp_dim=0)
    norm = TensorShape("ln.weight", 6, 6)
    tp2 = Layout(members=("a", "b"), shares=(4, 4), tp=2)
    assert ranges_of(tp2, 1, rowwise) == [(3, 6), (9, 12), (15, 18), (21, 24)]
    assert ranges_of(tp2, 0, colwise) == [(0, 12)] and ranges_of(tp2, 1, colwise) == [(12, 24)]
    assert ranges_of(tp2, 0, norm) == ranges_of(tp2, 1, norm) == [(0, 6)]
    both = Layout(members=("a", "b", "c", "d"), shares=(2, 2, 2, 2), dp_shard=2, tp=2)
    assert both.coords(3) == (0, 0, 1, 1)
    assert ranges_of(both, 3, rowwise) == [(15, 18), (21, 24)]  # (rows 2-3 of the second column block)
    assert ranges_of(both, 3, colwise) == [(18, 24)]
