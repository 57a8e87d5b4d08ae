"""Applying a printed fix line as a user would (tests/integration/test_fix_lines*.py).

A fix line's first option (the text before the first ", or ") is applied whole, as printed; each
backticked group in it is one of:
  `key=value ...`                overrides, appended to the command (the last one of a key wins)
  `NEW` in place of `OLD`        OLD, an argument of the command, replaced by NEW's words
  remove `KEY`                   the override of KEY dropped
  `"field": value` in `F.json`   the JSON file F edited
  `keel ...` / `python ...`      a command run (a `keel` command other than reward-server is the
                                 next command to try); `export V=x` / `unset V` set the environment
  `FILE` (with `function`)       a change to the user's own file that the fix line describes in
                                 words (return a float, add the ground truth): the test writes the
                                 user's corrected file, given beforehand, and only for the file
                                 named
Anything else in a first option is a fix this module cannot apply: the test fails, as it should.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from keel.cli import main

GROUP = re.compile(r"`([^`]*)`")
JSON_EDIT = re.compile(r'`("[^`"]+": [^`]*)` in `([^`]+\.json)`')
IN_PLACE = re.compile(r"`([^`]*)` in place of `([^`]*)`")
ERROR = re.compile(r"^([ \t]*)error\[(KEEL-[A-Z]\d{3})\]", re.M)


@dataclass
class Attempt:
    status: int
    output: str

    @property
    def codes(self) -> list[str]:
        return [m.group(2) for m in ERROR.finditer(self.output)]

    def fix_of(self, code: str) -> str:
        """The fix line printed for the first error of `code`: the first `fix:` line after it at the
        error's own indentation (a list of several problems has its own, indented deeper)."""
        match = next(m for m in ERROR.finditer(self.output) if m.group(2) == code)
        indent = match.group(1)
        for line in self.output[match.end() :].splitlines():
            if line.startswith(f"{indent}fix: "):
                return line[len(indent) + len("fix: ") :]
        raise AssertionError(f"no fix line for {code} in:\n{self.output}")


def attempt(argv: list[str]) -> Attempt:
    """`keel ARGV` in this process: its exit status and everything it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(list(argv))
    return Attempt(status, out.getvalue())


class Applier:
    """Applies fix lines to a command; started services are stopped by close()."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.services: list[subprocess.Popen] = []
        # a user's file -> its corrected text
        self.corrections: dict[str, str] = {}

    def apply(self, fix: str, argv: list[str]) -> list[str]:
        option = fix.split(", or ")[0]
        argv = list(argv)
        # not on the command line: written in the config file
        for new, old in IN_PLACE.findall(option):
            argv = [w for a in argv for w in (shlex.split(new) if a == old else [a])] + (
                [] if old in argv else shlex.split(new)
            )
            option = option.replace(f"`{new}` in place of `{old}`", "")
        for field, path in JSON_EDIT.findall(option):
            key, _, value = field.partition(": ")
            data = json.loads(Path(path).read_text())
            data[json.loads(key)] = json.loads(value)
            Path(path).write_text(json.dumps(data))
            option = option.replace(f"`{field}` in `{path}`", "")
        removed = re.findall(r"remove `([^`=]+)`", option)
        argv = [a for a in argv if not any(a == k or a.startswith(k + "=") for k in removed)]
        option = re.sub(r"remove `[^`=]+`", "", option)
        edited = [group for group in GROUP.findall(option) if group in self.corrections]
        for path in edited:
            Path(path).write_text(self.corrections.pop(path))
        for group in GROUP.findall(option):
            # the file, the function in it
            if not (group in edited or edited and group.isidentifier()):
                argv = self._apply_group(group, argv)
        return argv

    def _apply_group(self, group: str, argv: list[str]) -> list[str]:
        words = shlex.split(group)
        if words[0] == "keel" and words[1] == "reward-server":
            self._serve(words[1:])
        elif words[0] == "keel":
            return words[1:]
        elif words[0] == "python":
            subprocess.run([sys.executable, *words[1:]], check=True, timeout=600)
        elif words[0] == "export":
            name, _, value = words[1].partition("=")
            self.monkeypatch.setenv(name, value)
        elif words[0] == "unset":
            self.monkeypatch.delenv(words[1], raising=False)
        elif all("=" in w for w in words):
            return argv + words
        else:
            raise AssertionError(f"a fix this test cannot apply as printed: `{group}`")
        return argv

    def _serve(self, args: list[str]) -> None:
        """Start `keel reward-server ...` and wait for its /health, as a user's second terminal
        would."""
        service = subprocess.Popen(
            [sys.executable, "-m", "keel", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.services.append(service)
        port = args[args.index("--port") + 1]
        # it imports keel first: tens of seconds on a busy machine
        for _ in range(600):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                return
            assert service.poll() is None, "keel reward-server exited"
            time.sleep(0.2)
        raise AssertionError("keel reward-server did not answer /health")

    def close(self) -> None:
        for service in self.services:
            service.terminate()
            service.wait(timeout=30)


def apply_and_rerun(
    argv: list[str], code: str, applier: Applier, then: tuple[str, ...] = ()
) -> tuple[str, Attempt]:
    """Make the mistake, apply its fix line as printed, run again: (the fix line, the second run).
    The error must be gone, and the command must then work: where the fixed command stops at another
    check, that check's printed fix is applied too (twice at most), as a user would follow them.
    `then`: codes the case's own setup meets after the fix, which are not the fix's doing."""
    first = attempt(argv)
    assert code in first.codes, f"expected {code}:\n{first.output}"
    fix = first.fix_of(code)
    fixed = applier.apply(fix, argv)
    second = last = attempt(fixed)
    assert f"error[{code}]" not in second.output, f"fix: {fix}\nand then:\n{second.output}"
    followed = [fix]
    for _ in range(2):
        if last.status == 0 or not last.codes or set(last.codes) <= set(then):
            break
        followed.append(last.fix_of(last.codes[0]))
        fixed = applier.apply(followed[-1], fixed)
        last = attempt(fixed)
        assert f"error[{code}]" not in last.output, f"fixes: {followed}\nand then:\n{last.output}"
    assert last.status == 0 or (last.codes and set(last.codes) <= set(then)), (
        f"fixes followed: {followed}\nand then:\n{last.output[-3000:]}"
    )
    return fix, second


@dataclass
class Context:
    """A mistake's surroundings: the tiny config as a file, its assets, a scratch folder (the
    working directory, so relative paths a fix names land there)."""

    cfg: dict
    assets: dict
    tmp: Path
    config: str
    applier: Applier

    def check(self, *overrides: str) -> list[str]:
        return ["check", self.config, *overrides]

    def train(self, *overrides: str) -> list[str]:
        return [
            "train",
            self.config,
            "trainer.total_training_steps=1",
            "trainer.test_freq=-1",
            *overrides,
        ]

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def rows(self, name: str, rows: list[dict]) -> str:
        return str(self.write(name, "".join(json.dumps(r) + "\n" for r in rows)))

    def mistaken(self, name: str, text: str, corrected: str) -> str:
        """A file of the user's with a mistake in it, and the file as the user corrects it."""
        path = str(self.write(name, text))
        self.applier.corrections[path] = corrected
        return path

    def model_copy(self, name: str, drop_template: bool = False, **edits: dict) -> Path:
        """The tiny model copied, with `file.json`'s fields set as `edits[file]` says; without its
        chat template if `drop_template`."""
        import shutil

        model = self.tmp / name
        shutil.copytree(self.assets["model"], model)
        for file, fields in edits.items():
            path = model / f"{file}.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
        if drop_template:
            tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
            tokenizer_config.pop("chat_template", None)
            (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
            (model / "chat_template.jinja").unlink(missing_ok=True)
        return model


@pytest.fixture
def ctx(tiny_config, tiny_assets, tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    applier = Applier(monkeypatch)
    yield Context(tiny_config, tiny_assets, tmp_path, str(config), applier)
    applier.close()
