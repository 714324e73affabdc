# tfprofd: `make run` installs and runs the agent; `make test` installs what the tests need and runs them all.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: run test lint golden bench gpu-check demo system-deps clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[agent]'
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e '.[agent,tf,dev]'
	touch $@

# Runs the agent in the foreground with the built-in defaults (Ctrl-C stops it).
# Without root it keeps its state under ~/.local/state/tfprofd.
run: $(VENV)/.runtime
	$(VENV)/bin/tfprofd run $(ARGS)

# The whole loop in about a minute: agent, Keras job, input bottleneck, rule, capture, analysis.
demo: $(VENV)/.test
	$(VENV)/bin/tfprofd demo

# Debian's prometheus (promtool), alertmanager (amtool), node_exporter and systemd-analyze.
system-deps:
	scripts/install-system-deps

test: $(VENV)/.test system-deps
	$(MAKE) -s -C tests/fakenvml
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

# Accept an intended change of the metrics output; review the diff before committing it.
golden: $(VENV)/.test
	$(MAKE) -s -C tests/fakenvml
	UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/test_e2e_metrics.py

bench: $(VENV)/.test system-deps
	$(MAKE) -s -C tests/fakenvml
	$(PY) bench/run_all.py

# The agent against the real NVML of this machine for 60 s (see bench/gpu_check.py); `build` needs a package
# index, `run` only Python 3.10+ and the driver, so .gpu-check can be built here and run on a GPU machine.
gpu-check:
	$(PYTHON) bench/gpu_check.py build
	$(PYTHON) bench/gpu_capture.py build
	$(PYTHON) bench/gpu_check.py run
	$(PYTHON) bench/gpu_capture.py run

clean:
	rm -rf $(VENV) .gpu-check tests/fakenvml/libnvidia-ml.so.1
