# Two entry points, each self-contained on a fresh machine:
#   make demo   venv + install + export, check and bench the shipped default model; the three app
#               artifacts exported into examples/web/models (then: make serve, or the one-liner it prints)
#   make test   venv + install + the test suite (with the browser and Node tests of examples/)
#   make fuzz   venv + install + the fuzz tests (runner inputs, CLI arguments) with many examples:
#               FUZZ_EXAMPLES per test, default 2000 (make test runs a few of each)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ADAPTEX:= $(VENV)/bin/adaptex
STAMP  := $(VENV)/.installed
OUTDIR ?= build/demo
WEB    := examples/web
NODE   := examples/node
PORT   ?= 8000
APP_MODELS := tsa-charlm budgetformer-graded elastic-minilm
SERVE  := $(PYTHON) -m http.server -d $(WEB) --bind 127.0.0.1 $(PORT)

.PHONY: demo test test-slow test-gpu fuzz mutate install clean apps-deps chromium web serve serve-env

# pip at -qq prints its errors only: a pip configuration may name index folders that do not exist
# (a "Location ... is ignored" warning a package), and setuptools' editable install adds a note; a
# failed install still says why and stops make.
PIP    := $(PY) -m pip --quiet --quiet

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first, pinned: pip takes the CPU wheel that lies on disk.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,coreml,bench]'
	touch $(STAMP)

install: $(STAMP)

# `adaptex serve`'s serving interpreter: PyTriton's bundled Python backend links the system's libpython,
# so the model side runs in a venv made from the system Python (docs/serving.md). Where there is none,
# the serving test is skipped with that reason.
SERVE_PY  ?= /usr/bin/python3
SERVE_ENV := .venv-serve
$(SERVE_ENV)/.installed:
	@if [ -x $(SERVE_PY) ] && $(SERVE_PY) -m venv $(SERVE_ENV) 2>/dev/null; then \
	    $(SERVE_ENV)/bin/python -m pip install -qq nvidia-pytriton==0.7.0 onnxruntime 'numpy<2' && touch $@ \
	        || echo "note: could not install nvidia-pytriton into $(SERVE_ENV): the serving test will be skipped"; \
	else echo "note: no system Python at $(SERVE_PY) with venv: the serving test will be skipped"; fi

serve-env: $(SERVE_ENV)/.installed

# The apps' runtimes. Each step does nothing when already done; where it cannot run (no npm, no apt-get
# as root) it says so, and the tests that need it are skipped with that reason.
apps-deps: chromium $(WEB)/node_modules/.stamp $(NODE)/node_modules/.stamp

chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	    || command -v google-chrome >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	        || echo "note: apt-get could not install chromium: the browser tests will be skipped"; \
	else echo "note: no Chromium and no apt-get as root: the browser tests will be skipped"; fi

# --ignore-scripts: onnxruntime-node's install script fetches GPU binaries from a host these machines
# cannot reach; the CPU binary ships inside the package.
%/node_modules/.stamp: %/package.json %/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	    (cd $* && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) && touch $@; \
	else echo "note: npm not found: the $* tests will be skipped"; fi

# The artifacts the page and the Node script load, exported afresh (the exporter may have changed).
web: $(STAMP) apps-deps
	mkdir -p $(WEB)/models
	for m in $(APP_MODELS); do $(ADAPTEX) export $$m --target onnx -o $(WEB)/models/$$m.onnx || exit 1; done
	@if command -v node >/dev/null 2>&1 && [ -f $(NODE)/node_modules/.stamp ]; then node $(NODE)/run.mjs --new 40; fi
	@echo; echo "serve the page:  $(SERVE)"; echo "then open        http://127.0.0.1:$(PORT)/"

serve:
	$(SERVE)

demo: $(STAMP) web
	rm -rf $(OUTDIR) && mkdir -p $(OUTDIR)
	$(ADAPTEX) models
	$(ADAPTEX) export --target onnx -o $(OUTDIR)/budgetformer.onnx
	$(ADAPTEX) export --target onnx --variant dense -o $(OUTDIR)/budgetformer.dense.onnx
	$(ADAPTEX) inspect $(OUTDIR)/budgetformer.onnx
	$(ADAPTEX) check $(OUTDIR)/budgetformer.onnx --samples 200
	$(ADAPTEX) bench $(OUTDIR)/budgetformer.onnx --batch 1 --seq 128 --threads 1
	$(ADAPTEX) bench $(OUTDIR)/budgetformer.dense.onnx --batch 1 --seq 128 --threads 1
	@echo; echo "the apps: serve the page with  $(SERVE)  (or make serve), open http://127.0.0.1:$(PORT)/;"
	@echo "          node $(NODE)/run.mjs runs the same three tasks in Node"

# two pytest-xdist workers (one per core on the 2-core machines this project runs on), each test
# file on one worker (its module fixtures made once); TEST_WORKERS=0 runs the suite in one process.
# The 15 slowest tests are listed at the end: the suite's budget is 15 minutes on 2 cores
TEST_WORKERS ?= 2
test: $(STAMP) apps-deps serve-env
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=15

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q tests/unit/test_fuzz.py

test-slow: $(STAMP) serve-env
	$(PY) -m pytest -q -m slow

# Planted mutations of the lowering bodies, the parity checker, the bench accounting and the MIL
# evaluator, each run against the tests that should catch it; prints the score and the survivors.
# Not part of make test (each mutant reruns a few test files).
mutate: $(STAMP)
	mkdir -p build
	$(PY) tests/mutate.py --json build/mutation.json

# On an NVIDIA GPU machine: TensorRT 10 and cuda-python, then the engine tests (skipped elsewhere).
test-gpu: $(STAMP)
	$(PIP) install -e '.[tensorrt]'
	$(PY) -m pytest -q -m tensorrt -rs

clean:
	rm -rf $(VENV) $(SERVE_ENV) build .pytest_cache
