"""The RL run's directory: the files that say what the run is (config.yaml, batch_plan.json,
check.txt) and its checkpoints, saved and restored so that a resumed run repeats an uninterrupted
one. The actor's weights are the exception: `build_components` loads them from the checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.config.load import to_yaml
from keel.config.plan import make_plan
from keel.config.schema import KeelConfig
from keel.trainer.setup import Components
from keel.trainer.versions import policy_version

log = logging.getLogger("keel")


class RunDirectory:
    def __init__(self, cfg: KeelConfig, components: Components, check_report: str | None = None):
        """`check_report`: `keel check`'s whole report on this config, kept as check.txt."""
        self.cfg = cfg
        self.components = components
        self.check_report = check_report
        self.path = Path(cfg.run_dir)

    def open(self, resumed_step: int | None) -> None:
        """Write the run's description; a resumed run (`resumed_step`) keeps the logs of the steps
        it will not redo."""
        ckpt.init_run_dir(self.path, to_yaml(self.cfg), resumed_step)
        (self.path / "batch_plan.json").write_text(
            json.dumps(make_plan(self.cfg, self.components.plan).as_dict(), indent=2)
        )
        if self.check_report:
            (self.path / "check.txt").write_text(self.check_report + "\n")

    def description(self) -> str:
        return (
            f"run directory: {self.path} (config.yaml: the resolved config; batch_plan.json"
            f"{'; check.txt: the whole of keel check' if self.check_report else ''})"
        )

    def save(self, step: int, guard_counts: dict, sampler_state: dict | None = None) -> Path:
        """The checkpoint of `step`: the workers' weights and optimisers, and trainer_state.pt (the
        step, the sampler's position, the KL controller, the guards' `guard_counts`, RNG states,
        the reward normaliser). `sampler_state`: where a resume draws prompts from, when not the
        sampler's own position (async mode: the oldest batch in flight's)."""
        parts = self.components

        def write(tmp: Path) -> None:
            parts.workers.save(tmp)
            torch.save(
                {
                    "step": step,
                    "sampler": sampler_state or parts.sampler.state_dict(),
                    "policy_version": parts.workers.policy_version,
                    "kl_ctrl": parts.kl_ctrl.state_dict(),
                    **guard_counts,
                    "rng": ckpt.rng_state(),
                    "normalizer": parts.normalizer.state_dict() if parts.normalizer else None,
                },
                tmp / "trainer_state.pt",
            )

        return ckpt.save_checkpoint(
            self.path, step, write, self.cfg.trainer.max_actor_ckpt_to_keep, to_yaml(self.cfg)
        )

    def load(self, path: Path) -> dict:
        """Restore the components from the checkpoint at `path`, but the actor's weights -> its
        trainer_state.pt, whose step and guard counts are the loop's to restore."""
        parts, critic = self.components, self.cfg.critic_enabled
        if critic != (path / "critic").is_dir():
            raise ckpt.mismatch_error(
                path,
                self.cfg,
                f"{path} was saved {'without' if critic else 'with'} a "
                f"critic, but this config {'has' if critic else 'has no'} critic",
            )
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        # checkpoints before the version was saved: the steps' count (a skipped step would make it
        # high)
        parts.workers.load(
            path, state.get("policy_version", policy_version(self.cfg, state["step"]))
        )
        if parts.normalizer is not None and state.get("normalizer"):
            parts.normalizer.load_state_dict(state["normalizer"])
        try:
            parts.sampler.load_state_dict(state["sampler"])
        # the dataset or batch size changed since the checkpoint
        except ValueError as e:
            raise ckpt.mismatch_error(path, self.cfg, f"{path}: {e}") from e
        parts.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if state.get("in_flight_dropped"):
            log.info(
                "trainer.mode=async: %d generated %s in flight at %s; they are dropped and their "
                "prompts generated again",
                state["in_flight_dropped"],
                "samples were" if self.cfg.trainer.partial_rollout else "batches were",
                path.name,
            )
        ckpt.set_rng_state(state["rng"])
        return state
