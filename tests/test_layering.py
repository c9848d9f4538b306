"""csrc/'s folders are layers (docs/internals.md, "Layout"): collectives/ -> engine/ -> overlap/ -> bindings/, each
including only the ones before it, as engine/'s own folders do (plan/ -> host/ -> run/ -> split/); only bindings/
includes Python. In the Python package (and in benchmarks/) no two modules import each other, directly or round a
longer circle; benchmarks/harness/ imports no benchmark, and no benchmark another. No thread-local carries a call's
own state from one language to the other: each one in csrc/ and in the package is listed below with why it is one.
Reads the sources; needs no built engine."""

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


# Every thread-local of csrc/ and of the package, with why it belongs to a thread. A call's own state (its
# priorities, the overlap's backward it is) travels in the call's context, built where the call is asked for and
# passed down (csrc/engine/call_context.h; torch_ext/engine.py's _CallContext), never in a thread-local that one
# side sets for the other to read at the next call. A new thread-local fails here until it is listed with its reason.
CXX_THREAD_LOCALS = {
    ("engine/plan/plan_cache.cpp", "thread_cache"): "this thread's plans kept for replay: a cache, no call's options",
    ("engine/trace.cpp", "tid"): "this thread's id, for trace events",
    ("engine/run/running_node.h", "running_node"): (
        "the node this thread runs now, for code that runs inside it (a collective's backward formula handing over "
        "its result, the current execution order)"
    ),
    ("engine/collective_progress.h", "starting_planned_collective"): (
        "this thread is starting a planned collective now: set by the engine, read by the collective gate below the "
        "dispatcher on the same thread within that scope, where no argument of the call reaches"
    ),
    ("engine/collective_progress.h", "issuing_lane_node"): (
        "the lane node this thread starts now: set and read as starting_planned_collective"
    ),
    ("bindings/python_bindings.cpp", "ThreadLocalPythonObjects"): (
        "stock's stash of the caller's contextvars for the length of an engine call (_engine_run_backward's), made "
        "as stock's Python makes it, for torch's readers"
    ),
}
PYTHON_THREAD_LOCALS = {
    ("torch_ext/engine.py", "_thread"): (
        "the next engine call's context (_CallContext), set by a route and taken by the engine's entry, which passes "
        "it on whole: torch.autograd's engine call, which every route goes through, takes no more arguments"
    ),
    ("torch_ext/microbatch_overlap.py", "_RngSections"): "a backward-side thread's RNG section",
    ("torch_ext/verify/_session.py", "_inside"): "this thread is inside a backward call that verify records",
}
CXX_THREAD_LOCAL = re.compile(r"\bthread_local\b[^;=({]*?\b(\w+)\s*(?:=|;|\{)|\b(ThreadLocalPythonObjects)::set\b")


def cxx_thread_locals() -> set[tuple[str, str]]:
    """(file under csrc/, name) of every thread_local variable, and of every use of torch's thread-local Python
    objects."""
    found = set()
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in {".h", ".cpp"}:
            continue
        for line in path.read_text().splitlines():
            for match in CXX_THREAD_LOCAL.finditer(line.split("//", 1)[0]):
                found.add((str(path.relative_to(CSRC)), match.group(1) or match.group(2)))
    return found


def python_thread_locals() -> set[tuple[str, str]]:
    """(file, name) of every ``threading.local()`` the package makes (the name it is assigned to) and every class
    derived from ``threading.local``."""

    def is_threading_local(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "local" and getattr(node.value, "id", "") == "threading"

    found = set()
    for path in sorted((ROOT / "torch_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.ClassDef) and any(is_threading_local(base) for base in node.bases):
                name = node.name
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and is_threading_local(node.value.func)
            ):
                target = node.targets[0]
                name = target.attr if isinstance(target, ast.Attribute) else target.id
            if name is not None:
                found.add((str(path.relative_to(ROOT)), name))
    return found


def test_every_thread_local_is_a_threads_not_a_calls():
    # The checks see thread-locals at all.
    assert (
        CXX_THREAD_LOCAL.search("inline thread_local std::shared_ptr<Foo> next_call = nullptr;").group(1) == "next_call"
    )
    assert ("engine/run/running_node.h", "running_node") in cxx_thread_locals()
    assert ("torch_ext/engine.py", "_thread") in python_thread_locals()
    assert cxx_thread_locals() == set(CXX_THREAD_LOCALS), "a thread-local not listed, with its reason, or one gone"
    assert python_thread_locals() == set(PYTHON_THREAD_LOCALS), (
        "a thread-local not listed, with its reason, or one gone"
    )
