"""The rules for verl's configuration keys, which keel.config.verl applies. Each verl key is one of
three things in keel: honoured (keel's schema has the key, same meaning), accepted (keel already
does what it asks, or it does not apply: what keel does instead is said once, and `keel check`
lists it), or refused by name (KEEL-C015: what it does in verl, what to use in keel).

The table is verl_rules.yaml: glob patterns over dotted keys, the first match wins. A refusal may
depend on the value: `ulysses_sequence_parallel_size: 1` is accepted (no sequence parallelism),
`2` is refused. Here are the values verl writes that keel takes as its own defaults, the values
verl derives from others, and the defaults keel chose differently.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ACCEPT, RENAME, REFUSE = "accept", "rename", "refuse"


@dataclass(frozen=True)
class Rule:
    pattern: str
    # ACCEPT | RENAME | REFUSE
    kind: str
    # what keel does instead / what verl does, and what to use
    note: str
    # REFUSE only for values this does not allow
    allowed: Callable[[Any], bool] | None = None
    # RENAME: the key's name now (`a.*` -> `b.*` keeps the rest)
    target: str | None = None

    def renamed(self, key: str) -> str | None:
        """`key`'s new name under this RENAME rule (None: no key of keel's)."""
        if self.target and self.target.endswith(".*") and self.pattern.endswith(".*"):
            return self.target[:-1] + key[len(self.pattern) - 1 :]
        return self.target


def quiet(key: str, value) -> bool:
    """A value that asks for nothing (off, unset, one, a class path): accepted without a note."""
    return _off(value) or key.endswith("._target_")


def _off(value) -> bool:
    return value in (
        None,
        False,
        0,
        1,
        "",
        {},
        [],
        "disabled",
        "naive",
        "fsdp",
        "fsdp2",
        "register",
    )


# `unless:` in verl_rules.yaml: the values of a refused key that are verl's defaults
ALLOWED = {
    "off": _off,
    "one": lambda value: value in (None, 1),
    "unset": lambda value: value is None,
    "false": lambda value: not value,
}
NO_VLLM = (
    "keel generates with its own engine (keel has no vLLM or SGLang), whatever the engine setting"
)


def _rule(entry: dict) -> Rule:
    if "rename" in entry:
        return Rule(entry["key"], RENAME, entry["why"], target=entry["rename"])
    if "refuse" in entry:
        unless = entry["unless"]
        allowed = (
            ALLOWED[unless]
            if isinstance(unless, str)
            else (lambda value, listed=tuple(unless): value in listed)
        )
        return Rule(entry["key"], REFUSE, entry["refuse"], allowed)
    return Rule(entry["key"], ACCEPT, entry["accept"].replace("{NO_VLLM}", NO_VLLM))


def _load_rules() -> list[Rule]:
    entries = yaml.safe_load((Path(__file__).parent / "verl_rules.yaml").read_text())
    # A rule naming its section wins over a wildcard; otherwise the file's order.
    return sorted(
        (_rule(entry) for entry in entries), key=lambda rule: rule.pattern.startswith("*")
    )


RULES = _load_rules()

# Values verl writes for a key keel has, meaning "not set": keel uses its own default (said once).
UNSET_VALUES = {
    "reward_model.nnodes": (0,),
    "reward_model.n_gpus_per_node": (0,),
    "actor_rollout_ref.rollout.name": ("???", "vllm", "sglang", "trtllm"),
}


# verl's values for keys keel has that name the same thing differently, or something keel lacks.
VALUE_ALIASES = {
    # same numbers, faster
    "algorithm.adv_estimator": {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"},
    # verl 0.9.1's name for the score before KL
    "algorithm.filter_groups.metric": {"reward": "seq_reward"},
}
VALUE_REFUSALS = {
    "actor_rollout_ref.actor.policy_loss.loss_mode": {
        "clip_cov": "Clip-Cov (arXiv 2505.22617) clips the tokens of highest covariance",
        "kl_cov": "KL-Cov (arXiv 2505.22617) penalises the tokens of highest covariance",
        "geo_mean": "GMPO (arXiv 2507.20673) uses the geometric mean of token ratios",
        "sapo": "SAPO replaces the clip with soft gates (tau_pos, tau_neg)",
        "bypass_mode": "the loss verl sets itself for "
        "algorithm.rollout_correction.bypass_mode=true, which keel reads: set that "
        "key instead",
    },
    "algorithm.adv_estimator": {
        "optimal_token_baseline": "per-token optimal baselines",
        "tir_optimal_token_baseline": "per-token optimal baselines for tool-integrated rollouts",
    },
}

# verl's trackers (trainer.logger, verl/utils/tracking.py of verl 0.9.1) that keel has no sink for.
VERL_LOGGERS = {
    "swanlab": "SwanLab",
    "vemlp_wandb": "Volcano Engine's hosted wandb",
    "clearml": "ClearML",
    "trackio": "Hugging Face's trackio",
    "rl_insight": "verl's RL-Insight",
}

# verl derives these from another key when they are not set (OmegaConf references in its yaml).
DERIVED = {
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    ),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    ),
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "critic.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
}


# Keys whose keel default is deliberately not verl's: (verl's default, why keel's). `keel check`
# shows each one a config leaves unset, so the same script never trains differently in silence.
DIFFERENT_DEFAULTS = {
    "actor_rollout_ref.actor.shuffle": (
        False,
        "samples are shuffled between mini-batches, so a mini-batch is not one prompt's group",
    ),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        True,
        "off: faster for the models that fit; turn it on for long sequences or large models",
    ),
    "trainer.total_epochs": (30, "one pass over the data unless asked"),
    "data.train_batch_size": (1024, "small defaults that run on one GPU or a CPU"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        256,
        "small defaults that run on one GPU or a CPU",
    ),
    "trainer.n_gpus_per_node": (8, "one worker unless asked"),
    "trainer.device": ("cuda", "auto: the GPU when there is one, else the CPU"),
    "trainer.logger": (["console", "wandb"], "console only: a tracker is asked for, never assumed"),
}


def rule_for(key: str) -> Rule | None:
    return next((rule for rule in RULES if fnmatch.fnmatchcase(key, rule.pattern)), None)
