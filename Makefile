# Two commands on a fresh clone: `make serve` and `make test`. Both bootstrap .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrap-stamp
PYTEST_ARGS ?=

.PHONY: serve test test-long lint bench clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	./scripts/bootstrap.sh $(VENV)
	@touch $(STAMP)

# prepare is quick when nothing changed; after a pull it rebuilds the kernels before a start.
serve: $(STAMP)
	$(PY) -m punica_x.prepare
	$(VENV)/bin/punica-x serve $(SERVE_ARGS)

test: $(STAMP)
	./scripts/test-deps.sh $(VENV)
	$(PY) -m punica_x.prepare --all-isas
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The long runs left out of make test (20 SIGKILLs of Ray runner processes, ...).
test-long: $(STAMP)
	./scripts/test-deps.sh $(VENV)
	$(PY) -m punica_x.prepare --all-isas
	$(PY) -m pytest -m long $(PYTEST_ARGS)
	FUZZ_LONG=1 $(PY) -m pytest tests/frontend/test_openapi.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
