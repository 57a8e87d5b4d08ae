"""Two CPU workers (Ray actors, gloo, FSDP2) against one process, and failures that say where."""

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("ray")

from keel.config.load import load_config  # noqa: E402
from keel.data.prompts import collate_prompts  # noqa: E402
from keel.distributed.group import LocalGroup  # noqa: E402
from keel.distributed.pools import role_group  # noqa: E402
from keel.distributed.worker import RoleWorker, WorkerSpec  # noqa: E402
from keel.trainer.roles import WorkerRoles  # noqa: E402
from keel.trainer.setup import load_prompts  # noqa: E402
from keel.types import SamplingParams, TrainBatch  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False
    )
    yield ray
    ray.shutdown()


# fsdp_config keys of each role, by test id
SHARDING = {
    "fsdp": [],
    "replicated": [
        f"{role}.fsdp_config.fsdp_size=1"
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
    ],
    "offload": [
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        "critic.model.fsdp_config.param_offload=true",
    ],
    # LoRA's adapters sharded with the frozen base, which is offloaded, and trap 8: gradient
    # checkpointing on the workers only, and the same gradients as the one process without it.
    "lora": [
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ],
}
LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.actor.optim.lr=1e-2",
]


def train_batch(generated) -> TrainBatch:
    """The training batch of `generated`, whose learning signal each test fills in."""
    zeros = torch.zeros(generated.response_mask.shape)
    return TrainBatch.of(
        generated,
        scores=torch.zeros(len(generated)),
        token_level_rewards=zeros,
        advantages=zeros,
        returns=zeros,
    )


def ppo_config(
    tiny_config: dict,
    workers: int,
    dynamic: bool = False,
    sharding: str = "fsdp",
    critic_pool: bool = False,
    lora: bool = False,
):
    """Every role: actor, reference (KL loss), critic (GAE); two mini-batches of 8 samples. With
    `dynamic`, every forward pass is cut by a token budget (ranks then disagree on how many
    passes they need, and must agree). `sharding`: a key of SHARDING (replicated: fsdp_size=1 for
    every role, i.e. DDP)."""
    dynamic_keys = (
        [
            f"{key}={value}"
            for key, value in [
                ("actor_rollout_ref.actor.use_dynamic_bsz", "true"),
                ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 64),
                ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "true"),
                ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 64),
                ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "true"),
                ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 64),
                ("critic.use_dynamic_bsz", "true"),
                ("critic.ppo_max_token_len_per_gpu", 64),
            ]
        ]
        if dynamic
        else []
    )
    return load_config(
        tiny_config,
        [
            "trainer.device=cpu",
            f"trainer.n_gpus_per_node={workers}",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
            *dynamic_keys,
            *SHARDING[sharding],
            *(["critic.enable_resource_pool=true"] if critic_pool else []),
            *(LORA if lora else []),
        ],
    )


# decoupled: the trainer's weights and mask travel; bypass: computed per micro-batch
ROLLOUT_CORRECTION = {
    "decoupled": [
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=2",
    ],
    "bypass": [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_rs=token_k2",
        "algorithm.rollout_correction.rollout_rs_threshold=1e-7",
    ],
}


@pytest.mark.parametrize("mode", list(ROLLOUT_CORRECTION))
def test_two_workers_correct_the_rollout_as_one_process(tiny_config, tmp_path, ray_cluster, mode):
    """Rollout correction's weights and rejection (given per token by the trainer, or computed in
    the update against the current policy) split across ranks, with token-budget micro-batches and
    a masked filler: the update's numbers are one process's."""
    extra = ROLLOUT_CORRECTION[mode]
    one_cfg = load_config(tiny_config, ["trainer.device=cpu", *extra])
    two_cfg = load_config(
        tiny_config,
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            *extra,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
        ],
    )
    one = WorkerRoles.of(
        LocalGroup(RoleWorker(WorkerSpec.of(one_cfg, total_steps=2))), one_cfg, pad_token_id=0
    )
    tokenizer = one.group.worker.tokenizer
    prompts = collate_prompts(
        load_prompts(one_cfg.data.train_files, tokenizer, one_cfg, "train")[:4],
        tokenizer.pad_token_id,
    ).repeat_interleave(4)
    generated, _ = one.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    # the training batch, whose fields the test fills in
    batch = train_batch(generated).select(list(range(15)))
    torch.manual_seed(0)
    batch = replace(batch, advantages=torch.randn(batch.response_mask.shape) * batch.response_mask)
    batch = replace(
        batch,
        old_log_probs=batch.sampling_log_probs if mode == "bypass" else one.actor_log_probs(batch),
    )
    # what the trainer would compute, made to vary per token
    if mode == "decoupled":
        batch = replace(
            batch,
            rollout_is_weights=(torch.rand(batch.response_mask.shape) * 2) * batch.response_mask,
            rollout_keep=(torch.rand(batch.response_mask.shape) > 0.3).float(),
        )
    two = WorkerRoles.of(
        role_group(two_cfg, 2, None, tmp_path / "stacks"), two_cfg, tokenizer.pad_token_id
    )
    try:
        single, split = one.update_actor(batch, seed=3), two.update_actor(batch, seed=3)
    finally:
        two.shutdown()
    assert single["actor/grad_norm"] > 0
    # the first mini-batch keeps what the second, after an update, rejects
    if mode == "bypass":
        assert 0 < single["rollout_corr/rollout_rs_masked_fraction"] < 1
    for key in [k for k in single if not k.startswith("timing_s/")]:
        assert split[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("sharding", list(SHARDING))
def test_two_workers_take_the_same_step_as_one_process(
    tiny_config, tmp_path, ray_cluster, sharding
):
    """Two workers with token-budget micro-batches against one process with fixed ones: the
    same numbers either way, since every loss is divided by the whole mini-batch's counts. The
    workers shard with FSDP2 (also keeping the actor's layers gathered after forward, and the
    reference's and critic's weights offloaded), or (fsdp_size=1) hold whole models and average
    gradients. The two-worker checkpoint loads into the one process with the same Adam moments."""
    replicated, lora = sharding == "replicated", sharding == "lora"
    one_cfg = ppo_config(tiny_config, 1, lora=lora)
    two_cfg = ppo_config(tiny_config, 2, dynamic=True, sharding=sharding, lora=lora)
    one = WorkerRoles.of(
        LocalGroup(RoleWorker(WorkerSpec.of(one_cfg, total_steps=2))), one_cfg, pad_token_id=0
    )
    tokenizer = one.group.worker.tokenizer
    prompts = collate_prompts(
        load_prompts(one_cfg.data.train_files, tokenizer, one_cfg, "train")[:4],
        tokenizer.pad_token_id,
    ).repeat_interleave(4)
    generated, _ = one.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    # the training batch, whose fields the test fills in
    # odd: one rank's part is padded with a masked sample
    batch = train_batch(generated).select(list(range(15)))
    torch.manual_seed(0)
    batch = replace(
        batch,
        advantages=torch.randn(batch.response_mask.shape) * batch.response_mask,
        returns=torch.randn(batch.response_mask.shape) * batch.response_mask,
    )

    two = WorkerRoles.of(
        role_group(two_cfg, 2, None, tmp_path / "stacks"), two_cfg, tokenizer.pad_token_id
    )
    try:
        assert ("fsdp/actor_sharded_gb" in two.group.call("info", [()] * 2)[0]) != replicated
        # forward passes split across ranks
        for name in ("actor_log_probs", "ref_log_probs", "values"):
            single, split = getattr(one, name)(batch), getattr(two, name)(batch)
            torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-4, msg=name)
        batch = replace(
            batch, old_log_probs=one.actor_log_probs(batch), ref_log_probs=one.ref_log_probs(batch)
        )
        batch = replace(batch, values=one.values(batch))
        for update in ("update_critic", "update_actor"):
            single, split = getattr(one, update)(batch, seed=3), getattr(two, update)(batch, seed=3)
            for key in [k for k in single if not k.startswith("timing_s/")]:
                assert split[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
        # The workers' engines generate with the updated weights (gathered from the shards, or read
        # from the replicated module): the one process's updated policy gives their log-probs.
        after, _ = two.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=1)
        torch.testing.assert_close(
            after.sampling_log_probs, one.actor_log_probs(after), atol=1e-4, rtol=0
        )
        one.save(tmp_path / "one"), (tmp_path / "two").mkdir(), two.save(tmp_path / "two")
    finally:
        two.shutdown()
    optimizer = one.group.worker.actor.optimizer
    moments = [state["exp_avg"].clone() for state in optimizer.state.values()]
    # saved by 2 ranks, loaded by 1
    one.load(tmp_path / "two")
    for mine, theirs in zip(moments, [state["exp_avg"] for state in optimizer.state.values()]):
        torch.testing.assert_close(theirs, mine, atol=1e-7, rtol=1e-4)
    # LoRA saves its adapters only
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    single, split = (load_file(tmp_path / run / "actor" / weights) for run in ("one", "two"))
    assert single.keys() == split.keys()
    # B starts at 0: it moved, and nothing of the base is in the checkpoint
    if lora:
        assert (
            all("lora_" in k for k in single)
            and max(float(single[k].abs().max()) for k in single if "lora_B" in k) > 1e-3
        )
    else:
        # loaders find the model's class by this name, never FSDP's wrapper
        import json

        architectures = json.loads((tmp_path / "two" / "actor" / "config.json").read_text())[
            "architectures"
        ]
        assert architectures == ["Qwen2ForCausalLM"]
        initial = load_file(Path(one_cfg.actor_rollout_ref.model.path) / "model.safetensors")
        moved = max(float((initial[k] - single[k]).abs().max()) for k in single)
        # two Adam steps at lr 1e-3
        assert moved > 1e-3
    # Adam amplifies rounding where a gradient is ~0: 1% of one step's size
    for key in single:
        torch.testing.assert_close(split[key], single[key], atol=1e-5, rtol=0, msg=key)


def test_a_critic_on_workers_of_its_own_takes_the_same_step(tiny_config, tmp_path, ray_cluster):
    """critic.enable_resource_pool: the policy and the critic in different Ray workers. Values and
    the critic update equal the colocated single process's, and the checkpoint is the same files:
    the single process loads the pool's critic and computes the same values."""
    one_cfg, pool_cfg = ppo_config(tiny_config, 1), ppo_config(tiny_config, 1, critic_pool=True)
    one = WorkerRoles.of(
        LocalGroup(RoleWorker(WorkerSpec.of(one_cfg, total_steps=2))), one_cfg, pad_token_id=0
    )
    tokenizer = one.group.worker.tokenizer
    prompts = collate_prompts(
        load_prompts(one_cfg.data.train_files, tokenizer, one_cfg, "train")[:4],
        tokenizer.pad_token_id,
    ).repeat_interleave(4)
    generated, _ = one.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), seed=0)
    # the training batch, whose fields the test fills in
    batch = train_batch(generated)
    torch.manual_seed(0)
    batch = replace(
        batch,
        advantages=torch.randn(batch.response_mask.shape) * batch.response_mask,
        returns=torch.randn(batch.response_mask.shape) * batch.response_mask,
    )
    batch = replace(batch, values=one.values(batch))

    policy = role_group(pool_cfg, 2, None, tmp_path / "stacks")
    critic = role_group(
        pool_cfg, 2, None, tmp_path / "stacks", roles=frozenset({"critic"}), world_size=1
    )
    pooled = WorkerRoles.of(policy, pool_cfg, tokenizer.pad_token_id, critic)
    try:
        assert (
            policy.call("info", [()])[0]["rollout_engine"]
            and critic.call("info", [()])[0]["rollout_engine"] is None
        )
        torch.testing.assert_close(pooled.values(batch), batch.values, atol=1e-5, rtol=1e-4)
        single, split = one.update_critic(batch, seed=3), pooled.update_critic(batch, seed=3)
        for key in [k for k in single if not k.startswith("timing_s/")]:
            assert split[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
        (tmp_path / "pooled").mkdir()
        pooled.save(tmp_path / "pooled")
        after = pooled.values(batch)
    finally:
        pooled.shutdown()
    assert (tmp_path / "pooled" / "critic").is_dir() and (tmp_path / "pooled" / "actor").is_dir()
    one.load(tmp_path / "pooled")
    torch.testing.assert_close(one.values(batch), after, atol=1e-5, rtol=1e-4)


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def keel_train(config: Path, *overrides: str, env: dict | None = None, timeout: int = 900):
    return subprocess.run(
        [sys.executable, "-m", "keel", "train", str(config), "trainer.device=cpu", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_checkpoints_resume_on_a_different_number_of_workers(tiny_config, tmp_path):
    from keel.distributed.dist import free_port

    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    port = free_port()
    proc = keel_train(config, "trainer.n_gpus_per_node=2", env={"MASTER_PORT": str(port)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the ranks met where the user said
    assert f":{port} (MASTER_PORT)" in proc.stderr
    run_dir = Path(tiny_config["trainer"]["default_local_dir"])
    from transformers import AutoModelForCausalLM

    from keel.cli import main

    assert main(["export", str(run_dir / "global_step_2"), str(tmp_path / "exported")]) == 0
    # a whole model, not shards
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    initial = AutoModelForCausalLM.from_pretrained(
        tiny_config["actor_rollout_ref"]["model"]["path"]
    )
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), initial.parameters()))

    proc = keel_train(config, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "global_step_2" in proc.stderr
    # and back to 2
    proc = keel_train(config, "trainer.n_gpus_per_node=2", "trainer.total_training_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "global_step_3" in proc.stderr
    import json

    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s for s in steps if s > 0] == [1, 2, 3, 4]


def test_sharding_in_pairs_on_four_workers_keeps_the_sampler_on_the_updated_policy(
    tiny_config, tmp_path
):
    """fsdp_size=2 on 4 workers: shards within pairs, replicated across them (HSDP). After each
    update every engine takes whole weights gathered within its pair: in float32 the sampler's
    log-probs of step 2 agree with the trainer's, which stale or mis-gathered weights would
    break."""
    import json

    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    proc = keel_train(
        config,
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        "trainer.total_training_steps=2",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (
        (Path(tiny_config["trainer"]["default_local_dir"]) / "metrics.jsonl")
        .read_text()
        .splitlines()
    )
    second = [m for m in map(json.loads, lines) if m["step"] == 2][-1]
    assert second["rollout/log_prob_gap"] < 1e-4 and second["actor/grad_norm"] > 0


def test_keel_train_with_the_critic_on_workers_of_its_own(tiny_config, tmp_path):
    """A run with a critic pool, then resumed with the critic colocated: the same checkpoint."""
    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    proc = keel_train(
        config,
        "algorithm.adv_estimator=gae",
        "critic.enable_resource_pool=true",
        "trainer.total_training_steps=1",
        "trainer.save_freq=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 1 critic workers" in proc.stderr
    proc = keel_train(config, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "global_step_1" in proc.stderr
    import json

    metrics = (
        (Path(tiny_config["trainer"]["default_local_dir"]) / "metrics.jsonl")
        .read_text()
        .splitlines()
    )
    assert [json.loads(line)["step"] for line in metrics][-2:] == [
        1,
        2,
    ] and "critic/vf_loss" in json.loads(metrics[-1])


@pytest.mark.parametrize(
    "fault, overrides, code, expected",
    [
        (
            "raise:update_actor:1",
            ["trainer.n_gpus_per_node=2", "trainer.collective_timeout_s=10"],
            "KEEL-P001",
            [
                "rank 1 of 2",
                "role actor_rollout_ref",
                "phase update_actor",
                "InjectedFault",
                "worker traceback",
            ],
        ),
        (
            "die:update_actor:1",
            ["trainer.n_gpus_per_node=2", "trainer.collective_timeout_s=10"],
            "KEEL-P002",
            ["rank 1 of 2", "phase update_actor", "Last memory reading: rss_gb="],
        ),
        (
            "hang:update_actor:1",
            ["trainer.n_gpus_per_node=2", "trainer.collective_timeout_s=10"],
            "KEEL-P003",
            ["Ranks that did not arrive: [1]", "collective timed out"],
        ),
        # The phase deadline first: rank 0 still waits in FSDP's all-gather, rank 1 never came.
        (
            "hang:update_actor:1",
            ["trainer.n_gpus_per_node=2", "trainer.guards.phase_timeout_s=20"],
            "KEEL-P003",
            [
                "ran past trainer.guards.phase_timeout_s",
                "Ranks that did not arrive: [1]; still running: [0, 1]",
            ],
        ),
        (
            "raise:update_critic:0",
            ["algorithm.adv_estimator=gae", "critic.enable_resource_pool=true"],
            "KEEL-P001",
            ["rank 0 of 1", "role critic", "phase update_critic"],
            # a pool's failure names its own role
        ),
    ],
)
def test_a_failing_worker_ends_the_run_with_its_code_and_rank(
    tiny_config, tmp_path, fault, overrides, code, expected
):
    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    proc = keel_train(config, *overrides, env={"KEEL_INJECT_FAULT": fault}, timeout=900)
    assert proc.returncode != 0
    assert f"error[{code}]" in proc.stderr, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    # every rank's stacks were saved; the hung rank's shows where it is
    if fault.startswith("hang"):
        stacks = list(
            Path(tiny_config["trainer"]["default_local_dir"]).glob("stacks_update_actor_*.txt")
        )
        assert stacks and "faults.py" in stacks[0].read_text()


class Waiter:
    """A worker whose call waits for a file (polled with a long limit), or fails."""

    def __init__(self, rank: int = 0, world_size: int = 1, master=None):
        self.rank = rank

    def wait_for(self, path: str, value: int) -> int:
        for _ in range(6000):
            if Path(path).exists():
                return value * 10 + self.rank
            time.sleep(0.05)
        raise TimeoutError(path)

    def fail(self) -> None:
        raise RuntimeError("this rank broke")


def test_a_group_call_submitted_is_a_future_the_driver_need_not_wait_on(ray_cluster, tmp_path):
    """RayGroup.submit returns at once; its future holds the ranks' replies in rank order, or the
    KeelError `call` would raise naming the rank."""
    import ray.cloudpickle

    from keel.distributed.group import RayGroup
    from keel.distributed.ray_cluster import Devices
    from keel.errors import WORKER_RAISED, KeelError

    # the workers cannot import tests/
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayGroup(
        Waiter,
        2,
        Devices(False, 2, {}),
        role="waiters",
        stacks_dir=tmp_path,
        phase_timeout_s=None,
        rendezvous=False,
    )
    try:
        flag = tmp_path / "go"
        first = group.submit("wait_for", [(str(flag), 1), (str(flag), 2)])
        # queued behind the first
        second = group.submit("wait_for", [(str(flag), 3), (str(flag), 4)])
        # the driver goes on while the ranks wait
        assert not first.done() and not second.done()
        flag.touch()
        assert first.result(timeout=300) == [10, 21] and second.result(timeout=300) == [30, 41]
        with pytest.raises(KeelError) as failed:
            group.submit("fail", [(), ()]).result(timeout=300)
        assert failed.value.code == WORKER_RAISED and "this rank broke" in str(failed.value)
    finally:
        group.shutdown()


def test_a_local_groups_submitted_call_has_run_when_it_returns(tmp_path):
    """One worker in the driver's process: submit runs the call there and then; a failure is in its
    future."""
    group = LocalGroup(Waiter())
    (tmp_path / "go").touch()
    assert group.submit("wait_for", [(str(tmp_path / "go"), 5)]).result(timeout=0) == [50]
    failed = group.submit("fail", [()])
    assert failed.done() and isinstance(failed.exception(), RuntimeError)
