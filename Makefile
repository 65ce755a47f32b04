# Two commands a newcomer needs: `make demo` and `make test`. Each builds .venv
# from this repository's own files when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/objckpt demo

lint: $(STAMP)
	$(VENV)/bin/ruff check objckpt tests bench
	$(VENV)/bin/ruff format --check objckpt tests bench
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/bench_sync.py

clean:
	rm -rf $(VENV) build *.egg-info
