"""The documentation runs: every ```python block of README.md and docs/*.md, and the site's strict build.

Each ```python block is executed as a script of its own, in a subprocess whose working directory is a
fresh temporary folder, with ``OMP_NUM_THREADS=1`` and a 120 s limit. Blocks must not use Ray: the
runner blocks ``import ray`` (a runnable example trains in-process, ``num_workers=0``). A block that cannot
run here (it needs a cluster, a GPU, the network, or names the user's own objects) carries an HTML comment
on the line right before its fence, ``<!-- not run: REASON -->``; it is reported as skipped with that
reason, and a marker without a reason fails.

The site test runs ``mkdocs build --strict`` (warnings are errors) into a temporary folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 120

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
_MARKER_START = re.compile(r"^\s*<!--\s*not run\b")

# Runs a block as __main__ with Ray unimportable (a None entry in sys.modules makes `import ray` fail and
# importlib.util.find_spec("ray") answer None, as when Ray is not installed).
_RUNNER = """\
import runpy, sys
for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
    del sys.modules[name]
sys.modules["ray"] = None
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@dataclass
class Block:
    path: Path
    index: int  # among the file's python blocks
    line: int  # 1-based line of the opening fence
    code: str
    marker: str | None  # the line before the fence when it is a "not run" marker
    reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}-{self.index}"


def python_blocks(path: Path) -> list[Block]:
    """The fenced blocks whose info string starts with ``python``, with the marker before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if info.split(" ")[0].lower() == "python":
            before = lines[i - 1] if i > 0 else ""
            marker = before if _MARKER_START.match(before) else None
            found = _NOT_RUN.match(before)
            reason = found["reason"].strip() if found else None
            code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
            blocks.append(Block(path, len(blocks), i + 1, code, marker, reason))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in python_blocks(path)]


def test_the_documentation_has_python_blocks_and_some_run():
    assert ALL_BLOCKS, "no ```python block found in README.md or docs/*.md"
    runnable = [block.name for block in ALL_BLOCKS if block.marker is None]
    assert len(runnable) >= 3, f"too few runnable examples: {runnable}"


def test_every_not_run_marker_gives_a_reason_and_precedes_a_python_block():
    problems = [f"{block.name} (line {block.line}): {block.marker.strip()!r}" for block in ALL_BLOCKS
                if block.marker is not None and not block.reason]
    assert not problems, "a `<!-- not run: REASON -->` marker needs a reason: " + "; ".join(problems)
    marked_lines = {(block.path, block.line - 1) for block in ALL_BLOCKS if block.marker is not None}
    stray = []
    for path in DOC_FILES:
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if _MARKER_START.match(text) and (path, number) not in marked_lines:
                stray.append(f"{path.relative_to(ROOT).as_posix()}:{number}")
    assert not stray, ("a `not run` marker must be on the line right before a ```python fence: "
                       + ", ".join(stray))


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[block.name for block in ALL_BLOCKS])
def test_python_block_runs(block: Block, tmp_path):
    if block.marker is not None:
        if not block.reason:
            pytest.fail(f"{block.name}: a `not run` marker without a reason")
        pytest.skip(f"not run: {block.reason}")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    try:
        result = subprocess.run([sys.executable, "-c", _RUNNER, str(script)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} (line {block.line}) ran past {BLOCK_TIMEOUT_S} s")
    output = (result.stdout + result.stderr)[-6000:]
    hint = ("\nThe block imports Ray: documentation examples run in-process (num_workers=0), or are marked "
            "`<!-- not run: REASON -->`." if "import of ray halted" in output else "")
    assert result.returncode == 0, (f"{block.name} (line {block.line}) exited with {result.returncode}:"
                                    f"\n{output}{hint}")


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                   "-d", str(site)]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("mkdocs build --strict ran past 240 s")
    output = (result.stdout + result.stderr)[-6000:]
    if "No module named mkdocs" in output:
        pytest.fail("mkdocs is not installed: pip install -c constraints.txt -e '.[docs]'")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert (site / "index.html").is_file()
    assert (site / "api" / "index.html").is_file()
