"""What an OpenEnv environment of MCP tools answers, as keel reads it: listed tools become OpenAI
tool schemas, tool results become capped tool-turn text (errors said as errors), and anything that
is not what OpenEnv promises is the environment's fault, never a silent zero."""

import json
from types import SimpleNamespace

import pytest

from keel.rollout.agent.external.openenv_tools import (
    EnvironmentFault,
    call_arguments,
    step_reward,
    tool_schemas,
    tool_text,
)


def tool(name, schema, description="what it does"):
    return SimpleNamespace(name=name, description=description, input_schema=schema)


def test_listed_tools_become_openai_tool_schemas():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    listed = SimpleNamespace(tools=[tool("add", schema), tool("noop", {}, description=None)])
    assert tool_schemas(listed) == [
        {
            "type": "function",
            "function": {"name": "add", "description": "what it does", "parameters": schema},
        },
        {"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}},
    ]


@pytest.mark.parametrize(
    "listed, said",
    [
        (SimpleNamespace(result="no tools here"), "not a list of tools"),
        (SimpleNamespace(tools=[tool("", {})]), "not a name and an input schema"),
        (SimpleNamespace(tools=[tool("add", "a schema")]), "not a name and an input schema"),
        (None, "NoneType, not a list of tools"),
    ],
)
def test_malformed_tool_lists_are_the_environments_fault(listed, said):
    with pytest.raises(EnvironmentFault, match=said):
        tool_schemas(listed)


def text_result(text, is_error=False, data=None):
    content = [{"type": "text", "text": text}] if text is not None else []
    return {"content": content, "data": data, "is_error": is_error}


@pytest.mark.parametrize(
    "observation, expected",
    [
        (SimpleNamespace(error=None, result=text_result("42", data=42)), "42"),
        (
            SimpleNamespace(error=None, result=text_result("no such file", True)),
            "error: no such file",
        ),
        (
            SimpleNamespace(error=SimpleNamespace(message="timed out"), result=None),
            "error: timed out",
        ),
        # no text content: its data, as JSON
        (
            SimpleNamespace(error=None, result=text_result(None, data={"x": [1, 2]})),
            '{"x": [1, 2]}',
        ),
        # a result that is no MCP result at all: shown as what it is
        (SimpleNamespace(error=None, result=[1, "two"]), '[1, "two"]'),
        (SimpleNamespace(error=None, result="plain"), "plain"),
        (
            SimpleNamespace(reward=1.0),
            "error: the environment answered SimpleNamespace, not a tool",
        ),
    ],
)
def test_tool_results_become_tool_turn_text(observation, expected):
    assert tool_text(observation, 100).startswith(expected)


def test_a_long_tool_result_is_cut_and_says_so():
    text = tool_text(SimpleNamespace(error=None, result=text_result("y" * 5000)), 1000)
    assert text == "y" * 1000 + "\n[cut: 4000 more characters]"


def test_call_arguments_are_an_object_or_the_reason_said_to_the_model():
    def call(arguments):
        return {"function": {"name": "add", "arguments": arguments}}

    assert call_arguments(call(json.dumps({"a": 1}))) == {"a": 1}
    assert call_arguments(call("")) == {}
    assert call_arguments(call("{nope")) == "error: the arguments are not JSON"
    assert call_arguments(call("[1, 2]")) == "error: the arguments are not an object"


def test_step_rewards_are_finite_numbers_or_the_environments_fault():
    assert step_reward(None) == 0.0 and step_reward(2) == 2.0 and step_reward(0.5) == 0.5
    for reward in (float("nan"), float("inf"), "1.0", True, [1]):
        with pytest.raises(EnvironmentFault, match="not a finite number"):
            step_reward(reward)


def test_keel_check_names_the_openenv_in_use_old_or_new(monkeypatch):
    from importlib import metadata

    from keel.rollout.agent.external.openenv_env import openenv_version

    pytest.importorskip("openenv.core")
    installed = {"openenv-core": "0.3.0"}

    def version(dist):
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(metadata, "version", version)
    assert openenv_version().startswith("openenv-core 0.3.0 (its openenv.core API")
    installed["openenv"] = "0.10.0"
    # where both are installed, the new package is the one `openenv` imports
    assert openenv_version() == "openenv 0.10.0 (its openenv.core API, with MCP tools)"
