# ddpflow: `make run` sets everything up and runs the default workflow; `make test` runs
# every test (the real Slurm cluster tests need root; see tests/slurm/README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ddpflow-installed
DOCS_STAMP := $(VENV)/.ddpflow-docs-installed
# the experiment trackers' clients (envs/tracking.txt, `make tracking`); the tests add a
# real MLflow server for them to log to (envs/tracking-server.txt)
TRACKING_STAMP := $(VENV)/.ddpflow-tracking-installed
TRACKING_TEST_STAMP := $(VENV)/.ddpflow-tracking-server-installed
# export.formats: [onnx] (envs/onnx.txt, `make onnx`)
ONNX_STAMP := $(VENV)/.ddpflow-onnx-installed

.PHONY: run test test-fast lint bench clean profile docs docs-build docs-reference tracking \
	typed-config onnx image pictures

run: $(STAMP) profile
	$(BIN)/snakemake

test: $(STAMP) $(DOCS_STAMP) $(TRACKING_STAMP) $(TRACKING_TEST_STAMP) $(ONNX_STAMP) profile
	$(BIN)/python -m pytest

# `snakemake --profile slurm`, the name as users type it: Snakemake looks for named profiles
# in the working directory, then in its user config folder (platformdirs: $XDG_CONFIG_HOME or
# ~/.config/snakemake). Link this clone's profiles/slurm there, unless a profile called slurm
# that is not a ddpflow link is already installed (then: --profile profiles/slurm).
USER_PROFILES := $(or $(XDG_CONFIG_HOME),$(HOME)/.config)/snakemake
profile:
	@link="$(USER_PROFILES)/slurm"; \
	if [ -e "$$link" ] && ! readlink "$$link" | grep -q '/profiles/slurm$$'; then \
	  echo "ddpflow: $$link exists and is not ddpflow's: use --profile profiles/slurm"; \
	else \
	  mkdir -p "$(USER_PROFILES)" && ln -sfn "$(CURDIR)/profiles/slurm" "$$link" && \
	  echo "ddpflow: snakemake --profile slurm uses $(CURDIR)/profiles/slurm"; \
	fi

# The edit-test loop (about 2 minutes on 2 cores): the unit tests without those marked slow,
# and one small end-to-end workflow run (marked smoke). `make test` stays the whole suite.
test-fast: $(STAMP) $(DOCS_STAMP) profile
	$(BIN)/python -m pytest -q -m "(not slow and not e2e and not slurm and not gpu) or smoke"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint
	$(BIN)/mypy -p ddpflow

bench: $(STAMP)
	bench/run

# docs/img/report.png and sweep.png from the current report code (headless Chromium);
# tests/test_docs.py notices when the report's code changed since they were made
pictures: $(STAMP)
	$(BIN)/python docs/make_pictures.py

# The documentation site (docs/, mkdocs.yml): `make docs` serves it at http://127.0.0.1:8000,
# `make docs-build` builds it into site/ as CI does (--strict: a broken link fails).
$(DOCS_STAMP): envs/docs.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r envs/docs.txt
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs serve

docs-build: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

# MLflow and W&B clients for `tracking:` in config.yaml (docs/tracking.md), into the same .venv
tracking: $(TRACKING_STAMP)

$(TRACKING_STAMP): envs/tracking.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r envs/tracking.txt
	touch $@

# the ONNX exporter and onnxruntime for export.formats: [onnx] (docs/use-your-model.md)
onnx: $(ONNX_STAMP)

$(ONNX_STAMP): envs/onnx.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r envs/onnx.txt
	touch $@

$(TRACKING_TEST_STAMP): envs/tracking-server.txt envs/tracking.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r envs/tracking-server.txt
	touch $@

# machine.container's image of the pinned environment: a Charliecloud directory image at
# images/ddpflow (docs/software-on-the-nodes.md); needs root (debootstrap) and the apt mirror.
# envs/ddpflow.def builds the same for Apptainer where a site builds there.
image: $(STAMP)
	bash envs/charliecloud-image.sh

# the configuration reference, generated from the schema (tests/test_config_reference.py
# fails when the committed file is stale)
docs-reference: $(STAMP)
	$(BIN)/python -m ddpflow.config.reference > docs/reference/config.md

# the typed run the ranks read, generated from the schema (tests/test_typed_config.py fails
# when the committed file is stale)
typed-config: $(STAMP)
	$(BIN)/python -m ddpflow.config.typed_gen | $(BIN)/ruff format --stdin-filename \
	  workflow/ddpflow/config/typed.py - > workflow/ddpflow/config/typed.py

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
