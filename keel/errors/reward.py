"""Error codes KEEL-R: reward."""

from keel.errors.base import register

REWARD_FN_LOAD = register(
    "KEEL-R001",
    "Custom reward function cannot be loaded",
    "`custom_reward_function.path` does not exist, does not import, or has no function named "
    "`custom_reward_function.name`.",
    "Set the path and the name the fix line gives (the file or function spelt like the one "
    "given); the function takes (data_source, solution_str, ground_truth, extra_info) and returns "
    "a float.",
    ("custom_reward_function.path", "custom_reward_function.name"),
)
NO_SCORER = register(
    "KEEL-R002",
    "No scorer for a data_source",
    "A row's `data_source` matches no built-in scorer and no custom reward function is set; "
    "scoring it as 0 would look like a model that never learns.",
    "Set `reward.scorers.<data_source>.exact_match=1.0` to score each response against the row's "
    "ground truth, set `custom_reward_function.path` to a file with your scorer, or set the rows' "
    "data_source to one a built-in scorer serves (gsm8k, openai/gsm8k, exact_match).",
    ("custom_reward_function.path", "custom_reward_function.name"),
)
REWARD_NOT_NUMBER = register(
    "KEEL-R003",
    "Reward function returned a non-finite number or a non-number",
    "The reward function returned None, a string, NaN or infinity for a sample.",
    "Make the reward function return a finite float for every sample.",
)
MISSING_GROUND_TRUTH = register(
    "KEEL-R004",
    "Rows without a ground truth for a built-in scorer",
    "Built-in scorers compare the response with `reward_model.ground_truth`; a row without one "
    "would score 0 on every sample, which looks like a model that never learns.",
    "Add `reward_model: {ground_truth: ...}` to every row, or score with your own "
    "`custom_reward_function` that does not need one.",
    ("custom_reward_function.path",),
)
SCORER_RAISED = register(
    "KEEL-R005",
    "The scorer raised an exception on a real row",
    "`keel check` ran the reward function on a few dataset rows (the ground truth as the answer, "
    "and an empty answer) and it raised; during training every such sample would crash the run.",
    "Make the reward function handle these inputs (an empty response must score, e.g. 0.0).",
    ("custom_reward_function.path", "custom_reward_function.name"),
)
TOO_MANY_NOT_SCORED = register(
    "KEEL-R006",
    "Too many samples could not be scored",
    "More than reward.max_not_scored_ratio of a batch's samples raised, hung or returned a "
    "non-number in the scorer; a scorer failing that often is broken, and training on the rest "
    "would quietly follow a different reward than the one you wrote.",
    "Read the reason in the message (and reward/not_scored/* in the metrics) and fix the scorer; "
    "if the failures are expected, raise reward.max_not_scored_ratio (the fix line gives twice "
    "the batch's share) or reward.timeout_s.",
    ("reward.max_not_scored_ratio", "reward.on_error", "reward.timeout_s"),
)
SCORER_TIMEOUT = register(
    "KEEL-R007",
    "A scorer took longer than reward.timeout_s",
    "With reward.on_error=raise, one sample whose scoring runs past the limit stops the run.",
    "Raise reward.timeout_s if the scorer is just slow (the fix line gives ten times the limit), "
    "or make it faster; during training reward.on_error=mask leaves such samples out of the "
    "update (counted as reward/not_scored/timeout).",
    ("reward.timeout_s", "reward.on_error"),
)
SERVICE_UNAVAILABLE = register(
    "KEEL-R008",
    "The reward service is not reachable or not healthy",
    'reward.service.url is set, but GET /health did not answer {"status": "ok"} before training '
    "started: every batch would end up not scored.",
    "Start the service where the config points (the fix line gives `keel reward-server ... --host "
    "H --port P` for the config's scorer), check the URL, port and token, or set "
    "`reward.service.url=null` to score in this process.",
    ("reward.service.url", "reward.service.token"),
)
CODE_TESTS_FORM = register(
    "KEEL-R009",
    "Code test cases in an unknown form",
    "The code scorers (prime_code for verl's codecontests, apps, codeforces and taco; code_exec) "
    "read a row's reward_model.ground_truth as test cases: verl's "
    '{"inputs": [...], "outputs": [...]} (with "fn_name" for call-style tests), or keel\'s '
    '[{"input": ..., "output": ...}], as the object or its JSON text. A row in neither form, or '
    "with no tests, or with more inputs than outputs, has nothing to run the program against: "
    "verl's prime_code scores every response 0 on such a row (1 when it has no tests), without a "
    "word.",
    'Write the row\'s ground truth in one of the two forms: {"inputs": ["1 2\\n"], "outputs": '
    '["3\\n"]} or [{"input": "1 2\\n", "output": "3"}], every input with its expected output.',
)
REWARD_SIGNATURE = register(
    "KEEL-R010",
    "A reward function needs a parameter verl's call does not supply",
    "verl calls a reward function by keyword: compute_score(data_source=, solution_str=, "
    "ground_truth=, extra_info=, **reward_kwargs) (batched: data_sources=, solution_strs=, "
    "ground_truths=, extra_infos=). A required parameter with another name (`(ds, s, gt, ei)`, a "
    "typo such as `solution`) would get no value; binding parameters by position instead can hand "
    "one the value meant for another, which scores right answers wrong without an error.",
    "Name the parameters as verl does (leave out those you do not use, or take **kwargs), or give "
    "the named ones a default or a value in custom_reward_function.reward_kwargs.",
    (
        "custom_reward_function.path",
        "custom_reward_function.name",
        "custom_reward_function.reward_kwargs",
    ),
)

__all__ = [name for name in dir() if name.isupper()]
