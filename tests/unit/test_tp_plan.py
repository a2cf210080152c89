"""Which modules tensor parallelism splits and which degrees a model admits (worker.tp_plan)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from worker.job import JobError, load_job
from worker.tp_plan import tp_degrees, tp_dims, tp_styles

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def _job(name: str = "job_short"):  # noqa: ANN202
    return load_job(GPT.read_text(), name, filename=str(GPT))


def _meta(job):  # noqa: ANN001, ANN202
    with torch.device("meta"):
        return job.model()


def test_the_gpt_splits_attention_and_mlp_and_admits_the_degrees_that_divide_its_heads() -> None:
    job = _job()
    model = _meta(job)
    styles = tp_styles(job, model)
    assert styles["1.attn.q"] == styles["1.mlp.0"] == "colwise" and styles["4.attn.proj"] == styles["4.mlp.2"] == "rowwise"
    assert len(styles) == 4 * 6  # (four blocks of six Linears; the head and embeddings unsplit)
    dims = tp_dims(model, styles)
    assert dims["1.attn.q.weight"] == dims["1.attn.q.bias"] == 0 and dims["1.attn.proj.weight"] == 1
    assert dims["1.attn.proj.bias"] is None and dims["5.lm_head.weight"] is None and dims["1.ln1.weight"] is None
    assert tp_degrees(job, model)[0] == [2, 4]  # (4 heads of 32, d_model 128)
    big = _job("job_10m")
    degrees, why = tp_degrees(big, _meta(big))
    assert degrees == [2, 3, 6] and "6 attention heads" in why


def test_a_plan_that_names_no_module_or_a_module_that_is_not_a_linear_is_the_jobs_error() -> None:
    job = _job()
    model = _meta(job)
    with pytest.raises(JobError, match="matches no module"):
        tp_styles(dataclasses.replace(job, tp_plan={"*.attn.qkv": "colwise"}), model)
    with pytest.raises(JobError, match="only nn.Linear"):
        tp_styles(dataclasses.replace(job, tp_plan={"*.ln1": "colwise"}), model)
    with pytest.raises(JobError, match="tp_plan must map"):
        dataclasses.replace(job, tp_plan={"*.attn.q": "sideways"})


def test_a_job_without_a_plan_admits_no_degree_and_says_why() -> None:
    job = dataclasses.replace(_job(), tp_plan=None, tp_heads=None)
    degrees, why = tp_degrees(job, _meta(job))
    assert degrees == [] and "no tensor-parallel plan" in why


def test_a_hugging_face_llama_brings_its_own_plan_and_heads() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    job = dataclasses.replace(_job(), tp_plan=None, tp_heads=None, model=lambda: model)
    styles = tp_styles(job, model)
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise" and styles["model.layers.1.mlp.down_proj"] == "rowwise"
    assert tp_degrees(job, model)[0] == [2]  # (2 key-value heads)
