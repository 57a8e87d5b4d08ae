"""Fix lines applied as printed (test_fix_lines.py says how), for the mistakes found while training,
in SFT, in `keel export`, and in this machine's environment; and the resume mismatch of the README's
LoRA line in full."""

import json
import shutil

import pytest
import torch

from keel.checkpoint import save_checkpoint
from keel.config.load import load_config, to_yaml
from keel.distributed.dist import free_port

from fix_apply import apply_and_rerun, attempt, ctx  # noqa: F401 - ctx is a fixture

HALF_FLAT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return 1.0\n"
    "    return (sum(map(ord, solution_str)) % 7) / 6\n"
)
# Scores the rows keel check tries (the answer, an empty response); raises on a third of the long
# rollouts.
SOMETIMES = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if len(solution_str) > 6 and sum(map(ord, solution_str)) % 3 == 0:\n"
    "        raise ValueError('cannot parse')\n"
    "    return 0.5\n"
)


def checkpoint(c, actor: bool = False):
    """A complete checkpoint of the tiny config, as a run that saved at step 1 leaves it."""
    write = (
        (lambda tmp: shutil.copytree(c.assets["model"], tmp / "actor"))
        if actor
        else (lambda tmp: None)
    )
    cfg = load_config(c.cfg)
    return save_checkpoint(c.tmp / "run", 1, write, config_yaml=to_yaml(cfg))


def sft(c, *overrides: str) -> list[str]:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{i}+{i}"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(8)
    ]
    config = {
        "data": {
            "train_files": [c.rows("sft.jsonl", rows)],
            "max_length": 32,
            "train_batch_size": 4,
            "micro_batch_size_per_gpu": 4,
        },
        "model": {"partial_pretrain": str(c.assets["model"])},
        "trainer": {
            "default_local_dir": str(c.tmp / "sft_run"),
            "total_training_steps": 1,
            "logger": [],
        },
    }
    import yaml

    return ["sft", str(c.write("sft.yaml", yaml.safe_dump(config))), *overrides]


def nan_log_probs(c) -> list[str]:
    from keel.training.actor import ActorTrainer

    real = ActorTrainer.compute_log_probs
    c.applier.monkeypatch.setattr(
        ActorTrainer,
        "compute_log_probs",
        lambda self, batch: real(self, batch) * float("nan"),
        # a model that overflows
    )
    return c.train()


def unsynced_engine(c) -> list[str]:
    from keel.distributed.roles import EngineSync

    # the sync bug, verl #7495
    c.applier.monkeypatch.setattr(EngineSync, "push", lambda self, actor_model: None)
    return c.train(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.optim.lr=0.2",
        "trainer.guards.max_log_prob_gap=0.01",
        "trainer.total_training_steps=2",
    )


def failing_compiler(c) -> list[str]:
    from keel.distributed import parallelize, roles
    from keel.distributed.parallelize import block_modules

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("inductor: unsupported op in this release")

    def compile_with_failing_backend(model):
        for block in block_modules(model):
            block.forward = torch.compile(block.forward, backend=failing_backend)

    # as on a GPU
    c.applier.monkeypatch.setattr(roles, "can_compile", lambda device: True)
    c.applier.monkeypatch.setattr(parallelize, "compile_blocks", compile_with_failing_backend)
    return c.train()


def partial_jail(c) -> list[str]:
    from keel.rewards.jail import sandbox

    found = sandbox.jail()
    partial = sandbox.Jail(
        found.mode, {**found.protections, "accounting": False}, sandbox.NO_CGROUP
    )
    # a machine without cgroups for the jail
    c.applier.monkeypatch.setattr(sandbox, "jail", lambda: partial)
    tests = json.dumps([{"input": "", "output": "4"}])
    code = c.rows(
        "code.jsonl",
        [{"prompt": "Print 4.", "data_source": "code", "reward_model": {"ground_truth": tests}}]
        * 8,
    )
    return c.check(
        "reward.sandbox.require=all",
        f"data.train_files={code}",
        "data.val_files=[]",
        "custom_reward_function.path=null",
    )


def with_env(c, name: str, value: str) -> list[str]:
    c.applier.monkeypatch.setenv(name, value)
    # two workers: Ray, and a port for rank 0
    return c.check("trainer.n_gpus_per_node=2")


def tracker_not_installed(c) -> list[str]:
    import importlib.util

    real = importlib.util.find_spec
    c.applier.monkeypatch.setattr(
        importlib.util,
        # a machine without wandb
        "find_spec",
        lambda name, *a, **k: None if name == "wandb" else real(name, *a, **k),
    )
    return c.check("trainer.logger=[console,wandb]")


def hook_file(c) -> list[str]:
    # A module name no other test uses: Python keeps the first module of a name for the whole
    # session.
    c.write("fix_line_hooks.py", "def longest(step, metrics, batch):\n    return []\n")
    # importable, as with `export PYTHONPATH=$PWD`
    c.applier.monkeypatch.syspath_prepend(str(c.tmp))
    return c.train("trainer.hooks=[fix_line_hooks:longst]")


RUN_CASES = {
    "KEEL-C008": lambda c: (checkpoint(c), c.check("actor_rollout_ref.actor.optim.lr=0.01"))[1],
    "KEEL-C010": lambda c: (
        c.write("out/notes.txt", "mine"),
        ["export", str(checkpoint(c, actor=True)), str(c.tmp / "out")],
    )[1],
    "KEEL-C011": lambda c: (
        checkpoint(c, actor=True),
        ["export", str(c.tmp / "run"), str(c.tmp / "out")],
    )[1],
    "KEEL-C012": lambda c: (
        c.write("runs/digits/grpo/metrics.jsonl", '{"step": 1, "critic/score/mean": 0.5}\n'),
        ["report", str(c.tmp / "runs")],
        # the folder above the run directory
    )[1],
    "KEEL-C014": hook_file,
    "KEEL-D005": lambda c: sft(c, "data.max_length=8"),
    "KEEL-D006": lambda c: sft(c, "data.max_length=12", "data.truncation=right"),
    "KEEL-R006": lambda c: c.train(
        "trainer.val_before_train=false",
        f"custom_reward_function.path={c.write('sometimes.py', SOMETIMES)}",
    ),
    "KEEL-R008": lambda c: c.check(f"reward.service.url=http://127.0.0.1:{free_port()}"),
    "KEEL-T003": nan_log_probs,
    "KEEL-T005": lambda c: c.train(
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=1",
        "trainer.val_before_train=false",
        f"custom_reward_function.path={c.write('half.py', HALF_FLAT)}",
    ),
    "KEEL-T006": unsynced_engine,
    "KEEL-E009": failing_compiler,
    "KEEL-E010": partial_jail,
    "KEEL-E011": tracker_not_installed,
    # nothing listens there
    "KEEL-P005": lambda c: with_env(c, "RAY_ADDRESS", f"127.0.0.1:{free_port()}"),
    "KEEL-P007": lambda c: with_env(c, "MASTER_PORT", "29500x"),
}


# Codes a case's own setup meets after the fix, which are not the fix's doing (none at present).
THEN: dict[str, tuple[str, ...]] = {}


@pytest.mark.parametrize("code", sorted(RUN_CASES))
def test_the_printed_fix_fixes(code, ctx):  # noqa: F811 - ctx, the fixture
    apply_and_rerun(RUN_CASES[code](ctx), code, ctx.applier, THEN.get(code, ()))


def test_the_readme_lora_line_after_the_quickstart(ctx):  # noqa: F811
    """The run directory comes from project and experiment names: the fix is a new experiment_name
    whose directory does not exist; `trainer.resume_mode=disable` (the old first suggestion) is
    refused there too, with the same fix; the second option resumes with the checkpoint's
    settings."""
    import yaml

    cfg = {
        **ctx.cfg,
        "trainer": {k: v for k, v in ctx.cfg["trainer"].items() if k != "default_local_dir"},
    }
    cfg["trainer"].update(project_name="quickstart", experiment_name="grpo_digits")
    config = ctx.write("grpo.yaml", yaml.safe_dump(cfg))
    save_checkpoint(
        ctx.tmp / "checkpoints/quickstart/grpo_digits",
        2,
        lambda tmp: None,
        config_yaml=to_yaml(load_config(cfg)),
    )
    lora = [
        "check",
        str(config),
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.actor.optim.lr=1e-2",
    ]
    fix, second = apply_and_rerun(lora, "KEEL-C008", ctx.applier)
    assert fix.startswith("set `trainer.experiment_name=grpo_digits_2`") and second.status == 0
    assert "`actor_rollout_ref.actor.optim.lr=0.001 actor_rollout_ref.model.lora_rank=0`" in fix
    back = attempt(
        [*lora, *fix.split(", or resume with the checkpoint's settings: ")[1].strip("`").split()]
    )
    assert back.status == 0 and "will resume from" in back.output
    disable = attempt(["check", str(config), "trainer.resume_mode=disable"])
    assert disable.fix_of("KEEL-C008").startswith("set `trainer.experiment_name=grpo_digits_2`")


def test_the_quickstart_before_its_prepare_script_ran(ctx):  # noqa: F811
    """Before `python examples/quickstart/prepare.py` has run, the fix of the missing model and of
    the missing data is to run it (here a stand-in that writes the tiny model and data)."""
    ctx.write(
        "examples/quickstart/prepare.py",
        f"import shutil\nshutil.copytree({str(ctx.assets['model'])!r}, 'examples/data/model', "
        f"dirs_exist_ok=True)\nshutil.copy({str(ctx.assets['train'])!r}, "
        "'examples/data/train.jsonl')\n",
    )
    mistake = ctx.check(
        "actor_rollout_ref.model.path=examples/data/model",
        "data.train_files=examples/data/train.jsonl",
    )
    fix, second = apply_and_rerun(mistake, "KEEL-M001", ctx.applier)
    assert (
        fix == "run `python examples/quickstart/prepare.py`, which writes it" and second.status == 0
    )
    (ctx.tmp / "examples/data/train.jsonl").unlink()
    fix, second = apply_and_rerun(mistake, "KEEL-D001", ctx.applier)
    assert fix == "run `python examples/quickstart/prepare.py`, which writes examples/data"


def test_several_problems_at_once_have_one_fix_for_all(ctx):  # noqa: F811
    fix, second = apply_and_rerun(
        ctx.check("data.train_batch_size=-4", "algorithm.adv_estimator=grp0"),
        "KEEL-C002",
        ctx.applier,
    )
    # each line's own
    assert fix.startswith("set `algorithm.adv_estimator=grpo data.train_batch_size=1`")
