-- lease.lua: a producer leases its next shard, idempotently.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] work  KEYS[4] lease (this producer's)
-- KEYS[5] producers  KEYS[6] ledger (what a resumed trainer already has)
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] producer id  ARGV[4] token (unique per
--         lease request: a retried request with the same token gets the same shard)
-- ARGV[5] heartbeat ttl (ms)
-- ARGV[6] '1' when sent right behind a shard's last push (prefetch): lease only if that
--         push went through (the lease list is empty), so that a producer blocked at the
--         hwm never sits on a second shard another producer could build
-- Returns {'OK', g, skip} (g = global shard number: epoch * S + shard; skip = batches of
--         it the trainer already has: build it, push only from batch `skip` on)
--      or {'WAIT'} (the look-ahead window is full), {'BUSY'} (prefetch declined),
--         {'STATE_LOST'}, {'RUN_CHANGED'},
--         {'FINISHED'}, {'REAPED'} (this producer was declared dead: join again)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
local m = redis.call('HMGET', KEYS[1], 'run', 'finished', 'next', 'floor', 'window', 'shards')
if m[1] ~= ARGV[2] then return {'RUN_CHANGED'} end
if m[2] == '1' then return {'FINISHED'} end
if not redis.call('ZSCORE', KEYS[5], ARGV[3]) then return {'REAPED'} end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[5]), ARGV[3])

-- The ledger names shards as '<epoch>:<shard>': 'd' when done, else batches already had.
local S = tonumber(m[6])
local function had(g)
  local v = redis.call('HGET', KEYS[6], math.floor(g / S) .. ':' .. (g % S))
  if v == 'd' then return -1 end
  return tonumber(v or '0')
end

if ARGV[6] == '1' and redis.call('LLEN', KEYS[4]) > 0 then return {'BUSY'} end

local suffix = ':' .. ARGV[4]
for _, e in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
  if string.sub(e, -#suffix) == suffix then
    local g = string.sub(e, 1, #e - #suffix)
    return {'OK', g, math.max(had(tonumber(g)), 0)}
  end
end

local g = redis.call('LPOP', KEYS[3])
local skip = 0
if g then
  skip = math.max(had(tonumber(g)), 0)
else
  local nxt = tonumber(m[3])
  local limit = tonumber(m[4]) + tonumber(m[5])
  while true do
    if nxt >= limit then
      redis.call('HSET', KEYS[1], 'next', nxt)
      return {'WAIT'}
    end
    skip = had(nxt)
    if skip >= 0 then break end
    nxt = nxt + 1  -- the trainer has all of this shard: never build it
  end
  g = tostring(nxt)
  redis.call('HSET', KEYS[1], 'next', nxt + 1)
end
redis.call('RPUSH', KEYS[4], g .. suffix)
return {'OK', g, skip}
