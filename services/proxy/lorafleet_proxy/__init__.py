"""lorafleet-proxy: N vLLM replicas presented as one vLLM server (dp=1) with prefix-affinity routing.

Modules: `app` (FastAPI app factory, endpoints, auth), `main` (the console script, two ports),
`fleet` (membership, health, catch-up), `ledger` (persisted adapter list), `broadcast` (all-or-nothing
state changes), `forward` (routed and read-only calls with retries), `router` (KV-prefix affinity),
`discovery` (DNS), `metrics` (Prometheus).
"""
