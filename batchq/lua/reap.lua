-- reap.lua: hand the leases of dead (or leaving) producers back to the work list.
-- KEYS[1] incarnation  KEYS[2] producers  KEYS[3] work  KEYS[4] stats
-- KEYS[5..] lease lists, one per producer in ARGV[3..]
-- ARGV[1] incarnation  ARGV[2] 'dead' (only if the heartbeat deadline has passed) or
--         'leave' (unconditionally: the producer is stopping)
-- ARGV[3..] producer ids
-- Returns {'OK', producers reaped, shards returned} or {'STATE_LOST'}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'STATE_LOST'} end
local reaped, returned = 0, 0
for i = 3, #ARGV do
  local p = ARGV[i]
  local lease = KEYS[i + 2]
  local deadline = redis.call('ZSCORE', KEYS[2], p)
  if ARGV[2] == 'leave' or (deadline and tonumber(deadline) < now) then
    -- Back to the front, in the order they were held, so the oldest is redone first.
    local held = redis.call('LRANGE', lease, 0, -1)
    for j = #held, 1, -1 do
      local g = string.match(held[j], '^(%d+):')
      if g then
        redis.call('LPUSH', KEYS[3], g)
        returned = returned + 1
      end
    end
    redis.call('DEL', lease)
    redis.call('ZREM', KEYS[2], p)
    reaped = reaped + 1
  end
end
if returned > 0 then redis.call('HINCRBY', KEYS[4], 'redone_shards', returned) end
return {'OK', reaped, returned}
