"""The agent loop: multi-turn rollouts with tool calls, and environments, on any rollout engine.

Every sample alternates: the engine generates an assistant turn; tool calls in it are parsed and run
(all samples' at once); their results go back through the chat template. A turn without a call goes
to the environment when there is one (its observation is the next user turn), else ends the
episode; so do the environment saying done, `max_assistant_turns`, `max_user_turns`, and the
response budget (data.max_response_length, the whole trajectory's).

The sequence trained is the sampled tokens exactly, plus the template's tokens between turns, which
the loss, KL and entropy never see (response_mask 0) but the model attends to (response_attention
1).

On the native engine the engine schedules the turns (continuous batching): an episode keeps its KV
between turns, only the tokens after its last turn are prefilled, its tools run while the others
decode, and waiting episodes take finished ones' rows. Other engines (hf) get one `generate` call
per turn over the samples still going, their whole context as the prompt.
"""

from __future__ import annotations

import dataclasses
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from keel.data.prompts import collate_prompts
from keel.rollout.agent.actions import TurnActions, TurnPlan
from keel.rollout.agent.environment import Environment, load_environment
from keel.rollout.agent.episode import (
    Episode,
    episode_record,
    episode_text,
    episodes_batch,
)
from keel.rollout.agent.interaction import InteractionEnvironment, load_interactions
from keel.rollout.agent.parse import PARSERS
from keel.rollout.agent.runner import ToolLimits, ToolRunner
from keel.rollout.agent.template import TurnTemplate
from keel.rollout.agent.tool_types import Tool
from keel.rollout.agent.tools import load_tools
from keel.rollout.service import EngineService
from keel.types import GeneratedBatch, PromptBatch, SamplingParams


@dataclass
class AgentOptions:
    max_assistant_turns: int = 5
    # an environment's observations; None: until it says done
    max_user_turns: int | None = None
    # response tokens of the whole trajectory
    budget: int = 512
    # tokens one assistant turn may take; None: the budget left
    turn_tokens: int | None = None
    format: str = "hermes"
    limits: ToolLimits = field(default_factory=ToolLimits)


class AgentLoop:
    def __init__(
        self,
        engine,
        tokenizer,
        tools: list[Tool],
        options: AgentOptions,
        eos_ids: list[int],
        environment: type[Environment] | None = None,
        environment_config: dict | None = None,
    ):
        self.engine, self.tokenizer, self.options = engine, tokenizer, options
        self.environment, self.environment_config = environment, environment_config or {}
        self.eos_ids = set(eos_ids)
        self.template = TurnTemplate(tokenizer, [t.schema for t in tools], eos_ids)
        self.parse = PARSERS[options.format]
        self.runner = ToolRunner(tools, options.limits)
        self.actions = TurnActions(
            tokenizer, self.template, self.parse, self.runner, options, self.eos_ids
        )
        self.timing: dict[str, float] = {}
        # An episode's row is final when it ends, unless an environment or verl's lifecycle tools
        # add to it as the batch closes them: only then can its reward begin before the batch is
        # done.
        self.final_when_ended = environment is None and not any(t.lifecycle for t in tools)
        # on_finished, with each episode's row: told as the episode ends
        self.told = None

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, on_finished=None
    ) -> GeneratedBatch:
        """The episodes of every prompt; `on_finished(row, record, response text)` is told of each
        as it ends, where its row is final then (no environment, no lifecycle tools) and the engine
        schedules continuously."""
        episodes = [Episode(r, list(r.prompt_ids)) for r in prompts.records]
        self.timing = {}
        rows = {id(e): row for row, e in enumerate(episodes)}
        self.told = (
            (lambda e: on_finished(rows[id(e)], *self._final(e)))
            if on_finished and self.final_when_ended
            else None
        )
        sessions = self.runner.open([e.record.extra_info.get("tools_kwargs") for e in episodes])
        for episode, session in zip(episodes, sessions):
            episode.session = session
        try:
            if self.environment is not None:
                self.actions.reset_environments(episodes, self.environment, self.environment_config)
            if self.engine.capabilities.continuous:
                self._run_continuously(episodes, dataclasses.replace(params, n=1))
            else:
                while active := [e for e in episodes if not e.done]:
                    self._assistant_turn(active, params)
                    self._next_turn([e for e in active if not e.done])
            self.actions.close_environments(episodes)
        # verl's tools' instances are released whatever happened
        finally:
            self.runner.close(sessions)
        return episodes_batch(prompts, episodes, self.tokenizer)

    def _run_continuously(self, episodes: list[Episode], params: SamplingParams) -> None:
        """The episodes as a client of the engine service (native's continuous batching): an
        episode's KV stays in its row between turns, only the tokens after its last turn are
        prefilled, and its tools run in the background while the other episodes decode. The
        service tells this loop, on one queue, which turns a decode step ended and when tools are
        done."""
        budget = self.options.budget
        service = EngineService(
            self.engine,
            params,
            len(episodes),
            max(len(e.context) for e in episodes) + budget,
            min(budget, self.options.turn_tokens or budget),
        )
        news: queue.Queue = queue.Queue()
        try:
            # the samples of one prompt share its prefill (their group)
            self._ask(service, news, episodes, group=lambda e: e.record.index)
            waiting, acting = len(episodes), 0
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="keel-turn") as pool:
                while waiting or acting:
                    kind, payload = news.get()
                    # the engine failed (out of memory, ...)
                    if kind == "closed":
                        raise payload
                    if kind == "turns":
                        waiting -= len(payload)
                        acting += self._turns_ended(service, pool, news, payload)
                    # a plan's tools and environment steps are done
                    else:
                        acting -= 1
                        waiting += self._acted(service, news, *payload)
        finally:
            service.close()
        self.timing.update(self.engine.timing)

    def _ask(
        self, service, news: queue.Queue, episodes: list[Episode], group=lambda e: None
    ) -> None:
        """The episodes' next assistant turns, submitted together (one prefill pass)."""
        turns = [(e, e.context, self._turn_limit(e), group(e)) for e in episodes]
        if turns:
            service.submit_many(turns, notify=news)

    def _turns_ended(self, service, pool, news: queue.Queue, ended: list) -> int:
        """Turns a decode step ended: recorded, their tools started -> plans started (0 or 1)."""
        for episode, future in ended:
            # a refusal here is keel's bug: raised, never a silent sample
            completion = future.result()
            self._took_turn(episode, completion.ids, completion.log_probs)
        plan = self.actions.plan([e for e, _ in ended if not e.done])
        for episode, _ in ended:
            # its last turn: the row goes to a waiting episode
            if episode.done:
                self._end(service, episode)
        if not (plan.calling or plan.talking):
            return 0
        acted = pool.submit(self.actions.act, plan)
        acted.add_done_callback(lambda done: news.put(("acted", (plan, done))))
        return 1

    def _acted(self, service, news: queue.Queue, plan: TurnPlan, acted: Future) -> int:
        """A plan's results appended; its episodes ask again or end -> turns submitted."""
        self._apply(plan, *acted.result())
        going = [e for e in plan.calling + plan.talking if not e.done]
        for episode in plan.calling + plan.talking:
            if episode.done:
                self._end(service, episode)
        self._ask(service, news, going)
        return len(going)

    def _end(self, service, episode: Episode) -> None:
        """An ended episode's row goes to a waiting one, and its reward may begin (on_finished)."""
        service.end(episode)
        if self.told is not None:
            self.told(episode)

    def _final(self, episode: Episode) -> tuple:
        """(the ended episode's record, its response text): what episodes_batch will give its
        row."""
        return episode_record(episode, self.tokenizer), episode_text(episode, self.tokenizer)

    def _turn_limit(self, episode: Episode) -> int:
        left = self.options.budget - len(episode.ids)
        return min(left, self.options.turn_tokens or left)

    def _assistant_turn(self, active: list[Episode], params: SamplingParams) -> None:
        """One generate call for every active episode's next turn (engines without a scheduler)."""
        left = max(self._turn_limit(e) for e in active)
        # Rows of their own: the engine shares a prefill between rows of one group index.
        records = [
            dataclasses.replace(e.record, index=i, prompt_ids=e.context)
            for i, e in enumerate(active)
        ]
        batch = self.engine.generate(
            collate_prompts(records, self.tokenizer.pad_token_id),
            dataclasses.replace(params, n=1, max_new_tokens=left),
        )
        for part, seconds in self.engine.timing.items():
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        for row, episode in enumerate(active):
            keep = batch.response_mask[row].bool()
            ids = batch.response_ids[row][keep].tolist()[: self._turn_limit(episode)]
            self._took_turn(episode, ids, batch.sampling_log_probs[row][keep].tolist()[: len(ids)])

    def _took_turn(self, episode: Episode, ids: list[int], log_probs: list[float]) -> None:
        episode.add(ids, log_probs)
        episode.assistant_turns += 1
        ended = bool(ids) and ids[-1] in self.eos_ids
        episode.cut = not ended and len(episode.ids) >= self.options.budget
        episode.done = episode.cut or episode.assistant_turns >= self.options.max_assistant_turns

    def _next_turn(self, pending: list[Episode]) -> None:
        plan = self.actions.plan(pending)
        self._apply(plan, *self.actions.act(plan))

    def _apply(self, plan: TurnPlan, outputs: list, steps: list, seconds: float) -> None:
        """The plan's results appended; the seconds they took counted as the tools' time."""
        self.timing["tools"] = self.timing.get("tools", 0.0) + seconds
        self.actions.apply(plan, outputs, steps)


def build_agent_loop(multi_turn, engine, tokenizer, budget: int) -> AgentLoop:
    """The loop of a rollout.multi_turn section around an engine; `budget`:
    data.max_response_length."""
    tools = load_tools(multi_turn)
    limits = ToolLimits(
        multi_turn.max_parallel_calls,
        multi_turn.tool_timeout_s,
        multi_turn.max_tool_response_length,
        multi_turn.tool_response_truncate_side,
    )
    options = AgentOptions(
        max_assistant_turns=multi_turn.max_assistant_turns or budget,
        max_user_turns=multi_turn.max_user_turns,
        budget=budget,
        format=multi_turn.format,
        limits=limits,
        turn_tokens=multi_turn.max_tokens_per_turn,
    )
    environment, environment_config = None, multi_turn.environment_config
    if multi_turn.environment:
        environment = load_environment(multi_turn.environment)
    elif multi_turn.interaction_config_path:
        environment = InteractionEnvironment
        environment_config = {
            "interactions": load_interactions(multi_turn.interaction_config_path),
            "timeout_s": multi_turn.tool_timeout_s,
        }
    return AgentLoop(
        engine, tokenizer, tools, options, engine.eos_ids, environment, environment_config
    )
