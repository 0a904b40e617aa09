-- requeue.lua: after a stall, the trainer hands shards with a gap back to the work list.
-- A shard is requeued only if nobody can still be delivering it: the data list is
-- empty, it was minted already, it is not in the work list and no live producer holds it.
-- Returns {'OK', requeued...} or {'STATE_LOST'}, {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back
local data_key = KEYS[4]         -- LIST   the data list (the rank's own, data-parallel)
local stats_key = KEYS[5]        -- HASH   queue counters
-- KEYS[6..]: the lease lists of the producers named in ARGV
local incarnation = ARGV[1]
local run = ARGV[2]
local n = tonumber(ARGV[3])      -- the number of candidate shards m
local mask = tonumber(ARGV[4])   -- the caller's group slot as a mask (1: slot 0; groups.py)
-- ARGV[5..]: m candidate global shard numbers, oldest first; the producer ids whose
-- lease lists are KEYS[6..]; a data-parallel rank or a group slot > 0 then adds '', its
-- cursor field ('next:<rank>', 'next@<slot>[:<rank>]') and its candidates' local shard
-- numbers (compared with that counter instead of the global numbers with 'next')
local first_lease, first_candidate = 6, 5

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local next_field, locals = 'next', nil
for i = first_candidate + n, #ARGV do
  if ARGV[i] == '' then  -- never a producer id (batchq.protocol.keys.check_name)
    next_field, locals = ARGV[i + 1], i + 2
    break
  end
end
local m = redis.call('HMGET', meta_key, 'run', next_field)
if m[1] ~= run then return {'RUN_CHANGED'} end
if redis.call('LLEN', data_key) > 0 then return {'OK'} end
local held = {}
local function hold(entry)
  local g, for_mask = parse_spec(entry)
  -- An entry for other groups only will not bring it to the caller's list.
  if g and math.floor(for_mask / mask) % 2 == 1 then held[tostring(g)] = true end
end
for _, e in ipairs(redis.call('LRANGE', work_key, 0, -1)) do hold(e) end
for i = first_lease, #KEYS do
  for _, e in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do hold(e) end
end
local out = {'OK'}
for i = first_candidate + n - 1, first_candidate, -1 do
  local g = ARGV[i]
  local minted = tonumber(g)
  if locals then minted = tonumber(ARGV[locals + i - first_candidate]) end
  if minted < tonumber(m[2] or '0') and not held[g] then
    redis.call('LPUSH', work_key, work_spec(g, mask))  -- for the caller's group alone
    redis.call('HINCRBY', stats_key, 'redone_shards', 1)
    table.insert(out, g)
  end
end
return out
