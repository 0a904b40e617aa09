-- handback.lua: a producer gives a leased shard back untouched (its rank's data list
-- stayed full: a data-parallel rank that stopped popping must not hold the producers).
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] work  KEYS[4] lease (this producer's)
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] lease entry '<g>:<token>'  ARGV[4] g
-- Returns {'OK'} (the shard is at the back of the work list: leased again once its
-- rank has room), {'LEASE_LOST'}, {'STATE_LOST'}, {'RUN_CHANGED'}
local incarnation, run, entry, g = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('GET', KEYS[2]) ~= incarnation then return {'STATE_LOST'} end
if redis.call('HGET', KEYS[1], 'run') ~= run then return {'RUN_CHANGED'} end
if redis.call('LREM', KEYS[4], 1, entry) == 0 then return {'LEASE_LOST'} end
redis.call('RPUSH', KEYS[3], g)
return {'OK'}
