"""lorafleet's operations package: the `lorafleet` CLI and what operators run beside the services.

Every image installs it, so what only tests and benchmarks run (the chaos harness, the LoRA stress driver, the fakes)
lives in the testing room instead (`lorafleet_testing`, tests/support). It may import the contract package
(`lorafleet`) and the services; the contract and the services never import it (tests/unit/test_package_graph.py).
The arrows: docs/concepts/architecture.md#the-packages-and-the-arrows-between-them.
"""
