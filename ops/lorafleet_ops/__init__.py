"""lorafleet's operations package: the `lorafleet` CLI and what operators and tests run beside the services.

It may import the contract package (`lorafleet`) and the services; the contract and the services never import it
(tests/unit/test_package_graph.py). The arrows: docs/concepts/architecture.md#the-packages-and-the-arrows-between-them.
"""
