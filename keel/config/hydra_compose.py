"""verl's launch form, `keel train --config-path DIR --config-name NAME [overrides]`: the YAML
composed as Hydra composes it for verl (its `defaults:` list, its `hydra.searchpath`), into the
plain tree keel.config.load takes.

verl's example YAMLs compose verl's trainer config with `defaults: [ppo_trainer, _self_]` and
`hydra: searchpath: [file://verl/trainer/config]`, a path relative to a checkout of verl. keel finds
that config wherever it runs: from the installed verl when there is one, else from keel's copy of
verl 0.9.1's trainer config (verl_trainer/ppo_trainer.yaml); a relative `--config-path=config` is
verl's trainer config too, as Hydra reads it next to verl's main_ppo.py. Overrides are not given to
Hydra: keel applies them after composing (load.py), so keel's keys, renames and errors apply to
them.
"""

from __future__ import annotations

import difflib
import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from keel.errors import (
    CONFIG_FILE,
    LAUNCH_CONFIG_NAME,
    LAUNCH_CONFIG_PATH,
    LAUNCH_DEFAULTS,
    LAUNCH_SEARCHPATH,
    KeelError,
)

# verl 0.9.1's _generated_ppo_trainer.yaml as ppo_trainer.yaml
KEEL_COPY = Path(__file__).parent / "verl_trainer"
KEEL_COPY_VERSION = "0.9.1"
VERL_TRAINER_CONFIG = ("verl", "trainer", "config")
# verl's main_ppo: @hydra.main(config_path="config", config_name="ppo_trainer")
DEFAULT_NAME = "ppo_trainer"


@dataclass(frozen=True)
class VerlLaunch:
    """`--config-path` and `--config-name` as given (None: not given; "": given without a value)."""

    config_path: str | None = None
    config_name: str | None = None


def compose_launch(launch: VerlLaunch) -> tuple[dict, list[str]]:
    """The composed tree (OmegaConf references left for keel to resolve after the overrides) and
    what keel decided on the way (which verl trainer config it used), for `keel check`'s list."""
    notes: list[str] = []
    directory = config_directory(launch.config_path, notes)
    name = config_name(directory, launch.config_name)
    head = _primary(directory / f"{name}.yaml")
    searchpath = search_path(head, directory / f"{name}.yaml", notes)
    tree = _compose(directory, name, searchpath)
    for dotted, why in NOT_FROM_VERLS_DEFAULTS.items():
        *parents, leaf = dotted.split(".")
        node, mine = tree, head
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            mine = mine.get(part) if isinstance(mine, dict) else None
        if (
            isinstance(node, dict)
            and leaf in node
            and not (isinstance(mine, dict) and leaf in mine)
        ):
            notes.append(f"{dotted}: verl's default {node.pop(leaf)!r} left out: {why}")
    return tree, notes


# Defaults of verl's trainer config that mean another thing in keel, left out unless the YAML or an
# override sets them (keel's default applies, and `keel check` says so).
NOT_FROM_VERLS_DEFAULTS = {
    "reward.num_workers": "verl's reward-loop workers are Ray actors; keel's reward.num_workers "
    "are scoring processes, 0 (the trainer's process) unless asked",
}


def verl_trainer_config() -> tuple[Path, str]:
    """verl's trainer config directory: the installed verl's (found without importing verl, whose
    package needs its whole dependency set), else keel's copy; and words saying which."""
    for location in installed_verl():
        found = Path(location, *VERL_TRAINER_CONFIG[1:])
        if (found / f"{DEFAULT_NAME}.yaml").is_file():
            from importlib.metadata import PackageNotFoundError, version

            try:
                release = version("verl")
            except PackageNotFoundError:
                release = "(version unknown)"
            return found, f"the installed verl {release}'s ({found})"
    return KEEL_COPY, f"keel's copy of verl {KEEL_COPY_VERSION}'s (verl is not installed)"


def installed_verl() -> list[str]:
    """The installed verl package's directories (none without verl)."""
    spec = importlib.util.find_spec("verl")
    return list(spec.submodule_search_locations or []) if spec else []


def config_directory(given: str | None, notes: list[str]) -> Path:
    # --config-name alone: verl's main_ppo reads its own config directory
    if given is None:
        found, which = verl_trainer_config()
        notes.append(f"--config-path: not given, so verl's trainer config, {which}")
        return found
    if not given.strip():
        raise KeelError(
            LAUNCH_CONFIG_PATH,
            "--config-path was given without a directory",
            "pass `--config-path DIR` with the directory that holds the YAML --config-name names",
        )
    path = Path(given).expanduser()
    if path.is_dir():
        return path.resolve()
    # Hydra: relative to verl/trainer/main_ppo.py
    if not path.is_absolute() and path.parts in ((), ("config",)):
        found, which = verl_trainer_config()
        notes.append(
            f"--config-path={given}: verl's trainer config as verl's main_ppo reads it, {which}"
        )
        return found
    if path.is_file():
        raise KeelError(
            LAUNCH_CONFIG_PATH,
            f"--config-path {given!r} is a file; it names a directory",
            f"pass `{path.parent}` in place of `{given}` (the directory; --config-name "
            f"{path.stem})",
        )
    near = _near_directory(path)
    raise KeelError(
        LAUNCH_CONFIG_PATH,
        f"--config-path {given!r} is not a directory",
        f"pass `{near}` in place of `{given}` (the directory beside it spelt most like it)"
        if near
        else "pass a directory that exists with --config-path (the nearest that does is "
        f"{_existing_parent(path)})",
    )


def config_name(directory: Path, given: str | None) -> str:
    if given is not None and not given.strip():
        raise KeelError(
            LAUNCH_CONFIG_NAME,
            "--config-name was given without a name",
            f"pass `--config-name NAME` naming a YAML file of {directory} (without .yaml)",
        )
    name = given or DEFAULT_NAME
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    if (directory / f"{name}.yaml").is_file():
        return name
    present = sorted(p.stem for p in directory.glob("*.yaml"))
    near = difflib.get_close_matches(name, present, n=1, cutoff=0.6)
    shown = (
        ", ".join(present[:12]) + (", ..." if len(present) > 12 else "")
        if present
        else "no YAML file"
    )
    fix = (
        f"pass `{near[0]}` in place of `{given}` (the config there spelt most like it)"
        if near and given
        else f"pass one of the configs of {directory} with --config-name: {shown}"
    )
    raise KeelError(
        LAUNCH_CONFIG_NAME,
        f"--config-name {name!r}: {directory} has no {name}.yaml (it holds {shown})",
        fix,
    )


def _primary(primary: Path) -> dict:
    try:
        head = yaml.safe_load(primary.read_text()) or {}
    except yaml.YAMLError as e:
        raise KeelError(CONFIG_FILE, f"{primary} is not valid YAML: {e}") from e
    if not isinstance(head, dict):
        raise KeelError(
            CONFIG_FILE, f"{primary} must hold a mapping of sections, got {type(head).__name__}"
        )
    return head


def search_path(head: dict, primary: Path, notes: list[str]) -> list[str]:
    """The YAML's hydra.searchpath, each entry a directory that exists (verl's trainer config found
    where keel can find it)."""
    hydra = head.get("hydra") if isinstance(head.get("hydra"), dict) else {}
    entries = hydra.get("searchpath") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise KeelError(
            LAUNCH_SEARCHPATH,
            f"{primary}: hydra.searchpath must be a list of file:// or pkg:// entries, got "
            f"{entries!r}",
            f"in `{primary}`, write hydra.searchpath as a list of "
            "directories (file://verl/trainer/config for verl's trainer config)",
        )
    return [_search_entry(entry, primary, notes) for entry in entries]


def _search_entry(entry: str, primary: Path, notes: list[str]) -> str:
    scheme, sep, where = entry.partition("://")
    if not sep:
        scheme, where = "file", entry
    if scheme == "pkg":
        if where == ".".join(VERL_TRAINER_CONFIG):
            found, which = verl_trainer_config()
            notes.append(f"hydra.searchpath {entry}: {which}")
            return str(found)
        located = _package_directory(where)
        if located:
            return str(located)
    elif scheme == "file":
        path = Path(where).expanduser()
        if path.is_dir():
            return str(path.resolve())
        if path.parts[-3:] == VERL_TRAINER_CONFIG:
            found, which = verl_trainer_config()
            notes.append(
                f"hydra.searchpath {entry}: not under {Path.cwd()}, so verl's trainer config, "
                f"{which}"
            )
            return str(found)
    raise KeelError(
        LAUNCH_SEARCHPATH,
        f"{primary}: hydra.searchpath entry {entry!r} is not there ("
        + (
            f"no directory {Path(where).expanduser().absolute()}"
            if scheme == "file"
            else f"no package {where!r}"
            if scheme == "pkg"
            else f"Hydra reads file:// and pkg://, not {scheme}://"
        )
        + ")",
        f"in `{primary}`, make hydra.searchpath's entry {entry!r} a directory that exists, or "
        "remove it",
    )


def _package_directory(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _compose(directory: Path, name: str, searchpath: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    quoted = ",".join(
        "'file://" + p.replace("\\", "\\\\").replace("'", "\\'") + "'" for p in searchpath
    )
    GlobalHydra.instance().clear()
    primary = directory / f"{name}.yaml"
    try:
        with (
            warnings.catch_warnings(),
            initialize_config_dir(config_dir=str(directory), version_base=None),
        ):
            # Hydra's notes on search paths; keel's are in `notes`
            warnings.simplefilter("ignore")
            cfg = compose(name, overrides=[f"hydra.searchpath=[{quoted}]"])
            tree = OmegaConf.to_container(cfg, resolve=False)
    except MissingConfigException as e:
        raise _missing_default(e, primary, [str(directory), *searchpath]) from None
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        raise KeelError(
            LAUNCH_DEFAULTS,
            f"{primary}: Hydra cannot compose it: {_first_line(e)}",
            f"in `{primary}`, write its defaults list as Hydra reads it (a list of config names, "
            "`_self_` last; verl's: `- ppo_trainer` then `- _self_`)",
        ) from None
    finally:
        GlobalHydra.instance().clear()
    return tree if isinstance(tree, dict) else {}


def _missing_default(error: Exception, primary: Path, directories: list[str]) -> KeelError:
    # "In 'NAME': Could not load 'MISSING'."
    text = str(error)
    missing = getattr(error, "missing_cfg_file", None) or (
        text.split("'")[3] if text.count("'") >= 4 else text
    )
    found = sorted({p.stem for d in directories for p in Path(d).glob("*.yaml")} - {primary.stem})
    near = difflib.get_close_matches(missing, found, n=1, cutoff=0.6)
    searched = ", ".join(directories)
    fix = (
        f"in `{primary}`, write `{near[0]}` for {missing!r} in its defaults list (the config "
        "spelt most like it)"
        if near
        else f"in `{primary}`, name a config of {searched} in its defaults list, or add the "
        "directory that holds it to hydra.searchpath (file://verl/trainer/config for verl's "
        "ppo_trainer)"
    )
    return KeelError(
        LAUNCH_DEFAULTS,
        f"{primary}: its defaults list names {missing!r}, which no directory of the search "
        f"path holds ({searched})",
        fix,
    )


def _first_line(error: Exception) -> str:
    return next(
        (line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__
    )


def _near_directory(path: Path) -> str | None:
    parent = path.parent if path.parent.is_dir() else None
    if parent is None:
        return None
    siblings = [p.name for p in parent.iterdir() if p.is_dir()]
    near = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    return str(parent / near[0]) if near else None


def _existing_parent(path: Path) -> Path:
    return next((p for p in path.absolute().parents if p.is_dir()), Path("/"))
