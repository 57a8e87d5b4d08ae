"""`keel check`'s reward part: every data_source in the train and validation files is scored on a
few of its rows before training, and the report says which scorer serves each one.

A scorer that breaks on the second data_source of a mixed file, or a custom function that never
rewards a right answer for one of them, is found here rather than hours into a run.
"""

from __future__ import annotations

import math

from keel.check.findings import PASS, WARN, Finding, need
from keel.config.rules import lengths_within
from keel.config.schema import KeelConfig
from keel.errors import SANDBOX_INCOMPLETE, TOKEN_BUDGET, KeelError
from keel.rewards.jail.sandbox import jail

# rows of each data_source the scorer runs on
ROWS_PER_SOURCE = 4

# Answers a right response could take, written around the ground truth; each is also tried after a
# think block (reasoning models' functions often require one).
CANDIDATE_FORMS = (
    "{}",
    "#### {}",
    "\\boxed{{{}}}",
    "The answer is {}.",
    "Answer: {}",
    "<answer>{}</answer>",
)
THINK_BLOCK = "<think>\nLet me work it out.\n</think>\n"


def check_reward(cfg: KeelConfig, context: dict) -> list[Finding]:
    """The scorer must run on real rows of every data_source: the ground truth as the answer, and an
    empty answer."""
    from keel.trainer.setup import build_reward

    scorer = build_reward(cfg, context["plan"])
    environment = cfg.actor_rollout_ref.rollout.agent.environment
    # its rewards are its own: the scorers never see its samples
    if environment:
        context["reward"] = scorer
        return [Finding(PASS, "reward", f"the environment's own ({environment})")]
    records = need(context, "train_records") + context.get("val_records", [])
    scorer.check_records(records, [*cfg.data.train_files, *cfg.data.val_files])
    found = []
    try:
        for source, rows in rows_by_source(records).items():
            found += probe_source(scorer, source, rows, cfg.rewards_teach)
    finally:
        # its worker pool; the scorer starts a new one when the trainer reuses it
        scorer.close()
    context["reward"] = scorer
    if scorer.runs_model_code(records):
        found.append(sandbox_finding(jail()))
    if cfg.reward_model.enable:
        found.append(
            check_reward_model_budget(cfg, scorer.reward_model, records, need(context, "tokenizer"))
        )
    return found


def rows_by_source(records: list) -> dict[str, list]:
    """A few rows of each data_source, in the order the data_sources first appear."""
    rows: dict[str, list] = {}
    for record in records:
        kept = rows.setdefault(record.data_source, [])
        if len(kept) < ROWS_PER_SOURCE:
            kept.append(record)
    return rows


def probe_source(scorer, source: str, rows: list, rewards_teach: bool = True) -> list[Finding]:
    """The bare ground truth and an empty answer must score (an error here stops the check); a
    custom function that gives none of the candidate answers a positive score is a warning, where
    the rewards teach (not under distillation with task_reward_coef=0)."""
    bare = [_as_text(r.ground_truth) for r in rows]
    scorer.score_batch(rows, bare, on_error="raise", may_skip=False)
    empty = scorer.score_batch(
        rows, [""] * len(rows), on_error="raise", may_skip=False
    ).scores.tolist()
    found = [
        Finding(
            PASS,
            "reward",
            f"data_source {source!r}: scored by {scorer.describe(source)}; ran on "
            f"{len(rows)} rows (empty answers score {empty})",
        )
    ]
    if rewards_teach and _judged_by_user_code(scorer, source) and _best_score(scorer, rows) <= 0:
        found.append(
            Finding(
                WARN,
                "reward",
                f"data_source {source!r}: the reward function gave no positive score to any "
                f"answer built from the rows' ground truths: {_tried()}. If it never rewards a "
                "right answer, training learns nothing (verl's contract: "
                "compute_score(data_source=, solution_str=, ground_truth=, extra_info=), called "
                "by keyword)",
            )
        )
    return found


def candidate_answers(ground_truth) -> list[str]:
    """Right answers for a ground truth, in the forms responses take: each of its texts (a dict's
    values, a list's items) in every form, bare and after a think block."""
    answers = [form.format(text) for text in truth_texts(ground_truth) for form in CANDIDATE_FORMS]
    return answers + [THINK_BLOCK + answer for answer in answers]


def truth_texts(ground_truth) -> list[str]:
    """What a function would read as the answer: the ground truth itself, or for a dict its values
    (`{"target": ["Paris"]}` -> Paris) and for a list its first item."""
    if isinstance(ground_truth, dict):
        values = [v[0] if isinstance(v, (list, tuple)) and v else v for v in ground_truth.values()]
        return [_as_text(v) for v in values if isinstance(v, (str, int, float))][:3] or [
            _as_text(ground_truth)
        ]
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        return [_as_text(ground_truth[0])]
    return [_as_text(ground_truth)]


def _tried() -> str:
    return (
        f"{len(CANDIDATE_FORMS)} forms of each "
        f"({', '.join(f.format('x') for f in CANDIDATE_FORMS)}), each also after a "
        "<think>...</think> block, x being the ground truth or, for a dict or list, each of its "
        "values"
    )


def _as_text(value) -> str:
    return value if isinstance(value, str) else str(value)


def _best_score(scorer, rows: list) -> float:
    """The highest score any candidate answer gets; a form the scorer refuses tells nothing (0)."""
    columns = [candidate_answers(r.ground_truth) for r in rows]
    for i in range(max(len(c) for c in columns)):
        answers = [c[i] if i < len(c) else c[0] for c in columns]
        try:
            best = (
                scorer.score_batch(rows, answers, on_error="zero", may_skip=False)
                .scores.max()
                .item()
            )
        except KeelError:
            continue
        if best > 0:
            return best
    return 0.0


def _judged_by_user_code(scorer, source: str) -> bool:
    """Whether the data_source is scored by something keel did not write (a custom function, a
    service): the built-in scorers have tests of their own, and some (code, regex) read no bare
    answer."""
    return any(
        spec[0] != "builtin" if isinstance(spec, tuple) else True
        for spec, _ in scorer.scorers_for(source).values()
        if spec != ("reward_model",)
    )


def sandbox_finding(found) -> Finding:
    """Which of the jail's protections hold for model-written code (check_records has already
    refused a jail short of what reward.sandbox.require asks for)."""
    return Finding(
        PASS if found.complete else WARN,
        "sandbox",
        found.summary(),
        None if found.complete else SANDBOX_INCOMPLETE,
    )


def check_reward_model_budget(
    cfg: KeelConfig, reward_model, records: list, policy_tokenizer
) -> Finding:
    """The longest prompt, in the reward model's own template and tokens, plus a full-length
    response in its tokens must fit what it reads: a 4096-token rollout scored by a 512-token model
    is an error. The response budget is in the policy's tokens, so it is converted by the ratio of
    the two tokenizers' counts on the prompts."""

    def count(tokenizer, text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    longest = max(
        count(reward_model.tokenizer, reward_model.text(r.raw_prompt, "")) for r in records
    )
    texts = [reward_model.text(r.raw_prompt, "") for r in records[:64]]
    ratio = max(
        count(reward_model.tokenizer, t) / max(count(policy_tokenizer, t), 1) for t in texts
    )
    response = math.ceil(cfg.data.max_response_length * ratio)
    total = longest + response
    budget = (
        f"the longest prompt is {longest} tokens in the reward model's own template, and a "
        f"data.max_response_length={cfg.data.max_response_length} response about {response} of "
        "its tokens"
    )
    if reward_model.max_length and total > reward_model.max_length:
        raise KeelError(
            TOKEN_BUDGET,
            f"{budget}: {total}, over the {reward_model.max_length} tokens the reward model "
            f"reads ({reward_model.limited_by})",
            lengths_within(cfg, reward_model.max_length, "the reward model")
            + ", or use a reward model with a "
            "longer context (if its "
            "tokenizer's model_max_length "
            "is wrong, correct it)",
        )
    return Finding(
        PASS,
        "reward model",
        f"reads {reward_model.max_length} tokens ({reward_model.limited_by}); {budget}: {total}",
    )
