"""The error catalogue stays honest: every code is tested, and config choices match the
registries."""

from pathlib import Path

from keel import errors as codes
from keel.algorithms import preference as preference_losses
from keel.algorithms.advantages import ADV_ESTIMATORS
from keel.algorithms.kl import KL_ESTIMATORS
from keel.algorithms.losses import LOSS_AGG_MODES, POLICY_LOSSES
from keel.config import preference as preference_config
from keel.config import schema

TESTS = Path(__file__).parents[1]


def test_every_code_is_triggered_by_some_test():
    names = {
        value: name
        for name, value in vars(codes).items()
        if isinstance(value, str) and value in codes.CATALOGUE
    }
    assert set(names) == set(codes.CATALOGUE)
    sources = "\n".join(
        p.read_text() for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name
    )
    untested = sorted(
        f"{code} ({name})"
        for code, name in names.items()
        if name not in sources and code not in sources
    )
    assert not untested, f"codes no test triggers: {untested}"


def test_every_code_has_title_cause_and_fix():
    for entry in codes.CATALOGUE.values():
        assert entry.title and entry.cause and entry.fix, entry.code
        assert entry.code.startswith("KEEL-") and entry.code[5] in "ECMDRTP"


def test_config_choices_match_the_algorithm_registries():
    # keel.config may not import keel.algorithms (layout rule), so the lists are kept in step here
    assert set(schema.ADV_ESTIMATORS) == set(ADV_ESTIMATORS)
    assert set(schema.LOSS_AGG_MODES) == set(LOSS_AGG_MODES)
    assert set(schema.KL_TYPES) == set(KL_ESTIMATORS)
    assert set(
        schema.PolicyLossConfig.__dataclass_fields__["loss_mode"].metadata["choices"]
    ) == set(POLICY_LOSSES)
    assert set(schema.GROUP_ESTIMATORS) == {n for n, e in ADV_ESTIMATORS.items() if e.needs_group}
    # KeelConfig.critic_enabled
    assert {n for n, e in ADV_ESTIMATORS.items() if e.needs_critic} == {"gae"}


def test_preference_config_choices_match_the_losses():
    # keel.config.preference may not import keel.algorithms.preference either
    assert preference_config.LOSS_TYPES == preference_losses.LOSS_TYPES
    assert preference_config.REFERENCE_FREE == preference_losses.REFERENCE_FREE
    assert preference_config.SMOOTHED == preference_losses.SMOOTHED


def test_errors_doc_and_explain_list_every_code(capsys):
    from keel.check.errors_doc import render_errors
    from keel.cli import main

    doc = (TESTS.parent / "docs" / "errors.md").read_text()
    assert doc == render_errors(), "regenerate: python -m keel.check.errors_doc > docs/errors.md"
    assert main(["explain", "--list"]) == 0
    listed = capsys.readouterr().out
    for code in codes.CATALOGUE:
        assert f"### {code}:" in doc and code in listed
    assert main(["explain", "c001"]) == 0 and "fix:" in capsys.readouterr().out
    assert main(["explain", "not-a-code"]) == 2


def test_every_code_raised_in_the_code_base_is_in_the_catalogue():
    import re

    package = TESTS.parent / "keel"
    raised = {
        m for p in package.rglob("*.py") for m in re.findall(r"KEEL-[A-Z]\d{3}", p.read_text())
    }
    assert raised <= set(codes.CATALOGUE)
