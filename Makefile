# The two commands of the README.
.PHONY: generate test

PROMPT ?= What is the capital of France?

generate:
	bash scripts/install.sh
	.venv/bin/strata generate "$(PROMPT)"

test:
	bash scripts/install.sh --test
	.venv/bin/python -m pytest -q
