-- release.lua: a trainer of a run read by several groups is done with frames stored by
-- reference (its GETs travel before this call in the same round trip: Redis runs commands
-- in order). Each frame's count of readers left (refs[frame key], set by push.lua; no
-- field: one reader) drops by one; the last deletes it.
-- Returns {'OK', frames deleted}
local refs_key = KEYS[1]         -- HASH   frame key -> readers that have still to read it
-- KEYS[2..]: the frame keys read
local frames = tonumber(ARGV[1])  -- how many frame keys follow (a check of the call)
local first_frame = 2

if #KEYS - first_frame + 1 ~= frames then
  return redis.error_reply('release.lua: expected ' .. frames .. ' frame keys')
end
local deleted = 0
for i = first_frame, #KEYS do
  local left = redis.call('HINCRBY', refs_key, KEYS[i], -1)
  if left <= 0 then
    redis.call('HDEL', refs_key, KEYS[i])
    deleted = deleted + redis.call('DEL', KEYS[i])
  end
end
return {'OK', deleted}
