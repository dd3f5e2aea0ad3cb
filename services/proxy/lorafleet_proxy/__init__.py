"""lorafleet-proxy: N vLLM replicas presented as one vLLM server (dp=1) with prefix-affinity routing.

Modules: `app` (FastAPI app factory, endpoints, auth), `main` (the console script, two ports),
`fleet` (membership, health checks, ejection: the supervised loops), `replica` (one replica's state
and which adapters it holds), `sync` (catch-up of one replica to the ledger), `ledger` (the adapter
ledger in memory, committed durably; format in `lorafleet.ledger_file`), `broadcast` (all-or-nothing
state changes), `front` (the outermost layer: body limit, request counts, generation and read-only
calls relayed to one replica with retries), `upstream` (the lean HTTP/1.1 client to the replicas),
`router` (KV-prefix affinity), `discovery` (DNS), `metrics` (Prometheus).
"""
