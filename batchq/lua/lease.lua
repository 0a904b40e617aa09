-- lease.lua: a producer leases its next shard, idempotently.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] work  KEYS[4] lease (this producer's)
-- KEYS[5] producers  KEYS[6] ledger (what a resumed trainer already has)
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] producer id  ARGV[4] token (unique per
--         lease request: a retried request with the same token gets the same shard)
-- ARGV[5] heartbeat ttl (ms)
-- KEYS[7..6+world] (data-parallel runs) every rank's data list, rank 0 first, then
--         KEYS[7+world] the remap hash (slot -> shard of the epoch meta remap_epoch)
-- ARGV[6] '1' when sent right behind a shard's last push (prefetch): lease only if that
--         push went through (the lease list is empty), so that a producer blocked at the
--         hwm never sits on a second shard another producer could build
-- Returns {'OK', g, skip, slots, world[, shard]} (g = global slot number: epoch * slots + slot,
--         see batchq/ranks.py; world 1: {'OK', g, skip}, slots = S; skip = batches of
--         it the trainer
--         already has: build it, push only from batch `skip` on)
--      or {'WAIT'} (the look-ahead window is full), {'BUSY'} (prefetch declined),
--         {'STATE_LOST'}, {'RUN_CHANGED'},
--         {'FINISHED'}, {'REAPED'} (this producer was declared dead: join again)
-- A data-parallel run mints for the rank furthest behind (fewest minted shards above
-- its floor) among those with room in their window and in their data list; a shard
-- handed back is taken from the work list only for a rank whose list has room, so a
-- dead rank's full list never holds the producers.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
local m = redis.call('HMGET', KEYS[1], 'run', 'finished', 'next', 'floor', 'window', 'shards',
  'world', 'even', 'hwm', 'remap_epoch')
if m[1] ~= ARGV[2] then return {'RUN_CHANGED'} end
if m[2] == '1' then return {'FINISHED'} end
if not redis.call('ZSCORE', KEYS[5], ARGV[3]) then return {'REAPED'} end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[5]), ARGV[3])

local world = tonumber(m[7] or '1')
if world > 1 and #KEYS ~= 7 + world then return {'RUN_CHANGED'} end  -- a stale view
-- The ledger names slots as '<epoch>:<slot>': 'd' when done, else batches already had.
local S = tonumber(m[6])
if world > 1 then
  if m[8] == 'drop' then S = world * math.floor(S / world)
  else S = world * math.ceil(S / world) end
end
local function granted(g, skip)
  if world == 1 then return {'OK', g, skip} end
  -- A slot of a remapped epoch names the shard it builds (a resume with other ranks).
  if m[10] and math.floor(tonumber(g) / S) == tonumber(m[10]) then
    local shard = redis.call('HGET', KEYS[7 + world], tostring(tonumber(g) % S))
    if shard then return {'OK', g, skip, S, world, shard} end
  end
  return {'OK', g, skip, S, world}
end
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
    return granted(g, math.max(had(tonumber(g)), 0))
  end
end

if world > 1 then
  local P = S / world
  local W, hwm = tonumber(m[5]), tonumber(m[9])
  local function room(r)
    return redis.call('LLEN', KEYS[7 + r]) < hwm and
      redis.call('HGET', KEYS[1], 'done:' .. r) ~= '1'
  end
  local g
  for _, e in ipairs(redis.call('LRANGE', KEYS[3], 0, 99)) do
    if room((tonumber(e) % S) % world) then
      g = e
      redis.call('LREM', KEYS[3], 1, e)
      break
    end
  end
  local skip = 0
  if g then
    skip = math.max(had(tonumber(g)), 0)
  else
    local best, best_ahead
    for r = 0, world - 1 do
      local f = redis.call('HMGET', KEYS[1], 'next:' .. r, 'floor:' .. r)
      local nxt, floor = tonumber(f[1] or '0'), tonumber(f[2] or '0')
      if nxt < floor + W and room(r) and (best == nil or nxt - floor < best_ahead) then
        best, best_ahead = r, nxt - floor
      end
    end
    if best == nil then return {'WAIT'} end
    local field = 'next:' .. best
    local nxt = tonumber(redis.call('HGET', KEYS[1], field) or '0')
    local limit = tonumber(redis.call('HGET', KEYS[1], 'floor:' .. best) or '0') + W
    while true do
      if nxt >= limit then
        redis.call('HSET', KEYS[1], field, nxt)
        return {'WAIT'}
      end
      g = math.floor(nxt / P) * S + (nxt % P) * world + best
      skip = had(g)
      if skip >= 0 then break end
      nxt = nxt + 1  -- the rank has all of this slot: never build it
    end
    redis.call('HSET', KEYS[1], field, nxt + 1)
    g = tostring(g)
  end
  redis.call('RPUSH', KEYS[4], g .. suffix)
  return granted(g, skip)
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
return granted(g, skip)
