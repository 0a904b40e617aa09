-- fail.lua: a producer's pipeline raised on a shard: retry it elsewhere, or give up.
-- Returns {'RETRY', attempts} (the lease went back to the front of the work list),
--         {'GIVE_UP', attempts} (push the ERROR frame, which ends the shard),
--         {'LEASE_LOST'}, {'STATE_LOST'}, {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back
local lease_key = KEYS[4]        -- LIST   this producer's leases
local failures_key = KEYS[5]     -- HASH   g -> attempts that raised
local stats_key = KEYS[6]        -- HASH   queue counters
local incarnation = ARGV[1]
local run = ARGV[2]
local entry = ARGV[3]            -- lease entry '<g>:<run>:<token>'
local max_attempts = tonumber(ARGV[4])  -- before the shard is reported to the trainer

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
if redis.call('HGET', meta_key, 'run') ~= run then return {'RUN_CHANGED'} end
if not redis.call('LPOS', lease_key, entry) then return {'LEASE_LOST'} end
local attempts = redis.call('HINCRBY', failures_key, entry_slot(entry), 1)
redis.call('HINCRBY', stats_key, 'failed_attempts', 1)
if attempts >= max_attempts then return {'GIVE_UP', attempts} end
redis.call('LREM', lease_key, 1, entry)
redis.call('LPUSH', work_key, entry_spec(entry))  -- for the same groups
redis.call('HINCRBY', stats_key, 'redone_shards', 1)
return {'RETRY', attempts}
