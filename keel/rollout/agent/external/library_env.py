"""Environments of environment libraries as the rollout
(`actor_rollout_ref.rollout.agent.environment`), run unchanged through keel's OpenAI-compatible
endpoint as agent code is (rollout.py):

- `verifiers:NAME`: a verifiers environment package (verifiers_env.py; verifiers_v1.py for
  verifiers >= 0.4): its dataset (taskset) is the prompts, its rollout (Episode) the agent, its
  rubric's (tasks') reward the reward, its functions' values keel's metrics.
- `openenv:module:ClientClass`: an OpenEnv environment's client (openenv_env.py), its server at
  `environment_args.base_url`: the data's prompts, the model's turns its actions, its step rewards
  summed the reward.
"""

from __future__ import annotations

from keel.rollout.agent.external.openenv_env import load_openenv_agent
from keel.rollout.agent.external.outcome import environment_error
from keel.rollout.agent.external.verifiers_env import load_verifiers_agent

LIBRARIES = ("verifiers", "openenv")


def parse_environment(spec: str) -> tuple[str, str]:
    """`library:rest` -> (library, rest), or KEEL-C024."""
    library, _, rest = spec.partition(":")
    if library not in LIBRARIES or not rest:
        raise environment_error(
            spec, "not of the form verifiers:NAME or openenv:module:ClientClass"
        )
    return library, rest


def load_environment_agent(agent):
    """The agent that runs `agent.environment` (a rollout.agent section) for each sample."""
    library, name = parse_environment(agent.environment)
    if library == "verifiers":
        return load_verifiers_agent(name, agent.environment_args)
    return load_openenv_agent(name, agent.environment_args)


def environment_rows(agent, split: str) -> list[dict] | None:
    """The prompts an environment brings (verl's schema), or None where the data files give them:
    a verifiers environment's dataset (`split` train) or eval dataset (val); a v1 taskset's tasks
    (train)."""
    if not agent.environment:
        return None
    library, name = parse_environment(agent.environment)
    if library != "verifiers":
        return None
    return load_verifiers_agent(name, agent.environment_args).rows(split)
