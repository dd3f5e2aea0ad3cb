"""Chaos: several runs training under a seeded nemesis, judged by an independent checker (issue 56)."""
