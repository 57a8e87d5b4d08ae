"""DPO and reward-model training on the GPU: bf16 autocast over float32 weights, packed pairs."""

import json
from pathlib import Path

import pytest
import torch

from keel.api import train
from keel.models.tiny import make_tiny_model
from keel.training.preference import collate_pairs, pair_log_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXAMPLES = Path(__file__).parents[2] / "examples" / "quickstart"


@pytest.fixture(scope="module")
def data(quickstart_data) -> Path:
    return quickstart_data


def overrides(data: Path, run_dir: Path) -> list[str]:
    return [
        f"data.train_files=[{data / 'preference.jsonl'}]",
        f"data.val_files=[{data / 'preference_val.jsonl'}]",
        f"model.path={data / 'model'}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.device=cuda",
        "trainer.logger=[]",
    ]


def last_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("config", ["dpo.yaml", "reward_model.yaml"])
def test_preference_training_learns_on_the_gpu(data, tmp_path, config):
    result = train(EXAMPLES / config, overrides(data, tmp_path / "run"))
    metrics = last_metrics(result.run_dir)
    assert metrics["val/rewards/accuracies"] > 0.8
    assert metrics["train/loss"] < 0.69


def test_packed_pairs_equal_padded_pairs_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    from keel.data.preference import PreferencePair

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).cuda()
    torch.manual_seed(0)
    pairs = [
        PreferencePair(
            torch.randint(5, 250, (int(p),)).tolist(),
            torch.randint(5, 250, (int(c),)).tolist(),
            torch.randint(5, 250, (int(r),)).tolist(),
        )
        for p, c, r in torch.randint(3, 40, (8, 3))
    ]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        padded, _ = pair_log_probs(model, collate_pairs(pairs, 0, False, 96))
        for share_prompt in (False, True):
            packed, _ = pair_log_probs(model, collate_pairs(pairs, 0, True, 96, share_prompt))
            # bf16 matmuls over other shapes round differently: per-token error about 1e-2, summed
            torch.testing.assert_close(packed.chosen, padded.chosen, atol=0.5, rtol=0.02)
            torch.testing.assert_close(packed.rejected, padded.rejected, atol=0.5, rtol=0.02)
