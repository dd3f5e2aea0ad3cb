"""The seeded adversarial isolation harness (issue 64), in the shape of the chaos harness: an adversary (tricks,
adversary), a schedule from a seed, victims, planted defects (plants) and an independent checker that reads only the
run's artifacts (checker). `harness.attack` runs one; tests/integration/test_isolation.py runs the short form,
bench/isolation_attack.py the long one (`make isolation-attack`). docs/guides/security.md tells what it proves.
"""
