"""Preference pairs: each of TRL's data formats tokenized as a user expects, the reward model's
pairs rendered as it scores them, and the errors bad rows and long pairs raise."""

import logging

import pytest

from keel.data.preference import PairColumns, build_pairs
from keel.errors import (
    DATA_COLUMN,
    EMPTY_COMPLETION,
    IDENTICAL_PAIR,
    PAIR_TOO_LONG,
    KeelError,
)
from keel.models.chat import conversation_text
from keel.models.tiny import EOS, build_tokenizer, make_tiny_model

COLUMNS = PairColumns("prompt", "chosen", "rejected", "margin")
USER = {"role": "user", "content": "2+2"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer():
    """keel's tokenizer made to start every text with a BOS token, as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_tokenizer()
    bos_id = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{EOS} $A", special_tokens=[(EOS, bos_id)]
    )
    tokenizer.bos_token = EOS
    assert tokenizer("hi")["input_ids"][0] == bos_id
    return tokenizer


def pairs_of(rows, tokenizer, max_length=256, truncation="error", for_reward_model=False):
    return build_pairs(
        rows,
        tokenizer,
        COLUMNS,
        max_length=max_length,
        truncation=truncation,
        for_reward_model=for_reward_model,
    )


def texts(pair, tokenizer) -> tuple[str, str, str]:
    return tuple(tokenizer.decode(ids) for ids in (pair.prompt_ids, *completions(pair)))


def completions(pair):
    return pair.chosen_ids, pair.rejected_ids


def test_strings_are_prompt_then_completion_then_eos(tokenizer):
    (pair,), stats = pairs_of([{"prompt": "2+2=", "chosen": "4", "rejected": "five"}], tokenizer)
    assert pair.prompt_ids == tokenizer("2+2=")["input_ids"]
    assert pair.chosen_ids == tokenizer("4")["input_ids"] + [tokenizer.eos_token_id]
    assert texts(pair, tokenizer) == ("2+2=", "4<|im_end|>", "five<|im_end|>")
    assert (stats.total, stats.truncated, stats.identical) == (1, 0, 0)


def test_strings_start_with_the_tokens_the_tokenizer_adds_as_trl_does(bos_tokenizer):
    # TRL tokenizes a string prompt with the tokenizer's special tokens (a Llama BOS); the
    # completions follow it without any
    (pair,), _ = pairs_of([{"prompt": "2+2=", "chosen": "4", "rejected": "5"}], bos_tokenizer)
    assert pair.prompt_ids == bos_tokenizer("2+2=")["input_ids"]
    assert pair.prompt_ids[0] == bos_tokenizer.bos_token_id
    assert pair.chosen_ids == [bos_tokenizer.convert_tokens_to_ids("4"), bos_tokenizer.eos_token_id]


def test_chat_prompt_with_string_completions_uses_the_chat_template(tokenizer):
    prompt = [{"role": "system", "content": "be brief"}, USER]
    (pair,), _ = pairs_of([{"prompt": prompt, "chosen": "4", "rejected": "five"}], tokenizer)
    opened = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    # the completion is what the assistant turn adds, its end-of-turn included
    assert texts(pair, tokenizer) == (opened, "4<|im_end|>\n", "five<|im_end|>\n")
    whole = tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": "4"}], tokenize=False
    )
    assert tokenizer.decode(pair.prompt_ids + pair.chosen_ids) == whole


def test_a_template_that_opens_the_turn_otherwise_keeps_the_whole_conversation(caplog):
    # a template whose opened assistant turn starts a thought block that a finished conversation
    # does not show (as reasoning models' do): the completion starts where the two part, as in TRL
    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "assistant\n' }}", "assistant\n<think>\n' }}"
    )
    opened = tokenizer.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert opened.endswith("assistant\n<think>\n")
    (pair,), _ = pairs_of([{"prompt": [USER], "chosen": "4", "rejected": "five"}], tokenizer)
    whole = tokenizer.apply_chat_template(
        [USER, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert tokenizer.decode(pair.prompt_ids + pair.chosen_ids) == whole
    assert texts(pair, tokenizer)[1:] == ("4<|im_end|>\n", "five<|im_end|>\n")
    # and the user is told, as TRL tells
    assert "opens the assistant turn with tokens" in caplog.text


def test_a_string_prompt_with_chat_completions_is_one_user_turn(tokenizer):
    row = {
        "prompt": "2+2",
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    (pair,), _ = pairs_of([row], tokenizer)
    (same,), _ = pairs_of([{"prompt": [USER], "chosen": "4", "rejected": "5"}], tokenizer)
    assert pair == same


def test_whole_conversations_share_their_leading_messages_as_the_prompt(tokenizer):
    # TRL's implicit-prompt format: no prompt column, the prompt is what both conversations share
    history = [USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    row = {
        "chosen": history + [{"role": "assistant", "content": "6"}],
        "rejected": history + [{"role": "assistant", "content": "six, I think"}],
    }
    (implicit,), _ = pairs_of([row], tokenizer)
    (explicit,), _ = pairs_of(
        [{"prompt": history, "chosen": "6", "rejected": "six, I think"}], tokenizer
    )
    assert implicit == explicit
    prompt, chosen, rejected = texts(implicit, tokenizer)
    assert prompt.endswith("and 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert (chosen, rejected) == ("6<|im_end|>\n", "six, I think<|im_end|>\n")


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
        {"prompt": [USER], "chosen": "4", "rejected": "five"},
        {
            "chosen": [USER, {"role": "assistant", "content": "4"}],
            "rejected": [USER, {"role": "assistant", "content": "five"}],
        },
    ],
    ids=["strings", "chat-prompt", "conversations"],
)
@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "no-template"])
def test_reward_model_pairs_are_the_text_the_reward_model_scores(tmp_path, row, template):
    from keel.rewards.model import RewardTemplate

    reward_template = RewardTemplate(str(make_tiny_model(tmp_path / "rm")), max_length=None)
    tokenizer = reward_template.tokenizer
    if not template:
        tokenizer.chat_template = None
    (pair,), _ = pairs_of([row], tokenizer, for_reward_model=True)
    prompt = row.get("prompt", [USER])
    for ids, answer in ((pair.chosen_ids, "4"), (pair.rejected_ids, "five")):
        text = reward_template.text(prompt, answer)
        assert text == conversation_text(tokenizer, prompt, answer)
        assert tokenizer.decode(pair.prompt_ids + ids) == text
        # the very tokens the reward model is scored on (keel.rewards.model tokenizes this way)
        assert pair.prompt_ids + ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_reward_model_pairs_add_no_second_bos_to_a_templated_text(bos_tokenizer):
    # the chat template writes the BOS itself (as Llama's does); tokenizing its text with the
    # tokenizer's special tokens would start the sequence with two
    bos_tokenizer.chat_template = "{{ bos_token }}" + build_tokenizer().chat_template
    try:
        row = {"prompt": [USER], "chosen": "4", "rejected": "five"}
        (pair,), _ = pairs_of([row], bos_tokenizer, for_reward_model=True)
    finally:
        bos_tokenizer.chat_template = build_tokenizer().chat_template
    assert pair.prompt_ids.count(bos_tokenizer.bos_token_id) == 1


def test_reward_model_margins_come_from_the_margin_column(tokenizer):
    rows = [
        {"prompt": "a", "chosen": "b", "rejected": "c", "margin": 2},
        {"prompt": "a", "chosen": "d", "rejected": "e"},
    ]
    pairs, _ = pairs_of(rows, tokenizer, for_reward_model=True)
    assert [p.margin for p in pairs] == [2.0, None]


def refused(rows, tokenizer, **options) -> KeelError:
    with pytest.raises(KeelError) as info:
        pairs_of(rows, tokenizer, **options)
    return info.value


@pytest.mark.parametrize(
    "row, named, key",
    [
        ({"prompt": "a", "chosen": "b"}, "'rejected'", "data.rejected_key"),
        ({"prompt": "a", "answer": "b", "rejected": "c"}, "'chosen'", "data.chosen_key"),
        ({"question": "a", "chosen": "b", "rejected": "c"}, "'prompt'", "data.prompt_key"),
    ],
    ids=["no-rejected", "no-chosen", "no-prompt-for-strings"],
)
def test_a_missing_column_names_it_and_the_key_to_set(tokenizer, row, named, key):
    error = refused([row], tokenizer)
    assert error.code == DATA_COLUMN
    assert named in error.message and key in error.fix


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "a", "chosen": "  ", "rejected": "c"},
        {"prompt": [USER], "chosen": [{"role": "assistant", "content": ""}], "rejected": "c"},
    ],
    ids=["string", "chat"],
)
def test_an_empty_completion_is_refused_with_its_row(tokenizer, row):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, row]
    error = refused(rows, tokenizer)
    assert error.code == EMPTY_COMPLETION
    assert "row 1" in error.message and "'chosen'" in error.message and "row 1" in error.fix


def test_all_pairs_identical_is_refused(tokenizer):
    rows = [{"prompt": "a", "chosen": "same", "rejected": "same"}] * 3
    error = refused(rows, tokenizer)
    assert error.code == IDENTICAL_PAIR and "3 of 3" in error.message
    assert "data.chosen_key" in error.fix


def test_some_identical_pairs_are_dropped_with_a_warning(tokenizer, caplog):
    rows = [
        {"prompt": "a", "chosen": "same", "rejected": "same"},
        {"prompt": "a", "chosen": "b", "rejected": "c"},
        {"prompt": "d", "chosen": "e", "rejected": "f"},
    ]
    with caplog.at_level(logging.WARNING, logger="keel"):
        pairs, stats = pairs_of(rows, tokenizer)
    assert [texts(p, tokenizer)[0] for p in pairs] == ["a", "d"]
    assert (stats.total, stats.identical) == (2, 1)
    assert IDENTICAL_PAIR in caplog.text and "rows [0]" in caplog.text
    assert "1 identical pairs dropped" in stats.summary()


def long_rows(prompt_chars: int) -> list[dict]:
    # the strings format: one token per character, plus EOS on each completion
    return [
        {"prompt": "p" * 4, "chosen": "ok", "rejected": "no"},
        {"prompt": "q" * prompt_chars, "chosen": "yes", "rejected": "not at all"},
    ]


def test_truncation_error_names_the_longest_pair(tokenizer):
    # the second pair: 20 prompt tokens and an 11-token rejected completion
    error = refused(long_rows(20), tokenizer, max_length=16, truncation="error")
    assert error.code == PAIR_TOO_LONG and "row 1" in error.message
    assert "data.max_length=31" in error.fix and "data.truncation=left" in error.fix


def test_truncation_left_keeps_the_end_of_the_prompt_and_the_completions_whole(tokenizer, caplog):
    rows = long_rows(20)
    rows[1]["prompt"] = "start " + "q" * 8 + " the end"
    with caplog.at_level(logging.WARNING, logger="keel"):
        pairs, stats = pairs_of(rows, tokenizer, max_length=16, truncation="left")
    prompt, chosen, rejected = texts(pairs[1], tokenizer)
    # 16 tokens less the 11 of the longer completion
    assert prompt == "e end"
    assert (chosen, rejected) == ("yes<|im_end|>", "not at all<|im_end|>")
    assert texts(pairs[0], tokenizer)[0] == "pppp"
    assert stats.truncated == 1 and "1 prompts cut" in stats.summary()
    assert "1 of 2 prompts cut" in caplog.text and "data.max_length=" in caplog.text


def test_truncation_left_refuses_a_completion_that_alone_does_not_fit(tokenizer):
    # the rejected completion is 11 tokens: with one prompt token it needs 12
    error = refused(long_rows(4), tokenizer, max_length=11, truncation="left")
    assert error.code == PAIR_TOO_LONG and "completion alone does not fit" in error.message
    assert "data.max_length=15" in error.fix
    # at 12 the prompt keeps its last token
    pairs, _ = pairs_of(long_rows(4), tokenizer, max_length=12, truncation="left")
    assert texts(pairs[1], tokenizer)[0] == "q"
