"""Every sample output in README.md and docs/*.md equals what its command prints now.

A sample is a fenced block right after an HTML comment that names its command:

    <!-- sample: pagedqvg plan --preset longlive2 -->          the whole stdout (an optional first line `$ <command>`)
    <!-- sample-tail: 5 lines of pagedqvg plan ... -->          the last 5 lines of stdout
    <!-- sample: plugin-log PAGEDQVG_BUDGET=24GiB ... -->       the SGLang plugin's log line, with those variables

`pagedqvg ...` runs in this process (`pagedqvg.cli.app.main`, stdout captured; `simulate` in a temporary working
directory, so its output paths read as a user's). `plugin-log` runs the plugin's `register()` in a fresh Python with
SGLang's `plugin_hook` stubbed (the real one needs SGLang installed). The only normalisation (`normalise`): the
seconds of `... calls in 7.72 s` and the pid of `(pid 1234)`, which differ between runs. Everything else must match
character for character, trailing spaces included.

When the output changes on purpose, rewrite every block from a fresh run:
`PYTHONPATH=$PWD python tests/test_docs_samples.py --write` (then review the diff).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKER = re.compile(r"^<!-- (sample|sample-tail): (?:(\d+) lines of )?(.+?) -->$")
_NORMALISE = ((re.compile(r"( calls in )[0-9.]+ s\b"), r"\1T s"), (re.compile(r"\(pid \d+\)"), "(pid N)"))


@dataclass(frozen=True)
class Sample:
    """One sample block: file, 0-based line index of its first content line, the command, its lines as written."""

    path: Path
    first: int
    command: str
    tail: int | None
    lines: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.first + 1}:{self.command}"


def samples(paths: tuple[Path, ...] = DOCS) -> list[Sample]:
    """Every marked block of `paths`. A marker not followed by a fenced block is an error (ValueError)."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(text):
            m = MARKER.match(line)
            if not m:
                continue
            if i + 1 >= len(text) or not text[i + 1].startswith("```"):
                raise ValueError(f"{path.name}:{i + 1}: sample marker not followed by a fenced block")
            end = next(j for j in range(i + 2, len(text)) if text[j].startswith("```"))
            found.append(Sample(path, i + 2, m.group(3), int(m.group(2)) if m.group(2) else None,
                                tuple(text[i + 2 : end])))  # fmt: skip
    return found


def normalise(line: str) -> str:
    """A line with its run-dependent parts (seconds of a timed run, a pid) replaced by placeholders."""
    for pattern, repl in _NORMALISE:
        line = pattern.sub(repl, line)
    return line


def run_pagedqvg(argv: list[str], cwd: Path) -> list[str]:
    """`pagedqvg ARGV`'s stdout lines, run in this process with `cwd` as the working directory."""
    from pagedqvg.cli.app import main

    out, here = io.StringIO(), Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            status = main(argv)
    finally:
        os.chdir(here)
    assert status == 0, f"pagedqvg {' '.join(argv)} exited with {status}"
    return out.getvalue().rstrip("\n").split("\n")


_PLUGIN_LOG = """
import logging, sys, types
from pagedqvg.integrations.sglang import plugin
mod = types.ModuleType("sglang.multimodal_gen.runtime.platforms.plugins")
mod.HookType = types.SimpleNamespace(AROUND="around", BEFORE="before", AFTER="after")
mod.plugin_hook = lambda target, kind: (lambda fn: fn)
sys.modules[mod.__name__] = mod
from pagedqvg.integrations.sglang.versions import CURRENT, targets_for
plugin._check_sglang_version = lambda: targets_for(CURRENT)  # SGLang itself is not installed here: its table
plugin.register()
"""


def run_plugin_log(assignments: list[str]) -> list[str]:
    """The plugin's log lines (stderr) in a fresh Python whose environment has only `assignments` of PAGEDQVG_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQVG")}
    env.update(a.split("=", 1) for a in assignments)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _PLUGIN_LOG], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [x for x in done.stderr.rstrip("\n").split("\n") if x.startswith("[pagedqvg]")]


def fresh_output(sample: Sample, cwd: Path) -> list[str]:
    """What the sample's command prints now (its last `tail` lines for a sample-tail)."""
    words = sample.command.split()
    if words[0] == "pagedqvg":
        lines = run_pagedqvg(words[1:], cwd)
    elif words[0] == "plugin-log":
        lines = run_plugin_log(words[1:])
    else:
        raise ValueError(f"{sample.id}: unknown sample command {words[0]!r} (valid: pagedqvg, plugin-log)")
    return lines[-sample.tail :] if sample.tail else lines


def written_output(sample: Sample) -> list[str]:
    """The block's lines without its optional `$ command` line."""
    lines = list(sample.lines)
    if lines and lines[0] == f"$ {sample.command}":
        lines = lines[1:]
    return lines


SAMPLES = samples()


def test_the_docs_have_samples() -> None:
    commands = [s.command for s in SAMPLES]
    assert any(c.startswith("pagedqvg plan") for c in commands)
    assert "pagedqvg simulate --kv-cache-quant int2" in commands
    assert any(c.startswith("plugin-log") for c in commands)
    assert {s.path.name for s in SAMPLES} >= {"README.md", "PLANNING.md"}


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.id for s in SAMPLES])
def test_sample_matches_a_fresh_run(sample: Sample, tmp_path: Path) -> None:
    fresh = [normalise(x) for x in fresh_output(sample, tmp_path)]
    written = [normalise(x) for x in written_output(sample)]
    assert written == fresh, f"{sample.id}: regenerate with `python tests/test_docs_samples.py --write`"


def test_a_changed_line_is_noticed(tmp_path: Path) -> None:
    """The comparison is exact: one changed figure, or a missing line, fails."""
    sample = next(s for s in SAMPLES if s.command.startswith("pagedqvg plan") and s.tail is None)
    fresh = [normalise(x) for x in fresh_output(sample, tmp_path)]
    assert [normalise(x) for x in written_output(sample)] == fresh
    changed = [re.sub(r"\d", "7", fresh[0], count=1), *fresh[1:]]
    assert changed != fresh and fresh[:-1] != fresh
    assert normalise("400 calls in 7.72 s; pool") == normalise("400 calls in 0.5 s; pool")
    assert normalise("a (pid 12) b") == "a (pid N) b"


def write(paths: tuple[Path, ...] = DOCS) -> int:
    """Rewrite every sample block of `paths` from a fresh run (keeping a `$ command` line where there was one)."""
    import tempfile

    count = 0
    for path in paths:
        text = path.read_text(encoding="utf-8").split("\n")
        for sample in reversed(samples((path,))):
            with tempfile.TemporaryDirectory() as tmp:
                fresh = fresh_output(sample, Path(tmp))
            head = [f"$ {sample.command}"] if sample.lines[:1] == (f"$ {sample.command}",) else []
            text[sample.first : sample.first + len(sample.lines)] = head + fresh
            count += 1
        path.write_text("\n".join(text), encoding="utf-8")
    return count


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_docs_samples.py --write")
    print(f"rewrote {write()} sample blocks")
