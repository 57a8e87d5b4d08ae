"""An OpenEnv environment with MCP tools, written with OpenEnv's own classes: each episode asks for
the sum of two numbers; the model has the tools `add` (the sum) and `submit` (its answer), called
through OpenEnv's `CallToolAction`. Submitting ends the episode, 1 if the answer is the sum.

    python examples/agent/keel_calculator_env.py &     # its server, on 127.0.0.1:8123
    python examples/quickstart/prepare.py && keel train examples/agent/openenv.yaml

keel reaches it through OpenEnv's own `MCPToolClient` (openenv:openenv.core:MCPToolClient): it lists
the tools, offers them to the model as tool schemas and runs the model's calls.
"""

import random

from fastmcp import FastMCP
from openenv.core import CallToolAction, MCPEnvironment, Observation, State, create_app


class QuestionObservation(Observation):
    question: str = ""


class CalculatorEnvironment(MCPEnvironment):
    # one instance a session: the server runs many episodes at once
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        tools = FastMCP("calculator")

        @tools.tool
        def add(a: int, b: int) -> int:
            """The sum of a and b."""
            return a + b

        @tools.tool
        def submit(answer: int) -> str:
            """Submit the final answer; the episode ends."""
            self.submitted = answer
            return "submitted"

        super().__init__(tools)
        self.numbers, self.submitted = (0, 0), None
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        rng = random.Random(seed)
        self.numbers, self.submitted = (rng.randint(10, 99), rng.randint(10, 99)), None
        self._state = State(episode_id=episode_id or "", step_count=0)
        a, b = self.numbers
        question = f"What is {a} + {b}? Use the add tool, then submit the sum."
        return QuestionObservation(question=question, done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s=None, **kwargs):
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._scored(action, observation)

    def _scored(self, action, observation):
        """A tool call's observation with the episode's reward once the answer is submitted."""
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and self.submitted is not None:
            observation.reward = float(self.submitted == sum(self.numbers))
            observation.done = True
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs):
        # every action of this environment is a tool call
        return Observation(done=False, reward=0.0, metadata={"error": "call a tool"})

    @property
    def state(self):
        return self._state


app = create_app(
    CalculatorEnvironment,
    CallToolAction,
    QuestionObservation,
    env_name="calculator",
    max_concurrent_envs=64,
)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8123)
