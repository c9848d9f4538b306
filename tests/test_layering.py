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
    assert not found, "reach Python through the host (engine/host_interface.h) instead:\n" + "\n".join(found)


def source_lines(folder: str) -> list[tuple[str, int, str]]:
    """(file, line number, line) of every line of the C++ in csrc/``folder``."""
    return [
        (str(path.relative_to(CSRC)), number, line)
        for path in sorted((CSRC / folder).rglob("*"))
        if path.suffix in {".h", ".cpp"}
        for number, line in enumerate(path.read_text().splitlines(), start=1)
    ]


# A Python module imported from C++: CPython's calls and pybind11's.
IMPORTS_A_MODULE = re.compile(r"\bPyImport_\w+|\bmodule_?::import\b")
# A Python object at namespace scope (a declaration that starts a line, unlike a function's locals), or a static
# one anywhere: a global.
PYTHON_GLOBAL = re.compile(
    r"^(?:(?:static\s+|inline\s+)*|\s*static\s+)(?:PyObject\s*\*|THPObjectPtr|(?:pybind11|py)::object)\s*\w+\s*[=;{]"
)


def test_cpp_reaches_python_only_through_its_host():
    """One way from C++ to Python: the host torch_ext's import installs (bindings/python_host.h), which holds the
    Python objects it calls. No C++ imports a Python module by name; no Python object is a global of bindings/."""
    imports = [
        f"{path}:{number}: {line.strip()}" for path, number, line in source_lines("") if IMPORTS_A_MODULE.search(line)
    ]
    assert not imports, "hand the host the function instead (torch_ext/_host.py):\n" + "\n".join(imports)
    found = [f"{path}:{number}: {line}" for path, number, line in source_lines("bindings") if PYTHON_GLOBAL.match(line)]
    assert not found, "make it a member of PythonHost (bindings/python_host.h):\n" + "\n".join(found)
    # The checks see what they look for.
    assert IMPORTS_A_MODULE.search('PyImport_ImportModule("torch_ext.collectives.twin_groups")')
    assert PYTHON_GLOBAL.match("PyObject* role_decider = nullptr;") and PYTHON_GLOBAL.match(
        "static THPObjectPtr twins;"
    )
    assert PYTHON_GLOBAL.match("  static PyObject* twins = nullptr;")
    assert not PYTHON_GLOBAL.match("PyObject* py_install_host(PyObject* module, PyObject* args) {")
    assert not PYTHON_GLOBAL.match("  PyObject* checker = nullptr;")


# A class's name in the C++: a Python type's tp_name, a C++ type's typeid(...).name().
CLASS_NAME = r"(?:tp_name|typeid\([^()]*\)\.name\(\))"
# ... compared or matched on one line (an error message only names it).
MATCHES_A_CLASS_NAME = re.compile(
    rf"{CLASS_NAME}.*(?:==|!=|\.substr|\.compare|\.starts_with|\.find\(|strcmp)|(?:==|!=|strcmp\(|strncmp\().*{CLASS_NAME}"
)
# The names of a Python class (or of a node, name()), which torch_ext's Python may print but not match.
NAME_ATTRIBUTES = {"__name__", "__qualname__", "__module__"}
STRING_MATCHES = {"startswith", "endswith", "removeprefix", "removesuffix", "get", "__contains__"}


def _is_a_name(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in NAME_ATTRIBUTES and isinstance(node.ctx, ast.Load)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "name"
    )


def _names_a_class(node: ast.AST) -> bool:
    return any(_is_a_name(part) for part in ast.walk(node))


def class_name_matches(source: str) -> list[int]:
    """Lines of ``source`` that recognise a class (or node) by its name: the name compared, matched as a string,
    used as a key, or kept in a variable to be."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            suspects = [node]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRING_MATCHES:
            suspects = [node.func.value, *node.args]
        elif isinstance(node, ast.Subscript):
            suspects = [node.slice]
        elif isinstance(node, ast.Assign):
            suspects = [node.value] if _is_a_name(node.value) else []
        else:
            suspects = []
        if any(_names_a_class(suspect) for suspect in suspects):
            found.append(node.lineno)
    return found


def test_no_class_is_recognised_by_its_name():
    """Classes are known by identity or a registry (a generated Function by the op its forward holds, TorchRec's
    Functions as the module's objects, AccumulateGrad by its type), never by matching a name: in the C++ and in
    torch_ext's Python."""
    cpp = [
        f"{path}:{number}: {line.strip()}"
        for path, number, line in source_lines("")
        if MATCHES_A_CLASS_NAME.search(line)
    ]
    python = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "torch_ext").rglob("*.py"))
        for number in class_name_matches(path.read_text())
    ]
    assert not cpp + python, "\n".join(cpp + python)
    # The checks see what they look for: the ways torch_ext once matched names.
    assert MATCHES_A_CLASS_NAME.search("std::string_view(Py_TYPE(obj)->tp_name).substr(0, kOwnOps.size()) ==")
    assert MATCHES_A_CLASS_NAME.search('std::string_view(typeid(example).name()) == "N5torch8autograd6PyNodeE",')
    assert not MATCHES_A_CLASS_NAME.search('"expected a class, got ", Py_TYPE(obj)->tp_name);')
    assert class_name_matches("name = node_class.__name__\nif name.startswith(PREFIX): pass") == [1]
    assert class_name_matches("KNOWN.get((f.__module__, f.__qualname__), NONE)") == [1]
    assert class_name_matches("[o for o in objects if o.__name__ == name]") == [1]
    assert class_name_matches("if node.name() == ACCUMULATE_GRAD: pass") == [1]
    assert class_name_matches('raise TypeError(f"got {type(x).__name__}")\nf.__module__ = __name__') == []
    assert class_name_matches('names = ", ".join(sorted(c.__qualname__ for c in both))') == []


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
