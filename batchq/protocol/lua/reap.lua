-- reap.lua: hand the leases of dead (or leaving) producers back to the work list.
-- Returns {'OK', producers reaped, shards returned} or {'STATE_LOST'}
local incarnation_key = KEYS[1]  -- STRING
local producers_key = KEYS[2]    -- ZSET   producer -> heartbeat deadline (ms)
local work_key = KEYS[3]         -- LIST   shards handed back
local stats_key = KEYS[4]        -- HASH   queue counters
-- KEYS[5..]: the lease lists, one per producer of ARGV[3..]
local incarnation = ARGV[1]
local why = ARGV[2]              -- 'dead' (only if the heartbeat deadline has passed) or
                                 -- 'leave' (unconditionally: the producer is stopping)
-- ARGV[3..]: producer ids
local first_lease, first_producer = 5, 3

local now = server_now_ms()
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local reaped, returned = 0, 0
for i = first_producer, #ARGV do
  local p = ARGV[i]
  local lease = KEYS[first_lease + i - first_producer]
  local deadline = redis.call('ZSCORE', producers_key, p)
  if why == 'leave' or (deadline and tonumber(deadline) < now) then
    returned = returned + hand_back_leases(lease, work_key)
    redis.call('ZREM', producers_key, p)
    reaped = reaped + 1
  end
end
if returned > 0 then redis.call('HINCRBY', stats_key, 'redone_shards', returned) end
return {'OK', reaped, returned}
