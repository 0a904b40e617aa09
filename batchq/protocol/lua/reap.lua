-- reap.lua: hand the leases of producers back to the work list, those of the queue's
-- current, unfinished run only (hand_back_leases: a list that outlived its run is
-- dropped), and forget their recorded connections (one alive records them again when it
-- joins again). `why`: 'dead' (past its heartbeat deadline), 'leave' (stopping), or
-- 'closed' (its connections closed: a killed process), reaped without waiting for its
-- deadline while still registered with exactly the ids the caller found closed (none
-- reconnected since the caller's CLIENT LIST).
-- Returns {'OK', producers reaped, shards returned} or {'STATE_LOST'}
local incarnation_key = KEYS[1]  -- STRING
local producers_key = KEYS[2]    -- ZSET   producer -> heartbeat deadline (ms)
local work_key = KEYS[3]         -- LIST   shards handed back
local stats_key = KEYS[4]        -- HASH   queue counters
local meta_key = KEYS[5]         -- HASH   the run's meta (which run the leases must be of)
local clients_key = KEYS[6]      -- HASH   '<producer>', '<producer>:hb' -> CLIENT ID
local failures_key = KEYS[7]     -- HASH   g -> failed attempts (a death counts one)
-- KEYS[8..]: the lease lists, one per producer of ARGV[3..]
local incarnation = ARGV[1]
local why = ARGV[2]              -- 'dead' | 'leave' | 'closed'
-- ARGV[3..]: producer ids ('closed': each followed by the ids the caller found closed,
-- '<main>,<heartbeat>')
local first_lease, first_producer = 8, 3

local now = server_now_ms()
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local run = live_run(meta_key)
local step = why == 'closed' and 2 or 1
local reaped, returned = 0, 0
for i = first_producer, #ARGV, step do
  local p = ARGV[i]
  local lease = KEYS[first_lease + (i - first_producer) / step]
  local deadline = redis.call('ZSCORE', producers_key, p)
  local reap = why == 'leave' or (why == 'dead' and deadline and tonumber(deadline) < now)
  if why == 'closed' then
    local ids = (redis.call('HGET', clients_key, p) or '') .. ',' ..
      (redis.call('HGET', clients_key, p .. ':hb') or '')
    reap = ids == ARGV[i + 1] and deadline
  end
  if reap then
    -- A dead or killed producer's shards count a failed attempt each; a leaving one's
    -- do not.
    returned = returned + hand_back_leases(lease, work_key, run,
      why ~= 'leave' and failures_key or nil, stats_key)
    redis.call('ZREM', producers_key, p)
    redis.call('HDEL', clients_key, p, p .. ':hb')
    reaped = reaped + 1
  end
end
if why == 'closed' and reaped > 0 then redis.call('HINCRBY', stats_key, 'reaped_closed', reaped) end
return {'OK', reaped, returned}
