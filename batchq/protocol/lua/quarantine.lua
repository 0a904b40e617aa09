-- quarantine.lua: a producer records an example its dataset could not read, which it
-- replaced by a substitute (on_sample_error='quarantine', producer/quarantine.py). The
-- quarantine hash is the run's: a record of an earlier run starts it afresh. An example
-- is recorded once whoever meets it (every producer, every rebuild); at most `cap`
-- records are kept, the count goes on (exact while the records fit).
-- Returns {'OK', examples quarantined in the run} or {'STATE_LOST'}, {'RUN_CHANGED'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local quarantine_key = KEYS[3]   -- HASH   'run', 'count', 'kept', 'i:<index>' -> record
local stats_key = KEYS[4]        -- HASH   queue counters
local incarnation = ARGV[1]
local run = ARGV[2]
local index = ARGV[3]            -- the example's index in the dataset
local record = ARGV[4]           -- its record (JSON, batchq/protocol/layout.py)
local cap = tonumber(ARGV[5])    -- the most records kept

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
if redis.call('HGET', meta_key, 'run') ~= run then return {'RUN_CHANGED'} end
if redis.call('HGET', quarantine_key, 'run') ~= run then
  redis.call('DEL', quarantine_key)  -- an earlier run's
  redis.call('HSET', quarantine_key, 'run', run, 'count', 0, 'kept', 0)
end
local field = 'i:' .. index
if redis.call('HGET', quarantine_key, field) then  -- known (a rebuild, another producer)
  return {'OK', tonumber(redis.call('HGET', quarantine_key, 'count'))}
end
local count = redis.call('HINCRBY', quarantine_key, 'count', 1)
redis.call('HINCRBY', stats_key, 'quarantined', 1)
if tonumber(redis.call('HGET', quarantine_key, 'kept')) < cap then
  redis.call('HSET', quarantine_key, field, record)
  redis.call('HINCRBY', quarantine_key, 'kept', 1)
end
return {'OK', count}
