"""The `trainer` section: what every run's trainer section holds (RL's and SFT's: its name, where it
writes, how long it runs, where it computes and logs), then RL's own: validation, workers, keel's
run-time guards and the user's hooks."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import opt


@dataclass(frozen=True)
class OffPolicy:
    """How far generation runs ahead of training: trainer.mode, max_off_policy_steps,
    partial_rollout and off_policy_strategy read as one value. `trainer.mode` is keel's shorthand:
    sync has bound 0 and nothing ahead. async with bound 0 still scores ahead, and trains the
    samples a sync run would."""

    # generation and scoring run ahead of training (trainer.mode=async)
    ahead: bool
    # how many policy versions older than the one it updates a trained sample may be
    bound: int
    # a step's round ends when its batch is complete; the rest go on under the next policy
    partial: bool
    # partial rollouts: "wait" for the oldest prompts, or "drop" a group past the bound
    strategy: str

    @property
    def drop(self) -> bool:
        return self.strategy == "drop"

    @property
    def name(self) -> str:
        """The trainer.mode this value stands for."""
        return "async" if self.ahead else "sync"


@dataclass
class GuardsConfig:
    nonfinite: str = opt(
        "stop", choices=("stop", "skip"), help="NaN/inf in a stage: stop, or skip the step"
    )
    zero_signal_steps: int = opt(5, gt=0, help="warn after this many steps with no reward variance")
    max_clip_ratio: float = opt(
        0.9, ge=0, le=1, help="warn when more responses hit max_response_length"
    )
    min_response_length: float = opt(1.5, ge=0, help="warn when responses average fewer tokens")
    min_entropy: float = opt(0.01, ge=0, help="warn below this entropy (collapse)")
    max_kl: float = opt(1.0, gt=0, help="warn above this ppo_kl or ref_kl (blow-up)")
    max_log_prob_gap: float = opt(
        0.1,
        gt=0,
        help="mean |sampler - trainer| log-prob per token past which the "
        "engine is out of sync with the trainer (KEEL-T006); bf16 numerics give about 0.01",
    )
    phase_timeout_s: float | None = opt(
        3600.0,
        gt=0,
        help="a phase running longer dumps stacks and exits "
        "(null: never; a hang outside a collective would wait forever)",
    )


@dataclass
class RunOptions:
    """What every run's trainer section holds (RL's and SFT's): its name, where it writes, how long
    it runs, where it computes and logs."""

    project_name: str = opt("keel")
    experiment_name: str = opt("run")
    default_local_dir: str | None = opt(None, help="default: checkpoints/<project>/<experiment>")
    total_epochs: int = opt(1, gt=0)
    total_training_steps: int | None = opt(None, gt=0, help="default: epochs x batches per epoch")
    save_freq: int = opt(-1, help="checkpoint every N steps; -1: only at the end")
    resume_mode: str = opt("auto", help="auto | disable | path of a global_step_<N> dir")
    seed: int = opt(1, ge=0)
    device: str = opt("auto", choices=("auto", "cpu", "cuda"))
    logger: list[str] = opt(
        factory=lambda: ["console"],
        choices=("console", "wandb", "tensorboard", "mlflow"),
        help="console and experiment trackers (pip install -e '.[tracking]' in keel's checkout); "
        "metrics.jsonl is always written",
    )


class NamedRun:
    """A config whose `trainer` section names its run directory (RL's, SFT's, preference
    training's)."""

    @property
    def run_dir(self) -> str:
        t = self.trainer
        return t.default_local_dir or f"checkpoints/{t.project_name}/{t.experiment_name}"


# The keys a resumed run on fixed data (SFT, DPO, reward models) may change: when it stops, how
# often it validates, logs and saves, where it writes, and how it cuts micro-batches.
OFFLINE_RESUME_MAY_CHANGE = (
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.max_ckpt_to_keep",
    "trainer.resume_mode",
    "trainer.logger",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.device",
    "data.val_files",
    "data.micro_batch_size_per_gpu",
)


@dataclass
class TrainerConfig(RunOptions):
    test_freq: int = opt(-1, help="validate every N steps; -1: never")
    val_before_train: bool = opt(True)
    max_actor_ckpt_to_keep: int | None = opt(None, gt=0, help="older checkpoints are deleted")
    log_samples: int = opt(4, ge=0, help="samples per step written to samples.jsonl")
    log_val_generations: int = opt(
        0,
        ge=0,
        help="validation samples per evaluation: a table to the trackers, and "
        "samples.jsonl (split: val), which keel report shows",
    )
    n_gpus_per_node: int = opt(1, gt=0, help="workers per node (CPU processes with device=cpu)")
    nnodes: int = opt(1, gt=0, help="nodes of the Ray cluster (RAY_ADDRESS) to train on")
    collective_timeout_s: float = opt(
        300.0, gt=0, help="a collective waiting longer fails (NCCL's default is 600 s)"
    )
    guards: GuardsConfig = opt(factory=GuardsConfig)
    hooks: list[str] = opt(
        factory=list, help="`module:function` called as fn(step, metrics, batch)"
    )
    hook_freq: int = opt(1, gt=0, help="call hooks every N steps")
    mode: str = opt(
        "sync",
        choices=("sync", "async"),
        help="sync: a step trains the samples it generated; async: generation and scoring run up "
        "to max_off_policy_steps steps ahead of training, so rewards score on the host while "
        "the GPU generates and trains, and samples are up to that many policy versions old "
        "(rollout correction corrects for it)",
    )
    max_off_policy_steps: int = opt(
        1,
        ge=0,
        help="async: how many policy versions older than the one it updates a trained sample may "
        "be (0: none, which is sync); generation waits for training rather than go further "
        "ahead",
    )
    partial_rollout: bool = opt(
        False,
        help="async: a step's generation ends when its batch is complete, not at the slowest "
        "sample; samples still generating keep their tokens and go on under the next policy "
        "(each token tagged with its version); max_off_policy_steps + 1 batches of prompts "
        "are under way; needs the native engine",
    )
    off_policy_strategy: str = opt(
        "wait",
        choices=("wait", "drop"),
        help="partial rollouts: wait (a step trains the oldest prompts, once they finished: none "
        "passes max_off_policy_steps) or drop (a step trains the first groups to finish; a "
        "group that would pass the bound is dropped, which trains long responses less often "
        "than sampled)",
    )

    @property
    def off_policy(self) -> OffPolicy:
        """The four off-policy keys as one value: the one place trainer.mode is read."""
        ahead = self.mode == "async"
        return OffPolicy(
            ahead=ahead,
            bound=self.max_off_policy_steps if ahead else 0,
            partial=self.partial_rollout,
            strategy=self.off_policy_strategy,
        )
