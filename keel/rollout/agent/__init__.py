"""Multi-turn rollouts: the agent loop, tool calls and the tools themselves; agent code and
environment libraries behind keel's OpenAI endpoint in external/."""

from keel.rollout.agent.loop import AgentLoop, AgentOptions, build_agent_loop  # noqa: F401
from keel.rollout.agent.runner import ToolLimits  # noqa: F401
from keel.rollout.agent.tool_types import FunctionTool, Tool, ToolOutput, tool  # noqa: F401
from keel.rollout.agent.tools import Calculator, PythonCode, load_tool_config  # noqa: F401
