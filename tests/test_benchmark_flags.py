"""Every benchmark CLI under benchmarks/ checks its flags at startup: a bad value is a message naming the flag and
exit code 1 before any work (they used to report "inf s", run zero-size matmuls, or fail with a traceback minutes
in). Each script's flags are parsed in one subprocess per script (their absl flags share names, so they cannot share
a process), as `app.run` parses them; checks that live at the top of `main` are run with the work stubbed out."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
BENCHMARKS = os.path.join(REPO, "benchmarks")

# Parses each argv as app.run does; for ("main", argv) cases also calls main, whose model loading is stubbed so a
# check that does not fire shows as "work started" rather than running a benchmark.
DRIVER = """
import contextlib, importlib, io, json, sys
sys.path[:0] = [{repo!r}, {benchmarks!r}]
from absl import app, flags
module = importlib.import_module({name!r})
getattr(module, "define_flags", lambda: None)()  # scripts whose flags are defined only when they run

def no_work(*args, **kwargs):
    raise RuntimeError("work started")

module.load_model = no_work
results = []
for mode, argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            app.parse_flags_with_usage([module.__file__, *argv])
    except SystemExit as exit:
        results.append([exit.code, stderr.getvalue()])
        continue
    if mode == "main":
        try:
            module.main([module.__file__])
        except app.UsageError as error:
            results.append([1, str(error)])
            continue
        except RuntimeError as error:
            results.append([0, str(error)])
            continue
    results.append([0, ""])
print(json.dumps(results))
"""


def parse_all(name, cases):
    """[(exit code, message)] of each (mode, argv) in cases, parsed by benchmarks/<name>.py's flags."""
    code = DRIVER.format(repo=REPO, benchmarks=BENCHMARKS, name=name)
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkouts")
    (root / "sdk" / "nki" / "examples").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a_file").write_text("not a directory")
    return {name: str(root / name) for name in ("sdk", "empty", "a_file")}


def cases_table(paths):
    """{script name: (good argvs, [(mode, bad argv, expected message)])} of the CLIs in benchmarks/."""
    sdk, empty, a_file = paths["sdk"], paths["empty"], paths["a_file"]
    windows = [("main", ["--calibration_windows=100", "--distill_windows=50"], "must not exceed --distill_windows")]
    table = {
        "emulator_speed": (
            [[], ["--target=trn2", "--k=300", "--m=129", "--n=77"]],
            [
                ("parse", ["--repeats=0"], "--repeats=0: 0 is not a positive integer"),
                ("parse", ["--k=0"], "--k=0"),
                ("parse", ["--n=-5"], "--n=-5"),
                ("parse", ["--target=trn9"], "--target: got 'trn9', expected one of"),
            ],
        ),
        "primitive_overhead": (
            [[]],
            [
                ("parse", ["--repeats=0"], "--repeats=0"),
                ("parse", ["--repeats=abc"], "--repeats"),
            ],
        ),
        "decode_throughput": (
            [[], ["--quick"], ["--skip_measured"], ["--skip_modeled", "--rounds=2", "--keep=0.5"]],
            [
                ("parse", ["--rounds=0"], "--rounds=0"),
                ("parse", ["--keep=2"], "--keep: got 2.0, expected (0, 1]"),
                ("parse", ["--keep=nan"], "--keep: got nan, expected (0, 1]"),
                ("parse", ["--new_tokens=1"], "--new_tokens=1"),
                ("parse", ["--quick", "--rounds=7"], "--quick sets the layers, new tokens and rounds; it cannot be"),
                ("parse", ["--quick", "--rounds=0"], "--rounds=0"),
                ("parse", ["--skip_measured", "--rounds=0"], "--rounds=0"),
                ("parse", ["--skip_measured", "--keep=0.5"], "--skip_measured skips the measured comparison"),
                ("parse", ["--skip_measured", "--skip_modeled"], "leave nothing to run"),
            ],
        ),
        "kernel_report": (
            [[], ["--quick"], ["--models=Llama-3.2-1B", "--tokens=1,16", f"--out_dir={empty}"]],
            [
                ("parse", ["--tokens=abc"], "--tokens: got ['abc'], expected integers >= 1"),
                ("parse", ["--tokens=0,16"], "--tokens: got ['0', '16'], expected distinct integers >= 1"),
                ("parse", ["--tokens=16,16"], "expected distinct integers"),
                ("parse", ["--models=nope"], "--models: got ['nope'], expected distinct names from ['"),
                ("parse", ["--models="], "--models: got [], expected distinct names"),
                ("parse", ["--quick", "--tokens=1"], "--quick reports Llama-3.2-1B at T in {1, 512}; it cannot be"),
                ("parse", [f"--nki_library={empty}"], "has no src/nkilib_src/nkilib folder"),
                ("parse", [f"--out_dir={a_file}"], "is a file, expected a directory for the results"),
            ],
        ),
        "compress_speed": (
            [[]],
            [
                ("parse", ["--num_layers=0"], "--num_layers=0"),
                ("parse", ["--seq_len=0"], "--seq_len=0"),
                ("parse", ["--calibration_windows=-1"], "--calibration_windows=-1"),
            ],
        ),
        "accuracy_report": (
            [[]],
            [
                ("parse", ["--seq_len=1"], "--seq_len=1"),
                ("parse", ["--prompts=0"], "--prompts=0"),
                ("parse", ["--cloze_items=0"], "--cloze_items=0"),
                ("parse", [f"--checkpoint_dir={empty}"], "--checkpoint_dir must be a Hugging Face checkpoint"),
                ("parse", [f"--out_dir={a_file}"], "is a file"),
                ("main", ["--configs=nope"], "--configs: unknown ['nope'], expected some of"),
                *windows,
            ],
        ),
        "frontier": (
            [[]],
            [
                ("parse", [f"--out_dir={a_file}"], "is a file"),
                ("parse", ["--eval_windows=0"], "--eval_windows=0"),
                ("parse", ["--prompts=4"], "--prompts: not used by frontier.py"),
                ("main", ["--configs=nope"], "--configs: unknown ['nope'], expected some of"),
                *windows,
            ],
        ),
        "fp8_accuracy": (
            [[], ["--calibration_windows=4", "--eval_windows=2", "--seq_len=64"]],
            [
                ("parse", ["--eval_windows=0"], "--eval_windows=0"),
                ("parse", ["--distill_windows=10", "--render_only"], "--distill_windows, --render_only: not used by"),
            ],
        ),
        "aws_examples": (
            [[f"--sdk_path={sdk}"]],
            [
                ("parse", [], "give --sdk_path (aws-neuron-sdk checkout) and/or --nki_library"),
                ("parse", [f"--sdk_path={empty}"], "has no nki/examples folder"),
                ("parse", [f"--nki_library={empty}"], "has no src/nkilib_src/nkilib folder"),
            ],
        ),
        "cost_model_check": (
            [[f"--sdk_path={sdk}"]],
            [
                ("parse", [], "--sdk_path must have a value other than None"),
                ("parse", [f"--sdk_path={empty}"], "has no nki/examples folder"),
                ("parse", [f"--sdk_path={sdk}", "--cases=nope"], "--cases: got ['nope'], expected distinct names"),
            ],
        ),
        "decode_compositions": (
            [[], ["--quick"]],
            [
                ("parse", ["--quick", "--batches=1"], "--quick traces one small shape"),
                ("parse", [f"--out_dir={a_file}"], "is a file"),
                ("main", ["--batches=0"], "--batches: expected positive integers"),
                ("main", ["--models=nope"], "--models:"),
            ],
        ),
        "decode_paged": (
            [[], ["--quick"], ["--models=Llama-3.2-1B", "--block_sizes=5,12", "--weight_dtypes=fp8"]],
            [
                ("parse", ["--block_sizes=0"], "--block_sizes: got ['0'], expected distinct integers >= 1"),
                ("parse", ["--batches=abc"], "--batches: got ['abc'], expected integers"),
                ("parse", ["--cache_lengths=16,16"], "expected distinct integers"),
                ("parse", ["--models=nope"], "--models: got ['nope'], expected distinct names"),
                ("parse", ["--weight_dtypes=int8"], "--weight_dtypes: got ['int8'], expected distinct names"),
                ("parse", ["--quick", "--models=Llama-3.2-1B"], "--quick traces one 2-layer Gemma 3 270M shape"),
                ("parse", [f"--out_dir={a_file}"], "is a file"),
            ],
        ),
        "calibration": ([[], ["--quick"]], [("parse", [f"--out_dir={a_file}"], "is a file")]),
        "speed_bands": ([[], ["--quick"]], [("parse", [f"--out_dir={a_file}"], "is a file")]),
        "generalization": (
            [[], ["--models=smollm2", "--user_kind=novel", "--render_only"], ["--dense_only", "--models=gemma"]],
            [
                ("parse", ["--models=nope"], "--models: got ['nope'], expected distinct names"),
                ("parse", ["--configs=nope"], "--configs: got ['nope'], expected distinct names"),
                ("parse", ["--user_kind=poetry"], "--user_kind: expected one of"),
                ("parse", ["--seq_len=1"], "--seq_len=1"),
                ("parse", ["--eval_windows=0"], "--eval_windows=0"),
                ("parse", ["--self_text_windows=0"], "--self_text_windows=0"),
                ("parse", ["--dense_only", "--configs=fp8 gptq"], "records the dense model's own figures only"),
            ],
        ),
        "serving": (
            [
                [],
                ["--requests=4", "--clients=1", "--clients=2"],
                ["--render_only"],
                [
                    "--parts=llama_cpp,static",
                    f"--llama_cpp_python={sys.executable}",
                    "--configs=fp8",
                    "--variant_clients=4",
                ],
            ],
            [
                ("parse", ["--requests=0"], "--requests=0"),
                ("parse", ["--clients=0"], "--clients=0"),
                ("parse", [f"--out={a_file}"], "is a file"),
                ("parse", ["--configs=int4"], "--configs: got ['int4'], expected distinct names"),
                ("parse", ["--parts=gpu"], "--parts: got ['gpu'], expected distinct names"),
                ("parse", ["--modeled_weights=int4"], "--modeled_weights: got ['int4']"),
                ("parse", [f"--llama_cpp_python={a_file}"], "--llama_cpp_python: expected an executable Python"),
                ("parse", ["--modeled_batch=0"], "--modeled_batch=0"),
                ("parse", ["--variant_clients=0"], "--variant_clients=0"),
                ("parse", ["--request_timeout=0"], "--request_timeout=0"),
                ("parse", ["--render_only", "--requests=4"], "--render_only renders the results JSON"),
            ],
        ),
        "tuning": (
            [[], ["--models=Llama-3.2-1B", "--tokens=1,16", "--resume"], [f"--merge={a_file}", f"--out={a_file}"]],
            [
                ("parse", ["--models=nope"], "--models: got ['nope'], expected distinct names from ['"),
                ("parse", ["--tokens=0"], "--tokens: got ['0'], expected distinct integers >= 1"),
                ("parse", [f"--merge={empty}/missing.json"], "--merge: expected existing table files"),
                ("parse", [f"--out={empty}"], "--out: expected a file path, got a directory"),
            ],
        ),
    }
    return table


def scripts():
    return sorted(
        name[:-3]
        for name in os.listdir(BENCHMARKS)
        if name.endswith(".py") and "app.run(main)" in open(os.path.join(BENCHMARKS, name), encoding="utf-8").read()
    )


def test_every_cli_is_covered(paths):
    # A new benchmark script gets its bad-flag cases here too.
    assert sorted(cases_table(paths)) == scripts() and len(scripts()) == 17


@pytest.mark.parametrize("name", scripts())
def test_bad_flags_stop_at_startup(name, paths):
    good, bad = cases_table(paths)[name]
    results = parse_all(name, [(mode, argv) for mode, argv, _ in bad] + [("parse", argv) for argv in good])
    for (_, argv, message), (code, text) in zip(bad, results):
        assert code == 1 and message in text, (name, argv, code, text)
    for argv, (code, text) in zip(good, results[len(bad) :]):
        assert code == 0, (name, argv, text)


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("emulator_speed.py", ["--repeats", "0"], "--repeats=0: 0 is not a positive integer"),
        ("decode_throughput.py", ["--rounds", "0"], "--rounds=0"),
    ],
)
def test_the_script_exits_nonzero_without_a_traceback(script, argv, message):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""  # nothing measured or printed before the check
