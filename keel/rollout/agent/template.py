"""The tokens between turns, token-in/token-out: the model's own tokens are never decoded and
re-encoded; what the loop adds after an assistant turn is exactly the text the chat template puts
after that turn's end token, through the next generation prompt (for ChatML: the newline after
<|im_end|>, then the tool turn, then `<|im_start|>assistant\\n`). Dropping that newline at every
assistant -> tool boundary is the drift verl's PR #6921 fixed: the tokens trained were not the
tokens a template would give the same conversation."""

from __future__ import annotations

from keel.errors import NO_TOOL_ROLE, KeelError

PLACEHOLDER = "keel-assistant-turn"
PROBE = "keel-tool-output"


class TurnTemplate:
    """The chat template's text around assistant turns, found once by rendering a placeholder
    conversation: where an assistant turn's end token (EOS) stops, and what follows it."""

    def __init__(self, tokenizer, tools_schema: list[dict] | None, stop_ids: list[int]):
        """`stop_ids`: the tokens generation stops at; the template must end a turn with one of them
        (Qwen2.5-Instruct stops at <|im_end|> or <|endoftext|>, and ends its turns with
        <|im_end|>)."""
        self.tokenizer, self.tools = tokenizer, tools_schema or None
        self.context = [
            {"role": "user", "content": "keel-user-turn"},
            {"role": "assistant", "content": PLACEHOLDER},
        ]
        rendered = self._render(self.context, generation_prompt=False)
        after = rendered.index(PLACEHOLDER) + len(PLACEHOLDER)
        ends = [
            (i, tokenizer.decode([i]))
            for i in stop_ids
            if rendered.startswith(tokenizer.decode([i]), after)
        ]
        if not ends:
            raise KeelError(
                NO_TOOL_ROLE,
                f"the chat template of {_name(tokenizer)} ends an assistant turn with "
                f"{rendered[after : after + 30]!r}, which starts with none of the stop tokens "
                f"{[tokenizer.decode([i]) for i in stop_ids]}: the turns the model ends could not "
                "be joined to the template's next one",
                "use a chat template whose assistant turns end with a stop token (the tokenizer's "
                "EOS or one in the model's generation_config.eos_token_id)",
            )
        self.end_id, end_text = ends[0]
        self.prefix = rendered[: after + len(end_text)]
        self.check_tool_role()

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` (tool results, a user turn) after an assistant turn the model
        ended, and the generation prompt of the next assistant turn."""
        rendered = self._render(self.context + messages, generation_prompt=True)
        # a template that re-renders earlier turns
        if not rendered.startswith(self.prefix):
            raise KeelError(
                NO_TOOL_ROLE,
                f"the chat template of {_name(self.tokenizer)} renders the turns before a "
                f"{messages[0]['role']} message differently once it follows them",
                "use a chat template that renders each turn on its own (Qwen2.5, Llama 3, ChatML)",
            )
        return self.tokenizer.encode(rendered[len(self.prefix) :], add_special_tokens=False)

    def check_tool_role(self) -> None:
        """A template that drops or rejects role `tool` would hide every tool result from the
        model."""
        try:
            rendered = self._render(
                self.context + [{"role": "tool", "content": PROBE}], generation_prompt=True
            )
        except Exception as error:  # noqa: BLE001 - jinja's raise_exception in the template
            raise KeelError(
                NO_TOOL_ROLE,
                f"the chat template of {_name(self.tokenizer)} refuses a tool message: {error}",
            ) from None
        if PROBE not in rendered[len(self.prefix) :]:
            raise KeelError(
                NO_TOOL_ROLE,
                f"the chat template of {_name(self.tokenizer)} drops tool messages: their "
                "content never reaches the model",
            )

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )


def _name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def first_difference(built: list[int], reference: list[int]) -> int | None:
    """The first position where the loop's tokens differ from the template's (over the loop's
    length: the template may add a newline after the last turn), or None."""
    for position, (a, b) in enumerate(zip(built, reference)):
        if a != b:
            return position
    return None if len(reference) >= len(built) else len(reference)


SAMPLE_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def round_trip(tokenizer, tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """(the loop's tokens, the template's) for one conversation, a question, a tool call, its result
    and an answer: turn by turn as the loop builds it, and apply_chat_template of the same
    messages."""
    turns = TurnTemplate(tokenizer, tools, [tokenizer.eos_token_id])
    eos = turns.end_id
    user = [{"role": "user", "content": "What is 12*34?"}]
    answer = "The answer is 408"

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = tokenizer.apply_chat_template(
        user, tools=tools or None, tokenize=False, add_generation_prompt=True
    )
    built = (
        encode(prompt)
        + encode(SAMPLE_CALL)
        + [eos]
        + turns.suffix_ids([{"role": "tool", "content": "408"}])
        + encode(answer)
        + [eos]
    )
    messages = user + [
        {"role": "assistant", "content": SAMPLE_CALL},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": answer},
    ]
    return built, encode(
        tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
    )
