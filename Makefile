# Quick start: `make run` (seed matrix on the best available kernel) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# GPU extras are installed only where a GPU runtime is visible.
EXTRAS := test,plot,ort$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)$(shell test -e /dev/kfd && echo ,hip)

.PHONY: run test venv build-check wheel-check mutants report bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

venv: $(BIN)/.installed

## Run the seed and coverage suites (every required cell of the coverage model) on the best available kernel and write a report under reports/.
run: venv
	$(BIN)/refattn run --suite seed --suite coverage --report reports

## Install and run the test suite (pytest's exit 5, "no tests ran", is a failure).
test: venv
	$(BIN)/python -m pytest

build-check: venv
	$(BIN)/python -m hipkernel.build

## Build the wheel from a clean copy of the tree (tracked and untracked, not ignored: no stale
## build/), install it (with the test extra, not editable) into a fresh venv, and from an empty
## directory outside the tree, where the tree is not importable, check what a user gets: the
## suites as package data, `refattn run` on a registered kernel, on a kernel named by file
## path, and over 2 pytest-xdist workers, the fuzzer over 2 simulated devices, and the pytest
## plugin. WHEEL_CHECK_DIR keeps it all
## (default: a temporary directory, removed after).
WHEEL_CASES  := -k gptoss-sink-past0 -k gptoss-smooth-past0 -k gptoss-nosink-past0-w128
WHEEL_KERNEL := $(CURDIR)/examples/numpy_kernel.py:NumpyKernel
wheel-check: SHELL := /bin/bash
wheel-check: venv
	@set -euo pipefail; t0=$$SECONDS; \
	d="$${WHEEL_CHECK_DIR:-}"; if [ -z "$$d" ]; then d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; fi; \
	mkdir -p "$$d/src" "$$d/dist" "$$d/empty"; \
	echo "== wheel-check in $$d"; \
	if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	  git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C "$$d/src"; \
	else \
	  tar --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.egg-info' -cf - . | tar -xf - -C "$$d/src"; \
	fi; \
	$(BIN)/python -m pip wheel -q --no-deps -w "$$d/dist" "$$d/src"; \
	whl=$$(ls "$$d"/dist/refattn-*.whl); echo "built $$whl"; \
	$(PYTHON) -m venv "$$d/venv"; \
	"$$d/venv/bin/python" -m pip install -q "$$whl[test]"; \
	cd "$$d/empty"; \
	unset PYTHONPATH REFATTN_CASES_DIR PYTEST_ADDOPTS PYTEST_DISABLE_PLUGIN_AUTOLOAD; \
	py="$$d/venv/bin/python"; \
	"$$py" -c 'import pathlib, sys, refattn, refattn.cases as c; \
	site = pathlib.Path(sys.argv[1]).resolve(); \
	where = [pathlib.Path(refattn.__file__).resolve(), c.cases_dir().resolve()]; \
	bad = [str(p) for p in where if site not in p.parents]; \
	sys.exit(f"not from the wheel: {bad}" if bad else 0)' "$$d/venv"; \
	echo "== refattn cases --suite seed (package data)"; \
	"$$d/venv/bin/refattn" cases --suite seed > cases.txt; \
	grep -Eq "^ *[1-9][0-9]* cases from seed" cases.txt && grep -q "gptoss-sink-past0" cases.txt \
	  || { cat cases.txt; echo "wheel-check: refattn cases --suite seed listed no seed cases" >&2; exit 1; }; \
	echo "== refattn run --kernel reference"; \
	"$$d/venv/bin/refattn" run --kernel reference --suite seed $(WHEEL_CASES) -q; \
	echo "== refattn run --kernel $(WHEEL_KERNEL)"; \
	"$$d/venv/bin/refattn" run --kernel "$(WHEEL_KERNEL)" --suite seed $(WHEEL_CASES) -q; \
	echo "== refattn run --kernel reference --gpus 2 (two simulated devices)"; \
	CUDA_VISIBLE_DEVICES=0,1 "$$d/venv/bin/refattn" run --kernel reference --suite seed $(WHEEL_CASES) --gpus 2 -q; \
	echo "== refattn fuzz --kernel reference --gpus 2 (two simulated devices)"; \
	CUDA_VISIBLE_DEVICES=0,1 "$$d/venv/bin/refattn" fuzz --kernel reference --examples 20 --max-cost 65536 --gpus 2 -q; \
	echo "== pytest -p refattn.pytest_plugin --refattn-kernel $(WHEEL_KERNEL) --refattn-suite contracts"; \
	"$$py" -m pytest -p refattn.pytest_plugin -p no:cacheprovider -q -rs \
	  --refattn-kernel "$(WHEEL_KERNEL)" --refattn-suite contracts; \
	echo "wheel-check: OK in $$((SECONDS - t0)) s"

mutants: venv
	$(BIN)/refattn mutants --kernel model --suite seed --suite extended --suite coverage --suite ragged --suite bf16

report: venv
	$(BIN)/refattn report --check

bench: venv
	$(BIN)/python -m pytest benchmarks -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
