"""Issue 51's rules on the shape of the code, read from the sources (AST, no imports), so a file that breaks one
fails here with its file:line and the rule:

- no .py file over 700 lines (jax_neuronmm/, nki_kernels/, benchmarks/, examples/, tests/);
- no public function over 10 parameters: module-level functions and the methods (constructors included) of
  module-level classes whose names do not start with "_"; `self` / `cls` not counted, `*args` / `**kwargs` counted.
  The exceptions are the emulator's `nki` API functions whose signatures mirror AWS's own (listed below with the
  signature they mirror: a kernel written for the real `nki` must run on the emulator unchanged);
- no docstring in jax_neuronmm/ or nki_kernels/ quoting a measured ratio ("1.06x") or naming a real model
  ("Gemma 3 270M", "SmolLM2") as a result: in a sentence that also quotes a measured figure (a ratio, a percentage,
  a time or a size). Figures live in benchmarks/results/, prose in docs/.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("jax_neuronmm", "nki_kernels", "benchmarks", "examples", "tests")
LIBRARY_FOLDERS = ("jax_neuronmm", "nki_kernels")
MAX_LINES = 700
MAX_PARAMETERS = 10

# (file, function) -> the `nki` 0.6 API function whose documented signature it mirrors (aws-neuron-sdk
# nki/api/nki/isa/): kernels call these with the real package's keywords, so the emulator takes every one of them.
NKI_API_SIGNATURES = {
    ("nki_kernels/emulator/isa_matmul.py", "nc_matmul"): "nki.isa.nc_matmul",
    ("nki_kernels/emulator/isa_select.py", "range_select"): "nki.isa.range_select",
    ("nki_kernels/emulator/isa_vector.py", "tensor_scalar_reduce"): "nki.isa.tensor_scalar_reduce",
    # An @nki.jit kernel's HBM tensors are its arguments one by one (NKI's JAX integration and the neuron lowering
    # pass them so); its body takes them bundled.
    ("nki_kernels/svd_mlp.py", "svd_mlp_gate_up_kernel"): "the kernel's device call (gate_up_body takes bundles)",
}

# A ratio quoted to two or more decimals ("1.06x"), not part of a name ("trn2.48xlarge").
RATIO = re.compile(r"(?<![\w.])\d+\.\d\d+x(?!\w)")
MODEL_NAMES = ("Gemma 3 270M", "SmolLM2")
# A measured figure: a ratio, a percentage, a time, a size or a rate ("1.9x", "86%", "1.2 µs", "23 KiB", "5 MB").
FIGURE = re.compile(
    r"\d(?:[\d,]*\.\d+|[\d,]*)(?:x\b|\s*(?:%|µs|us\b|ms\b|KiB|MiB|GiB|kB\b|MB\b|GB\b|GB/s|TB/s|tok/s|bytes\b))"
)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`\"])|\n\s*\n")


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _relative(path, root=ROOT) -> str:
    return path.relative_to(root).as_posix()


def _parsed():
    return [(path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) for path in _sources()]


@pytest.fixture(scope="module")
def parsed():
    return _parsed()


def _parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    arguments = function.args
    names = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    count = len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)
    if method and names and names[0].arg in ("self", "cls"):
        count -= 1
    return count


def public_functions(tree: ast.Module):
    """(function node, qualified name, is a method) of the module's public functions and public classes' methods."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and not node.name.startswith("_"):
            yield node, node.name, False
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, functions) and (item.name == "__init__" or not item.name.startswith("_")):
                    yield item, f"{node.name}.{item.name}", True


def long_files(sources, root=ROOT) -> list[str]:
    problems = []
    for path in sources:
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            problems.append(
                f"{_relative(path, root)}:1: {lines} lines, over the {MAX_LINES}-line limit: split it by idea"
            )
    return problems


def long_signatures(parsed) -> list[str]:
    problems = []
    for path, tree in parsed:
        for function, name, method in public_functions(tree):
            count = _parameter_count(function, method)
            if count > MAX_PARAMETERS and (_relative(path), name) not in NKI_API_SIGNATURES:
                problems.append(
                    f"{_relative(path)}:{function.lineno}: public function {name} takes {count} parameters, over "
                    f"{MAX_PARAMETERS}: pass a parameter object"
                )
    return problems


def _docstring_nodes(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first


def docstring_findings(path_name: str, docstring: str, first_line: int) -> list[str]:
    """Problems of one docstring starting at source line `first_line`, each at the line of its match."""

    def line_of(offset):
        return first_line + docstring.count("\n", 0, offset)

    problems = [
        f"{path_name}:{line_of(m.start())}: docstring quotes the measured ratio {m.group()!r}: figures belong in "
        "benchmarks/results/"
        for m in RATIO.finditer(docstring)
    ]
    start = 0
    for sentence in SENTENCE_END.split(docstring):
        offset = docstring.index(sentence, start)
        start = offset + len(sentence)
        for model in MODEL_NAMES:
            if model not in sentence:
                continue
            figure = FIGURE.search(sentence.replace(model, ""))
            if figure:
                problems.append(
                    f"{path_name}:{line_of(offset + sentence.index(model))}: docstring names {model} as a result "
                    f"(beside {figure.group()!r}): results belong in benchmarks/results/"
                )
    return problems


def measured_docstrings(parsed) -> list[str]:
    problems = []
    for path, tree in parsed:
        if _relative(path).split("/")[0] not in LIBRARY_FOLDERS:
            continue
        for expression in _docstring_nodes(tree):
            problems += docstring_findings(_relative(path), expression.value.value, expression.lineno)
    return problems


def _report(problems: list[str]) -> str:
    return f"{len(problems)} violation(s):\n" + "\n".join(problems)


def test_no_file_over_700_lines():
    problems = long_files(list(_sources()))
    assert not problems, _report(problems)


def test_no_public_function_over_10_parameters(parsed):
    problems = long_signatures(parsed)
    assert not problems, _report(problems)


def test_every_nki_api_exception_is_still_needed(parsed):
    # A listed function that shrank, moved or vanished leaves a stale entry: the list must say exactly who is exempt.
    found = {
        (_relative(path), name): _parameter_count(function, method)
        for path, tree in parsed
        for function, name, method in public_functions(tree)
    }
    stale = [f"{file}::{name}" for file, name in NKI_API_SIGNATURES if found.get((file, name), 0) <= MAX_PARAMETERS]
    assert not stale, f"NKI_API_SIGNATURES lists functions that no longer exceed {MAX_PARAMETERS} parameters: {stale}"


def test_no_measured_figures_in_library_docstrings(parsed):
    problems = measured_docstrings(parsed)
    assert not problems, _report(problems)


# --- the checks themselves, on made-up sources -----------------------------------------------------------------


def test_parameter_rule_counts_what_a_caller_passes():
    tree = ast.parse(
        "def f(a, b, /, c, *args, d, e=1, **kwargs): pass\n"
        "def _private(a, b, c, d, e, f, g, h, i, j, k): pass\n"
        "class Public:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h, i, j): pass\n"
        "    def method(self, a, b, c, d, e, f, g, h, i, j, k): pass\n"
        "    def _helper(self, a, b, c, d, e, f, g, h, i, j, k): pass\n"
        "class _Private:\n"
        "    def method(self, a, b, c, d, e, f, g, h, i, j, k): pass\n"
    )
    counted = {name: _parameter_count(node, method) for node, name, method in public_functions(tree)}
    assert counted == {"f": 7, "Public.__init__": 10, "Public.method": 11}


def test_docstring_rule_flags_results_not_mentions():
    docstring = (
        "Loads the checkpoint.\n\n"
        "Gemma 3 270M's one KV head is repeated on 4 ranks. The real SmolLM2 GGUF of the demo extra.\n"
        "Gemma 3 270M's 640 x 2048 MLP weights on a trn2.48xlarge. "
        "Measured 1.064x on novel text. On Gemma 3 270M at R = 128 the ring holds 23 KiB."
    )
    problems = docstring_findings("pkg/mod.py", docstring, 10)
    assert problems == [
        "pkg/mod.py:13: docstring quotes the measured ratio '1.064x': figures belong in benchmarks/results/",
        "pkg/mod.py:13: docstring names Gemma 3 270M as a result (beside '23 KiB'): results belong in "
        "benchmarks/results/",
    ]


def test_long_file_rule_names_the_file(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(sorted(tmp_path.glob("*.py")), root=tmp_path) == [
        f"long.py:1: {MAX_LINES + 1} lines, over the {MAX_LINES}-line limit: split it by idea"
    ]
