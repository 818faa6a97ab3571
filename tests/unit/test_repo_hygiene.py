"""The repository's own rules that no linter holds: the pre-commit hooks are the test command's
checks, in the same order."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import yaml

from tests.helpers.paths import ROOT


def _test_command_checks() -> list[str]:
    """The `.venv/bin/...` check lines of scripts/test.sh, comments stripped."""
    lines = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.startswith(".venv/bin/")]


def test_the_pre_commit_hooks_run_the_test_commands_checks() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [hook["entry"] for hook in hooks] == _test_command_checks()
    assert all(hook["language"] == "system" and hook["pass_filenames"] is False for hook in hooks)


def test_the_test_command_runs_the_four_checks() -> None:
    assert [line.split()[0] for line in _test_command_checks()] == [
        ".venv/bin/ruff",
        ".venv/bin/ruff",
        ".venv/bin/mypy",
        ".venv/bin/lint-imports",
    ]


# -- rule 20: the repository is self-contained ------------------------------------------------------

# What the checks below read: the package, the tests, benchmarks, deployment, scripts and docs, and
# the top-level documents.
SELF_CONTAINED_AREAS = ("ambient_mesh/", "tests/", "bench/", "deploy/", "scripts/", "docs/")
TOP_LEVEL_DOCUMENTS = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")

# Citations of documents outside the repository (and of the experiment log that left bench/README.md):
# the sibling `shared/` tree, its `reference/*.md` and `spec/wire-protocols.md`, bare section numbers of
# those ("reference 3.2", "spec 4.1"), and `bench/README.md` from anywhere but the two documents that
# say what it is.
OUTSIDE_CITATION = re.compile(
    r"\.\./shared|\bshared/(?:reference|spec)/|reference/[\w-]+\.md|wire-protocols\.md"
    r"|\b[Rr]eference (?:section )?\d+\.\d|\b[Ss]pec (?:section )?\d+(?:\.\d)?"
)
BENCH_LOG = "bench/README.md"
MAY_NAME_BENCH_LOG = frozenset({"README.md", "docs/performance.md", "bench/README.md"})

# Files other branches are rewriting while this rule lands (the TLS package, the HBONE shell and pool,
# the waypoint work): their citations are re-pointed after those merges, and each entry goes then.
# The list only shrinks: an entry whose file no longer cites anything outside fails the test below.
CITATIONS_LEFT_FOR_MERGES: dict[str, str] = {}

# A documentation path named anywhere (`docs/performance.md`), and a section cited in it by title
# (`docs/istio-behaviour.md, "Inbound HBONE (15008)"`, a title possibly wrapped over a comment line).
DOCS_PATH = re.compile(r"\bdocs/[\w/.-]+\.md\b")
DOCS_SECTION = re.compile(r'\b(docs/[\w/.-]+\.md),((?:\s*(?:#|//)?\s*"[^"]+"(?:,| and)?)+)')


def _tracked_files() -> list[str]:
    """The files git tracks in the areas rule 20 covers (the tree's own files when git is absent)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *SELF_CONTAINED_AREAS, *TOP_LEVEL_DOCUMENTS],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout.decode()
        names = [name for name in listed.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        names = [
            str(path.relative_to(ROOT))
            for area in SELF_CONTAINED_AREAS
            for path in (ROOT / area).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        ]
        names += [name for name in TOP_LEVEL_DOCUMENTS if (ROOT / name).is_file()]
    return sorted(name for name in names if (ROOT / name).is_file())


def _texts() -> dict[str, str]:
    """Every covered file that is text, by path; results and other data files are JSON, skipped."""
    texts = {}
    for name in _tracked_files():
        if name.endswith(".json"):
            continue
        try:
            texts[name] = (ROOT / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file cites nothing
    return texts


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _outside_citations(name: str, text: str) -> list[str]:
    found = [f"{name}:{_line(text, m.start())}: {m.group(0)}" for m in OUTSIDE_CITATION.finditer(text)]
    if name not in MAY_NAME_BENCH_LOG:
        found += [
            f"{name}:{_line(text, m.start())}: {BENCH_LOG}" for m in re.finditer(re.escape(BENCH_LOG), text)
        ]
    return found


def test_nothing_cites_a_document_outside_the_repository() -> None:
    this_file = str(Path(__file__).resolve().relative_to(ROOT))
    offences = [
        line
        for name, text in _texts().items()
        if name != this_file and name not in CITATIONS_LEFT_FOR_MERGES
        for line in _outside_citations(name, text)
    ]
    assert offences == [], (
        "rule 20: cite the section of docs/istio-behaviour.md (Istio's facts) or docs/performance.md "
        "(measured reasons) instead:\n" + "\n".join(offences)
    )


def test_the_merge_allow_list_names_only_files_that_still_need_it() -> None:
    texts = _texts()
    stale = [
        name
        for name in CITATIONS_LEFT_FOR_MERGES
        if name in texts and not _outside_citations(name, texts[name])
    ]
    assert stale == [], f"these files cite nothing outside any more: remove them from the list: {stale}"


def test_every_docs_path_and_cited_section_exists() -> None:
    headings: dict[str, set[str]] = {}
    missing = []
    for name, text in _texts().items():
        for m in DOCS_PATH.finditer(text):
            if not (ROOT / m.group(0)).is_file():
                missing.append(f"{name}:{_line(text, m.start())}: {m.group(0)} does not exist")
        for m in DOCS_SECTION.finditer(text):
            doc = m.group(1)
            if not (ROOT / doc).is_file():
                continue
            if doc not in headings:
                lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
                headings[doc] = {line.lstrip("#").strip() for line in lines if line.startswith("#")}
            for title in re.findall(r'"([^"]+)"', m.group(2)):
                title = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", title)
                if not any(heading == title or heading.startswith(title + " (") for heading in headings[doc]):
                    missing.append(f'{name}:{_line(text, m.start())}: {doc} has no section "{title}"')
    assert missing == [], "\n".join(missing)


# -- the test tree's layout --------------------------------------------------------------------------


def _test_tree_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts)


def test_every_test_directory_is_a_package() -> None:
    """pytest imports a module of a directory without `__init__.py` by its bare name (and puts that
    directory on sys.path): two such modules with one name stop the whole run at collection, and a
    bare `from test_x import` works from one directory only. With every directory a package, each
    module is imported by its full name (`tests.unit.proxy.test_pool`), in one import mode."""
    missing = sorted(
        {
            str(directory.relative_to(ROOT))
            for path in _test_tree_modules()
            for directory in [path.parent, *path.parent.parents]
            if directory.is_relative_to(ROOT / "tests") and not (directory / "__init__.py").is_file()
        }
    )
    assert missing == [], f"add an empty __init__.py to: {missing}"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, as absolute dotted names (relative imports resolved), with
    the line; `from a import b` yields both `a` and `a.b`, since b may be a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_a_test_module_never_imports_another_test_module() -> None:
    """What two test modules share lives in tests/helpers/ (or a tier's helper module or conftest):
    importing a test module runs its tests twice under another name and ties one file's helpers to
    another file's tests."""
    offences = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in _test_tree_modules()
        for line, module in _imported_modules(path)
        if module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert offences == [], "move what is shared into tests/helpers/:\n" + "\n".join(offences)
