"""keel's keys in verl's rollout.agent section: agent code behind an OpenAI client as the rollout.
verl's own keys of the section (its agent-loop workers) are accepted as not needed
(verl_rules.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import opt


@dataclass
class AgentConfig:
    function: str | None = opt(
        None,
        help="keel: agent code as the rollout, module:function or file.py:function: an async "
        "function (client, row, extra_info) called for every sample, its OpenAI client "
        "pointed at keel's endpoint over the policy; it returns the sample's reward, or None "
        "to leave it to the reward function",
    )
    concurrency: int = opt(64, gt=0, help="keel: agents running at once")
    admission_window_ms: float = opt(
        20.0,
        ge=0,
        help="keel: the engine holds turns that arrive while arrivals keep coming (a quiet gap "
        "this long, or four of them at most) and prefills them in one pass; 0: each as it "
        "arrives",
    )
    processes: int | None = opt(
        None,
        ge=0,
        help="keel: processes the agents run in, beside the engine's (their Python then never "
        "holds the GIL the engine's run loop needs); a prompt's samples share one; 0: in the "
        "engine's own process; default: one per two CPU cores of the host, 1 to 8",
    )
    endpoint_processes: int | None = opt(
        None,
        ge=0,
        help="keel: processes keel's OpenAI endpoint runs in (each parses, templates and "
        "tokenizes the requests of its agent processes, so a wave of turns reaches the "
        "engine together); 0: a thread of the engine's process; default: as processes (0 "
        "when the agents run in the engine's process)",
    )
    timeout_s: float = opt(
        600.0,
        gt=0,
        help="keel: seconds an agent may take; past it, it is cancelled and counted "
        "(agent/timeouts)",
    )
    on_prefix_break: str = opt(
        "drop",
        choices=("drop", "segments"),
        help="keel: a sample whose requests do not extend its earlier tokens (the agent rewrote "
        "its history): drop leaves it out of the update; segments trains each continuous "
        "stretch of it as a sequence of its own, all with the sample's reward and advantage, "
        "the sample counted once in its group (agent/prefix_breaks counts them either way)",
    )
    max_prompt_length: int = opt(
        2048,
        gt=0,
        help="keel: tokens an agent's first prompt may take (its own system prompt and tools "
        "included)",
    )
    environment: str | None = opt(
        None,
        help="keel: an environment library's environment as the rollout, run through the same "
        "endpoint: verifiers:NAME (a verifiers environment package: with verifiers >= 0.4 a v1 "
        "taskset loaded by verifiers' own loader, each sample an Episode of its harness, the "
        "taskset's tasks the prompts; with verifiers <= 0.3 a classic environment loaded with "
        "verifiers.load_environment, its dataset the prompts; either when data.train_files is "
        "empty, the environment's reward the reward) or openenv:module:ClientClass (an OpenEnv "
        "environment's client, e.g. openenv.core:MCPToolClient, whose MCP tools the model "
        "calls; its step rewards summed are the reward)",
    )
    environment_args: dict = opt(
        factory=dict,
        help="keel: verifiers v1: verifiers' env config (taskset: the taskset's own config, "
        "agent: its harness and runtime, a local subprocess by default, timeout, ...) and "
        "keel's client (train: token ids through /inference/v1/generate, token-exact, the "
        "default; eval: chat completions, where keel continues a conversation's tokens) and "
        "renderer (verifiers' TrainClient's renderer config, e.g. {name: qwen3}; default auto); "
        "classic verifiers: the keyword arguments of the "
        "environment's load_environment; "
        "openenv: base_url (its server), action_field and observation_field (the text "
        "fields, found when there is one), max_turns, max_tokens (a turn's), step_timeout_s "
        "(a reset, step or tool call; default 60), max_tool_chars (a tool result the model is "
        "shown; default 4096)",
    )
    host: str = opt(
        "127.0.0.1", help="keel: where the endpoint listens (loopback: only this machine's agents)"
    )
