-- gone.lua: hand back the leases of producers whose Redis connections are all closed (a
-- killed process) without waiting for their heartbeat deadline: of those still registered
-- that record exactly those ids (not reconnected since the caller listed them), to
-- reap.lua's run (hand_back_leases).
-- Returns {'OK', producers reaped, shards returned} or {'STATE_LOST'}
local incarnation_key = KEYS[1]  -- STRING
local producers_key = KEYS[2]    -- ZSET   producer -> heartbeat deadline (ms)
local work_key = KEYS[3]         -- LIST   shards handed back
local stats_key = KEYS[4]        -- HASH   queue counters
local clients_key = KEYS[5]      -- HASH   '<producer>', '<producer>:hb' -> CLIENT ID
local meta_key = KEYS[6]         -- HASH   the run's meta (which run the leases must be of)
local failures_key = KEYS[7]     -- HASH   g -> failed attempts (a death counts one)
-- KEYS[8..]: the lease lists, one per producer of the ARGV pairs
local incarnation = ARGV[1]
-- ARGV[2..]: pairs of producer id, the ids the caller found closed ('<main>,<heartbeat>')
local first_lease, first_pair = 8, 2

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local run = live_run(meta_key)
local reaped, returned = 0, 0
for i = first_pair, #ARGV - 1, 2 do
  local p, expected = ARGV[i], ARGV[i + 1]
  local lease = KEYS[first_lease + (i - first_pair) / 2]
  local ids = (redis.call('HGET', clients_key, p) or '') .. ',' ..
    (redis.call('HGET', clients_key, p .. ':hb') or '')
  if ids == expected and redis.call('ZSCORE', producers_key, p) then
    returned = returned + hand_back_leases(lease, work_key, run, failures_key, stats_key)
    redis.call('ZREM', producers_key, p)
    redis.call('HDEL', clients_key, p, p .. ':hb')
    reaped = reaped + 1
  end
end
if reaped > 0 then redis.call('HINCRBY', stats_key, 'reaped_closed', reaped) end
return {'OK', reaped, returned}
