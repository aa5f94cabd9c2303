"""The kernel package's folders import one way, and the library never imports the benchmarks.

Folders of nki_kernels (the root's own modules are one node, each subfolder another) must form no cycle; the
emulator imports nothing of nki_kernels outside itself (it stands in for `nki`, which knows no kernels); nothing in
nki_kernels or jax_neuronmm imports benchmarks/ (by its package name, a relative import reaching it, or one of its
scripts and its harness package as the top-level names they are imported by). Imports are read from the source
(ast, function-level ones included), so a lazy import cannot hide an edge.
"""

import ast
import pathlib

from test_import_graph import cycles  # one strongly-connected-components search for both graph tests

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = "nki_kernels"
LIBRARY = ("jax_neuronmm", "nki_kernels")
ABOVE = "<above the package>"  # what a relative import climbing above its top package names


def _module_name(root, path):
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root, packages):
    """{dotted module name: path} of every .py file under root/<package>."""
    return {_module_name(root, path): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def imports(name, path):
    """Absolute dotted names `name`'s source imports (relative imports resolved; `from a import b` gives a.b, which
    names a module, or a name in module a)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                source = node.module
            elif node.level - 1 <= len(package):
                # From a top package's own modules, one level more reaches its sibling folders (benchmarks/).
                source = ".".join(
                    [*package[: len(package) - (node.level - 1)], *([node.module] if node.module else [])]
                )
            else:
                source = ABOVE
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def folder_of(module, known):
    """The folder node of an nki_kernels module (its package for a plain module, itself for a package), or None."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    if not module or not module.startswith(KERNELS):
        return None
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


def folder_graph(root):
    """{folder: folders its modules import} over nki_kernels' folders ("nki_kernels" is the root's own modules)."""
    known = modules(root, [KERNELS])
    graph = {folder_of(name, known): set() for name in known}
    for name, path in known.items():
        for imported in imports(name, path):
            target = folder_of(imported, known)
            if target is not None and target != folder_of(name, known):
                graph[folder_of(name, known)].add(target)
    return graph


def benchmark_names(root):
    """Top-level names that mean benchmarks/: the package name and what its scripts import each other by."""
    folder = root / "benchmarks"
    return {"benchmarks"} | {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}


def benchmark_imports(root, packages=LIBRARY):
    """Sorted (module, imported name) pairs where a library module imports the benchmarks."""
    names = benchmark_names(root) - {"__pycache__", "results"}
    return sorted(
        (name, imported)
        for name, path in modules(root, packages).items()
        for imported in imports(name, path)
        if imported.split(".")[0] in names | {ABOVE}
    )


def test_nki_kernels_folders_form_no_cycle():
    graph = folder_graph(ROOT)
    assert {"nki_kernels", "nki_kernels.decode", "nki_kernels.emulator", "nki_kernels.hardware"} <= set(graph)
    assert "nki_kernels.emulator" in graph["nki_kernels"]  # the binding: the graph does see edges
    assert cycles(graph) == []


def test_the_emulator_imports_no_other_nki_kernels_folder():
    graph = folder_graph(ROOT)
    assert graph["nki_kernels.emulator"] <= {"nki_kernels.hardware"}, sorted(graph["nki_kernels.emulator"])
    assert graph["nki_kernels.hardware"] == set()


def test_the_library_never_imports_the_benchmarks():
    assert {"benchmarks", "harness", "_flag_checks", "decode_compositions"} <= benchmark_names(ROOT)
    assert benchmark_imports(ROOT) == []


def _tree(tmp_path, files):
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_a_folder_cycle_through_a_lazy_import_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "nki_kernels/__init__.py": "",
            "nki_kernels/plan.py": "def plan():\n    from nki_kernels.decode import step\n",
            "nki_kernels/decode/__init__.py": "",
            "nki_kernels/decode/step.py": "from .. import plan\n",
            "nki_kernels/emulator/__init__.py": "from nki_kernels.decode.step import x\n",
        },
    )
    graph = folder_graph(root)
    assert graph == {
        "nki_kernels": {"nki_kernels.decode"},
        "nki_kernels.decode": {"nki_kernels"},
        "nki_kernels.emulator": {"nki_kernels.decode"},
    }
    assert cycles(graph) == [["nki_kernels", "nki_kernels.decode"]]


def test_benchmark_imports_are_found_absolute_relative_and_by_sibling_name(tmp_path):
    root = _tree(
        tmp_path,
        {
            "benchmarks/tool.py": "",
            "benchmarks/harness/__init__.py": "",
            "jax_neuronmm/__init__.py": "",
            "jax_neuronmm/models/a.py": "import benchmarks.tool\n",
            "jax_neuronmm/models/b.py": "def f():\n    from harness.comparison import DecodeModel\n",
            "nki_kernels/__init__.py": "",
            "nki_kernels/decode/c.py": "from ...benchmarks import tool\n",
            "nki_kernels/decode/d.py": "from ..decode import c\nimport numpy\n",
        },
    )
    found = benchmark_imports(root)
    assert sorted({module for module, _ in found}) == [
        "jax_neuronmm.models.a",
        "jax_neuronmm.models.b",
        "nki_kernels.decode.c",
    ]
    assert {
        ("jax_neuronmm.models.b", "harness.comparison.DecodeModel"),
        ("nki_kernels.decode.c", "benchmarks.tool"),
    } <= set(found)


def test_a_relative_import_above_the_top_package_counts_as_reaching_outside(tmp_path):
    root = _tree(
        tmp_path,
        {
            "benchmarks/tool.py": "",
            "nki_kernels/__init__.py": "",
            "nki_kernels/e.py": "from ...elsewhere import tool\n",
        },
    )
    assert benchmark_imports(root) == [("nki_kernels.e", f"{ABOVE}.tool")]
