"""An agent written against the OpenAI client, trained by keel as it is (examples/agent/grpo.yaml).

keel calls `agent` once per sample with an `openai.AsyncOpenAI` client pointed at its endpoint over
the policy being trained. This one answers, asks itself for a second look, and answers again; it
returns None, so the reward function (examples/quickstart/reward.py) scores its last answer. Any
OpenAI-client code works the same way: LangGraph, the OpenAI Agents SDK, a coding agent's loop.
"""


async def agent(client, row, extra_info):
    prompt = row["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append(
        {"role": "user", "content": "Check your answer and give it again, digits only."}
    )
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
    # leave the score to the reward function
    return None
