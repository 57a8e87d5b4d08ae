"""A harness that runs its chat loop in-process (verifiers' Harness contract allows it: every model
call goes through the rollout's interception endpoint): no program to install, so it runs offline,
unlike the uv-script harnesses (null, bash) that fetch their program's packages first."""

import openai
import verifiers.v1 as vf


class ChatHarnessConfig(vf.HarnessConfig):
    # model turns an episode: the user asks again after each but the last
    turns: int = 1
    max_tokens: int | None = None


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for turn in range(self.config.turns):
                if turn:
                    messages.append({"role": "user", "content": "Once more."})
                extra = {"max_tokens": self.config.max_tokens} if self.config.max_tokens else {}
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, **extra
                )
                messages.append(
                    {"role": "assistant", "content": reply.choices[0].message.content or ""}
                )
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
