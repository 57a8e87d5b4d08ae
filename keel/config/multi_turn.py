"""verl's actor_rollout_ref.rollout.multi_turn section."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import opt


@dataclass
class MultiTurnConfig:
    """verl's rollout.multi_turn: the policy calls tools between its turns (keel.rollout.agent)."""

    enable: bool = opt(
        False,
        help="multi-turn rollouts with tool calls; data.max_response_length is the whole "
        "trajectory's budget",
    )
    max_assistant_turns: int | None = opt(
        None,
        gt=0,
        help="assistant turns per trajectory; null: until the model answers without a call or the "
        "budget ends",
    )
    tool_config_path: str | None = opt(
        None,
        help="verl's tool config YAML: tools: [{class_name, config, "
        "tool_schema}]; class_name keel.tools.Calculator or module.Class",
    )
    function_tool_path: str | None = opt(
        None,
        help="verl's function tools: a Python file whose functions carry "
        "verl's @function_tool (verl.tools.function_tool), each a tool "
        "beside those of tool_config_path; needs verl importable",
    )
    max_parallel_calls: int = opt(
        1, gt=0, help="tool calls run per sample and turn; more are dropped"
    )
    max_tool_response_length: int = opt(
        256, gt=0, help="characters of a tool's output the model sees"
    )
    tool_response_truncate_side: str = opt(
        "middle",
        choices=("left", "middle", "right"),
        help="which part of a longer output is kept: left (its start), middle (both ends), right "
        "(its end)",
    )
    format: str = opt(
        "hermes",
        choices=("hermes",),
        help="how tool calls are written: hermes, <tool_call>{name, arguments}</tool_call>",
    )
    tool_timeout_s: float = opt(
        30.0,
        gt=0,
        help="seconds a tool call (or an environment's step) may take; then the model is told it "
        "timed out",
    )
    environment: str | None = opt(
        None,
        help="keel: a task that answers the model's turns, file.py:Class or "
        "module.Class (keel.rollout.agent.Environment: reset, step -> "
        "observation, reward, done)",
    )
    environment_config: dict = opt(factory=dict, help="given to the environment's class")
    interaction_config_path: str | None = opt(
        None,
        help="verl's interaction config YAML: interaction: [{name, "
        "class_name, config}], a simulated user answering turns "
        "without tool calls (one per episode by "
        "extra_info.interaction_kwargs.name)",
    )
    max_user_turns: int | None = opt(
        None, gt=0, help="an environment's observations per trajectory; null: until it says done"
    )
    max_tokens_per_turn: int | None = opt(
        None,
        gt=0,
        help="keel: tokens one assistant turn may take; a turn cut "
        "there goes on to the tools or environment; null: the "
        "budget left",
    )
