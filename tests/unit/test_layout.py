"""The plan's Layout: degrees validated (ParallelDims-style), the mesh's coordinates, batch slices, and
a tensor's slice on the shard axis exactly as FSDP2 lays it out (torch.chunk on dim 0)."""

from __future__ import annotations

import pytest
import torch

from plan.layout import Layout, LayoutError, LayoutPin, parse_pin


def test_degrees_must_multiply_to_the_members_and_be_at_least_one() -> None:
    with pytest.raises(LayoutError, match="make 4 ranks, but the plan has 3 members"):
        Layout(members=("a", "b", "c"), shares=(1, 1, 1), dp_replicate=2, dp_shard=2)
    with pytest.raises(LayoutError, match="dp_shard must be an integer >= 1"):
        Layout(members=("a",), shares=(1,), dp_shard=0)
    with pytest.raises(LayoutError, match="unique"):
        Layout(members=("a", "a"), shares=(1, 1), dp_replicate=2)
    with pytest.raises(LayoutError, match="2 shares for 3 members"):
        Layout(members=("a", "b", "c"), shares=(1, 1), dp_replicate=3)
    with pytest.raises(LayoutError, match="shares a data-parallel slot"):  # a tp pair computes one slice
        Layout(members=("a", "b"), shares=(1, 2), tp=2)


def test_coordinates_are_row_major_pp_replicate_shard_tp() -> None:
    layout = Layout(members=tuple("abcdefgh"), shares=(1,) * 8, pp=2, dp_replicate=2, dp_shard=2,
                    stages=(("0", "1"), ("2",)))
    assert [layout.coords(r) for r in (0, 1, 2, 3, 4, 7)] == [
        (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 0), (1, 0, 0, 0), (1, 1, 1, 0)]
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(8))
    assert layout.shard_group(2) == [2, 3] and layout.replicate_group(1) == [1, 3]
    assert layout.dp == 4 and layout.dp_ranks(1) == [1, 5], "both stages of slot 1"


def test_batch_slices_are_contiguous_in_slot_order_and_cover_the_global_batch() -> None:
    layout = Layout(members=("a", "b", "c", "d"), shares=(3, 0, 5, 2), dp_replicate=2, dp_shard=2)
    assert [layout.batch_slice(r) for r in range(4)] == [(0, 3), (3, 3), (3, 8), (8, 10)]
    assert layout.global_batch == 10


@pytest.mark.parametrize("rows,cols,world", [(7, 3, 3), (2, 5, 3), (16, 1, 4), (5, 4, 8), (1, 1, 2)])
def test_a_shard_is_fsdp2s_chunk_of_dim_0(rows: int, cols: int, world: int) -> None:
    layout = Layout(members=tuple(f"m{i}" for i in range(world)), shares=(1,) * world, dp_shard=world)
    full = torch.arange(rows * cols).reshape(rows, cols)
    chunks = list(torch.chunk(full, world, dim=0))
    chunks += [full[rows:]] * (world - len(chunks))  # FSDP2 gives the ranks past the last chunk empty shards
    for rank in range(world):
        lo, hi = layout.slice_of(rank, rows, rows * cols)
        assert torch.equal(full.flatten()[lo:hi], chunks[rank].flatten()), rank


def test_the_wire_form_round_trips_and_names_what_is_wrong() -> None:
    layout = Layout(members=("a", "b", "c", "d"), shares=(2, 2, 3, 1), dp_replicate=2, dp_shard=2)
    assert Layout.from_dict(layout.to_dict()) == layout
    assert layout.to_dict() == {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "tp": 1,
                                "members": ["a", "b", "c", "d"], "shares": [2, 2, 3, 1], "stages": []}
    with pytest.raises(LayoutError, match="unknown fields"):
        Layout.from_dict({**layout.to_dict(), "cp": 1})
    with pytest.raises(LayoutError, match="make 4 ranks"):
        Layout.from_dict({**layout.to_dict(), "members": ["a", "b", "c"], "shares": [1, 1, 1]})
    assert Layout.replicated(["a", "b"], [1, 2]).describe() == "dp_replicate=2"


def test_a_pin_parses_and_refuses_what_cannot_run() -> None:
    assert parse_pin("dp=2,fsdp=2") == LayoutPin(dp_replicate=2, dp_shard=2)
    assert parse_pin("fsdp=3").members is None
    assert parse_pin("dp=2,fsdp=3").members == 6, "both data-parallel degrees pinned: 6 members (pp, tp: 1)"
    assert parse_pin("pp=2,dp=2,fsdp=2").members == 8, "HSDP stages: 2 x 2 x 2"
    assert parse_pin("fsdp=3").admits(Layout(members=("a", "b", "c"), shares=(1, 1, 1), dp_shard=3))
    assert not parse_pin("fsdp=3").admits(Layout.replicated(["a", "b", "c"], [1, 1, 1]))
    assert parse_pin("tp=2,dp=2").members == 4 and parse_pin("tp=2").members is None  # (replicas filled)
    assert parse_pin("tp=2").admits(Layout(members=("a", "b", "c", "d"), shares=(1,) * 4, dp_replicate=2, tp=2))
    assert parse_pin("tp=2,fsdp=2").members is None and parse_pin("tp=2,fsdp=2,dp=2").members == 8
    assert parse_pin("tp=2,fsdp=2").admits(Layout(members=("a", "b", "c", "d"), shares=(1,) * 4, dp_shard=2, tp=2))
    assert not parse_pin("tp=2").admits(Layout(members=("a", "b", "c", "d"), shares=(1,) * 4, dp_shard=2, tp=2))
    for bad, why in [("dp=0", ">= 1"), ("zero=2", "NAME=N"), ("dp=2,dp=3", "twice"),
                     ("dp=x", "NAME=N")]:
        with pytest.raises(LayoutError, match=why):
            parse_pin(bad)


def test_a_pipeline_pin_alone_means_that_many_members_and_no_data_parallelism() -> None:
    pin = parse_pin("pp=2")
    assert pin == LayoutPin(pp=2) and pin.members == 2 and pin.describe() == "pp=2"
    assert parse_pin("pp=3,dp=1,fsdp=1").members == 3
    pipeline = Layout(members=("a", "b"), shares=(8, 8), pp=2, stages=(("0", "1"), ("2",)))
    assert pin.admits(pipeline) and pipeline.global_batch == 8, "both stages compute the same 8 samples"
    assert not pin.admits(Layout.replicated(["a", "b"], [4, 4]))
    assert not pipeline.whole_replicas and Layout.replicated(["a", "b"], [4, 4]).whole_replicas
    assert not Layout(members=("a", "b"), shares=(4, 4), dp_shard=2).whole_replicas


@pytest.mark.process
def test_the_coordinator_refuses_a_pin_of_both_degrees_beyond_max_workers_and_says_the_members_it_waits_for() -> None:
    """`--layout dp=R,fsdp=S` implies R x S members (pp and tp stay 1): found while trying it, such a
    pin was taken as "members unknown", so --max-workers was not checked against it and
    --min-workers was not raised (the job waited with no word of why)."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "coordinator", "--job", "examples/mlp.py:job", "--bind", "tcp://127.0.0.1:0",
            "--insecure"]
    refused = subprocess.run([*base, "--layout", "dp=2,fsdp=2", "--max-workers", "3"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "needs 4 members, but --max-workers is 3" in refused.stderr, refused.stderr
    waiting = subprocess.Popen([*base, "--layout", "dp=2,fsdp=3", "--min-workers", "2"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stderr is not None
        line = waiting.stderr.readline()
        assert "needs 6 members: training starts once 6 workers are ready (--min-workers 2 raised to 6)" in line, line
    finally:
        waiting.terminate()
        waiting.communicate(timeout=30)  # (closes its pipes)
