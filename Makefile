# Quick start: `make run` (seed matrix on the best available kernel) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# GPU extras are installed only where a GPU runtime is visible.
EXTRAS := test,plot$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)$(shell test -e /dev/kfd && echo ,hip)

.PHONY: run test venv build-check mutants report bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

venv: $(BIN)/.installed

## Run the seed case matrix on the best available kernel and write a report under reports/.
run: venv
	$(BIN)/refattn run --suite seed --report reports

## Install and run the test suite (pytest's exit 5, "no tests ran", is a failure).
test: venv
	$(BIN)/python -m pytest

build-check: venv
	$(BIN)/python -m hipkernel.build

mutants: venv
	$(BIN)/refattn mutants --kernel model --suite seed --suite extended

report: venv
	$(BIN)/refattn report --check

bench: venv
	$(BIN)/python -m pytest benchmarks -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
