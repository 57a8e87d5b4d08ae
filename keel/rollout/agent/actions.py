"""What follows an assistant turn in the agent loop (loop.py): its tool calls run, or its
environment's step, and their results appended as the next turn through the chat template; and the
episodes' environments reset before the first turn and closed after the last.

A tool's or an environment's failure (raised, hung, nonsense) is counted on its episode, never an
exception out of the rollout.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from keel.rollout.agent.environment import Environment
from keel.rollout.agent.episode import Episode, last_text
from keel.rollout.agent.runner import ToolRunner
from keel.rollout.agent.template import TurnTemplate


@dataclass
class TurnPlan:
    """What follows the last turn of each of `pending`."""

    pending: list[Episode]
    # its tool calls run
    calling: list[Episode]
    # its environment steps
    talking: list[Episode]
    # id(episode) -> its parsed turn
    parsed: dict


class TurnActions:
    """The tool calls and environment steps between assistant turns, and the turns they append.
    `options`: the loop's AgentOptions (budget, max_user_turns)."""

    def __init__(
        self, tokenizer, template: TurnTemplate, parse, runner: ToolRunner, options, eos_ids: set
    ):
        self.tokenizer, self.template, self.parse = tokenizer, template, parse
        self.runner, self.options, self.eos_ids = runner, options, eos_ids

    def reset_environments(
        self, episodes: list[Episode], environment: type[Environment], config: dict
    ) -> None:
        """An environment each, reset with its episode's extra_info; one that fails is counted and
        left out (its episode ends at its first answer)."""
        environments = [environment(config) for _ in episodes]
        for env, episode in zip(environments, episodes):
            env.prompt, env.conversation = episode.record.raw_prompt, episode.conversation
        resets = self.runner.call_each(
            [
                functools.partial(env.reset, dict(e.record.extra_info))
                for env, e in zip(environments, episodes)
            ]
        )
        for episode, env, (_, status) in zip(episodes, environments, resets):
            episode.environment = env if status == "ok" else None
            episode.environment_errors += status != "ok"

    def close_environments(self, episodes: list[Episode]) -> None:
        """Every environment closed (one that raises or hangs is counted, as a step would be)."""
        # a class with step only
        having = [e for e in episodes if callable(getattr(e.environment, "close", None))]
        for episode, (_, status) in zip(
            having, self.runner.call_each([e.environment.close for e in having])
        ):
            episode.environment_errors += status != "ok"
        # what a verl interaction scored: recorded, not added (interaction.py)
        for episode in episodes:
            episode.reward_scores.update(getattr(episode.environment, "reward_scores", None) or {})

    def plan(self, pending: list[Episode]) -> TurnPlan:
        """What follows each pending sample's last turn: its tool calls, or the environment's
        answer, or nothing (it was the answer: the episode ends)."""
        for episode in pending:
            episode.conversation.append(
                {"role": "assistant", "content": last_text(episode, self.tokenizer)}
            )
        parsed = {id(e): self.parse(e.conversation[-1]["content"]) for e in pending}
        calling = [e for e in pending if parsed[id(e)].calls or parsed[id(e)].malformed]
        talking = [e for e in pending if e not in calling and e.environment is not None]
        for episode in pending:
            episode.done = episode not in calling and episode not in talking
        return TurnPlan(pending, calling, talking, parsed)

    def act(self, plan: TurnPlan) -> tuple[list, list, float]:
        """The plan's tool calls and environment steps run (safe on a thread: the episodes are not
        touched) -> (tool outputs, environment steps, seconds)."""
        start = time.perf_counter()
        outputs = self.runner.run(
            [plan.parsed[id(e)].calls for e in plan.calling], [e.session for e in plan.calling]
        )
        steps = self.runner.call_each(
            [
                functools.partial(e.environment.step, e.conversation[-1]["content"])
                for e in plan.talking
            ]
        )
        return outputs, steps, time.perf_counter() - start

    def apply(self, plan: TurnPlan, outputs: list, steps: list) -> None:
        """What `act` gave, appended to the plan's episodes as their next turns."""
        self._tool_results(plan, outputs)
        self._environment_results(plan.talking, steps)

    def _tool_results(self, plan: TurnPlan, outputs: list) -> None:
        """The calls' results (and malformed calls' errors) appended as tool turns."""
        for episode, results in zip(plan.calling, outputs):
            turn = plan.parsed[id(episode)]
            episode.malformed_calls += len(turn.malformed)
            for output in results:
                episode.count(output)
            messages = [{"role": "tool", "content": r.text} for r in results]
            messages += [{"role": "tool", "content": f"Error: {why}"} for why in turn.malformed]
            episode.tool_turns += self._append(episode, messages)

    def _environment_results(self, talking: list[Episode], steps: list) -> None:
        """Each environment's observation is its episode's next user turn."""
        limit = self.options.max_user_turns
        for episode, (result, status) in zip(talking, steps):
            step = _checked_step(result) if status == "ok" else None
            # raised, hung or answered nonsense: the episode ends, counted
            if step is None:
                episode.environment_errors += 1
                episode.done = True
                continue
            observation, reward, done = step
            episode.turn_reward += reward
            if done or (limit is not None and episode.user_turns >= limit):
                episode.done = True
                continue
            episode.user_turns += self._append(episode, [{"role": "user", "content": observation}])

    def _append(self, episode: Episode, messages: list[dict]) -> bool:
        """The messages' turn and the next generation prompt, through the template; when they leave
        no room for the model to answer, the budget ends the episode instead."""
        suffix = self.template.suffix_ids(messages)
        # a turn cut at max_tokens_per_turn:
        if not episode.ids or episode.ids[-1] not in self.eos_ids:
            # closed as the template closes one
            suffix = [self.template.end_id] + suffix
        if len(episode.ids) + len(suffix) >= self.options.budget:
            episode.cut = episode.done = True
            return False
        episode.add(suffix, None)
        episode.conversation += messages
        return True


def _checked_step(result) -> tuple[str, float, bool] | None:
    """An environment's (observation, reward, done), or None when it is not one."""
    if not (isinstance(result, tuple) and len(result) == 3):
        return None
    observation, reward, done = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        return None
    if reward != reward or abs(reward) == float("inf"):
        return None
    return str(observation), reward, bool(done)
