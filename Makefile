# ddpflow: `make run` sets everything up and runs the default workflow; `make test` runs
# every test (the real Slurm cluster tests need root; see tests/slurm/README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ddpflow-installed

.PHONY: run test lint bench clean

run: $(STAMP)
	$(BIN)/snakemake

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

bench: $(STAMP)
	bench/run

# torch and torchvision are pinned together in envs/requirements.txt (a bare torch pulls
# another multi-GB build); the package is installed editable so submitit's ranks import it.
$(STAMP): envs/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r envs/requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

clean:
	rm -rf results logs .snakemake
