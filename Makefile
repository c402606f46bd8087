# One command for a new user: `make test` creates .venv, installs tritonshard with its test dependencies, and runs
# the suite (kernels through the Triton interpreter on CPU, distributed tests with real gloo processes).
#
# TORCH_SPEC pins the CPU build used by CI (on the project's CI machines an unpinned torch pulls a multi-GB CUDA
# build). On a GPU machine, override it with your CUDA torch, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
NPROC ?= 2
# pytest-xdist workers for `make test` (2: the CI machine's cores; each worker also starts its own gloo rank processes)
TEST_JOBS ?= 2

.PHONY: test train train-hf figures install clean

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_JOBS) --durations=10 $(PYTEST_ARGS)

# The main job: a small GPT trained with ShardedAdamW on 2 processes (gloo on CPU, NCCL on GPUs).
# `make train TRAIN_ARGS="--optimizer torch"` runs the fp32 torch.optim.AdamW baseline on the same data and seed.
# (torchrun --standalone through examples/launch.py: Ctrl-C stops the workers cleanly, without torchrun's traceback)
train: $(VENV)/.installed
	$(PY) examples/launch.py --nproc-per-node $(NPROC) examples/train_gpt.py $(TRAIN_ARGS)

# The same training idioms as Hugging Face code: a LlamaForCausalLM from a tiny config, torch's clipping, save_pretrained.
train-hf: $(VENV)/.installed
	$(PY) examples/launch.py --nproc-per-node $(NPROC) examples/train_hf.py $(TRAIN_ARGS)

# Every figure the README quotes from CPU runs, regenerated (docs/figures.json + the loss-curve PNGs; ~12 min).
figures: $(VENV)/.installed
	$(PY) -m benchmarks.figures

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
