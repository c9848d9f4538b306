"""The documentation holds: the API reference (docs/api.rst) documents every public name, every relative link of
the README and docs/ leads to a file of the repository (and a link's #anchor to a heading of that file, by
GitHub's rule, which myst_heading_anchors in docs/conf.py follows too), nothing points outside the repository,
and every citation of docs/design.md names one of its sections. The Sphinx build itself runs in .ci/run.

The link checks need no built engine: only the API reference test imports torch_ext.
"""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
API_REFERENCE = DOCS / "api.rst"
DESIGN = DOCS / "design.md"
# Build outputs and caches: not the repository's text. Hidden folders too, but .ci holds the CI script.
SKIPPED_FOLDERS = {"build", "_build", "results", "__pycache__"}
SOURCE_SUFFIXES = {".md", ".rst", ".py", ".h", ".cpp", ".sh", ".toml", ".cfg", ".txt", ".yml", ".yaml"}


def documented_names(module: str) -> set[str]:
    """Names ``module.<name>`` that an autodoc directive of docs/api.rst documents."""
    pattern = rf"^\.\. (?:auto\w+|py:\w+):: {re.escape(module)}\.(\w+)\s*$"
    return set(re.findall(pattern, API_REFERENCE.read_text(), flags=re.MULTILINE))


def test_api_reference_covers_every_public_name():
    import torch_ext
    import torch_ext.ops

    # The submodules in __all__ are documented as modules: torch_ext.ops and debug by their functions, kernels by
    # automodule, verify (callable) by its function and classes.
    missing = set(torch_ext.__all__) - {"debug", "kernels", "ops", "verify"} - documented_names("torch_ext")
    assert not missing, f"add to docs/api.rst: {sorted(missing)}"
    assert "verify" in documented_names("torch_ext.verify")
    for namespace in (torch_ext.ops, torch_ext.debug):
        missing_names = set(namespace.__all__) - documented_names(namespace.__name__)
        assert not missing_names, f"add to docs/api.rst: {sorted(missing_names)}"
    assert ".. automodule:: torch_ext.kernels" in API_REFERENCE.read_text()


def test_api_reference_documents_no_name_that_is_gone():
    # The other direction: a renamed or removed name (the aliases deprecated before 0.1.0 among them) leaves no
    # directive behind, which Sphinx would only warn about.
    import importlib

    targets = re.findall(r"^\.\. (?:auto\w+|py:\w+):: (torch_ext[\w.]*)\s*$", API_REFERENCE.read_text(), re.MULTILINE)
    assert targets
    for target in targets:
        module_name, _, attribute_path = target, "", []
        while True:
            try:
                found = importlib.import_module(module_name)
                break
            except ModuleNotFoundError:
                module_name, _, last = module_name.rpartition(".")
                attribute_path.insert(0, last)
        for attribute in attribute_path:
            assert hasattr(found, attribute), f"docs/api.rst documents {target}, which does not exist"
            found = getattr(found, attribute)


def repository_files(suffixes: set[str]) -> list[Path]:
    """The repository's files with these suffixes (and the CI script), build outputs and caches left out."""
    found = []
    for path in sorted(REPO.rglob("*")):
        folders = path.relative_to(REPO).parts[:-1]
        if any(f in SKIPPED_FOLDERS or f.endswith(".egg-info") or (f.startswith(".") and f != ".ci") for f in folders):
            continue
        if path.is_file() and (path.suffix in suffixes or folders == (".ci",)):
            found.append(path)
    return found


MARKDOWN = [path for path in repository_files({".md"}) if path == REPO / "README.md" or DOCS in path.parents]


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked, line numbers kept."""
    lines = []
    fence = None
    for line in text.splitlines():
        marker = re.match(r"\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def prose(text: str) -> str:
    """``text`` without its code: fenced blocks blanked (line numbers kept), inline code spans removed."""
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", without_code_blocks(text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_anchors(markdown: Path) -> set[str]:
    """Every anchor GitHub makes for the headings of ``markdown`` (repeats get -1, -2, ... as on GitHub)."""
    anchors: set[str] = set()
    for line in without_code_blocks(markdown.read_text()).splitlines():
        heading = re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            unique, repeat = anchor, 0
            while unique in anchors:
                repeat += 1
                unique = f"{anchor}-{repeat}"
            anchors.add(unique)
    return anchors


def links(markdown: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of ``markdown``: inline, reference definitions and HTML."""
    text = prose(markdown.read_text())
    patterns = (
        r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(?:<([^>]*)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)",
        r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*(?:<([^>]*)>|(\S+))",
        r"\b(?:href|src)=\"([^\"]+)\"",
    )
    found = []
    for pattern in patterns:
        for match in re.finditer(pattern, text, flags=re.MULTILINE):
            target = next(group for group in match.groups() if group is not None)
            found.append((text.count("\n", 0, match.start()) + 1, target))
    return sorted(found)


def link_problem(markdown: Path, target: str) -> str | None:
    """What is wrong with the link ``target`` in ``markdown``, or None."""
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return None  # a URL: not this test's business
    path, _, anchor = target.partition("#")
    resolved = (markdown.parent / unquote(path)).resolve() if path else markdown
    if not resolved.is_relative_to(REPO):
        return "points outside the repository"
    if not resolved.exists():
        return f"{resolved.relative_to(REPO)} does not exist"
    if anchor:
        if resolved.suffix != ".md":
            return "an anchor into a file that is not Markdown cannot be checked; link the file"
        if anchor not in heading_anchors(resolved):
            return f"{resolved.relative_to(REPO)} has no heading whose GitHub anchor is #{anchor}"
    return None


@pytest.mark.parametrize("markdown", MARKDOWN, ids=[str(path.relative_to(REPO)) for path in MARKDOWN])
def test_relative_links_resolve_inside_the_repository(markdown):
    problems = [
        f"{markdown.relative_to(REPO)}:{line}: ({target}) {problem}"
        for line, target in links(markdown)
        if (problem := link_problem(markdown, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_the_checks_see_links_and_anchors(tmp_path):
    # The link test would pass on nothing if links() or heading_anchors() read nothing.
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Mixture-of-experts: Megatron-core's `_AllToAll`\n\nSee [the guide](guides/moe.md#x) and\n"
        '![a picture](<figure one.png>), [`code`](api.rst "title").\n\n[ref]: ../shared/x.md\n\n'
        "```bash\n# not a heading\nsee [not a link](nowhere.md)\n```\n\n## A page\n"
    )
    assert links(page) == [(5, "guides/moe.md#x"), (6, "api.rst"), (6, "figure one.png"), (8, "../shared/x.md")]
    assert heading_anchors(page) == {"a-page", "a-page-1", "mixture-of-experts-megatron-cores-_alltoall"}
    readme = REPO / "README.md"
    assert link_problem(readme, "../shared/docs/brief.md") == "points outside the repository"
    assert link_problem(readme, "docs/guides/moe.md#collective-lane") is not None
    assert link_problem(readme, "docs/guides/moe.md#the-collective-lane") is None
    assert link_problem(readme, "docs/no-such-page.md") is not None


def test_nothing_points_at_the_design_brief_outside_the_repository():
    # The design lives in docs/design.md; the brief it came from (in a shared folder beside the checkout) is
    # not part of the repository, and a reader of the code or of GitHub cannot open it.
    outside = re.compile(r"DESIGN\.md|\.\./shared|shared/docs")
    found = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}"
        for path in repository_files(SOURCE_SUFFIXES)
        if path != Path(__file__).resolve()
        for text in [path.read_text(errors="replace")]
        for match in outside.finditer(text)
    ]
    assert not found, "point at docs/design.md instead:\n" + "\n".join(found)


def test_design_citations_name_its_sections():
    # Comments cite a section of the design by its heading, in double quotes after the page's path and a comma,
    # wrapped across comment lines or not.
    lines = without_code_blocks(DESIGN.read_text()).splitlines()
    headings = (re.match(r" {0,3}#{1,6}\s+(.*)", line) for line in lines)
    sections = {heading.group(1).strip() for heading in headings if heading}
    citation = re.compile(r"docs/design\.md,?(?:\s|//|#)*\"([^\"]+)\"")
    cited = []
    for path in repository_files(SOURCE_SUFFIXES):
        if path == Path(__file__).resolve():
            continue
        for match in citation.finditer(path.read_text(errors="replace")):
            section = re.sub(r"\s*\n\s*(?://+|#+)?\s*", " ", match.group(1)).strip()
            cited.append((path.relative_to(REPO), section))
    assert cited, "found no citation of docs/design.md: is the pattern still right?"
    unknown = [f"{path}: {section!r}" for path, section in cited if section not in sections]
    assert not unknown, "docs/design.md has no such section:\n" + "\n".join(unknown)
