"""The weight files of a checkpoint against the architecture its config describes: shapes that
disagree are an error naming the config field to fix; tensors the architecture has that the files
lack are a warning, unless transformers builds them on load (a mixture's stacked experts)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from torch import nn

from keel.errors import WEIGHTS_BROKEN, KeelError
from keel.models.load import weight_file_shapes


def check_weights_match(
    path: str | Path, model_cfg, model: nn.Module | None
) -> tuple[str, str | None]:
    """The weight files against `model`, the config's architecture on the meta device (None when it
    would not build there): a tensor of another shape is an error. Returns a summary, and a warning
    when tensors the architecture has are not in the files under their names (transformers renames
    some keys on load, so that alone is not an error; unmatched ones would start from random
    values)."""
    found = weight_file_shapes(path)
    if not found:
        return "no safetensors files to check (weights in another format)", None
    if model is None:
        return (
            f"{len(found)} tensors; shapes not compared (the architecture does not build on "
            "the meta device)",
            None,
        )
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # saved once, as the embedding
    if getattr(model_cfg, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    pairs = [
        (name, found[name], shape)
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    wrong = [f"{name} {list(have)} (the config says {list(shape)})" for name, have, shape in pairs]
    if wrong:
        raise KeelError(
            WEIGHTS_BROKEN,
            f"{len(wrong)} tensors in {path} do not match config.json: {wrong[0]}"
            + (f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""),
            _config_size_fix(Path(path), [(have, shape) for _, have, shape in pairs]),
        )
    missing = [
        name for name in expected if name not in found and not _built_on_load(name, found, model)
    ]
    warning = (
        f"{len(missing)} of the {len(expected)} tensors the config's architecture has are not in "
        f"{path}'s weight files under their names (first: {missing[0]}): unless transformers maps "
        "them on load, they start from random values"
        if missing
        else None
    )
    return f"{len(found)} tensors, shapes match the config", warning


def _built_on_load(name: str, found: dict, model: nn.Module) -> bool:
    """Whether transformers builds tensor `name` on load from others in the files: a mixture's
    experts are saved one by one (`mlp.experts.3.gate_proj.weight`) and stacked on load into
    `mlp.experts.gate_up_proj`, as its conversion mapping for the architecture says."""
    try:
        from transformers.conversion_mapping import WeightConverter, get_model_conversion_mapping

        converters = [
            c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)
        ]
    # transformers 4: no conversions, every tensor is saved as the model holds it
    except ImportError:
        return False
    for converter in converters:
        for target in converter.target_patterns:
            if not name.endswith(target):
                continue
            prefix = name[: -len(target)]
            sources = [
                re.compile(re.escape(prefix + source).replace(r"\*", r"\d+"))
                for source in converter.source_patterns
            ]
            if all(any(pattern.fullmatch(key) for key in found) for pattern in sources):
                return True
    return False


def _config_size_fix(path: Path, shapes: list[tuple[tuple, tuple]]) -> str | None:
    """The config.json field every wrong shape points at, set to the size the weights have: when one
    field's value is the size the config expects in each, and the weights agree on one other
    size."""
    config = json.loads((path / "config.json").read_text())
    fields, sizes = None, set()
    for have, want in shapes:
        for h, w in zip(have, want):
            if h != w:
                named = {k for k, v in config.items() if type(v) is int and v == w}
                fields, sizes = (named if fields is None else fields & named), sizes | {h}
    if not fields or len(fields) != 1 or len(sizes) != 1:
        return None
    return (
        f'set `"{fields.pop()}": {sizes.pop()}` in `{path / "config.json"}` '
        "(the size the weights have), "
        "or point the model path at the directory whose config.json matches these weights"
    )
