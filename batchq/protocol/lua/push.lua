-- push.lua: the capped push of one frame into the list of every group it is for (one in a
-- run of one group: the fast path). A full list of a group with max_lag set never holds
-- a push: it is left out, its shard back to work for that group alone (design.md "Several
-- groups"). A frame stored by reference in k > 1 lists gets refs[frame key] = k.
-- Returns {'OK', depth, dropped}, {'FULL', depth[, slot]}, {'DROPPED', mask} (no list
--   took it), {'GONE'} (the referenced frame expired), {'REROUTE'} (a descriptor for a
--   host a target rank's trainer has not published), {'WRONG_TYPE', key, type},
--   {'LEASE_LOST'}, {'REAPED'}, {'STATE_LOST'}, {'RUN_CHANGED'}, {'FINISHED'}: PushReply
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local stats_key = KEYS[3]        -- HASH   queue counters
local producers_key = KEYS[4]    -- ZSET   producer -> heartbeat deadline (ms)
local lease_key = KEYS[5]        -- LIST   this producer's leases
local pstats_key = KEYS[6]       -- HASH   per-producer counters
local refs_key = KEYS[7]         -- HASH   frame key -> readers that have still to read it
local work_key = KEYS[8]         -- LIST   shards handed back
-- KEYS[9..]: per target group slot, ascending: its data list (the rank's) and its stats
-- hash; then, for a frame stored by reference, the frame's key
local incarnation = ARGV[1]
local run = ARGV[2]
local producer = ARGV[3]
local entry = ARGV[4]            -- lease entry '<g>[/<mask>]:<run>:<token>' the frame belongs to
local element = ARGV[5]          -- the frame itself, a reference to it, or a descriptor
local last = ARGV[6]             -- '1' if the shard's last frame (the lease is released)
local heartbeat_ttl_ms = tonumber(ARGV[7])
local frame_bytes = tonumber(ARGV[8])
local blocked_ms = tonumber(ARGV[9])  -- spent blocked at the hwm since the last try
local produce_ms = tonumber(ARGV[10]) -- the pipeline took to build this batch
local shm_host = ARGV[11]        -- the host a descriptor's segment is on; '' for a frame
local rank = ARGV[12]            -- the rank the shard is for
local world = tonumber(ARGV[13])  -- the run's ranks
local targets = tonumber(ARGV[14])  -- the group slots to push to (a mask; 1: slot 0)
local groups = tonumber(ARGV[15])  -- the run's group slots as the caller knows them (0: one)
local by_ref = ARGV[16]          -- '1': the last key is the frame's, stored by reference
local first_target = 9

local now = server_now_ms()
-- Every key's type first (wrong_type: a foreign one found half-way would leave a frame
-- half pushed).
local frame_key = by_ref == '1' and KEYS[#KEYS] or nil
local typed = {
  {meta_key, 'hash'}, {incarnation_key, 'string'}, {stats_key, 'hash'},
  {producers_key, 'zset'}, {lease_key, 'list'}, {pstats_key, 'hash'},
  {KEYS[first_target], 'list'},
}
local slots = {0}  -- a run of one group: slot 0's list, its stats the queue's
if groups > 0 then
  typed[#typed + 1] = {refs_key, 'hash'}  -- written in a run of several groups only
  typed[#typed + 1] = {work_key, 'list'}
  slots = {}
  for bit = 0, 31 do
    if mask_has(targets, bit) then slots[#slots + 1] = bit end
  end
  for j = 1, #slots do
    typed[#typed + 1] = {KEYS[first_target + 2 * (j - 1)], 'list'}
    typed[#typed + 1] = {KEYS[first_target + 2 * (j - 1) + 1], 'hash'}
  end
end
if #KEYS ~= first_target - 1 + 2 * #slots + (frame_key and 1 or 0) then
  return redis.error_reply('push.lua: KEYS do not match the targets')
end
local refused = wrong_type(typed)
if refused then return refused end
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'finished', 'hwm', 'groups',
  'shm_host' .. reader_sfx(0, rank, world))
refused = run_refused(m, run) or heartbeat(producers_key, producer, now + heartbeat_ttl_ms)
if refused then return refused end
if not redis.call('LPOS', lease_key, entry) then return {'LEASE_LOST'} end
-- The time blocked at the hwm since the last try, counted for the queue and the producer.
if blocked_ms > 0 then
  redis.call('HINCRBY', stats_key, 'producer_blocked_ms', blocked_ms)
  redis.call('HINCRBY', pstats_key, producer .. ':blocked_ms', blocked_ms)
end

local n, hwm = tonumber(m[4] or '1'), tonumber(m[3])
if groups == 0 then
  -- The fast path: a run of one group, one list (the rank's), its trainer's host.
  local data_key = KEYS[first_target]
  if shm_host ~= '' and m[5] ~= shm_host then return {'REROUTE'} end
  if frame_key and redis.call('TYPE', frame_key).ok ~= 'string' then return {'GONE'} end
  local depth = redis.call('LLEN', data_key)
  if depth >= hwm then return {'FULL', depth} end
  redis.call('LPUSH', data_key, element)
  if frame_key then redis.call('PERSIST', frame_key) end
  count_push(stats_key, pstats_key, producer, frame_bytes, produce_ms)
  if last == '1' then shard_pushed(stats_key, lease_key, entry) end
  return {'OK', depth + 1, 0}
end
-- The lists that take it: a group that finished takes nothing; a descriptor goes only
-- into lists of trainers on its host.
local go = {}
for j, i in ipairs(slots) do
  local sfx = reader_sfx(i, rank, world)
  local t = {slot = i, data = KEYS[first_target + 2 * (j - 1)],
    stats = KEYS[first_target + 2 * (j - 1) + 1],
    f = redis.call('HMGET', meta_key, 'done' .. sfx, 'shm_host' .. sfx,
      'max_lag' .. reader_sfx(i, 0, 1))}
  if t.f[1] ~= '1' then
    if shm_host ~= '' and t.f[2] ~= shm_host then return {'REROUTE'} end
    go[#go + 1] = t
  end
end
-- The stored frame expired, or a foreign writer put another type there: store it again.
if frame_key and redis.call('TYPE', frame_key).ok ~= 'string' then return {'GONE'} end

local into, dropped, depth = {}, 0, nil
for _, t in ipairs(go) do
  local len = redis.call('LLEN', t.data)
  if len >= hwm then
    if not t.f[3] then return {'FULL', len, t.slot} end  -- the others wait for this group
    dropped = dropped + 2 ^ t.slot
    redis.call('HINCRBY', t.stats, 'detached_drops', 1)
  else
    into[#into + 1] = t
    if depth == nil or len + 1 < depth then depth = len + 1 end
  end
end
if dropped > 0 then redis.call('RPUSH', work_key, work_spec(entry_slot(entry), dropped)) end
if #into == 0 then
  -- Every list it was for is gone (finished) or left behind: not ours any more.
  redis.call('LREM', lease_key, 1, entry)
  return {'DROPPED', dropped}
end

for _, t in ipairs(into) do
  redis.call('LPUSH', t.data, element)
  if t.slot > 0 then  -- slot 0's counters are the queue's own (below)
    redis.call('HINCRBY', t.stats, 'pushed', 1)
    redis.call('HINCRBY', t.stats, 'pushed_bytes', frame_bytes)
  end
  -- Built for this group alone in a run of several (detached, joined late, or the others
  -- finished before it).
  if #into == 1 and n > 1 then redis.call('HINCRBY', t.stats, 'solo_pushed', 1) end
end
if frame_key then
  redis.call('PERSIST', frame_key)
  if #into > 1 then redis.call('HSET', refs_key, frame_key, #into) end
end
count_push(stats_key, pstats_key, producer, frame_bytes, produce_ms)
if last == '1' then shard_pushed(stats_key, lease_key, entry) end
return {'OK', depth, dropped}
