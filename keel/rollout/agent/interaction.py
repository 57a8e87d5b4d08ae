"""verl's interactions (`multi_turn.interaction_config_path`) run as keel environments.

verl's interaction classes (verl.interactions.base.BaseInteraction: async `start_interaction`,
`generate_response(instance_id, messages) -> (should_terminate, response, score, metrics)`,
`finalize_interaction`) are built once per name from verl's YAML (`interaction: [{name,
class_name, config}]`) and shared by every episode, as verl shares them, each episode being one
instance id. An episode takes the interaction named by its `extra_info.interaction_kwargs.name`
(verl's rule), or the only one configured; the rest of interaction_kwargs goes to the calls, as
in verl. The reply becomes the next user turn; `finalize_interaction` runs for every episode after
the rollout (verl never calls it; keel does, so per-episode state does not pile up). Every call
runs on one event loop, as in verl (runner.on_shared_loop). `calculate_score` is the
interaction's own business: verl's loop never calls it (verl's gsm8k interaction calls it inside
generate_response), and neither does keel.

Scores, as verl takes them: verl's agent loop keeps each turn's score in `turn_scores` and adds
none to the score (the reward function's); its SGLang rollout gave them to the reward function as
`extra_info["rollout_reward_scores"]["user_turn_rewards"]`. keel does both (`extra_info.turn_scores`
and that key) and adds nothing, so a verl run scores exactly as in verl. keel's own environments
(environment.py) add their rewards, as keel documents them.
"""

from __future__ import annotations

import inspect
import math
import numbers
from pathlib import Path
from uuid import uuid4

from keel.errors import TOOL_CONFIG, KeelError
from keel.rollout.agent.environment import Environment
from keel.rollout.agent.runner import on_shared_loop

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


def load_interactions(path: str | Path) -> dict[str, object]:
    """name -> interaction instance, from verl's interaction config YAML; anything that does not
    build is an error naming its entry, before any model loads."""
    import yaml

    from keel.rollout.agent.tool_types import missing_config_fix
    from keel.rollout.agent.tools import resolve_class

    path = Path(path)
    if not path.is_file():
        raise KeelError(
            TOOL_CONFIG,
            f"{KEY}={str(path)!r} does not exist",
            missing_config_fix(str(path), KEY, "verl's interaction config YAML"),
        )
    loaded = yaml.safe_load(path.read_text())
    entries = loaded.get("interaction") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeelError(
            TOOL_CONFIG,
            f"{path} has no `interaction:` list",
            "list them as verl does: interaction: [{name, class_name, config}]",
        )
    interactions = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise KeelError(
                TOOL_CONFIG, f"{where} has no class_name", "give each interaction a class_name"
            )
        cls = resolve_class(
            str(entry["class_name"]), where, path.parent, method="generate_response"
        )
        name = entry.get("name") or _default_name(cls.__name__)
        if name in interactions:
            raise KeelError(
                TOOL_CONFIG,
                f"{where}: a second interaction named {name!r}",
                "give each its own name",
            )
        try:
            interactions[name] = cls(config={**(entry.get("config") or {}), "name": name})
        except Exception as error:  # noqa: BLE001 - the user's class: its error, named
            raise KeelError(
                TOOL_CONFIG,
                f"{where} ({entry['class_name']}) raised when built: {type(error).__name__}: "
                f"{error}",
            ) from None
    return interactions


def _default_name(class_name: str) -> str:
    """verl's: the class name without its "Interaction" suffix, lower-cased."""
    return (
        class_name[: -len("Interaction")] if class_name.endswith("Interaction") else class_name
    ).lower()


class InteractionEnvironment(Environment):
    """One episode's side of a verl interaction; config["interactions"]: load_interactions' map."""

    def reset(self, extra_info: dict) -> None:
        super().reset(extra_info)
        interactions = self.config["interactions"]
        self.kwargs = dict(extra_info.get("interaction_kwargs") or {})
        name = self.kwargs.get("name", next(iter(interactions)) if len(interactions) == 1 else None)
        if name not in interactions:
            raise ValueError(
                f"extra_info.interaction_kwargs.name is {name!r}, not one of {sorted(interactions)}"
            )
        self.interaction, self.instance_id = interactions[name], str(uuid4())
        # the loop's tool_timeout_s
        self.timeout_s = self.config.get("timeout_s")
        self.turn_scores: list[float] = []
        _run(self.interaction.start_interaction(self.instance_id, **self.kwargs), self.timeout_s)

    @property
    def reward_scores(self) -> dict[str, list[float]]:
        """What verl's SGLang rollout gave the reward function
        (extra_info.rollout_reward_scores)."""
        return {"user_turn_rewards": list(getattr(self, "turn_scores", []))}

    def step(self, text: str) -> tuple[str, float, bool]:
        """verl's messages: the prompt, then every turn so far (tool calls and results included),
        the model's `text` last. The turn's score is recorded, not added (as in verl)."""
        prompt = (
            self.prompt
            if isinstance(self.prompt, list)
            else [{"role": "user", "content": str(self.prompt)}]
        )
        messages = [dict(m) for m in prompt + self.conversation]
        done, reply, score, _ = _run(
            self.interaction.generate_response(self.instance_id, messages, **self.kwargs),
            self.timeout_s,
        )
        # verl keeps a score that is there
        if score is not None:
            if (
                isinstance(score, bool)
                or not isinstance(score, numbers.Real)
                or not math.isfinite(score)
            ):
                raise ValueError(f"generate_response's score is {score!r}, not a finite number")
            self.turn_scores.append(float(score))
        return str(reply), 0.0, bool(done)

    def close(self) -> None:
        finalize = self.interaction.finalize_interaction
        # verl's example takes the instance id; its base class takes nothing
        try:
            inspect.signature(finalize).bind(self.instance_id)
        except TypeError:
            _run(finalize(), self.timeout_s)
            return
        _run(finalize(self.instance_id), self.timeout_s)


def _run(result, timeout_s: float | None = None):
    """An async method's result, run on the shared loop (the agent loop calls environments from
    worker threads, which wait here), cancelled past the tool timeout; or a plain method's."""
    return on_shared_loop(result, timeout_s) if inspect.iscoroutine(result) else result
