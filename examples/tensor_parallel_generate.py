"""Tensor-parallel generation with an SVD-compressed Llama over a (data, model) device mesh.

The Megatron layout, written as NamedShardings of the factors; jit and the SPMD partitioner do the rest:
  MLP (svd_mlp)        gate/up v [r, I] split on I (column parallel), down u [I, r] split on I (row parallel):
                       one all-reduce for the whole MLP
  attention            q/k/v v [r, heads·D] split on heads (column parallel), o u [heads·D, r] split on heads
                       (row parallel): one all-reduce; with more ranks than KV heads (--model 8 here) the
                       decode steps repeat each KV head on the ranks that share it
  LM head              an untied head's kernel / v split on the vocabulary (column parallel); the tiny Llama's
                       is tied (the embedding, replicated)
  everything else      replicated. The factors stay sharded through generation. The prefill runs the model's
                       forward under the SPMD partitioner; every decode step after it runs through
                       `jax_neuronmm.decode_step` sharded over "model"
                       (`decode_step_parallel.tensor_parallel_decode_step`: jax.shard_map, each device one
                       decode_step on its Megatron shard, KV cache split by KV heads, per layer one all-reduce
                       after o and one after down, the logits all-gathered over the vocabulary), "data"
                       splitting the rows: each (data) group of ranks decodes B / --data
                       rows. The prefill's batch is not split (generate places the prompts unsharded); "data"
                       also splits the separately compiled MLP shown at the end.
Generates (same sampling seed) on one device and on the mesh, checks that the decode steps ran through the
sharded decode_step (prints its compiled collectives) and that the tokens are the same.
Without accelerators,
--cpu_devices fakes that many CPU devices (must be set before JAX starts, hence parsed by hand below).

    python examples/tensor_parallel_generate.py --data 2 --model 4 --keep 0.5 --max_new_tokens 12
    python examples/tensor_parallel_generate.py --checkpoint_dir /path/to/hf/llama   # a local HF checkpoint

Several processes, one JAX runtime (`jax.distributed`; CPU collectives over gloo): with --num_processes N and no
--process_id this script starts N copies of itself on this machine, each with --cpu_devices devices, the
coordinator on 127.0.0.1 at a free port; the mesh spans the devices of all processes, every process checks the
tokens against its own one-device run, and the launcher exits non-zero if any process fails or runs past
--timeout_s. The same code runs across machines: start one process per machine by hand with the same
--num_processes, its own --process_id (0 .. N-1) and --coordinator_address=HOST:PORT of process 0's machine; a
process that cannot join the coordinator within --connect_timeout_s stops with an error saying so. Results whose
rows live on other processes' devices ("data" across hosts, the usual multi-host layout) are gathered onto every
process (`jax.experimental.multihost_utils.process_allgather`) before they are compared.

    python examples/tensor_parallel_generate.py --num_processes 2 --cpu_devices 2 --data 1 --model 4
    python examples/tensor_parallel_generate.py --num_processes 2 --cpu_devices 4 --data 2 --model 4
"""

import math
import os
import re
import socket
import subprocess
import sys
import time


def _fake_cpu_devices(argv):
    """--cpu_devices=N (default 8) as XLA_FLAGS, before JAX initializes its backends."""
    count = "8"
    for i, arg in enumerate(argv):
        if arg.startswith("--cpu_devices="):
            count = arg.split("=", 1)[1]
        elif arg == "--cpu_devices" and i + 1 < len(argv):
            count = argv[i + 1]
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"


_fake_cpu_devices(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_neuronmm import models, pipeline  # noqa: E402
from jax_neuronmm.models import decode, generation  # noqa: E402

flags.DEFINE_integer(
    "cpu_devices", 8, "CPU devices to fake when running on CPU (read before JAX starts).", lower_bound=1
)
flags.DEFINE_integer("data", 2, "Size of the data axis (batch split).", lower_bound=1)
flags.DEFINE_integer("model", 4, "Size of the model axis (tensor parallel).", lower_bound=1)
flags.DEFINE_string("checkpoint_dir", None, "Local HF Llama checkpoint directory; default: a random tiny Llama.")
flags.DEFINE_float("keep", 0.5, "Fraction of each projection's parameters kept by its SVD factors, in (0, 1].")
flags.DEFINE_integer("batch", 4, "Prompts (random token ids).", lower_bound=1)
flags.DEFINE_integer("prompt_tokens", 7, "Tokens per prompt.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 12, "Tokens to generate.", lower_bound=1)
flags.DEFINE_float(
    "temperature", 0.8, "Sampling temperature (0: greedy); both runs sample with the same seed.", lower_bound=0.0
)
flags.DEFINE_integer("seed", 0, "Random seed (model init and prompts).")
flags.DEFINE_integer(
    "num_processes", 1, "JAX processes sharing one runtime (jax.distributed); > 1 starts them.", lower_bound=1
)
flags.DEFINE_integer(
    "process_id",
    None,
    "This process's id in 0 .. --num_processes - 1 (given: join the runtime; absent: launch all of them here).",
    lower_bound=0,
)
flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordinator (default for local launches: 127.0.0.1:free)."
)
flags.DEFINE_float("timeout_s", 300.0, "Seconds the local launcher waits for its processes before killing them.")
flags.DEFINE_float(
    "connect_timeout_s", 60.0, "Seconds a process waits to join the coordinator before it stops with an error."
)
flags.register_validator("keep", lambda keep: 0 < keep <= 1, message="--keep must lie in (0, 1]")
for _name in ("timeout_s", "connect_timeout_s"):
    flags.register_validator(
        _name, lambda seconds: math.isfinite(seconds) and seconds > 0, message=f"--{_name} must be a finite number > 0"
    )
flags.register_validator(
    "coordinator_address",
    lambda address: address is None or re.fullmatch(r"[^\s:]+:\d{1,5}", address) is not None,
    message="--coordinator_address must be HOST:PORT",
)
flags.register_multi_flags_validator(
    ["batch", "data"],
    lambda values: values["data"] < 1 or values["batch"] % values["data"] == 0,
    message="--data must divide --batch",
)
flags.register_multi_flags_validator(
    ["process_id", "num_processes"],
    lambda values: values["process_id"] is None or values["process_id"] < values["num_processes"],
    message="--process_id must be below --num_processes",
)
FLAGS = flags.FLAGS

# Megatron layout: (parameter path regex, spec). The first match wins; parameters matching none are replicated.
MEGATRON_LAYOUT = (
    (r"mlp/(gate_proj|up_proj)/v$", P(None, "model")),
    (r"mlp/down_proj/u$", P("model", None)),
    (r"self_attn/(q_proj|k_proj|v_proj)/v$", P(None, "model")),
    (r"self_attn/(q_proj|k_proj|v_proj)/bias$", P("model")),
    (r"self_attn/o_proj/u$", P("model", None)),
    (r"lm_head/(kernel|v)$", P(None, "model")),
)


def shard_model(model, mesh):
    """Places every parameter on `mesh` with its spec from MEGATRON_LAYOUT; returns the placed model."""
    graphdef, state = nnx.split(model)

    def place(path, value):
        name = "/".join(str(key.key) for key in path if hasattr(key, "key"))  # dict keys; no ".value"
        spec = next((s for pattern, s in MEGATRON_LAYOUT if re.search(pattern, name)), P())
        # From the host: with several processes the mesh spans devices this process cannot address, and every
        # process holds the same values (same seed), so each places its own shards.
        return jax.device_put(np.asarray(value), NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def check_layout(config, mesh):
    """Usage error unless the model splits into --model Megatron shards: its query heads and MLP features split, its
    KV heads split or --model is a multiple of them (each KV head then repeated on the ranks sharing it)."""
    model_size = mesh.shape["model"]
    for name, count in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if count % model_size:
            raise app.UsageError(f"--model={model_size} must divide the model's {name} = {count}")
    kv = config.num_kv_heads
    if kv % model_size and model_size % kv:
        raise app.UsageError(f"--model={model_size} must divide the model's num_kv_heads = {kv} or be a multiple of it")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local_processes():
    """Start --num_processes copies of this script joined by one coordinator on 127.0.0.1; their exit status.

    Each copy gets the same flags plus --process_id and --coordinator_address. A copy that fails stops the rest
    (they would wait on it in a collective); so does --timeout_s.
    """
    address = FLAGS.coordinator_address or f"127.0.0.1:{free_port()}"
    children = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], f"--process_id={i}", f"--coordinator_address={address}"]
        )
        for i in range(FLAGS.num_processes)
    ]
    deadline = time.monotonic() + FLAGS.timeout_s
    status = 0
    try:
        while any(child.poll() is None for child in children):
            failed = [c.returncode for c in children if c.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                print(f"a process exited with status {status}; stopping the others", file=sys.stderr)
                break
            if time.monotonic() > deadline:
                status = 1
                print(f"processes still running after --timeout_s={FLAGS.timeout_s:g}; stopping them", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    codes = [child.returncode for child in children]
    if status == 0 and any(codes):
        status = next(c for c in codes if c)
    print(f"{FLAGS.num_processes} processes exited with {codes}")
    return status


def join_runtime():
    """Join the multi-process JAX runtime as --process_id (CPU collectives over gloo) within --connect_timeout_s.

    A process other than 0 first waits for the coordinator's port to accept connections (SystemExit naming the
    address when it does not in time): jax.distributed aborts the process from C++, with no Python error, when it
    cannot register. The rest of the time bounds jax.distributed's own wait for every process to join."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + FLAGS.connect_timeout_s
    if FLAGS.process_id != 0:
        wait_for_coordinator(FLAGS.coordinator_address, deadline)
    print(
        f"process {FLAGS.process_id}: joining the JAX runtime of {FLAGS.num_processes} processes at "
        f"{FLAGS.coordinator_address} (at most --connect_timeout_s={FLAGS.connect_timeout_s:g})",
        flush=True,
    )
    jax.distributed.initialize(
        coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id,
        initialization_timeout=max(1, math.ceil(deadline - time.monotonic())),
    )


def wait_for_coordinator(address, deadline):
    """Return once HOST:PORT `address` accepts a TCP connection; SystemExit naming it after `deadline`
    (time.monotonic)."""
    host, port = address.rsplit(":", 1)
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"process {FLAGS.process_id}: no coordinator at --coordinator_address={address} within "
                    f"--connect_timeout_s={FLAGS.connect_timeout_s:g} ({error}); start process 0 there first, with "
                    "the same --num_processes"
                ) from None
        time.sleep(0.2)


def check_checkpoint_dir():
    """Usage error naming --checkpoint_dir when it is missing, has no config.json, or is a compressed checkpoint
    (this example compresses an HF checkpoint with --keep itself); checked before any process starts or joins."""
    path = FLAGS.checkpoint_dir
    if path is None:
        return
    if not os.path.isdir(path):
        raise app.UsageError(f"--checkpoint_dir {path}: no such directory (expected a local HF checkpoint directory)")
    if models.is_compressed_checkpoint(path):
        raise app.UsageError(
            f"--checkpoint_dir {path}: a compressed checkpoint; this example compresses an HF checkpoint itself "
            "(--keep): pass the HF checkpoint directory it was made from"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise app.UsageError(f"--checkpoint_dir {path}: no config.json (expected a local HF checkpoint directory)")


def load_model():
    """The --checkpoint_dir HF checkpoint (a usage error naming it when it does not load), else a random tiny
    Llama."""
    path = FLAGS.checkpoint_dir
    if path is None:
        config = models.LlamaConfig.preset("tiny", num_heads=8, num_kv_heads=4, head_dim=16)
        return models.Llama(config, rngs=nnx.Rngs(FLAGS.seed))
    try:
        return models.load_hf(path)
    except (OSError, ValueError) as error:  # missing files, malformed config, CheckpointError
        raise app.UsageError(f"--checkpoint_dir {path}: {error}") from None


def mesh_devices(count):
    """`count` devices for the mesh: with several processes an equal share of each one's devices when they divide
    evenly (so "data" rows fall on every process, not only the first one's devices), else the first `count`."""
    processes = jax.process_count()
    if processes == 1 or count % processes:
        return jax.devices()[:count]
    share = count // processes
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(processes)]
    return [device for devices in by_process for device in devices[:share]]


def fetch(array) -> np.ndarray:
    """`array`'s values on this process: its rows on other processes' devices gathered first."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def main(argv):
    del argv
    if FLAGS.process_id is not None and not FLAGS.coordinator_address:
        raise app.UsageError("--process_id needs --coordinator_address=HOST:PORT (process 0's coordinator)")
    check_checkpoint_dir()  # before any process starts: a bad --checkpoint_dir is one usage error
    if FLAGS.num_processes > 1 and FLAGS.process_id is None:
        return launch_local_processes()
    if FLAGS.process_id is not None:
        join_runtime()
    if FLAGS.data * FLAGS.model > jax.device_count():
        raise app.UsageError(f"--data * --model = {FLAGS.data * FLAGS.model} exceeds the {jax.device_count()} devices")
    devices = np.array(mesh_devices(FLAGS.data * FLAGS.model)).reshape(FLAGS.data, FLAGS.model)
    mesh = Mesh(devices, ("data", "model"))

    model = load_model()  # after join_runtime: jax.distributed must start before any computation
    check_layout(model.config, mesh)
    # Every MLP becomes an SVDMLP, every attention projection an SVDLinear.
    model = pipeline.compress_model(model, pipeline.Recipe(keep=FLAGS.keep, include=("mlp", "attention"), method="svd"))

    rng = np.random.default_rng(FLAGS.seed)
    prompts = rng.integers(0, model.config.vocab_size, size=(FLAGS.batch, FLAGS.prompt_tokens), dtype=np.int32)

    sampling = dict(temperature=FLAGS.temperature, seed=FLAGS.seed)
    single = fetch(models.generate(model, prompts, FLAGS.max_new_tokens, **sampling))
    sharded_model = shard_model(model, mesh)
    generation.TRACE_COUNTS.clear()
    parallel = fetch(models.generate(sharded_model, prompts, FLAGS.max_new_tokens, **sampling))

    where = f"process {jax.process_index()} of {jax.process_count()}: " if jax.process_count() > 1 else ""
    plan = decode.decode_plan(sharded_model)
    layout = plan.tensor_parallel if plan is not None else None
    if FLAGS.max_new_tokens > 1 and (layout is None or not generation.TRACE_COUNTS["decode_step_tensor_parallel"]):
        raise SystemExit(
            f"{where}FAILED: the decode steps did not run through the tensor-parallel decode_step "
            f"(routes traced: {dict(generation.TRACE_COUNTS)})"
        )
    if layout is not None:
        weights = decode.stack_weights(sharded_model, plan)
        cache = decode.place_cache(plan, sharded_model.init_cache(FLAGS.batch, FLAGS.prompt_tokens + 1))
        ids = np.zeros((FLAGS.batch, 1), np.int32)
        step = jax.jit(decode.decode, static_argnums=1).lower(sharded_model, plan, weights, ids, ids, cache)
        step_collectives = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter)", step.compile().as_text())
        rows = layout.batch_axis(FLAGS.batch)
        kv_heads = model.config.num_kv_heads
        repeated = "" if plan.spec.num_kv_heads == kv_heads else f"{kv_heads} KV heads as {plan.spec.num_kv_heads}, "
        print(
            f"{where}decode steps ran through decode_step sharded over mesh axis {layout.axis!r}: {layout.ranks} "
            f"ranks, each on its Megatron shard (spec.tensor_parallel={layout.ranks}), {repeated}"
            f"{'rows not split' if rows is None else f'rows split over {rows!r}'}; one step compiles to "
            f"collectives {[(op, shape.split('{')[0]) for shape, op in step_collectives]} (two all-reduces in the "
            "layer loop, the logits' all-gather after it)"
        )

    mlp = sharded_model.layers[0].mlp
    print(
        f"{where}mesh {dict(mesh.shape)} over {jax.device_count()} devices; layer 0 MLP factor shards: "
        f"gate v {mlp.gate_proj.v[...].sharding.spec}, "
        f"down u {mlp.down_proj.u[...].sharding.spec}"
    )
    x = jax.device_put(
        np.zeros((FLAGS.batch, FLAGS.prompt_tokens, model.config.hidden_size), np.float32),
        NamedSharding(mesh, P("data")),
    )
    hlo = jax.jit(lambda m, x: m(x)).lower(mlp, x).compile().as_text()
    collectives = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter)", hlo)
    print(
        f"one tensor-parallel MLP compiles to collectives: {[(op, shape.split('{')[0]) for shape, op in collectives]}"
    )
    print(f"{where}one device :", single[:, FLAGS.prompt_tokens :].tolist())
    print(f"{where}mesh       :", parallel[:, FLAGS.prompt_tokens :].tolist())
    if not np.array_equal(single, parallel):
        raise SystemExit(f"{where}FAILED: tensor-parallel generation differs from one device")
    print(f"{where}same tokens on one device and on the mesh")


if __name__ == "__main__":
    app.run(main)
