"""csrc/'s folders are layers (docs/internals.md, "Layout"): collectives/ -> engine/ -> overlap/ -> bindings/, each
including only the ones before it, as engine/'s own folders do (plan/ -> host/ -> run/ -> split/); only bindings/
includes Python. In the Python package (and in benchmarks/) no two modules import each other, directly or round a
longer circle; benchmarks/harness/ imports no benchmark, and no benchmark another. Reads the sources; needs no built
engine."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
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
    above = {
        "collectives": ("engine/", "overlap/", "bindings/"),
        "engine": ("overlap/", "bindings/"),
        "overlap": ("bindings/",),
    }
    found = [
        f"{path}:{line}: {header}"
        for folder, forbidden in above.items()
        for path, line, header in includes(folder)
        if header.startswith(forbidden)
    ]
    assert not found, "\n".join(found)


def test_engine_folders_include_only_the_ones_before_them():
    order = ["plan", "host", "run", "split"]
    found = [
        f"{path}:{line}: {header}"
        for position, folder in enumerate(order)
        for path, line, header in includes(f"engine/{folder}")
        if header.startswith(tuple(f"engine/{later}/" for later in order[position + 1 :]))
    ]
    assert any(header.startswith("engine/plan/") for _, _, header in includes("engine/run"))
    assert not found, "\n".join(found)


# Subpackages installed from a folder outside the package's own (setup.py's package_dir): name -> folder.
MAPPED_SUBPACKAGES = {"torch_ext._triton_kernels": ROOT / "triton_kernels"}


def module_imports(package_root: Path, mapped: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Each module of the package at ``package_root`` (and of the ``mapped`` subpackages, ``name -> folder``) -> the
    package's modules it imports, anywhere in it (a function's lazy import counts: it is the same dependency,
    deferred)."""
    modules = {}
    for prefix, folder in [(package_root.name, package_root), *(mapped or {}).items()]:
        for path in folder.rglob("*.py"):
            parts = [*prefix.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    imports = {}
    for module, path in modules.items():
        this_package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = this_package.split(".")[: len(this_package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    found.add(owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else owner(base))
        imports[module] = {name for name in found if name is not None and name != module}
    return imports


def import_circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for imported in sorted(imports[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return circles


def test_no_python_modules_import_each_other():
    package = module_imports(ROOT / "torch_ext", MAPPED_SUBPACKAGES)
    assert "torch_ext.engine" in package["torch_ext"]  # the walk sees imports at all
    assert package["torch_ext.kernels"] >= {"torch_ext._triton_kernels.multi_tensor_ref"}
    assert package["torch_ext._triton_kernels.multi_tensor"] == {"torch_ext._triton_kernels.multi_tensor_ref"}
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    benchmarks = module_imports(ROOT / "benchmarks")
    assert "benchmarks.harness.sweep" in benchmarks["benchmarks.overlap.__main__"]
    assert import_circles(package) == [] and import_circles(benchmarks) == []


# What the benchmarks share besides the harness: the graphs engine_overhead and trace_overhead time, the MoE
# libraries' all_to_all moe_sync, microbatch_overlap and trainer_overlap run, and the MoE layer the last two run.
SHARED_BENCHMARK_MODULES = {"benchmarks", "benchmarks.graphs", "benchmarks.moe_libraries", "benchmarks.moe_layer"}


def test_the_harness_is_below_the_benchmarks():
    """benchmarks/harness/ imports no benchmark, and a benchmark imports no other benchmark: what they share is in
    the harness (or a shared module), so that a benchmark's modules can change without reaching into another's."""
    benchmarks = module_imports(ROOT / "benchmarks")
    harness = {module for module in benchmarks if module.startswith("benchmarks.harness")}
    assert "benchmarks.harness.timing" in benchmarks["benchmarks.harness.sweep"]  # the walk sees relative imports
    assert [module for module in harness if not benchmarks[module] <= harness] == []
    shared = harness | SHARED_BENCHMARK_MODULES
    reaching = {
        module: sorted(name for name in imported - shared if name.split(".")[:2] != module.split(".")[:2])
        for module, imported in benchmarks.items()
    }
    assert {module: names for module, names in reaching.items() if names} == {}
