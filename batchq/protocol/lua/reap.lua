-- reap.lua: hand the leases of dead (or leaving) producers back to the work list, those
-- of the queue's current, unfinished run only (hand_back_leases: a list that outlived its
-- run is dropped). Their recorded connections go too (one alive records them again when
-- it joins again).
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
local why = ARGV[2]              -- 'dead' (past its heartbeat deadline) | 'leave' (stopping)
-- ARGV[3..]: producer ids
local first_lease, first_producer = 8, 3

local now = server_now_ms()
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local run = live_run(meta_key)
local reaped, returned = 0, 0
for i = first_producer, #ARGV do
  local p = ARGV[i]
  local lease = KEYS[first_lease + i - first_producer]
  local deadline = redis.call('ZSCORE', producers_key, p)
  if why == 'leave' or (deadline and tonumber(deadline) < now) then
    -- A dead producer's shards count a failed attempt each; a leaving one's do not.
    returned = returned + hand_back_leases(lease, work_key, run,
      why == 'dead' and failures_key or nil, stats_key)
    redis.call('ZREM', producers_key, p)
    redis.call('HDEL', clients_key, p, p .. ':hb')
    reaped = reaped + 1
  end
end
return {'OK', reaped, returned}
