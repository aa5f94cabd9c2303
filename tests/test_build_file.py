"""BUILD covers the tree: every source file is in a target, every test file has its own py_test.

BUILD is evaluated as Python with stand-ins for the Bazel functions it calls, so this runs without Bazel.
The stand-in glob() follows Bazel's rules: `**` spans any number of folders (none included), `*` and `?` stay
within one path segment, results are sorted, `exclude` patterns are removed.
"""

import ast
import os
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parent.parent.absolute()

# Folders whose every .py file must be in some target's srcs.
SOURCE_FOLDERS = ("jax_neuronmm", "nki_kernels", "examples", "benchmarks", "tests")
DATA_SUFFIXES = (".json", ".txt")
SKIPPED_FOLDER_NAMES = ("__pycache__",)


def _segment_regex(segment):
    return "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in segment)


def _glob_regex(pattern):
    segments = pattern.split("/")
    parts = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            parts.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
        else:
            parts.append(_segment_regex(segment) + ("" if last else "/"))
    return re.compile("".join(parts) + r"\Z")


def _has_wildcard(segment):
    return "*" in segment or "?" in segment


def _files_under(root, folder):
    """Relative POSIX paths of the files below root/folder ("" is root), skipping hidden folders like .venv."""
    found = []
    for directory, subdirectories, filenames in os.walk(root / folder):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_FOLDER_NAMES and not d.startswith(".")]
        relative = Path(directory).relative_to(root).as_posix()
        prefix = "" if relative == "." else relative + "/"
        found.extend(prefix + name for name in filenames)
    return found


def _glob(root, include, exclude=()):
    excluded = [_glob_regex(pattern) for pattern in exclude]
    found = set()
    for pattern in include:
        segments = pattern.split("/")
        if not any(map(_has_wildcard, segments)):
            if (root / pattern).is_file():
                found.add(pattern)
            continue
        # Walk only the folder the pattern is anchored in, not the whole checkout.
        anchor = []
        for segment in segments:
            if _has_wildcard(segment):
                break
            anchor.append(segment)
        regex = _glob_regex(pattern)
        found.update(path for path in _files_under(root, "/".join(anchor)) if regex.match(path))
    return sorted(path for path in found if not any(regex.match(path) for regex in excluded))


def evaluate_build(build_text, root):
    """Runs BUILD text as Python; returns {target name: {"kind": rule, attribute: value, ...}}."""
    targets = {}

    def rule(kind):
        def record(name, **attributes):
            if name in targets:
                raise ValueError(f"BUILD defines target {name!r} twice")
            targets[name] = dict(attributes, kind=kind)

        return record

    namespace = {
        "glob": lambda include, exclude=(), **_: _glob(root, include, exclude),
        "package": lambda **_: None,
        "exports_files": lambda *_, **__: None,
        "load": lambda *_, **__: None,
    }
    for kind in ("py_library", "py_binary", "py_test", "genrule", "filegroup"):
        namespace[kind] = rule(kind)
    exec(compile(build_text, "BUILD", "exec"), namespace)
    return targets


def _file_name(label):
    """'//:a/b.py' or ':a/b.py' or 'a/b.py' -> 'a/b.py'."""
    return label.split(":", 1)[1] if ":" in label else label


def _python_files(root):
    return sorted(
        path
        for folder in SOURCE_FOLDERS
        if (root / folder).is_dir()
        for path in _files_under(root, folder)
        if path.endswith(".py")
    )


def uncovered_sources(targets, root):
    covered = {_file_name(src) for target in targets.values() for src in target.get("srcs", [])}
    return [path for path in _python_files(root) if path not in covered]


def uncovered_data_files(targets, root):
    listed = {
        _file_name(item)
        for target in targets.values()
        for attribute in ("srcs", "data")
        for item in target.get(attribute, [])
    }
    data_files = [
        path
        for folder in SOURCE_FOLDERS
        if (root / folder).is_dir()
        for path in _files_under(root, folder)
        if path.endswith(DATA_SUFFIXES)
    ]
    return [path for path in data_files if path not in listed]


def files_without_exactly_one_py_test(targets, root):
    test_files = [path for path in _python_files(root) if Path(path).name.startswith("test_")]
    problems = []
    for path in test_files:
        owners = [
            name
            for name, target in targets.items()
            if target["kind"] == "py_test" and path in map(_file_name, target.get("srcs", []))
        ]
        if len(owners) != 1:
            problems.append(f"{path}: py_test targets {owners}, expected exactly one")
    return problems


def undefined_dependencies(targets):
    problems = []
    for name, target in targets.items():
        for dependency in target.get("deps", []):
            dependency_name = _file_name(dependency)
            if targets.get(dependency_name, {}).get("kind") != "py_library":
                problems.append(f"{name} depends on {dependency!r}, which is no py_library in BUILD")
    return problems


def missing_files(targets, root):
    generated = {out for target in targets.values() for out in target.get("outs", [])}
    problems = []
    for name, target in targets.items():
        for attribute in ("srcs", "data"):
            for item in target.get(attribute, []):
                path = _file_name(item)
                if path not in generated and path not in targets and not (root / path).is_file():
                    problems.append(f"{name}.{attribute} lists {item!r}, which is neither a file nor a target")
    return problems


@pytest.fixture(scope="module")
def build_text():
    return (REPO_ROOT / "BUILD").read_text()


@pytest.fixture(scope="module")
def repo_targets(build_text):
    return evaluate_build(build_text, REPO_ROOT)


def test_build_stays_in_the_starlark_subset(build_text):
    """Bazel rejects these in BUILD files, Python would accept them."""
    forbidden = (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.While, ast.JoinedStr, ast.Lambda)
    offending = [
        f"line {node.lineno}: {type(node).__name__}"
        for node in ast.walk(ast.parse(build_text))
        if isinstance(node, forbidden)
    ]
    assert offending == []


def test_every_python_file_is_in_some_target(repo_targets):
    assert _python_files(REPO_ROOT), "found no Python files to check"
    assert uncovered_sources(repo_targets, REPO_ROOT) == []


def test_every_data_file_is_listed(repo_targets):
    assert uncovered_data_files(repo_targets, REPO_ROOT) == []


def test_every_test_file_has_exactly_one_py_test(repo_targets):
    assert any(t["kind"] == "py_test" for t in repo_targets.values())
    assert files_without_exactly_one_py_test(repo_targets, REPO_ROOT) == []


def test_every_script_has_a_py_binary(repo_targets):
    binary_sources = {_file_name(src) for t in repo_targets.values() if t["kind"] == "py_binary" for src in t["srcs"]}
    scripts = [path for path in _python_files(REPO_ROOT) if re.fullmatch(r"(examples|benchmarks)/[^/]+\.py", path)]
    assert [path for path in scripts if path not in binary_sources] == []


def test_dependencies_are_defined_libraries(repo_targets):
    assert undefined_dependencies(repo_targets) == []


def test_no_target_lists_a_missing_file(repo_targets):
    assert missing_files(repo_targets, REPO_ROOT) == []


def test_no_nested_build_files():
    """A nested BUILD would make its folder a separate Bazel package that the root globs skip."""
    nested = [
        path
        for folder in SOURCE_FOLDERS
        if (REPO_ROOT / folder).is_dir()
        for path in _files_under(REPO_ROOT, folder)
        if Path(path).name in ("BUILD", "BUILD.bazel")
    ]
    assert nested == []


# The checks themselves, on a small synthetic tree, with the project's BUILD and with broken variants of it.


@pytest.fixture
def synthetic_tree(tmp_path):
    for path in (
        "jax_neuronmm/__init__.py",
        "jax_neuronmm/models/llama.py",
        "nki_kernels/__init__.py",
        "nki_kernels/emulator/isa.py",
        "nki_kernels/block_sizes.json",
        "examples/quickstart.py",
        "benchmarks/primitive_overhead.py",
        "tests/conftest.py",
        "tests/test_primitive.py",
        "tests/test_emulator.py",
        "pytest.ini",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# placeholder\n")
    return tmp_path


def test_glob_follows_bazel_rules(synthetic_tree):
    assert _glob(synthetic_tree, ["nki_kernels/*.py"]) == ["nki_kernels/__init__.py"]
    assert _glob(synthetic_tree, ["nki_kernels/**/*.py"]) == ["nki_kernels/__init__.py", "nki_kernels/emulator/isa.py"]
    assert _glob(synthetic_tree, ["nki_kernels/**"], exclude=["**/*.py"]) == ["nki_kernels/block_sizes.json"]
    assert _glob(synthetic_tree, ["tests/test_?rimitive.py", "pytest.ini", "absent.txt"]) == [
        "pytest.ini",
        "tests/test_primitive.py",
    ]


def test_project_build_passes_on_synthetic_tree(build_text, synthetic_tree):
    targets = evaluate_build(build_text, synthetic_tree)
    assert uncovered_sources(targets, synthetic_tree) == []
    assert uncovered_data_files(targets, synthetic_tree) == []
    assert files_without_exactly_one_py_test(targets, synthetic_tree) == []
    assert undefined_dependencies(targets) == []
    assert missing_files(targets, synthetic_tree) == []


def test_uncovered_source_file_is_reported(build_text, synthetic_tree):
    narrowed = build_text.replace('glob(["nki_kernels/**/*.py"])', 'glob(["nki_kernels/*.py"])')
    assert narrowed != build_text, "BUILD no longer has the glob this test narrows"
    targets = evaluate_build(narrowed, synthetic_tree)
    assert uncovered_sources(targets, synthetic_tree) == ["nki_kernels/emulator/isa.py"]


def test_uncovered_data_file_is_reported(synthetic_tree):
    targets = evaluate_build('py_library(name = "nki_kernels", srcs = glob(["nki_kernels/**/*.py"]))', synthetic_tree)
    assert uncovered_data_files(targets, synthetic_tree) == ["nki_kernels/block_sizes.json"]


def test_test_file_without_py_test_is_reported(synthetic_tree):
    targets = evaluate_build(
        'py_library(name = "lib", srcs = [])\n'
        'py_test(name = "a", srcs = ["tests/test_primitive.py"], deps = [":lib"])\n'
        'py_test(name = "b", srcs = ["tests/test_primitive.py"], deps = [":lib"])\n',
        synthetic_tree,
    )
    assert files_without_exactly_one_py_test(targets, synthetic_tree) == [
        "tests/test_emulator.py: py_test targets [], expected exactly one",
        "tests/test_primitive.py: py_test targets ['a', 'b'], expected exactly one",
    ]


def test_undefined_dependency_and_missing_file_are_reported(synthetic_tree):
    targets = evaluate_build(
        'py_binary(name = "tool", srcs = ["examples/quickstart.py"], data = ["examples/gone.txt"])\n'
        'py_test(name = "t", srcs = ["tests/test_primitive.py"], deps = [":tool", "//:absent"])\n',
        synthetic_tree,
    )
    assert undefined_dependencies(targets) == [
        "t depends on ':tool', which is no py_library in BUILD",
        "t depends on '//:absent', which is no py_library in BUILD",
    ]
    assert missing_files(targets, synthetic_tree) == [
        "tool.data lists 'examples/gone.txt', which is neither a file nor a target"
    ]
