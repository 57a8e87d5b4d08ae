"""Multi-turn rollouts: the agent loop, tool calls and the tools themselves."""

from keel.rollout.agent.loop import AgentLoop, AgentOptions, build_agent_loop  # noqa: F401
from keel.rollout.agent.runner import ToolLimits  # noqa: F401
from keel.rollout.agent.tools import (  # noqa: F401
    Calculator,
    FunctionTool,
    PythonCode,
    Tool,
    ToolOutput,
    load_tool_config,
    tool,
)
