"""lorafleet-proxy: N vLLM replicas presented as one vLLM server (dp=1) with prefix-affinity routing.

The request path: `main` (the console script, two ports), `server_protocol` (one write per answer), `auth`
(which port, the public port's key), `front` (the outermost layer: body limit, request counts, generation and
read-only calls relayed to one replica with retries), `request` (one relayed request, carried from the front to
each attempt), `router` (KV-prefix affinity), `upstream` (the lean HTTP/1.1 client to the replicas, a pool per
replica), `errors` (vLLM-style error answers, both planes).

The admin plane: `admin` (load/unload, register, pause/resume, cache resets, refused routes), `views`
(/server_info, /v1/models, /is_paused, /health, /fleet, /metrics), `schemas` (typed admin bodies), `broadcast`
(all-or-nothing state changes under one guard), `elision` (pause elision), `openapi` (the document, route tables).

The fleet: `fleet` (the replicas, membership, every change of a replica's state; the supervised loops),
`admission` (warm-up then catch-up, scheduled with backoff), `health` (the health loop, failures toward ejection),
`breaker` (the circuit breaker), `canary_watch` (the canary's rounds and verdicts), `ledger_rebuild` (an unreadable
ledger rebuilt from the replicas), `replica` (one replica's state and which adapters it holds), `sync` (catch-up
of one replica to the ledger), `ledger` (the adapter ledger in memory, committed durably; format in
`lorafleet.ledger_format`), `discovery` (DNS), `canary` (probes and verdicts), `metrics` (Prometheus). `runs` (a
package): everything about several runs on one fleet.
`app` wires them together.
"""
