-- join.lua: a producer joins the queue's run, creating the queue and the run if needed.
-- KEYS[1] meta          HASH   bq:{Q}:meta
-- KEYS[2] incarnation   STRING bq:{Q}:incarnation
-- KEYS[3] producers     ZSET   bq:{Q}:producers
-- KEYS[4] lease         LIST   bq:{Q}:lease:<p>  (this producer's)
-- KEYS[5] work          LIST   bq:{Q}:work
-- KEYS[6] data          LIST   bq:{Q}:data
-- KEYS[7] failures      HASH   bq:{Q}:failures
-- KEYS[8] ledger        HASH   bq:{Q}:ledger
-- ARGV[1] producer id         ARGV[2] pipeline fingerprint
-- ARGV[3] hwm                 ARGV[4] shards per epoch (S)
-- ARGV[5] window (shards)     ARGV[6] run id to use if a run must be created
-- ARGV[7] incarnation to use if the queue must be created
-- ARGV[8] heartbeat ttl (ms)  ARGV[9] protocol version
-- ARGV[10] batches per epoch (-1 if the pipeline cannot tell)
-- ARGV[11] the run this producer served before ('' if none)
-- ARGV[12] grace (ms): a run that finished less than this long ago is over for late
--          producers too (they exit); after it, a producer starts the next run
-- ARGV[13] '1': do not create a queue or a run (after Redis lost the queue's state the
--          trainer re-creates it from its ledger; producers wait for that)
-- Returns {'OK', incarnation, run, hwm, S, window, created[, world: ranks of the run's
--         data-parallel trainer, batchq/ranks.py]}
--      or {'MISMATCH', what, expected}, {'FINISHED'}, {'WAIT'} (nothing to join yet)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local inc = redis.call('GET', KEYS[2])
local run = redis.call('HGET', KEYS[1], 'run')
if ARGV[13] == '1' and not (inc and run) then return {'WAIT'} end
if not inc then
  inc = ARGV[7]
  redis.call('SET', KEYS[2], inc)
  redis.call('DEL', KEYS[1], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
  run = false
end

local created = 0
local finished_at = tonumber(redis.call('HGET', KEYS[1], 'finished_at') or '')
if finished_at and now - finished_at < tonumber(ARGV[12]) then
  return {'FINISHED'}
end
if (not run) or finished_at then
  -- No run yet, or the last one finished: this producer starts the next run.
  redis.call('DEL', KEYS[1], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
  run = ARGV[6]
  redis.call('HSET', KEYS[1], 'version', ARGV[9], 'run', run, 'next', 0, 'floor', 0)
  created = 1
end

-- A trainer resuming from a checkpoint may have set the fingerprint alone: each part
-- of the plan is set by the first producer that finds it missing, then checked.
local fp = redis.call('HGET', KEYS[1], 'fingerprint')
if not fp then
  redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2])
elseif fp ~= ARGV[2] then
  return {'MISMATCH', 'fingerprint', fp}
end
local hwm = redis.call('HGET', KEYS[1], 'hwm')
if not hwm then
  redis.call('HSET', KEYS[1], 'hwm', ARGV[3], 'shards', ARGV[4], 'window', ARGV[5],
    'epoch_batches', ARGV[10])
elseif hwm ~= ARGV[3] then
  return {'MISMATCH', 'hwm', hwm}
end

-- Leases this producer id still holds from an earlier life go back to the front of the
-- work list when they belong to this run; leases of an older run are simply dropped.
local held = redis.call('LRANGE', KEYS[4], 0, -1)
if ARGV[11] == run then
  for i = #held, 1, -1 do
    local g = string.match(held[i], '^(%d+):')
    if g then redis.call('LPUSH', KEYS[5], g) end
  end
end
redis.call('DEL', KEYS[4])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[8]), ARGV[1])
local m = redis.call('HMGET', KEYS[1], 'hwm', 'shards', 'window', 'world')
if m[4] then return {'OK', inc, run, m[1], m[2], m[3], created, tonumber(m[4])} end
return {'OK', inc, run, m[1], m[2], m[3], created}
