# The two commands a newcomer needs: `make run` and `make test`. Both bootstrap themselves.
.PHONY: bootstrap run test kafka-up kafka-down bench clean

bootstrap:
	@bash deploy/bootstrap.sh

run: bootstrap
	.venv/bin/flexpipe up $(ARGS)

test: bootstrap
	@bash deploy/test.sh $(ARGS)

kafka-up: bootstrap
	.venv/bin/flexpipe kafka up

kafka-down:
	.venv/bin/flexpipe kafka down

bench: bootstrap
	.venv/bin/python -m bench.planner

clean:
	-.venv/bin/flexpipe kafka down
	rm -rf .venv .cache out .mypy_cache .ruff_cache .pytest_cache
