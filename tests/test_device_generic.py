"""No CUDA-only call on a path another accelerator reaches.

torch_ext's stream handling is device-generic (the device guard, ``torch.accelerator``, the device module
``torch.get_device_module`` returns), so it runs on any PrivateUse1 device as on CUDA; the stream tests prove
it on the test device (tests/testdev). This test keeps CUDA-only calls from creeping back where the test
device cannot see them: ``torch.cuda.*`` in Python, ``Tensor.record_stream`` (``aten::record_stream`` is
registered for CUDA only in torch 2.13) and CUDA's C++ namespaces in csrc/.
"""

from __future__ import annotations

import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent

CUDA_ONLY_PYTHON = re.compile(r"torch\.cuda\b|\.record_stream\(|\.is_cuda\b")
CUDA_ONLY_CPP = re.compile(r"\bc10::cuda\b|\bat::cuda\b|\.record_stream\(|\bkCUDA\b|DeviceType::CUDA\b|\.is_cuda\(")

# Where CUDA alone is meant, and why.
ALLOWED = {
    # Triton compiles for CUDA only here: _kernels_for sends nothing else to _launch.
    "torch_ext/kernels.py": {'with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():'},
}


def _python_code(path: pathlib.Path) -> dict[int, str]:
    """Each line's code with strings and comments left out (docstrings may name torch.cuda)."""
    code: dict[int, str] = {}
    with path.open() as source:
        for token in tokenize.generate_tokens(source.readline):
            if token.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
                code[token.start[0]] = code.get(token.start[0], "") + token.string
    return code


def _cpp_code(path: pathlib.Path) -> dict[int, str]:
    lines = path.read_text().splitlines()
    return {number: line.split("//", 1)[0] for number, line in enumerate(lines, 1)}


def _offenders(files, pattern: re.Pattern, code_of) -> list[str]:
    found = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        for number, code in code_of(path).items():
            line = lines[number - 1].strip()
            if pattern.search(code) and line not in ALLOWED.get(relative, ()):
                found.append(f"{relative}:{number}: {line}")
    return found


def test_no_cuda_only_call_in_the_package():
    files = sorted((ROOT / "torch_ext").rglob("*.py"))
    assert files
    assert _offenders(files, CUDA_ONLY_PYTHON, _python_code) == []


def test_no_cuda_only_call_in_the_engine():
    files = sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cpp"))
    assert files
    assert _offenders(files, CUDA_ONLY_CPP, _cpp_code) == []


def test_the_check_finds_a_cuda_only_call():
    planted = ROOT / "torch_ext" / "__planted_for_test__.py"
    try:
        planted.write_text("import torch\n\nstate = torch.cuda.get_rng_state()  # a CUDA-only call\n")
        assert _offenders([planted], CUDA_ONLY_PYTHON, _python_code) == [
            "torch_ext/__planted_for_test__.py:3: state = torch.cuda.get_rng_state()  # a CUDA-only call"
        ]
    finally:
        planted.unlink()


def test_the_gpu_check_script_runs_what_exists():
    """tools/gpu_check.sh runs only on a machine with a GPU, which CI never has: its syntax and the files it runs
    are checked here, so that it has not rotted when a session is lent one."""
    import subprocess

    script = ROOT / "tools" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    named = re.findall(r"\b((?:tests|benchmarks)/[\w/]+\.py)\b", script.read_text())
    assert "tests/test_accelerator_streams.py" in named
    assert [name for name in named if not (ROOT / name).is_file()] == []
