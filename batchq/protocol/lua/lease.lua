-- lease.lua: a producer leases its next shard, idempotently.
-- Returns {'OK', g, skip, slots, world[, shard], stamp} (g = global slot number: epoch *
--         slots + slot, see batchq/protocol/ranks.py; world 1: {'OK', g, skip, stamp},
--         slots = S; skip = batches of it the trainer already has: build it, push only
--         from batch `skip` on; stamp = meta 'params', the params log's '<run>:<version>',
--         '' for none: the producer reads the log again when it changed)
--      or {'WAIT'} (the look-ahead window is full), {'BUSY'} (prefetch declined),
--         {'GROUPS', n} (the run is read by n group slots: glease.lua), {'STATE_LOST'},
--         {'RUN_CHANGED'},
--         {'FINISHED'}, {'REAPED'} (this producer was declared dead: join again)
-- A data-parallel run mints for the rank furthest behind (fewest minted shards above
-- its floor) among those with room in their window and in their data list; a shard
-- handed back is taken from the work list only for a rank whose list has room, so a
-- dead rank's full list never holds the producers.
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back
local lease_key = KEYS[4]        -- LIST   this producer's leases
local producers_key = KEYS[5]    -- ZSET   producer -> heartbeat deadline (ms)
local ledger_key = KEYS[6]       -- HASH   what a resumed trainer already has
-- KEYS[7..]: (data-parallel runs) every rank's data list, rank 0 first, then the remap
-- hash (slot -> shard of the epoch meta remap_epoch)
local incarnation = ARGV[1]
local run = ARGV[2]
local producer = ARGV[3]
local token = ARGV[4]            -- unique per lease request: a retried request with the
                                 -- same token gets the same shard
local heartbeat_ttl_ms = tonumber(ARGV[5])
local prefetch = tonumber(ARGV[6])  -- k > 0 when sent right behind a shard's last push:
                                 -- lease only if that push went through (its entry `after`
                                 -- left the lease list) and the producer then holds fewer
                                 -- than k leases (k = 2: the one it builds next while this
                                 -- reply travels), so that a producer blocked at the hwm
                                 -- is never granted a further shard another could build
local after = ARGV[7]            -- the lease entry of the push this rides behind
local first_rank_data = 7

local now = server_now_ms()
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'finished', 'next', 'floor', 'window', 'shards',
  'world', 'even', 'hwm', 'remap_epoch', 'params')
local refused = run_refused(m, run)
if refused then return refused end
-- A run read by several groups is glease.lua's (batchq/protocol/groups.py).
local grouped = redis.call('HGET', meta_key, 'groups')
if grouped then return {'GROUPS', tonumber(grouped)} end
refused = heartbeat(producers_key, producer, now + heartbeat_ttl_ms)
if refused then return refused end

local world = tonumber(m[7] or '1')
if world > 1 and #KEYS ~= first_rank_data + world then return {'RUN_CHANGED'} end  -- a stale view
-- The ledger names slots as '<epoch>:<slot>': 'd' when done, else batches already had.
local S = tonumber(m[6])
if world > 1 then
  if m[8] == 'drop' then S = world * math.floor(S / world)
  else S = world * math.ceil(S / world) end
end
local stamp = m[11] or ''  -- the params log's version rides with every lease
local function granted(g, skip)
  if world == 1 then return {'OK', g, skip, stamp} end
  -- A slot of a remapped epoch names the shard it builds (a resume with other ranks).
  if m[10] and math.floor(tonumber(g) / S) == tonumber(m[10]) then
    local shard = redis.call('HGET', KEYS[first_rank_data + world], tostring(tonumber(g) % S))
    if shard then return {'OK', g, skip, S, world, shard, stamp} end
  end
  return {'OK', g, skip, S, world, stamp}
end
local function had(g)
  local v = redis.call('HGET', ledger_key, math.floor(g / S) .. ':' .. (g % S))
  if v == 'd' then return -1 end
  return tonumber(v or '0')
end

-- A retried request first (its first reply was lost): the same shard, even if the
-- producer now holds k leases with it.
local again = retried_lease(lease_key, run, token)
if again then return granted(again, math.max(had(tonumber(again)), 0)) end
if prefetch_declined(lease_key, prefetch, after) then return {'BUSY'} end

local suffix = ':' .. run .. ':' .. token  -- the lease entry's tail (layout.py)

if world > 1 then
  local P = S / world
  local W, hwm = tonumber(m[5]), tonumber(m[9])
  local function room(r)
    return redis.call('LLEN', KEYS[first_rank_data + r]) < hwm and
      redis.call('HGET', meta_key, 'done:' .. r) ~= '1'
  end
  local g
  for _, e in ipairs(redis.call('LRANGE', work_key, 0, 99)) do
    if room((tonumber(e) % S) % world) then
      g = e
      redis.call('LREM', work_key, 1, e)
      break
    end
  end
  local skip = 0
  if g then
    skip = math.max(had(tonumber(g)), 0)
  else
    local best, best_ahead
    for r = 0, world - 1 do
      local f = redis.call('HMGET', meta_key, 'next:' .. r, 'floor:' .. r)
      local nxt, floor = tonumber(f[1] or '0'), tonumber(f[2] or '0')
      if nxt < floor + W and room(r) and (best == nil or nxt - floor < best_ahead) then
        best, best_ahead = r, nxt - floor
      end
    end
    if best == nil then return {'WAIT'} end
    local field = 'next:' .. best
    local nxt = tonumber(redis.call('HGET', meta_key, field) or '0')
    local limit = tonumber(redis.call('HGET', meta_key, 'floor:' .. best) or '0') + W
    while true do
      if nxt >= limit then
        redis.call('HSET', meta_key, field, nxt)
        return {'WAIT'}
      end
      g = math.floor(nxt / P) * S + (nxt % P) * world + best
      skip = had(g)
      if skip >= 0 then break end
      nxt = nxt + 1  -- the rank has all of this slot: never build it
    end
    redis.call('HSET', meta_key, field, nxt + 1)
    g = tostring(g)
  end
  redis.call('RPUSH', lease_key, g .. suffix)
  return granted(g, skip)
end

local g = redis.call('LPOP', work_key)
local skip = 0
if g then
  skip = math.max(had(tonumber(g)), 0)
else
  local nxt = tonumber(m[3])
  local limit = tonumber(m[4]) + tonumber(m[5])
  while true do
    if nxt >= limit then
      redis.call('HSET', meta_key, 'next', nxt)
      return {'WAIT'}
    end
    skip = had(nxt)
    if skip >= 0 then break end
    nxt = nxt + 1  -- the trainer has all of this shard: never build it
  end
  g = tostring(nxt)
  redis.call('HSET', meta_key, 'next', nxt + 1)
end
redis.call('RPUSH', lease_key, g .. suffix)
return granted(g, skip)
