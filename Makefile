# Two entry points: `make demo` (the main job) and `make test` (lint + the whole suite).
# Both create .venv on first use; re-running is fast while the install stamp is current.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONDONTWRITEBYTECODE :=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# No wheel cache: CI's disk can be nearly full, and each install runs once per clone.
export PIP_NO_CACHE_DIR := 1

.PHONY: demo test lint install clean gpu-check

$(STAMP): pyproject.toml requirements/no-deps.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "setuptools>=70" wheel
	# torch first and pinned: an unpinned torch would pull the CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps -r requirements/no-deps.txt
	# Byte-compile once: this machine sets PYTHONDONTWRITEBYTECODE, imports are 2-3x slower otherwise.
	$(BIN)/python -m compileall -q -j 0 $(VENV) > /dev/null || true
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/genrec-spec demo

# On a CUDA machine, with the python whose torch is a CUDA build: the package without its CPU
# set, the GPU set (GPU_SET: pip arguments, e.g. local wheels where nothing can be downloaded),
# then every GPU check into runs/gpu-check (GPU_CKPT: a recommender checkpoint for bench recsys,
# GPU_DATA: its prepared data where it is not where it was trained; GPU_ARGS: other gpu-check
# options, e.g. --catalogues DIR --tune-grid pipeline).
GPU_SET ?= -r requirements/gpu.txt
gpu-check:
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -m pip install -q $(GPU_SET)
	$(PY) -m genrec_spec.cli gpu-check --out runs/gpu-check \
		$(if $(GPU_CKPT),--ckpt $(GPU_CKPT)) $(if $(GPU_DATA),--data $(GPU_DATA)) $(GPU_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
