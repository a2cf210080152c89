# Set-up and checks for a fresh machine. `make demo` and `make test` each create .venv and install
# everything first (torch pinned to the CPU build through constraints.txt), so either one works on a
# fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install wheel-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/mypy plan transport coordinator worker scripts/localjob.py scripts/bench_planner.py scripts/bench_planner_solve.py scripts/bench_planner_quality.py scripts/bench_planner_latency.py scripts/bench_make_plan.py scripts/fuzzer.py scripts/bench_control.py scripts/bench_planner_stability.py scripts/record_steps.py scripts/demo.py scripts/bench_recipe.py scripts/bench_parallel.py scripts/_torchrun_fsdp.py scripts/bench_faults.py scripts/bench_copy_update.py scripts/liveness.py scripts/soak.py scripts/bench_pipeline.py scripts/_torchrun_pipeline.py scripts/netns.py scripts/bench_links.py scripts/bench_relayout.py scripts/_relayout_job.py scripts/slowcpu.py
	$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is broken"; exit 1; fi; exit $$rc

# The tests that stay in one process (tests/conftest.py: the kinds pure, gloo and process), while iterating.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m pure

# What `pip install .` gives a user (make test runs it too): build the wheel, install it in a fresh
# venv, run a two-worker job with the installed console scripts from outside the checkout.
wheel-check: $(STAMP)
	$(BIN)/python -m pytest -q tests/system/test_wheel.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
