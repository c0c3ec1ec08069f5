# Unison: `make demo` and `make test` set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NP ?= 2

.PHONY: venv demo test test-fast lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[all]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/unisonrun -np $(NP) $(PY) examples/keras_fit.py

test: venv
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: venv
	$(VENV)/bin/ruff check unison tests benchmarks examples
	$(VENV)/bin/mypy unison/common unison/collectives

clean:
	rm -rf $(VENV) build *.egg-info
