-- fail.lua: a producer's pipeline raised on a shard: retry it elsewhere, or give up.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] work  KEYS[4] lease (this producer's)
-- KEYS[5] failures (HASH g -> attempts that raised)  KEYS[6] stats
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] lease entry '<g>:<token>'  ARGV[4] g
-- ARGV[5] most attempts before the shard is reported to the trainer
-- Returns {'RETRY', attempts} (the lease went back to the front of the work list),
--         {'GIVE_UP', attempts} (push the ERROR frame, which ends the shard),
--         {'LEASE_LOST'}, {'STATE_LOST'}, {'RUN_CHANGED'}
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
if redis.call('HGET', KEYS[1], 'run') ~= ARGV[2] then return {'RUN_CHANGED'} end
if not redis.call('LPOS', KEYS[4], ARGV[3]) then return {'LEASE_LOST'} end
local attempts = redis.call('HINCRBY', KEYS[5], ARGV[4], 1)
redis.call('HINCRBY', KEYS[6], 'failed_attempts', 1)
if attempts >= tonumber(ARGV[5]) then return {'GIVE_UP', attempts} end
redis.call('LREM', KEYS[4], 1, ARGV[3])
redis.call('LPUSH', KEYS[3], ARGV[4])
redis.call('HINCRBY', KEYS[6], 'redone_shards', 1)
return {'RETRY', attempts}
