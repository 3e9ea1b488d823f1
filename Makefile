# Two commands on a fresh clone: `make serve` and `make test`. Both bootstrap .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrap-stamp
PYTEST_ARGS ?=

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	./scripts/bootstrap.sh $(VENV)
	@touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/punica-x serve $(SERVE_ARGS)

test: $(STAMP)
	./scripts/test-deps.sh
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
