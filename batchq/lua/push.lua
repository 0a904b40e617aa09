-- push.lua: push one frame below the hwm (the capped push).
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] data  KEYS[4] stats  KEYS[5] producers
-- KEYS[6] lease (this producer's)
-- KEYS[7] pstats (per-producer counters)
-- KEYS[8] (only for a frame stored by reference) the frame's own key
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] producer id
-- ARGV[4] lease entry '<g>:<token>' the frame belongs to
-- ARGV[5] list element: the frame itself, or a reference to KEYS[8]
-- ARGV[6] 1 if this is the shard's last frame (the lease is released), else 0
-- ARGV[7] heartbeat ttl (ms)  ARGV[8] frame bytes  ARGV[9] ms spent blocked at the hwm
-- ARGV[10] ms the pipeline took to build this batch
-- Returns {'OK', depth} or {'FULL', depth}, {'GONE'} (the referenced frame expired:
-- store it again), {'LEASE_LOST'}, {'REAPED'}, {'STATE_LOST'}, {'RUN_CHANGED'},
-- {'FINISHED'}, {'WRONG_TYPE', key, type} (a foreign writer replaced the data list: wait)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Every key's type first: a foreign type found half-way would leave a frame pushed and
-- its lease held (a script's writes are not rolled back).
local want = {'hash', 'string', 'list', 'hash', 'zset', 'list', 'hash'}
for i = 1, 7 do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= want[i] and kind ~= 'none' then return {'WRONG_TYPE', KEYS[i], kind} end
end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
local m = redis.call('HMGET', KEYS[1], 'run', 'finished', 'hwm')
if m[1] ~= ARGV[2] then return {'RUN_CHANGED'} end
if m[2] == '1' then return {'FINISHED'} end
if not redis.call('ZSCORE', KEYS[5], ARGV[3]) then return {'REAPED'} end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[7]), ARGV[3])
if not redis.call('LPOS', KEYS[6], ARGV[4]) then return {'LEASE_LOST'} end
local blocked = tonumber(ARGV[9])
if blocked > 0 then
  redis.call('HINCRBY', KEYS[4], 'producer_blocked_ms', blocked)
  redis.call('HINCRBY', KEYS[7], ARGV[3] .. ':blocked_ms', blocked)
end
-- The stored frame expired, or a foreign writer put another type there: store it again.
if #KEYS == 8 and redis.call('TYPE', KEYS[8]).ok ~= 'string' then return {'GONE'} end

local depth = redis.call('LLEN', KEYS[3])
if depth >= tonumber(m[3]) then return {'FULL', depth} end
redis.call('LPUSH', KEYS[3], ARGV[5])
if #KEYS == 8 then redis.call('PERSIST', KEYS[8]) end
redis.call('HINCRBY', KEYS[4], 'pushed', 1)
redis.call('HINCRBY', KEYS[4], 'pushed_bytes', tonumber(ARGV[8]))
redis.call('HINCRBY', KEYS[7], ARGV[3] .. ':batches', 1)
redis.call('HINCRBY', KEYS[7], ARGV[3] .. ':bytes', tonumber(ARGV[8]))
redis.call('HINCRBY', KEYS[7], ARGV[3] .. ':produce_ms', tonumber(ARGV[10]))
if ARGV[6] == '1' then
  redis.call('LREM', KEYS[6], 1, ARGV[4])
  redis.call('HINCRBY', KEYS[4], 'shards_done', 1)
end
return {'OK', depth + 1}
