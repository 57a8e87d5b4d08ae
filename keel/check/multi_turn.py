"""`keel check` on multi-turn rollouts: the tools build, the chat template renders tool results, and
the tokens the agent loop builds turn by turn equal the template's rendering of the same
conversation (the first difference, by position, when they do not)."""

from __future__ import annotations

from keel.check.findings import PASS, WARN, Finding, need
from keel.config.schema import KeelConfig
from keel.rollout.agent.environment import load_environment
from keel.rollout.agent.interaction import load_interactions
from keel.rollout.agent.template import first_difference, round_trip
from keel.rollout.agent.tools import load_tools


def check_multi_turn(cfg: KeelConfig, context: dict) -> list[Finding]:
    multi_turn, agent = (
        cfg.actor_rollout_ref.rollout.multi_turn,
        cfg.actor_rollout_ref.rollout.agent,
    )
    if agent.function or agent.environment:
        return [_check_agent(cfg)]
    if not multi_turn.enable:
        return []
    tokenizer = need(context, "tokenizer")
    tools = load_tools(multi_turn)
    environment = (
        load_environment(multi_turn.environment).__name__ if multi_turn.environment else None
    )
    if multi_turn.interaction_config_path:
        environment = "verl interactions " + ", ".join(
            load_interactions(multi_turn.interaction_config_path)
        )
    found = [
        Finding(PASS, "multi-turn", f"tools: {_named(tools)}; environment: {environment or 'none'}")
        if tools or environment
        else Finding(
            WARN,
            "multi-turn",
            "multi_turn.enable with no tool_config_path, environment or "
            "interaction_config_path: nothing answers the model, so every rollout "
            "is one turn",
        )
    ]
    built, reference = round_trip(tokenizer, [t.schema for t in tools])
    position = first_difference(built, reference)
    if position is None:
        found.append(
            Finding(
                PASS,
                "multi-turn",
                f"token-in/token-out: the {len(built)} tokens the loop builds for a "
                "tool call and its answer are the chat template's own",
            )
        )
    else:

        def around(ids: list[int]) -> str:
            return repr(tokenizer.decode(ids[max(0, position - 8) : position + 8]))

        found.append(
            Finding(
                WARN,
                "multi-turn",
                "token-in/token-out: the loop's tokens differ from the chat template's rendering "
                f"at position {position}: {around(built)} against {around(reference)}; the model "
                "is trained on the sampled tokens, which the template would render otherwise at "
                "inference",
            )
        )
    return found


def _check_agent(cfg: KeelConfig) -> Finding:
    """Agent code as the rollout: the function loads, and what the run does with its requests."""
    from keel.rollout.agent.external.agents import load_agent_function
    from keel.rollout.agent.external.library_env import load_environment_agent

    agent = cfg.actor_rollout_ref.rollout.agent
    if agent.environment:
        # KEEL-C024 when the library, the environment or its class is not there
        loaded = load_environment_agent(agent)
        # an environment served elsewhere (OpenEnv's): it answers, and says which library
        # version and tools are in use
        served = loaded.probe() if hasattr(loaded, "probe") else None
        # which library API and version runs it (verifiers: classic or v1)
        api = getattr(loaded, "api", None) or served
        by = f"the environment {agent.environment} ({api + '; ' if api else ''}its reward: the "
        by += "environment's)"
    else:
        # KEEL-C023 when it is not an async def there
        load_agent_function(agent.function)
        by = f"{agent.function} (an async def)"
    return Finding(
        PASS,
        "agent",
        f"rollout by {by} through keel's OpenAI-compatible endpoint on {agent.host} "
        f"({agent.concurrency} at once, {agent.timeout_s:g} s each); trained: the exact tokens it "
        f"sampled; a sample whose requests rewrote its history: {agent.on_prefix_break}",
    )


def _named(tools: list) -> str:
    """The tools by name, verl's marked with how keel runs them and what their rewards do."""
    from keel.rollout.agent.verl_tools import VerlFunctionTool, VerlTool

    def kind(tool) -> str:
        if isinstance(tool, VerlTool):
            return (
                f"{tool.name} (verl {type(tool.tool).__name__}: create, execute, calc_reward, "
                "release per sample)"
            )
        if isinstance(tool, VerlFunctionTool):
            return f"{tool.name} (verl function tool)"
        return tool.name

    named = ", ".join(kind(t) for t in tools) or "none"
    if any(isinstance(t, (VerlTool, VerlFunctionTool)) for t in tools):
        named += (
            "; as in verl, verl's tools' rewards are not added to the score: the reward function "
            "reads them in extra_info.tool_rewards and extra_info.rollout_reward_scores"
        )
    return named
