"""A rollout on workers of its own with LoRA takes only adapters after each update, which keel's
native engine applies: where `auto` would give a model transformers' generate (a family the native
engine does not run), the worker refuses to start, with the code and the fix, rather than generate
without them."""

import pytest

from keel.config.load import load_config
from keel.distributed import rollout_worker
from keel.distributed.worker import WorkerSpec
from keel.errors import INCOMPATIBLE_OPTIONS, KeelError
from keel.rollout.hf import HFRolloutEngine


def test_a_lora_rollout_worker_that_would_generate_with_transformers_refuses_to_start(
    tiny_config, monkeypatch
):
    tiny_config["actor_rollout_ref"]["model"]["lora_rank"] = 8
    cfg = load_config(tiny_config, ["actor_rollout_ref.hybrid_engine=false", "trainer.device=cpu"])
    chosen = []

    def hf_as_auto_would_choose(
        rollout_cfg, model, tokenizer, device, dtype, log_choice, lora=False, **_
    ):
        chosen.append(lora)
        return HFRolloutEngine(model, tokenizer, rollout_cfg.max_num_seqs, dtype)

    monkeypatch.setattr(rollout_worker, "make_rollout_engine", hf_as_auto_would_choose)
    with pytest.raises(KeelError) as refused:
        rollout_worker.RolloutWorker(WorkerSpec.of(cfg, 2, None))
    assert chosen == [True] and refused.value.code == INCOMPATIBLE_OPTIONS
    assert "hybrid_engine=true" in refused.value.fix and "HFRolloutEngine" in refused.value.message
