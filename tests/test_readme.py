"""The README as a newcomer uses it: every Python block runs as written, and every command it names exists with
the flags and values it shows (issue 22.4: the quickstart had placeholders and failed on fp32 inputs).

* The Python blocks run in the order they appear, in one namespace (a later block may use the ``opt`` an earlier
  one built, as a reader would), in a fresh directory, one process, no process group (world size 1). The block
  that starts a process group itself (``init_process_group``) runs as its comment says: under torchrun, 2 ranks.
* Commands (``make ...``, ``python -m ...``, ``torchrun ...``) in shell blocks and inline code: the make target
  exists; the module or script exists, and every ``--flag`` and every lowercase word value after it appears in its
  ``--help`` (argparse lists choices there). Running them is other tests' job (test_example, test_benchmarks).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: the pages the README links to for the details: their commands are checked as the README's are
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
MAKE_SCRIPTS = {"train": "examples/train_gpt.py", "train-hf": "examples/train_hf.py"}  # what TRAIN_ARGS reach


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _python_blocks() -> tuple[list[str], list[str]]:
    blocks = _blocks("python")
    distributed = [b for b in blocks if "init_process_group" in b]
    return [b for b in blocks if b not in distributed], distributed


def test_the_readme_has_the_blocks_this_test_runs():
    local, distributed = _python_blocks()
    assert len(local) >= 3 and len(distributed) == 1, (len(local), len(distributed))
    assert any("ShardedAdamW" in b for b in local) and any("save_checkpoint" in b for b in local)


def test_every_python_block_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    local, _ = _python_blocks()
    for i, block in enumerate(local):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:  # name the block: the traceback's file is not a file
            raise AssertionError(f"README python block {i} failed:\n{block}") from e
    out = capsys.readouterr().out
    loss = float(re.search(r"loss (\S+),", out).group(1))
    assert 0 < loss < 10, out  # the quickstart trained (a NaN or a crash would not print a finite loss)
    assert (tmp_path / "ckpts").is_dir()


def test_the_buffer_quickstart_runs_under_torchrun(tmp_path):
    _, (block,) = _python_blocks()
    script = tmp_path / "buffer_quickstart.py"
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"  # each rank's stdout in a file of its own (on a shared pipe, lines interleave)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(logs), "--redirects", "1", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):  # every rank printed its pieces
        (out,) = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        lines = out.read_text().splitlines()
        assert lines and all(line.startswith(f"{rank} ShardPiece(") for line in lines), (rank, lines)


# ---------------------------------------------------------------------------------------------- commands
def _commands() -> list[str]:
    found = []
    for text in (README, *DOCS.values()):
        for block in _blocks("bash", text):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(("make ", "python -m ", "torchrun ")):
                    found.append(line)
        for inline in re.findall(r"`((?:make|python -m|torchrun) [^`]+)`", text):
            found.append(" ".join(inline.split()))  # (an inline command may wrap across lines)
    return sorted(set(found))


def _target(cmd: str) -> tuple[str, list[str]]:
    """(module or script, the arguments the user gives it) of a README command."""
    words = shlex.split(cmd)
    if words[0] == "make":
        target = words[1]
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"`{cmd}`: no make target {target!r}"
        args = []
        for w in words[2:]:
            if w.startswith("TRAIN_ARGS="):
                args = shlex.split(w.split("=", 1)[1])
        return MAKE_SCRIPTS.get(target, ""), args
    if "-m" in words:
        i = words.index("-m")
        return words[i + 1], words[i + 2:]
    script = next(w for w in words if w.endswith(".py"))
    return script, words[words.index(script) + 1:]


_HELP = """
import contextlib, io, runpy, sys
for target in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [target, "--help"]
    with contextlib.redirect_stdout(out):
        try:
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    sys.__stdout__.write(f"=== {target}\\n{out.getvalue()}")
"""


def test_every_command_in_the_readme_exists_with_the_flags_it_shows():
    commands = {cmd: _target(cmd) for cmd in _commands()}
    assert any(c.startswith("make train") for c in commands) and any("benchmarks.e2e" in c for c in commands)
    targets = sorted({t for t, _ in commands.values() if t})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    proc = subprocess.run([sys.executable, "-c", _HELP, *targets], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    helps = dict(re.findall(r"^=== (\S+)\n(.*?)(?=^=== |\Z)", proc.stdout, flags=re.S | re.M))
    for cmd, (target, args) in commands.items():
        if not target:
            continue
        text = helps.get(target, "")
        assert "usage:" in text, f"`{cmd}`: {target} --help printed no usage:\n{text}\n{proc.stderr[-2000:]}"
        for j, arg in enumerate(args):
            if arg.startswith("--"):
                assert re.search(rf"{re.escape(arg)}\b", text), f"`{cmd}`: {target} has no flag {arg}:\n{text}"
            elif j and args[j - 1].startswith("--") and re.fullmatch(r"[a-z][a-z0-9_-]*", arg):
                # a word value (a choice); placeholders are upper case (DIR, N), numbers are not checked
                assert re.search(rf"\b{re.escape(arg)}\b", text), f"`{cmd}`: {args[j - 1]} {arg} is not in:\n{text}"


# ---------------------------------------------------------------------------------------------- links
def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_readme_and_its_pages_resolves():
    """The README keeps the summary and links to docs/ for the details (session 29 moved them there): a link to a
    file that is not there, or to a heading that was renamed, would leave a reader at a dead end."""
    pages = {"README.md": README, **DOCS}
    checked = 0
    for name, text in pages.items():
        here = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else ROOT / name
            assert file.exists(), f"{name}: the link {target!r} points to {file}, which does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{name}: no heading for #{anchor} in {file.name}"
            checked += 1
    assert checked >= 10, checked  # the README links to each page of docs/, and each page back to it
    for page in DOCS:
        assert f"({page})" in README, f"README.md does not link to {page}"
