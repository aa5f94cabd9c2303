# make demo / make test / make bench work on a fresh machine: each creates .venv
# and installs what it needs (torch is pinned to the CPU wheel in the test extra).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bazel-test install clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# Optional: the same tests through Bazel (2.1 from the npm registry; needs npm, runs offline after that).
BAZEL := /tmp/jax_neuronmm_bazel/package/bazel-2.1.0-linux-x86_64
$(BAZEL):
	mkdir -p /tmp/jax_neuronmm_bazel
	cd /tmp/jax_neuronmm_bazel && npm pack --silent @bazel/bazel-linux_x64@2.1.0 && tar xzf bazel-bazel-linux_x64-2.1.0.tgz

BAZEL_TARGETS ?= //...
bazel-test: $(STAMP) $(BAZEL)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(BAZEL) --output_user_root=/tmp/jax_neuronmm_bazel/root test $(BAZEL_TARGETS) --test_output=errors

clean:
	rm -rf $(VENV) *.egg-info
