"""keel's token-level generate endpoint (`POST /inference/v1/generate`, the shape of vLLM's and of
what verifiers' TrainClient sends): prompt token ids in, the sampled ids and their log-probs out.
The prompt is the client's own tokens, never text encoded again, so the sample's trace is
token-exact; a prompt that does not extend the sample's tokens is a prefix break (trace.py), as a
chat turn's is.

Request: {"model": the sample, "token_ids": [id, ...], "sampling_params": {"max_tokens",
"temperature", "top_p", "top_k", "n", "logprobs", "stop_token_ids", ...}}.
Answer: {"request_id", "choices": [{"index": 0, "token_ids": [...], "logprobs": {"content":
[{"token": "token_id:<id>", "logprob": x}]}, "finish_reason": "stop" | "length"}],
"prompt_token_ids", "usage"}.

Bodies are hostile: every id within the vocabulary, every length within the rollout's, every
setting one the engine honours as asked, or a 400 that says which and why.
"""

from __future__ import annotations

import math
import uuid

from keel.rollout.agent.external.openai_requests import (
    BUDGET_SPENT,
    LIMIT_KEYS,
    SAMPLING_KEYS,
    RequestError,
    rollout_limit,
)

# top-level keys: the request's own; cache_salt, priority and request_id change no sampled token
TOP_KEYS = {"model", "token_ids", "sampling_params", "cache_salt", "priority", "request_id"}
# no effect on the tokens sampled: how the client detokenises, and where a bridged turn's prompt
# starts for the MoE routing replay that verifiers' TrainClient asks of vLLM (keel returns none)
NO_EFFECT_KEYS = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "detokenize",
    "routed_experts_prompt_start",
}
# settings the engine does not apply per request: accepted only at the values that change nothing
NEUTRAL = {
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "min_p": (0.0,),
    "min_tokens": (0,),
    "seed": (None,),
    "stop": (None, []),
    "prompt_logprobs": (None,),
    "ignore_eos": (False,),
}
KNOWN = set(SAMPLING_KEYS) | NO_EFFECT_KEYS | set(NEUTRAL) | set(LIMIT_KEYS)
KNOWN |= {"n", "logprobs", "stop_token_ids"}


class GenerateReader:
    """A generate request's prompt and turn limit, over an EngineService's settings and the size
    of the vocabulary."""

    def __init__(self, service, vocab: int):
        self.service, self.vocab = service, vocab

    def prompt(self, body: dict, trace=None) -> tuple[list[int], None]:
        """(the prompt's token ids, no conversation), or RequestError saying why not."""
        unknown = sorted(set(body) - TOP_KEYS)
        if unknown:
            raise RequestError(f"unknown keys {unknown}: this endpoint takes {sorted(TOP_KEYS)}")
        prompt = self._ids(body.get("token_ids"), "token_ids", _sampled(trace))
        if not prompt:
            raise RequestError("token_ids must be a non-empty list of token ids")
        _, max_len, _ = self.service.shape
        if len(prompt) >= max_len:
            # as a chat turn past the sample's budget: clients read it as a rollout at its length
            if trace is not None:
                trace.budget_spent = True
            raise RequestError(
                f"token_ids holds {len(prompt)} tokens; the rollout's context is {max_len}",
                kind=BUDGET_SPENT,
            )
        return prompt, None

    def limit(self, body: dict) -> int:
        """The turn's token limit, after refusing settings the engine does not apply as asked."""
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        unknown = sorted(set(params) - KNOWN)
        if unknown:
            raise RequestError(f"sampling_params {unknown} are not ones keel's engine applies")
        for key, neutral in NEUTRAL.items():
            if params.get(key) not in (None, *neutral):
                raise RequestError(
                    f"sampling_params.{key}={params[key]!r}: keel's engine samples without it "
                    f"(leave it unset or {neutral[0]!r})"
                )
        if params.get("logprobs") not in (None, 0, 1) or isinstance(params.get("logprobs"), bool):
            raise RequestError(
                "sampling_params.logprobs must be 0 or 1: keel answers the sampled token's"
            )
        stops = self._ids(params.get("stop_token_ids") or [], "sampling_params.stop_token_ids")
        beyond = sorted(set(stops) - set(self.service.stop_ids))
        if beyond:
            raise RequestError(
                f"sampling_params.stop_token_ids {beyond} are not the rollout's stop tokens "
                f"{sorted(self.service.stop_ids)}: the engine stops at those"
            )
        return rollout_limit(params, self.service, "sampling_params.")

    def _ids(self, ids, name: str, sampled=None) -> list[int]:
        """`ids`, each the tokenizer's or one `sampled()` holds (a model's embedding may have rows
        past its tokenizer's ids, and the engine may sample them)."""
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise RequestError(f"{name} must be a list of whole numbers (token ids)")
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:
            known = sampled() if sampled else set()
            outside = [t for t in outside if t not in known]
        if outside:
            raise RequestError(
                f"{name} holds ids outside the vocabulary of {self.vocab} that the engine did "
                f"not sample: {outside[:5]}"
            )
        return list(ids)


def _sampled(trace):
    """-> the ids the engine sampled for this sample so far (read only when needed)."""

    def ids() -> set[int]:
        if trace is None:
            return set()
        return {
            t
            for stretch in trace.stretches
            for t, kept in zip(stretch.ids, stretch.trained)
            if kept
        }

    return ids


def generate_answer(body: dict, prompt: list[int], completion) -> dict:
    """The engine's completion in the generate endpoint's form (vLLM's GenerateResponse)."""
    content = [
        {"token": f"token_id:{t}", "logprob": _finite(lp)}
        for t, lp in zip(completion.ids, completion.log_probs)
    ]
    wanted = body.get("sampling_params", {}).get("logprobs") is not None
    return {
        "request_id": str(body.get("request_id") or f"keel-{uuid.uuid4().hex}"),
        "choices": [
            {
                "index": 0,
                "token_ids": list(completion.ids),
                "logprobs": {"content": content} if wanted else None,
                "finish_reason": "stop" if completion.stopped else "length",
            }
        ],
        "prompt_token_ids": prompt,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(completion.ids),
            "total_tokens": len(prompt) + len(completion.ids),
        },
    }


def _finite(log_prob: float) -> float:
    """JSON holds no -inf: a token sampled at probability 0 (never, barring a bug) reads as the
    lowest float."""
    return float(log_prob) if math.isfinite(log_prob) else -1e30
