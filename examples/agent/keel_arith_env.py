"""A verifiers environment package, written with verifiers' own classes: two-digit additions, the
model answers, is asked to check its answer, and answers again; the rubric pays the last answer's
correctness and reports how long the answers were (a metric: weight 0).

    PYTHONPATH=examples/agent keel train examples/agent/verifiers.yaml

verifiers.load_environment("keel-arith-env") imports this module (its name with dashes) and calls
load_environment; a published environment (pip install it) is named the same way.
"""

import random

import verifiers as vf
from datasets import Dataset


class CheckYourAnswer(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Check it once more and give the number alone.")]


def last_answer_is_right(completion, answer, parser, **kwargs) -> float:
    said = parser.parse_answer(completion) or ""
    return 1.0 if said.strip().split(" ")[-1:] == [answer] else 0.0


def answer_length(completion, parser, **kwargs) -> float:
    return float(len(parser.parse_answer(completion) or ""))


def load_environment(questions: int = 256, seed: int = 0):
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(questions)]
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    parser = vf.Parser()
    rubric = vf.Rubric(
        funcs=[last_answer_is_right, answer_length], weights=[1.0, 0.0], parser=parser
    )
    return CheckYourAnswer(
        dataset=Dataset.from_list(rows[16:]),
        eval_dataset=Dataset.from_list(rows[:16]),
        parser=parser,
        rubric=rubric,
        max_turns=2,
        sampling_args={"max_tokens": 32},
    )
