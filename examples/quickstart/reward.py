"""The quick-start's reward: the share of digit characters in the response (verl's contract)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.strip()
    if not text:
        return 0.0
    return sum(ch.isdigit() for ch in text) / len(text)
