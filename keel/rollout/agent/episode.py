"""One sample's trajectory as the agent loop builds it (`Episode`), and the batch finished episodes
make: the tokens as sampled, the template's between turns attended to but never trained on, and
each record's extra_info saying how its episode went (turns, tool calls, what verl's tools and
interactions gave, the conversation)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel.rollout.agent.environment import Environment
from keel.rollout.agent.runner import ToolSession
from keel.rollout.agent.tool_types import ToolOutput
from keel.types import GeneratedBatch, PromptBatch, PromptRecord


# compared by identity
@dataclass(eq=False)
class Episode:
    """One sample's trajectory so far."""

    record: PromptRecord
    # prompt and response so far: the next turn's prompt
    context: list[int]
    # the response
    ids: list[int] = field(default_factory=list)
    # 1 where the model sampled the token
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    tool_turns: int = 0
    # an environment's observations
    user_turns: int = 0
    environment: Environment | None = None
    # its reset or step raised, hung, or answered nonsense
    environment_errors: int = 0
    tool_calls: int = 0
    malformed_calls: int = 0
    # by tool name: calls, errors, timeouts, unknown, truncated, seconds
    tools: dict = field(default_factory=dict)
    # what the model was shown, in order
    tool_outputs: list[str] = field(default_factory=list)
    # the turns after the prompt, as messages
    conversation: list[dict] = field(default_factory=list)
    turn_reward: float = 0.0
    # its tools' instances (verl's tools) and what they gave
    session: ToolSession | None = None
    # verl's rollout_reward_scores: calc_reward, interactions'
    reward_scores: dict = field(default_factory=dict)
    # the budget ended it
    cut: bool = False
    done: bool = False

    def add(self, ids: list[int], log_probs: list[float] | None) -> None:
        self.ids += ids
        self.context += ids
        self.trained += [1 if log_probs is not None else 0] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def counts(self, name: str) -> dict:
        return self.tools.setdefault(
            name,
            {"calls": 0, "error": 0, "timeout": 0, "unknown": 0, "truncated": 0, "seconds": 0.0},
        )

    def count(self, output: ToolOutput) -> None:
        counts = self.counts(output.name)
        counts["calls"] += 1
        counts["seconds"] += output.seconds
        counts["truncated"] += int(output.truncated)
        if output.status != "ok":
            counts[output.status] += 1
        self.tool_calls += 1
        self.turn_reward += output.reward
        self.tool_outputs.append(output.text)


def episodes_batch(prompts: PromptBatch, episodes: list[Episode], tokenizer) -> GeneratedBatch:
    """The batch finished episodes make: the response as sampled, with the template's tokens between
    turns attended to but not trained on, and each record's extra_info saying how its episode
    went."""
    width = max(1, max(len(e.ids) for e in episodes))

    def rows(values: list[list], fill=0, dtype=torch.long) -> Tensor:  # [N, width], right-padded
        out = torch.full((len(values), width), fill, dtype=dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    records = [episode_record(e, tokenizer) for e in episodes]
    trained = rows([e.trained for e in episodes])
    return GeneratedBatch(
        prompt_ids=prompts.input_ids,
        prompt_mask=prompts.attention_mask,
        response_ids=rows([e.ids for e in episodes], tokenizer.pad_token_id),
        response_mask=trained,
        sampling_log_probs=rows([e.log_probs for e in episodes], dtype=torch.float32) * trained,
        group_index=torch.tensor([e.record.index for e in episodes]),
        records=records,
        response_texts=[episode_text(e, tokenizer) for e in episodes],
        truncated=torch.tensor([e.cut for e in episodes]),
        response_attention=rows([[1] * len(e.ids) for e in episodes]),
        turn_rewards=torch.tensor([e.turn_reward for e in episodes]),
    )


def episode_record(e: Episode, tokenizer) -> PromptRecord:
    """The episode's row, its extra_info saying how the episode went (what the reward function
    reads)."""
    return dataclasses.replace(
        e.record,
        extra_info={
            **e.record.extra_info,
            "num_turns": _turns(e),
            "tool_calls": e.tool_calls,
            "tools": _tool_counts(e),
            "tool_outputs": e.tool_outputs,
            "malformed_tool_calls": e.malformed_calls,
            "turn_reward": e.turn_reward,
            "user_turns": e.user_turns,
            "environment_errors": e.environment_errors,
            "cut_by_budget": e.cut,
            # the final answer, for rewards
            "last_turn": last_text(e, tokenizer),
            "conversation": _conversation(e, tokenizer),
            **_verl_rewards(e),
        },
    )


def episode_text(e: Episode, tokenizer) -> str:
    """The episode's response as the reward function reads it: every turn's text, the tools'
    between."""
    return tokenizer.decode(e.ids, skip_special_tokens=True)


def _conversation(episode: Episode, tokenizer) -> list[dict]:
    """The episode's turns as messages, the last assistant turn included (samples.jsonl,
    reports)."""
    last = {"role": "assistant", "content": last_text(episode, tokenizer)}
    ended_on_tool = not episode.conversation or episode.conversation[-1]["role"] == "tool"
    return episode.conversation + [last] if ended_on_tool else list(episode.conversation)


def last_text(episode: Episode, tokenizer) -> str:
    """The text of the assistant turn generated last (the final answer, once the episode ends)."""
    return tokenizer.decode(
        last_sampled_turn(episode.ids, episode.trained), skip_special_tokens=True
    )


def _turns(episode: Episode) -> int:
    """The prompt, the assistant turns and the tool and user turns between them, as verl counts
    num_turns."""
    return 1 + episode.assistant_turns + episode.tool_turns + episode.user_turns


def _tool_counts(episode: Episode) -> dict:
    """The episode's counts by tool, with its session's lifecycle failures (create, calc_reward,
    release) added: on a copy, so a row built twice (told as it ends, then batched) counts each
    failure once."""
    tools = copy.deepcopy(episode.tools)
    for name, status in (episode.session or ToolSession()).failures:
        tools.setdefault(
            name,
            {"calls": 0, "error": 0, "timeout": 0, "unknown": 0, "truncated": 0, "seconds": 0.0},
        )
        tools[name][status] += 1
    return tools


def _verl_rewards(episode: Episode) -> dict:
    """What verl's tools and interactions gave, where verl puts it (verl_tools.py): recorded for the
    reward function, never added to the score."""
    session = episode.session or ToolSession()
    scores = {**session.reward_scores, **episode.reward_scores}
    turn_scores = episode.reward_scores.get("user_turn_rewards", [])
    return {
        **({"rollout_reward_scores": scores} if scores else {}),
        **({"tool_rewards": session.tool_rewards} if session.tool_rewards else {}),
        **({"turn_scores": turn_scores} if turn_scores else {}),
    }


def last_sampled_turn(ids: list[int], trained: list[int]) -> list[int]:
    """The tokens of the assistant turn generated last: the trailing run of sampled tokens (an
    Episode's, or an external agent's trace stretch)."""
    start = len(trained)
    while start > 0 and trained[start - 1]:
        start -= 1
    return ids[start:]
