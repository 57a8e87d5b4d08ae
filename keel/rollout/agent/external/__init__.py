"""Agent code and environment libraries as the rollout, behind keel's OpenAI-compatible endpoint.

- rollout.py: the rollout and the batch the samples' traces make.
- agents.py, agent_processes.py: running the agents, in the engine's process or their own.
- openai_server.py, openai_requests.py, openai_responses.py, generate_requests.py (the token-level
  /inference/v1/generate), endpoints.py: the endpoint and where it runs.
- trace.py: each sample's token trace.
- outcome.py: how a sample's agent ended.
- library_env.py, verifiers_env.py, verifiers_v1.py, openenv_env.py: environment libraries as the
  agent.
"""

from keel.rollout.agent.external.rollout import (  # noqa: F401
    ExternalAgentRollout,
    build_external_agent,
)
