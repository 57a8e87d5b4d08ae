"""Keys of earlier verl releases (0.6.0 to 0.7.0) whose later form is not a plain rename, taken as
verl's later releases (and keel) spell them: rollout correction's `algorithm.rollout_is*` family of
verl 0.6.0, the ratio levels `rollout_rs: token | sequence | geometric` with
`rollout_rs_threshold_lower` and `use_policy_gradient` of 0.6.1 and 0.7.0. Where the numbers are the
same the keys are mapped and `keel check` says so; where they are not, the key is refused by name
with the key to use now. Plain renames are rows of verl_rules.yaml.
"""

from __future__ import annotations

from typing import Any

from keel.errors import VERL_UNSUPPORTED, KeelError

NEW = "algorithm.rollout_correction."
OLD_IS = (
    "algorithm.rollout_is",
    "algorithm.rollout_is_threshold",
    "algorithm.rollout_is_threshold_lower",
    "algorithm.rollout_is_level",
    "algorithm.rollout_is_mode",
    "algorithm.rollout_is_veto_threshold",
)
# verl 0.7.0's rejection levels on the ratio band [lower, upper], as 0.9.1's k1 options (whose
# bounds are on -log ratio: a band [l, u] of 0.9.1 keeps ratios in [1/u, 1/l]).
RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def earlier_releases(flat: dict[str, Any], decided: list, problems: list) -> None:
    """`flat` (dotted keys) with these keys replaced by their later forms; what cannot be is
    refused."""
    if any(key in flat for key in OLD_IS):
        _rollout_is_family(
            {key: flat.pop(key) for key in OLD_IS if key in flat}, flat, decided, problems
        )
    _rejection_levels(flat, decided, problems)
    if NEW + "use_policy_gradient" in flat:
        if flat.pop(NEW + "use_policy_gradient"):
            flat[NEW + "loss_type"] = "reinforce"
            decided.append(
                f"{NEW}use_policy_gradient=true (verl 0.6.1): {NEW}loss_type=reinforce in verl's "
                "later releases and keel (the same loss)"
            )


def _refuse(problems: list, key: str, value: Any, what: str, fix: str) -> None:
    problems.append(
        KeelError(
            VERL_UNSUPPORTED,
            f"{key}={value!r} is a setting of an earlier verl release that keel does not "
            f"have: {what}",
            fix,
        )
    )


def _rollout_is_family(
    old: dict[str, Any], flat: dict[str, Any], decided: list, problems: list
) -> None:
    """verl 0.6.0: rollout_is (apply the weights, else metrics only), rollout_is_threshold (null: no
    weights at all), _level (token, sequence, geometric), _mode (truncate, mask: zero the weights
    outside [lower, upper]), _veto_threshold (drop a sequence with a token ratio below it)."""
    apply, threshold = old.get("algorithm.rollout_is"), old.get("algorithm.rollout_is_threshold")
    level, mode = (
        old.get("algorithm.rollout_is_level") or "token",
        old.get("algorithm.rollout_is_mode"),
    )
    veto = old.get("algorithm.rollout_is_veto_threshold")
    refused = len(problems)
    if mode not in (None, "truncate"):
        _refuse(
            problems,
            "algorithm.rollout_is_mode",
            mode,
            "the weights zeroed outside [lower, upper]; verl's later releases and keel truncate "
            f"the weights and reject tokens with {NEW}rollout_rs (token_k1 is a band on the "
            f"token's ratio) and {NEW}rollout_rs_threshold",
            "remove `algorithm.rollout_is_mode` (truncated weights), and set "
            f"{NEW}rollout_rs=token_k1 with {NEW}rollout_rs_threshold for a band",
        )
    if level not in ("token", "sequence"):
        _refuse(
            problems,
            "algorithm.rollout_is_level",
            level,
            "weights from the geometric mean of a sequence's ratios, which later releases "
            f"dropped ({NEW}rollout_is is token or sequence; {NEW}rollout_rs=seq_mean_k1 rejects "
            "on the geometric mean)",
            "remove `algorithm.rollout_is_level` (per-token weights)",
        )
    if veto is not None and apply and threshold is not None:
        _refuse(
            problems,
            "algorithm.rollout_is_veto_threshold",
            veto,
            "a sequence dropped when one of its tokens' ratios is below it; later releases "
            f"dropped the veto ({NEW}rollout_rs=token_k1 rejects tokens outside a ratio band)",
            "remove `algorithm.rollout_is_veto_threshold`",
        )
    if len(problems) > refused:
        return
    given = ", ".join(f"{key.removeprefix('algorithm.')}={value}" for key, value in old.items())
    if apply and threshold is not None:
        flat[NEW + "rollout_is"], flat[NEW + "rollout_is_threshold"] = level, threshold
        decided.append(
            f"{given} (verl 0.6.0): {NEW}rollout_is={level} and rollout_is_threshold={threshold} "
            "in verl's later releases and keel (the same truncated weights; 0.6.0 also dropped "
            "sequences with a token ratio below rollout_is_veto_threshold, 1e-4 unless set to "
            "null, which later releases and keel do not)"
        )
    elif any(value not in (None, False) for value in old.values()):
        decided.append(
            f"{given} (verl 0.6.0): no weights applied (rollout_is is false, or "
            f"rollout_is_threshold null), as {NEW}rollout_is=null in verl's later releases and "
            "keel"
        )


def _rejection_levels(flat: dict[str, Any], decided: list, problems: list) -> None:
    """verl 0.6.1-0.7.0: rollout_rs token / sequence / geometric kept ratios (the token's, the
    sequence's product, their geometric mean) in [lower, upper]: upper rollout_rs_threshold (null:
    rollout_is_threshold), lower rollout_rs_threshold_lower (null: 1 / upper).
    rollout_token_veto_threshold dropped a sequence with a token ratio below it."""
    lower = flat.pop(NEW + "rollout_rs_threshold_lower", None)
    veto = flat.pop(NEW + "rollout_token_veto_threshold", None)
    if veto is not None:
        _refuse(
            problems,
            NEW + "rollout_token_veto_threshold",
            veto,
            "a sequence dropped when one of its tokens' ratios is below it; later releases "
            f"dropped the veto: {NEW}rollout_rs=seq_max_k2 (or seq_max_k3) drops a sequence by "
            "its worst token",
            f"remove `{NEW}rollout_token_veto_threshold`",
        )
    level = flat.get(NEW + "rollout_rs")
    if level not in RS_LEVELS:
        if lower is not None:
            _refuse(
                problems,
                NEW + "rollout_rs_threshold_lower",
                lower,
                f"later releases write a k1 option's band as {NEW}rollout_rs_threshold=lower_upper",
                f"remove `{NEW}rollout_rs_threshold_lower`",
            )
        return
    upper = flat.get(NEW + "rollout_rs_threshold") or flat.get(NEW + "rollout_is_threshold") or 2.0
    upper = float(upper)
    threshold = f"{upper}" if lower is None else f"{1.0 / upper!r}_{1.0 / float(lower)!r}"
    flat[NEW + "rollout_rs"], flat[NEW + "rollout_rs_threshold"] = RS_LEVELS[level], threshold
    decided.append(
        f"{NEW}rollout_rs={level} (ratios in [{lower or 1.0 / upper:g}, {upper:g}], verl 0.7.0): "
        f"rollout_rs={RS_LEVELS[level]} with rollout_rs_threshold={threshold} in verl's later "
        "releases and keel (the same band: k1 bounds -log ratio)"
    )
