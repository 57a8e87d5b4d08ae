"""keel's version, in a module of its own: the package's face imports the API lazily, and
modules that stamp the version (checkpoints, the command line) must not import that face."""

from importlib import metadata as _metadata


def _version() -> str:
    try:
        return _metadata.version("keel")
    # running from a source tree that was never installed
    except _metadata.PackageNotFoundError:
        return "0.0.0+source"


__version__ = _version()
