"""The slow-reward workloads' scorer (s1): 1 s of host time per sample, as a code reward's jail or a
judge's round trip takes, and t1's deterministic score of the text."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1.0)
    return (sum(map(ord, solution_str)) % 7) / 6
