-- join.lua: a producer joins the queue's run, creating the queue and the run if needed.
-- Returns {'OK', incarnation, run, hwm, S, window, created[, world[, groups]]} (JoinReply),
--   {'MISMATCH', what, expected}, {'FINISHED'}, {'WAIT'} (nothing to join yet)
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local producers_key = KEYS[3]    -- ZSET   producer -> heartbeat deadline (ms)
local lease_key = KEYS[4]        -- LIST   this producer's leases
local work_key = KEYS[5]         -- LIST   shards handed back
local data_key = KEYS[6]         -- LIST
local failures_key = KEYS[7]     -- HASH
local ledger_key = KEYS[8]       -- HASH
local stats_key = KEYS[9]        -- HASH   queue counters (the leases it hands back)
local wake_key = KEYS[10]        -- LIST   a trainer waiting for the plan blocks on it
local planwait_key = KEYS[11]    -- SET    len() callers waiting for the plan, unclaimed
local producer = ARGV[1]
local fingerprint = ARGV[2]      -- the pipeline's
local hwm = ARGV[3]
local shards = ARGV[4]           -- shards per epoch (S)
local window = ARGV[5]           -- look-ahead window (shards)
local new_run = ARGV[6]          -- run id to use if a run must be created
local new_incarnation = ARGV[7]  -- incarnation to use if the queue must be created
local heartbeat_ttl_ms = tonumber(ARGV[8])
local version = ARGV[9]          -- protocol version
local epoch_batches = ARGV[10]   -- batches per epoch (-1 if the pipeline cannot tell)
local age_ms = tonumber(ARGV[11])    -- how long ago this producer's job started
local no_create = ARGV[12]       -- '1': wait for the trainer to re-create a lost queue
local shard_batches = ARGV[13]   -- batches per full shard (ranks.py), 0 if not countable
local stripes = ARGV[14]         -- the queues the run is striped over (stripes.py)

local now = server_now_ms()
local inc = redis.call('GET', incarnation_key)
local run = redis.call('HGET', meta_key, 'run')
if no_create == '1' and not (inc and run) then return {'WAIT'} end
-- (A meta left without its incarnation is no run's: its finished_at is not read.)
local finished_at = inc and tonumber(redis.call('HGET', meta_key, 'finished_at') or '')
-- A run that finished after this producer's job started was that job's: the producer is
-- a late replica of it (FINISHED). One that finished before was an earlier job's: this
-- producer starts the queue's next run.
if finished_at and now - age_ms < finished_at then return {'FINISHED'} end
local created = 0
if not (inc and run) or finished_at then
  -- No queue or run yet, or the last one finished: this producer starts the next run.
  if not inc then
    inc = new_incarnation
    redis.call('SET', incarnation_key, inc)
  end
  redis.call('DEL', meta_key, work_key, data_key, failures_key, ledger_key)
  run = new_run
  redis.call('HSET', meta_key, 'version', version, 'run', run, 'next', 0, 'floor', 0)
  created = 1
end

-- Whether this join publishes the plan (no producer had): see the wake-up below.
local publishes = not redis.call('HGET', meta_key, 'shards')

-- A trainer resuming from a checkpoint may have set the fingerprint alone: each part
-- of the plan is set (with the figures that go with it) by the first producer that finds
-- it missing, then checked: the MISMATCH reply, or nil. The protocol version first: a
-- producer of another batchq version is refused before it writes anything (a run that
-- a resume made has none: its first producer sets it).
local function set_or_check(field, value, ...)
  local have = redis.call('HGET', meta_key, field)
  if not have then redis.call('HSET', meta_key, field, value, ...) end
  if have and have ~= value then return {'MISMATCH', field, have} end
  return nil
end
local refused = set_or_check('version', version) or set_or_check('fingerprint', fingerprint) or
  set_or_check('hwm', hwm, 'shards', shards, 'window', window, 'epoch_batches', epoch_batches,
    'shard_batches', shard_batches)
if refused then return refused end
-- A resume re-created the plan's figures without it (the same pipeline: the same B).
if not redis.call('HGET', meta_key, 'shard_batches') then
  redis.call('HSET', meta_key, 'shard_batches', shard_batches)
end
refused = set_or_check('stripes', stripes)
if refused then return refused end

-- The plan published: the ranks of the trainer that claimed the run before any producer
-- joined wait for it, blocked on the wake list (consumer/plan.py wait_for_plan); without
-- a token each would find it only when its bounded wait ends. One token per rank of
-- every group slot holding a claim (every group's ranks watch the run's wake list) and
-- per len() caller in the waiters' set (none where no trainer came yet: producers
-- started first); through pcall, as pop.lua's tokens: a foreign type under either key
-- fails no join.
if publishes then
  local fields = {}
  for g = 0, math.max(tonumber(redis.call('HGET', meta_key, 'groups') or '1'), 1) - 1 do
    local world = slot_world(meta_key, g)
    for r = 0, world - 1 do fields[#fields + 1] = 'claim' .. reader_sfx(g, r, world) end
  end
  local waiting = redis.pcall('SCARD', planwait_key)
  local tokens = type(waiting) == 'number' and waiting or 0
  for _, holder in ipairs(redis.call('HMGET', meta_key, unpack(fields))) do
    if holder then tokens = tokens + 1 end
  end
  for _ = 1, tokens do redis.pcall('LPUSH', wake_key, '1') end
  redis.call('DEL', planwait_key)
end

-- Leases this producer id holds from an earlier life: this run's back to work, an older
-- run's dropped, counted as a reap counts them.
hand_back_leases(lease_key, work_key, run, nil, stats_key)
redis.call('ZADD', producers_key, now + heartbeat_ttl_ms, producer)
local m = redis.call('HMGET', meta_key, 'hwm', 'shards', 'window', 'world', 'groups')
-- World and group slots only where the run has them (batchq/protocol/groups.py).
local reply = {'OK', inc, run, m[1], m[2], m[3], created}
if m[4] or m[5] then reply[8] = tonumber(m[4] or '1') end
if m[5] then reply[9] = tonumber(m[5]) end
return reply
