"""keel: reinforcement-learning post-training for Hugging Face language models."""

from importlib import metadata as _metadata


def _version() -> str:
    try:
        return _metadata.version("keel")
    except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+source"


__version__ = _version()
