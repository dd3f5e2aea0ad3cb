"""A stand-in for a vLLM server that answers at once: the trainer benchmark's generation side (a TEST DOUBLE).

It speaks the routes TRL 1.16's AsyncGRPOTrainer and its rollout worker call, with vLLM's shapes:
`/health`, `/v1/models`, `/server_info?config_format=json` (LoRA enabled, data-parallel size 1), `/pause`,
`/resume`, the lorafleet proxy's `/fleet` (this one replica, so lorafleet-train's doctor passes),
`/v1/load_lora_adapter` (the adapter directory must hold PEFT's files; a name already loaded is a 400,
as in vLLM), `/v1/unload_lora_adapter`, and `/v1/completions` with `return_token_ids` and `logprobs`: random
token ids of the tokenizer's vocabulary, at lengths drawn like the published run's (`trainer_shape.Lengths`),
ending in EOS unless they hit `max_tokens`, each with the log-probability a randomly initialised model gives
(uniform over the model's vocabulary), so the importance ratio stays near 1. A request naming neither the base
model nor a loaded adapter gets vLLM's 404.

No model runs here: generation costs nothing, so the benchmark times the trainer alone. Usage:
python bench/vllm_standin.py --port P --model NAME --token-ids N --eos E --model-vocab V [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from trainer_shape import PUBLISHED_LENGTHS, TINY_LENGTHS, Lengths

FIRST_ORDINARY_ID = 4  # the bench tokenizer's special tokens come first (lorafleet_ops.tiny_model.SPECIAL_TOKENS)


def error(status: int, message: str, kind: str) -> web.Response:
    """vLLM's error body."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


class StandIn:
    def __init__(self, *, model: str, token_ids: int, eos: int, model_vocab: int, max_model_len: int,
                 max_lora_rank: int, max_loras: int, lengths: Lengths) -> None:
        self.model, self.token_ids, self.eos = model, token_ids, eos
        self.logprob = -math.log(model_vocab)
        self.max_model_len, self.max_lora_rank, self.max_loras = max_model_len, max_lora_rank, max_loras
        self.lengths = lengths
        self.adapters: dict[str, str] = {}
        self.paused = False
        self.counts = {"completions": 0, "completion_tokens": 0, "loads": 0, "pauses": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models), web.get("/server_info", self.info),
            web.post("/pause", self.pause), web.post("/resume", self.resume), web.get("/is_paused", self.is_paused),
            web.post("/v1/load_lora_adapter", self.load), web.post("/v1/unload_lora_adapter", self.unload),
            web.post("/v1/completions", self.complete), web.get("/standin/stats", self.stats),
            web.get("/fleet", self.fleet),
        ])
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        cards = [{"id": self.model, "object": "model", "root": self.model, "parent": None,
                  "max_model_len": self.max_model_len}]
        cards += [{"id": name, "object": "model", "root": path, "parent": self.model,
                   "max_model_len": self.max_model_len} for name, path in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards})

    def server_info(self) -> dict[str, Any]:
        return {"vllm_config": {
            "model_config": {"model": self.model, "max_model_len": self.max_model_len, "dtype": "torch.bfloat16"},
            "lora_config": {"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras},
            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
        }}

    async def info(self, _: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    async def fleet(self, request: web.Request) -> web.Response:
        """The lorafleet proxy's GET /fleet for a fleet of this one replica (lorafleet-train's doctor reads it)."""
        own_url = f"{request.scheme}://{request.host}"
        replica = {"url": own_url, "state": "ready", "inflight": 0, "routed": 0, "adapters": dict(self.adapters),
                   "last_error": None, "generates": True, "server_info": self.server_info()}
        return web.json_response({
            "replicas": [replica], "ledger": [{"name": n, "path": p, "fingerprint": None}
                                              for n, p in self.adapters.items()],
            "paused": False, "ledger_rebuilding": False, "loops_alive": True, "min_ready": 1, "sync_pause": None,
        })

    async def pause(self, _: web.Request) -> web.Response:
        self.paused = True
        self.counts["pauses"] += 1
        return web.json_response({})

    async def resume(self, _: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name", ""), Path(body.get("lora_path", ""))
        if name in self.adapters:
            return error(400, f"The lora adapter '{name}' has already been loaded.", "BadRequestError")
        if not (path / "adapter_config.json").is_file() or not any(path.glob("adapter_model.*")):
            return error(404, f"No adapter found for {path}", "NotFoundError")
        json.loads((path / "adapter_config.json").read_text())  # a half-written config fails the load, as in vLLM
        self.adapters[name] = str(path)
        self.counts["loads"] += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json()).get("lora_name", "")
        if self.adapters.pop(name, None) is None:
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = body.get("model")
        if model != self.model and model not in self.adapters:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError")
        cap = int(body.get("max_tokens") or 16)
        rng = random.Random(body.get("seed"))
        length = self.lengths.draw(rng, cap)
        ids = [rng.randrange(FIRST_ORDINARY_ID, self.token_ids) for _ in range(length)]
        finish = "length"
        if length < cap:
            ids[-1], finish = self.eos, "stop"
        self.counts["completions"] += 1
        self.counts["completion_tokens"] += length
        prompt = body.get("prompt") or []
        return web.json_response({
            "id": f"cmpl-{self.counts['completions']}", "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish,
                         "logprobs": {"token_logprobs": [self.logprob] * length}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": length,
                      "total_tokens": len(prompt) + length},
        })

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({**self.counts, "adapters": sorted(self.adapters)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the served base model's name (TRL sends its path)")
    parser.add_argument("--token-ids", type=int, required=True, help="generated ids are < this (tokenizer size)")
    parser.add_argument("--eos", type=int, required=True)
    parser.add_argument("--model-vocab", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-lora-rank", type=int, default=1)
    parser.add_argument("--max-loras", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="short completions (the CPU smoke test)")
    args = parser.parse_args(argv)
    standin = StandIn(model=args.model, token_ids=args.token_ids, eos=args.eos, model_vocab=args.model_vocab,
                      max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                      lengths=TINY_LENGTHS if args.tiny else PUBLISHED_LENGTHS)
    web.run_app(standin.app(), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
