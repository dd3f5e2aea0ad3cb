-- wrk: POST one GRPO-shaped completion request (200 prompt token ids) to /v1/completions.
local ids = {}
for i = 1, 200 do ids[i] = tostring((i * 7919) % 32000) end
wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"fake-base","prompt":[' .. table.concat(ids, ",") ..
  '],"max_tokens":16,"temperature":1.0,"logprobs":0,"return_token_ids":true,"n":1}'
