"""keel: reinforcement-learning post-training for Hugging Face language models."""

# first, before anything loads torch (the module says why)
from keel import openmp as _openmp  # noqa: F401
from keel.version import __version__


def __getattr__(name: str):
    """The Python API, imported on first use so `import keel` stays light."""
    if name == "train":
        from keel.api import train

        return train
    if name == "RLTrainer":
        from keel.trainer.rl import RLTrainer

        return RLTrainer
    if name == "load_config":
        from keel.config.load import load_config

        return load_config
    if name == "load_run":
        from keel.config.load import load_run

        return load_run
    raise AttributeError(f"module 'keel' has no attribute {name!r}")


__all__ = ["__version__", "train", "RLTrainer", "load_config", "load_run"]
