"""csrc/'s folders are layers (docs/internals.md, "Layout"): only bindings/ includes Python, nothing includes
bindings/ from outside it, and the microbatch overlap (overlap/) sits above the engine and its collectives, which
never include it. Reads the sources; needs no built engine."""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Headers that need Python: CPython's, pybind11's, and torch's Python bindings.
PYTHON_HEADER = re.compile(
    r"Python\.h|pybind|torch/csrc/(?:Exceptions|utils|python_headers|PyInterpreter)\.h|/python_[^/]*\.h|/THP"
)


def includes(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, included header) of every #include in csrc/``folder``."""
    found = []
    for path in sorted((CSRC / folder).rglob("*")):
        if path.suffix not in {".h", ".cpp"}:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            included = re.match(r"\s*#\s*include\s*[<\"]([^>\"]+)[>\"]", line)
            if included:
                found.append((str(path.relative_to(CSRC)), number, included.group(1)))
    return found


def test_the_layers_are_the_folders_the_docs_name():
    assert sorted(p.name for p in CSRC.iterdir() if p.is_dir()) == ["bindings", "collectives", "engine", "overlap"]
    # The check sees includes at all.
    assert any(header == "engine/collective_progress.h" for _, _, header in includes("overlap"))
    assert any(PYTHON_HEADER.search(header) for _, _, header in includes("bindings"))


def test_only_bindings_include_python():
    found = [
        f"{path}:{line}: {header}"
        for folder in ("engine", "collectives", "overlap")
        for path, line, header in includes(folder)
        if PYTHON_HEADER.search(header)
    ]
    assert not found, "reach Python through HostCallbacks (engine/host_callbacks.h) instead:\n" + "\n".join(found)


def test_no_layer_includes_one_above_it():
    above = {"engine": ("overlap/", "bindings/"), "collectives": ("overlap/", "bindings/"), "overlap": ("bindings/",)}
    found = [
        f"{path}:{line}: {header}"
        for folder, forbidden in above.items()
        for path, line, header in includes(folder)
        if header.startswith(forbidden)
    ]
    assert not found, "\n".join(found)
