"""llama.cpp's OpenAI-compatible server (`llama-cpp-python[server]`) as the CPU reference of benchmarks/serving.py.

The server runs from its own Python (a separate virtual environment: its C++ build must not touch the project's),
on 127.0.0.1 at a free port, on the same GGUF file, with 2 threads. Closed-loop clients send the benchmark's
requests through the `openai` client, streamed: the prompt as text (the request mix's token ids decoded; llama.cpp
tokenizes it again with the same vocabulary), greedy, max_tokens the request's output length, the end-of-sequence
token's logit biased to -100 so every request produces its length (llama-cpp-python has no ignore_eos). Each
streamed chunk is one token; the closing chunk (finish_reason, no text) is not counted.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time

import openai

START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int | str = "self") -> float:
    """VmHWM (peak resident set) of a process in MiB, since its last reset_peak_rss."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def reset_peak_rss(pid: int | str = "self") -> None:
    """Resets a process's VmHWM to its current resident set (Linux: 5 written to /proc/PID/clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


@contextlib.contextmanager
def llama_cpp_server(python: str, gguf: str, log_path: str):
    """Starts `python -m llama_cpp.server` on gguf at 127.0.0.1:<free port>; yields (openai client, process) once
    GET /v1/models answers; terminates it on exit. RuntimeError with the log's tail when it does not come up."""
    port = _free_port()
    command = [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    # interrupt_requests off: by default a new request interrupts the one streaming (concurrent clients fail)
    command += ["--n_threads", "2", "--n_ctx", "2048", "--interrupt_requests", "False"]
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if process.poll() is not None or time.time() > deadline:
                    with open(log_path, encoding="utf-8") as f:
                        raise RuntimeError(f"llama_cpp.server did not start: {f.read()[-2000:]}") from None
                time.sleep(1)
        yield client, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def closed_loop(count: int, clients: int, one) -> tuple[list, float]:
    """`clients` threads take request indices 0 .. count - 1 in order, each running one(index) to its end before it
    takes the next (closed-loop clients); (one's results in completion order, wall seconds)."""
    queue = list(range(count))
    lock = threading.Lock()
    results = []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            result = one(index)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def run_clients(client, process, prompts: list[str], lengths: list[int], clients: int, eos_id: int, timeout_s: float):
    """Closed-loop clients over the requests; (per-request records, wall seconds, peak RSS MiB of the server)."""
    model = client.models.list().data[0].id

    def one(index):
        stamps, failed = [], False
        start = time.perf_counter()
        try:
            stream = client.with_options(timeout=timeout_s).completions.create(
                model=model,
                prompt=prompts[index],
                max_tokens=lengths[index],
                temperature=0.0,
                logit_bias={str(eos_id): -100},
                stream=True,
            )
            reason = None
            for chunk in stream:
                choice = chunk.choices[0]
                if choice.finish_reason is None or choice.text:  # the closing chunk carries no token
                    stamps.append(time.perf_counter())
                reason = choice.finish_reason or reason
            failed = reason not in ("length", "stop")
        except openai.OpenAIError:
            failed = True
        return start, stamps, failed

    reset_peak_rss(process.pid)
    records, wall = closed_loop(len(prompts), clients, one)
    return records, wall, peak_rss_mib(process.pid)
