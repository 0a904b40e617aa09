-- requeue.lua: after a stall, the trainer hands shards with a gap back to the work list.
-- A shard is requeued only if nobody can still be delivering it: the data list is
-- empty, it was minted already, it is not in the work list and no live producer holds it.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] work  KEYS[4] data  KEYS[5] producers
-- KEYS[6] stats
-- KEYS[7..] lease lists of the producers named in ARGV[4 + #shards ..]
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] number of candidate shards m
-- ARGV[4 .. 3+m] candidate global shard numbers, oldest first
-- ARGV[4+m ..] producer ids whose lease lists are KEYS[7..]
-- A data-parallel rank passes its own data list as KEYS[4] and, after the producer ids,
-- '', its 'next:<rank>' field and its candidates' local shard numbers (compared with
-- that counter instead of the global numbers with 'next').
-- Returns {'OK', requeued...} or {'STATE_LOST'}, {'RUN_CHANGED'}
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
local n = tonumber(ARGV[3])
local next_field, locals = 'next', nil
for i = 4 + n, #ARGV do
  if ARGV[i] == '' then  -- never a producer id (batchq.keys.check_name)
    next_field, locals = ARGV[i + 1], i + 2
    break
  end
end
local m = redis.call('HMGET', KEYS[1], 'run', next_field)
if m[1] ~= ARGV[2] then return {'RUN_CHANGED'} end
if redis.call('LLEN', KEYS[4]) > 0 then return {'OK'} end
local held = {}
for _, g in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do held[g] = true end
for i = 7, #KEYS do
  for _, e in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    local g = string.match(e, '^(%d+):')
    if g then held[g] = true end
  end
end
local out = {'OK'}
for i = 3 + n, 4, -1 do
  local g = ARGV[i]
  local minted = tonumber(g)
  if locals then minted = tonumber(ARGV[locals + i - 4]) end
  if minted < tonumber(m[2] or '0') and not held[g] then
    redis.call('LPUSH', KEYS[3], g)
    redis.call('HINCRBY', KEYS[6], 'redone_shards', 1)
    table.insert(out, g)
  end
end
return out
