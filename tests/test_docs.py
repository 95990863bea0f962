"""The documentation still says what the code does (issue #38): the README and every page under ``docs/``.

* Every fenced shell command ``python -m runner ...`` (also ``torchrun ... -m runner ...``, after leading
  ``VAR=value`` assignments, and the ``command:`` lists of fenced YAML) composes with Hydra against ``conf/``
  exactly as ``python -m runner`` does (each job of a ``-m`` sweep on its own), then passes the schema check a run
  starts with (``runner.app.checks.check_schema``: a ``+key`` Hydra adds without checking); a refused line is
  reported with what the runner's own pre-Hydra checks print for it (``runner.tools.sweep.sweep_override_problem``,
  ``runner.app.console.override_key_problem``, as ``runner/__main__.py`` runs them). Nothing runs and no file is read:
  composition resolves no path, so placeholders (``/snap``, ``/models/clip``, a tool's ``outputs/runs/<date>/<time>``)
  are checked like real paths. Rules for writing commands: a placeholder holds no space (it would split into two
  arguments), and none in a Hydra override holds ``<`` or ``>`` (its grammar refuses them); a ``...`` argument is an elision and is dropped; a command that composes only with an optional extra
  (``hydra/launcher=submitit_*``: the scale extra's Hydra plugin) is skipped naming the extra where it is missing.
* Every fenced ``python -m runner.<tool> ...`` command's arguments parse with that tool's own argparse parser:
  the tool's ``main`` is called with the arguments and stopped right after ``ArgumentParser.parse_args`` returns
  (nothing after the parse runs); an argument the parser refuses fails the test with argparse's message.
* Every relative link (inline or reference definition, outside code) reaches an existing file and, with
  ``#anchor``, a heading of that page (GitHub's slug rule); every repository path in backticks exists
  (``path.attr`` names an attribute of ``path.py``); ``python <script>.py`` names an existing script.
* The README is a front page: at most :data:`README_MAX_LINES` lines, linking every page. The configuration page
  names every option of every config group under ``conf/``, the backends page every backend ``runner.kernels.registry``
  registers, the console page every optional extra of ``pyproject.toml``.

The checks are functions (:func:`runner_problem`, :func:`tool_problem`, :func:`link_problems`) so that
:func:`test_the_checks_catch_what_they_are_for` can feed them broken commands and links: a misspelt override key
(``batchsize=4``, ``model.generation.widht=64``, ``+model.nme=x``, one in a sweep job), a misspelt tool flag and a
dead anchor must each be reported. Verified also by hand on the pages themselves: with ``batch_size=4`` changed to
``batchsize=4`` in docs/configuration.md, ``test_documented_runner_command_composes[docs/configuration.md:...]``
failed with the runner's ``did you mean batch_size?``; with ``--min-metric-ratio`` misspelt in docs/metrics.md,
the tool test failed with argparse's ``unrecognized arguments``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest
import yaml

from _helpers import skip_without_extra

pytestmark = pytest.mark.cpu

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")))
README_MAX_LINES = 300
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}
#: Command-line words that compose only with an optional extra installed: the word -> the extra.
COMPOSE_NEEDS_EXTRA = {"hydra/launcher=submitit": "scale"}
#: Repository paths written in the docs that are no file of the checkout, each with why.
NOT_IN_CHECKOUT = {"runner/conf": "the wheel's copy of conf/ (pyproject.toml package-dir)"}
TOP_DIRS = ("runner", "models", "kernels", "tests", "benchmarks", "conf", "scripts", "docs", ".ci")


# ------------------------------------------------------------------------------------------------ reading pages
@dataclass(frozen=True)
class Command:
    """One documented command: where it is, and its words (shell-split, continuation lines joined)."""

    page: Path
    line: int
    words: Tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT).as_posix()}:{self.line}"


def _blocks(text: str) -> Iterator[Tuple[Optional[str], int, List[str]]]:
    """The page cut at its fences: ``(info string, 1-based line of the first line, lines)`` of every fenced block
    (its body) and, with info ``None``, of the prose between them."""
    lines, i, prose_start = text.splitlines(), 0, 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        yield None, prose_start + 1, lines[prose_start:i]
        fence, info, start = m.group(1), m.group(2).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        yield info, start + 1, lines[start:i]
        i += 1
        prose_start = i
    yield None, prose_start + 1, lines[prose_start:]


def _split_commands(words: List[str]) -> Iterator[List[str]]:
    """The simple commands of a shell line (``a && b; c | d``), each without its leading ``VAR=value`` words."""
    for sep, group in itertools.groupby(words, key=lambda w: w in ("&&", "||", ";", "|")):
        if sep:
            continue
        cmd = list(group)
        while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):
            cmd.pop(0)
        if cmd:
            yield cmd


def shell_commands(page: Path, text: Optional[str] = None) -> Iterator[Command]:
    """Every simple command of the page's shell fences, and every ``command:`` list of its YAML fences."""
    text = page.read_text(encoding="utf-8") if text is None else text
    for info, first, body in _blocks(text):
        if info in SHELL_FENCES:
            logical, start = "", None
            for n, raw in enumerate(body, first):
                start = n if start is None else start
                if raw.rstrip().endswith("\\"):
                    logical += raw.rstrip()[:-1] + " "
                    continue
                words = shlex.split(logical + raw, comments=True)
                for cmd in _split_commands(words):
                    yield Command(page, start, tuple(cmd))
                logical, start = "", None
        elif info in ("yaml", "yml"):
            for doc in yaml.safe_load_all("\n".join(body)):
                for cmd in _yaml_commands(doc):
                    yield Command(page, first, tuple(str(w) for w in cmd))


def _yaml_commands(node) -> Iterator[list]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "command" and isinstance(value, list):
                yield value
            else:
                yield from _yaml_commands(value)
    elif isinstance(node, list):
        for value in node:
            yield from _yaml_commands(value)


def runner_args(words: Sequence[str]) -> Optional[Tuple[str, List[str]]]:
    """``("runner", args)`` for ``python -m runner args`` (or ``torchrun ... -m runner args``), ``("runner.<tool>",
    args)`` for a tool, else None; ``...`` words (elisions) are dropped."""
    words = list(words)
    if words and words[0] == "torchrun" and "-m" in words:
        words = ["python", *words[words.index("-m"):]]
    if len(words) < 3 or words[0] not in ("python", "python3") or words[1] != "-m":
        return None
    if words[2] != "runner" and not words[2].startswith("runner."):
        return None
    return words[2], [w for w in words[3:] if w != "..."]


def documented(kind: str) -> List[Command]:
    """The commands of every page that invoke ``python -m runner`` (``kind="runner"``) or a tool (``"tool"``)."""
    out = []
    for page in PAGES:
        for cmd in shell_commands(page):
            found = runner_args(cmd.words)
            if found and (found[0] == "runner") == (kind == "runner"):
                out.append(cmd)
    return out


# ------------------------------------------------------------------------------------------------ the checks
#: Hydra's flags the pages may show (``--cfg job``); another flag (``--config-name``: another primary config) is
#: reported, since the composition here is of conf/config.yaml
_RUNNER_FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--device-gb")
_RUNNER_FLAGS = ("-m", "--multirun", "--help", "-h", "--hydra-help", "--resolve", "--info", "--version",
                 "--plan", "--json")  # the last two: the runner's plan mode (runner/tools/plan.py)


def _jobs(overrides: List[str], multirun: bool) -> List[List[str]]:
    """The override lists of the jobs a command line runs: one, or the cartesian product of a sweep's values
    (Hydra's basic sweeper); sweep values outside ``-m`` are left to composition, which refuses them."""
    if not multirun:
        return [overrides]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(job) for job in itertools.product(*choices)]


def runner_problem(args: Sequence[str], compose) -> Optional[str]:
    """What ``python -m runner <args>`` would refuse before running, or None: an unknown flag, a composition error
    of any job, the startup schema check; for a refused line, with what the runner's own pre-Hydra checks say."""
    from runner.app.checks import check_schema
    from runner.app.console import override_key_problem
    from runner.tools.sweep import sweep_override_problem

    args, overrides, multirun = list(args), [], False
    while args:
        a = args.pop(0)
        if a in _RUNNER_FLAGS_WITH_VALUE:
            args.pop(0)
        elif a.split("=", 1)[0] in _RUNNER_FLAGS_WITH_VALUE and a.startswith("--"):
            continue  # --device-gb=80
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a in _RUNNER_FLAGS:
            continue
        elif a.startswith("-") and "=" not in a:
            return f"{a}: not a flag of python -m runner (Hydra's)"
        else:
            overrides.append(a)
    try:
        for job in _jobs(overrides, multirun):
            check_schema(compose(job, test_model=False))
        return None
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        problem = f"{type(e).__name__}: {e}"
    # what the runner itself prints for it (did you mean ...; the sweep's missing key): its checks compose too,
    # so they run only for a line that failed
    argv = (["-m"] if multirun else []) + overrides
    runner_says = sweep_override_problem(argv) or override_key_problem(argv)
    return f"{runner_says}\n({problem})" if runner_says else problem


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once the tool's parser accepted the arguments."""


def tool_problem(tool: str, args: Sequence[str], monkeypatch) -> Optional[str]:
    """What the argparse parser of ``python -m <tool>`` refuses in ``args`` (its message), or None. The tool's
    ``main`` builds its parser and parses; the parse is the real one, and the run after it never starts."""
    try:
        module = importlib.import_module(tool)
    except ModuleNotFoundError as e:
        return f"python -m {tool}: {e}"
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        raise _Parsed(parse(self, *a, **kw))

    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            with contextlib.redirect_stderr(err):
                module.main(list(args))
        except _Parsed:
            return None
        except SystemExit as e:
            return f"exit {e.code}: {err.getvalue().strip()}"
    return f"{tool}.main returned without parsing its arguments"


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: code spans and links as their text, lower case, punctuation other than
    ``-`` and ``_`` removed, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set:
    """Every heading anchor of a page (repeated headings get ``-1``, ``-2``), and explicit ``<a id/name>``."""
    found, seen = set(), {}
    for line in _prose_lines(text, blank_code=False):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def _prose_lines(text: str, blank_code: bool = True) -> List[str]:
    """The page's lines outside fenced blocks, inline code spans blanked (``blank_code``)."""
    prose = [line for info, _, lines in _blocks(text) if info is None for line in lines]
    return [re.sub(r"`[^`]*`", "``", line) for line in prose] if blank_code else prose


def link_problems(page: Path, text: Optional[str] = None) -> List[str]:
    """Relative links of ``page`` whose file or anchor does not exist (``page:line: target: why``)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    problems = []
    prose = _prose_lines(text)
    joined = "\n".join(prose)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", joined) + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", joined,
                                                                                     re.M)
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO_ROOT).as_posix()}: {target}"
        if path and not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md":
            dest_text = text if dest == page else dest.read_text(encoding="utf-8")
            if anchor not in anchors(dest_text):
                problems.append(f"{where}: no heading with this anchor in {dest.name}")
    return problems


def path_problems(page: Path) -> List[str]:
    """Repository paths in the page's code spans (and ``python <script>.py`` in its fences) that do not exist."""
    text = page.read_text(encoding="utf-8")
    spans = re.findall(r"`([^`\s]+)`", text)
    scripts = [c.words[1] for c in shell_commands(page)
               if len(c.words) > 1 and c.words[0] in ("python", "python3") and c.words[1].endswith(".py")]
    problems = []
    for p in spans + scripts:
        p = p.rstrip("/")
        if not p.startswith(tuple(d + "/" for d in TOP_DIRS)) or re.search(r"[<>{}*|]|\.\.\.", p):
            continue
        if (REPO_ROOT / p).exists() or p in NOT_IN_CHECKOUT:
            continue
        module, dot, _ = p.rpartition(".")
        if dot and (REPO_ROOT / f"{module}.py").exists():  # tests/_helpers.tiny_clip: an attribute of a module
            continue
        problems.append(f"{page.relative_to(REPO_ROOT).as_posix()}: `{p}` does not exist")
    return problems


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("cmd", documented("runner"), ids=lambda c: c.where)
def test_documented_runner_command_composes(cmd: Command, compose):
    for word, extra in COMPOSE_NEEDS_EXTRA.items():
        if any(w.startswith(word) for w in cmd.words):
            skip_without_extra(extra)
    _, args = runner_args(cmd.words)
    problem = runner_problem(args, compose)
    assert problem is None, f"{cmd.where}: {shlex.join(cmd.words)}\n{problem}"


@pytest.mark.parametrize("cmd", documented("tool"), ids=lambda c: c.where)
def test_documented_tool_command_parses(cmd: Command, monkeypatch):
    tool, args = runner_args(cmd.words)
    problem = tool_problem(tool, args, monkeypatch)
    assert problem is None, f"{cmd.where}: {shlex.join(cmd.words)}\n{problem}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_links_and_paths_resolve(page: Path):
    problems = link_problems(page) + path_problems(page)
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_front_page():
    n = len((REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): reference text belongs "
                                   "in a page under docs/, linked from the README's tour")
    assert documented("runner") and documented("tool"), "the pages show no command at all: the reader found none"


def test_every_page_is_linked_from_the_readme():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README's 'Where to read more' does not link: {unlinked}"


def test_the_configuration_page_names_every_group_option():
    """The group table of docs/configuration.md lists each option of each group under ``conf/``."""
    from runner.core.paths import CONF_DIR

    text = (REPO_ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    missing = [f"{g.name}={o.stem}" for g in sorted(p for p in CONF_DIR.iterdir() if p.is_dir())
               for o in sorted(g.glob("*.yaml")) if f"`{o.stem}`" not in rows.get(g.name, "")]
    assert not missing, f"options missing from docs/configuration.md's group table: {missing}"


def test_the_backends_page_names_every_registered_backend():
    from runner.kernels.registry import BACKENDS

    text = (REPO_ROOT / "docs" / "backends.md").read_text(encoding="utf-8")
    missing = [f"{field}={name}" for field, named in BACKENDS.items() for name in named if f"`{name}`" not in text]
    assert not missing, f"backends missing from docs/backends.md: {missing}"



def test_the_console_page_names_every_extra():
    """docs/console.md's table of extras lists each optional extra of ``pyproject.toml``."""
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = [line for line in (REPO_ROOT / "docs" / "console.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    missing = [e for e in extras if not any(f"`{e}`" in row.split("|")[1] for row in rows)]
    assert not missing, f"extras missing from docs/console.md's table: {missing}"


BROKEN = {  # a documented line -> a word the problem must name
    "python -m runner batchsize=4": "batch_size",
    "python -m runner model.generation.widht=64": "width",
    "python -m runner +model.nme=x": "nme",
    "python -m runner -m seed=1,2 model.nme=x": "nme",
    "python -m runner seed=1,2": "seed",  # a sweep without -m
    "python -m runner --cfgg job": "--cfgg",
    "python -m runner.gate outputs/x --min-ratoi 0.9": "--min-ratoi",
    "python -m runner.score run --model clip_score=x": "--metrics",  # a required flag left out
    "python -m runner.nosuchtool x": "nosuchtool",
}


@pytest.mark.parametrize("line", sorted(BROKEN))
def test_the_checks_catch_what_they_are_for(line, compose, monkeypatch, tmp_path):
    """A misspelt key or flag in a documented command is reported, naming it; the same checks pass a correct line
    (so they do not refuse everything)."""
    page = tmp_path / "page.md"
    text = f"```bash\n{line}\n```\n"
    (cmd,) = shell_commands(page, text)
    tool, args = runner_args(cmd.words)
    problem = runner_problem(args, compose) if tool == "runner" else tool_problem(tool, args, monkeypatch)
    assert problem is not None and BROKEN[line] in problem, problem
    good = {"runner": "python -m runner -m seed=1,2 batch_size=4", "runner.score":
            "python -m runner.score run --metrics clip_score"}.get(tool, "python -m runner.gate outputs/x --min-ratio 0.9")
    (ok,) = shell_commands(page, f"```bash\n{good}\n```\n")
    tool, args = runner_args(ok.words)
    assert (runner_problem(args, compose) if tool == "runner" else tool_problem(tool, args, monkeypatch)) is None


def test_a_dead_link_or_anchor_is_reported():
    """Only the dead ones: the link in a code span, the live anchor of another page and this page's own are not."""
    page = REPO_ROOT / "docs" / "page.md"  # never written: the text is given
    text = ("See [memory](memory.md#offload-and-the-budget), [x](memory.md#no-such-heading), [y](nope.md),\n"
            "`[not a link](nope.md)` in code, and [the top](#a-heading), [gone](#no-heading).\n\n## A heading\n")
    dead_anchor = "docs/page.md: memory.md#no-such-heading: no heading with this anchor in memory.md"
    assert link_problems(page, text) == [dead_anchor, "docs/page.md: nope.md: no such file",
                                         "docs/page.md: #no-heading: no heading with this anchor in page.md"]
