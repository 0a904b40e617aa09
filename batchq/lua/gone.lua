-- gone.lua: hand back the leases of producers whose Redis connections are all closed
-- (a killed process), without waiting for their heartbeat deadline.
-- KEYS[1] incarnation  KEYS[2] producers  KEYS[3] work  KEYS[4] stats
-- KEYS[5] clients (HASH: '<producer>' and '<producer>:hb' -> CLIENT ID of its connections)
-- KEYS[6..] lease lists, one per producer in the ARGV pairs
-- ARGV[1] incarnation
-- ARGV[2..] pairs: producer id, the ids the caller found closed ('<main>,<heartbeat>')
-- A producer is reaped only if it still records exactly those ids (it did not reconnect
-- since the caller listed the connections) and is still registered.
-- Returns {'OK', producers reaped, shards returned} or {'STATE_LOST'}
local incarnation = ARGV[1]
if redis.call('GET', KEYS[1]) ~= incarnation then return {'STATE_LOST'} end
local reaped, returned = 0, 0
for i = 2, #ARGV - 1, 2 do
  local p, expected = ARGV[i], ARGV[i + 1]
  local lease = KEYS[6 + (i - 2) / 2]
  local ids = (redis.call('HGET', KEYS[5], p) or '') .. ',' ..
    (redis.call('HGET', KEYS[5], p .. ':hb') or '')
  if ids == expected and redis.call('ZSCORE', KEYS[2], p) then
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
    redis.call('HDEL', KEYS[5], p, p .. ':hb')
    reaped = reaped + 1
  end
end
if returned > 0 then redis.call('HINCRBY', KEYS[4], 'redone_shards', returned) end
if reaped > 0 then redis.call('HINCRBY', KEYS[4], 'reaped_closed', reaped) end
return {'OK', reaped, returned}
