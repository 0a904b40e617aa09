-- handback.lua: a producer hands a leased shard back. Untouched (max_attempts 0: its
-- rank's data list stayed full, and a data-parallel rank that stopped popping must not
-- hold the producers): to the back of the work list, leased again once the rank has room.
-- Its pipeline raised: the attempt counts, and the shard goes to the front of the work list
-- to be retried elsewhere, or after max_attempts stays leased: the producer pushes the
-- ERROR frame that ends it.
-- Returns {'OK'} (untouched), {'RETRY', attempts}, {'GIVE_UP', attempts}, {'LEASE_LOST'},
--   {'STATE_LOST'}, {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back
local lease_key = KEYS[4]        -- LIST   this producer's leases
local failures_key = KEYS[5]     -- HASH   g -> attempts that raised
local stats_key = KEYS[6]        -- HASH   queue counters
local incarnation = ARGV[1]
local run = ARGV[2]
local entry = ARGV[3]            -- lease entry '<g>[/<mask>]:<run>:<token>'
local max_attempts = tonumber(ARGV[4])  -- before the shard is reported; 0: untouched

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
if redis.call('HGET', meta_key, 'run') ~= run then return {'RUN_CHANGED'} end
if not redis.call('LPOS', lease_key, entry) then return {'LEASE_LOST'} end
if max_attempts == 0 then
  redis.call('LREM', lease_key, 1, entry)
  redis.call('RPUSH', work_key, entry_spec(entry))  -- for the same groups
  return {'OK'}
end
local attempts = redis.call('HINCRBY', failures_key, entry_slot(entry), 1)
redis.call('HINCRBY', stats_key, 'failed_attempts', 1)
if attempts >= max_attempts then return {'GIVE_UP', attempts} end
redis.call('LREM', lease_key, 1, entry)
redis.call('LPUSH', work_key, entry_spec(entry))  -- for the same groups
redis.call('HINCRBY', stats_key, 'redone_shards', 1)
return {'RETRY', attempts}
