"""What a second reading of preference training found: rows of the wrong form, settings another
objective would not read, a model retrained in place, a reward model read where keel's scorer
reads it when pad is EOS, and the shared prompt kept to attention that honours its mask."""

import pytest
import torch

from keel.config.load import load_config
from keel.config.preference import PreferenceConfig, PreferenceDataConfig
from keel.data.preference import PairColumns, PreferencePair, build_pairs
from keel.errors import DATA_COLUMN, EMPTY_COMPLETION, PREFERENCE_OPTION, KeelError
from keel.models.tiny import build_tokenizer, make_tiny_model, make_tiny_reward_model
from keel.trainer.reference_logps import model_identity
from keel.training.preference import collate_pairs, pair_scores
from keel.training.shared_prompt import can_share_prompt

GOOD = {"prompt": "1 2", "chosen": "12", "rejected": "one two"}


def refused_rows(rows, for_reward_model=False, columns=None) -> KeelError:
    with pytest.raises(KeelError) as info:
        build_pairs(
            rows,
            build_tokenizer(),
            columns or PairColumns("prompt", "chosen", "rejected", "margin"),
            max_length=64,
            truncation="left",
            for_reward_model=for_reward_model,
        )
    return info.value


@pytest.mark.parametrize(
    "bad, code",
    [
        ({**GOOD, "chosen": None}, EMPTY_COMPLETION),
        ({**GOOD, "chosen": 5}, DATA_COLUMN),
        ({**GOOD, "rejected": [{"text": "no role"}]}, DATA_COLUMN),
        ({**GOOD, "prompt": None}, DATA_COLUMN),
    ],
)
def test_a_row_of_the_wrong_form_is_named_not_a_traceback(bad, code):
    error = refused_rows([GOOD, bad])
    assert error.code == code and "row 1" in error.message


def test_a_margin_that_is_not_a_number_is_named():
    error = refused_rows([{**GOOD, "margin": "big"}], for_reward_model=True)
    assert error.code == DATA_COLUMN and "'big'" in error.message


def test_a_margin_column_named_but_absent_is_refused():
    data = PreferenceDataConfig(margin_key="score_gap")
    columns = PairColumns.of(data)
    assert columns.margin_named and not PairColumns.of(PreferenceDataConfig()).margin_named
    error = refused_rows([GOOD], for_reward_model=True, columns=columns)
    assert error.code == DATA_COLUMN and "score_gap" in error.message


@pytest.mark.parametrize(
    "objective, setting",
    [
        ("reward_model", {"dpo": {"beta": 0.5}}),
        ("dpo", {"reward_model": {"center_coefficient": 1}}),
    ],
)
def test_the_other_objectives_settings_are_refused_not_ignored(objective, setting):
    source = {
        "objective": objective,
        "data": {"train_files": ["pairs.jsonl"]},
        "model": {"path": "model"},
        **setting,
    }
    with pytest.raises(KeelError) as info:
        load_config(source, schema=PreferenceConfig)
    assert info.value.code == PREFERENCE_OPTION
    # the fix's objective reads them
    other = "dpo" if objective == "reward_model" else "reward_model"
    assert f"`objective={other}`" in info.value.fix
    load_config({**source, "objective": other}, schema=PreferenceConfig)


def test_a_model_retrained_in_place_is_another_reference(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    model = PreferenceConfig().model
    model.path = str(path)
    before = model_identity(model, torch.float32)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    assert model_identity(model, torch.float32) != before
    assert model_identity(model, torch.bfloat16) != model_identity(model, torch.float32)


def test_a_reward_model_is_read_where_transformers_reads_when_pad_is_eos(tmp_path):
    """Llama-3-Instruct, Mistral: no pad token, so pad = EOS, and the template ends with EOS;
    transformers' head (keel's scorer) reads the token before it, and so must training."""
    from transformers import AutoModelForSequenceClassification

    eos = build_tokenizer().eos_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        make_tiny_reward_model(tmp_path / "rm"), num_labels=1, dtype=torch.float32
    ).eval()
    model.config.pad_token_id = eos
    pairs = [PreferencePair([20, 21, 22], [30, 31, eos], [40, eos]), PreferencePair([], [5], [6])]
    sequences = [p.prompt_ids + c for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    with torch.no_grad():
        expected = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])
        for padding_free, share_prompt in [(True, False), (False, False), (True, True)]:
            batch = collate_pairs(pairs, eos, padding_free, 64, share_prompt)
            chosen, rejected = pair_scores(model, batch)
            got = torch.stack([chosen, rejected], dim=1).reshape(-1)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_shared_prompt_needs_attention_that_honours_its_mask(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m")
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    # eager attention adds a 4-D mask to its scores: a boolean one would mask nothing
    assert can_share_prompt(sdpa.config, 256) and not can_share_prompt(eager.config, 256)
