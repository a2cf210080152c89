"""Writing the trained model (`worker.save.save_state`): plain state dicts, each file holding only
its own tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.save import save_state


def test_a_tensor_that_views_a_larger_buffer_is_written_alone(tmp_path: Path) -> None:
    """A pipeline's received stages are views of one flat buffer: the file holds the views' bytes,
    not the buffer's, and loads back to the same values."""
    flat = torch.arange(1_000_000, dtype=torch.float32)
    model = {"a": flat[:100].view(10, 10), "b": flat[100:110]}
    written = save_state(model, {"state": {}, "param_groups": []}, tmp_path)
    assert (tmp_path / "model.pt").stat().st_size < 10_000 and written < 20_000, written
    back = torch.load(tmp_path / "model.pt")
    assert torch.equal(back["a"], flat[:100].view(10, 10)) and torch.equal(back["b"], flat[100:110])
