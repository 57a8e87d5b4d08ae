"""verl 0.9.1's question-answering rule for the Search-R1 data sets (`searchR1_nq`,
`searchR1_hotpotqa`, ...), reimplemented so that keel scores as verl's `search_r1_like_qa_em.py`
does.

The answer is the last `<answer>...</answer>` in the response; it scores 1.0 when it equals one of
the ground truth's `target` answers after SQuAD's normalisation (lower case, no punctuation, no
articles, single spaces), 0.25 when it does but the response opens or closes more than ten answer
tags, else 0.0. The ground truth is verl's dict `{"target": [answers]}` (a single string answer also
works).
"""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
# more answer tags than this look like a model gaming the extraction...
TAG_SPAM_LIMIT = 10
# ...and get a quarter of the score
TAG_SPAM_SHARE = 0.25


def normalise_qa_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation dropped, articles dropped, single
    spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLE.sub(" ", text).split())


def last_tagged_answer(solution_str: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>`, or None without one."""
    answers = _ANSWER.findall(solution_str)
    return answers[-1].strip() if answers else None


def matches_any(answer: str, golden_answers: Any) -> bool:
    """Whether the normalised answer equals one of the normalised golden answers."""
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    normalised = normalise_qa_answer(answer)
    return any(normalise_qa_answer(golden) == normalised for golden in golden_answers)


def targets(ground_truth: Any) -> Any:
    """The golden answers of verl's Search-R1 ground truth `{"target": [...]}`."""
    try:
        return ground_truth["target"]
    except (TypeError, KeyError, IndexError) as e:
        raise TypeError(
            'search_r1 reads the ground truth as {"target": [answers]} '
            "(verl's Search-R1 data); "
            f"got {type(ground_truth).__name__} {str(ground_truth)[:80]!r}"
        ) from e


def search_r1(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's Search-R1 exact-match rule on the last `<answer>` (see the module's docstring)."""
    answer = last_tagged_answer(solution_str)
    if answer is None:
        return 0.0
    if not matches_any(answer, targets(ground_truth)):
        return 0.0
    tags_spammed = (
        solution_str.count("<answer>") > TAG_SPAM_LIMIT
        or solution_str.count("</answer>") > TAG_SPAM_LIMIT
    )
    return TAG_SPAM_SHARE if tags_spammed else 1.0
