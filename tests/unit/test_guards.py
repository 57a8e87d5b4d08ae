"""Errors raised while setting up or running a step, each with its code."""

import logging

import pytest
import torch

from keel.config.load import load_config
from keel.diagnostics.codes import (DATA_EMPTY, DEVICE_UNAVAILABLE, MODEL_PATH, NO_EOS, NO_GRADIENT,
                                    NONFINITE_LOSS, KeelError)
from keel.models.load import load_tokenizer
from keel.models.tiny import build_tokenizer
from keel.trainer.rl import RLTrainer
from keel.training.step import apply_gradients


def code_of(fn) -> str:
    with pytest.raises(KeelError) as info:
        fn()
    return info.value.code


def test_missing_model_path(tmp_path):
    assert code_of(lambda: load_tokenizer(tmp_path / "no_model")) == MODEL_PATH


def test_tokenizer_without_pad_gets_eos_with_a_warning(tmp_path, caplog):
    build_tokenizer(with_pad=False).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="keel"):
        tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert "no pad token" in caplog.text


def test_tokenizer_without_eos_is_an_error(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert code_of(lambda: load_tokenizer(tmp_path)) == NO_EOS


def test_dataset_smaller_than_a_batch(tiny_config, tmp_path):
    cfg = load_config(tiny_config, {"data.train_batch_size": 64, "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 64})
    assert code_of(lambda: RLTrainer(cfg)) == DATA_EMPTY
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_a_gpu(tiny_config):
    cfg = load_config(tiny_config, {"trainer.device": "cuda"})
    assert code_of(lambda: RLTrainer(cfg)) == DEVICE_UNAVAILABLE


def test_nonfinite_gradient_is_refused_and_weights_unchanged():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.tensor([[float("nan"), 1.0]])).sum()).backward()
    assert code_of(lambda: apply_gradients(model, optimizer, 1.0, "actor")) == NONFINITE_LOSS
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_no_gradient_is_an_error():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert code_of(lambda: apply_gradients(model, optimizer, 1.0, "actor")) == NO_GRADIENT
