"""A verifiers environment (`verifiers:NAME`) through the API the installed verifiers has: the
classic `verifiers.Environment` (verifiers <= 0.3) here, the v1 API (verifiers >= 0.4) in
verifiers_v1.py. The classic one as keel's rollout: each sample is the environment's own
`rollout`, its model calls made through verifiers' OpenAI chat client at keel's endpoint; each
prompt's group is scored by the environment's rubric at once (`score_group`: a rubric may compare a
group's answers), its reward the sample's, its functions' values keel's
`agent/metrics/<name>/mean`."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import math

from keel.rollout.agent.external.outcome import Outcome, environment_error
from keel.rollout.agent.external.verifiers_v1 import load_v1_agent

# extra_info's key holding the environment's own dataset row
DATA_KEY = "verifiers"


def load_verifiers_agent(name: str, args: dict):
    """The agent of `verifiers:NAME` through the API its package is written against (classic_api);
    loaded once a process (its rows, the check and the rollout read the same one)."""
    key = ("agent", name, json.dumps(args, sort_keys=True, default=str))
    if key not in _LOADED:
        try:
            import verifiers
        except ImportError:
            raise environment_error(
                f"verifiers:{name}", "verifiers is not installed (pip install 'keel[verifiers]')"
            ) from None
        if classic_api(verifiers, name):
            _LOADED[key] = VerifiersAgent(load_verifiers_environment(name, args), name)
        else:
            _LOADED[key] = load_v1_agent(name, args)
    return _LOADED[key]


def classic_api(verifiers, name: str) -> bool:
    """Whether `verifiers:NAME` runs through the classic API: the only one the installed verifiers
    has (<= 0.2), or, where it has both (0.3: v1 beside its classic names), the environment package
    defines the classic contract's load_environment; a v1 taskset package does not."""
    has_classic = hasattr(verifiers, "load_environment")
    if importlib.util.find_spec("verifiers.v1") is None or not has_classic:
        return has_classic
    # as verifiers' env_module_name names it: "org/my-env" is my_env
    module = name.replace("-", "_").split("/")[-1]
    try:
        package = importlib.import_module(module)
    # not importable by that name: the classic loader says why, as it did before v1
    except ImportError:
        return True
    return hasattr(package, "load_environment")


def load_verifiers_environment(name: str, args: dict):
    """verifiers.load_environment(name, **args), or KEEL-C024 saying why there is none; loaded once
    a process (its dataset, the check and the rollout read the same one)."""
    key = (name, json.dumps(args, sort_keys=True, default=str))
    if key not in _LOADED:
        _LOADED[key] = _load(name, args)
    return _LOADED[key]


_LOADED: dict = {}


def _load(name: str, args: dict):
    spec = f"verifiers:{name}"
    try:
        import verifiers
    except ImportError:
        raise environment_error(
            spec, "verifiers is not installed (pip install 'keel[verifiers]')"
        ) from None
    load = getattr(verifiers, "load_environment", None)
    # verifiers 0.4 keeps only its v1 API, whose environments are not loaded this way
    if load is None:
        raise environment_error(
            spec,
            f"verifiers {verifiers.__version__} has neither the classic load_environment nor "
            "verifiers.v1 (pip install 'keel[verifiers]')",
        )
    try:
        env = load(name, **args)
    # the environment's own code: missing or raising, named
    except Exception as error:  # noqa: BLE001
        raise environment_error(
            spec, f"load_environment raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(env, verifiers.Environment):
        raise environment_error(
            spec, f"load_environment returned {type(env).__name__}, not a verifiers.Environment"
        )
    return env


def verifiers_rows(env, name: str, split: str) -> list[dict] | None:
    """The environment's dataset (train) or eval dataset (val) as prompt rows in verl's schema; the
    environment's row rides in extra_info for its rollout. None: it has no such dataset."""
    # None: it has none
    dataset = env.build_dataset() if split == "train" else env.build_eval_dataset()
    if dataset is None:
        return None
    return [
        {
            "prompt": row["prompt"],
            "data_source": f"verifiers:{name}",
            "extra_info": {DATA_KEY: dict(row)},
        }
        for row in dataset
    ]


class VerifiersAgent:
    """A classic verifiers Environment's rollout of each sample, scored by its group."""

    def __init__(self, env, name: str):
        import verifiers

        self.env, self.name = env, name
        self.api = f"verifiers {verifiers.__version__}, classic API: {type(env).__name__}"

    def rows(self, split: str) -> list[dict] | None:
        return verifiers_rows(self.env, self.name, split)

    async def run(self, client, row: dict, extra_info: dict):
        """The environment's rollout of this sample's row -> its verifiers State (scored by the
        group)."""
        import verifiers

        task = extra_info.get(DATA_KEY)
        if task is None:
            raise ValueError(
                f"this row is not from verifiers:{self.name}'s dataset: leave data.train_files / "
                "data.val_files empty for the environment's own"
            )
        # the environment's own (max_tokens, ...), as its generate
        sampling = copy.deepcopy(self.env.sampling_args)
        return await self.env.rollout(
            dict(task), verifiers.OpenAIChatCompletionsClient(client), "keel", sampling
        )

    async def score_group(self, states: list) -> list[Outcome]:
        await self.env.rubric.score_group(states)
        outcomes = [_outcome(state) for state in states]
        for state in states:
            await self.env.rubric.cleanup(state)
        return outcomes


def _outcome(state) -> Outcome:
    reward = state.get("reward")
    metrics = {
        name: float(value)
        for name, value in (state.get("metrics") or {}).items()
        if isinstance(value, (int, float)) and math.isfinite(value)
    }
    if reward is None or not math.isfinite(reward):
        return Outcome(status="error", error=f"the rubric gave reward {reward!r}", metrics=metrics)
    error = state.get("error")
    # the rollout stopped on it; scored as verifiers scores it, and counted
    if error is not None:
        return Outcome(float(reward), "error", f"{type(error).__name__}: {error}"[:500], metrics)
    return Outcome(float(reward), metrics=metrics)
