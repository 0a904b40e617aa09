-- params.lua: the run's change log of producer parameters (batchq/protocol/params_log.py),
-- written here only, and the shards built with params that changed since, handed back.
-- op 'add': append {id, index, params, version} for the caller's run (meta 'params' =
--   '<run>:<version>'); a call whose id is in the log already adds nothing.
-- op 'load': a whole log (`body`, `index` entries) for the run `run` (a checkpoint's, or
--   stripe 0's copied to another stripe); a log there as long or longer is kept.
-- op 'rebuild': shards built with params since changed back to the front of the work
--   list, the ledger saying the batches kept of each (lease.lua's skip); `index` frames
--   were dropped (stats rebuilt_params).
-- add and load return {'OK', the log's version, its JSON} or {'TOO_BIG', bytes}, rebuild
--   {'OK'}; every op {'STATE_LOST'}, {'CLAIM_LOST'}, {'CORRUPT'} (a stored log that is not
--   batchq's); add and rebuild {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local params_key = KEYS[3]       -- STRING the log, {"run":...,"entries":[...]}
local work_key = KEYS[4]         -- LIST   shards handed back
local ledger_key = KEYS[5]       -- HASH   '<epoch>:<slot>' -> 'd' or batches had
local stats_key = KEYS[6]        -- HASH   queue counters
local incarnation = ARGV[1]
local run = ARGV[2]
local token = ARGV[3]            -- the caller's claim token
local sfx = ARGV[4]              -- meta field suffix: '' (world 1) or ':<rank>'
local op = ARGV[5]               -- 'add' | 'load' | 'rebuild'
local index = ARGV[6]            -- add: the entry's index; load: entries; rebuild: frames dropped
local body = ARGV[7]             -- add: the params (JSON object); load: the entries (array)
local call_id = ARGV[8]          -- add: names the call (letters and digits)
local max_bytes = tonumber(ARGV[9])  -- the log's cap (batchq.protocol.layout)
-- ARGV[10..]: rebuild: triples '<epoch>:<slot>' (the ledger field), batches kept,
-- global slot number, oldest first
local first_triple = 10

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'claim' .. sfx, 'params')
if m[2] ~= token then return {'CLAIM_LOST'} end
if op ~= 'load' and m[1] ~= run then return {'RUN_CHANGED'} end
if not string.match(index, '^%d+$') or not string.match(call_id, '^%w*$') or
    not string.match(run, '^[%w_.-]+$') then
  return redis.error_reply('params.lua: index, call id or run of a form batchq never sends')
end

if op == 'rebuild' then
  for i = #ARGV - 2, first_triple, -3 do
    redis.call('HSET', ledger_key, ARGV[i], ARGV[i + 1])
    redis.call('LREM', work_key, 0, ARGV[i + 2])
    redis.call('LPUSH', work_key, ARGV[i + 2])
  end
  if tonumber(index) > 0 then redis.call('HINCRBY', stats_key, 'rebuilt_params', index) end
  return {'OK'}
end

-- The log of `run` as stored, and its version (meta's stamp '<run>:<version>').
local prefix = '{"run":"' .. run .. '","entries":['
local have, log = 0, nil
local stamp = m[3] or ''
if string.sub(stamp, 1, #run + 1) == run .. ':' then
  have = tonumber(string.sub(stamp, #run + 2)) or 0
end
if have > 0 then
  log = redis.call('GET', params_key)
  if not log or string.sub(log, 1, #prefix) ~= prefix then return {'CORRUPT'} end
end

local new
if op == 'load' then
  local count = tonumber(index)
  if have >= count then return {'OK', have, log or ''} end
  new = prefix .. string.sub(body, 2) .. '}'
  have = count
else
  if log and call_id ~= '' and string.find(log, '"id":"' .. call_id .. '"', 1, true) then
    return {'OK', have, log}
  end
  have = have + 1
  local entry = '{"id":"' .. call_id .. '","index":' .. index .. ',"params":' .. body ..
    ',"version":' .. have .. '}'
  if log then new = string.sub(log, 1, #log - 2) .. ',' .. entry .. ']}'
  else new = prefix .. entry .. ']}' end
end
if #new > max_bytes then return {'TOO_BIG', #new} end
local new_stamp = run .. ':' .. have  -- batchq.protocol.layout.params_stamp
redis.call('SET', params_key, new)
redis.call('HSET', meta_key, 'params', new_stamp)
return {'OK', have, new}
