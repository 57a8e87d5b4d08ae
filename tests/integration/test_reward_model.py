"""A reward model scores whole responses in its own template; too long is not scored, never cut."""

import pytest
import torch

from keel.check.preflight import run_checks
from keel.config.load import load_config, load_run
from keel.errors import TOKEN_BUDGET, KeelError
from keel.models.tiny import make_tiny_reward_model
from keel.rewards.model import RewardModel


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return make_tiny_reward_model(
        tmp_path_factory.mktemp("rm") / "rm", hidden_size=32, max_position_embeddings=96
    )


def test_reward_model_scores_whole_responses_and_refuses_to_truncate(reward_model_dir):
    rm = RewardModel(
        str(reward_model_dir), torch.device("cpu"), micro_batch_size=2, max_length=None
    )
    chat = [{"role": "user", "content": "2+2?"}]
    # its own template
    assert rm.text(chat, "4").endswith("<|im_start|>assistant\n4<|im_end|>\n")
    scores = rm.score([chat, chat, "plain prompt"], ["4", "5", "x" * 200])
    assert isinstance(scores[0], float) and scores[0] != scores[1]
    # 96 positions
    assert scores[2].startswith("longer than the reward model reads")


def test_keel_train_with_a_reward_model(tiny_config, reward_model_dir):
    from keel.api import train

    overrides = {
        "reward_model.enable": True,
        "reward_model.model.path": str(reward_model_dir),
        "custom_reward_function.path": None,
    }
    result = train(tiny_config, overrides)
    assert result.last_step == 2 and result.last_metrics["reward/not_scored_ratio"] == 0.0


def test_check_measures_the_budget_in_the_reward_models_own_tokens(tiny_config, reward_model_dir):
    overrides = {
        "reward_model.enable": True,
        "reward_model.model.path": str(reward_model_dir),
        "custom_reward_function.path": None,
        "data.max_response_length": 80,
    }
    report = run_checks(*load_run(tiny_config, overrides))
    assert [f.code for f in report.failures] == [TOKEN_BUDGET]
    assert "reward model" in report.failures[0].message


def test_the_tokenizers_model_max_length_is_the_limit_when_it_is_lower(tiny_config, tmp_path):
    """The seed's trap: config.json says 1024 positions, the tokenizer was saved with
    model_max_length=128. The reward model reads 128, and keel check says so."""
    import json

    rm_dir = make_tiny_reward_model(tmp_path / "rm", hidden_size=32, max_position_embeddings=1024)
    settings = json.loads((rm_dir / "tokenizer_config.json").read_text())
    (rm_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 128}))
    overrides = {
        "reward_model.enable": True,
        "reward_model.model.path": str(rm_dir),
        "custom_reward_function.path": None,
        "data.max_response_length": 120,
    }
    report = run_checks(*load_run(tiny_config, overrides))
    assert [f.code for f in report.failures] == [TOKEN_BUDGET]
    assert "over the 128 tokens" in report.failures[0].message
    assert (
        "model_max_length=128" in report.failures[0].message
        and "1024" in report.failures[0].message
    )
    fits = run_checks(*load_run(tiny_config, {**overrides, "data.max_response_length": 32}))
    assert not fits.failures
    assert any("reads 128 tokens (model_max_length=128" in f.message for f in fits.findings)
    # The user may overrule the tokenizer (said in the log), never the positions the model has
    assert (
        RewardModel(str(rm_dir), torch.device("cpu"), micro_batch_size=2, max_length=512).max_length
        == 512
    )
    with pytest.raises(KeelError) as info:
        RewardModel(str(rm_dir), torch.device("cpu"), micro_batch_size=2, max_length=2048)
    assert info.value.code == TOKEN_BUDGET and "max_position_embeddings=1024" in info.value.message


def test_a_truncated_reward_model_file_is_a_coded_error(tiny_config, tmp_path):
    from keel.errors import WEIGHTS_BROKEN

    rm_dir = make_tiny_reward_model(tmp_path / "rm", hidden_size=32, max_position_embeddings=96)
    weights = rm_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(KeelError) as info:
        RewardModel(str(rm_dir), torch.device("cpu"), micro_batch_size=2, max_length=None)
    assert info.value.code == WEIGHTS_BROKEN and "truncated" in info.value.message


@pytest.fixture
def fresh_ray():
    """Ray started by keel in this process, stopped afterwards (other modules start their own)."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    yield
    ray.shutdown()


def test_a_reward_model_pool_scores_as_the_model_in_process(
    tiny_config, reward_model_dir, fresh_ray
):
    """Two replicas in Ray actors, each scoring a share: the same scores, in order, as one model in
    this process, the too-long sample still refused rather than cut."""
    from keel.distributed.pools import RewardModelPool

    cfg = load_config(
        tiny_config,
        {
            "reward_model.enable": True,
            "reward_model.model.path": str(reward_model_dir),
            "reward_model.enable_resource_pool": True,
            "reward_model.n_gpus_per_node": 2,
            "trainer.device": "cpu",
        },
    )
    chat = [{"role": "user", "content": "2+2?"}]
    prompts, responses = (
        [chat, chat, "plain prompt", chat, chat],
        ["4", "5", "x" * 200, "four", "22"],
    )
    pool = RewardModelPool.of(cfg)
    try:
        assert len(pool.replicas) == 2
        pooled = pool.score(prompts, responses)
    finally:
        pool.shutdown()
    local = RewardModel(
        str(reward_model_dir), torch.device("cpu"), micro_batch_size=2, max_length=None
    )
    expected = local.score(prompts, responses)
    assert pooled[2] == expected[2] and pooled[2].startswith("longer than")
    assert pooled[:2] + pooled[3:] == pytest.approx(expected[:2] + expected[3:], abs=1e-5)


def test_keel_train_with_a_reward_model_on_its_own_devices(
    tiny_config, reward_model_dir, fresh_ray
):
    from keel.api import train

    overrides = {
        "reward_model.enable": True,
        "reward_model.model.path": str(reward_model_dir),
        "reward_model.enable_resource_pool": True,
        "custom_reward_function.path": None,
        "trainer.device": "cpu",
        "trainer.total_training_steps": 1,
    }
    result = train(tiny_config, overrides)
    assert result.last_step == 1 and result.last_metrics["reward/not_scored_ratio"] == 0.0


def test_a_reward_model_pool_larger_than_the_cluster_is_refused_before_waiting(
    tiny_config, reward_model_dir, fresh_ray
):
    import ray

    from keel.distributed.pools import RewardModelPool
    from keel.errors import NOT_ENOUGH_DEVICES, KeelError

    # a cluster already running, with 2 CPUs
    ray.init(num_cpus=2, include_dashboard=False)
    cfg = load_config(
        tiny_config,
        {
            "reward_model.enable": True,
            "reward_model.model.path": str(reward_model_dir),
            "reward_model.enable_resource_pool": True,
            "reward_model.n_gpus_per_node": 4,
            "trainer.device": "cpu",
        },
    )
    with pytest.raises(KeelError) as error:
        RewardModelPool.of(cfg)
    assert error.value.code == NOT_ENOUGH_DEVICES and "needs 4 CPUs" in str(error.value)
