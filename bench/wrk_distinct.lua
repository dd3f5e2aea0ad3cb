-- wrk: POST GRPO-shaped completion requests (200 prompt token ids) whose prompts are all distinct: the
-- first two ids count requests, the other 198 are shared, so every prompt adds new blocks to the routing table.
local tail = {}
for i = 1, 198 do tail[i] = tostring(100 + i) end
tail = table.concat(tail, ",")
local sent = 0

request = function()
  sent = sent + 1
  local body = '{"model":"fake-base","prompt":[' .. (sent % 65536) .. ',' .. math.floor(sent / 65536) .. ',' ..
    tail .. '],"max_tokens":16,"temperature":1.0}'
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
