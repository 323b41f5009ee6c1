# The two commands of the README: `make serve` and `make test`.
.PHONY: serve test

serve:
	bash scripts/install.sh
	.venv/bin/strata serve $(ARGS)

test:
	bash scripts/install.sh --test
	.venv/bin/python -m pytest -q
