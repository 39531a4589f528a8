# Two entry points, each self-contained on a fresh machine:
#   make demo   venv + install + export, check and bench the shipped default model
#   make test   venv + install + the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ADAPTEX:= $(VENV)/bin/adaptex
STAMP  := $(VENV)/.installed
OUTDIR ?= build/demo

.PHONY: demo test test-slow test-gpu install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: pip takes the CPU wheel that lies on disk.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,coreml]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf $(OUTDIR) && mkdir -p $(OUTDIR)
	$(ADAPTEX) models
	$(ADAPTEX) export --target onnx -o $(OUTDIR)/budgetformer.onnx
	$(ADAPTEX) export --target onnx --variant dense -o $(OUTDIR)/budgetformer.dense.onnx
	$(ADAPTEX) inspect $(OUTDIR)/budgetformer.onnx
	$(ADAPTEX) check $(OUTDIR)/budgetformer.onnx --samples 200
	$(ADAPTEX) bench $(OUTDIR)/budgetformer.onnx --batch 1 --seq 128 --threads 1
	$(ADAPTEX) bench $(OUTDIR)/budgetformer.dense.onnx --batch 1 --seq 128 --threads 1

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# On an NVIDIA GPU machine: TensorRT 10 and cuda-python, then the engine tests (skipped elsewhere).
test-gpu: $(STAMP)
	$(PY) -m pip install --quiet -e '.[tensorrt]'
	$(PY) -m pytest -q -m tensorrt -rs

clean:
	rm -rf $(VENV) build .pytest_cache
