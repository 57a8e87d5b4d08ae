"""Every fix line in keel's catalogue is tested by applying it: the test makes the mistake through
the command a user runs, applies the printed fix as printed (fix_apply.py says how), runs the
command again, and that error is gone (the command may pass, or stop at another code).

This module: the mistakes `keel check` finds before any training. test_fix_lines_runs.py: those of
training, SFT, export and the machine. NOT_HERE: the codes whose fix this machine cannot apply.
"""

import json
import re

import pytest
import torch

from keel.errors import CATALOGUE

from fix_apply import apply_and_rerun, attempt, ctx  # noqa: F401 - ctx is a fixture
from test_fix_lines_runs import RUN_CASES

CHAT = [{"role": "user", "content": "Digits please"}]
MODEL = "actor_rollout_ref.model.path="


def digit_rows(n: int, **columns) -> list[dict]:
    return [
        {
            "prompt": CHAT,
            "data_source": "digits",
            "reward_model": {"ground_truth": str(i)},
            **columns,
        }
        for i in range(n)
    ]


def more_tokens(c) -> str:
    """A tokenizer with tokens added after the model was saved: ids past the embedding."""
    from transformers import AutoTokenizer

    model = c.model_copy("grown")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])
    tokenizer.save_pretrained(model)
    return f"actor_rollout_ref.model.path={model}"


def reward(c, body: str, corrected: str | None = None) -> str:
    return f"custom_reward_function.path={c.mistaken('my_reward.py', body, corrected or body)}"


def code_rows(c) -> str:
    """verl's apps rows whose tests are in a form of their own (a "tests" list); the user rewrites
    them."""
    row = {"prompt": CHAT, "data_source": "apps"}
    wrong = {**row, "reward_model": {"ground_truth": json.dumps({"tests": [["1", "1"]]})}}
    right = {
        **row,
        "reward_model": {"ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})},
    }
    return "data.train_files=" + c.mistaken(
        "apps.jsonl", (json.dumps(wrong) + "\n") * 8, (json.dumps(right) + "\n") * 8
    )


def gsm8k_rows(c) -> str:
    """Rows for the built-in gsm8k scorer without the ground truth it compares with; the user adds
    it."""
    row = {"prompt": CHAT, "data_source": "gsm8k"}
    lines = [json.dumps(row), json.dumps({**row, "reward_model": {"ground_truth": "4"}})]
    return "data.train_files=" + c.mistaken(
        "gsm.jsonl", (lines[0] + "\n") * 8, (lines[1] + "\n") * 8
    )


# 0.3 s on an empty response (one keel check tries), over a limit of 0.1 s; the fix's 1 s leaves
# room on a busy machine
SLOW_ON_EMPTY = (
    "import time\n\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    time.sleep(0.3 if not solution_str else 0)\n"
    "    return 0.0\n"
)
SCORE = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    s = solution_str\n"
    "    return {}\n"
)


def launch(c, directory: str, name: str) -> list[str]:
    """verl's launch form, `keel check --config-path DIR --config-name NAME`, over a folder holding
    the tiny config as tiny_base.yaml (`name` may be a YAML written there: its stem is the name)."""
    c.write("tiny_configs/tiny_base.yaml", open(c.config).read())
    return [
        "check",
        "--config-path",
        str(c.tmp / directory),
        "--config-name",
        name.rsplit("/", 1)[-1].split(".")[0],
    ]


PAIR = {"prompt": "Reply with digits: 1 2", "chosen": "12", "rejected": "one, two"}


def dpo_check(c, *overrides: str, pairs: str | None = None) -> list[str]:
    """`keel check` on a DPO config over the tiny model (`objective: dpo`), its pairs in `pairs`
    (default: 8 good ones)."""
    import yaml

    config = {
        "objective": "dpo",
        "data": {
            "train_files": [pairs or c.rows("pairs.jsonl", [PAIR] * 8)],
            "max_length": 64,
            "train_batch_size": 4,
            "micro_batch_size_per_gpu": 2,
        },
        "model": {"path": str(c.assets["model"])},
        "trainer": {"default_local_dir": str(c.tmp / "dpo_run")},
    }
    return ["check", str(c.write("dpo.yaml", yaml.safe_dump(config))), *overrides]


def mistaken_pairs(c, wrong: dict) -> str:
    """A pairs file whose second row is `wrong`, and the file as the user corrects it."""
    rows = [PAIR, wrong] + [PAIR] * 6
    text = "".join(json.dumps(row) + "\n" for row in rows)
    corrected = "".join(json.dumps(row) + "\n" for row in [PAIR] * 7)
    return c.mistaken("pairs.jsonl", text, corrected)


# code -> the mistake: a function of the context giving the command (keel ARGV) that makes it.
CHECK_CASES = {
    "KEEL-C001": lambda c: c.check("trainer.sav_freq=2"),
    "KEEL-C002": lambda c: c.check("data.train_batch_size=-4"),
    "KEEL-C003": lambda c: c.check("data.train_batch_size"),
    "KEEL-C004": lambda c: c.check("actor_rollout_ref.actor.ppo_mini_batch_size=3"),
    "KEEL-C005": lambda c: ["check", c.config.replace(".yaml", ".yml")],
    "KEEL-C006": lambda c: c.check("algorithm.critic_warmup=2"),
    "KEEL-C007": lambda c: c.check(f"trainer.resume_mode={c.tmp / 'run' / 'global_step_9'}"),
    "KEEL-C013": lambda c: c.check("data.max_response_length=1000"),
    "KEEL-C015": lambda c: c.check("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"),
    "KEEL-C016": lambda c: (
        c.write("tools.yaml", "tools:\n  - class_name: keel.tools.Calculator\n"),
        c.check(
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={c.tmp / 'tool.yaml'}",
        ),
    )[1],
    "KEEL-C018": lambda c: launch(c, "tiny_confs", "tiny_base"),
    "KEEL-C019": lambda c: launch(c, "tiny_configs", "tiyn_base"),
    "KEEL-C020": lambda c: launch(
        c,
        "tiny_configs",
        c.mistaken(
            "tiny_configs/run.yaml",
            "defaults: [tiyn_base, _self_]\n",
            "defaults: [tiny_base, _self_]\n",
        ),
    ),
    "KEEL-C021": lambda c: launch(
        c,
        "tiny_configs",
        c.mistaken(
            "tiny_configs/run.yaml",
            f"hydra:\n  searchpath: [file://{c.tmp}/nowhere]\ndefaults: [tiny_base, _self_]\n",
            "defaults: [tiny_base, _self_]\n",
        ),
    ),
    "KEEL-M001": lambda c: c.check(
        f"actor_rollout_ref.model.path={c.assets['model'].parent / 'modle'}"
    ),
    "KEEL-M002": lambda c: c.check(
        MODEL + str(c.model_copy("m", tokenizer_config={"eos_token": None}))
    ),
    "KEEL-M009": lambda c: c.check(
        MODEL + str(c.model_copy("m9", tokenizer_config={"eos_token": "<|end_of_turn|>"}))
    ),
    "KEEL-M003": lambda c: c.check(MODEL + str(c.model_copy("m", drop_template=True))),
    "KEEL-M004": lambda c: c.check(more_tokens(c)),
    # weights: 64
    "KEEL-M005": lambda c: c.check(
        MODEL + str(c.model_copy("m", config={"intermediate_size": 128}))
    ),
    "KEEL-M006": lambda c: c.check(
        MODEL
        + str(
            c.model_copy(
                "m", tokenizer_config={"eos_token": "<|endoftext|>", "pad_token": "<|im_start|>"}
            )
        )
    ),
    "KEEL-M007": lambda c: c.check(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
    ),
    "KEEL-D001": lambda c: c.check(f"data.train_files={c.assets['train'].parent / 'trian.jsonl'}"),
    "KEEL-D002": lambda c: c.check(
        f"data.train_files={c.rows('q.jsonl', [{'question': 'hi'}] * 8)}",
        f"data.val_files={c.rows('q_val.jsonl', [{'question': 'ho'}] * 2)}",
    ),
    "KEEL-D003": lambda c: c.check(
        f"data.train_files={c.rows('long.jsonl', digit_rows(8, prompt='x' * 200))}"
    ),
    "KEEL-D004": lambda c: c.check(f"data.train_files={c.rows('two.jsonl', digit_rows(2))}"),
    "KEEL-R001": lambda c: c.check("custom_reward_function.name=compute_scor"),
    "KEEL-R002": lambda c: c.check("custom_reward_function.path=null"),
    "KEEL-R003": lambda c: c.check(
        reward(c, SCORE.format("str(len(s))"), SCORE.format("float(len(s))"))
    ),
    "KEEL-R004": lambda c: c.check(
        "custom_reward_function.path=null", "data.val_files=[]", gsm8k_rows(c)
    ),
    "KEEL-R005": lambda c: c.check(
        reward(c, SCORE.format("1 / len(s)"), SCORE.format("1 / len(s) if s else 0.0"))
    ),
    "KEEL-R009": lambda c: c.check(
        "custom_reward_function.path=null", "data.val_files=[]", code_rows(c)
    ),
    "KEEL-R010": lambda c: c.check(
        reward(
            c,
            "def compute_score(ds, s, gt, ei=None):\n    return float(s == gt)\n",
            SCORE.format("float(s == ground_truth)"),
        )
    ),
    "KEEL-R007": lambda c: c.check("reward.timeout_s=0.1", reward(c, SLOW_ON_EMPTY)),
    "KEEL-E002": lambda c: c.check("actor_rollout_ref.rollout.max_num_seqs=100000000"),
    "KEEL-E003": lambda c: c.check(f"trainer.default_local_dir={c.write('a_file', '')}/run"),
    # preference training
    "KEEL-C025": lambda c: dpo_check(c, "dpo.label_smoothing=0.1"),
    "KEEL-C027": lambda c: dpo_check(c, "objective=dop"),
    # distillation: a gkd setting under reverse_kl (the teacher: the tiny model, the same tokenizer)
    "KEEL-C028": lambda c: c.check(
        "distillation.enable=true",
        f"distillation.teacher.path={c.assets['model']}",
        "distillation.gkd.top_k=8",
    ),
    # a float8 teacher where there are no float8 tensor cores (the CPU): the fix is the default
    "KEEL-M011": lambda c: c.check(
        "distillation.enable=true",
        f"distillation.teacher.path={c.assets['model']}",
        "distillation.teacher.dtype=float8",
    ),
    # gkd's data steps (lmbda < 1) need sync steps; the rows hold their responses
    "KEEL-C029": lambda c: c.check(
        *gkd_data_steps(c, [{**row, "response": "12"} for row in digit_rows(8)]),
        "trainer.mode=async",
    ),
    # the rows' responses are under another name: the fix names it
    "KEEL-D010": lambda c: c.check(
        *gkd_data_steps(c, [{**row, "completion": "12"} for row in digit_rows(8)])
    ),
    "KEEL-D007": lambda c: dpo_check(c, pairs=mistaken_pairs(c, {**PAIR, "chosen": ""})),
    "KEEL-D008": lambda c: dpo_check(
        c,
        pairs=c.mistaken(
            "same.jsonl",
            (json.dumps({**PAIR, "rejected": "12"}) + "\n") * 8,
            (json.dumps(PAIR) + "\n") * 8,
        ),
    ),
    "KEEL-D009": lambda c: dpo_check(c, "data.max_length=8"),
    # a batch-invariant rollout on the hf engine: the fix turns it off (or names native)
    "KEEL-C030": lambda c: c.check(
        "actor_rollout_ref.rollout.batch_invariant=true", "actor_rollout_ref.rollout.name=hf"
    ),
    "KEEL-P004": lambda c: c.check("trainer.nnodes=2"),
    "KEEL-P006": lambda c: c.check("actor_rollout_ref.ref.nnodes=2"),
}


def gkd_data_steps(c, rows: list[dict]) -> tuple[str, ...]:
    """Overrides of a gkd run that trains half its steps on the rows' responses (the teacher: the
    tiny model, the same tokenizer)."""
    return (
        "distillation.enable=true",
        f"distillation.teacher.path={c.assets['model']}",
        "distillation.mode=gkd",
        "distillation.gkd.lmbda=0.5",
        f"data.train_files={c.rows('responses.jsonl', rows)}",
    )


# the mistake is asking for a GPU this machine does not have
if not torch.cuda.is_available():
    CHECK_CASES["KEEL-E001"] = lambda c: c.check("trainer.device=cuda")

# Codes whose fix cannot be applied here, and why; test_what_can_be_tested_of_the_rest checks them.
NOT_HERE = {
    "KEEL-C026": "a warning (the run goes on), which this test cannot tell from success; "
    "tests/unit/test_preference_config.py finds it and checks the reference its fix names",
    "KEEL-C009": "the printed fix is a `keel demo --out` command, which runs the whole demo "
    "(minutes); tests/integration/test_demo.py checks that it names a directory that "
    "is free",
    "KEEL-C022": "the fix is in the agent's own requests to keel's endpoint; "
    "tests/unit/test_openai_endpoint.py sends each refused request again as the fix "
    "says and is answered",
    "KEEL-C023": "the fix is the user's own agent function (an async def at the path named); "
    "tests/integration/test_external_agent.py names a missing one, then the one written",
    "KEEL-C024": "the fix is installing an environment package or naming its own arguments; "
    "tests/integration/test_verifiers_classic.py names missing and broken ones, "
    "then loads the fixed one",
    "KEEL-M010": "the fix is another teacher, one trained with the student's tokenizer; "
    "tests/unit/test_distill_check.py refuses teachers whose tokenizer differs and takes one "
    "saved with the student's",
    "KEEL-M008": "the fix is a chat template with a tool role in the model's own turn format, "
    "which only the model's makers can write",
    "KEEL-T001": "a non-finite gradient from finite log-probs needs low-precision overflow, which "
    "a float32 CPU run does not give (a diverging one stops at KEEL-T003 first)",
    "KEEL-T002": "caused by code that freezes the model or detaches the loss; the fix is that code",
    "KEEL-T004": "the process exits (os._exit, from a timer thread) where this test runs keel "
    "in-process; tests/unit/test_guards.py applies its fix in a subprocess",
    "KEEL-E004": "installing another torch",
    "KEEL-E005": "an NVIDIA driver",
    "KEEL-E006": "a GPU",
    "KEEL-E007": "installing other package versions",
    "KEEL-E008": "a full disk",
    "KEEL-E012": "installing verl and the packages it imports (tests/unit/test_verl_tools.py "
    "checks the fix line names them)",
    "KEEL-P001": "an exception in a Ray worker: the fix is the worker's own traceback",
    "KEEL-P002": "a Ray worker killed by the system (out of memory)",
    "KEEL-P003": "ranks stalled in a collective across Ray workers",
}
if torch.cuda.is_available():
    NOT_HERE["KEEL-E001"] = "a machine without the GPU asked for"


def test_every_code_has_a_case_or_a_reason():
    cases = set(CHECK_CASES) | set(RUN_CASES)
    assert not cases & set(NOT_HERE), cases & set(NOT_HERE)
    assert cases | set(NOT_HERE) == set(CATALOGUE), set(CATALOGUE) ^ (cases | set(NOT_HERE))


@pytest.mark.parametrize("code", sorted(CHECK_CASES))
def test_the_printed_fix_fixes(code, ctx):  # noqa: F811 - ctx, the fixture
    apply_and_rerun(CHECK_CASES[code](ctx), code, ctx.applier)


def checkable(code: str) -> bool:
    """Whether the catalogue's entry names something this machine can check: keys, or backticked
    overrides, keys and commands (the driver, GPU and worker-traceback entries name none)."""
    return bool(CATALOGUE[code].keys) or "`" in CATALOGUE[code].fix


@pytest.mark.parametrize("code", sorted(code for code in NOT_HERE if checkable(code)))
def test_what_can_be_tested_of_the_rest(code):
    """For a code this machine cannot fix: the keys its entry names are keel's, its backticked
    overrides set keel's keys, its keel commands parse, its pip requirements are pyproject's."""
    import shlex
    from pathlib import Path

    from keel.cli import build_parser
    from keel.config.load import all_keys
    from keel.config.preference import PreferenceConfig
    from keel.config.sft import SFTConfig

    # every tree's: RL's, preference training's and SFT's
    keys = {*all_keys(), *all_keys(PreferenceConfig), *all_keys(SFTConfig)}
    entry = CATALOGUE[code]
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert set(entry.keys) <= keys
    for group in re.findall(r"`([^`]*)`", entry.fix):
        words = shlex.split(group)
        if words[0] == "keel":
            # exits on a command keel does not have
            build_parser().parse_args(words[1:])
        elif words[0] == "pip":
            for requirement in (w for w in words[2:] if not w.startswith("-")):
                name, _, floor = requirement.partition(">=")
                extra = re.fullmatch(r"keel\[(\w+)\]", requirement)
                assert (
                    f"\n{extra.group(1)} = [" in pyproject
                    if extra
                    else requirement == "." or f'"{name}>={floor}"' in pyproject
                ), requirement
        else:
            assert all(word.split("=")[0] in keys for word in words), group
