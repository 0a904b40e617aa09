-- handback.lua: a producer gives a leased shard back untouched (its rank's data list
-- stayed full: a data-parallel rank that stopped popping must not hold the producers).
-- Returns {'OK'} (the shard is at the back of the work list: leased again once its
-- rank has room), {'LEASE_LOST'}, {'STATE_LOST'}, {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back
local lease_key = KEYS[4]        -- LIST   this producer's leases
local incarnation = ARGV[1]
local run = ARGV[2]
local entry = ARGV[3]            -- lease entry '<g>:<run>:<token>'

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
if redis.call('HGET', meta_key, 'run') ~= run then return {'RUN_CHANGED'} end
if redis.call('LREM', lease_key, 1, entry) == 0 then return {'LEASE_LOST'} end
redis.call('RPUSH', work_key, entry_spec(entry))  -- for the same groups
return {'OK'}
