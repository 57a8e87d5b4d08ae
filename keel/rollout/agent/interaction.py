"""verl's interactions (`multi_turn.interaction_config_path`) run as keel environments.

verl's interaction classes (verl.interactions.base.BaseInteraction: async `start_interaction`,
`generate_response(instance_id, messages) -> (should_terminate, response, score, metrics)`,
`finalize_interaction`) are built once per name from verl's YAML (`interaction: [{name,
class_name, config}]`) and shared by every episode, as verl shares them, each episode being one
instance id. An episode takes the interaction named by its `extra_info.interaction_kwargs.name`
(verl's rule), or the only one configured; the rest of interaction_kwargs goes to the calls, as
in verl. The reply becomes the next user turn, the score adds to the episode's reward, and
`finalize_interaction` runs for every episode after the rollout (verl never calls it; keel does,
so per-episode state does not pile up). Every call runs on one event loop, as in verl.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path
from uuid import uuid4

from keel.errors import TOOL_CONFIG, KeelError
from keel.rollout.agent.environment import Environment

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


def load_interactions(path: str | Path) -> dict[str, object]:
    """name -> interaction instance, from verl's interaction config YAML; anything that does not
    build is an error naming its entry, before any model loads."""
    import yaml

    from keel.rollout.agent.tools import missing_config_fix, resolve_class

    path = Path(path)
    if not path.is_file():
        raise KeelError(TOOL_CONFIG, f"{KEY}={str(path)!r} does not exist",
                        missing_config_fix(str(path), KEY, "verl's interaction config YAML"))
    loaded = yaml.safe_load(path.read_text())
    entries = loaded.get("interaction") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeelError(TOOL_CONFIG, f"{path} has no `interaction:` list",
                        "list them as verl does: interaction: [{name, class_name, config}]")
    interactions = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise KeelError(TOOL_CONFIG, f"{where} has no class_name", "give each interaction a class_name")
        cls = resolve_class(str(entry["class_name"]), where, path.parent, method="generate_response")
        name = entry.get("name") or _default_name(cls.__name__)
        if name in interactions:
            raise KeelError(TOOL_CONFIG, f"{where}: a second interaction named {name!r}", "give each its own name")
        try:
            interactions[name] = cls(config={**(entry.get("config") or {}), "name": name})
        except Exception as error:  # noqa: BLE001 - the user's class: its error, named
            raise KeelError(TOOL_CONFIG, f"{where} ({entry['class_name']}) raised when built: "
                            f"{type(error).__name__}: {error}") from None
    return interactions


def _default_name(class_name: str) -> str:
    """verl's: the class name without its "Interaction" suffix, lower-cased."""
    return (class_name[:-len("Interaction")] if class_name.endswith("Interaction") else class_name).lower()


class InteractionEnvironment(Environment):
    """One episode's side of a verl interaction; config["interactions"]: load_interactions' map."""

    def reset(self, extra_info: dict) -> None:
        super().reset(extra_info)
        interactions = self.config["interactions"]
        self.kwargs = dict(extra_info.get("interaction_kwargs") or {})
        name = self.kwargs.get("name", next(iter(interactions)) if len(interactions) == 1 else None)
        if name not in interactions:
            raise ValueError(f"extra_info.interaction_kwargs.name is {name!r}, not one of {sorted(interactions)}")
        self.interaction, self.instance_id = interactions[name], str(uuid4())
        _run(self.interaction.start_interaction(self.instance_id, **self.kwargs))

    def step(self, text: str) -> tuple[str, float, bool]:
        """verl's messages: the prompt, then every turn so far (tool calls and results included),
        the model's `text` last."""
        prompt = self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": str(self.prompt)}]
        messages = [dict(m) for m in prompt + self.conversation]
        done, reply, score, _ = _run(self.interaction.generate_response(self.instance_id, messages, **self.kwargs))
        return str(reply), 0.0 if score is None else score, bool(done)

    def close(self) -> None:
        finalize = self.interaction.finalize_interaction
        try:  # verl's example takes the instance id; its base class takes nothing
            inspect.signature(finalize).bind(self.instance_id)
            _run(finalize(self.instance_id))
        except TypeError:
            _run(finalize())


class _EventLoop:
    """One event loop on a thread of its own for every interaction call, as verl has one loop: an
    interaction's clients and locks belong to the loop they were made on."""
    loop: asyncio.AbstractEventLoop | None = None
    lock = threading.Lock()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls.lock:
            if cls.loop is None:
                cls.loop = asyncio.new_event_loop()
                threading.Thread(target=cls.loop.run_forever, name="keel-interactions", daemon=True).start()
            return cls.loop


def _run(result):
    """An async method's result, run on the interactions' loop (the agent loop calls environments
    from worker threads, which wait here), or a plain method's."""
    if not inspect.iscoroutine(result):
        return result
    return asyncio.run_coroutine_threadsafe(result, _EventLoop.get()).result()
