"""Operator commands of the `lorafleet` CLI (doctor, demo, status); the rest of `lorafleet` is the library they use."""
