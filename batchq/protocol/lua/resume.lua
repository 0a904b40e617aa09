-- resume.lua: a trainer restarts the plan from its ledger (a checkpoint, or what it had
-- received when Redis lost the queue's state). A new run id makes every producer join
-- again and drop what it was building; the stale contents of the queue go.
-- The ranks of a job resume into one run: the first one creates it (every rank computes
-- the same run id), the others join it and add their ledgers; a rank whose step differs
-- is refused.
-- Returns {'OK', run} or {'CLAIM_LOST'}, {'STEP', the run's step}, {'GROUPS'} (a run read
-- by several groups: gresume.lua's)
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING (kept for the key layout)
local data_key = KEYS[3]         -- LIST
local work_key = KEYS[4]         -- LIST   shards handed back
local failures_key = KEYS[5]     -- HASH
local ledger_key = KEYS[6]       -- HASH   '<epoch>:<slot>' -> 'd' or batches had
local wake_key = KEYS[7]         -- LIST
-- KEYS[8..]: (data-parallel) every rank's data list, this rank's first, then the counts
-- hash and the remap hash (slot -> shard), last
local token = ARGV[1]            -- the trainer's claim token
local new_run = ARGV[2]
local first = ARGV[3]            -- first shard to mint (e * S; a rank: e * P, its count)
local fingerprint = ARGV[4]
local hwm = ARGV[5]              -- '' to let the first producer set the plan's figures
local shards = ARGV[6]           -- S
local window = ARGV[7]
local epoch_batches = ARGV[8]
local rank = ARGV[9]
local world = tonumber(ARGV[10])
local even = ARGV[11]            -- 'pad' | 'drop'
local step = ARGV[12]            -- the batches yielded at the checkpoint; -1 after Redis
                                 -- lost the queue's state (each rank recovers its own)
local held = ARGV[13]            -- '1' if this rank held the new run already (the job
                                 -- resumes again): with the run's step its counters
                                 -- start again at `first`, with another step the run
                                 -- starts again from this checkpoint
local remap_epoch = ARGV[14]     -- the epoch whose slots are remapped ('' for none: a job
                                 -- resumed with another number of ranks,
                                 -- consumer/rank_state.py)
local remapped = tonumber(ARGV[15] or '0')  -- the number m of remapped slots
local wake_cap = tonumber(ARGV[16])  -- the wake list's length cap
-- ARGV[17..]: m slot, shard pairs (into the remap hash), then the ledger pairs
-- '<epoch>:<slot>', 'd' or batches already had
local first_rank_data, first_pair = 8, 17

local sfx = ''
if world > 1 then sfx = ':' .. rank end
local m = redis.call('HMGET', meta_key, 'claim' .. sfx, 'run', 'resume_step')
if m[1] ~= token then return {'CLAIM_LOST'} end
-- A run read by several groups is gresume.lua's (batchq/protocol/groups.py).
if redis.call('HGET', meta_key, 'groups') then return {'GROUPS'} end

local function add_pairs()
  for i = first_pair + 2 * remapped, #ARGV, 2 do
    redis.call('HSET', ledger_key, ARGV[i], ARGV[i + 1])
  end
  if remap_epoch ~= '' and remapped > 0 then
    for i = first_pair, first_pair - 1 + 2 * remapped, 2 do
      redis.call('HSET', KEYS[#KEYS], ARGV[i], ARGV[i + 1])
    end
    redis.call('HSET', meta_key, 'remap_epoch', remap_epoch)
  end
end

local again = held == '1' and m[3] ~= step  -- the job resumes another checkpoint
-- Step -1: not a checkpoint but Redis' lost state: each rank is where it is, so each
-- sets only its own counters (a rank's neighbours may be in another epoch).
local recovering = step == '-1'
if m[2] == new_run and not again then
  -- A retried resume whose first reply was lost, or another rank of the job resumed
  -- first: producers may have pushed frames of the new run already; keep them.
  if world > 1 and m[3] and m[3] ~= step then return {'STEP', m[3]} end
  if held == '1' then
    redis.call('HSET', meta_key, 'next' .. sfx, first, 'floor' .. sfx, first)
    if world > 1 then redis.call('DEL', KEYS[first_rank_data]) end
  elseif recovering then
    redis.call('HSET', meta_key, 'next' .. sfx, first, 'floor' .. sfx, first)
  end
  add_pairs()
  return {'OK', new_run}
end
redis.call('DEL', data_key, work_key, failures_key, ledger_key)
for i = first_rank_data, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('HDEL', meta_key, 'finished', 'finished_at', 'hwm', 'shards', 'window',
  'epoch_batches', 'world', 'even', 'resume_step', 'remap_epoch', 'shm_host', 'shm_lookahead')
redis.call('HSET', meta_key, 'run', new_run, 'next', first, 'floor', first,
  'fingerprint', fingerprint)
if world > 1 then
  redis.call('HSET', meta_key, 'world', world, 'even', even, 'resume_step', step)
  for r = 0, world - 1 do
    if not recovering or tostring(r) == rank then
      redis.call('HSET', meta_key, 'next:' .. r, first, 'floor:' .. r, first)
    end
    -- Ranks join the new run by resuming into it: none has held it yet, but this one.
    -- Each publishes its host again once resumed (the previous job's may be elsewhere).
    redis.call('HDEL', meta_key, 'done:' .. r, 'shm_host:' .. r, 'shm_lookahead:' .. r)
    if tostring(r) ~= rank then redis.call('HDEL', meta_key, 'claimed:' .. r) end
  end
end
if hwm ~= '' then
  redis.call('HSET', meta_key, 'hwm', hwm, 'shards', shards, 'window', window,
    'epoch_batches', epoch_batches)
end
add_pairs()
redis.call('LPUSH', wake_key, '1')
redis.call('LTRIM', wake_key, 0, wake_cap - 1)
return {'OK', new_run}
